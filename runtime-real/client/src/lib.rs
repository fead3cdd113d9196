//! GitLab's side of kas: the public API client that `kasctl`, the tests, the benchmark and
//! the simulation's callers use.

pub mod api_client;
