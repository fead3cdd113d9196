//! Exponential backoff with jitter drawn from an injected [`Rng`].

use crate::rng::Rng;
use std::time::Duration;

/// Backoff shape: `initial * factor^attempt`, capped at `max`, then "equal jitter": the
/// delay is uniformly drawn from `[d/2, d]` so that many clients that failed together do
/// not retry together.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Backoff {
    /// Delay before the first retry (before jitter).
    pub initial: Duration,
    /// Upper bound of any delay (before jitter).
    pub max: Duration,
    /// Growth per attempt.
    pub factor: u32,
}

impl Backoff {
    /// The delay before retry number `attempt` (0-based).
    pub fn delay(&self, attempt: u32, rng: &mut Rng) -> Duration {
        let growth = u64::from(self.factor.max(1)).saturating_pow(attempt.min(63));
        let base_ms = u64::try_from(self.initial.as_millis())
            .unwrap_or(u64::MAX)
            .saturating_mul(growth)
            .min(u64::try_from(self.max.as_millis()).unwrap_or(u64::MAX));
        let half = base_ms / 2;
        Duration::from_millis(half + rng.below(base_ms - half + 1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_caps_and_jitters_within_bounds() {
        let b = Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(2),
            factor: 2,
        };
        let mut rng = Rng::new(3);
        for attempt in 0..40 {
            let full = (100u64 << attempt.min(20)).min(2000);
            for _ in 0..50 {
                let d = b.delay(attempt, &mut rng).as_millis() as u64;
                assert!(
                    d >= full / 2 && d <= full,
                    "attempt {attempt}: {d} not in [{}, {full}]",
                    full / 2
                );
            }
        }
    }

    #[test]
    fn jitter_spreads_delays() {
        let b = Backoff {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(1),
            factor: 2,
        };
        let mut rng = Rng::new(9);
        let mut seen: Vec<_> = (0..100).map(|_| b.delay(0, &mut rng)).collect();
        seen.sort();
        seen.dedup();
        assert!(seen.len() > 50, "only {} distinct delays", seen.len());
    }
}
