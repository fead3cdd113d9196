//! How a call from GitLab finds a kas holding a tunnel of its agent.
//!
//! One router per kas, for the calls that arrived on its public API. For each call:
//! 1. If this kas holds a tunnel of the agent, try it first ([`Target::Local`]).
//! 2. Otherwise subscribe to the agent's tunnel events and, only once the subscription is
//!    confirmed, look up which kas replicas hold its tunnels: a tunnel registered after the
//!    lookup read is then announced to us, so no wake-up is lost. Lookups for one agent are
//!    shared by all its waiting calls.
//! 3. Try those kas in random order (never itself; recently failed ones last). A kas that
//!    refuses before delivery ([`RouterInput::AttemptRefused`]) makes the router try the
//!    next one. The refusal is remembered for `failure_memory`, for what it was about only:
//!    the agent, and the replica when the call was pinned to one. (Remembered per kas, one
//!    pinned refusal once sent every call of every agent elsewhere for 30 s.) Once a call
//!    may have reached an agent the router never retries it: the driver reports
//!    [`RouterInput::Finished`] whatever the outcome (at-most-once).
//! 4. With no kas left, wait for a tunnel event (pub-sub, or a local tunnel). While the
//!    pub-sub connection is up ([`RouterInput::PubSubUp`]), the last lookup succeeded and
//!    no kas refused the call since, that is all: no event is lost on a live connection,
//!    and a lost connection re-runs every lookup when it is back. A call that came after
//!    an event that raced its lookup never saw that event: it looks up again. Otherwise
//!    the call also polls (looks up again) on a jittered backoff.
//! 5. At the deadline a call that is not with a kas fails with
//!    [`RouteError::NotConnected`]; one still in an attempt is failed `grace` later.
//! 6. After an agent's last call the router keeps its subscription for `linger`, and with
//!    it what it knows: the kas of the last lookup, kept current by the agent's tunnel
//!    events. A call in that time skips the subscribe and the lookup (no Redis round trip)
//!    as long as pub-sub stayed up and no event raced the lookup. A kas refusing a call
//!    drops that knowledge, so a kas that died without an event costs one refusal.
//!
//! The kas that receives a forwarded call serves it from its own registry only and never
//! asks a router, so a call takes at most two kas hops.
//!
//! Driving contract: feed [`Router::handle_input`], drain [`Router::poll_output`], call
//! [`Router::handle_timeout`] at [`Router::poll_timeout`].

use crate::backoff::Backoff;
use crate::fixed_hash::{Map, Set};
use crate::ids::{AgentId, ConnectionId, KasId, RequestId};
use crate::rng::Rng;
use crate::time::Time;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};
use std::time::Duration;

/// What the driver tells the router.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RouterInput {
    /// A call for the agent (the replica, when set) arrived; give up at `deadline`.
    Start {
        /// The call.
        request: RequestId,
        /// The wanted agent.
        agent: AgentId,
        /// The wanted replica, if any.
        connection: Option<ConnectionId>,
        /// The caller's deadline.
        deadline: Time,
    },
    /// This kas gained its first or lost its last tunnel of the agent (from the registry).
    LocalPresence {
        /// The agent.
        agent: AgentId,
        /// Whether this kas holds a tunnel of it now.
        present: bool,
    },
    /// The subscription to the agent's tunnel events is active.
    Subscribed {
        /// The agent.
        agent: AgentId,
    },
    /// The kas replicas whose tunnel records for the agent are live.
    LookupDone {
        /// The agent.
        agent: AgentId,
        /// Their ids, in any order; this kas's own id may be among them.
        kas: Vec<KasId>,
    },
    /// The lookup failed (store unreachable).
    LookupFailed {
        /// The agent.
        agent: AgentId,
    },
    /// A tunnel event arrived on the agent's channel.
    TunnelEvent {
        /// The agent.
        agent: AgentId,
        /// The kas whose tunnels changed.
        kas: KasId,
        /// Whether that kas gained (`true`) or lost its tunnels of the agent.
        connected: bool,
    },
    /// The pub-sub connection is up, with every subscription in place: events may have
    /// been missed before, so every waiting call looks again, then waits without polling.
    PubSubUp,
    /// The pub-sub connection is down: waiting calls poll until it is up again.
    PubSubDown,
    /// The target refused the call before any agent saw it (no tunnel there, kas
    /// unreachable before sending): the router may try elsewhere.
    AttemptRefused {
        /// The call.
        request: RequestId,
    },
    /// The call is over: answered, failed after it may have been delivered, or cancelled by
    /// the caller. The router forgets it.
    Finished {
        /// The call.
        request: RequestId,
    },
}

