//! The invariant checker: compares what callers saw with what agents saw (the ground
//! truth) and with the cluster's state after the faults have healed.
//!
//! The invariants of docs/invariants.md, as checked here:
//! 1. a call is delivered only to the agent it names (and the replica, if it named one);
//! 2. every call has an outcome by its deadline (plus a bound, plus any time jump), and
//!    kas lets go of an agent that never answers by then (plus its grace);
//! 3. at most once: no call is delivered twice, and no call kas answered `Unavailable`
//!    (not delivered: GitLab's client sends it again) was delivered;
//! 4. at most one kas -> kas hop (kas metrics: hop labels, and no more routed calls
//!    counted than GitLab made);
//! 5. in a run without faults, every call for a connected agent is answered (timeouts of
//!    2 s and more);
//! 5. and 7. after faults heal, every kas routes to every live agent and lists exactly the
//!    live replicas, and calls waiting for an agent that connects are delivered (the final
//!    phase, in `scenario`);
//! 6. nothing leaks: once agents are gone and records expire, no tunnel, call, connection
//!    or Redis record is left;
//! 8. a two-way call that ends OK carried every request piece to the agent and every
//!    answer piece back, in order (the echo equals what was sent);
//! 9. with agent HA (agents on two kas at once), every replica is served by a live kas
//!    at every moment once it is homed, and no call for it fails because a kas went away:
//!    only a call that entered a kas already stopping or down (GitLab's to retry: nothing
//!    was delivered), or that was under way when a kas serving its agent was killed (it
//!    may have been on that kas), may fail (`ha`);
//! 11. a token GitLab revokes stops being served within a bound (`revoked`);
//! 17. each kas's audit log records the Kubernetes API requests answered through it
//!     (`audit`).
//!
//! Invariant 15 (a tunnel record that becomes live is announced) is judged by the
//! simulated Redis itself (`redis::announced`).

mod audit;
mod ha;
mod revoked;
mod silent;

pub use audit::check_audit;
pub use ha::{Far, HalfOpen, Outage, check_available, check_reachable};
pub use revoked::{REVOKE_BOUND, Revocation, check_revoked};
pub use silent::check_silences;

use crate::bounds::{OUTCOME_BOUND, SLACK, STREAM_BOUND};
use crate::cluster::AgentSpec;
use crate::truth::{Delivery, Hold, pod_name};
use crate::workload::Call;
use kas_server::kas::timing::TUNNEL_GRACE;
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::time::Instant;

