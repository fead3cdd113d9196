//! Names of registry keys and pub-sub channels.
//!
//! Every per-agent or per-project key carries a Redis Cluster hash tag (`{agent:N}`), so
//! one transaction never spans two slots.

use crate::ids::{AgentId, KasId, ProjectId};

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

    /// Hash of what every kas records of the agent, so that one write a refresh period
    /// keeps all of it: its replicas' connections (field `connection id@kas id`, value
    /// `ConnectedAgentInfo`; a replica connected to several kas has a record from each)
    /// and the kas holding its tunnels (field = kas id, empty value). See
    /// [`is_connection_field`].
    pub fn agent(&self, agent: AgentId) -> String {
        format!("{}:agent:{{agent:{agent}}}", self.prefix)
    }

    /// Hash of a project's agent connections: field = `connection id@kas id`.
    pub fn connections_by_project(&self, project: ProjectId) -> String {
        format!("{}:conn_by_project:{{project:{project}}}", self.prefix)
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

/// Whether a field of [`Keys::agent`] records a connection (`connection id@kas id`) rather
/// than the tunnels of a kas (`kas id`: a kas id is an address, which has no `@`).
pub fn is_connection_field(field: &str) -> bool {
    field.contains('@')
}

/// The kas holding tunnels of an agent, from the (live) fields of its [`Keys::agent`] hash.
pub fn tunnel_holders<V>(fields: impl IntoIterator<Item = (String, V)>) -> Vec<KasId> {
    fields
        .into_iter()
        .filter(|(field, _)| !is_connection_field(field))
        .map(|(kas, _)| KasId(kas))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_keys_share_one_hash_tag() {
        let k = Keys::new("gl");
        let tag = "{agent:42}";
        assert_eq!(k.agent(AgentId(42)), "gl:agent:{agent:42}");
        assert!(k.tunnel_events(AgentId(42)).ends_with(tag));
        assert_eq!(
            k.connections_by_project(ProjectId(7)),
            "gl:conn_by_project:{project:7}"
        );
    }
}
