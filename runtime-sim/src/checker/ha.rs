//! Invariant 9, agent HA: a replica on two kas is served by a live kas at every moment,
//! and a call for it fails only where a kas it used went away.

use super::silent::SILENT_AFTER;
use crate::truth::{Delivery, Homes};
use crate::workload::Call;
use std::collections::BTreeSet;
use std::time::Duration;
use tokio::time::Instant;

/// A kas stopping (from its SIGTERM) or down (from its kill), until it listens again.
#[derive(Clone, Copy, Debug)]
pub struct Outage {
    /// The kas.
    pub kas: usize,
    /// From its SIGTERM or kill.
    pub from: Instant,
    /// Until it listens again after its restart.
    pub to: Instant,
    /// Killed (SIGKILL) at `from`, rather than stopped gracefully.
    pub killed: bool,
}

/// A link from a kas that went half-open at `from` (one way drops everything, with no
/// reset): a call that may have gone down it meanwhile may fail, until `to`, by when the
/// link must have been given up and calls go elsewhere.
#[derive(Clone, Copy, Debug)]
pub struct HalfOpen {
    /// The kas.
    pub kas: usize,
    /// Where the link goes.
    pub to_whom: Far,
    /// When the link went half-open.
    pub from: Instant,
    /// The bound for giving it up.
    pub to: Instant,
}

/// The far end of a [`HalfOpen`] link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Far {
    /// A replica of this agent.
    Agent(i64),
    /// Another kas.
    Kas(usize),
}

impl HalfOpen {
    /// True when `c` was under way while the link was half-open and not yet due to be
    /// given up, and may have gone down it: a call for the agent, or one that entered
    /// either kas.
    fn may_fail(&self, c: &Call) -> bool {
        let down_it = match self.to_whom {
            Far::Agent(agent) => agent == c.agent,
            Far::Kas(other) => c.kas == self.kas || c.kas == other,
        };
        down_it && c.started <= self.to && self.from <= c.started + c.took
    }
}

/// A call issued this shortly before its kas's SIGTERM may reach kas after it: refused
/// there, not delivered (as HTTP/2's `REFUSED_STREAM` after a `GOAWAY`).
const ENTERING: Duration = Duration::from_millis(100);

/// The changes of where replica `replica` of `agent` was served, in time order.
fn moves(homes: &[Homes], agent: i64, replica: usize) -> impl Iterator<Item = &Homes> {
    homes
        .iter()
        .filter(move |h| h.agent == agent && h.replica == replica)
}

/// The kas serving replica `replica` of `agent` at `at`, by `homes` (in time order), each
/// with when its connection came up.
fn serving_at(homes: &[Homes], agent: i64, replica: usize, at: Instant) -> Vec<(usize, Instant)> {
    let mut since: Vec<(usize, Instant)> = Vec::new();
    for h in moves(homes, agent, replica).take_while(|h| h.at <= at) {
        since.retain(|(k, _)| h.kas.contains(k));
        for &k in &h.kas {
            if !since.iter().any(|(s, _)| *s == k) {
                since.push((k, h.at));
            }
        }
    }
    since
}

/// Whether kas `kas` served some replica of `agent` at `at`.
fn serves(homes: &[Homes], agent: i64, kas: usize, at: Instant) -> bool {
    let replicas: BTreeSet<usize> = homes
        .iter()
        .filter(|h| h.agent == agent)
        .map(|h| h.replica)
        .collect();
    replicas.into_iter().any(|r| {
        serving_at(homes, agent, r, at)
            .iter()
            .any(|(k, _)| *k == kas)
    })
}

/// Violations of invariant 9 by where the replicas of `agents` were served until `until`:
/// from the moment a replica is first served by two kas, it must hold a connection to a
/// live kas at every moment: one that came up after that kas last (re)started and before
/// it next went away (a killed kas's connections die with it, although the replica may
/// notice only later). Excused: a gap from giving up links that were all cut
/// (`cuts`, as when the replica froze), up to [`SILENT_AFTER`] after they healed.
pub fn check_available(
    homes: &[Homes],
    agents: &[i64],
    outages: &[Outage],
    cuts: &[HalfOpen],
    until: Instant,
) -> Vec<String> {
    let replicas: BTreeSet<(i64, usize)> = homes
        .iter()
        .filter(|h| agents.contains(&h.agent))
        .map(|h| (h.agent, h.replica))
        .collect();
    let mut violations = Vec::new();
    for (agent, replica) in replicas {
        let Some(homed) = moves(homes, agent, replica)
            .find(|h| h.kas.len() >= 2)
            .map(|h| h.at)
        else {
            violations.push(format!(
                "inv 9: agent {agent} replica {replica} was never served by two kas"
            ));
            continue;
        };
        // Where the answer may change: the replica's moves, and kas going away.
        let mut moments: BTreeSet<Instant> = moves(homes, agent, replica)
            .map(|h| h.at)
            .chain(outages.iter().map(|o| o.from))
            .filter(|&t| homed <= t && t < until)
            .collect();
        moments.insert(until);
        let mut gap: Option<Instant> = None;
        let mut before: Vec<(usize, Instant)> = Vec::new();
        for at in moments {
            let serving = serving_at(homes, agent, replica, at);
            let live = serving.iter().any(|&(k, up)| {
                !outages
                    .iter()
                    .any(|o| o.kas == k && up <= o.from && o.from <= at)
            });
            let cut_off = !before.is_empty()
                && before.iter().all(|&(k, _)| {
                    cuts.iter().any(|c| {
                        c.kas == k
                            && c.to_whom == Far::Agent(agent)
                            && c.from <= at
                            && at <= c.to + SILENT_AFTER
                    })
                });
            before = serving;
            match (gap, live || at == until) {
                (None, false) if cut_off => {}
                (None, false) => gap = Some(at),
                (Some(from), true) => {
                    violations.push(format!(
                        "inv 9: agent {agent} replica {replica}, on two kas since {homed:?}, had no connection to a live kas for {:?} from {from:?} (where it was served: {:?}; kas away: {outages:?})",
                        at - from,
                        moves(homes, agent, replica).map(|h| (h.at, &h.kas)).collect::<Vec<_>>()
                    ));
                    gap = None;
                }
                _ => {}
            }
        }
    }
    violations
}