/// Where to send a call.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// This kas's own tunnel registry.
    Local,
    /// Another kas, over the private API.
    Kas(KasId),
}

/// What the router asks of the driver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RouterOutput {
    /// Subscribe to the agent's tunnel events; answer with [`RouterInput::Subscribed`].
    Subscribe(AgentId),
    /// Drop that subscription.
    Unsubscribe(AgentId),
    /// Read the agent's live tunnel records; answer with `LookupDone` or `LookupFailed`.
    Lookup(AgentId),
    /// Send the call to `target`; answer with `AttemptRefused` or `Finished`.
    Attempt {
        /// The call.
        request: RequestId,
        /// Where to.
        target: Target,
    },
    /// End the call with this error; the router has forgotten it (abandon any attempt).
    Fail {
        /// The call.
        request: RequestId,
        /// Why.
        error: RouteError,
    },
    /// The call's routing took this step (only with [`RouterConfig::steps`]): for its
    /// trace, nothing to do.
    Step {
        /// The call.
        request: RequestId,
        /// What it is doing now.
        step: RouteStep,
    },
}

/// What a call's routing is doing, from the step on until the next: where its time goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RouteStep {
    /// It waits for the agent's tunnel records: a subscription to the agent's events, then
    /// a lookup (shared with the agent's other calls waiting for one).
    LookingUp,
    /// It knows `kas` other kas holding tunnels of the agent (`None`: the lookup failed);
    /// `remembered`: from what the agent's subscription kept, with no lookup.
    Found {
        /// How many, this kas not counted.
        kas: Option<u32>,
        /// Known without a lookup.
        remembered: bool,
    },
    /// It is tried at `target`, its `attempt`th try.
    Attempt {
        /// Where.
        target: Target,
        /// 1 for the first.
        attempt: u32,
    },
    /// Nowhere is left to try: it waits, because of `reason`.
    Waiting(WaitReason),
    /// A tunnel of the agent appeared: it tries there next.
    Woken,
}

/// Why a call waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitReason {
    /// No kas holds a tunnel of the agent (of the replica, when pinned): it waits for one
    /// to be announced.
    NoTunnel,
    /// Every kas that held one refused the call: it waits for an announcement or a poll.
    Refused,
    /// The store could not be read: it polls.
    StoreFailing,
    /// The pub-sub connection is down, so no announcement can come: it polls.
    PubSubDown,
    /// Every tunnel of the agent at this kas is busy: it waits for one to be free (reported
    /// by the node, which holds the tunnels).
    TunnelsBusy,
}

impl WaitReason {
    /// Its name in traces.
    pub fn as_str(self) -> &'static str {
        match self {
            WaitReason::NoTunnel => "no_tunnel",
            WaitReason::Refused => "refused",
            WaitReason::StoreFailing => "store_failing",
            WaitReason::PubSubDown => "pubsub_down",
            WaitReason::TunnelsBusy => "tunnels_busy",
        }
    }
}

/// Why a call could not be routed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RouteError {
    /// No tunnel of the agent became reachable before the deadline.
    NotConnected {
        /// The agent.
        agent: AgentId,
        /// The replica that was asked for, if any.
        connection: Option<ConnectionId>,
    },
    /// An attempt was still running `grace` after the deadline.
    DeadlineExceeded {
        /// The agent.
        agent: AgentId,
    },
}

impl std::fmt::Display for RouteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RouteError::NotConnected {
                agent,
                connection: None,
            } => write!(f, "agent {agent} is not connected"),
            RouteError::NotConnected {
                agent,
                connection: Some(c),
            } => write!(f, "agent {agent} connection {c} is not connected"),
            RouteError::DeadlineExceeded { agent } => {
                write!(f, "deadline exceeded while calling agent {agent}")
            }
        }
    }
}

