//! Invariant 15, judged where the records live: a kas's tunnel record for an agent that
//! becomes live (written new, or rewritten after it had expired) is announced on the
//! agent's tunnel events channel soon after. A router that looked the agent up while it
//! had no live record waits for that event (polling only now and then), so an unannounced
//! record leaves its callers waiting: `redis-restart` seed 217 found kas's write script
//! announcing only the fields it created, not those a late refresh revived.

use kas_core::expiring;
use kas_core::keys::is_connection_field;
use kas_transport::clock;
use std::time::Duration;
use tokio::time::Instant;

/// How soon after the write a record must be announced: the write's answer may come a
/// Redis timeout late (the simulation's longest is 3 s), the announcement may fail once
/// and go again, and a second of slack.
pub const ANNOUNCE_BOUND: Duration = Duration::from_secs(7);

/// A tunnel record that became live, not announced yet.
#[derive(Debug)]
struct Revival {
    key: String,
    field: String,
    channel: String,
    at: Instant,
}

/// The tunnel records written live and not announced yet, and the violations found.
#[derive(Debug, Default)]
pub struct Announcements {
    pending: Vec<Revival>,
    violations: Vec<String>,
}

/// The tunnel events channel of an agent's hash `key` (`P:agent:{agent:N}`), if it is one.
fn channel(key: &str) -> Option<String> {
    let (prefix, agent) = key.split_once(":agent:{agent:")?;
    Some(format!("{prefix}:tunnel_events:{{agent:{agent}"))
}

/// Whether stored `bytes` are a record live now.
fn live(bytes: Option<&[u8]>) -> bool {
    bytes.is_some_and(|b| {
        expiring::decode(b).is_ok_and(|(at, _)| expiring::is_live(at, clock::now()))
    })
}

impl Announcements {
    /// `HSET key pairs` is about to replace what `before` reads (the key's fields and
    /// their stored bytes; read only for an agent's key): the kas tunnel records it makes
    /// live are owed an announcement.
    pub fn written(
        &mut self,
        key: &str,
        pairs: &[(String, Vec<u8>)],
        before: impl FnOnce() -> Vec<(String, Vec<u8>)>,
        now: Instant,
    ) {
        let Some(channel) = channel(key) else { return };
        let before = before();
        let was_live = |field: &str| {
            live(
                before
                    .iter()
                    .find(|(f, _)| f == field)
                    .map(|(_, v)| v.as_slice()),
            )
        };
        for (field, bytes) in pairs {
            if !is_connection_field(field) && !was_live(field) && live(Some(bytes)) {
                self.pending.push(Revival {
                    key: key.to_string(),
                    field: field.clone(),
                    channel: channel.clone(),
                    at: now,
                });
            }
        }
    }

    /// A message on `channel`: every record of its agent written before is announced.
    pub fn published(&mut self, channel: &str) {
        self.pending.retain(|r| r.channel != channel);
    }

    /// Judges the records written [`ANNOUNCE_BOUND`] ago or more: one still live
    /// (`current` gives a field's stored bytes now) and never announced is a violation.
    pub fn judge(&mut self, now: Instant, mut current: impl FnMut(&str, &str) -> Option<Vec<u8>>) {
        if !self.pending.iter().any(|r| now >= r.at + ANNOUNCE_BOUND) {
            return;
        }
        let (due, pending): (Vec<Revival>, Vec<Revival>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|r| now >= r.at + ANNOUNCE_BOUND);
        self.pending = pending;
        for r in due {
            if live(current(&r.key, &r.field).as_deref()) {
                self.violations.push(format!(
                    "inv 15: kas {}'s tunnel record in {} became live at {:?} and was still live {ANNOUNCE_BOUND:?} later, but nothing was published on {} (routers waiting for the agent were not woken)",
                    r.field, r.key, r.at, r.channel
                ));
            }
        }
    }

    /// The violations found so far.
    pub fn violations(&self) -> &[String] {
        &self.violations
    }

    /// Forgets what is pending: the data were lost (a restart, a failover) or changed
    /// behind the writers' backs, and what they write next is announced from scratch.
    pub fn forget(&mut self) {
        self.pending.clear();
    }
}
