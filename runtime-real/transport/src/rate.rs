//! A token bucket: `rate` events per `period` on average, bursts of up to `rate`.

use std::time::Duration;
use tokio::time::Instant;

/// One bucket; it starts full.
#[derive(Clone, Copy, Debug)]
pub struct Bucket {
    left: f64,
    at: Instant,
}

/// The rate buckets are filled at.
#[derive(Clone, Copy, Debug)]
pub struct Rate {
    /// Events per period, and the largest burst.
    pub events: u32,
    /// The period.
    pub per: Duration,
}

impl Rate {
    /// A full bucket.
    pub fn bucket(self, now: Instant) -> Bucket {
        Bucket {
            left: f64::from(self.events),
            at: now,
        }
    }

    /// Takes one event from `bucket`, refilled up to `now`; false when it is empty.
    pub fn take(self, bucket: &mut Bucket, now: Instant) -> bool {
        let cap = f64::from(self.events);
        let refill = now.duration_since(bucket.at).as_secs_f64() * cap / self.per.as_secs_f64();
        bucket.left = (bucket.left + refill).min(cap);
        bucket.at = now;
        if bucket.left < 1.0 {
            return false;
        }
        bucket.left -= 1.0;
        true
    }

    /// True when `bucket` would be full by now: no different from a fresh one, so it
    /// need not be kept.
    pub fn is_full(self, bucket: &Bucket, now: Instant) -> bool {
        now.duration_since(bucket.at) >= self.per
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bursts_up_to_the_rate_then_refills_over_the_period() {
        let rate = Rate {
            events: 2,
            per: Duration::from_secs(1),
        };
        let t0 = Instant::now();
        let mut b = rate.bucket(t0);
        assert!(rate.take(&mut b, t0) && rate.take(&mut b, t0));
        assert!(!rate.take(&mut b, t0), "burst spent");
        assert!(
            rate.take(&mut b, t0 + Duration::from_millis(500)),
            "one back"
        );
        assert!(!rate.take(&mut b, t0 + Duration::from_millis(500)));
        assert!(rate.is_full(&b, t0 + Duration::from_millis(1500)));
    }
}
