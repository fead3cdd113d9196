//! Model-based property test: three kas (tunnel registry + tracker + router each) and a
//! fake Redis with expiring hashes and lossy pub-sub, driven by random sequences of agent
//! connects and disconnects, calls with deadlines, clock advances, failed Redis batches,
//! Redis data loss and lost pub-sub messages. A message is lost only with a subscriber's
//! connection, as with Redis: those routers see the connection go down, and come back at
//! the next clock advance. The test's own table of tunnels is the reference model; after
//! each sequence a fault-free phase checks convergence.
//!
//! Invariants (DESIGN.md): 1 right agent, 2 every call ends by deadline + grace,
//! 3 at most one delivery, 4 at most two kas hops, 5 the store converges to the live truth,
//! 6 nothing leaks, 7 a connected agent is reachable from every kas.
//!
//! `MODEL_TRACE=1` prints every router command while a case runs.

use kas_core::backoff::Backoff;
use kas_core::expiring;
use kas_core::keys::Keys;
use kas_core::router::{RouteError, Router, RouterConfig, RouterInput, RouterOutput, Target};
use kas_core::tracker::{Tracker, TrackerConfig, TrackerInput, TrackerOutput};
use kas_core::tunnel_registry::{RegistryConfig, RegistryInput, RegistryOutput, TunnelRegistry};
use kas_core::{AgentId, ConnectionId, KasId, ProjectId, RequestId, Time, TunnelId};
use kas_proto::registry::{ConnectedAgentInfo, KasInstanceInfo, TunnelEvent};
use proptest::prelude::*;
use prost::Message;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

const KAS: usize = 3;
const TTL: Duration = Duration::from_millis(300);
const REFRESH: Duration = Duration::from_millis(240);
const GC: Duration = Duration::from_millis(600);
const GRACE: Duration = Duration::from_millis(50);

#[derive(Clone, Debug)]
enum Op {
    Connect {
        agent: i64,
        kas: usize,
    },
    Disconnect {
        pick: usize,
    },
    Call {
        agent: i64,
        via: usize,
        pin: bool,
        deadline_ms: u64,
    },
    Advance {
        ms: u64,
    },
    FailNextBatch {
        kas: usize,
    },
    LoseRedisData,
    LoseNextPublish,
    /// The next agent to answer a call sends an `Error` frame instead of a trailer.
    AgentAnswersError,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..4i64, 0..KAS).prop_map(|(agent, kas)| Op::Connect { agent, kas }),
        2 => any::<usize>().prop_map(|pick| Op::Disconnect { pick }),
        4 => (0..5i64, 0..KAS, any::<bool>(), 1..1500u64)
            .prop_map(|(agent, via, pin, deadline_ms)| Op::Call { agent, via, pin, deadline_ms }),
        4 => (1..400u64).prop_map(|ms| Op::Advance { ms }),
        1 => (0..KAS).prop_map(|kas| Op::FailNextBatch { kas }),
        1 => Just(Op::LoseRedisData),
        1 => Just(Op::LoseNextPublish),
        1 => Just(Op::AgentAnswersError),
    ]
}

fn kas_id(n: usize) -> KasId {
    KasId(format!("10.0.0.{n}:8155"))
}

struct Node {
    registry: TunnelRegistry,
    tracker: Tracker,
    router: Router,
    subscriptions: BTreeSet<AgentId>,
    /// The pub-sub connection is down (until the next clock advance).
    pubsub_down: bool,
    fail_next_batch: bool,
}

/// One Redis hash: its key expiry and field -> stored bytes.
type Hash = (Option<Time>, BTreeMap<String, Vec<u8>>);

/// Expiring hashes, as Redis holds them.
#[derive(Default)]
struct Store {
    hashes: BTreeMap<String, Hash>,
}

impl Store {
    fn expire_keys(&mut self, now: Time) {
        self.hashes
            .retain(|_, (exp, fields)| exp.is_none_or(|e| now < e) && !fields.is_empty());
    }
}

#[derive(Clone, Debug)]
struct ModelTunnel {
    agent: AgentId,
    connection: ConnectionId,
    kas: usize,
}

#[derive(Clone, Debug)]
struct Call {
    agent: AgentId,
    connection: Option<ConnectionId>,
    origin: usize,
    deadline: Time,
    delivered_to: Option<TunnelId>,
    outcome: Option<(Time, Result<(), RouteError>)>,
}