/// Violations of invariants 1, 2, 3 and 8 by `calls`, given `truth`; `absent` agents never
/// connect; `stalls` are the times the world or one kas stood still; `outages` the times a
/// kas was stopped or killed.
pub fn check_calls(
    calls: &[Call],
    truth: &[Delivery],
    absent: &[i64],
    stalls: &[Stall],
    outages: &[Outage],
) -> Vec<String> {
    let mut violations = Vec::new();
    let mut delivered: BTreeMap<&str, Vec<&Delivery>> = BTreeMap::new();
    for d in truth {
        delivered.entry(d.marker.as_str()).or_default().push(d);
    }
    for c in calls {
        let got = delivered
            .get(c.marker.as_str())
            .cloned()
            .unwrap_or_default();
        if got.len() > 1 {
            violations.push(format!(
                "inv 3: {} delivered {} times: {got:?}",
                c.marker,
                got.len()
            ));
        }
        if let (Err((tonic::Code::Unavailable, msg)), Some(d)) = (&c.result, got.first())
            && !broke_under(c, msg, outages)
        {
            violations.push(format!(
                "inv 3: {} ended Unavailable, which tells GitLab it was not delivered ({msg}), but agent {} replica {} had it",
                c.marker, d.agent, d.replica
            ));
        }
        for d in &got {
            if d.agent != c.agent || c.replica.is_some_and(|r| r != d.replica) {
                violations.push(format!(
                    "inv 1: {} for agent {} (replica {:?}) delivered to agent {} replica {}",
                    c.marker, c.agent, c.replica, d.agent, d.replica
                ));
            }
        }
        match (&c.result, &c.echo_mismatch) {
            // The correlation id is wrong whatever the outcome (see `kube_caller`).
            (_, Some(m)) if m.starts_with("inv 14") => {
                violations.push(format!("{m} ({})", c.marker));
            }
            (Ok(_), Some(m)) => violations.push(format!(
                "inv 8: two-way {} ended OK with a wrong echo: {m}",
                c.marker
            )),
            _ => {}
        }
        let stalled = stalled(stalls, Some(c.kas), c.started, c.started + c.took);
        // A delivered two-way call is not bounded by its deadline: by its ends, and by
        // HTTP/2 keepalive on a dead link under it.
        let bound = if c.two_way {
            STREAM_BOUND
        } else {
            OUTCOME_BOUND
        };
        if c.took > c.timeout + bound + stalled {
            violations.push(format!(
                "inv 2: {} (kas{}, agent {}, timeout {:?}) ended after {:?}: {:?}",
                c.marker, c.kas, c.agent, c.timeout, c.took, c.result
            ));
        }
        match &c.result {
            Ok(pod) if absent.contains(&c.agent) => violations.push(format!(
                "inv 1: {} for absent agent {} answered by {pod}",
                c.marker, c.agent
            )),
            Ok(pod) => {
                let from_truth = got.first().map(|d| pod_name(d.agent, d.replica));
                if from_truth.as_deref() != Some(pod.as_str()) {
                    violations.push(format!(
                        "inv 1: {} answered by {pod}, but the agents recorded {from_truth:?}",
                        c.marker
                    ));
                }
            }
            Err(_) => {}
        }
    }
    violations
}

/// Whether `call` failed with `msg` because the kas it called went away under it: madsim's
/// gRPC says `Unavailable` ("connection reset", from the I/O error) for the caller's own
/// connection breaking, where tonic over HTTP/2 says `Unknown`. That is the caller's
/// guess, not kas's word that nothing was delivered (kas itself never passes on a broken
/// connection's status as `Unavailable`: see `kas::forward`).
fn broke_under(call: &Call, msg: &str, outages: &[Outage]) -> bool {
    let end = call.started + call.took;
    msg == "connection reset"
        && outages
            .iter()
            .any(|o| o.kas == call.kas && o.from <= end && o.to >= call.started)
}

/// Violations of liveness in a run without faults: a call with a timeout of `timeout` or
/// more for one of `agents` (all connected from the start) failed.
pub fn check_fault_free(calls: &[Call], agents: &[AgentSpec], timeout: Duration) -> Vec<String> {
    calls
        .iter()
        .filter(|c| c.timeout >= timeout && agents.iter().any(|a| a.agent == c.agent))
        .filter_map(|c| {
            let (code, msg) = c.result.as_ref().err()?;
            Some(format!(
                "inv 5: in a run without faults, {} (timeout {:?}) for connected agent {} through kas{} failed after {:?}: {code:?} {msg}",
                c.marker, c.timeout, c.agent, c.kas, c.took
            ))
        })
        .collect()
}

/// Violations of invariant 5 by the calls made through every kas to every agent once the
/// faults have healed: each must be answered.
pub fn check_healed_calls(calls: &[Call]) -> Vec<String> {
    calls
        .iter()
        .filter_map(|c| {
            let (code, msg) = c.result.as_ref().err()?;
            Some(format!(
                "inv 5: after healing, kas{} could not reach agent {}: {code:?} {msg}",
                c.kas, c.agent
            ))
        })
        .collect()
}

/// What a kas listed for an agent after healing: (kas, agent, its replicas' pods).
pub type Listed = (usize, i64, Result<Vec<String>, String>);

/// Violations of invariant 7 by the listings after healing: each kas lists exactly the
/// live replicas of each of `agents`.
pub fn check_listed(listed: &[Listed], agents: &[AgentSpec]) -> Vec<String> {
    let mut violations = Vec::new();
    for (k, agent, pods) in listed {
        let replicas = agents
            .iter()
            .find(|a| a.agent == *agent)
            .map_or(0, |a| a.replicas.len());
        let expected: Vec<String> = (0..replicas).map(|r| pod_name(*agent, r)).collect();
        match pods {
            Ok(p) if *p == expected => {}
            other => violations.push(format!(
                "inv 7: after healing, kas{k} lists agent {agent} as {other:?}, expected {expected:?}"
            )),
        }
    }
    violations
}

