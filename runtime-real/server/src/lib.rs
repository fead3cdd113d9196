//! The kas server: its listeners and engine (`kas`), its configuration (`config`), and
//! the registry store (`store`: Redis, in memory, or the simulation's), and the health
//! probe containers run (`probe`).

pub mod buggify;
pub mod config;
pub mod kas;
pub mod probe;
pub mod store;
