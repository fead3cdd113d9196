//! The driver of this kas's [`KasNode`]: one task owns the node, feeds it what the API
//! handlers and I/O tasks report, fires its timers, and carries its outputs to the store,
//! the pub-sub connection, the tunnels and other kas. Every decision is the node's; this
//! module only does I/O, so production runs the composition the model test checks.
//!
//! Every input is handled in O(log n) (store I/O and forwards run in tasks of their own
//! that report back), so the engine never waits on the network. New calls queue in a
//! bounded channel and are refused, naming the limit, when it is full; everything else the
//! engine receives answers something it started, so it is bounded by what it admitted. The
//! loop serves due timers first, then those answers, then pub-sub events, then new calls:
//! a flood of calls can delay calls, never deadlines or wake-ups.

use super::call::Call;
use super::forward::Forwarder;
use super::handle::{CALL_QUEUE, Command, EngineHandle, Orders, TunnelOrder};
use super::metrics::{self, Metrics};
use super::route_spans::RouteSpans;
use crate::buggify::{self, Point};
use crate::store::{PubSub, PubSubEvent, Store};
use kas_core::fixed_hash::Map;
use kas_core::keys::tunnel_holders;
use kas_core::node::{
    CallError, KasNode, NodeError, NodeInput, NodeOutput, NodeStats, Origin, Outcome,
};
use kas_core::{RequestId, TunnelId};
use kas_proto::registry::KasInstanceInfo;
use kas_transport::clock;
use kas_transport::frames;
use kas_transport::tasks::Tasks;
use kas_transport::traces::{self, KeyValue, Status as SpanStatus, TraceContextExt};
use prost::Message;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::AbortHandle;
use tonic::Status;

/// How often the store is pinged to tell readiness.
const HEALTH_CHECK_EVERY: Duration = Duration::from_secs(1);

/// What the engine drives.
pub struct EngineParts {
    /// The kas node.
    pub node: KasNode<Call>,
    /// The registry store.
    pub store: Store,
    /// Sends calls to other kas.
    pub forwarder: Forwarder,
    /// Counters and gauges.
    pub metrics: Metrics,
    /// Set to the store's health.
    pub store_ready: watch::Sender<bool>,
    /// Set to the node's sizes (what a stop waits to see empty).
    pub stats: watch::Sender<NodeStats>,
}

struct Engine {
    node: KasNode<Call>,
    store: Store,
    pubsub: PubSub,
    forwarder: Forwarder,
    metrics: Metrics,
    store_ready: watch::Sender<bool>,
    stats: watch::Sender<NodeStats>,
    handle: EngineHandle,
    /// Where each open tunnel takes its calls: dropping one closes the tunnel.
    tunnels: Map<TunnelId, Orders>,
    /// Running forwards, to abandon those of calls that ended otherwise.
    forwards: Map<RequestId, AbortHandle>,
    /// Routing calls' open step spans (traces on).
    route_spans: RouteSpans,
    /// Store I/O and forwards; aborted when the engine stops.
    tasks: Tasks,
    health_check_running: bool,
    shutdown: Option<oneshot::Sender<()>>,
    /// Shutdown is complete: the loop ends.
    stopped: bool,
}

/// Starts the engine task.
pub fn spawn(parts: EngineParts) -> EngineHandle {
    let (control, control_rx) = mpsc::unbounded_channel();
    let (calls, calls_rx) = mpsc::channel(CALL_QUEUE);
    let handle = EngineHandle::new(control, calls);
    let (pubsub, events) = parts.store.pubsub();
    let engine = Engine {
        node: parts.node,
        store: parts.store,
        pubsub,
        forwarder: parts.forwarder,
        metrics: parts.metrics,
        store_ready: parts.store_ready,
        stats: parts.stats,
        handle: handle.clone(),
        tunnels: Map::default(),
        forwards: Map::default(),
        route_spans: RouteSpans::default(),
        tasks: Tasks::default(),
        health_check_running: false,
        shutdown: None,
        stopped: false,
    };
    tokio::spawn(engine.run(control_rx, calls_rx, events));
    handle
}

