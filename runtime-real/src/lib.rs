//! The tokio/tonic/redis drivers of kas-core, and the code behind the `kas`, `agentk` and
//! `kasctl` binaries.

pub mod agent;
pub mod agent_auth;
pub mod api_client;
pub mod buggify;
pub mod channel_ends;
pub mod clock;
pub mod config;
pub mod errors;
pub mod frames;
#[cfg(not(madsim))]
pub mod http_relay;
pub mod jwt;
pub mod kas;
#[cfg(not(madsim))]
pub mod local;
#[cfg(not(madsim))]
pub mod logging;
#[cfg(madsim)]
pub mod planted_bug;
pub mod proxy;
pub mod rate;
#[cfg(not(madsim))]
pub mod signals;
pub mod store;
pub mod tasks;
pub mod tls;
#[cfg(not(madsim))]
pub mod ws;
