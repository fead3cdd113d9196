//! agentk's connections to several kas at once, so that a kas stopping or dying never
//! leaves the agent unreachable.
//!
//! An agent replica dials its one kas address (a load balancer in front of every kas)
//! until it holds connections to `want` distinct kas, or to every live kas when there are
//! fewer. Each connection says which kas it reached: one that reached a kas already held
//! is closed and the next dial waits a jittered backoff, so that many agents re-homing at
//! once do not stampede. That backoff grows for failed dials (kas unreachable, the token
//! refused), but not for duplicates, nor for dials a stopping kas declined: those are the
//! balancer's draw, not a kas in trouble. Their redraws stay at the first step (0.5-1 s
//! with agentk's defaults): a growing one (to 4 s) kept the unluckiest of 6,661 agents
//! re-homing after a kas died for 52 s, and the redraws of a wave of agents are fewer
//! than the wave (half of them draw right each time), so they never load kas more than
//! the wave itself. One dial runs at a time.
//!
//! A kas may ask a connection to move (it is stopping, or the connection is old): the
//! connection stops counting and a replacement is dialled; the old one serves on until as
//! many connections serve as are wanted, or, when its kas is stopping, until another
//! serves and [`MOVE_PATIENCE`] has passed, then drains (its running calls finish, then
//! it closes). Make before break:
//! the agent is never without a serving connection because a kas asked it to move, nor
//! left on one kas by a move while its replacement is dialled (two connections made
//! together age out together, and the kas of the other may stop meanwhile), and a stopping
//! kas is left soon after its calls end even where no replacement can be found.
//!
//! Driving contract: feed [`KasLinks::handle_input`], drain [`KasLinks::poll_output`], call
//! [`KasLinks::handle_timeout`] at [`KasLinks::poll_timeout`].

use crate::backoff::Backoff;
use crate::rng::Rng;
use crate::time::{Time, earliest};
use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

/// How long a connection asked to move serves on, once another serves, waiting for a
/// replacement to bring the count back up: a few redraws of a dial (0.5-1 s each with
/// agentk's defaults), and no more, since a stopping kas waits for its agents to leave.
pub const MOVE_PATIENCE: Duration = Duration::from_secs(3);

/// A connection of the agent, numbered by the machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Link(pub u64);

/// Settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinksConfig {
    /// Distinct kas to hold connections to (fewer when fewer are live).
    pub want: usize,
    /// Delays between dials that failed or reached a kas already held.
    pub backoff: Backoff,
}

/// What the driver reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinksInput {
    /// The connection is up at kas `kas`, which counted `live_kas` live kas (0: unknown).
    Up {
        /// The connection.
        link: Link,
        /// The kas it reached (its id; empty when the kas did not say).
        kas: String,
        /// Live kas, as that kas counted them.
        live_kas: u32,
    },
    /// A connection's kas counted this many live kas since (its keepalives carry the
    /// count): an agent that first met a kas counting itself alone learns of the others.
    LiveKas(u32),
    /// The connection's kas asked it to move: `stopping`, or the connection is old.
    MoveAsked {
        /// The connection.
        link: Link,
        /// kas is stopping (else the connection only grew old).
        stopping: bool,
    },
    /// The dial reached a kas that is stopping, which declined it (`Ended` follows).
    Declined(Link),
    /// The connection ended (failed to come up, was cut, or finished draining).
    Ended(Link),
    /// The agent is stopping: drain every connection, dial no more.
    Stop,
}