impl Engine {
    async fn run(
        mut self,
        mut control: mpsc::UnboundedReceiver<Command>,
        mut calls: mpsc::Receiver<Command>,
        mut events: mpsc::Receiver<PubSubEvent>,
    ) {
        self.carry_outputs();
        let mut health = tokio::time::interval(HEALTH_CHECK_EVERY);
        health.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let timer = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(timer);
        // The node's next deadline the timer is set for; None when it is not set.
        let mut armed = None;
        loop {
            let due = self.node.poll_timeout();
            if due != armed {
                if let Some(at) = due {
                    timer
                        .as_mut()
                        .reset(tokio::time::Instant::now() + clock::until(at));
                }
                armed = due;
            }
            tokio::select! {
                biased;
                () = &mut timer, if armed.is_some() => {
                    let now = clock::now();
                    if let Some(due) = armed.take() {
                        self.metrics.timer_lag.observe((now - due).as_secs_f64());
                    }
                    self.node.handle_timeout(now);
                }
                cmd = control.recv() => match cmd {
                    Some(cmd) => self.command(cmd),
                    None => return,
                },
                Some(event) = events.recv() => {
                    match event {
                        PubSubEvent::Up => tracing::info!("pub-sub connection up"),
                        PubSubEvent::Down => tracing::warn!("pub-sub connection lost: waiting calls poll until it is back"),
                        _ => {}
                    }
                    self.input(NodeInput::PubSub(event));
                }
                Some(ended) = self.tasks.next(), if !self.tasks.is_empty() => {
                    if let Err(e) = ended
                        && e.is_panic()
                    {
                        tracing::error!(error = %e, "an engine task panicked");
                    }
                }
                _ = health.tick(), if !self.health_check_running => self.check_health(),
                Some(cmd) = calls.recv() => self.command(cmd),
            }
            self.carry_outputs();
            let stats = self.node.stats();
            self.metrics.node(stats);
            self.stats
                .send_if_modified(|s| std::mem::replace(s, stats) != stats);
            if self.stopped {
                return; // dropping the tasks aborts them
            }
        }
    }

    fn check_health(&mut self) {
        self.health_check_running = true;
        let store = self.store.clone();
        let handle = self.handle.clone();
        self.tasks.spawn(async move {
            let ok = store.ping().await.is_ok();
            handle.input(NodeInput::StoreHealth(ok));
        });
    }

    fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Node(input) => {
                match &input {
                    NodeInput::StoreHealth(ok) => {
                        self.health_check_running = false;
                        if !ok {
                            self.metrics.store_error("ping");
                        }
                    }
                    NodeInput::BatchDone { ok: false, .. } => self.metrics.store_error("write"),
                    NodeInput::LookupDone { kas: None, .. } => self.metrics.store_error("lookup"),
                    NodeInput::LiveKas(None) => self.metrics.store_error("read_kas"),
                    _ => {}
                }
                self.input(input);
            }
            Command::TunnelOpened {
                tunnel,
                agent,
                connection,
                orders,
                reply,
            } => {
                let opened = NodeInput::TunnelOpened {
                    tunnel,
                    agent,
                    connection,
                };
                // In the table before the node's outputs are carried: a waiting call may
                // be matched to the tunnel at once.
                self.tunnels.insert(tunnel, orders);
                let result = self.node.handle_input(clock::now(), opened);
                if let Err(e) = &result {
                    self.tunnels.remove(&tunnel);
                    let status = match e {
                        NodeError::ConnectionNotOpen { .. } => {
                            Status::failed_precondition(e.to_string())
                        }
                        _ => Status::internal(format!("kas could not register the tunnel: {e}")),
                    };
                    let _ = reply.send(Err(status));
                    self.report(result);
                } else {
                    let _ = reply.send(Ok(()));
                }
            }
            Command::Shutdown(done) => {
                self.shutdown = Some(done);
                self.input(NodeInput::Shutdown);
            }
        }
    }

    fn input(&mut self, input: NodeInput<Call>) {
        tracing::trace!(?input, "node input");
        let result = self.node.handle_input(clock::now(), input);
        self.report(result);
    }

    /// Logs what the node refused: a driver mistake is a bug here, so loudly.
    fn report(&self, result: Result<(), NodeError>) {
        match result {
            Ok(()) => {}
            Err(e @ NodeError::DriverMistake(_)) => {
                self.metrics.driver_mistakes.inc();
                tracing::error!(error = %e, "kas engine bug: the node refused an input");
            }
            Err(e @ NodeError::ConnectionNotOpen { .. }) => {
                tracing::info!(error = %e, "tunnel refused")
            }
            Err(e) => tracing::warn!(error = %e, "input refused"),
        }
    }

    /// Carries the node's outputs until it has none.
    fn carry_outputs(&mut self) {
        while let Some(out) = self.node.poll_output() {
            tracing::trace!(output = ?out, "node output");
            self.output(out);
        }
    }

    fn output(&mut self, out: NodeOutput<Call>) {
        match out {
            NodeOutput::Subscribe(channel) => self.pubsub.subscribe(channel),
            NodeOutput::Unsubscribe(channel) => self.pubsub.unsubscribe(channel),
            NodeOutput::Lookup { agent, key } => {
                let store = self.store.clone();
                let handle = self.handle.clone();
                self.tasks.spawn(async move {
                    // Not filtered by kas liveness (listings are): a tunnel record may
                    // outlive its kas's liveness record for a moment while refreshes fail,
                    // and a router that kept such a lookup would wait for an announcement
                    // that never comes (the record was never gone). A dead kas costs one
                    // refused attempt instead.
                    buggify::pause(Point::LateLookup).await;
                    let kas = store
                        .read_live(&key, clock::now())
                        .await
                        .ok()
                        .map(tunnel_holders);
                    handle.input(NodeInput::LookupDone { agent, kas });
                });
            }
            NodeOutput::Write(batch) => {
                let store = self.store.clone();
                let handle = self.handle.clone();
                self.tasks.spawn(async move {
                    let result = store.execute(&batch.writes).await;
                    if let Err(e) = &result {
                        tracing::warn!(error = %e, "registry write failed; will retry");
                    }
                    handle.input(NodeInput::BatchDone {
                        batch: batch.id,
                        ok: result.is_ok(),
                    });
                });
            }
            NodeOutput::ReadKas { key } => {
                let store = self.store.clone();
                let handle = self.handle.clone();
                self.tasks.spawn(async move {
                    let live = store.read_live(&key, clock::now()).await.ok().map(|live| {
                        live.into_iter()
                            .map(|(id, info)| {
                                let info = KasInstanceInfo::decode(info.as_slice());
                                (id, info.map_or(0, |i| i.incarnation))
                            })
                            .collect()
                    });
                    handle.input(NodeInput::LiveKas(live));
                });
            }
            NodeOutput::Gc { keys } => {
                let store = self.store.clone();
                let metrics = self.metrics.clone();
                let handle = self.handle.clone();
                self.tasks.spawn(async move {
                    match store.gc(&keys, clock::now()).await {
                        Ok(0) => {}
                        Ok(n) => {
                            tracing::debug!(keys = keys.len(), n, "expired registry fields removed")
                        }
                        Err(e) => {
                            metrics.store_error("gc");
                            tracing::warn!(keys = keys.len(), error = %e, "registry GC failed; retried next period");
                            handle.input(NodeInput::GcFailed(keys));
                        }
                    }
                });
            }
            NodeOutput::Deliver {
                request,
                tunnel,
                call,
                waited,
            } => self.deliver(request, tunnel, call, waited),
            NodeOutput::Forward {
                request,
                kas,
                call,
                waited,
            } => {
                let task = self
                    .forwarder
                    .run(kas, request, call, waited, self.handle.clone());
                let task = self.tasks.spawn(task);
                self.forwards.insert(request, task);
            }
            NodeOutput::CloseTunnel(tunnel) => {
                // Dropping its orders ends the tunnel task, which reports `TunnelClosed`.
                self.tunnels.remove(&tunnel);
            }
            NodeOutput::Ended {
                request,
                origin,
                outcome,
                hops,
                call,
                error,
            } => {
                if let Some(task) = self.forwards.remove(&request)
                    && outcome != Outcome::Delivered
                {
                    task.abort();
                }
                if traces::on() {
                    self.route_spans.left(request);
                    routed(&call, origin, outcome, hops, error.as_ref());
                }
                if let Some(error) = error {
                    tracing::debug!(%request, correlation_id = call.start.correlation_id(), trace_id = traces::trace_id(&call.trace).as_deref(), %error, "call ended by kas");
                    let _ = call.responses.try_send(answer(request, origin, &error));
                }
                match origin {
                    Origin::Public => self.metrics.routed(outcome, hops),
                    Origin::Private => self.metrics.served(outcome),
                }
            }
            NodeOutput::StoreHealth(ok) => {
                let _ = self.store_ready.send(ok);
                if ok {
                    tracing::info!("registry store reachable again: re-registering everything");
                } else {
                    tracing::warn!("registry store unreachable: serving local tunnels only");
                }
            }
            NodeOutput::ShutdownComplete => {
                if let Some(done) = self.shutdown.take() {
                    let _ = done.send(());
                }
                self.stopped = true;
            }
            NodeOutput::Inconsistent(what) => {
                self.metrics.driver_mistakes.inc();
                tracing::error!(%what, "kas node bug: its machines disagreed");
            }
            NodeOutput::Step { request, step } => {
                let call = self.node.call(request);
                self.route_spans.step(request, call, step);
            }
        }
    }

    /// Hands `call` to `tunnel`'s task; one that cannot take it goes back to the node.
    fn deliver(&mut self, request: RequestId, tunnel: TunnelId, call: Call, waited: Duration) {
        let start = call.start.clone();
        let order = Box::new(TunnelOrder { request, call });
        let sent = self
            .tunnels
            .get(&tunnel)
            .is_some_and(|orders| orders.try_send(order).is_ok());
        if traces::on() {
            self.route_spans.left(request);
        }
        if sent {
            self.metrics.routing_latency.observe(waited.as_secs_f64());
            tracing::debug!(%request, %tunnel, correlation_id = start.correlation_id(), "call handed to a tunnel");
        } else {
            self.input(NodeInput::DeliveryFailed { request, tunnel });
        }
    }
}

