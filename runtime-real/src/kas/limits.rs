//! What one agent may hold on this kas: requests per minute, open connections, tunnels per
//! connection. (One agent token once held 20,000 `GetConfiguration` streams and 20,000
//! tunnels.) Each refusal is `ResourceExhausted` naming the configuration key, and counted
//! in `kas_limit_refusals_total`.

use super::metrics::Metrics;
use crate::rate::{Bucket, Rate};
use kas_core::fixed_hash::Map;
use kas_core::{AgentId, ConnectionId};

use std::sync::{Arc, Mutex};
use tokio::time::Instant;
use tonic::Status;

/// Rate buckets kept before full (idle) ones are dropped.
const MAX_BUCKETS: usize = 10_000;

/// The configured limits.
#[derive(Clone, Copy, Debug)]
pub struct AgentLimitsConfig {
    /// `agent.listen.connections_per_token_per_minute`.
    pub requests_per_minute: u32,
    /// `agent.max_connections_per_agent`.
    pub connections_per_agent: usize,
    /// `agent.max_tunnels_per_connection`.
    pub tunnels_per_connection: usize,
}

#[derive(Default)]
struct State {
    /// Per agent: its requests.
    buckets: Map<AgentId, Bucket>,
    connections: Map<AgentId, usize>,
    tunnels: Map<(AgentId, ConnectionId), usize>,
}

/// The limits and what each agent holds, shared by the agent API's handlers.
#[derive(Clone)]
pub struct AgentLimits {
    config: AgentLimitsConfig,
    state: Arc<Mutex<State>>,
    metrics: Metrics,
}

/// What a [`Slot`] holds a place in.
enum Held {
    Connection(AgentId),
    Tunnel(AgentId, ConnectionId),
}

/// A connection or tunnel counted against its limit until dropped.
pub struct Slot {
    limits: AgentLimits,
    held: Held,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut state = self.limits.lock();
        match self.held {
            Held::Connection(agent) => release(&mut state.connections, agent),
            Held::Tunnel(agent, c) => release(&mut state.tunnels, (agent, c)),
        }
    }
}

pub(super) fn release<K: std::hash::Hash + Eq>(counts: &mut Map<K, usize>, key: K) {
    if let Some(n) = counts.get_mut(&key) {
        *n -= 1;
        if *n == 0 {
            counts.remove(&key);
        }
    }
}

/// Takes a place under `max` in `counts[key]`.
pub(super) fn take<K: std::hash::Hash + Eq>(
    counts: &mut Map<K, usize>,
    key: K,
    max: usize,
) -> bool {
    let n = counts.entry(key).or_default();
    if *n >= max {
        return false;
    }
    *n += 1;
    true
}

impl AgentLimits {
    /// Limits as configured, refusals counted in `metrics`.
    pub fn new(config: AgentLimitsConfig, metrics: Metrics) -> Self {
        AgentLimits {
            config,
            state: Arc::default(),
            metrics,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The counts stay consistent under a panic elsewhere: each update is one statement.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts a refusal by the limit configured at `key`, made elsewhere.
    pub fn refused(&self, key: &'static str) {
        self.metrics.limit_refused(key);
    }

    fn refuse(&self, key: &'static str, what: String) -> Status {
        self.metrics.limit_refused(key);
        tracing::info!(limit = key, "{what}");
        Status::resource_exhausted(format!("{what} (limit {key})"))
    }

    /// Counts one request (`GetConfiguration` or `OpenTunnel`) of `agent` against its rate.
    pub fn request(&self, agent: AgentId) -> Result<(), Status> {
        let rate = Rate {
            events: self.config.requests_per_minute,
            per: std::time::Duration::from_secs(60),
        };
        let now = Instant::now();
        let mut state = self.lock();
        if state.buckets.len() >= MAX_BUCKETS {
            state.buckets.retain(|_, b| !rate.is_full(b, now));
        }
        let bucket = state.buckets.entry(agent).or_insert(rate.bucket(now));
        if rate.take(bucket, now) {
            return Ok(());
        }
        drop(state);
        Err(self.refuse(
            "agent.listen.connections_per_token_per_minute",
            format!(
                "agent {agent} made more than {} requests in a minute",
                self.config.requests_per_minute
            ),
        ))
    }

    /// A place for one more open connection of `agent`.
    pub fn connection(&self, agent: AgentId) -> Result<Slot, Status> {
        let max = self.config.connections_per_agent;
        if !take(&mut self.lock().connections, agent, max) {
            return Err(self.refuse(
                "agent.max_connections_per_agent",
                format!("agent {agent} already holds {max} connections on this kas"),
            ));
        }
        Ok(Slot {
            limits: self.clone(),
            held: Held::Connection(agent),
        })
    }

    /// A place for one more tunnel of `agent`'s `connection`.
    pub fn tunnel(&self, agent: AgentId, connection: ConnectionId) -> Result<Slot, Status> {
        let max = self.config.tunnels_per_connection;
        if !take(&mut self.lock().tunnels, (agent, connection), max) {
            return Err(self.refuse(
                "agent.max_tunnels_per_connection",
                format!("connection {connection} of agent {agent} already holds {max} tunnels"),
            ));
        }
        Ok(Slot {
            limits: self.clone(),
            held: Held::Tunnel(agent, connection),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(rate: u32) -> AgentLimits {
        AgentLimits::new(
            AgentLimitsConfig {
                requests_per_minute: rate,
                connections_per_agent: 2,
                tunnels_per_connection: 1,
            },
            Metrics::default(),
        )
    }

    #[test]
    fn places_are_counted_per_agent_and_connection_and_freed_on_drop() {
        let l = limits(100);
        let (a, b) = (AgentId(1), AgentId(2));
        let first = l.connection(a).unwrap();
        let _second = l.connection(a).unwrap();
        let err = l.connection(a).err().expect("a third is refused");
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        assert!(
            err.message().contains("agent.max_connections_per_agent"),
            "{err}"
        );
        let _other = l.connection(b).expect("another agent is not affected");
        drop(first);
        let _again = l.connection(a).expect("a freed place is reusable");
        let t = l.tunnel(a, ConnectionId(5)).unwrap();
        assert!(l.tunnel(a, ConnectionId(5)).is_err());
        let _t2 = l.tunnel(a, ConnectionId(6)).expect("per connection");
        drop(t);
        let _t3 = l.tunnel(a, ConnectionId(5)).unwrap();
        let text = l.metrics.encode();
        assert!(
            text.contains("kas_limit_refusals_total{limit=\"agent.max_tunnels_per_connection\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn requests_beyond_the_rate_are_refused_per_agent() {
        let l = limits(3);
        for _ in 0..3 {
            l.request(AgentId(1)).unwrap();
        }
        let err = l.request(AgentId(1)).unwrap_err();
        assert!(
            err.message().contains("connections_per_token_per_minute"),
            "{err}"
        );
        l.request(AgentId(2))
            .expect("another agent has its own budget");
    }
}