struct World {
    now: Time,
    nodes: Vec<Node>,
    store: Store,
    keys: Keys,
    tunnels: BTreeMap<TunnelId, ModelTunnel>,
    calls: BTreeMap<RequestId, Call>,
    /// Calls delivered and not yet answered: (holder kas, call).
    answering: Vec<(usize, RequestId)>,
    lose_next_publish: bool,
    error_next_answer: bool,
    next_id: u64,
}

impl World {
    fn new(seed: u64) -> Self {
        let keys = Keys::new("kas");
        let nodes = (0..KAS)
            .map(|n| Node {
                registry: TunnelRegistry::new(RegistryConfig {
                    heartbeat_timeout: Duration::from_secs(3600),
                }),
                tracker: Tracker::new(
                    Time(0),
                    TrackerConfig {
                        ttl: TTL,
                        refresh: REFRESH,
                        gc: GC,
                        liveness: TTL,
                        backoff: Backoff {
                            initial: Duration::from_millis(10),
                            max: Duration::from_millis(100),
                            factor: 2,
                        },
                        max_keys_per_batch: 4,
                    },
                    keys.clone(),
                    kas_id(n),
                    &KasInstanceInfo::default(),
                    seed ^ n as u64,
                ),
                router: Router::new(
                    RouterConfig {
                        poll_backoff: Backoff {
                            initial: Duration::from_millis(50),
                            max: Duration::from_millis(400),
                            factor: 2,
                        },
                        failure_memory: Duration::from_secs(1),
                        grace: GRACE,
                        linger: TTL / 2,
                    },
                    kas_id(n),
                    seed.wrapping_add(n as u64),
                ),
                subscriptions: BTreeSet::new(),
                pubsub_down: false,
                fail_next_batch: false,
            })
            .collect();
        let mut w = World {
            now: Time(0),
            nodes,
            store: Store::default(),
            keys,
            tunnels: BTreeMap::new(),
            calls: BTreeMap::new(),
            answering: Vec::new(),
            lose_next_publish: false,
            error_next_answer: false,
            next_id: 1,
        };
        for n in &mut w.nodes {
            n.router.handle_input(Time(0), RouterInput::PubSubUp);
        }
        w.settle();
        w
    }

    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn apply(&mut self, op: &Op) {
        let now = self.now;
        match *op {
            Op::Connect { agent, kas } => {
                let (tunnel, connection) = (TunnelId(self.id()), ConnectionId(self.id() as i64));
                let agent = AgentId(agent);
                self.tunnels.insert(
                    tunnel,
                    ModelTunnel {
                        agent,
                        connection,
                        kas,
                    },
                );
                let node = &mut self.nodes[kas];
                node.tracker.handle_input(
                    now,
                    TrackerInput::AgentConnected(ConnectedAgentInfo {
                        agent_id: agent.0,
                        project_id: 100 + agent.0,
                        connection_id: connection.0,
                        ..Default::default()
                    }),
                );
                let opened = RegistryInput::TunnelOpened {
                    tunnel,
                    agent,
                    connection,
                };
                node.registry.handle_input(now, opened).unwrap();
            }
            Op::Disconnect { pick } => {
                if self.tunnels.is_empty() {
                    return;
                }
                let tunnel = *self.tunnels.keys().nth(pick % self.tunnels.len()).unwrap();
                self.close_tunnel(tunnel);
            }
            Op::Call {
                agent,
                via,
                pin,
                deadline_ms,
            } => {
                let agent = AgentId(agent);
                let connection = pin
                    .then(|| {
                        self.tunnels
                            .values()
                            .find(|t| t.agent == agent)
                            .map(|t| t.connection)
                    })
                    .flatten();
                self.start_call(
                    agent,
                    connection,
                    via,
                    now + Duration::from_millis(deadline_ms),
                );
            }
            Op::Advance { ms } => {
                self.answer_calls();
                self.reconnect_pubsub();
                self.advance_to(now + Duration::from_millis(ms));
            }
            Op::FailNextBatch { kas } => self.nodes[kas].fail_next_batch = true,
            Op::LoseRedisData => self.store.hashes.clear(),
            Op::LoseNextPublish => self.lose_next_publish = true,
            Op::AgentAnswersError => self.error_next_answer = true,
        }
        self.settle();
    }

    fn start_call(
        &mut self,
        agent: AgentId,
        connection: Option<ConnectionId>,
        via: usize,
        deadline: Time,
    ) -> RequestId {
        let request = RequestId(self.id());
        let call = Call {
            agent,
            connection,
            origin: via,
            deadline,
            delivered_to: None,
            outcome: None,
        };
        self.calls.insert(request, call);
        let start = RouterInput::Start {
            request,
            agent,
            connection,
            deadline,
        };
        self.nodes[via].router.handle_input(self.now, start);
        request
    }

