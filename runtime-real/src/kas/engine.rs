//! The driver of the core machines: one task owns the tunnel registry, the tracker and the
//! router, takes commands from the API handlers and I/O tasks, runs the machines' timers,
//! and turns their outputs into store operations, forwards and tunnel orders.
//!
//! Every command is handled in O(1) (store I/O and forwards run in tasks of their own that
//! report back), so the engine never waits on the network.

use super::call::Call;
use super::forward::Forwarder;
use super::metrics::{Metrics, Outcome};
use super::tunnel::{Orders, TunnelOrder};
use crate::clock;
use crate::frames;
use crate::store::{PubSub, PubSubEvent, Store};
use kas_core::fixed_hash::{Map, Set};
use kas_core::keys::Keys;
use kas_core::router::{RouteError, Router, RouterInput, RouterOutput, Target};
use kas_core::tracker::{Tracker, TrackerInput, TrackerOutput};
use kas_core::tunnel_registry::{RegistryInput, RegistryOutput, TunnelRegistry};
use kas_core::{AgentId, ConnectionId, KasId, ProjectId, RequestId, Time, TunnelId};
use kas_proto::registry::{ConnectedAgentInfo, TunnelEvent};
use prost::Message;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::AbortHandle;
use tonic::Status;

/// What the engine is told.
pub enum Command {
    /// An agent replica opened `GetConfiguration`.
    AgentConnected(ConnectedAgentInfo),
    /// That stream ended.
    AgentDisconnected {
        /// The agent.
        agent: AgentId,
        /// Its project.
        project: ProjectId,
        /// The stream's connection id.
        connection: ConnectionId,
    },
    /// A tunnel sent its descriptor; the reply says whether it was accepted.
    TunnelOpened {
        /// Its id.
        tunnel: TunnelId,
        /// The agent.
        agent: AgentId,
        /// The replica's connection.
        connection: ConnectionId,
        /// Where calls for it go.
        orders: Orders,
        /// Accepted, or why not.
        reply: oneshot::Sender<Result<(), Status>>,
    },
    /// The tunnel is alive.
    TunnelActivity(TunnelId),
    /// The tunnel's stream ended.
    TunnelClosed(TunnelId),
    /// A call from GitLab: route it.
    Route(RequestId, Call),
    /// A call from another kas: serve it from this kas's tunnels only.
    Serve(RequestId, Call),
    /// The call is over (its tunnel or forward saw the end).
    CallDone(RequestId),
    /// A tunnel or a kas did not take the call; nothing reached an agent.
    Bounced(RequestId),
    /// The caller went away.
    Cancel(RequestId),
    /// A registry write finished.
    BatchDone {
        /// The batch.
        batch: u64,
        /// Whether it committed.
        ok: bool,
    },
    /// The live kas ids holding tunnels of the agent, or `None` on a store failure.
    LookupDone(AgentId, Option<Vec<KasId>>),
    /// The store answered (or failed) a health check.
    StoreHealth(bool),
    /// Close every agent connection and delete this kas's records; reply when done.
    Shutdown(oneshot::Sender<()>),
}

/// A cheap, cloneable way to talk to the engine.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::UnboundedSender<Command>,
    next_id: Arc<AtomicU64>,
}

impl EngineHandle {
    /// Sends a command (dropped silently once the engine has stopped).
    pub fn send(&self, cmd: Command) {
        let _ = self.tx.send(cmd);
    }

    /// A fresh call id, unique in this kas.
    pub fn next_request_id(&self) -> RequestId {
        RequestId(self.next_id.fetch_add(1, Ordering::Relaxed))
    }
}

/// Cancels a call when dropped: held by whoever waits for the call's answer, so that a
/// caller going away frees what the call holds.
pub struct CancelOnDrop(Option<(EngineHandle, RequestId)>);

