//! The agent (`agentk`): dials kas, keeps a pool of reverse tunnels open and serves the
//! calls that come down them with its modules.
//!
//! - [`modules`]: the methods an agent serves; a tunnel carries any of them without kas
//!   knowing about it.
//! - [`pods`]: the Pods module, reading the Kubernetes API or a fixture file.
//! - [`kubernetes_api`]: the Kubernetes API module, proxying HTTP to the API server.
//! - [`meta`]: what agentk tells kas about itself (versions, architecture, pod).
//! - [`client`]: `GetConfiguration` and one tunnel.
//! - [`run`]: the connection loop: reconnect with backoff, the tunnel pool, shutdown.

pub mod client;
pub mod kubernetes_api;
pub mod meta;
pub mod modules;
pub mod pods;
pub mod run;

pub use client::{AgentClient, UNANSWERED_HEARTBEATS};
pub use modules::Modules;
pub use pods::{PODS_LIST, PODS_LOGS, PodSource};
pub use run::{AgentOptions, Reports, run, run_reporting};