/// Invariant 7's wake-ups: every call in `waited` (one through each kas, for `agent`, which
/// connected to `live_kas` meanwhile; its tunnel was announced at `registered`) must be
/// delivered. Returns how long after the announcement each call through another kas
/// reached the agent, and the violations.
pub fn check_woken(
    waited: &[Call],
    truth: &[Delivery],
    registered: Option<Instant>,
    agent: i64,
    live_kas: usize,
) -> (Vec<Duration>, Vec<String>) {
    let (mut wakeups, mut violations) = (Vec::new(), Vec::new());
    for c in waited {
        match (&c.result, registered) {
            (Ok(_), Some(at)) if c.kas != live_kas => {
                if let Some(d) = truth.iter().find(|d| d.marker == c.marker) {
                    wakeups.push(d.at.saturating_duration_since(at));
                }
            }
            (Ok(_), _) => {}
            (Err((code, msg)), _) => violations.push(format!(
                "inv 7: kas{}'s call waiting for agent {agent}, which connected to kas{live_kas} meanwhile, ended {code:?} {msg}",
                c.kas
            )),
        }
    }
    (wakeups, violations)
}

/// The gauges that must read zero once every agent is gone: what a kas holds, and its
/// driver's mistakes since its last start (the node's machines never disagreed, and the
/// engine never fed it an input it refused).
const ZERO_AT_THE_END: [&str; 7] = [
    "kas_tunnels",
    "kas_calls",
    "kas_connected_agents",
    "kas_routing_calls",
    "kas_tunnel_waiters",
    "kas_pubsub_subscriptions",
    "kas_driver_mistakes_total",
];

/// Violations of invariant 6 by kas `kas`'s `metrics` at the end: nothing held.
pub fn check_gauges_zero(kas: usize, metrics: &str) -> Vec<String> {
    ZERO_AT_THE_END
        .iter()
        .filter_map(
            |gauge| match kas_server::kas::observability::gauge(metrics, gauge) {
                Some(0.0) => None,
                other => Some(format!("inv 6: kas{kas} {gauge} = {other:?} at the end")),
            },
        )
        .collect()
}

/// Violations of invariant 6 by what Redis holds at the end: no agent's or project's
/// record.
pub fn check_records_left(entries: &BTreeMap<String, Vec<(String, Vec<u8>)>>) -> Vec<String> {
    entries
        .iter()
        .filter(|(key, _)| key.contains("agent:") || key.contains("project:"))
        .map(|(key, fields)| {
            let names: Vec<&String> = fields.iter().map(|(f, _)| f).collect();
            format!("inv 6: Redis still holds {key} {names:?}")
        })
        .collect()
}

/// A time the world (`kas: None`: the clock jumped, as for a paused VM) or one kas (cut
/// off from everything, callers included) stood still.
#[derive(Clone, Copy, Debug)]
pub struct Stall {
    /// The kas cut off, or `None` for everything.
    pub kas: Option<usize>,
    /// When it began.
    pub at: Instant,
    /// How long it lasted.
    pub lasting: Duration,
}

/// How long, between `from` and `to`, the world or kas `kas` stood still.
fn stalled(stalls: &[Stall], kas: Option<usize>, from: Instant, to: Instant) -> Duration {
    stalls
        .iter()
        .filter(|s| s.kas.is_none() || s.kas == kas)
        .map(|s| {
            let (start, end) = (s.at.max(from), (s.at + s.lasting).min(to));
            end.saturating_duration_since(start)
        })
        .sum()
}