/// What the driver must do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinksOutput {
    /// Open a new connection; report `Up` or `Ended`. It opens no tunnel before `Serve`.
    Dial(Link),
    /// Keep the connection that is up: open its tunnels and serve calls. (A duplicate is
    /// closed before it opened any, so that no call is ever sent down a tunnel of it.)
    Serve(Link),
    /// Stop opening tunnels on it, let its running calls finish, then close it (report
    /// `Ended`).
    Drain(Link),
    /// Close it now: it duplicates another (report `Ended`).
    Close(Link),
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    Dialing,
    /// Dialled a stopping kas, which declined; its end is due.
    Declined,
    /// Up, and counted.
    Serving {
        kas: String,
    },
    /// Asked to move at `since`: not counted, but serving on until drained; for
    /// [`MOVE_PATIENCE`] at most once another serves when its kas is `stopping`.
    Moving {
        kas: String,
        since: Time,
        stopping: bool,
    },
    /// Told to drain or close; waiting for its end.
    Leaving,
}

/// The connections of one agent replica. See the module docs.
#[derive(Debug)]
pub struct KasLinks {
    config: LinksConfig,
    rng: Rng,
    links: BTreeMap<Link, State>,
    next: u64,
    /// Dials in a row that failed.
    failures: u32,
    /// No dial before this.
    dial_at: Time,
    /// Live kas, as a kas last counted them (0: unknown).
    live_kas: u32,
    stopping: bool,
    outputs: VecDeque<LinksOutput>,
}

impl KasLinks {
    /// No connection yet: the first dial is due at once. `seed` drives the jitter.
    pub fn new(config: LinksConfig, seed: u64) -> Self {
        KasLinks {
            config,
            rng: Rng::new(seed),
            links: BTreeMap::new(),
            next: 0,
            failures: 0,
            dial_at: Time(0),
            live_kas: 0,
            stopping: false,
            outputs: VecDeque::new(),
        }
    }

    /// Applies one input at `now`. Inputs about links the machine has forgotten are ignored.
    pub fn handle_input(&mut self, now: Time, input: LinksInput) {
        match input {
            LinksInput::Up {
                link,
                kas,
                live_kas,
            } => {
                if self.links.get(&link) != Some(&State::Dialing) {
                    return;
                }
                if live_kas > 0 {
                    self.live_kas = live_kas;
                }
                let duplicate = self.links.values().any(
                    |s| matches!(s, State::Serving { kas: k } if *k == kas && !kas.is_empty()),
                );
                if duplicate || self.stopping {
                    self.leave(link, LinksOutput::Close(link));
                    self.redraw(now);
                } else {
                    self.links.insert(link, State::Serving { kas });
                    self.outputs.push_back(LinksOutput::Serve(link));
                    self.failures = 0;
                    // The next dial, if one is needed, after a short jittered pause.
                    self.dial_at = now + self.config.backoff.delay(0, &mut self.rng);
                }
            }
            LinksInput::LiveKas(live_kas) => {
                if live_kas > 0 {
                    self.live_kas = live_kas;
                }
            }
            LinksInput::MoveAsked { link, stopping } => match self.links.get_mut(&link) {
                Some(State::Serving { kas }) => {
                    let kas = kas.clone();
                    let moving = State::Moving {
                        kas,
                        since: now,
                        stopping,
                    };
                    self.links.insert(link, moving);
                    self.failures = 0;
                    self.dial_at = now + self.config.backoff.delay(0, &mut self.rng);
                }
                // Moved for age, and now its kas stops: patient from now.
                Some(State::Moving {
                    since, stopping: s, ..
                }) if stopping && !*s => {
                    (*since, *s) = (now, true);
                }
                _ => {}
            },
            LinksInput::Declined(link) => {
                if self.links.get(&link) == Some(&State::Dialing) {
                    self.links.insert(link, State::Declined);
                }
            }
            LinksInput::Ended(link) => match self.links.remove(&link) {
                Some(State::Dialing) => self.back_off(now),
                Some(State::Declined) => self.redraw(now),
                Some(State::Serving { .. } | State::Moving { .. }) => {
                    let soon = now + self.config.backoff.delay(0, &mut self.rng);
                    self.dial_at = self.dial_at.max(soon);
                }
                Some(State::Leaving) | None => {}
            },
            LinksInput::Stop => {
                self.stopping = true;
                let links: Vec<(Link, State)> =
                    self.links.iter().map(|(l, s)| (*l, s.clone())).collect();
                for (link, state) in links {
                    match state {
                        State::Dialing | State::Declined => {
                            self.leave(link, LinksOutput::Close(link));
                        }
                        State::Serving { .. } | State::Moving { .. } => {
                            self.leave(link, LinksOutput::Drain(link));
                        }
                        State::Leaving => {}
                    }
                }
            }
        }
        self.act(now);
    }

