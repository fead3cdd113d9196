//! Time as the machines see it: a number the driver passes in.
//!
//! `Time` is milliseconds since the Unix epoch, because the tracker writes expiry times
//! that other kas replicas compare with their own clocks. Drivers should derive it from a
//! monotonic clock anchored to wall time at start-up so that deadlines never jump.

use std::ops::{Add, Sub};
use std::time::Duration;

/// A point in time: milliseconds since the Unix epoch on the driver's clock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Time(pub u64);

impl Time {
    /// Milliseconds since the Unix epoch.
    pub fn as_millis(self) -> u64 {
        self.0
    }

    /// Time left until `later`, zero when `later` has passed.
    pub fn until(self, later: Time) -> Duration {
        Duration::from_millis(later.0.saturating_sub(self.0))
    }
}

impl Add<Duration> for Time {
    type Output = Time;
    fn add(self, d: Duration) -> Time {
        Time(
            self.0
                .saturating_add(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        )
    }
}

impl Sub<Time> for Time {
    type Output = Duration;
    fn sub(self, earlier: Time) -> Duration {
        earlier.until(self)
    }
}

/// The earlier of two optional deadlines.
pub fn earliest(a: Option<Time>, b: Option<Time>) -> Option<Time> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}
