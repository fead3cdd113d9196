//! One kas, whole: the tunnel registry, the tracker and the router wired together, with the
//! bookkeeping of every call this kas carries (where it is, whether it may have reached an
//! agent) and the table of agent connections and their tunnels.
//!
//! This is the composition production runs, the model test drives and the simulation
//! exercises: the driver (`kas-server`'s engine) only carries outputs to the network and
//! the network's answers back as inputs.
//!
//! At-most-once lives here. A call is in one of three places: routing (the router decides),
//! with a local tunnel ([`NodeOutput::Deliver`]), or with another kas
//! ([`NodeOutput::Forward`]). Only a refusal the driver reports with
//! [`NodeInput::Bounced`] or [`NodeInput::DeliveryFailed`] — nothing reached an agent —
//! sends a call back to its router; once a tunnel holds it, a cancellation waits for the
//! tunnel to drain the answer, and a failure ends it for good.
//!
//! A call for `C` (the driver's payload: the request frames and where the answer goes) is
//! stored once and handed out in the outputs that need it; the node never looks inside.

use crate::backoff::Backoff;
use crate::ids::{AgentId, ConnectionId, Holder, KasId, ProjectId, RequestId, TunnelId};
use crate::keys::Keys;
use crate::router::{
    RouteError, RouteStep, Router, RouterConfig, RouterInput, RouterOutput, Target, WaitReason,
};
use crate::time::{self, Time};
use crate::tracker::{Batch, Tracker, TrackerConfig, TrackerInput, TrackerOutput};
use crate::tunnel_registry::{RegistryConfig, RegistryInput, RegistryOutput, TunnelRegistry};
use kas_proto::registry::{ConnectedAgentInfo, KasInstanceInfo, TunnelEvent};
use prost::Message;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

/// Where a call came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// GitLab, on the public API: the router finds its agent.
    Public,
    /// Another kas, on the private API: served from this kas's tunnels or refused.
    Private,
}

/// How a call ended, as counted in metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// It reached an agent (or may have: a tunnel or forward held it).
    Delivered,
    /// No tunnel of the agent became reachable by the deadline.
    NotConnected,
    /// The deadline passed while waiting for a busy agent or during an attempt.
    DeadlineExceeded,
    /// The caller went away first.
    Cancelled,
    /// A call from another kas this kas could not serve.
    Refused,
}

/// Why the node ended a call that no agent saw (or that was abandoned mid-attempt).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallError {
    /// The router gave up.
    Route(RouteError),
    /// Every tunnel of the agent here stayed busy until the deadline.
    TunnelsBusy {
        /// The agent.
        agent: AgentId,
    },
    /// A forwarded call found no tunnel of its agent here.
    NoFreeTunnel {
        /// This kas.
        kas: KasId,
        /// The agent.
        agent: AgentId,
    },
}

impl CallError {
    /// True when the caller's deadline passed (rather than the agent being unreachable).
    pub fn is_deadline(&self) -> bool {
        matches!(
            self,
            CallError::Route(RouteError::DeadlineExceeded { .. }) | CallError::TunnelsBusy { .. }
        )
    }
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Route(e) => e.fmt(f),
            CallError::TunnelsBusy { agent } => {
                write!(
                    f,
                    "every tunnel of agent {agent} was busy until the deadline"
                )
            }
            CallError::NoFreeTunnel { kas, agent } => {
                write!(f, "kas {kas} holds no free tunnel of agent {agent}")
            }
        }
    }
}

/// What a call asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wanted {
    /// The agent.
    pub agent: AgentId,
    /// The replica, if the caller named one.
    pub connection: Option<ConnectionId>,
    /// The caller's deadline.
    pub deadline: Time,
    /// Whom the call counts against in the sharing of the agent's tunnels, if anyone.
    pub holder: Option<Holder>,
}

/// A message from the pub-sub connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PubSubEvent {
    /// The subscription is active: messages published from now on arrive.
    Subscribed(String),
    /// A message on a subscribed channel.
    Message {
        /// The channel.
        channel: String,
        /// The payload.
        payload: Vec<u8>,
    },
    /// The connection is up with every subscription in place: at start, and again after
    /// each loss (messages published while it was down are lost).
    Up,
    /// The connection was lost (closed, or its keep-alive `PING` went unanswered).
    Down,
}

