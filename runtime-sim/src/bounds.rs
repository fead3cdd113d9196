//! How much later than their timeouts simulated calls may end: the bounds the workload
//! waits out and the checker holds every call to.

use kas_server::kas::timing::TUNNEL_GRACE;
use std::time::Duration;

/// Slack for the network and timers on top of kas's own graces.
pub const SLACK: Duration = Duration::from_secs(1);

/// How much later than its timeout a call may end: kas's API handler answers before the
/// caller's timeout (`timing::answer_slack`); a tunnel's answer may still be under way
/// [`TUNNEL_GRACE`] past kas's deadline (longer than the router's `ROUTE_GRACE`), plus
/// [`SLACK`].
pub const OUTCOME_BOUND: Duration = TUNNEL_GRACE.saturating_add(SLACK);

/// How much later than its timeout a two-way call may end: its ends finish within a
/// second, and a kas -> kas link that dies under a delivered one is found by HTTP/2
/// keepalive (`keepalive_interval` 30 s + `keepalive_timeout` 20 s).
pub const STREAM_BOUND: Duration = Duration::from_secs(51).saturating_add(OUTCOME_BOUND);
