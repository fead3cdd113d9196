//! How long past a call's deadline each part of kas keeps at it, in one place because
//! their order matters (checked at compile time below):
//!
//! 1. kas's deadline is the caller's less [`DEADLINE_MARGIN`] (a tenth of the timeout at
//!    most), so that the caller hears why a call failed before its own timer fires.
//! 2. A call still in an attempt (a forward under way) is failed by the router
//!    [`ROUTE_GRACE`] after kas's deadline.
//! 3. A tunnel whose agent has not finished answering gives up [`TUNNEL_GRACE`] after it,
//!    failing the call and closing the tunnel.
//! 4. The API handler stops waiting for an answer halfway through the margin of 1
//!    ([`answer_slack`]), answering `DEADLINE_EXCEEDED` itself: the caller's own deadline
//!    comes next, and there tonic's timeout answers `CANCELLED` for it, whichever kas
//!    the call went through. Precise errors that come before still reach the caller.
//! 5. A forward that relayed its trailer reads the stream's end for at most
//!    [`FORWARD_DRAIN`] (dropping it early resets the HTTP/2 stream).
//!
//! And how long a stop may run past `shutdown_grace`.

use std::time::Duration;

/// Longest margin kept between kas's deadline for a call and the caller's.
pub const DEADLINE_MARGIN: Duration = Duration::from_millis(500);
/// How long past its deadline a call in an attempt may run before the router fails it.
pub const ROUTE_GRACE: Duration = Duration::from_secs(2);
/// How long past its deadline a call may hold a tunnel before the tunnel is given up.
pub const TUNNEL_GRACE: Duration = Duration::from_secs(2);
/// How long past kas's deadline, `left` before it, the API handler still waits for an
/// answer: half the margin [`DEADLINE_MARGIN`] keeps before the caller's own deadline
/// (kas's is the caller's less a tenth of the timeout, at most the margin).
pub fn answer_slack(left: Duration) -> Duration {
    (left / 18).min(DEADLINE_MARGIN / 2)
}
/// How long a finished forward reads its stream's end.
pub const FORWARD_DRAIN: Duration = Duration::from_secs(1);

/// A stop past its grace: how long deleting this kas's registry records may take (what is
/// not deleted expires by TTL, and readers skip it once this kas's liveness lapses).
pub const STOP_CLEANUP: Duration = Duration::from_secs(1);
/// A stop past its grace: how long each listener left (the call listeners once their calls
/// were cut off, agents, observability) may take to close its connections. With
/// [`STOP_CLEANUP`], a stop ends within the grace + 2 s.
pub const STOP_LISTENER: Duration = Duration::from_millis(300);

const _: () = {
    assert!(DEADLINE_MARGIN.as_millis() < ROUTE_GRACE.as_millis());
    assert!(STOP_CLEANUP.as_millis() + 3 * STOP_LISTENER.as_millis() < 2000);
};
