//! agentk's pool of reverse tunnels for one connection: when to open one, which idle one
//! to close.
//!
//! The pool keeps `min_idle` tunnels idle (open or opening) so that a call never waits for
//! a tunnel to be dialled, grows when tunnels are claimed, up to `max`, and closes tunnels
//! idle for `idle_timeout` beyond the minimum. A tunnel that fails to open is retried
//! after a jittered exponential backoff, one probe at a time, so that a kas refusing the
//! agent (or restarting) sees a trickle of attempts, not a storm.

use crate::backoff::Backoff;
use crate::rng::Rng;
use crate::time::{Time, earliest};
use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

/// The pool's shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PoolConfig {
    /// Tunnels kept idle (open or being opened), as long as `max` allows.
    pub min_idle: usize,
    /// Most tunnels open or opening at once.
    pub max: usize,
    /// A tunnel idle this long is closed when more than `min_idle` are idle.
    pub idle_timeout: Duration,
    /// Delay before reopening after tunnels failed to open.
    pub retry: Backoff,
}

/// A tunnel of the pool, numbered by the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Slot(pub u64);

/// What the driver reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolInput {
    /// The tunnel the pool asked for with [`PoolOutput::Open`] is open at kas.
    Opened(Slot),
    /// kas sent a call down the tunnel.
    Claimed(Slot),
    /// The call finished: the tunnel is idle again.
    Released(Slot),
    /// The tunnel ended. `failed`: with an error (including failing to open).
    Ended {
        /// The tunnel.
        slot: Slot,
        /// It ended with an error rather than being closed by kas or by the pool.
        failed: bool,
    },
    /// Shutting down: open nothing more, close every idle tunnel and each busy one when
    /// its call finishes.
    Drain,
}

/// What the driver must do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolOutput {
    /// Open a tunnel for this slot.
    Open(Slot),
    /// Close this tunnel (it is idle).
    Close(Slot),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Opening,
    Idle { since: Time },
    Busy,
    Closing,
}

/// The pool of one connection. Follows the core contract: `handle_input`, drain
/// `poll_output`, `handle_timeout` at `poll_timeout`.
pub struct TunnelPool {
    config: PoolConfig,
    rng: Rng,
    slots: BTreeMap<Slot, State>,
    next: u64,
    failures: u32,
    retry_at: Option<Time>,
    draining: bool,
    out: VecDeque<PoolOutput>,
}

impl TunnelPool {
    /// A pool that opens its first tunnels at the first `handle_timeout(now)`.
    pub fn new(config: PoolConfig, rng: Rng) -> Self {
        TunnelPool {
            config,
            rng,
            slots: BTreeMap::new(),
            next: 0,
            failures: 0,
            retry_at: None,
            draining: false,
            out: VecDeque::new(),
        }
    }

    /// Feeds one report.
    pub fn handle_input(&mut self, now: Time, input: PoolInput) {
        match input {
            PoolInput::Opened(slot) => {
                if let Some(s @ State::Opening) = self.slots.get_mut(&slot) {
                    *s = State::Idle { since: now };
                    self.failures = 0;
                    self.retry_at = None;
                }
            }
            PoolInput::Claimed(slot) => {
                if let Some(s @ (State::Idle { .. } | State::Opening)) = self.slots.get_mut(&slot) {
                    *s = State::Busy;
                }
            }
            PoolInput::Released(slot) => {
                if let Some(s @ State::Busy) = self.slots.get_mut(&slot) {
                    *s = State::Idle { since: now };
                }
            }
            PoolInput::Ended { slot, failed } => match self.slots.remove(&slot) {
                // It never opened: each failed open backs off further.
                Some(State::Opening) if failed => {
                    let delay = self.config.retry.delay(self.failures, &mut self.rng);
                    self.failures = self.failures.saturating_add(1);
                    self.retry_at = Some(now + delay);
                }
                // It was up and ended with an error (kas closed it): reopen after the
                // first step's delay, not a growing one, since tunnels that end together
                // (kas stalled past their heartbeats) are one event, not one failure each.
                Some(_) if failed => {
                    let at = now + self.config.retry.delay(0, &mut self.rng);
                    self.retry_at = Some(self.retry_at.map_or(at, |t| t.max(at)));
                }
                _ => {}
            },
            PoolInput::Drain => self.draining = true,
        }
        self.rebalance(now);
    }

    /// Acts on time passing: retries and idle closes.
    pub fn handle_timeout(&mut self, now: Time) {
        self.rebalance(now);
    }

    /// The next thing to do, if any.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<PoolOutput> {
        self.out.pop_front()
    }

    /// When `handle_timeout` has something to do.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Time> {
        let retry = self.retry_at.filter(|_| self.wants_more());
        let idle_close = if self.draining || self.count_idle() <= self.config.min_idle {
            None
        } else {
            self.idle_since()
                .min()
                .map(|since| since + self.config.idle_timeout)
        };
        earliest(retry, idle_close)
    }

    /// Tunnels that are open or opening, by state: (opening, idle, busy).
    pub fn counts(&self) -> (usize, usize, usize) {
        let opening = self.count(|s| matches!(s, State::Opening));
        let busy = self.count(|s| matches!(s, State::Busy));
        (opening, self.count_idle(), busy)
    }

    /// True when draining and every tunnel has ended.
    pub fn drained(&self) -> bool {
        self.draining && self.slots.is_empty()
    }

    fn count(&self, f: impl Fn(&State) -> bool) -> usize {
        self.slots.values().filter(|s| f(s)).count()
    }

    fn count_idle(&self) -> usize {
        self.idle_since().count()
    }

    fn idle_since(&self) -> impl Iterator<Item = Time> + '_ {
        self.slots.values().filter_map(|s| match s {
            State::Idle { since } => Some(*since),
            _ => None,
        })
    }

    /// Below the idle minimum and the maximum, and not already probing after failures.
    fn wants_more(&self) -> bool {
        let opening = self.count(|s| matches!(s, State::Opening));
        let live = self.count(|s| !matches!(s, State::Closing));
        !self.draining
            && self.count_idle() + opening < self.config.min_idle
            && live < self.config.max
            && (self.failures == 0 || opening == 0)
    }

    fn rebalance(&mut self, now: Time) {
        if self.draining {
            for (slot, state) in self.slots.iter_mut() {
                if matches!(state, State::Idle { .. }) {
                    *state = State::Closing;
                    self.out.push_back(PoolOutput::Close(*slot));
                }
            }
            return;
        }
        if self.retry_at.is_some_and(|t| now < t) {
            // Backing off: nothing opens before the retry time.
        } else {
            self.retry_at = None;
            while self.wants_more() {
                let slot = Slot(self.next);
                self.next += 1;
                self.slots.insert(slot, State::Opening);
                self.out.push_back(PoolOutput::Open(slot));
            }
        }
        // Close the longest-idle tunnels past the timeout while more than the minimum idle.
        let mut expired: Vec<(Time, Slot)> = self
            .slots
            .iter()
            .filter_map(|(slot, s)| match s {
                State::Idle { since } if *since + self.config.idle_timeout <= now => {
                    Some((*since, *slot))
                }
                _ => None,
            })
            .collect();
        expired.sort();
        let surplus = self.count_idle().saturating_sub(self.config.min_idle);
        for (_, slot) in expired.into_iter().take(surplus) {
            self.slots.insert(slot, State::Closing);
            self.out.push_back(PoolOutput::Close(slot));
        }
    }
}

#[cfg(test)]
mod tests;