/// What the driver tells the node.
#[derive(Debug)]
pub enum NodeInput<C> {
    /// An agent replica opened `GetConfiguration`. A replica may hold several streams here
    /// at once (a new one opened before an old one ended): its tunnels belong to all of
    /// them.
    AgentConnected(Box<ConnectedAgentInfo>),
    /// That stream ended; once the replica's last stream here ended, its tunnels are
    /// closed with it.
    AgentDisconnected {
        /// The agent.
        agent: AgentId,
        /// Its project.
        project: ProjectId,
        /// The stream's connection id.
        connection: ConnectionId,
    },
    /// A tunnel sent its descriptor. Refused with [`NodeError::ConnectionNotOpen`] when
    /// its connection is not open here.
    TunnelOpened {
        /// Its id.
        tunnel: TunnelId,
        /// The agent.
        agent: AgentId,
        /// The replica's connection.
        connection: ConnectionId,
    },
    /// The tunnel is alive.
    TunnelActivity(TunnelId),
    /// The tunnel's stream ended (reported once per tunnel the node accepted).
    TunnelClosed(TunnelId),
    /// A call from GitLab: route it.
    Route {
        /// Its id, unique in this kas.
        request: RequestId,
        /// What it wants.
        wanted: Wanted,
        /// The driver's payload.
        call: C,
    },
    /// A call from another kas: serve it from this kas's tunnels only.
    Serve {
        /// Its id, unique in this kas.
        request: RequestId,
        /// What it wants.
        wanted: Wanted,
        /// The driver's payload.
        call: C,
    },
    /// The tunnel of a [`NodeOutput::Deliver`] could not take the call (gone, or still
    /// draining): nothing reached the agent.
    DeliveryFailed {
        /// The call.
        request: RequestId,
        /// The tunnel.
        tunnel: TunnelId,
    },
    /// A streaming call reached an agent, or may have: its tunnel began sending it, or the
    /// serving kas said it handed it to a tunnel. It is never offered elsewhere from now
    /// on, and its deadline, which bounded its routing only, no longer applies: it lasts
    /// until its tunnel or forward ends it ([`NodeInput::CallDone`]) or its caller goes
    /// away.
    Delivered(RequestId),
    /// The call is over: its tunnel or forward saw the end (delivered, or possibly so).
    CallDone(RequestId),
    /// A tunnel or a kas did not take the call; nothing reached an agent.
    Bounced(RequestId),
    /// Another kas did not take the forwarded call because every tunnel of the agent there
    /// was busy ([`CallError::NoFreeTunnel`]): like [`NodeInput::Bounced`], and should the
    /// call end unrouted, it ends as [`CallError::TunnelsBusy`], as it would have on that
    /// kas, not as "not connected".
    BouncedBusy(RequestId),
    /// The caller went away.
    Cancel(RequestId),
    /// A tracker batch finished.
    BatchDone {
        /// The batch.
        batch: u64,
        /// Whether it committed.
        ok: bool,
    },
    /// A [`NodeOutput::ReadKas`] finished: the live kas ids with their incarnations, or
    /// `None` when the store failed.
    LiveKas(Option<BTreeMap<String, u64>>),
    /// The [`NodeOutput::Gc`] of these keys failed.
    GcFailed(Vec<String>),
    /// A [`NodeOutput::Lookup`] finished: the kas holding live tunnel records of the agent,
    /// or `None` when the store failed.
    LookupDone {
        /// The agent.
        agent: AgentId,
        /// The kas ids found.
        kas: Option<Vec<KasId>>,
    },
    /// The store answered (or failed) a health check.
    StoreHealth(bool),
    /// The pub-sub connection reported something.
    PubSub(PubSubEvent),
    /// kas is stopping, its agents moving elsewhere: from now on no call is given to a
    /// tunnel here. Calls waiting for one go back to their router (or, when another kas
    /// sent them, are refused) so that they are served elsewhere, and this kas's tunnel
    /// records are deleted and announced gone, so that routers stop choosing it. Calls in
    /// tunnels run on.
    Drain,
    /// Close every tunnel and delete this kas's records; answered by
    /// [`NodeOutput::ShutdownComplete`].
    Shutdown,
}

/// What the node asks of the driver.
#[derive(Debug)]
pub enum NodeOutput<C> {
    /// Subscribe to this channel; answer with `PubSub(Subscribed(channel))`.
    Subscribe(String),
    /// Drop that subscription.
    Unsubscribe(String),
    /// Read the live tunnel records of `agent` under `key`; answer with `LookupDone`.
    Lookup {
        /// The agent.
        agent: AgentId,
        /// Its tunnels-by-agent key.
        key: String,
    },
    /// Run this transaction batch; answer with `BatchDone`.
    Write(Batch),
    /// Read the live kas records of this hash; answer with `LiveKas`.
    ReadKas {
        /// The kas instances hash.
        key: String,
    },
    /// Remove expired fields of these keys; answer `GcFailed` if that failed.
    Gc {
        /// The keys.
        keys: Vec<String>,
    },
    /// Send the call down this tunnel; answer with `DeliveryFailed` if it cannot take it,
    /// then `CallDone` (or `Bounced`, when the tunnel ended before sending anything).
    Deliver {
        /// The call.
        request: RequestId,
        /// The claimed tunnel.
        tunnel: TunnelId,
        /// The payload.
        call: C,
        /// How long the call took to find the tunnel.
        waited: Duration,
    },
    /// Send the call to another kas; answer with `CallDone` or `Bounced`.
    Forward {
        /// The call.
        request: RequestId,
        /// Where to.
        kas: KasId,
        /// The payload.
        call: C,
        /// How long the call has been routing.
        waited: Duration,
    },
    /// Close this tunnel's stream (missed heartbeats, its connection ended, shutdown): drop
    /// what sends it calls, then report `TunnelClosed`.
    CloseTunnel(TunnelId),
    /// The node has forgotten the call: count it; with `error`, answer the caller with it
    /// (a refusal frame when the call came from another kas); a forward still running for a
    /// call not delivered is abandoned.
    Ended {
        /// The call.
        request: RequestId,
        /// Where it came from.
        origin: Origin,
        /// How it ended.
        outcome: Outcome,
        /// 1 when a forward held it at the end, else 0.
        hops: u32,
        /// The payload.
        call: C,
        /// What to tell the caller, when the node ends the call rather than a tunnel or
        /// forward.
        error: Option<CallError>,
    },
    /// The store became reachable (`true`) or unreachable.
    StoreHealth(bool),
    /// Every record of this kas is deleted after [`NodeInput::Shutdown`].
    ShutdownComplete,
    /// The node's machines disagreed (a bug in the node): log it loudly and count it.
    Inconsistent(String),
    /// A call's routing took this step (only with [`RouterConfig::steps`]): for its
    /// trace; its payload is [`KasNode::call`].
    Step {
        /// The call.
        request: RequestId,
        /// What it is doing now.
        step: RouteStep,
    },
}