impl std::error::Error for RouteError {}

/// Router settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterConfig {
    /// Delays between safety-net polls of a waiting call.
    pub poll_backoff: Backoff,
    /// How long a kas that refused a call is tried last for calls of that agent (and
    /// replica, when the call named one).
    pub failure_memory: Duration,
    /// How long past its deadline a call in an attempt may run before the router fails it.
    pub grace: Duration,
    /// How long an agent's subscription, and what it tells, outlives the agent's last
    /// call; zero unsubscribes at once.
    pub linger: Duration,
    /// How long a call waits for a free tunnel among this kas's busy ones while another
    /// kas is known to hold the agent; then the others are tried.
    pub local_patience: Duration,
    /// Report each call's steps ([`RouterOutput::Step`]), for traces; off, none is made.
    pub steps: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// An attempt at `Route::current` is under way.
    Attempting,
    /// Waiting for the agent's lookup.
    NeedLookup,
    /// Waiting for an event, or the safety-net poll at `poll_at` (no timer when that is
    /// past the deadline).
    Waiting { poll_at: Time },
    /// Waiting for an event alone: pub-sub is up, the subscription active, and the last
    /// lookup told everything (the deadline timer ends it).
    Listening,
}

impl Phase {
    /// Waiting for something to happen: an event, a poll or the deadline.
    fn waiting(self) -> bool {
        matches!(self, Phase::Waiting { .. } | Phase::Listening)
    }
}

/// What a call's lookups told of the agent's tunnels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Known {
    /// No lookup has answered yet.
    Nothing,
    /// The last lookup failed.
    Failed,
    /// A kas refused the call since the last lookup.
    Refused,
    /// The last lookup succeeded and no kas refused the call since: with pub-sub up, an
    /// event is all it needs.
    Everything,
}

#[derive(Debug)]
struct Route {
    agent: AgentId,
    connection: Option<ConnectionId>,
    deadline: Time,
    phase: Phase,
    candidates: VecDeque<Target>,
    current: Option<Target>,
    /// A tunnel event arrived since the last lookup was issued for this call.
    woken: bool,
    known: Known,
    polls: u32,
    /// Targets tried so far.
    attempts: u32,
}

#[derive(Debug, Default)]
struct AgentRoutes {
    requests: BTreeSet<RequestId>,
    subscription: Subscription,
    lookup: Lookup,
    /// The other kas holding tunnels of the agent: the last lookup with every event since.
    /// Only while the subscription stayed active and pub-sub up.
    known: Option<BTreeSet<KasId>>,
    /// Without calls since; unsubscribed once `linger` has passed.
    idle_since: Option<Time>,
}

/// An agent's lookup of its tunnel records.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Lookup {
    /// None in flight.
    #[default]
    Idle,
    /// One in flight.
    InFlight {
        /// An event arrived, or pub-sub went down, since it was sent: its result may be
        /// stale, so it answers the waiting calls but is not kept.
        raced: bool,
        /// The subscription became active since it was sent (a poll sent while pub-sub was
        /// down): it may have read the store before a record was announced that the
        /// subscription missed, so the calls it leaves waiting look up again.
        early: bool,
    },
}

impl Lookup {
    /// An event arrived, or pub-sub went down: a lookup in flight may answer stale.
    fn race(&mut self) {
        if let Lookup::InFlight { raced, .. } = self {
            *raced = true;
        }
    }

    /// The subscription became active: a lookup in flight may have read too early.
    fn subscribed_meanwhile(&mut self) {
        if let Lookup::InFlight { early, .. } = self {
            *early = true;
        }
    }
}

/// What a refusal says a kas lacks: a tunnel of the agent, or of one of its replicas.
type Refusal = (AgentId, Option<ConnectionId>, KasId);

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Subscription {
    #[default]
    None,
    Pending,
    Active,
}