impl CancelOnDrop {
    /// Arms the guard for `request`.
    pub fn new(engine: EngineHandle, request: RequestId) -> Self {
        CancelOnDrop(Some((engine, request)))
    }

    /// The call ended by itself (its end was received): nothing to cancel.
    pub fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some((engine, request)) = self.0.take() {
            engine.send(Command::Cancel(request));
        }
    }
}

/// Settings the engine needs besides the machines'.
pub struct EngineParts {
    /// This kas's id (its private API address).
    pub kas_id: KasId,
    /// The registry machine.
    pub registry: TunnelRegistry,
    /// The tracker machine.
    pub tracker: Tracker,
    /// The router machine.
    pub router: Router,
    /// Key names.
    pub keys: Keys,
    /// The registry store.
    pub store: Store,
    /// Sends calls to other kas.
    pub forwarder: Forwarder,
    /// Counters and gauges.
    pub metrics: Metrics,
    /// Set to the store's health.
    pub store_ready: watch::Sender<bool>,
    /// Subscribe to tunnel events (otherwise waiting calls rely on the poll alone).
    pub wakeups: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Origin {
    /// From GitLab: the router decides.
    Public,
    /// From another kas: served locally or refused.
    Private,
}

struct CallState {
    call: Call,
    origin: Origin,
    /// Handed to a local tunnel: the tunnel ends it.
    in_tunnel: bool,
    /// A forward to another kas is running.
    forward: Option<AbortHandle>,
    started: tokio::time::Instant,
}

struct Engine {
    kas_id: KasId,
    registry: TunnelRegistry,
    tracker: Tracker,
    router: Router,
    keys: Keys,
    store: Store,
    pubsub: PubSub,
    forwarder: Forwarder,
    metrics: Metrics,
    store_ready: watch::Sender<bool>,
    handle: EngineHandle,
    tunnels: Map<TunnelId, Orders>,
    connections: Map<(AgentId, ConnectionId), Set<TunnelId>>,
    tunnel_connection: Map<TunnelId, (AgentId, ConnectionId)>,
    calls: Map<RequestId, CallState>,
    channels: Map<String, AgentId>,
    store_healthy: bool,
    wakeups: bool,
    /// The pub-sub connection has been up before (so `Up` is a reconnection).
    pubsub_was_up: bool,
    shutdown: Option<oneshot::Sender<()>>,
}

/// Starts the engine task.
pub fn spawn(parts: EngineParts) -> EngineHandle {
    let (tx, rx) = mpsc::unbounded_channel();
    let handle = EngineHandle {
        tx,
        next_id: Arc::new(AtomicU64::new(1)),
    };
    let (pubsub, events) = parts.store.pubsub();
    let engine = Engine {
        kas_id: parts.kas_id,
        registry: parts.registry,
        tracker: parts.tracker,
        router: parts.router,
        keys: parts.keys,
        store: parts.store,
        pubsub,
        forwarder: parts.forwarder,
        metrics: parts.metrics,
        store_ready: parts.store_ready,
        handle: handle.clone(),
        tunnels: Map::default(),
        connections: Map::default(),
        tunnel_connection: Map::default(),
        calls: Map::default(),
        channels: Map::default(),
        store_healthy: true,
        wakeups: parts.wakeups,
        pubsub_was_up: false,
        shutdown: None,
    };
    tokio::spawn(engine.run(rx, events));
    handle
}

impl Engine {
    async fn run(
        mut self,
        mut commands: mpsc::UnboundedReceiver<Command>,
        mut events: mpsc::Receiver<PubSubEvent>,
    ) {
        self.drain(clock::now());
        self.spawn_health_checks();
        loop {
            let next = kas_core::time::earliest(
                kas_core::time::earliest(self.registry.poll_timeout(), self.tracker.poll_timeout()),
                self.router.poll_timeout(),
            );
            let sleep =
                tokio::time::sleep(next.map_or(std::time::Duration::from_secs(3600), clock::until));
            tokio::select! {
                biased;
                cmd = commands.recv() => match cmd {
                    Some(cmd) => self.command(clock::now(), cmd),
                    None => return,
                },
                Some(event) = events.recv() => self.pubsub_event(clock::now(), event),
                () = sleep => {
                    let now = clock::now();
                    self.registry.handle_timeout(now);
                    self.tracker.handle_timeout(now);
                    self.router.handle_timeout(now);
                }
            }
            self.drain(clock::now());
            self.metrics.calls.set(self.calls.len() as i64);
            self.metrics.routing.set(self.router.request_count() as i64);
            self.metrics
                .tunnel_waiters
                .set(self.registry.waiter_count() as i64);
            self.metrics.subscriptions.set(self.channels.len() as i64);
        }
    }

