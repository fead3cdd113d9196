//! The sans-IO core of kas: state machines that take `(now, input)` and yield commands for
//! their driver, with no I/O, clock or randomness of their own.
//!
//! - [`tunnel_registry`]: this kas's reverse tunnels and the calls waiting for one.
//! - [`tracker`]: what this kas must keep in Redis, as transaction batches.
//! - [`router`]: how a GitLab call finds a kas holding its agent's tunnel.
//! - [`tunnel_pool`]: agentk's pool of idle tunnels (how many to open, which to close).
//! - [`frame_sequence`]: the checked frame grammar of tunnel and forward streams.
//!
//! The drivers (`kas-runtime` with tokio, `kas-sim` under madsim) do the I/O and nothing
//! else. Every machine follows one contract, after str0m and quinn-proto: feed one input
//! with `handle_input(now, ..)`, drain `poll_output()` until it returns `None`, then sleep
//! until `poll_timeout()` (or the next input) and call `handle_timeout(now)`.

pub mod backoff;
pub mod expiring;
pub mod fixed_hash;
pub mod frame_sequence;
pub mod ids;
pub mod keys;
pub mod rng;
pub mod router;
pub mod time;
pub mod tracker;
pub mod tunnel_pool;
pub mod tunnel_registry;

pub use ids::{AgentId, ConnectionId, KasId, ProjectId, RequestId, TunnelId};
pub use time::Time;
