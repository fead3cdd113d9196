//! Identifiers shared by the machines. Newtypes so an agent id is never passed where a
//! project id belongs.

use std::fmt;

/// A GitLab agent (one `agentk` deployment, possibly several replicas).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AgentId(pub i64);

/// The GitLab project that holds an agent's configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProjectId(pub i64);

/// One agentk replica, the same on every kas it holds a connection to (drawn by the replica
/// at start; by kas, for agents that do not propose one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnectionId(pub i64);

/// A call being routed or served, unique within one kas.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// One reverse tunnel stream held by this kas, unique within it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TunnelId(pub u64);

/// Whoever a call counts against in the sharing of an agent's tunnels: a digest of a
/// Kubernetes API caller's token, the same on every kas. GitLab's own calls have none.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Holder(pub u64);

/// A kas instance, named by its private API address (`host:port`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KasId(pub String);

macro_rules! display_inner {
    ($($t:ty),*) => {$(
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }
    )*};
}
display_inner!(
    AgentId,
    ProjectId,
    ConnectionId,
    RequestId,
    TunnelId,
    KasId,
    Holder
);