    fn close_tunnel(&mut self, tunnel: TunnelId) {
        let t = self.tunnels.remove(&tunnel).unwrap();
        let node = &mut self.nodes[t.kas];
        node.registry
            .handle_input(self.now, RegistryInput::TunnelClosed { tunnel })
            .unwrap();
        node.tracker.handle_input(
            self.now,
            TrackerInput::AgentDisconnected {
                agent: t.agent,
                project: ProjectId(100 + t.agent.0),
                connection: t.connection,
            },
        );
        // A call on the tunnel ends with the broken stream: delivered, so no retry.
        if let Some(pos) = self
            .answering
            .iter()
            .position(|(_, r)| self.calls[r].delivered_to == Some(tunnel))
        {
            let (_, request) = self.answering.remove(pos);
            self.finish(request, Ok(()));
        }
    }

    /// Agents answer every call delivered to them since the last advance.
    fn answer_calls(&mut self) {
        if std::mem::take(&mut self.error_next_answer)
            && let Some(&(holder, request)) = self.answering.first()
        {
            self.answer_with_error(holder, request);
        }
        for (holder, request) in std::mem::take(&mut self.answering) {
            let release = RegistryInput::Release { request };
            self.nodes[holder]
                .registry
                .handle_input(self.now, release)
                .unwrap();
            self.finish(request, Ok(()));
        }
    }

    /// The agent answers with an `Error` frame, which the holder's tunnel checks against the
    /// frame grammar as kas does. A violation closes the tunnel and ends the call (it was
    /// delivered); were the frame taken as kas's "not delivered", the call would go back to
    /// its router as refused and could be delivered twice (inv 3).
    fn answer_with_error(&mut self, holder: usize, request: RequestId) {
        use kas_core::frame_sequence::{Direction, FrameSequence, Progress, StreamKind};
        use kas_proto::frame::{self as f, Frame, frame::Kind};
        let frame = |kind| Frame { kind: Some(kind) };
        let id = request.0;
        let mut tunnel = FrameSequence::new(StreamKind::Tunnel);
        let down = [
            frame(Kind::RequestStart(f::RequestStart {
                request_id: id,
                ..Default::default()
            })),
            frame(Kind::CloseSend(f::CloseSend { request_id: id })),
        ];
        tunnel
            .check(
                Direction::FromAgent,
                &frame(Kind::Descriptor(f::Descriptor::default())),
            )
            .unwrap();
        for d in &down {
            tunnel.check(Direction::ToAgent, d).unwrap();
        }
        let error = frame(Kind::Error(f::Error {
            request_id: id,
            ..Default::default()
        }));
        match tunnel.check(Direction::FromAgent, &error) {
            Ok(Progress::Finished(_)) => {
                self.answering.retain(|(_, r)| *r != request);
                let release = RegistryInput::Release { request };
                self.nodes[holder]
                    .registry
                    .handle_input(self.now, release)
                    .unwrap();
                let origin = self.calls[&request].origin;
                let refused = RouterInput::AttemptRefused { request };
                self.nodes[origin].router.handle_input(self.now, refused);
            }
            Ok(_) => panic!("an error frame neither ended the call nor broke the grammar"),
            Err(_) => {
                let tunnel = self.calls[&request].delivered_to.expect("delivered");
                self.close_tunnel(tunnel);
            }
        }
    }

    fn finish(&mut self, request: RequestId, outcome: Result<(), RouteError>) {
        let call = self.calls.get_mut(&request).unwrap();
        assert!(call.outcome.is_none(), "inv 2: call {request} ended twice");
        call.outcome = Some((self.now, outcome));
        let origin = call.origin;
        self.nodes[origin]
            .router
            .handle_input(self.now, RouterInput::Finished { request });
    }

    fn advance_to(&mut self, target: Time) {
        loop {
            let next = self
                .nodes
                .iter()
                .flat_map(|n| {
                    [
                        n.registry.poll_timeout(),
                        n.tracker.poll_timeout(),
                        n.router.poll_timeout(),
                    ]
                })
                .flatten()
                .filter(|t| *t <= target)
                .min();
            let Some(t) = next else { break };
            self.now = self.now.max(t);
            self.store.expire_keys(self.now);
            for n in &mut self.nodes {
                n.registry.handle_timeout(self.now);
                n.tracker.handle_timeout(self.now);
                n.router.handle_timeout(self.now);
            }
            self.settle();
        }
        self.now = target;
        self.store.expire_keys(self.now);
    }