    fn spawn_health_checks(&self) {
        let store = self.store.clone();
        let handle = self.handle.clone();
        tokio::spawn(async move {
            loop {
                let ok = store.ping().await.is_ok();
                handle.send(Command::StoreHealth(ok));
                if handle.tx.is_closed() {
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        });
    }

    fn command(&mut self, now: Time, cmd: Command) {
        match cmd {
            Command::AgentConnected(info) => {
                let key = (AgentId(info.agent_id), ConnectionId(info.connection_id));
                self.connections.entry(key).or_default();
                self.metrics.connections.set(self.connections.len() as i64);
                self.tracker
                    .handle_input(now, TrackerInput::AgentConnected(info));
            }
            Command::AgentDisconnected {
                agent,
                project,
                connection,
            } => {
                for tunnel in self
                    .connections
                    .remove(&(agent, connection))
                    .unwrap_or_default()
                {
                    // Its tunnels go with it: the agent reconnects both.
                    self.tunnels.remove(&tunnel);
                }
                self.metrics.connections.set(self.connections.len() as i64);
                self.tracker.handle_input(
                    now,
                    TrackerInput::AgentDisconnected {
                        agent,
                        project,
                        connection,
                    },
                );
            }
            Command::TunnelOpened {
                tunnel,
                agent,
                connection,
                orders,
                reply,
            } => {
                let Some(set) = self.connections.get_mut(&(agent, connection)) else {
                    let _ = reply.send(Err(Status::failed_precondition(format!(
                        "connection {connection} of agent {agent} is not open on this kas: open GetConfiguration first and use the connection id it returns"
                    ))));
                    return;
                };
                set.insert(tunnel);
                self.tunnel_connection.insert(tunnel, (agent, connection));
                self.tunnels.insert(tunnel, orders);
                self.registry_input(
                    now,
                    RegistryInput::TunnelOpened {
                        tunnel,
                        agent,
                        connection,
                    },
                );
                self.metrics.tunnels.set(self.tunnels.len() as i64);
                let _ = reply.send(Ok(()));
            }
            Command::TunnelActivity(tunnel) => {
                self.registry_input(now, RegistryInput::TunnelActivity { tunnel });
            }
            Command::TunnelClosed(tunnel) => {
                self.forget_tunnel(tunnel);
                self.registry_input(now, RegistryInput::TunnelClosed { tunnel });
            }
            Command::Route(request, call) => {
                let input = RouterInput::Start {
                    request,
                    agent: call.agent,
                    connection: call.connection,
                    deadline: call.deadline,
                };
                self.calls
                    .insert(request, CallState::new(call, Origin::Public));
                self.router.handle_input(now, input);
            }
            Command::Serve(request, call) => {
                let input = RegistryInput::Request {
                    request,
                    agent: call.agent,
                    connection: call.connection,
                    deadline: call.deadline,
                };
                self.calls
                    .insert(request, CallState::new(call, Origin::Private));
                self.registry_input(now, input);
            }
            Command::CallDone(request) => {
                self.registry_input(now, RegistryInput::Release { request });
                self.router
                    .handle_input(now, RouterInput::Finished { request });
                self.end(request, Outcome::Delivered);
            }
            Command::Bounced(request) => self.bounced(now, request),
            Command::Cancel(request) => {
                let Some(state) = self.calls.get(&request) else {
                    return;
                };
                if state.in_tunnel {
                    return; // the tunnel drains the agent's answer and ends the call
                }
                self.registry_input(now, RegistryInput::Release { request });
                self.router
                    .handle_input(now, RouterInput::Finished { request });
                self.end(request, Outcome::Cancelled);
            }
            Command::BatchDone { batch, ok } => {
                if !ok {
                    self.metrics.store_error("write");
                    self.set_store_health(now, false);
                }
                self.tracker
                    .handle_input(now, TrackerInput::BatchResult { batch, ok });
            }
            Command::LookupDone(agent, found) => {
                let input = match found {
                    Some(kas) => RouterInput::LookupDone { agent, kas },
                    None => {
                        self.metrics.store_error("lookup");
                        RouterInput::LookupFailed { agent }
                    }
                };
                self.router.handle_input(now, input);
            }
            Command::StoreHealth(ok) => {
                if !ok {
                    self.metrics.store_error("ping");
                }
                self.set_store_health(now, ok);
            }
            Command::Shutdown(done) => {
                for (_, orders) in self.tunnels.drain() {
                    drop(orders); // the tunnel task tells its agent to reconnect elsewhere
                }
                self.shutdown = Some(done);
                self.tracker.handle_input(now, TrackerInput::Shutdown);
            }
        }
    }

    fn pubsub_event(&mut self, now: Time, event: PubSubEvent) {
        match event {
            PubSubEvent::Subscribed(channel) => {
                if let Some(&agent) = self.channels.get(&channel) {
                    self.router
                        .handle_input(now, RouterInput::Subscribed { agent });
                }
            }
            PubSubEvent::Message { channel, payload } => {
                #[cfg(madsim)]
                if crate::planted_bug::planted() == crate::planted_bug::Bug::DropWakeup {
                    return;
                }
                let Ok(ev) = TunnelEvent::decode(payload.as_slice()) else {
                    tracing::warn!(%channel, "undecodable tunnel event ignored");
                    return;
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
            PubSubEvent::Up => {
                // Without wake-ups the router is never told: its calls keep polling.
                if self.wakeups {
                    self.router.handle_input(now, RouterInput::PubSubUp);
                }
                if std::mem::replace(&mut self.pubsub_was_up, true) {
                    // The store may have restarted empty.
                    tracing::info!("pub-sub connection re-established");
                    self.tracker.handle_input(now, TrackerInput::RewriteAll);
                }
            }
            PubSubEvent::Down => {
                tracing::warn!("pub-sub connection lost: waiting calls poll until it is back");
                self.router.handle_input(now, RouterInput::PubSubDown);
            }
        }
    }

    fn set_store_health(&mut self, now: Time, ok: bool) {
        if ok == self.store_healthy {
            return;
        }
        self.store_healthy = ok;
        let _ = self.store_ready.send(ok);
        if ok {
            tracing::info!("registry store reachable again: re-registering everything");
            self.tracker.handle_input(now, TrackerInput::RewriteAll);
        } else {
            tracing::warn!("registry store unreachable: serving local tunnels only");
        }
    }

    fn registry_input(&mut self, now: Time, input: RegistryInput) {
        if let Err(e) = self.registry.handle_input(now, input) {
            // Races between a tunnel's end and the registry's own expiry land here.
            tracing::debug!(error = %e, "registry input ignored");
        }
    }

    fn forget_tunnel(&mut self, tunnel: TunnelId) {
        self.tunnels.remove(&tunnel);
        if let Some(key) = self.tunnel_connection.remove(&tunnel)
            && let Some(set) = self.connections.get_mut(&key)
        {
            set.remove(&tunnel);
        }
        self.metrics.tunnels.set(self.tunnels.len() as i64);
    }

    /// Drains every machine's outputs until all are quiet.
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
                self.tracker_output(out);
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
                    self.registry_input(now, RegistryInput::Release { request });
                    return;
                };
                let order = TunnelOrder {
                    request,
                    call: state.call.clone(),
                };
                let sent = self
                    .tunnels
                    .get(&tunnel)
                    .is_some_and(|orders| orders.try_send(Box::new(order)).is_ok());
                if sent {
                    state.in_tunnel = true;
                    let hops = if state.origin == Origin::Public { 0 } else { 1 };
                    self.metrics
                        .routing_latency
                        .observe(state.started.elapsed().as_secs_f64());
                    tracing::debug!(%request, %tunnel, hops, "call handed to a tunnel");
                } else {
                    // The tunnel is gone or busy draining: drop it, offer the call again.
                    self.forget_tunnel(tunnel);
                    self.registry_input(now, RegistryInput::TunnelClosed { tunnel });
                    self.bounced(now, request);
                }
            }
            RegistryOutput::NoTunnel { request } => self.bounced(now, request),
            RegistryOutput::WaitExpired { request } => {
                if let Some(state) = self.calls.get(&request) {
                    let status = Status::deadline_exceeded(format!(
                        "every tunnel of agent {} was busy until the deadline",
                        state.call.agent
                    ));
                    let _ = state.call.responses.try_send(Err(status));
                }
                self.router
                    .handle_input(now, RouterInput::Finished { request });
                self.end(request, Outcome::DeadlineExceeded);
            }
            RegistryOutput::CloseTunnel { tunnel, request } => {
                tracing::info!(%tunnel, "tunnel missed its heartbeats: closing it");
                self.forget_tunnel(tunnel);
                if let Some(request) = request {
                    // The tunnel task fails the call; it may have been delivered.
                    self.router
                        .handle_input(now, RouterInput::Finished { request });
                }
            }
            RegistryOutput::AgentPresence { agent, present } => {
                self.router
                    .handle_input(now, RouterInput::LocalPresence { agent, present });
                self.tracker
                    .handle_input(now, TrackerInput::TunnelPresence { agent, present });
            }
        }
    }