/// Violations of invariant 2 on kas's side: a tunnel whose agent never answered must be
/// let go [`TUNNEL_GRACE`] after the call's deadline (the caller's timeout at the latest);
/// one still held counts until now.
pub fn check_holds(calls: &[Call], holds: &[Hold], stalls: &[Stall]) -> Vec<String> {
    let mut violations = Vec::new();
    for h in holds {
        let Some(c) = calls.iter().find(|c| c.marker == h.marker) else {
            continue;
        };
        let until = h.until.unwrap_or_else(Instant::now);
        let held = until.saturating_duration_since(c.started);
        let bound = c.timeout + TUNNEL_GRACE + SLACK + stalled(stalls, None, c.started, until);
        if held > bound {
            violations.push(format!(
                "inv 2: {} (timeout {:?}) held its unanswered tunnel for {held:?}",
                c.marker, c.timeout
            ));
        }
    }
    violations
}

/// Violations of invariant 4: routed calls with more than one hop.
pub fn check_hops(kas: usize, metrics: &str) -> Vec<String> {
    metrics
        .lines()
        .filter(|l| l.starts_with("kas_routed_requests_total{"))
        .filter(|l| !l.contains("hops=\"0\"") && !l.contains("hops=\"1\""))
        .map(|l| format!("inv 4: kas{kas}: {l}"))
        .collect()
}

/// Calls from GitLab that kas `metrics` counts as routed (all outcomes and hops).
pub fn routed(metrics: &str) -> f64 {
    total(metrics, "kas_routed_requests_total")
}

