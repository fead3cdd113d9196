//! The simulated world for madsim: the simulated Redis node and the cluster builder. The
//! kas and agent code that runs in it is kas-server's and kas-agent's own, compiled for madsim.
//!
//! Everything here exists only under `RUSTFLAGS="--cfg madsim"`.

#[cfg(madsim)]
pub mod api_server;
#[cfg(madsim)]
pub mod bounds;
#[cfg(madsim)]
pub mod callers;
#[cfg(madsim)]
pub mod checker;
#[cfg(madsim)]
pub mod cluster;
#[cfg(madsim)]
pub mod cut_watch;
#[cfg(madsim)]
pub mod gitlab;
#[cfg(madsim)]
pub mod greedy;
#[cfg(madsim)]
pub mod greedy_caller;
#[cfg(madsim)]
pub mod kube_caller;
#[cfg(madsim)]
pub mod planted_bug;
#[cfg(madsim)]
pub mod redis;
#[cfg(madsim)]
pub mod redis_dial;
#[cfg(madsim)]
pub mod rogue;
#[cfg(madsim)]
pub mod scenario;
#[cfg(madsim)]
pub mod spans;
#[cfg(madsim)]
pub mod store_back;
#[cfg(madsim)]
pub mod truth;
#[cfg(madsim)]
pub mod workload;
