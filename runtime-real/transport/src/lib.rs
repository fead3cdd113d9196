//! What kas, agentk and the tools share below the protocols: TLS and WebSocket dialling
//! and serving, HTTP proxies, the Kubernetes API's HTTP relay, frame helpers, and the
//! runtime's basics (the clock, owned task sets, rate buckets, signals, logging, traces).

/// The largest HTTP/2 DATA frame kas and agentk take (`SETTINGS_MAX_FRAME_SIZE`), as
/// servers and as clients: a streamed body's 256 KiB messages go in one frame each
/// rather than sixteen of the protocol's default 16 KiB.
pub const MAX_FRAME_SIZE: u32 = 256 * 1024 + 64;

/// `agent.max_message_size`'s default, and the largest message kasctl's client takes: the
/// pods of a 20,000-pod cluster at Kubernetes' longest names fit (about 12 MiB).
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = 32 << 20;

pub mod channel_ends;
pub mod clock;
pub mod errors;
pub mod frames;
pub mod http_relay;
pub mod kas_url;
#[cfg(all(not(madsim), any(test, feature = "local-ca")))]
pub mod local_ca;
#[cfg(not(madsim))]
pub mod logging;
pub mod proxy;
pub mod rate;
pub mod rt;
#[cfg(not(madsim))]
pub mod signals;
pub mod tasks;
pub mod tls;
pub mod traces;
pub mod ws;
