//! What one agent may hold on this kas: requests per minute, open connections, tunnels per
//! connection. (One agent token once held 20,000 `GetConfiguration` streams and 20,000
//! tunnels.) Each refusal is `ResourceExhausted` naming the configuration key, and counted
//! in `kas_limit_refusals_total`. [`Places`] counts what a key holds under a maximum, for
//! these and for the Kubernetes API's requests per caller token.

use super::metrics::Metrics;
use kas_core::fixed_hash::Map;
use kas_core::{AgentId, ConnectionId};
use kas_transport::rate::{Bucket, Rate};

use std::hash::Hash;
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

/// Places counted per key under one maximum, each held until its [`Place`] is dropped.
#[derive(Clone)]
pub struct Places<K> {
    max: usize,
    counts: Arc<Mutex<Map<K, usize>>>,
}

/// One place in a [`Places`], given back when dropped.
pub struct Place<K: Hash + Eq> {
    counts: Arc<Mutex<Map<K, usize>>>,
    key: K,
}

pub(super) fn locked<T>(state: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The state stays consistent under a panic elsewhere: each update is one statement.
    state.lock().unwrap_or_else(|p| p.into_inner())
}

impl<K: Hash + Eq> Drop for Place<K> {
    fn drop(&mut self) {
        let mut counts = locked(&self.counts);
        if let Some(n) = counts.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                counts.remove(&self.key);
            }
        }
    }
}

impl<K: Hash + Eq + Clone> Places<K> {
    /// At most `max` places per key.
    pub fn new(max: usize) -> Self {
        Places {
            max,
            counts: Arc::default(),
        }
    }

    /// The most places one key may hold.
    pub fn max(&self) -> usize {
        self.max
    }

    /// A place for `key`; `None` when it holds the most already.
    pub fn take(&self, key: K) -> Option<Place<K>> {
        let mut counts = locked(&self.counts);
        let n = counts.entry(key.clone()).or_default();
        if *n >= self.max {
            return None;
        }
        *n += 1;
        Some(Place {
            counts: self.counts.clone(),
            key,
        })
    }
}

/// The limits and what each agent holds, shared by the agent API's handlers.
#[derive(Clone)]
pub struct AgentLimits {
    config: AgentLimitsConfig,
    /// Per agent: its requests.
    buckets: Arc<Mutex<Map<AgentId, Bucket>>>,
    connections: Places<AgentId>,
    tunnels: Places<(AgentId, ConnectionId)>,
    metrics: Metrics,
}

impl AgentLimits {
    /// Limits as configured, refusals counted in `metrics`.
    pub fn new(config: AgentLimitsConfig, metrics: Metrics) -> Self {
        AgentLimits {
            config,
            buckets: Arc::default(),
            connections: Places::new(config.connections_per_agent),
            tunnels: Places::new(config.tunnels_per_connection),
            metrics,
        }
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
        let mut buckets = locked(&self.buckets);
        if buckets.len() >= MAX_BUCKETS {
            buckets.retain(|_, b| !rate.is_full(b, now));
        }
        let bucket = buckets.entry(agent).or_insert(rate.bucket(now));
        if rate.take(bucket, now) {
            return Ok(());
        }
        drop(buckets);
        Err(self.refuse(
            "agent.listen.connections_per_token_per_minute",
            format!(
                "agent {agent} made more than {} requests in a minute",
                self.config.requests_per_minute
            ),
        ))
    }

    /// A place for one more open connection of `agent`.
    pub fn connection(&self, agent: AgentId) -> Result<Place<AgentId>, Status> {
        self.connections.take(agent).ok_or_else(|| {
            let max = self.connections.max();
            self.refuse(
                "agent.max_connections_per_agent",
                format!("agent {agent} already holds {max} connections on this kas"),
            )
        })
    }

    /// Most tunnels one connection may hold (`agent.max_tunnels_per_connection`).
    pub fn max_tunnels(&self) -> usize {
        self.tunnels.max()
    }

    /// A place for one more tunnel of `agent`'s `connection`.
    pub fn tunnel(
        &self,
        agent: AgentId,
        connection: ConnectionId,
    ) -> Result<Place<(AgentId, ConnectionId)>, Status> {
        self.tunnels.take((agent, connection)).ok_or_else(|| {
            let max = self.tunnels.max();
            self.refuse(
                "agent.max_tunnels_per_connection",
                format!("connection {connection} of agent {agent} already holds {max} tunnels"),
            )
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
