//! Names of registry keys and pub-sub channels.
//!
//! Every per-agent or per-project key carries a Redis Cluster hash tag (`{agent:N}`), so
//! one transaction never spans two slots.

use crate::ids::{AgentId, ProjectId};

/// Builds key and channel names under a configurable prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    /// Names under `prefix` (e.g. `"kas"`).
    pub fn new(prefix: impl Into<String>) -> Self {
        Keys {
            prefix: prefix.into(),
        }
    }

    /// Hash of the agent's connections: field = `connection id@kas id` (a replica connected
    /// to several kas has a record from each), value = `ConnectedAgentInfo`.
    pub fn connections_by_agent(&self, agent: AgentId) -> String {
        format!("{}:conn_by_agent:{{agent:{agent}}}", self.prefix)
    }

    /// Hash of a project's agent connections: field = `connection id@kas id`.
    pub fn connections_by_project(&self, project: ProjectId) -> String {
        format!("{}:conn_by_project:{{project:{project}}}", self.prefix)
    }

    /// Hash of the kas replicas holding tunnels of the agent: field = kas id.
    pub fn tunnels_by_agent(&self, agent: AgentId) -> String {
        format!("{}:tunnels_by_agent:{{agent:{agent}}}", self.prefix)
    }

    /// Hash of kas instances: field = kas id, value = `KasInstanceInfo`.
    pub fn kas_instances(&self) -> String {
        format!("{}:kas_instances", self.prefix)
    }

    /// Channel announcing tunnel events of the agent.
    pub fn tunnel_events(&self, agent: AgentId) -> String {
        format!("{}:tunnel_events:{{agent:{agent}}}", self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_keys_share_one_hash_tag() {
        let k = Keys::new("gl");
        let tag = "{agent:42}";
        assert_eq!(
            k.connections_by_agent(AgentId(42)),
            "gl:conn_by_agent:{agent:42}"
        );
        assert!(k.tunnels_by_agent(AgentId(42)).ends_with(tag));
        assert!(k.tunnel_events(AgentId(42)).ends_with(tag));
        assert_eq!(
            k.connections_by_project(ProjectId(7)),
            "gl:conn_by_project:{project:7}"
        );
    }
}