/// On this kas's span of `call`, how its routing ended. A routing kas's span of a call is
/// its routing's, over at the latest now (when the call was taken, it ended then); the
/// serving kas's lasts for the whole call.
fn routed(call: &Call, origin: Origin, outcome: Outcome, hops: u32, error: Option<&CallError>) {
    let span = call.trace.span();
    span.add_event(
        "routed",
        vec![
            KeyValue::new("kas.outcome", metrics::label(outcome)),
            KeyValue::new("kas.forwarded", hops > 0),
        ],
    );
    if let Some(error) = error {
        span.set_status(SpanStatus::error(error.to_string()));
    }
    if origin == Origin::Public {
        span.end();
    }
}

/// What the caller is told when the node ends its call: a status, or for a call from
/// another kas a refusal frame (that kas may then try elsewhere: nothing was delivered).
fn answer(
    request: RequestId,
    origin: Origin,
    error: &CallError,
) -> Result<kas_proto::frame::Frame, Status> {
    let status = match (error, origin) {
        // The routing kas tells "busy here" from other refusals by its code
        // (NodeInput::BouncedBusy), and ends the call as busy as this kas would have.
        (CallError::NoFreeTunnel { .. } | CallError::TunnelsBusy { .. }, Origin::Private) => {
            Status::resource_exhausted(error.to_string())
        }
        (e, _) if e.is_deadline() => Status::deadline_exceeded(error.to_string()),
        _ => Status::unavailable(error.to_string()),
    };
    match origin {
        Origin::Public => Err(status),
        Origin::Private => Ok(frames::error(request.0, &status)),
    }
}