/// Routes of the calls that arrived at one kas. See the module docs.
#[derive(Debug)]
pub struct Router {
    config: RouterConfig,
    self_id: KasId,
    rng: Rng,
    routes: Map<RequestId, Route>,
    agents: Map<AgentId, AgentRoutes>,
    local: Set<AgentId>,
    /// When a kas last refused a call, by what the refusal was about: the agent, and the
    /// replica for a pinned call.
    failed_at: BTreeMap<Refusal, Time>,
    /// Deadlines, deadline-plus-grace instants and polls of live calls: a call's entries
    /// go when it does, so the set (and the engine's wake-ups) follow the calls in flight,
    /// not the call rate times the deadline.
    timers: BTreeSet<(Time, RequestId)>,
    /// When lingering agents may be unsubscribed.
    linger_timers: BinaryHeap<Reverse<(Time, AgentId)>>,
    outputs: VecDeque<RouterOutput>,
    pubsub_up: bool,
}

impl Router {
    /// A router of kas `self_id`; `seed` drives shuffling and jitter.
    pub fn new(config: RouterConfig, self_id: KasId, seed: u64) -> Self {
        Router {
            config,
            self_id,
            rng: Rng::new(seed),
            routes: Map::default(),
            agents: Map::default(),
            local: Set::default(),
            failed_at: BTreeMap::new(),
            timers: BTreeSet::new(),
            linger_timers: BinaryHeap::new(),
            outputs: VecDeque::new(),
            pubsub_up: false,
        }
    }

    /// Applies one input at `now`. Inputs naming calls the router has forgotten are ignored.
    pub fn handle_input(&mut self, now: Time, input: RouterInput) {
        match input {
            RouterInput::Start {
                request,
                agent,
                connection,
                deadline,
            } => self.start(now, request, agent, connection, deadline),
            RouterInput::LocalPresence { agent, present } => {
                if present {
                    self.local.insert(agent);
                    let me = &self.self_id;
                    self.failed_at.retain(|(a, _, k), _| (*a, k) != (agent, me));
                    self.wake(now, agent, Target::Local);
                } else {
                    self.local.remove(&agent);
                    self.drop_candidate(agent, &Target::Local);
                }
            }
            RouterInput::Subscribed { agent } => {
                if let Some(a) = self.agents.get_mut(&agent) {
                    a.subscription = Subscription::Active;
                    a.lookup.subscribed_meanwhile();
                    if self.any_in_phase(agent, Phase::NeedLookup) {
                        self.lookup(agent);
                    }
                }
            }
            RouterInput::LookupDone { agent, kas } => self.lookup_done(now, agent, Some(kas)),
            RouterInput::LookupFailed { agent } => self.lookup_done(now, agent, None),
            RouterInput::TunnelEvent {
                agent,
                kas,
                connected,
            } => {
                // This kas's own tunnels are reported first-hand, as `LocalPresence`.
                if kas == self.self_id {
                    return;
                }
                if let Some(a) = self.agents.get_mut(&agent) {
                    a.lookup.race();
                    if connected {
                        if let Some(known) = &mut a.known {
                            known.insert(kas.clone());
                        }
                    } else {
                        // Not trusted to remove what an earlier event or lookup said: one
                        // delivered out of order would hide a kas that does hold tunnels,
                        // and no later event would bring it back (a live record is not
                        // announced again). The next call looks the agent up. A stale
                        // "connected" costs one refused attempt, which forgets `known` too.
                        a.known = None;
                    }
                }
                if connected {
                    self.failed_at
                        .retain(|(a, _, k), _| (*a, k) != (agent, &kas));
                    self.wake(now, agent, Target::Kas(kas));
                } else {
                    self.drop_candidate(agent, &Target::Kas(kas));
                }
            }
            RouterInput::PubSubDown => {
                self.pubsub_up = false;
                for a in self.agents.values_mut() {
                    a.known = None;
                    a.lookup.race();
                    // Re-subscribed by the reconnection, but active again only once
                    // confirmed: a lookup before that could miss a record announced
                    // between its read and the subscription (a lingering subscription
                    // made this likely: agents vanished after a Redis restart).
                    if a.subscription == Subscription::Active {
                        a.subscription = Subscription::Pending;
                    }
                }
                for id in self.sorted_requests() {
                    let r = self.routes.get_mut(&id).expect("listed above");
                    let past =
                        matches!(r.phase, Phase::Waiting { poll_at } if poll_at >= r.deadline);
                    if past || r.phase == Phase::Listening {
                        self.schedule_poll(now, id);
                        self.step(id, || RouteStep::Waiting(WaitReason::PubSubDown));
                    }
                }
            }
            RouterInput::PubSubUp => {
                self.pubsub_up = true;
                let ids: Vec<RequestId> = self.sorted_requests();
                for id in ids {
                    if let Some(r) = self.routes.get_mut(&id) {
                        r.woken = true;
                        if r.phase.waiting() {
                            self.discover(now, id);
                        }
                    }
                }
            }
            RouterInput::AttemptRefused { request } => {
                let Some(r) = self.routes.get_mut(&request) else {
                    return;
                };
                if r.phase != Phase::Attempting {
                    return;
                }
                if r.known == Known::Everything {
                    r.known = Known::Refused;
                }
                let refused = r.current.take();
                if refused == Some(Target::Local) {
                    // This kas's tunnels stayed busy past the patience: the others first.
                    let me = self.self_id.clone();
                    self.failed_at.insert((r.agent, r.connection, me), now);
                }
                if let Some(Target::Kas(k)) = refused {
                    self.failed_at.insert((r.agent, r.connection, k), now);
                    // A replica missing there says nothing about the agent's other tunnels.
                    if r.connection.is_none()
                        && let Some(a) = self.agents.get_mut(&r.agent)
                    {
                        a.known = None;
                    }
                }
                self.try_next(now, request);
            }
            RouterInput::Finished { request } => self.forget(now, request),
        }
    }

