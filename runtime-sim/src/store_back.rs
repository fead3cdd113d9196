//! A kas that finds the registry store answering again must be back in it at once: its
//! records are rewritten, its liveness record first among them, whatever backoff its
//! failed writes left (`swarm` seed 96 once found a kas unlisted for 5 s after an outage,
//! its calls skipped as a dead kas's).

use crate::checker::{Outage, Stall};
use crate::cluster::{Cluster, kas_addr, kas_id};
use kas_core::keys::Keys;
use std::time::Duration;
use tokio::time::Instant;

/// How long after a kas finds the store answering again its liveness record must be in
/// it: the batch in flight then and the rewrite's, each delayed by the fault points.
/// Not judged while the store is slowed on purpose (up to 800 ms a request: two of those
/// in a row ran past 1.5 s at `redis-restart` seed 1447), nor while the kas's path to it
/// is cut off (its writes wait for the path: `partition` seed 1850).
pub const LIVE_AGAIN: Duration = Duration::from_millis(1500);

/// How often the watcher reads each kas's readiness.
const POLL: Duration = Duration::from_millis(50);

/// Kas `kas` found the store answering again `at`; `LIVE_AGAIN` later its liveness record
/// was (`live`) or was not in it. Not judged when its readiness dropped again meanwhile,
/// the store lost data behind its back, or it was slowed or cut off on purpose.
#[derive(Clone, Copy, Debug)]
pub struct Return {
    kas: usize,
    at: Instant,
    live: bool,
    judged: bool,
}

/// Watches every kas's store readiness until `until`, and what the store holds
/// [`LIVE_AGAIN`] after each time a kas finds it answering again.
pub async fn watch(cluster: &Cluster, until: Instant) -> Vec<Return> {
    let n = cluster.kas_nodes.len();
    let mut was: Vec<Option<bool>> = vec![None; n];
    // (kas, since, readiness held since)
    let mut open: Vec<(usize, Instant, bool)> = Vec::new();
    let mut seen = Vec::new();
    while Instant::now() < until {
        let now = Instant::now();
        for (kas, was) in was.iter_mut().enumerate() {
            let ready = cluster.health[kas]
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
                .map(|h| *h.store_ready.borrow());
            if *was == Some(false) && ready == Some(true) {
                open.push((kas, now, true));
            }
            for (k, _, held) in &mut open {
                *held &= *k != kas || ready == Some(true);
            }
            *was = ready;
        }
        open.retain(|&(kas, at, held)| {
            if now < at + LIVE_AGAIN {
                return true;
            }
            let disturbed = cluster.redis.with_db(|db| db.disturbed_since(at))
                || cluster
                    .redis
                    .knobs
                    .slow_between(at.checked_sub(LIVE_AGAIN).unwrap_or(at), now)
                || cluster
                    .redis
                    .knobs
                    .cut_between(kas_addr(kas, 0).ip(), at, now);
            seen.push(Return {
                kas,
                at,
                live: live(cluster, kas),
                judged: held && !disturbed,
            });
            false
        });
        tokio::time::sleep(POLL).await;
    }
    seen
}

/// Whether kas `kas`'s liveness record is in the store, unexpired.
fn live(cluster: &Cluster, kas: usize) -> bool {
    let key = Keys::new("kas").kas_instances();
    let field = kas_id(kas);
    let now = kas_transport::clock::now();
    cluster.redis.with_db(|db| {
        db.entries(Instant::now()).get(&key).is_some_and(|fields| {
            fields.iter().any(|(f, bytes)| {
                *f == field && kas_core::expiring::decode(bytes).is_ok_and(|(at, _)| at > now)
            })
        })
    })
}

/// Violations by `returns`: a kas back in the store's answers whose liveness record was
/// not in it [`LIVE_AGAIN`] later, unless that kas went away (`outages`) or stood still
/// (`stalls`) meanwhile.
pub fn check(returns: &[Return], outages: &[Outage], stalls: &[Stall]) -> Vec<String> {
    returns
        .iter()
        .filter(|r| r.judged && !r.live)
        .filter(|r| {
            let end = r.at + LIVE_AGAIN;
            let away = outages
                .iter()
                .any(|o| o.kas == r.kas && o.from <= end && r.at <= o.to);
            let still = stalls.iter().any(|s| {
                (s.kas.is_none() || s.kas == Some(r.kas)) && s.at <= end && r.at <= s.at + s.lasting
            });
            !away && !still
        })
        .map(|r| {
            format!(
                "inv 7: kas{} found the store answering again at {:?}, and {LIVE_AGAIN:?} later its liveness record was not in it",
                r.kas, r.at
            )
        })
        .collect()
}