    /// Carries every machine's outputs to their destinations until all are quiet.
    fn settle(&mut self) {
        loop {
            let mut progressed = false;
            for n in 0..KAS {
                while let Some(o) = self.nodes[n].registry.poll_output() {
                    progressed = true;
                    self.on_registry(n, o);
                }
                while let Some(o) = self.nodes[n].tracker.poll_output() {
                    progressed = true;
                    self.on_tracker(n, o);
                }
                while let Some(o) = self.nodes[n].router.poll_output() {
                    progressed = true;
                    self.on_router(n, o);
                }
                self.nodes[n].registry.check_invariants().unwrap();
            }
            if !progressed {
                return;
            }
        }
    }

    fn on_registry(&mut self, n: usize, o: RegistryOutput) {
        let now = self.now;
        match o {
            RegistryOutput::Matched { request, tunnel } => {
                let t = &self.tunnels[&tunnel];
                let call = self.calls.get_mut(&request).unwrap();
                assert_eq!(
                    t.agent, call.agent,
                    "inv 1: call {request} delivered to wrong agent"
                );
                if let Some(c) = call.connection {
                    assert_eq!(t.connection, c, "inv 1: call {request} to wrong connection");
                }
                assert!(
                    call.delivered_to.is_none(),
                    "inv 3: call {request} delivered twice"
                );
                assert!(
                    call.outcome.is_none(),
                    "call {request} delivered after it ended"
                );
                call.delivered_to = Some(tunnel);
                self.answering.push((n, request));
            }
            RegistryOutput::NoTunnel { request } | RegistryOutput::WaitExpired { request } => {
                let origin = self.calls[&request].origin;
                let refused = RouterInput::AttemptRefused { request };
                self.nodes[origin].router.handle_input(now, refused);
            }
            RegistryOutput::CloseTunnel { .. } => panic!("heartbeats are not modelled"),
            RegistryOutput::AgentPresence { agent, present } => {
                let node = &mut self.nodes[n];
                node.tracker
                    .handle_input(now, TrackerInput::TunnelPresence { agent, present });
                node.router
                    .handle_input(now, RouterInput::LocalPresence { agent, present });
            }
        }
    }

    fn on_tracker(&mut self, n: usize, o: TrackerOutput) {
        let now = self.now;
        match o {
            TrackerOutput::Write(batch) => {
                let ok = !std::mem::take(&mut self.nodes[n].fail_next_batch);
                if ok {
                    for w in &batch.writes {
                        let (exp, fields) = self.store.hashes.entry(w.key.clone()).or_default();
                        for f in &w.delete {
                            fields.remove(f);
                        }
                        let before = fields.len();
                        fields.extend(w.set.iter().cloned());
                        if let Some(ttl) = w.expire {
                            *exp = Some(now + ttl);
                        }
                        let mut events = w.publish.clone();
                        if fields.len() > before {
                            events.extend(w.announce.iter().cloned());
                        }
                        for (_, payload) in &events {
                            self.publish(TunnelEvent::decode(payload.as_slice()).unwrap());
                        }
                    }
                    self.store.expire_keys(now);
                }
                let result = TrackerInput::BatchResult {
                    batch: batch.id,
                    ok,
                };
                self.nodes[n].tracker.handle_input(now, result);
            }
            TrackerOutput::Gc { keys } => {
                for key in keys {
                    if let Some((_, fields)) = self.store.hashes.get_mut(&key) {
                        let view = fields.iter().map(|(f, v)| (f.as_str(), v.as_slice()));
                        for f in expiring::garbage_fields(view, now) {
                            fields.remove(&f);
                        }
                    }
                }
                self.store.expire_keys(now);
            }
            TrackerOutput::ShutdownComplete => {}
        }
    }

    fn publish(&mut self, event: TunnelEvent) {
        let agent = AgentId(event.agent_id);
        let lose = std::mem::take(&mut self.lose_next_publish);
        for node in &mut self.nodes {
            if lose && node.subscriptions.contains(&agent) {
                node.pubsub_down = true;
                node.router.handle_input(self.now, RouterInput::PubSubDown);
            }
            if node.subscriptions.contains(&agent) && !node.pubsub_down {
                let input = RouterInput::TunnelEvent {
                    agent,
                    kas: KasId(event.kas_id.clone()),
                    connected: event.connected,
                };
                node.router.handle_input(self.now, input);
            }
        }
    }

