//! The tokio/tonic/redis drivers of kas-core, and the code behind the `kas`, `agentk` and
//! `kasctl` binaries.

pub mod agent_auth;
pub mod clock;
pub mod config;
pub mod jwt;
pub mod store;
pub mod frames;
pub mod kas;
pub mod agent;
