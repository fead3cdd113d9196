//! The clock the core machines are driven with (unix milliseconds).
//!
//! Registry records carry absolute expiry times that every kas compares, so the core runs
//! on wall-clock time. But a wall clock stepped by NTP must not move a call's deadline or
//! fire every timer at once: kas reads the wall clock once, at its first reading, and counts
//! from there on the monotonic clock (`core/src/time.rs`). Under madsim the clock is the
//! simulation's, whose jumps are the world pausing, so it is read as it is.

use kas_core::Time;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The wall clock in unix milliseconds.
fn wall() -> Time {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis();
    Time(u64::try_from(ms).unwrap_or(u64::MAX))
}

/// Now, as the core's [`Time`]: the wall clock at the first reading, plus the monotonic
/// time since.
#[cfg(not(madsim))]
pub fn now() -> Time {
    use std::sync::OnceLock;
    use std::time::Instant;
    static ANCHOR: OnceLock<(Instant, Time)> = OnceLock::new();
    let (at, wall) = *ANCHOR.get_or_init(|| (Instant::now(), wall()));
    let elapsed = u64::try_from(at.elapsed().as_millis()).unwrap_or(u64::MAX);
    Time(wall.0.saturating_add(elapsed))
}

/// Now, as the core's [`Time`]: the simulation's clock.
#[cfg(madsim)]
pub fn now() -> Time {
    wall()
}

/// How long from now until `at` (zero when it has passed).
pub fn until(at: Time) -> Duration {
    now().until(at)
}

#[cfg(all(test, not(madsim)))]
mod tests {
    use super::*;

    #[test]
    fn now_follows_the_wall_clock_and_never_goes_back() {
        let first = now();
        let skew = first.0.abs_diff(wall().0);
        assert!(skew < 1_000, "{skew} ms from the wall clock");
        let mut last = first;
        for _ in 0..1_000 {
            let t = now();
            assert!(t >= last, "{t:?} after {last:?}");
            last = t;
        }
    }
}
