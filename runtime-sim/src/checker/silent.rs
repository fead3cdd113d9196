//! A link kas keeps alive is never given up: an agent gives a link up as silent only when
//! a fault touched that kas or that link shortly before. kas's keepalives must not wait on
//! anything that a fault elsewhere slows down (Redis, GitLab): `redis-restart` seed 123
//! once found agents giving healthy links up while a Redis Cluster shard failed over.

use super::{Far, HalfOpen, Outage, Stall};
use crate::truth::Silence;
use std::time::Duration;

/// How long before giving a link up an agent last heard on it, at most: three keepalives
/// of 750 ms (the simulation's `agent.heartbeat_timeout` of 3 s, a quarter each), or four
/// tunnel heartbeat periods of 500 ms; and a second of slack.
pub const SILENT_AFTER: Duration = Duration::from_millis(3_250);

/// Violations by `silences`: a link given up as silent with no stall, outage or
/// half-open cut of its kas (or of the link) within [`SILENT_AFTER`] before.
pub fn check_silences(
    silences: &[Silence],
    stalls: &[Stall],
    outages: &[Outage],
    cuts: &[HalfOpen],
) -> Vec<String> {
    silences
        .iter()
        .filter(|s| {
            let since = s.at.checked_sub(SILENT_AFTER).unwrap_or(s.at);
            let stalled = stalls.iter().any(|t| {
                (t.kas.is_none() || t.kas == Some(s.kas)) && t.at <= s.at && since <= t.at + t.lasting
            });
            let down = outages
                .iter()
                .any(|o| o.kas == s.kas && o.from <= s.at && since <= o.to);
            let cut = cuts.iter().any(|c| {
                c.kas == s.kas
                    && c.to_whom == Far::Agent(s.agent)
                    && c.from <= s.at
                    && since <= c.to
            });
            !stalled && !down && !cut
        })
        .map(|s| {
            format!(
                "inv 9: agent {} replica {} gave its link to kas{} up as silent at {:?}, though nothing had touched that kas or link in the {SILENT_AFTER:?} before",
                s.agent, s.replica, s.kas, s.at
            )
        })
        .collect()
}
