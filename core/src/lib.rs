//! The sans-IO core of kas: state machines that take `(now, input)` and yield commands for
//! their driver, with no I/O, clock or randomness of their own.
//!
//! - [`node`]: one whole kas — registry, tracker and router wired together with the
//!   bookkeeping of its calls. kas's engine, the model test and the simulation run it.
//! - [`tunnel_registry`]: this kas's reverse tunnels and the calls waiting for one.
//! - [`tracker`]: what this kas must keep in Redis, as transaction batches.
//! - [`router`]: how a GitLab call finds a kas holding its agent's tunnel.
//! - [`tunnel_pool`]: agentk's pool of idle tunnels (how many to open, which to close).
//! - [`kas_links`]: agentk's connections to several kas (which to dial, drain, close).
//! - [`frame_sequence`]: the checked frame grammar of tunnel and forward streams.
//!
//! The drivers (`kas-server` and `kas-agent` with tokio, `kas-sim` under madsim) do the I/O and nothing
//! else. Every machine follows one contract, after str0m and quinn-proto: feed one input
//! with `handle_input(now, ..)`, drain `poll_output()` until it returns `None`, then sleep
//! until `poll_timeout()` (or the next input) and call `handle_timeout(now)`.
//!
//! The driving loop, as kas's engine runs it (here with a scripted clock and inputs):
//!
//! ```
//! use kas_core::keys::Keys;
//! use kas_core::node::{KasNode, NodeConfig, NodeInput, NodeOutput, Wanted};
//! use kas_core::{AgentId, KasId, RequestId, Time};
//!
//! // GitLab kas's defaults and the production tuning; polls alone (no pub-sub here).
//! let config = NodeConfig {
//!     wakeups: false,
//!     ..NodeConfig::new(KasId("10.0.0.1:8155".into()), Keys::new("kas"))
//! };
//! let mut node: KasNode<&str> = KasNode::new(Time(0), config);
//! // A call for an agent no kas holds, with a 1 s deadline.
//! let wanted = Wanted { agent: AgentId(7), connection: None, deadline: Time(1_000), holder: None };
//! let mut inputs = vec![NodeInput::Route { request: RequestId(1), wanted, call: "payload" }];
//! let mut now = Time(0);
//! let mut failed = None;
//! loop {
//!     // 1. Feed what arrived. An error means the input changed nothing.
//!     for input in inputs.drain(..) {
//!         node.handle_input(now, input).expect("a well-formed input");
//!     }
//!     // 2. Carry every output; answers come back as inputs.
//!     while let Some(output) = node.poll_output() {
//!         match output {
//!             NodeOutput::Lookup { agent, .. } => inputs.push(NodeInput::LookupDone { agent, kas: Some(vec![]) }),
//!             NodeOutput::Write(batch) => inputs.push(NodeInput::BatchDone { batch: batch.id, ok: true }),
//!             NodeOutput::Ended { request, error, .. } => failed = Some((request, error)),
//!             _ => {} // subscriptions, tunnels, forwards: none in this script
//!         }
//!     }
//!     if !inputs.is_empty() {
//!         continue;
//!     }
//!     if failed.is_some() {
//!         break;
//!     }
//!     // 3. Sleep until the next timer (or input), then fire what is due.
//!     now = node.poll_timeout().expect("the call's deadline is pending");
//!     node.handle_timeout(now);
//! }
//! let (request, error) = failed.unwrap();
//! assert_eq!(request, RequestId(1));
//! assert_eq!(error.unwrap().to_string(), "agent 7 is not connected");
//! assert!(now >= Time(1_000));
//! ```

pub mod backoff;
pub mod expiring;
pub mod fixed_hash;
pub mod frame_sequence;
pub mod ids;
pub mod kas_links;
pub mod keys;
pub mod node;
pub mod rng;
pub mod router;
pub mod time;
pub mod tracker;
pub mod tunnel_pool;
pub mod tunnel_registry;

pub use ids::{AgentId, ConnectionId, Holder, KasId, ProjectId, RequestId, TunnelId};
pub use time::Time;