/// Violations of invariant 9 by `calls` for `agents` (each on two kas) issued after `from`
/// with a timeout of at least `timeout`, given the kas `outages`, what agents received and
/// where they were served. A call that failed is excused if it entered a kas that was
/// stopping or down (or went down with the call in it), if a kas serving its agent
/// was killed while it was under way (it may have been on that kas), or if it was under
/// way while a link to its agent was half-open and not yet due to be given up (`cuts`).
#[allow(clippy::too_many_arguments)] // one judgement over every record of the run
pub fn check_reachable(
    calls: &[Call],
    truth: &[Delivery],
    homes: &[Homes],
    agents: &[i64],
    outages: &[Outage],
    cuts: &[HalfOpen],
    from: Instant,
    timeout: Duration,
) -> Vec<String> {
    let delivered: BTreeSet<&str> = truth.iter().map(|d| d.marker.as_str()).collect();
    let excused = |c: &Call| {
        let end = c.started + c.took;
        let refused = !delivered.contains(c.marker.as_str());
        let cut = cuts.iter().any(|h| h.may_fail(c));
        cut || outages.iter().any(|o| {
            let entering = o.from <= c.started || (refused && o.from <= c.started + ENTERING);
            let entered_away = o.kas == c.kas && entering && c.started <= o.to;
            let killed_meanwhile = o.killed && c.started <= o.from && o.from <= end;
            let on_it = o.kas == c.kas || serves(homes, c.agent, o.kas, o.from);
            entered_away || (killed_meanwhile && on_it)
        })
    };
    calls
        .iter()
        .filter(|c| c.started >= from && c.timeout >= timeout && agents.contains(&c.agent))
        .filter(|c| !excused(c))
        .filter_map(|c| {
            let (code, msg) = c.result.as_ref().err()?;
            Some(format!(
                "inv 9: {} (timeout {:?}, at {:?} for {:?}) through kas{} for agent {}, which is on two kas, failed: {code:?} {msg} (kas away: {outages:?})",
                c.marker, c.timeout, c.started - from, c.took, c.kas, c.agent
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn home(replica: usize, kas: &[usize], at: Instant) -> Homes {
        Homes {
            agent: 1,
            replica,
            kas: kas.to_vec(),
            at,
        }
    }

    fn outage(kas: usize, from: Instant, to: Instant, killed: bool) -> Outage {
        Outage {
            kas,
            from,
            to,
            killed,
        }
    }

    #[madsim::test]
    async fn a_replica_left_without_a_live_kas_is_reported_and_one_that_moved_first_is_not() {
        let t0 = Instant::now();
        let s = |n: u64| t0 + Duration::from_secs(n);
        // On kas 0 and 1; kas 0 stops at 3 s (the replica moves to kas 2 at once, make
        // before break) and listens again at 5 s.
        let moved = [
            home(0, &[0, 1], s(1)),
            home(0, &[1], s(3)),
            home(0, &[1, 2], s(4)),
        ];
        let stop = outage(0, s(3), s(5), false);
        assert!(check_available(&moved, &[1], &[stop], &[], s(10)).is_empty());
        // Killed at 3 s while the replica held kas 0 alone since 2 s: a gap until it is
        // served again at 4 s, although it noticed the death only at 6 s.
        let alone = [
            home(0, &[0, 1], s(1)),
            home(0, &[0], s(2)),
            home(0, &[0, 2], s(4)),
            home(0, &[2], s(6)),
        ];
        let kill = outage(0, s(3), s(5), true);
        let gap = check_available(&alone, &[1], &[kill], &[], s(10));
        assert_eq!(gap.len(), 1, "{gap:?}");
        assert!(
            gap[0].contains("no connection to a live kas for 1s"),
            "{gap:?}"
        );
        // A connection that came up after kas 0 restarted counts, though its outage
        // (which runs until kas 0 is surely listening) has not ended.
        let back = [
            home(0, &[0, 1], s(1)),
            home(0, &[0], s(2)),
            home(0, &[0], s(4)),
        ];
        let early = outage(0, s(3), s(5), true);
        assert_eq!(check_available(&back, &[1], &[early], &[], s(10)).len(), 1);
        let back = [
            home(0, &[0, 1], s(1)),
            home(0, &[1], s(2)),
            home(0, &[1, 0], s(4)),
        ];
        assert!(check_available(&back, &[1], &[early], &[], s(10)).is_empty());
        let never = check_available(&[home(0, &[0], s(1))], &[1], &[], &[], s(10));
        assert!(never[0].contains("never served by two kas"), "{never:?}");
    }

    #[madsim::test]
    async fn a_gap_is_excused_only_when_every_link_the_replica_gave_up_was_cut() {
        let t0 = Instant::now();
        let s = |n: u64| t0 + Duration::from_secs(n);
        // Frozen from 2 s to 6 s; on waking at 6 s it gives both links up, back at 7 s.
        let woke = [
            home(0, &[0, 1], s(1)),
            home(0, &[], s(6)),
            home(0, &[0, 1], s(7)),
        ];
        let cut = |kas: usize| HalfOpen {
            kas,
            to_whom: Far::Agent(1),
            from: s(2),
            to: s(6),
        };
        assert!(check_available(&woke, &[1], &[], &[cut(0), cut(1)], s(10)).is_empty());
        // One link cut: the other was still there to keep.
        assert_eq!(check_available(&woke, &[1], &[], &[cut(0)], s(10)).len(), 1);
        // Another agent's cuts excuse nothing.
        let other = |kas| HalfOpen {
            to_whom: Far::Agent(2),
            ..cut(kas)
        };
        assert_eq!(
            check_available(&woke, &[1], &[], &[other(0), other(1)], s(10)).len(),
            1
        );
    }

    #[madsim::test]
    async fn a_call_cut_by_a_kill_is_excused_only_if_the_killed_kas_served_its_agent() {
        let t0 = Instant::now();
        let s = |n: u64| t0 + Duration::from_secs(n);
        let call = Call {
            timeout: Duration::from_secs(2),
            took: Duration::from_secs(2),
            result: Err((tonic::Code::Unavailable, "cut".into())),
            ..Call::sample("c1", 2, 1, s(2))
        };
        let kill = outage(0, s(3), s(5), true);
        let judge = |homes: &[Homes]| {
            check_reachable(
                std::slice::from_ref(&call),
                &[],
                homes,
                &[1],
                &[kill],
                &[],
                t0,
                call.timeout,
            )
        };
        assert!(judge(&[home(0, &[0, 1], s(1))]).is_empty());
        let failed = judge(&[home(0, &[1, 2], s(1))]);
        assert!(failed[0].starts_with("inv 9"), "{failed:?}");
    }

    #[madsim::test]
    async fn a_call_is_excused_by_a_half_open_link_to_its_agent_only_until_the_bound() {
        let t0 = Instant::now();
        let s = |n: u64| t0 + Duration::from_secs(n);
        let call = |agent: i64, started: u64| Call {
            timeout: Duration::from_secs(2),
            took: Duration::from_secs(2),
            result: Err((tonic::Code::DeadlineExceeded, "lost".into())),
            ..Call::sample(&format!("c{agent}-{started}"), 0, agent, s(started))
        };
        // Agent 1's link to kas 0 half-open from 4 s, to be given up by 8 s.
        let cut = HalfOpen {
            kas: 0,
            to_whom: Far::Agent(1),
            from: s(4),
            to: s(8),
        };
        let calls = [call(1, 3), call(1, 7), call(1, 9), call(2, 5), call(1, 1)];
        let homes = [home(0, &[0, 1], s(0))];
        let failed = check_reachable(&calls, &[], &homes, &[1, 2], &[], &[cut], t0, s(2) - t0);
        let markers: Vec<&str> = failed
            .iter()
            .map(|f| f.split_whitespace().nth(2).unwrap_or(""))
            .collect();
        // Under way at 4 s (3 s + 2 s) and 7 s: excused; after the bound, another agent's,
        // or over before the cut: not.
        assert_eq!(markers, ["c1-9", "c2-5", "c1-1"], "{failed:?}");
        // The link between kas 0 and kas 2 instead: any agent's call through kas 0 is
        // excused while it may have gone down it, none through kas 1.
        let between = HalfOpen {
            to_whom: Far::Kas(2),
            ..cut
        };
        let through_1 = Call {
            kas: 1,
            marker: "k1-5".into(),
            ..call(2, 5)
        };
        let calls = [call(1, 7), call(2, 5), call(2, 9), through_1];
        let failed = check_reachable(&calls, &[], &homes, &[1, 2], &[], &[between], t0, s(2) - t0);
        let markers: Vec<&str> = failed
            .iter()
            .map(|f| f.split_whitespace().nth(2).unwrap_or(""))
            .collect();
        assert_eq!(markers, ["c2-9", "k1-5"], "{failed:?}");
    }
}