    fn router_output(&mut self, now: Time, out: RouterOutput) {
        match out {
            RouterOutput::Subscribe(agent) if !self.wakeups => {
                self.router
                    .handle_input(now, RouterInput::Subscribed { agent });
            }
            RouterOutput::Subscribe(agent) => {
                let channel = self.keys.tunnel_events(agent);
                self.channels.insert(channel.clone(), agent);
                self.pubsub.subscribe(channel);
            }
            RouterOutput::Unsubscribe(_) if !self.wakeups => {}
            RouterOutput::Unsubscribe(agent) => {
                let channel = self.keys.tunnel_events(agent);
                self.channels.remove(&channel);
                self.pubsub.unsubscribe(channel);
            }
            RouterOutput::Lookup(agent) => {
                let store = self.store.clone();
                let key = self.keys.tunnels_by_agent(agent);
                let handle = self.handle.clone();
                tokio::spawn(async move {
                    // Not filtered by kas liveness (listings are): a tunnel record may
                    // outlive its kas's liveness record for a moment while refreshes fail,
                    // and a router that kept such a lookup would wait for an announcement
                    // that never comes (the record was never gone). A dead kas costs one
                    // refused attempt instead.
                    let found = store
                        .read_live(&key, clock::now())
                        .await
                        .ok()
                        .map(|live| live.into_iter().map(|(kas, _)| KasId(kas)).collect());
                    handle.send(Command::LookupDone(agent, found));
                });
            }
            RouterOutput::Attempt { request, target } => {
                let Some(state) = self.calls.get_mut(&request) else {
                    self.router
                        .handle_input(now, RouterInput::Finished { request });
                    return;
                };
                match target {
                    Target::Local => {
                        let input = RegistryInput::Request {
                            request,
                            agent: state.call.agent,
                            connection: state.call.connection,
                            deadline: state.call.deadline,
                        };
                        self.registry_input(now, input);
                    }
                    Target::Kas(kas) => {
                        debug_assert_ne!(kas, self.kas_id, "the router never picks itself");
                        let task = self.forwarder.spawn(
                            kas,
                            request,
                            state.call.clone(),
                            self.handle.clone(),
                            state.started,
                        );
                        state.forward = Some(task);
                    }
                }
            }
            RouterOutput::Fail { request, error } => {
                let Some(state) = self.calls.get(&request) else {
                    return;
                };
                let (status, outcome) = match &error {
                    RouteError::NotConnected { .. } => (
                        Status::unavailable(error.to_string()),
                        Outcome::NotConnected,
                    ),
                    RouteError::DeadlineExceeded { .. } => (
                        Status::deadline_exceeded(error.to_string()),
                        Outcome::DeadlineExceeded,
                    ),
                };
                let _ = state.call.responses.try_send(Err(status));
                if !state.in_tunnel {
                    self.registry_input(now, RegistryInput::Release { request });
                }
                self.end(request, outcome);
            }
        }
    }

