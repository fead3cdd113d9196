//! Routing bugs the simulation plants on purpose, to prove its invariant checker reports
//! them (madsim build only; each simulated test runs on its own thread, so the switch is
//! per thread and cannot leak into another test). They act in simulated I/O only — the
//! simulated GitLab client and the simulated Redis connection — never in kas's own code.

use std::cell::Cell;

/// A deliberate routing bug.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Bug {
    /// No bug: the production behaviour.
    #[default]
    None,
    /// Each call reaches the next agent id instead of the one asked for.
    WrongAgent,
    /// After an agent answered, the same call is delivered again.
    DeliverTwice,
    /// Every tunnel event on the pub-sub connection is lost (a lost wake-up).
    DropWakeup,
}

thread_local! {
    static PLANTED: Cell<Bug> = const { Cell::new(Bug::None) };
}

/// Plants `bug` for the simulation running on this thread.
pub fn plant(bug: Bug) {
    PLANTED.with(|p| p.set(bug));
}

/// The bug planted on this thread.
pub fn planted() -> Bug {
    PLANTED.with(Cell::get)
}
