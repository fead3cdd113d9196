//! Named chaos scenarios and the seed runner.
//!
//! Not built yet: this crate is filled by the issue "Deterministic simulation".
