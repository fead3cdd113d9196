//! Fault points in kas's own code (FoundationDB's "buggify"), at the steps where timing
//! changes the outcome. Under `--cfg madsim` a simulation run switches each point on with
//! probability 1/2 ([`enable`]), and a point that is on fires at a rate drawn for the run
//! (1-20%): every seed tries another mix. When a scenario heals, the points that are
//! faults (failures, broken connections) go off, while those that only change timing stay
//! on to its end. In the real build every point is a constant `false` and a pause is an
//! empty future.

/// A fault point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Point {
    /// A forward pauses between the serving kas's headers and its call frames.
    ForwardAfterHeaders,
    /// A router's lookup reaches Redis late, after events may have been published.
    LateLookup,
    /// A tunnel pauses between its claim of a call and the call's first frame.
    TunnelBeforeFirstFrame,
    /// A Redis command is slow.
    RedisLatency,
    /// A Redis command fails.
    RedisFailure,
    /// A batch write fails after writing only its first keys, as a Redis Cluster's can
    /// (one script call per master, each whole or not at all).
    RedisPartialBatch,
    /// The pub-sub connection breaks as a message arrives (the message is lost with it).
    PubSubBreak,
    /// A pub-sub message is delivered twice.
    PubSubDuplicate,
    /// A pub-sub message is delivered late (and every later one after it, in order).
    PubSubDelay,
    /// A pub-sub message is delivered after the one that follows it (or 500 ms late if
    /// none does).
    PubSubReorder,
    /// A `SUBSCRIBE` reaches Redis late: the window before its confirmation grows.
    SubscribeLate,
    /// A call's stream (a forward, or an agent's tunnel) is reset as its next frame is read.
    StreamReset,
}

impl Point {
    /// True for a point that makes an operation fail rather than only take longer; such
    /// points go off when a scenario heals.
    pub fn is_fault(self) -> bool {
        matches!(
            self,
            Point::RedisFailure
                | Point::RedisPartialBatch
                | Point::PubSubBreak
                | Point::PubSubReorder
                | Point::StreamReset
        )
    }
}

/// Every point, in a fixed order.
pub const POINTS: [Point; 12] = [
    Point::ForwardAfterHeaders,
    Point::LateLookup,
    Point::TunnelBeforeFirstFrame,
    Point::RedisLatency,
    Point::RedisFailure,
    Point::RedisPartialBatch,
    Point::PubSubBreak,
    Point::PubSubDuplicate,
    Point::PubSubDelay,
    Point::PubSubReorder,
    Point::SubscribeLate,
    Point::StreamReset,
];

#[cfg(madsim)]
mod run {
    use super::{POINTS, Point};
    use std::cell::Cell;

    thread_local! {
        /// Each point's firing rate in this run (0: off).
        static RATES: Cell<[f64; POINTS.len()]> = const { Cell::new([0.0; POINTS.len()]) };
    }

    fn index(point: Point) -> usize {
        POINTS.iter().position(|p| *p == point).unwrap_or(0)
    }

    pub fn enable() -> Vec<Point> {
        let mut rates = [0.0; POINTS.len()];
        for rate in &mut rates {
            if rand::random::<bool>() {
                *rate = 0.01 + 0.19 * rand::random::<f64>();
            }
        }
        RATES.with(|r| r.set(rates));
        POINTS
            .iter()
            .zip(rates)
            .filter(|(_, r)| *r > 0.0)
            .map(|(p, _)| *p)
            .collect()
    }

    pub fn heal() {
        RATES.with(|r| {
            let mut rates = r.get();
            for (rate, point) in rates.iter_mut().zip(POINTS) {
                if point.is_fault() {
                    *rate = 0.0;
                }
            }
            r.set(rates);
        });
    }

    pub fn disable() {
        RATES.with(|r| r.set([0.0; POINTS.len()]));
    }

    pub fn rates() -> [f64; POINTS.len()] {
        RATES.with(|r| r.get())
    }

    pub fn restore(rates: [f64; POINTS.len()]) {
        RATES.with(|r| r.set(rates));
    }

    pub fn fires(point: Point) -> bool {
        let rate = RATES.with(|r| r.get()[index(point)]);
        rate > 0.0 && rand::random::<f64>() < rate
    }
}

/// Switches points on for this simulation run, each with probability 1/2 and its own
/// rate; returns those switched on.
#[cfg(madsim)]
pub fn enable() -> Vec<Point> {
    run::enable()
}

/// Switches the fault points off (see [`Point::is_fault`]); timing points stay on.
#[cfg(madsim)]
pub fn heal() {
    run::heal()
}

/// Switches every point off.
#[cfg(madsim)]
pub fn disable() {
    run::disable()
}

/// Every point's rate now, to put back with [`restore`] (after a [`heal`], say).
#[cfg(madsim)]
pub fn rates() -> Rates {
    Rates(run::rates())
}

/// Puts back the rates that [`rates`] returned.
#[cfg(madsim)]
pub fn restore(rates: Rates) {
    run::restore(rates.0)
}

/// The points' rates in a run (see [`rates`]).
#[cfg(madsim)]
#[derive(Clone, Copy, Debug)]
pub struct Rates([f64; POINTS.len()]);

/// True when `point` fires now.
#[cfg(madsim)]
pub fn fires(point: Point) -> bool {
    run::fires(point)
}

/// Never: the real build has no fault points.
#[cfg(not(madsim))]
#[inline(always)]
pub fn fires(_: Point) -> bool {
    false
}

/// A delay of 1-500 ms when `point` fires.
#[inline]
pub fn delay(point: Point) -> Option<std::time::Duration> {
    fires(point).then(|| std::time::Duration::from_millis(1 + rand::random::<u64>() % 500))
}

/// The next frame from `read`, or when [`Point::StreamReset`] fires, the error a broken
/// stream reads as in tonic (and `read` is dropped, which resets the stream for real):
/// `Unknown` for a reset or an I/O error, or, half the time, `Unavailable` for an HTTP/2
/// keepalive that timed out, which madsim's gRPC never reports by itself (mutant 58).
#[inline]
pub async fn read<T>(
    read: impl Future<Output = Result<T, tonic::Status>>,
) -> Result<T, tonic::Status> {
    if fires(Point::StreamReset) {
        return Err(match rand::random::<bool>() {
            true => tonic::Status::unknown("stream reset (buggify)"),
            false => tonic::Status::unavailable("keep-alive timed out (buggify)"),
        });
    }
    read.await
}

/// Sleeps 1-500 ms when `point` fires.
#[inline]
pub async fn pause(point: Point) {
    if let Some(d) = delay(point) {
        tokio::time::sleep(d).await;
    }
}