/// An input the node did not apply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeError {
    /// A tunnel named a connection that is not open here (the agent's mistake).
    ConnectionNotOpen {
        /// The agent.
        agent: AgentId,
        /// The connection it named.
        connection: ConnectionId,
    },
    /// A pub-sub message that is not a tunnel event (broken or hostile store data).
    BadTunnelEvent {
        /// Its channel.
        channel: String,
    },
    /// The driver broke the contract: a bug in the driver, never the network's doing.
    DriverMistake(String),
}

impl std::fmt::Display for NodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NodeError::ConnectionNotOpen { agent, connection } => write!(
                f,
                "connection {connection} of agent {agent} is not open on this kas: open GetConfiguration first and use the connection id it returns"
            ),
            NodeError::BadTunnelEvent { channel } => {
                write!(f, "undecodable tunnel event on channel {channel}")
            }
            NodeError::DriverMistake(m) => write!(f, "driver mistake: {m}"),
        }
    }
}

impl std::error::Error for NodeError {}

/// Delays between retries of a failed registry batch, in production.
pub const BATCH_RETRY: Backoff = Backoff {
    initial: Duration::from_millis(100),
    max: Duration::from_secs(5),
    factor: 2,
};

/// Keys one registry batch writes at most, in production.
pub const MAX_KEYS_PER_BATCH: usize = 256;

/// Delays between a waiting call's safety-net polls, in production.
pub const POLL_BACKOFF: Backoff = Backoff {
    initial: Duration::from_millis(500),
    max: Duration::from_secs(10),
    factor: 2,
};

/// How long a call waits for this kas's busy tunnels while another kas holds the agent,
/// in production: agentk opens a tunnel as each is taken, so a healthy agent's pool refills
/// well within it.
pub const LOCAL_PATIENCE: Duration = Duration::from_millis(500);

/// How long a kas that refused a call is tried last for its agent, in production.
pub const FAILURE_MEMORY: Duration = Duration::from_secs(30);

/// Everything a node is built from: who it is, and its machines' settings.
/// [`NodeConfig::new`] gives GitLab kas's defaults and the production tuning; kas sets
/// what its configuration file says, tests what they need.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// This kas's id (its private API address).
    pub kas_id: KasId,
    /// Key and channel names.
    pub keys: Keys,
    /// Subscribe to tunnel events; without, waiting calls rely on polls alone.
    pub wakeups: bool,
    /// This kas's instance record (version, address, incarnation).
    pub instance: KasInstanceInfo,
    /// Seeds the machines' jitter.
    pub seed: u64,
    /// The tracker's record lifetimes and batching.
    pub tracker: TrackerConfig,
    /// The router's polls, memory of refusals, grace and subscription linger.
    pub router: RouterConfig,
    /// The tunnel registry's heartbeat timeout.
    pub registry: RegistryConfig,
}

impl NodeConfig {
    /// Kas `kas_id` with GitLab kas's defaults (records live 300 s, refreshed every 240 s,
    /// collected every 600 s; its liveness 30 s; heartbeats 60 s; subscriptions linger
    /// 60 s) and the production tuning.
    pub fn new(kas_id: KasId, keys: Keys) -> NodeConfig {
        NodeConfig {
            kas_id,
            keys,
            wakeups: true,
            instance: KasInstanceInfo::default(),
            seed: 0,
            tracker: TrackerConfig {
                ttl: Duration::from_secs(300),
                refresh: Duration::from_secs(240),
                gc: Duration::from_secs(600),
                liveness: Duration::from_secs(30),
                backoff: BATCH_RETRY,
                max_keys_per_batch: MAX_KEYS_PER_BATCH,
            },
            router: RouterConfig {
                poll_backoff: POLL_BACKOFF,
                failure_memory: FAILURE_MEMORY,
                local_patience: LOCAL_PATIENCE,
                grace: Duration::from_secs(2),
                linger: Duration::from_secs(60),
                steps: false,
            },
            registry: RegistryConfig {
                heartbeat_timeout: Duration::from_secs(60),
                // kas's default `agent.max_tunnels_per_connection`.
                tunnels_per_connection: 200,
            },
        }
    }
}

/// Sizes, for gauges.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeStats {
    /// Calls this kas holds.
    pub calls: usize,
    /// Of them, calls the router holds.
    pub routing: usize,
    /// Calls waiting for a busy agent's tunnel.
    pub tunnel_waiters: usize,
    /// Pub-sub subscriptions.
    pub subscriptions: usize,
    /// Open agent connections.
    pub connections: usize,
    /// Open tunnels.
    pub tunnels: usize,
}