    /// Subscriber connections that went down are back, with their subscriptions.
    fn reconnect_pubsub(&mut self) {
        for node in &mut self.nodes {
            if std::mem::take(&mut node.pubsub_down) {
                node.router.handle_input(self.now, RouterInput::PubSubUp);
                for &agent in &node.subscriptions {
                    node.router
                        .handle_input(self.now, RouterInput::Subscribed { agent });
                }
            }
        }
    }

    fn on_router(&mut self, n: usize, o: RouterOutput) {
        let now = self.now;
        if std::env::var("MODEL_TRACE").is_ok() {
            eprintln!("{now:?} router {n}: {o:?}");
        }
        match o {
            RouterOutput::Subscribe(agent) => {
                self.nodes[n].subscriptions.insert(agent);
                if !self.nodes[n].pubsub_down {
                    self.nodes[n]
                        .router
                        .handle_input(now, RouterInput::Subscribed { agent });
                }
            }
            RouterOutput::Unsubscribe(agent) => {
                self.nodes[n].subscriptions.remove(&agent);
            }
            RouterOutput::Lookup(agent) => {
                let key = self.keys.tunnels_by_agent(agent);
                let kas = self
                    .store
                    .hashes
                    .get(&key)
                    .map(|(_, fields)| {
                        let view = fields.iter().map(|(f, v)| (f.as_str(), v.as_slice()));
                        expiring::live_fields(view, now)
                    })
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(f, _)| KasId(f))
                    .collect();
                self.nodes[n]
                    .router
                    .handle_input(now, RouterInput::LookupDone { agent, kas });
            }
            RouterOutput::Attempt { request, target } => {
                let holder = match target {
                    Target::Local => n,
                    Target::Kas(k) => {
                        let holder = (0..KAS).find(|i| kas_id(*i) == k).expect("a known kas");
                        assert_ne!(holder, n, "inv 4: a kas forwarded a call to itself");
                        holder
                    }
                };
                let call = &self.calls[&request];
                let input = RegistryInput::Request {
                    request,
                    agent: call.agent,
                    connection: call.connection,
                    deadline: call.deadline,
                };
                // The holder serves from its own registry only: the second and last hop.
                self.nodes[holder]
                    .registry
                    .handle_input(now, input)
                    .unwrap();
            }
            RouterOutput::Fail { request, error } => {
                let call = &self.calls[&request];
                assert!(
                    now <= call.deadline + GRACE,
                    "inv 2: call {request} failed at {now:?}, after deadline {:?} + grace",
                    call.deadline
                );
                if call.delivered_to.is_some() {
                    // Abandoned mid-delivery: the holder releases the tunnel.
                    let pos = self
                        .answering
                        .iter()
                        .position(|(_, r)| *r == request)
                        .unwrap();
                    let (holder, _) = self.answering.remove(pos);
                    let release = RegistryInput::Release { request };
                    self.nodes[holder]
                        .registry
                        .handle_input(now, release)
                        .unwrap();
                }
                let call = self.calls.get_mut(&request).unwrap();
                assert!(call.outcome.is_none(), "inv 2: call {request} ended twice");
                call.outcome = Some((now, Err(error)));
            }
        }
    }

    /// Fault-free phase: let every call end and the store converge, then check 2, 5, 6, 7.
    fn check_convergence(&mut self) {
        let last_deadline = self
            .calls
            .values()
            .map(|c| c.deadline)
            .max()
            .unwrap_or(self.now);
        let until = self.now.max(last_deadline) + TTL + REFRESH + GC + GRACE;
        while self.now < until {
            self.answer_calls();
            self.reconnect_pubsub();
            self.advance_to(self.now + Duration::from_millis(100));
            self.settle();
        }
        for (id, call) in &self.calls {
            assert!(
                call.outcome.is_some(),
                "inv 2: call {id} never ended: {call:?}"
            );
        }
        for (n, node) in self.nodes.iter().enumerate() {
            let leaks = (
                node.router.request_count(),
                node.router.subscription_count(),
                node.registry.waiter_count(),
                node.registry.claimed_count(),
            );
            assert_eq!(
                leaks,
                (0, 0, 0, 0),
                "inv 6: kas {n} leaks (routes, subs, waiters, claims)"
            );
            assert!(
                node.tracker.is_settled(),
                "kas {n} has writes pending after healing"
            );
        }
        // Inv 5: the store holds exactly what the live kas want, nothing of the past.
        let now = self.now;
        let mut stored: Vec<(String, String, Vec<u8>)> = Vec::new();
        for (key, (_, fields)) in &self.store.hashes {
            for (field, bytes) in fields {
                let (at, payload) = expiring::decode(bytes).unwrap();
                assert!(
                    expiring::is_live(at, now),
                    "inv 5: {key}/{field} expired but kept"
                );
                stored.push((key.clone(), field.clone(), payload));
            }
        }
        stored.sort();
        let mut desired: Vec<_> = self
            .nodes
            .iter()
            .flat_map(|n| n.tracker.desired())
            .collect();
        desired.sort();
        assert_eq!(stored, desired, "inv 5: store differs from the live truth");
        let expected_tunnels: BTreeSet<(AgentId, usize)> =
            self.tunnels.values().map(|t| (t.agent, t.kas)).collect();
        for &(agent, kas) in &expected_tunnels {
            let key = self.keys.tunnels_by_agent(agent);
            assert!(
                self.store
                    .hashes
                    .get(&key)
                    .is_some_and(|(_, f)| f.contains_key(&kas_id(kas).0)),
                "inv 5: tunnel of {agent} at kas {kas} not registered"
            );
        }
        // Inv 7: every connected agent is reachable from every kas.
        let agents: BTreeSet<AgentId> = expected_tunnels.iter().map(|(a, _)| *a).collect();
        for &agent in &agents {
            for via in 0..KAS {
                let deadline = self.now + Duration::from_millis(1000);
                let id = self.start_call(agent, None, via, deadline);
                self.settle();
                let delivered = self.calls[&id].delivered_to.is_some();
                assert!(
                    delivered,
                    "inv 7: probe {id} via kas {via} did not reach {agent} at once"
                );
                self.answer_calls();
                self.settle();
            }
        }
    }
}

