//! Percentiles.

use std::time::Duration;

/// Sorted samples.
#[derive(Clone, Debug, Default)]
pub struct Latencies(Vec<Duration>);

impl Latencies {
    /// Sorts `samples`.
    pub fn new(mut samples: Vec<Duration>) -> Self {
        samples.sort();
        Latencies(samples)
    }

    /// The `q` quantile (zero without samples).
    pub fn quantile(&self, q: f64) -> Duration {
        let i = ((self.0.len() as f64 * q) as usize).min(self.0.len().saturating_sub(1));
        self.0.get(i).copied().unwrap_or_default()
    }

    /// How many.
    pub fn len(&self) -> usize {
        self.0.len()
    }
}

/// Milliseconds with two decimals.
pub fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 100_000.0).round() / 100.0
}
