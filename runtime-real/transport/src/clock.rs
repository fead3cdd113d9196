//! The wall clock the core machines are driven with (unix milliseconds).
//!
//! Registry records carry absolute expiry times that every kas compares, so the core runs
//! on wall-clock time; under madsim this clock is simulated.

use kas_core::Time;
use std::time::{SystemTime, UNIX_EPOCH};

/// Now, as the core's [`Time`].
pub fn now() -> Time {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis();
    Time(u64::try_from(ms).unwrap_or(u64::MAX))
}

/// How long from now until `at` (zero when it has passed).
pub fn until(at: Time) -> std::time::Duration {
    now().until(at)
}
