//! The tokio, tonic and redis drivers of `kas-core`, and the `kas`, `agentk` and `kasctl`
//! binaries.
//!
//! Not built yet: this crate is filled by the issue "The kas server: four listeners, JWT,
//! agent auth and the real Redis registry" and the agentk/kasctl issue. It is a workspace
//! member now so the layout, lints and CI are fixed from the start.