    /// Fails calls past their deadline and runs polls due at `now`.
    pub fn handle_timeout(&mut self, now: Time) {
        let memory = self.config.failure_memory;
        self.failed_at.retain(|_, at| *at + memory > now);
        while let Some(Reverse((at, agent))) = self.linger_timers.peek().cloned() {
            if at > now {
                break;
            }
            self.linger_timers.pop();
            let done = self.agents.get(&agent).is_some_and(|a| {
                a.idle_since
                    .is_some_and(|since| since + self.config.linger <= now)
            });
            if done {
                self.unsubscribe(agent);
            }
        }
        while let Some(&(at, request)) = self.timers.first() {
            if at > now {
                break;
            }
            self.timers.pop_first();
            let Some(r) = self.routes.get(&request) else {
                continue;
            };
            let error = match r.phase {
                Phase::Attempting if now >= r.deadline + self.config.grace => {
                    Some(RouteError::DeadlineExceeded { agent: r.agent })
                }
                Phase::Attempting => None,
                _ if now >= r.deadline => Some(RouteError::NotConnected {
                    agent: r.agent,
                    connection: r.connection,
                }),
                Phase::Waiting { poll_at } if now >= poll_at => {
                    self.discover(now, request);
                    None
                }
                _ => None,
            };
            if let Some(error) = error {
                self.forget(now, request);
                self.outputs
                    .push_back(RouterOutput::Fail { request, error });
            }
        }
    }

