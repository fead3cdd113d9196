//! The tools around kas: `kas-local` (a whole deployment in one process, with a fake
//! Kubernetes API server), `kasctl` and `kas-bench` (binaries of this crate).

pub mod local;