/// One agent replica's connection here.
#[derive(Default)]
struct Connection {
    /// Its open `GetConfiguration` streams.
    streams: u32,
    tunnels: BTreeSet<TunnelId>,
    /// The most tunnels its replica opens (`AgentMeta::max_tunnels`; 0: unknown).
    max_tunnels: usize,
}

/// Where a call is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// With the router, or waiting here for a tunnel: nothing reached an agent.
    Routing,
    /// In a local tunnel, which ends it. `delivered`: it reached the agent, or may have
    /// ([`NodeInput::Delivered`]).
    Tunnel { delivered: bool },
    /// Forwarded to another kas, whose answer ends it. `delivered`: that kas handed it to
    /// a tunnel.
    Forward { delivered: bool },
}

impl Place {
    /// It reached an agent, or may have: it is never offered again.
    fn delivered(self) -> bool {
        matches!(
            self,
            Place::Tunnel { delivered: true } | Place::Forward { delivered: true }
        )
    }

    fn in_tunnel(self) -> bool {
        matches!(self, Place::Tunnel { .. })
    }
}

struct CallState<C> {
    call: C,
    wanted: Wanted,
    origin: Origin,
    place: Place,
    /// A kas holding the agent's tunnels refused it as all busy ([`NodeInput::BouncedBusy`]).
    found_busy: bool,
    started: Time,
}

/// One kas: see the module documentation.
pub struct KasNode<C> {
    config: NodeConfig,
    registry: TunnelRegistry,
    tracker: Tracker,
    router: Router,
    calls: BTreeMap<RequestId, CallState<C>>,
    connections: BTreeMap<(AgentId, ConnectionId), Connection>,
    tunnels: BTreeMap<TunnelId, (AgentId, ConnectionId)>,
    /// Tunnels the node closed (registry already told) whose `TunnelClosed` is still due.
    closing: BTreeSet<TunnelId>,
    channels: BTreeMap<String, AgentId>,
    store_healthy: bool,
    /// The pub-sub connection has been up before (so `Up` is a reconnection).
    pubsub_was_up: bool,
    /// [`NodeInput::Drain`] came: no call goes to a tunnel here any more.
    draining: bool,
    outputs: VecDeque<NodeOutput<C>>,
}

impl<C: Clone> KasNode<C> {
    /// A kas with no agents and no calls at `now`.
    pub fn new(now: Time, config: NodeConfig) -> Self {
        let c = &config;
        let tracker = Tracker::new(
            now,
            c.tracker.clone(),
            c.keys.clone(),
            c.kas_id.clone(),
            &c.instance,
            c.seed,
        );
        let router = Router::new(c.router, c.kas_id.clone(), c.seed.rotate_left(17));
        let mut node = KasNode {
            registry: TunnelRegistry::new(c.registry),
            tracker,
            router,
            config,
            calls: BTreeMap::new(),
            connections: BTreeMap::new(),
            tunnels: BTreeMap::new(),
            closing: BTreeSet::new(),
            channels: BTreeMap::new(),
            store_healthy: true,
            pubsub_was_up: false,
            draining: false,
            outputs: VecDeque::new(),
        };
        node.drain(now);
        node
    }

    /// Applies one input at `now`. An error means the input changed nothing.
    pub fn handle_input(&mut self, now: Time, input: NodeInput<C>) -> Result<(), NodeError> {
        let result = self.input(now, input);
        self.drain(now);
        result
    }

    /// Fires the timers due at `now`: call deadlines, polls, heartbeats, refreshes.
    pub fn handle_timeout(&mut self, now: Time) {
        self.registry.handle_timeout(now);
        self.tracker.handle_timeout(now);
        self.router.handle_timeout(now);
        self.drain(now);
    }

