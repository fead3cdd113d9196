//! The simulated world for madsim: simulated Redis node, cluster builder, fault injection
//! and the invariant checker.
//!
//! Not built yet: this crate is filled by the issue "Deterministic simulation". The
//! protocol crate already compiles under `--cfg madsim` (CI checks it).