    /// The next command for the driver.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<RouterOutput> {
        self.outputs.pop_front()
    }

    /// When to call [`Self::handle_timeout`] next (may be early, never late).
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Time> {
        let call = self.timers.first().map(|t| t.0);
        let linger = self.linger_timers.peek().map(|r| r.0.0);
        call.into_iter().chain(linger).min()
    }

    /// Calls being routed.
    pub fn request_count(&self) -> usize {
        self.routes.len()
    }

    /// Agents with a subscription requested or active.
    pub fn subscription_count(&self) -> usize {
        self.agents
            .values()
            .filter(|a| a.subscription != Subscription::None)
            .count()
    }

    fn start(
        &mut self,
        now: Time,
        request: RequestId,
        agent: AgentId,
        connection: Option<ConnectionId>,
        deadline: Time,
    ) {
        if self.routes.contains_key(&request) {
            return;
        }
        self.routes.insert(
            request,
            Route {
                agent,
                connection,
                deadline,
                phase: Phase::NeedLookup,
                candidates: VecDeque::new(),
                current: None,
                woken: false,
                known: Known::Nothing,
                polls: 0,
                attempts: 0,
            },
        );
        let a = self.agents.entry(agent).or_default();
        a.requests.insert(request);
        a.idle_since = None;
        self.timers.insert((deadline, request));
        self.timers.insert((deadline + self.config.grace, request));
        if self.local.contains(&agent) {
            self.routes
                .get_mut(&request)
                .expect("inserted above")
                .candidates
                .push_back(Target::Local);
            self.try_next(now, request);
        } else {
            self.discover(now, request);
        }
    }

    /// Puts the call into discovery: subscribe first, look up once subscribed; or take
    /// what the subscription already tells.
    fn discover(&mut self, now: Time, request: RequestId) {
        let Some(r) = self.routes.get_mut(&request) else {
            return;
        };
        r.phase = Phase::NeedLookup;
        r.woken = false;
        let agent = r.agent;
        let remembered = self.pubsub_up
            && (self.agents.get(&agent))
                .is_some_and(|a| a.subscription == Subscription::Active && a.known.is_some());
        if !remembered {
            self.step(request, || RouteStep::LookingUp);
        }
        let a = self.agents.entry(agent).or_default();
        match (a.subscription, &a.known) {
            (Subscription::None, _) => {
                a.subscription = Subscription::Pending;
                self.outputs.push_back(RouterOutput::Subscribe(agent));
            }
            // A subscription awaiting its renewal after a pub-sub loss: while pub-sub is
            // down, a poll looks up anyway (its result is not kept); once it is up, the
            // lookup waits for the confirmation.
            (Subscription::Pending, _) if !self.pubsub_up => self.lookup(agent),
            (Subscription::Pending, _) => {}
            (Subscription::Active, Some(known)) if self.pubsub_up => {
                let kas: Vec<KasId> = known.iter().cloned().collect();
                self.take_lookup(now, request, agent, Some(&kas), true);
            }
            (Subscription::Active, _) => self.lookup(agent),
        }
    }

    fn lookup(&mut self, agent: AgentId) {
        if let Some(a) = self.agents.get_mut(&agent)
            && a.lookup == Lookup::Idle
        {
            a.lookup = Lookup::InFlight {
                raced: false,
                early: false,
            };
            self.outputs.push_back(RouterOutput::Lookup(agent));
        }
    }

    fn lookup_done(&mut self, now: Time, agent: AgentId, kas: Option<Vec<KasId>>) {
        let Some(a) = self.agents.get_mut(&agent) else {
            return;
        };
        let (raced, early) = match std::mem::take(&mut a.lookup) {
            Lookup::InFlight { raced, early } => (raced, early),
            Lookup::Idle => (false, false),
        };
        let keep = self.pubsub_up && a.subscription == Subscription::Active && !raced && !early;
        a.known = match &kas {
            Some(kas) if keep => Some(
                kas.iter()
                    .filter(|k| **k != self.self_id)
                    .cloned()
                    .collect(),
            ),
            _ => None,
        };
        let waiting: Vec<RequestId> = a
            .requests
            .iter()
            .copied()
            .filter(|id| self.routes[id].phase == Phase::NeedLookup)
            .collect();
        for id in waiting.iter().copied() {
            self.take_lookup(now, id, agent, kas.as_deref(), false);
        }
        if early || raced {
            // The answer may predate a tunnel announced before the calls it leaves waiting
            // came: since pub-sub was back, or since the event that raced it (calls there
            // then were woken by it). They look up again.
            for id in waiting {
                let waits = |r: &Route| r.phase.waiting();
                if self.routes.get(&id).is_some_and(waits) {
                    self.discover(now, id);
                }
            }
        }
    }

    /// Gives the call the result of a lookup (`None`: it failed; `remembered`: what the
    /// subscription kept) and moves it on.
    fn take_lookup(
        &mut self,
        now: Time,
        id: RequestId,
        agent: AgentId,
        kas: Option<&[KasId]>,
        remembered: bool,
    ) {
        let connection = self.routes[&id].connection;
        let targets = match kas {
            Some(kas) => self.order(now, agent, connection, kas),
            None => Vec::new(),
        };
        self.step(id, || RouteStep::Found {
            kas: kas.map(|_| {
                let others = targets.iter().filter(|t| matches!(t, Target::Kas(_)));
                u32::try_from(others.count()).unwrap_or(u32::MAX)
            }),
            remembered,
        });
        let r = self.routes.get_mut(&id).expect("a live route");
        r.known = if kas.is_some() {
            Known::Everything
        } else {
            Known::Failed
        };
        for t in targets {
            if !r.candidates.contains(&t) {
                r.candidates.push_back(t);
            }
        }
        if kas.is_none() {
            r.woken = false; // the store is failing: back off rather than spin
        }
        self.try_next(now, id);
    }

    /// The candidates for a lookup result: shuffled, kas that recently refused this agent
    /// (this replica, for a pinned call) last, this kas only as `Local` and only while it
    /// holds a tunnel of the agent.
    fn order(
        &mut self,
        now: Time,
        agent: AgentId,
        connection: Option<ConnectionId>,
        kas: &[KasId],
    ) -> Vec<Target> {
        let mut others: Vec<&KasId> = kas.iter().filter(|k| **k != self.self_id).collect();
        others.sort();
        others.dedup();
        self.rng.shuffle(&mut others);
        let memory = self.config.failure_memory;
        let local = self.local.contains(&agent).then_some(Target::Local);
        let mut targets: Vec<Target> = local
            .into_iter()
            .chain(others.into_iter().map(|k| Target::Kas(k.clone())))
            .collect();
        // This kas first, unless its tunnels stayed busy past the patience lately.
        targets.sort_by_key(|t| {
            let k = match t {
                Target::Local => &self.self_id,
                Target::Kas(k) => k,
            };
            self.failed_at
                .get(&(agent, connection, k.clone()))
                .is_some_and(|at| *at + memory > now)
        });
        targets
    }

    /// Until when a call may wait for this kas's busy tunnels: the patience, until a lookup
    /// has told where else the agent is, and while another kas is a candidate, is known to
    /// hold the agent, or refused the call lately while where the agent is is not known (it
    /// may have a tunnel free by now); else its deadline. (A refusal remembered after the
    /// subscription's view says no other kas holds the agent sent calls looking every
    /// patience for a kas that had none.)
    pub fn local_wait_until(&self, now: Time, request: RequestId) -> Option<Time> {
        let r = self.routes.get(&request)?;
        let unlooked = r.known == Known::Nothing;
        let candidate = r.candidates.iter().any(|t| matches!(t, Target::Kas(_)));
        let view = self.agents.get(&r.agent).and_then(|a| a.known.as_ref());
        let known = view.is_some_and(|k| !k.is_empty());
        let refused = view.is_none()
            && self
                .failed_at
                .range((r.agent, r.connection, KasId(String::new()))..)
                .take_while(|((a, c, _), _)| (*a, *c) == (r.agent, r.connection))
                .any(|((_, _, k), at)| {
                    *k != self.self_id && *at + self.config.failure_memory > now
                });
        let elsewhere = unlooked || candidate || known || refused;
        Some(if elsewhere {
            r.deadline.min(now + self.config.local_patience)
        } else {
            r.deadline
        })
    }

    fn try_next(&mut self, now: Time, request: RequestId) {
        let Some(r) = self.routes.get_mut(&request) else {
            return;
        };
        if let Some(target) = r.candidates.pop_front() {
            r.phase = Phase::Attempting;
            r.current = Some(target.clone());
            r.attempts = r.attempts.saturating_add(1);
            let attempt = r.attempts;
            self.step(request, || RouteStep::Attempt {
                target: target.clone(),
                attempt,
            });
            self.outputs
                .push_back(RouterOutput::Attempt { request, target });
        } else if r.woken || r.known == Known::Nothing {
            self.discover(now, request);
        } else if self.pubsub_up
            && r.known == Known::Everything
            && self.agents.get(&r.agent).map(|a| a.subscription) == Some(Subscription::Active)
        {
            r.phase = Phase::Listening;
            self.step(request, || RouteStep::Waiting(WaitReason::NoTunnel));
        } else {
            let reason = match r.known {
                _ if !self.pubsub_up => WaitReason::PubSubDown,
                Known::Failed => WaitReason::StoreFailing,
                Known::Refused => WaitReason::Refused,
                Known::Nothing | Known::Everything => WaitReason::NoTunnel,
            };
            self.schedule_poll(now, request);
            self.step(request, || RouteStep::Waiting(reason));
        }
    }

    /// Reports the call's step when [`RouterConfig::steps`] asks for it.
    fn step(&mut self, request: RequestId, step: impl FnOnce() -> RouteStep) {
        if self.config.steps {
            self.outputs.push_back(RouterOutput::Step {
                request,
                step: step(),
            });
        }
    }

    /// Waits with a safety-net poll after the next backoff delay.
    fn schedule_poll(&mut self, now: Time, request: RequestId) {
        let r = self.routes.get_mut(&request).expect("a live route");
        let delay = self.config.poll_backoff.delay(r.polls, &mut self.rng);
        r.polls = r.polls.saturating_add(1);
        let poll_at = now + delay;
        r.phase = Phase::Waiting { poll_at };
        if poll_at < r.deadline {
            self.timers.insert((poll_at, request));
        }
    }

    /// A tunnel of `agent` appeared at `target`: calls waiting for it try there at once;
    /// calls busy elsewhere add it to their candidates and look again when they run out.
    fn wake(&mut self, now: Time, agent: AgentId, target: Target) {
        let Some(a) = self.agents.get(&agent) else {
            return;
        };
        let ids: Vec<RequestId> = a.requests.iter().copied().collect();
        for id in ids {
            let r = self.routes.get_mut(&id).expect("agent lists live routes");
            r.woken = true;
            if r.current.as_ref() != Some(&target) && !r.candidates.contains(&target) {
                r.candidates.push_front(target.clone());
            }
            if r.phase.waiting() {
                r.woken = false;
                self.step(id, || RouteStep::Woken);
                self.try_next(now, id);
            }
        }
    }

    fn drop_candidate(&mut self, agent: AgentId, target: &Target) {
        if let Some(a) = self.agents.get(&agent) {
            for id in &a.requests {
                if let Some(r) = self.routes.get_mut(id) {
                    r.candidates.retain(|t| t != target);
                }
            }
        }
    }

    fn any_in_phase(&self, agent: AgentId, phase: Phase) -> bool {
        self.agents
            .get(&agent)
            .is_some_and(|a| a.requests.iter().any(|id| self.routes[id].phase == phase))
    }

    fn sorted_requests(&self) -> Vec<RequestId> {
        let mut ids: Vec<RequestId> = self.routes.keys().copied().collect();
        ids.sort();
        ids
    }

    fn forget(&mut self, now: Time, request: RequestId) {
        let Some(r) = self.routes.remove(&request) else {
            return;
        };
        self.timers.remove(&(r.deadline, request));
        self.timers
            .remove(&(r.deadline + self.config.grace, request));
        if let Phase::Waiting { poll_at } = r.phase {
            self.timers.remove(&(poll_at, request));
        }
        let Some(a) = self.agents.get_mut(&r.agent) else {
            return;
        };
        a.requests.remove(&request);
        if !a.requests.is_empty() {
            return;
        }
        if self.config.linger.is_zero() || a.subscription == Subscription::None {
            self.unsubscribe(r.agent);
        } else {
            a.idle_since = Some(now);
            self.linger_timers
                .push(Reverse((now + self.config.linger, r.agent)));
        }
    }

    /// Forgets an agent without calls, and drops its subscription.
    fn unsubscribe(&mut self, agent: AgentId) {
        if let Some(a) = self.agents.remove(&agent)
            && a.subscription != Subscription::None
        {
            self.outputs.push_back(RouterOutput::Unsubscribe(agent));
        }
    }
}

#[cfg(test)]
mod tests;