    /// Dials when one is due at `now`.
    pub fn handle_timeout(&mut self, now: Time) {
        self.act(now);
    }

    /// The next order for the driver.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<LinksOutput> {
        self.outputs.pop_front()
    }

    /// When to call [`Self::handle_timeout`] next: the next dial, when one is wanted, and
    /// the end of a moving connection's patience, when another serves.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Time> {
        let patience = self.leaving().map(|(_, since)| since + MOVE_PATIENCE).min();
        earliest(
            self.wants_dial().then_some(self.dial_at),
            patience.filter(|_| self.serving() > 0),
        )
    }

    /// Stopped, with every connection ended.
    pub fn done(&self) -> bool {
        self.stopping && self.links.is_empty()
    }

    /// Connections up and counted.
    pub fn serving(&self) -> usize {
        self.links
            .values()
            .filter(|s| matches!(s, State::Serving { .. }))
            .count()
    }

    /// The kas of the connections up, counted or moving (a moving one serves until its
    /// replacement is up), in link order: where the replica can be reached now (the
    /// simulation's record of where it was).
    pub fn reachable_kas(&self) -> Vec<String> {
        self.links
            .values()
            .filter_map(|s| match s {
                State::Serving { kas } | State::Moving { kas, .. } => Some(kas.clone()),
                _ => None,
            })
            .collect()
    }

    /// Distinct kas wanted now.
    fn want(&self) -> usize {
        let want = self.config.want.max(1);
        match self.live_kas {
            0 => want,
            live => want.min(live as usize),
        }
    }

    fn wants_dial(&self) -> bool {
        !self.stopping
            && self.serving() < self.want()
            && !self
                .links
                .values()
                .any(|s| matches!(s, State::Dialing | State::Declined))
    }

    fn act(&mut self, now: Time) {
        if self.wants_dial() && now >= self.dial_at {
            let link = Link(self.next);
            self.next += 1;
            self.links.insert(link, State::Dialing);
            self.outputs.push_back(LinksOutput::Dial(link));
        }
        let (serving, full) = (self.serving(), self.serving() >= self.want());
        let patient = |since: Time| serving > 0 && now >= since + MOVE_PATIENCE;
        let done: Vec<Link> = self
            .links
            .iter()
            .filter_map(|(l, s)| match s {
                State::Moving {
                    since, stopping, ..
                } if full || (*stopping && patient(*since)) => Some(*l),
                _ => None,
            })
            .collect();
        for link in done {
            self.leave(link, LinksOutput::Drain(link));
        }
    }

    /// The connections asked to move by a stopping kas, and since when.
    fn leaving(&self) -> impl Iterator<Item = (Link, Time)> + '_ {
        self.links.iter().filter_map(|(l, s)| match s {
            State::Moving {
                since,
                stopping: true,
                ..
            } => Some((*l, *since)),
            _ => None,
        })
    }

    fn leave(&mut self, link: Link, order: LinksOutput) {
        self.links.insert(link, State::Leaving);
        self.outputs.push_back(order);
    }

    /// The next dial after one that drew the wrong kas (held already, or stopping).
    fn redraw(&mut self, now: Time) {
        self.dial_at = now + self.config.backoff.delay(0, &mut self.rng);
    }

    fn back_off(&mut self, now: Time) {
        self.dial_at = now + self.config.backoff.delay(self.failures, &mut self.rng);
        self.failures = self.failures.saturating_add(1);
    }
}

#[cfg(test)]
mod tests;