fn run(seed: u64, ops: &[Op]) {
    let mut w = World::new(seed);
    for op in ops {
        w.apply(op);
    }
    w.check_convergence();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(1000)
    ))]

    /// Invariants 1-7 over random histories with Redis batch failures, data loss and lost
    /// pub-sub messages.
    #[test]
    fn routing_holds_its_invariants(seed in any::<u64>(), ops in prop::collection::vec(op(), 1..60)) {
        run(seed, &ops);
    }
}

/// A call made before its agent connects is delivered when the agent connects elsewhere,
/// by pub-sub wake-up without waiting for a poll.
#[test]
fn late_agent_wakes_the_waiting_call() {
    let mut w = World::new(1);
    let call = w.start_call(AgentId(9), None, 0, Time(5_000));
    w.settle();
    w.apply(&Op::Advance { ms: 10 });
    assert!(w.calls[&call].delivered_to.is_none());
    w.apply(&Op::Connect { agent: 9, kas: 2 });
    assert!(
        w.calls[&call].delivered_to.is_some(),
        "woken by pub-sub at once"
    );
    w.check_convergence();
}

/// A wake-up lost with its subscriber's connection: the lookup made when the connection is
/// back finds the agent.
#[test]
fn lost_wake_up_is_recovered_when_pubsub_is_back() {
    let mut w = World::new(2);
    let call = w.start_call(AgentId(9), None, 0, Time(5_000));
    w.apply(&Op::Advance { ms: 10 });
    w.apply(&Op::LoseNextPublish);
    w.apply(&Op::Connect { agent: 9, kas: 2 });
    assert!(w.calls[&call].delivered_to.is_none(), "the event was lost");
    w.apply(&Op::Advance { ms: 1 });
    assert!(w.calls[&call].delivered_to.is_some(), "looked up again");
    w.check_convergence();
}

/// A tunnel record lost with Redis's data is written again by the refresh, and that write
/// announces it: a call that waits without polling is woken.
#[test]
fn record_rewritten_after_data_loss_wakes_the_waiting_call() {
    let mut w = World::new(3);
    w.apply(&Op::Connect { agent: 9, kas: 2 });
    w.apply(&Op::LoseRedisData);
    let call = w.start_call(AgentId(9), None, 0, Time(5_000));
    w.settle();
    assert!(w.calls[&call].delivered_to.is_none(), "no record to find");
    w.apply(&Op::Advance {
        ms: REFRESH.as_millis() as u64 + 1,
    });
    assert!(
        w.calls[&call].delivered_to.is_some(),
        "announced by the refresh"
    );
    w.check_convergence();
}