    fn tracker_output(&mut self, out: TrackerOutput) {
        match out {
            TrackerOutput::Write(batch) => {
                let store = self.store.clone();
                let handle = self.handle.clone();
                tokio::spawn(async move {
                    let result = store.execute(&batch.writes).await;
                    if let Err(e) = &result {
                        tracing::warn!(error = %e, "registry write failed; will retry");
                    }
                    handle.send(Command::BatchDone {
                        batch: batch.id,
                        ok: result.is_ok(),
                    });
                });
            }
            TrackerOutput::Gc { keys } => {
                let store = self.store.clone();
                let metrics = self.metrics.clone();
                tokio::spawn(async move {
                    match store.gc(&keys, clock::now()).await {
                        Ok(0) => {}
                        Ok(n) => {
                            tracing::debug!(keys = keys.len(), n, "expired registry fields removed")
                        }
                        Err(e) => {
                            metrics.store_error("gc");
                            tracing::warn!(keys = keys.len(), error = %e, "registry GC failed");
                        }
                    }
                });
            }
            TrackerOutput::ShutdownComplete => {
                if let Some(done) = self.shutdown.take() {
                    let _ = done.send(());
                }
            }
        }
    }

    /// A target did not take the call; nothing reached an agent.
    fn bounced(&mut self, now: Time, request: RequestId) {
        let Some(state) = self.calls.get_mut(&request) else {
            return;
        };
        state.in_tunnel = false;
        state.forward = None;
        match state.origin {
            Origin::Public => self
                .router
                .handle_input(now, RouterInput::AttemptRefused { request }),
            Origin::Private => {
                let status = Status::unavailable(format!(
                    "kas {} holds no free tunnel of agent {}",
                    self.kas_id, state.call.agent
                ));
                let _ = state
                    .call
                    .responses
                    .try_send(Ok(frames::error(request.0, &status)));
                self.end(request, Outcome::Refused);
            }
        }
    }

    /// Forgets a call and counts its outcome.
    fn end(&mut self, request: RequestId, outcome: Outcome) {
        let Some(state) = self.calls.remove(&request) else {
            return;
        };
        let hops = u32::from(state.forward.is_some());
        if let Some(task) = state.forward
            && outcome != Outcome::Delivered
        {
            task.abort();
        }
        if state.origin == Origin::Public {
            self.metrics.routed(outcome, hops);
        } else {
            self.metrics.served(outcome);
        }
    }
}

impl CallState {
    fn new(call: Call, origin: Origin) -> Self {
        CallState {
            call,
            origin,
            in_tunnel: false,
            forward: None,
            started: tokio::time::Instant::now(),
        }
    }
}