    /// The next thing for the driver to do, `None` when there is nothing.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<NodeOutput<C>> {
        self.outputs.pop_front()
    }

    /// When to call [`KasNode::handle_timeout`] next, `None` when no timer runs.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Time> {
        time::earliest(
            time::earliest(self.registry.poll_timeout(), self.tracker.poll_timeout()),
            self.router.poll_timeout(),
        )
    }

    /// The payload of a call this kas holds.
    pub fn call(&self, request: RequestId) -> Option<&C> {
        self.calls.get(&request).map(|s| &s.call)
    }

    /// Sizes, for gauges.
    pub fn stats(&self) -> NodeStats {
        NodeStats {
            calls: self.calls.len(),
            routing: self.router.request_count(),
            tunnel_waiters: self.registry.waiter_count(),
            subscriptions: self.channels.len(),
            connections: self.connections.len(),
            tunnels: self.tunnels.len(),
        }
    }

    /// The machines, read-only: for invariant checks in tests.
    pub fn parts(&self) -> (&TunnelRegistry, &Tracker, &Router) {
        (&self.registry, &self.tracker, &self.router)
    }

    fn input(&mut self, now: Time, input: NodeInput<C>) -> Result<(), NodeError> {
        match input {
            NodeInput::AgentConnected(info) => {
                let key = (AgentId(info.agent_id), ConnectionId(info.connection_id));
                let max_tunnels = info.agent_meta.as_ref().map_or(0, |m| m.max_tunnels);
                let c = self.connections.entry(key).or_default();
                c.streams += 1;
                c.max_tunnels = usize::try_from(max_tunnels).unwrap_or(usize::MAX);
                self.tracker
                    .handle_input(now, TrackerInput::AgentConnected(info));
            }
            NodeInput::AgentDisconnected {
                agent,
                project,
                connection,
            } => self.agent_disconnected(now, agent, project, connection)?,
            NodeInput::TunnelOpened {
                tunnel,
                agent,
                connection,
            } => self.tunnel_opened(now, tunnel, agent, connection)?,
            NodeInput::TunnelActivity(tunnel) => {
                if self.tunnels.contains_key(&tunnel) {
                    self.registry(now, RegistryInput::TunnelActivity { tunnel })?;
                } else if !self.closing.contains(&tunnel) {
                    return Err(mistake(format!("activity on unknown tunnel {tunnel}")));
                }
            }
            NodeInput::TunnelClosed(tunnel) => self.tunnel_closed(now, tunnel)?,
            NodeInput::Route {
                request,
                wanted,
                call,
            } => {
                self.admit(now, request, wanted, call, Origin::Public)?;
                self.router.handle_input(
                    now,
                    RouterInput::Start {
                        request,
                        agent: wanted.agent,
                        connection: wanted.connection,
                        deadline: wanted.deadline,
                    },
                );
            }
            NodeInput::Serve {
                request,
                wanted,
                call,
            } => {
                self.admit(now, request, wanted, call, Origin::Private)?;
                if self.draining {
                    self.bounced(now, request);
                } else {
                    self.registry(now, wants_tunnel(request, wanted, now))?;
                    self.busy_step(request);
                }
            }
            NodeInput::DeliveryFailed { request, tunnel } => {
                // The tunnel cannot be trusted with calls any more: close it, offer again.
                if self.tunnels.contains_key(&tunnel) {
                    self.close(now, tunnel)?;
                }
                self.bounced(now, request);
            }
            NodeInput::CallDone(request) => {
                // Released even when the call was ended already: its tunnel is free now.
                self.registry(now, RegistryInput::Release { request })?;
                self.router
                    .handle_input(now, RouterInput::Finished { request });
                self.end(request, Outcome::Delivered, None);
            }
            NodeInput::Delivered(request) => {
                let Some(state) = self.calls.get_mut(&request) else {
                    return Ok(()); // ended first (its caller went away)
                };
                let (Place::Tunnel { delivered } | Place::Forward { delivered }) = &mut state.place
                else {
                    return Err(mistake(format!(
                        "call {request} reported delivered while no tunnel or forward held it"
                    )));
                };
                *delivered = true;
                self.router
                    .handle_input(now, RouterInput::Finished { request });
            }
            NodeInput::Bounced(request) => self.bounced(now, request),
            NodeInput::BouncedBusy(request) => {
                if let Some(state) = self.calls.get_mut(&request) {
                    state.found_busy = true;
                }
                self.bounced(now, request);
            }
            NodeInput::Cancel(request) => self.cancel(now, request)?,
            NodeInput::BatchDone { batch, ok } => {
                if !ok {
                    self.set_store_health(now, false);
                }
                self.tracker
                    .handle_input(now, TrackerInput::BatchResult { batch, ok });
            }
            NodeInput::LiveKas(live) => {
                self.tracker.handle_input(now, TrackerInput::LiveKas(live));
            }
            NodeInput::GcFailed(keys) => {
                self.tracker.handle_input(now, TrackerInput::GcFailed(keys));
            }
            NodeInput::LookupDone { agent, kas } => {
                let input = match kas {
                    Some(kas) => RouterInput::LookupDone { agent, kas },
                    None => RouterInput::LookupFailed { agent },
                };
                self.router.handle_input(now, input);
            }
            NodeInput::StoreHealth(ok) => self.set_store_health(now, ok),
            NodeInput::PubSub(event) => return self.pubsub(now, event),
            NodeInput::Drain => self.drain_tunnels(now)?,
            NodeInput::Shutdown => self.shutdown(now)?,
        }
        Ok(())
    }

    /// A replica's stream ended: with its last stream here, its tunnels and records go.
    fn agent_disconnected(
        &mut self,
        now: Time,
        agent: AgentId,
        project: ProjectId,
        connection: ConnectionId,
    ) -> Result<(), NodeError> {
        let key = (agent, connection);
        if let Some(c) = self.connections.get_mut(&key) {
            c.streams = c.streams.saturating_sub(1);
            if c.streams > 0 {
                return Ok(()); // another stream of the replica holds it here
            }
        }
        // Its tunnels go with it: the agent reconnects both.
        let c = self.connections.remove(&key).unwrap_or_default();
        for tunnel in c.tunnels {
            self.close(now, tunnel)?;
        }
        self.tracker.handle_input(
            now,
            TrackerInput::AgentDisconnected {
                agent,
                project,
                connection,
            },
        );
        Ok(())
    }

    /// A tunnel of an open connection sent its descriptor.
    fn tunnel_opened(
        &mut self,
        now: Time,
        tunnel: TunnelId,
        agent: AgentId,
        connection: ConnectionId,
    ) -> Result<(), NodeError> {
        if self.tunnels.contains_key(&tunnel) || self.closing.contains(&tunnel) {
            return Err(mistake(format!("tunnel {tunnel} opened twice")));
        }
        let Some(c) = self.connections.get_mut(&(agent, connection)) else {
            return Err(NodeError::ConnectionNotOpen { agent, connection });
        };
        c.tunnels.insert(tunnel);
        let max_tunnels = c.max_tunnels;
        self.tunnels.insert(tunnel, (agent, connection));
        let opened = RegistryInput::TunnelOpened {
            tunnel,
            agent,
            connection,
            max_tunnels,
        };
        self.registry(now, opened)?;
        Ok(())
    }

    /// A tunnel's stream ended.
    fn tunnel_closed(&mut self, now: Time, tunnel: TunnelId) -> Result<(), NodeError> {
        if self.closing.remove(&tunnel) {
            return Ok(()); // closed by the node; the registry knows
        }
        if !self.untable(tunnel) {
            return Err(mistake(format!(
                "tunnel {tunnel} closed twice or never opened"
            )));
        }
        self.registry(now, RegistryInput::TunnelClosed { tunnel })?;
        Ok(())
    }

    /// The caller went away.
    fn cancel(&mut self, now: Time, request: RequestId) -> Result<(), NodeError> {
        let Some(state) = self.calls.get(&request) else {
            return Ok(()); // ended first: the caller's guard fires after every end
        };
        if state.place.in_tunnel() || state.place.delivered() {
            // The tunnel, or the forward of a delivered streaming call, sees its
            // caller gone, drains the answer's end and ends the call: aborting a
            // forward there would reset its stream between the kas.
            return Ok(());
        }
        self.registry(now, RegistryInput::Release { request })?;
        self.router
            .handle_input(now, RouterInput::Finished { request });
        self.end(request, Outcome::Cancelled, None);
        Ok(())
    }

    /// See [`NodeInput::Shutdown`].
    fn shutdown(&mut self, now: Time) -> Result<(), NodeError> {
        for (tunnel, _) in std::mem::take(&mut self.tunnels) {
            self.registry(now, RegistryInput::TunnelClosed { tunnel })?;
            self.closing.insert(tunnel);
            self.outputs.push_back(NodeOutput::CloseTunnel(tunnel));
        }
        for c in self.connections.values_mut() {
            c.tunnels.clear();
        }
        self.tracker.handle_input(now, TrackerInput::Shutdown);
        Ok(())
    }

    /// See [`NodeInput::Drain`].
    fn drain_tunnels(&mut self, now: Time) -> Result<(), NodeError> {
        if std::mem::replace(&mut self.draining, true) {
            return Ok(());
        }
        let present: BTreeSet<AgentId> = self.tunnels.values().map(|(agent, _)| *agent).collect();
        for agent in present {
            self.presence(now, agent, false);
        }
        let waiting: Vec<RequestId> = self
            .calls
            .iter()
            .filter(|(_, s)| s.place == Place::Routing)
            .map(|(request, _)| *request)
            .collect();
        for request in waiting {
            self.registry(now, RegistryInput::Release { request })?;
            self.bounced(now, request);
        }
        Ok(())
    }

    /// Tells the router and the tracker whether this kas holds a tunnel of the agent.
    fn presence(&mut self, now: Time, agent: AgentId, present: bool) {
        self.router
            .handle_input(now, RouterInput::LocalPresence { agent, present });
        self.tracker
            .handle_input(now, TrackerInput::TunnelPresence { agent, present });
    }

    fn admit(
        &mut self,
        now: Time,
        request: RequestId,
        wanted: Wanted,
        call: C,
        origin: Origin,
    ) -> Result<(), NodeError> {
        if self.calls.contains_key(&request) {
            return Err(mistake(format!("request id {request} reused")));
        }
        let state = CallState {
            call,
            wanted,
            origin,
            place: Place::Routing,
            found_busy: false,
            started: now,
        };
        self.calls.insert(request, state);
        Ok(())
    }

    fn pubsub(&mut self, now: Time, event: PubSubEvent) -> Result<(), NodeError> {
        match event {
            PubSubEvent::Subscribed(channel) => {
                if let Some(&agent) = self.channels.get(&channel) {
                    self.router
                        .handle_input(now, RouterInput::Subscribed { agent });
                }
            }
            PubSubEvent::Message { channel, payload } => {
                let Ok(ev) = TunnelEvent::decode(payload.as_slice()) else {
                    return Err(NodeError::BadTunnelEvent { channel });
                };
                self.router.handle_input(
                    now,
                    RouterInput::TunnelEvent {
                        agent: AgentId(ev.agent_id),
                        kas: KasId(ev.kas_id),
                        connected: ev.connected,
                    },
                );
            }
            // Without wake-ups the router is never told of the connection: its calls keep
            // polling, and its subscriptions stay the node's own fiction.
            PubSubEvent::Up => {
                if self.config.wakeups {
                    self.router.handle_input(now, RouterInput::PubSubUp);
                }
                if std::mem::replace(&mut self.pubsub_was_up, true) {
                    // The store may have restarted empty.
                    self.tracker.handle_input(now, TrackerInput::RewriteAll);
                }
            }
            PubSubEvent::Down if self.config.wakeups => {
                self.router.handle_input(now, RouterInput::PubSubDown);
            }
            PubSubEvent::Down => {}
        }
        Ok(())
    }

    fn set_store_health(&mut self, now: Time, ok: bool) {
        if ok == self.store_healthy {
            return;
        }
        self.store_healthy = ok;
        self.outputs.push_back(NodeOutput::StoreHealth(ok));
        if ok {
            // The store may have lost what this kas wrote while it was away.
            self.tracker.handle_input(now, TrackerInput::RewriteAll);
        }
    }

    fn registry(&mut self, now: Time, input: RegistryInput) -> Result<(), NodeError> {
        // The node keeps the registry's view of tunnels and calls in step with its own, so
        // a refusal here is a driver input the node failed to screen.
        self.registry
            .handle_input(now, input)
            .map_err(|e| mistake(e.to_string()))
    }

    /// [`KasNode::registry`] while carrying outputs, where a refusal has no input to
    /// blame: it is reported as [`NodeOutput::Inconsistent`].
    fn registry_in_drain(&mut self, now: Time, input: RegistryInput) {
        if let Err(e) = self.registry.handle_input(now, input) {
            self.outputs
                .push_back(NodeOutput::Inconsistent(e.to_string()));
        }
    }

    /// Takes an open tunnel out of the node's tables; `false` when it was not open.
    fn untable(&mut self, tunnel: TunnelId) -> bool {
        let Some(key) = self.tunnels.remove(&tunnel) else {
            return false;
        };
        if let Some(c) = self.connections.get_mut(&key) {
            c.tunnels.remove(&tunnel);
        }
        true
    }

    /// Forgets a tunnel the node closes itself and tells the registry and the driver.
    fn close(&mut self, now: Time, tunnel: TunnelId) -> Result<(), NodeError> {
        self.untable(tunnel);
        self.registry(now, RegistryInput::TunnelClosed { tunnel })?;
        self.closing.insert(tunnel);
        self.outputs.push_back(NodeOutput::CloseTunnel(tunnel));
        Ok(())
    }

    /// Carries every machine's outputs to their destinations until all are quiet.
    fn drain(&mut self, now: Time) {
        loop {
            let mut any = false;
            while let Some(out) = self.registry.poll_output() {
                any = true;
                self.registry_output(now, out);
            }
            while let Some(out) = self.router.poll_output() {
                any = true;
                self.router_output(now, out);
            }
            while let Some(out) = self.tracker.poll_output() {
                any = true;
                self.outputs.push_back(match out {
                    TrackerOutput::Write(batch) => NodeOutput::Write(batch),
                    TrackerOutput::ReadKas { key } => NodeOutput::ReadKas { key },
                    TrackerOutput::Gc { keys } => NodeOutput::Gc { keys },
                    TrackerOutput::ShutdownComplete => NodeOutput::ShutdownComplete,
                });
            }
            if !any {
                return;
            }
        }
    }

    fn registry_output(&mut self, now: Time, out: RegistryOutput) {
        match out {
            RegistryOutput::Matched { request, tunnel } => {
                let Some(state) = self.calls.get_mut(&request) else {
                    // Every end of a waiting call takes it out of the registry's queue, so
                    // this is a waiter left behind: free the tunnel, and say so.
                    self.outputs.push_back(NodeOutput::Inconsistent(format!(
                        "tunnel {tunnel} matched to call {request}, which had ended"
                    )));
                    self.registry_in_drain(now, RegistryInput::Release { request });
                    return;
                };
                state.place = Place::Tunnel { delivered: false };
                self.outputs.push_back(NodeOutput::Deliver {
                    request,
                    tunnel,
                    call: state.call.clone(),
                    waited: now - state.started,
                });
            }
            RegistryOutput::NoTunnel { request } => self.bounced(now, request),
            RegistryOutput::WaitExpired { request } => {
                let Some(state) = self.calls.get(&request) else {
                    return;
                };
                if now < state.wanted.deadline {
                    // The patience with this kas's busy tunnels ran out: the others next.
                    self.bounced(now, request);
                    return;
                }
                // Nothing reached an agent, and the deadline has passed: no kas could do
                // better, so the call ends here with the reason, whichever API it came on.
                let error = CallError::TunnelsBusy {
                    agent: state.wanted.agent,
                };
                self.router
                    .handle_input(now, RouterInput::Finished { request });
                self.end(request, Outcome::DeadlineExceeded, Some(error));
            }
            RegistryOutput::CloseTunnel { tunnel, request } => {
                self.untable(tunnel);
                self.closing.insert(tunnel);
                self.outputs.push_back(NodeOutput::CloseTunnel(tunnel));
                if let Some(request) = request {
                    // The tunnel fails the call as its stream closes; it may have been
                    // delivered, so the router must not retry it.
                    self.router
                        .handle_input(now, RouterInput::Finished { request });
                }
            }
            // Draining, this kas is absent for every agent already.
            RegistryOutput::AgentPresence { .. } if self.draining => {}
            RegistryOutput::AgentPresence { agent, present } => {
                self.presence(now, agent, present);
            }
        }
    }

    fn router_output(&mut self, now: Time, out: RouterOutput) {
        match out {
            RouterOutput::Subscribe(agent) if !self.config.wakeups => {
                self.router
                    .handle_input(now, RouterInput::Subscribed { agent });
            }
            RouterOutput::Subscribe(agent) => {
                let channel = self.config.keys.tunnel_events(agent);
                self.channels.insert(channel.clone(), agent);
                self.outputs.push_back(NodeOutput::Subscribe(channel));
            }
            RouterOutput::Unsubscribe(_) if !self.config.wakeups => {}
            RouterOutput::Unsubscribe(agent) => {
                let channel = self.config.keys.tunnel_events(agent);
                self.channels.remove(&channel);
                self.outputs.push_back(NodeOutput::Unsubscribe(channel));
            }
            RouterOutput::Lookup(agent) => {
                let key = self.config.keys.agent(agent);
                self.outputs.push_back(NodeOutput::Lookup { agent, key });
            }
            RouterOutput::Attempt { request, target } => {
                let Some(state) = self.calls.get_mut(&request) else {
                    self.router
                        .handle_input(now, RouterInput::Finished { request });
                    return;
                };
                match target {
                    Target::Local if self.draining => self.bounced(now, request),
                    Target::Local => {
                        let (mut wanted, since) = (state.wanted, state.started);
                        if let Some(until) = self.router.local_wait_until(now, request) {
                            wanted.deadline = wanted.deadline.min(until);
                        }
                        // A request id is fresh in the registry whenever the router
                        // attempts: the last attempt ended with a refusal. Its place
                        // in the queue is when it arrived here.
                        self.registry_in_drain(now, wants_tunnel(request, wanted, since));
                        self.busy_step(request);
                    }
                    Target::Kas(kas) => {
                        debug_assert_ne!(kas, self.config.kas_id, "the router never picks itself");
                        state.place = Place::Forward { delivered: false };
                        self.outputs.push_back(NodeOutput::Forward {
                            request,
                            kas,
                            call: state.call.clone(),
                            waited: now - state.started,
                        });
                    }
                }
            }
            RouterOutput::Step { request, step } => {
                self.outputs.push_back(NodeOutput::Step { request, step });
            }
            RouterOutput::Fail { request, error } => {
                let Some(state) = self.calls.get(&request) else {
                    return;
                };
                // Busy, not absent: a kas refused it as busy, or this kas holds tunnels of
                // the agent that stayed busy after the call's local patience ran out
                // (swarm seed 4568: an agent with one tunnel here, saturated, was reported
                // "not connected" by the kas it was connected to).
                let Wanted {
                    agent, connection, ..
                } = state.wanted;
                let (outcome, error) = match error {
                    RouteError::NotConnected { .. }
                        if state.found_busy || self.registry.has_tunnels(agent, connection) =>
                    {
                        (Outcome::DeadlineExceeded, CallError::TunnelsBusy { agent })
                    }
                    RouteError::NotConnected { .. } => {
                        (Outcome::NotConnected, CallError::Route(error))
                    }
                    RouteError::DeadlineExceeded { .. } => {
                        (Outcome::DeadlineExceeded, CallError::Route(error))
                    }
                };
                if !state.place.in_tunnel() {
                    self.registry_in_drain(now, RegistryInput::Release { request });
                }
                self.end(request, outcome, Some(error));
            }
        }
    }

    /// Reports that the call waits for a busy tunnel here, when it does and steps are
    /// asked for.
    fn busy_step(&mut self, request: RequestId) {
        if self.config.router.steps && self.registry.is_waiting(request) {
            self.outputs.push_back(NodeOutput::Step {
                request,
                step: RouteStep::Waiting(WaitReason::TunnelsBusy),
            });
        }
    }

    /// A target did not take the call; nothing reached an agent.
    fn bounced(&mut self, now: Time, request: RequestId) {
        let Some(state) = self.calls.get_mut(&request) else {
            return;
        };
        if state.place.delivered() {
            // At most once: whatever the driver says now, the call may have reached the
            // agent, so it is never offered again.
            self.outputs.push_back(NodeOutput::Inconsistent(format!(
                "call {request} bounced after it was delivered"
            )));
            return;
        }
        state.place = Place::Routing;
        match state.origin {
            Origin::Public => self
                .router
                .handle_input(now, RouterInput::AttemptRefused { request }),
            Origin::Private => {
                let error = CallError::NoFreeTunnel {
                    kas: self.config.kas_id.clone(),
                    agent: state.wanted.agent,
                };
                self.end(request, Outcome::Refused, Some(error));
            }
        }
    }

    /// Forgets a call and reports how it ended.
    fn end(&mut self, request: RequestId, outcome: Outcome, error: Option<CallError>) {
        let Some(state) = self.calls.remove(&request) else {
            return;
        };
        self.outputs.push_back(NodeOutput::Ended {
            request,
            origin: state.origin,
            outcome,
            hops: u32::from(matches!(state.place, Place::Forward { .. })),
            call: state.call,
            error,
        });
    }
}

/// The registry's request for a tunnel the call wants.
fn wants_tunnel(request: RequestId, wanted: Wanted, since: Time) -> RegistryInput {
    RegistryInput::Request {
        request,
        agent: wanted.agent,
        connection: wanted.connection,
        deadline: wanted.deadline,
        since,
        holder: wanted.holder,
    }
}

fn mistake(what: String) -> NodeError {
    NodeError::DriverMistake(what)
}

#[cfg(test)]
mod tests;