/// The sum of counter `family` over all its labels in `metrics`.
pub fn total(metrics: &str, family: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| {
            l.strip_prefix(family)
                .is_some_and(|rest| rest.starts_with(['{', ' ']))
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// Violations of invariant 4 over the cluster: a kas that routed a forwarded call on
/// counts it a second time, so the kas together count more calls than GitLab made
/// (`routed` may count fewer: a restarted kas starts from zero).
pub fn check_routed(routed: f64, issued: usize) -> Vec<String> {
    if routed > issued as f64 {
        vec![format!(
            "inv 4: the kas counted {routed} routed calls, but GitLab made {issued}: some kas routed a forwarded call on"
        )]
    } else {
        Vec::new()
    }
}

/// Summary numbers of a run.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    /// Calls issued.
    pub requests: usize,
    /// Calls answered by an agent.
    pub delivered: usize,
    /// Failed calls by status code.
    pub errors: BTreeMap<String, usize>,
    /// Median and 99th percentile duration of answered calls.
    pub p50: Duration,
    /// See `p50`.
    pub p99: Duration,
    /// Median and 99th percentile wake-up latency: from a tunnel's registration to the
    /// delivery of a call that was waiting for it (the final phase's late agent).
    pub wakeup_p50: Duration,
    /// See `wakeup_p50`.
    pub wakeup_p99: Duration,
}

/// The `q` quantile of sorted `v` (zero when empty).
pub fn quantile(v: &[Duration], q: f64) -> Duration {
    v.get(((v.len() as f64 * q) as usize).min(v.len().saturating_sub(1)))
        .copied()
        .unwrap_or_default()
}

impl Stats {
    /// The numbers of `calls`, and of the wake-up latencies `wakeups`.
    pub fn of(calls: &[Call], mut wakeups: Vec<Duration>) -> Stats {
        let mut ok: Vec<Duration> = calls
            .iter()
            .filter(|c| c.result.is_ok())
            .map(|c| c.took)
            .collect();
        ok.sort();
        wakeups.sort();
        let mut errors = BTreeMap::new();
        for c in calls {
            if let Err((code, _)) = &c.result {
                *errors.entry(format!("{code:?}")).or_default() += 1;
            }
        }
        Stats {
            requests: calls.len(),
            delivered: ok.len(),
            errors,
            p50: quantile(&ok, 0.5),
            p99: quantile(&ok, 0.99),
            wakeup_p50: quantile(&wakeups, 0.5),
            wakeup_p99: quantile(&wakeups, 0.99),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(marker: &str, agent: i64, result: Result<&str, tonic::Code>) -> Call {
        Call {
            result: result.map(str::to_string).map_err(|c| (c, String::new())),
            ..Call::sample(marker, 0, agent, Instant::now())
        }
    }

    /// `calls` judged against `truth`, with no absent agent, stall or outage.
    fn checked(calls: &[Call], truth: &[Delivery]) -> Vec<String> {
        check_calls(calls, truth, &[], &[], &[])
    }

    fn delivery(marker: &str, agent: i64, replica: usize) -> Delivery {
        Delivery {
            marker: marker.into(),
            agent,
            replica,
            at: Instant::now(),
        }
    }

    #[madsim::test]
    async fn a_clean_history_has_no_violation() {
        let calls = [
            call("c1", 1, Ok("agent1-replica0")),
            call("c2", 9, Err(tonic::Code::Unavailable)),
        ];
        let truth = [delivery("c1", 1, 0)];
        assert!(check_calls(&calls, &truth, &[9], &[], &[]).is_empty());
    }

    #[madsim::test]
    async fn each_planted_bug_is_reported() {
        let wrong_agent = checked(
            &[call("c1", 1, Ok("agent2-replica0"))],
            &[delivery("c1", 2, 0)],
        );
        assert!(
            wrong_agent.iter().any(|v| v.starts_with("inv 1")),
            "{wrong_agent:?}"
        );
        let twice = checked(
            &[call("c1", 1, Ok("agent1-replica0"))],
            &[delivery("c1", 1, 0), delivery("c1", 1, 1)],
        );
        assert!(twice.iter().any(|v| v.starts_with("inv 3")), "{twice:?}");
        let resendable = checked(
            &[call("c1", 1, Err(tonic::Code::Unavailable))],
            &[delivery("c1", 1, 0)],
        );
        assert!(
            resendable.iter().any(|v| v.starts_with("inv 3")),
            "{resendable:?}"
        );
        let mut reset = call("c1", 1, Err(tonic::Code::Unavailable));
        reset.result = Err((tonic::Code::Unavailable, "connection reset".into()));
        let away = |kas| Outage {
            kas,
            from: reset.started,
            to: reset.started + Duration::from_secs(2),
            killed: true,
        };
        let delivered = [delivery("c1", 1, 0)];
        let calls = std::slice::from_ref(&reset);
        assert!(check_calls(calls, &delivered, &[], &[], &[away(0)]).is_empty());
        assert!(!check_calls(calls, &delivered, &[], &[], &[away(1)]).is_empty());
        let mut late = call("c1", 1, Err(tonic::Code::DeadlineExceeded));
        late.took = Duration::from_secs(6);
        let jump = Stall {
            kas: None,
            at: late.started + Duration::from_secs(1),
            lasting: Duration::from_secs(4),
        };
        assert!(check_calls(&[late.clone()], &[], &[], &[jump], &[]).is_empty());
        let elsewhere = Stall {
            kas: Some(1),
            ..jump
        };
        let cut_off = Stall {
            kas: Some(0),
            ..jump
        };
        assert!(!check_calls(&[late.clone()], &[], &[], &[elsewhere], &[]).is_empty());
        assert!(check_calls(&[late.clone()], &[], &[], &[cut_off], &[]).is_empty());
        let late = checked(&[late], &[]);
        assert!(late.iter().any(|v| v.starts_with("inv 2")), "{late:?}");
        let mut pinned = call("c1", 1, Ok("agent1-replica1"));
        pinned.replica = Some(0);
        let wrong_replica = checked(&[pinned], &[delivery("c1", 1, 1)]);
        assert!(
            wrong_replica.iter().any(|v| v.starts_with("inv 1")),
            "{wrong_replica:?}"
        );
        let hops = check_hops(
            0,
            "kas_routed_requests_total{outcome=\"delivered\",hops=\"2\"} 1",
        );
        assert_eq!(hops.len(), 1);
        let metrics = "kas_routed_requests_total{outcome=\"delivered\",hops=\"1\"} 2\n\
                       kas_routed_requests_total{outcome=\"not_connected\",hops=\"0\"} 1";
        assert_eq!(routed(metrics), 3.0);
        assert!(check_routed(3.0, 3).is_empty());
        assert_eq!(check_routed(4.0, 3).len(), 1);
    }
}
