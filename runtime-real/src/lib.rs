//! The tokio/tonic/redis drivers of kas-core, and the code behind the `kas`, `agentk` and
//! `kasctl` binaries.

pub mod agent;

/// The largest HTTP/2 DATA frame kas and agentk take (`SETTINGS_MAX_FRAME_SIZE`), as
/// servers and as clients: a streamed body's 256 KiB messages go in one frame each
/// rather than sixteen of the protocol's default 16 KiB.
pub const MAX_FRAME_SIZE: u32 = 256 * 1024 + 64;
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
pub mod token_file;
#[cfg(not(madsim))]
pub mod ws;
