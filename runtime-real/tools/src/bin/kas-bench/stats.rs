//! Percentiles, and processes' CPU time.

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

/// Clock ticks per second of `/proc/<pid>/stat`'s times (`USER_HZ`, 100 on Linux's
/// mainstream architectures).
const USER_HZ: f64 = 100.0;

/// The CPU time (user and system, every thread) process `pid` has used so far, from
/// `/proc/<pid>/stat`; `None` where it cannot be read.
pub fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces, in parentheses): utime and
    // stime are the 14th and 15th of the line, the 12th and 13th after it.
    let rest = stat.rsplit_once(')')?.1;
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(Duration::from_secs_f64((utime + stime) as f64 / USER_HZ))
}

/// The CPU time the processes of `pids` have used so far, together.
pub fn cpu_of(pids: &[u32]) -> Option<Duration> {
    pids.iter().map(|&p| cpu_time(p)).sum()
}
