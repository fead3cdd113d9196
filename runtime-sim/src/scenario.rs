//! Named scenarios: a cluster, GitLab's calls, a fault schedule drawn from the seed, then
//! a fault-free final phase that checks convergence, liveness (calls waiting for an agent
//! that connects are delivered, and how fast) and leaks.

use crate::checker::{self, Far, HalfOpen, Outage, Revocation, Stall, Stats};
use crate::cluster::{AgentSpec, Cluster, ClusterSpec, RedisMode, Script, kas_id};
use crate::greedy_caller;
use crate::redis::{Db, MAX_REPLICATION_LAG, SHARDS};
use crate::store_back;
use crate::truth::pod_name;
use crate::workload::{self, Call};
use kas_core::AgentId;
use kas_core::keys::Keys;
use madsim::net::NetSim;
use madsim::rand::{Rng, thread_rng};
use madsim::runtime::{Handle, NodeHandle};
use madsim::task::NodeId;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::time::Instant;

/// The scenarios.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    /// No faults.
    Steady,
    /// kas replicas killed, or stopped gracefully, and restarted.
    KasCrash,
    /// Links between kas, and between kas and Redis, clogged (one way or both), and whole
    /// kas nodes cut off.
    Partition,
    /// Redis restarted empty, failed over to a replica that lacks the last writes, and
    /// slowed down.
    RedisRestart,
    /// The kas holding most agents killed and restarted: they all reconnect at once.
    ReconnectStorm,
    /// Agent replicas killed and restarted.
    AgentChurn,
    /// Fault kinds and rates drawn from the seed, including clock jumps past the TTL.
    Swarm,
    /// Agents on two kas at once; each kas stopped gracefully and restarted in turn,
    /// again and again, while calls flow: no call may fail.
    RollingRestart,
    /// Agents on two kas at once; kas killed, or stopped gracefully, and restarted: only
    /// calls under way on a killed kas may fail.
    KasCrashHa,
}

impl Scenario {
    /// Every scenario, in order.
    pub const ALL: [Scenario; 9] = [
        Scenario::Steady,
        Scenario::KasCrash,
        Scenario::Partition,
        Scenario::RedisRestart,
        Scenario::ReconnectStorm,
        Scenario::AgentChurn,
        Scenario::Swarm,
        Scenario::RollingRestart,
        Scenario::KasCrashHa,
    ];

    /// Its command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Steady => "steady",
            Scenario::KasCrash => "kas-crash",
            Scenario::Partition => "partition",
            Scenario::RedisRestart => "redis-restart",
            Scenario::ReconnectStorm => "reconnect-storm",
            Scenario::AgentChurn => "agent-churn",
            Scenario::Swarm => "swarm",
            Scenario::RollingRestart => "rolling-restart",
            Scenario::KasCrashHa => "kas-crash-ha",
        }
    }

    /// Agents hold connections to two kas at once.
    fn ha(self) -> bool {
        matches!(self, Scenario::RollingRestart | Scenario::KasCrashHa)
    }

    /// The scenario called `name`.
    pub fn parse(name: &str) -> Option<Scenario> {
        Scenario::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// What a run found.
#[derive(Debug)]
pub struct Report {
    /// The numbers.
    pub stats: Stats,
    /// Faults injected.
    pub faults: usize,
    /// Invariant violations; empty when the run passed.
    pub violations: Vec<String>,
    /// Each wake-up latency measured (see [`Stats::wakeup_p50`]).
    pub wakeups: Vec<Duration>,
}

/// The agent no replica of which ever runs.
const ABSENT: i64 = 99;
/// The agent whose one replica connects at a random time during the faults.
const LATE: i64 = 60;
/// The agent that connects during the final phase, while calls wait for it.
const LIVENESS: i64 = 61;
/// A misbehaving agent (see `rogue`): not expected to answer, only to be called once per call.
const ROGUE: i64 = 62;
/// A greedy agent (see `greedy`): takes every place kas's limits give it, never called.
const GREEDY: i64 = 63;
/// In a run without faults, every call with at least this timeout for a connected agent
/// must be answered: shorter ones may legitimately run out under the fault points' pauses
/// (up to 0.5 s each, in the forward, the tunnel, the lookup and Redis).
const LIVE_TIMEOUT: Duration = Duration::from_secs(2);
/// With agent HA, every call with at least this timeout must be answered: a call may also
/// wait out kas's local patience on busy tunnels before it looks elsewhere, and the
/// lookup's timing points then (`rolling-restart` seed 78: 0.8 s of patience and a 1.2 s
/// lookup failed a call of 2.06 s).
const HA_LIVE_TIMEOUT: Duration = Duration::from_secs(3);
/// Registry record lifetime in the simulation.
const TTL: Duration = Duration::from_secs(4);
/// kas's `shutdown_grace` in the simulation.
const GRACE: Duration = Duration::from_secs(2);
/// kas's `shutdown_grace` where agents move make-before-break: the longest call (timeouts
/// and fault pauses included) fits in it, so a graceful stop cuts none.
const HA_GRACE: Duration = Duration::from_secs(10);
/// How long the faulty phase lasts.
const FAULTY: Duration = Duration::from_secs(20);

/// A run's shape: the cluster, and how often GitLab calls (mean gap between calls).
struct Shape {
    cluster: ClusterSpec,
    every: Duration,
}

fn shape(scenario: Scenario) -> Shape {
    let agents = match scenario {
        Scenario::ReconnectStorm => (1..=8)
            .map(|agent| AgentSpec {
                agent,
                replicas: vec![0],
            })
            .collect(),
        Scenario::Swarm => return swarm_shape(),
        // One replica; two on different kas; one; two sharing a kas (a pinned call must
        // take its own replica's tunnel even when the other's is idle beside it). With
        // agent HA, the kas is only where a replica is likely to connect first.
        _ => [vec![0], vec![1, 2], vec![2], vec![0, 0]]
            .into_iter()
            .zip(1..)
            .map(|(replicas, agent)| AgentSpec { agent, replicas })
            .collect(),
    };
    Shape {
        cluster: ClusterSpec {
            kas: 3,
            agents,
            pubsub_wakeups: true,
            ttl: TTL,
            grace: if scenario.ha() { HA_GRACE } else { GRACE },
            ha: scenario.ha(),
            // Half the HA runs: the two links of a replica, made at once, age out close
            // together, so one must serve until its replacement is up.
            max_connection_age: (scenario.ha() && thread_rng().gen_bool(0.5))
                .then(|| random_ms(4_000, 12_000)),
        },
        every: Duration::from_millis(150),
    }
}

/// The swarm's shape, drawn from the seed: 1-5 kas; 1-8 agents (a fifth of the runs 9-24,
/// a tenth 25-50) of 1-3 replicas each, which share one kas with a probability drawn for
/// the run; a mean gap between calls of 20-500 ms (a fifth of the runs 5-500 ms: about 40
/// to 4,000 calls in the faulty phase). Bounded so that the CI seed set stays within minutes.
fn swarm_shape() -> Shape {
    let mut rng = thread_rng();
    let kas = rng.gen_range(1..=5);
    let n = match rng.gen_range(0..10) {
        0 => rng.gen_range(25..=50),
        1 | 2 => rng.gen_range(9..=24),
        _ => rng.gen_range(1..=8),
    };
    let share = rng.r#gen::<f64>();
    // Log-uniform up to 500 ms, from 20 ms, or in a fifth of the runs from 5 ms.
    let fastest: f64 = if rng.gen_bool(0.2) { 0.005 } else { 0.02 };
    let every = Duration::from_secs_f64(fastest * (0.5 / fastest).powf(rng.r#gen::<f64>()));
    let agents = (1..=n)
        .map(|agent| {
            let first = rng.gen_range(0..kas);
            let shared = rng.gen_bool(share);
            let replicas = (0..rng.gen_range(1..=3))
                .map(|_| if shared { first } else { rng.gen_range(0..kas) })
                .collect();
            AgentSpec { agent, replicas }
        })
        .collect();
    Shape {
        cluster: ClusterSpec {
            kas,
            agents,
            pubsub_wakeups: true,
            ttl: TTL,
            grace: GRACE,
            ha: false,
            max_connection_age: None,
        },
        every,
    }
}

fn random_ms(lo: u64, hi: u64) -> Duration {
    Duration::from_millis(thread_rng().gen_range(lo..hi))
}

/// The faults injected in a run.
#[derive(Debug, Default)]
struct FaultLog {
    count: usize,
    /// Clock jumps and kas nodes cut off.
    stalls: Vec<Stall>,
    /// A fault cut agents off from kas (a whole kas clogged, an agent killed): what an
    /// agent saw of kas then is no measure of when kas acted.
    agents_cut_off: bool,
    /// What the faults themselves saw go wrong (a graceful stop's leftovers).
    violations: Vec<String>,
    /// When each kas was stopping or down.
    outages: Vec<Outage>,
    /// The links between a kas and an agent replica that went half-open.
    cuts: Vec<HalfOpen>,
    /// The agent tokens GitLab revoked.
    revocations: Vec<Revocation>,
    /// The calls of the probes after faults (see [`probe`]).
    calls: Vec<Call>,
    /// When every agent replica was on two kas after the run started with one kas (see
    /// [`scale_out`]): until then an agent may rightly be nowhere, and calls for it fail.
    settled: Option<Instant>,
}

/// How long a restarted kas may take to listen again.
const RESTARTING: Duration = Duration::from_secs(1);

/// Injects faults of `kinds` until `until`. Everything is healed at the end. `agents`: who
/// is connected where (a kas down past the TTL must stop being listed as holding them);
/// `homed`: with agent HA, the agents back on two kas before each next fault.
async fn faults(
    cluster: &Cluster,
    agents: &[AgentSpec],
    homed: &[AgentSpec],
    kinds: &[Fault],
    until: Instant,
) -> FaultLog {
    let handle = Handle::current();
    let net = NetSim::current();
    let mut log = FaultLog::default();
    if kinds.is_empty() {
        tokio::time::sleep_until(until).await;
        return log;
    }
    while Instant::now() + Duration::from_secs(5) < until {
        if cluster.ha {
            // Each fault on its own: every agent on two kas first (before the first too:
            // an agent that never connected cannot be reached while GitLab is down).
            await_homed(cluster, homed).await;
        }
        tokio::time::sleep(random_ms(500, 3_000)).await;
        let fault = kinds[thread_rng().gen_range(0..kinds.len())].on(cluster.redis_mode);
        let kas = thread_rng().gen_range(0..cluster.kas_nodes.len());
        let lasting = random_ms(500, 4_000);
        log.count += 1;
        tracing::info!(?fault, kas, ?lasting, "fault");
        match fault {
            Fault::KillKas => {
                let from = Instant::now();
                handle.kill(cluster.kas_nodes[kas].id());
                if thread_rng().gen_bool(0.3) {
                    tokio::time::sleep(cluster.ttl + Duration::from_millis(500)).await;
                    log.violations
                        .extend(listed_while_dead(cluster, agents, kas).await);
                }
                back_up(cluster, kas, from, lasting, true, &mut log).await;
            }
            Fault::StopKas => restart_gracefully(cluster, kas, lasting, &mut log).await,
            Fault::Clog => {
                let other = (kas + 1) % cluster.kas_nodes.len();
                let (a, b) = (cluster.kas_nodes[kas].id(), cluster.kas_nodes[other].id());
                let both = thread_rng().gen_bool(0.5);
                net.clog_link(a, b);
                if both {
                    net.clog_link(b, a);
                }
                tokio::time::sleep(lasting).await;
                heal((a, b));
            }
            Fault::ClogRedis => {
                // Both ways, or only kas -> Redis, or only Redis -> kas.
                let (a, r) = (cluster.kas_nodes[kas].id(), cluster.redis_master().id());
                let way = thread_rng().gen_range(0..3);
                if way != 2 {
                    net.clog_link(a, r);
                }
                if way != 1 {
                    net.clog_link(r, a);
                }
                let ip = crate::cluster::kas_addr(kas, 0).ip();
                cluster.redis.knobs.cut_off(ip, true);
                tokio::time::sleep(lasting).await;
                heal((a, r));
                cluster.redis.knobs.cut_off(ip, false);
            }
            Fault::ClogNode => {
                log.agents_cut_off = true;
                // Sent during the clog, a segment is retried with a doubling backoff (as
                // TCP's retransmission timer does), so it may arrive as long after the clog
                // as the clog lasted (swarm seed 4841 of 5,000: a call 0.14 s past a bound
                // that counted the clogs once).
                log.stalls.push(Stall {
                    kas: Some(kas),
                    at: Instant::now(),
                    lasting: lasting * 2,
                });
                let (id, ip) = (
                    cluster.kas_nodes[kas].id(),
                    crate::cluster::kas_addr(kas, 0).ip(),
                );
                net.clog_node(id);
                cluster.redis.knobs.cut_off(ip, true);
                tokio::time::sleep(lasting).await;
                net.unclog_node(id);
                cluster.redis.knobs.cut_off(ip, false);
            }
            Fault::TimeJump => {
                // The whole world stalls past the record TTL (a VM pause, say): records
                // expire, heartbeats are missed, every timer fires at once.
                let jump = TTL + random_ms(0, 2_000);
                log.stalls.push(Stall {
                    kas: None,
                    at: Instant::now(),
                    lasting: jump,
                });
                madsim::time::advance(jump);
            }
            Fault::RestartRedis => restart_redis(cluster).await,
            Fault::MoveSlots => move_slots(cluster, agents, lasting, &mut log).await,
            Fault::FailoverRedis | Fault::FailoverShard => {
                fail_over(cluster, fault, lasting, &mut log).await;
            }
            // A slow spell, or a third of the times a stall: Redis answers nothing for
            // longer than a refresh period but less than kas's timeout (where it can), so
            // refreshes sent before land late, after the records they refresh expired, and
            // are answered (what invariant 15 watches).
            Fault::SlowRedis if thread_rng().gen_ratio(1, 3) => {
                let period = cluster.ttl / 2;
                let lasting = match cluster.redis_timeout.checked_sub(period) {
                    Some(spare) if !spare.is_zero() => {
                        period + spare.mul_f64(thread_rng().gen_range(0.0..1.0))
                    }
                    _ => lasting,
                };
                cluster.redis.knobs.stall(lasting).await;
            }
            Fault::SlowRedis => {
                cluster.redis.knobs.set_latency(random_ms(50, 800));
                tokio::time::sleep(lasting).await;
                cluster.redis.knobs.set_latency(Duration::ZERO);
            }
            Fault::LoseRecords => lose_records(cluster, agents, kas),
            Fault::HalfOpen => half_open(cluster, homed, kas, &mut log).await,
            Fault::HalfOpenKas => half_open_kas(cluster, agents, kas, &mut log).await,
            Fault::GitLabSlow => {
                cluster.gitlab.set_latency(random_ms(50, 1_000));
                tokio::time::sleep(lasting).await;
                cluster.gitlab.set_latency(Duration::ZERO);
            }
            Fault::GitLabDown => gitlab_down(cluster, homed, &mut log).await,
            Fault::RevokeToken => revoke(cluster, homed, lasting, &mut log).await,
            Fault::KillAgent => {
                log.agents_cut_off = true;
                let i = thread_rng().gen_range(0..cluster.agent_nodes.len());
                let id = cluster.agent_nodes[i].2.id();
                handle.kill(id);
                tokio::time::sleep(lasting).await;
                handle.restart(id);
            }
        }
        if fault.touches_redis() {
            probe(cluster, homed, fault, &mut log).await;
        }
    }
    log
}

/// Within this long of a link between kas and an agent going half-open, the agent (which
/// finds its heartbeats unanswered: 3 of 500 ms, [`kas_agent::UNANSWERED_HEARTBEATS`], or
/// kas's keepalives missing: 3 of 750 ms) or kas (which misses its heartbeats:
/// `agent.heartbeat_timeout`, 3 s here) must have given it up, and calls for the agent
/// must go elsewhere.
const HALF_OPEN_BOUND: Duration = Duration::from_secs(4);

/// How a [`half_open`] fault cuts the link.
#[derive(Clone, Copy, Debug)]
enum Cut {
    /// What kas sends is lost.
    ToAgent,
    /// What the agent sends is lost.
    FromAgent,
    /// The replica freezes (a stopped process, a suspended VM) until the watch over the
    /// link is judged: it sends nothing, not even the close of a link it gives up, so kas
    /// alone must notice the loss (madsim's TCP lets a close cross a clogged link).
    Frozen,
}

/// The link between a replica of one of `agents` and a kas serving it (`kas` if none
/// does) goes half-open: one way drops everything, the other flows, and nothing resets
/// (a middlebox that lost the flow, one route withdrawn); or the replica freezes, which
/// cuts every link of its. Held through a probe of that agent started
/// [`HALF_OPEN_BOUND`] after: the agent must be reachable through every kas again, where
/// it has anywhere else to be (another kas, with agent HA, or another replica); a watch
/// under way over the link must have ended or be flowing by then ([`crate::cut_watch`]).
async fn half_open(cluster: &Cluster, agents: &[AgentSpec], kas: usize, log: &mut FaultLog) {
    let mut rng = thread_rng();
    let candidates: Vec<&(i64, usize, NodeHandle)> = cluster
        .agent_nodes
        .iter()
        .filter(|(agent, _, _)| agents.iter().any(|a| a.agent == *agent))
        .collect();
    let Some(&&(agent, replica, ref node)) =
        candidates.get(rng.gen_range(0..candidates.len().max(1)))
    else {
        return;
    };
    let serving = cluster.truth.serving(agent, replica);
    let kas = serving
        .get(rng.gen_range(0..serving.len().max(1)))
        .copied()
        .unwrap_or(kas);
    let how = match rng.gen_range(0..3) {
        0 => Cut::ToAgent,
        1 => Cut::FromAgent,
        _ => Cut::Frozen,
    };
    // A watch under way over the link, when the replica serves one through that kas.
    let marker = format!("cut{}-kas{kas}-agent{agent}", log.count);
    let watch = crate::cut_watch::open(&cluster.caller(), kas, agent, replica, marker).await;
    tracing::info!(
        kas,
        agent,
        replica,
        ?how,
        watched = watch.judged(),
        "half-open"
    );
    // One served elsewhere is closed at once: it would hold a tunnel the probe needs.
    let watch = if watch.judged() {
        Some(watch)
    } else {
        log.calls
            .push(watch.judge(Instant::now(), HALF_OPEN_BOUND).await.0);
        None
    };
    let spec: Vec<AgentSpec> = agents
        .iter()
        .filter(|a| a.agent == agent)
        .cloned()
        .collect();
    let others = spec.iter().any(|a| a.replicas.len() > 1);
    // Without agent HA a replica dials only its own kas: another replica must take over;
    // a frozen one is nowhere.
    let probed = others || (cluster.ha && !matches!(how, Cut::Frozen));
    // Half the probed faults flood the agent, from [`FLOOD_AHEAD`] before the cut until
    // the probe ends, faster than its tunnels serve: kas refuse one another its calls as
    // busy, which leaves each kas's calls impatient with its own busy tunnels for a
    // while, so that a probe's call gives up waiting here, finds no other kas, and must
    // come back to its place among the flood's (`swarm` seed 4568, mutant 66). Not with
    // agent HA, where every call is judged (invariant 9) and the flood's overload would
    // fail the workload's (`kas-crash-ha` seeds 329, 381 and 10 more of 3,700).
    let stop = Arc::new(AtomicBool::new(false));
    let flood = (probed && !cluster.ha && thread_rng().gen_bool(0.5)).then(|| {
        let (secret, count) = (cluster.gitlab_secret(), cluster.kas_nodes.len());
        let (prefix, stop) = (format!("flood{}", log.count), stop.clone());
        let calls = workload::flood(secret, count, agent, FLOOD_EVERY, prefix, stop);
        cluster.caller().spawn(calls)
    });
    if flood.is_some() {
        tokio::time::sleep(FLOOD_AHEAD).await;
    }
    let (k, a) = (cluster.kas_nodes[kas].id(), node.id());
    let cut = Instant::now();
    match how {
        Cut::ToAgent => cut_one_way((k, a), kas, Far::Agent(agent), HALF_OPEN_BOUND, log).await,
        Cut::FromAgent => cut_one_way((a, k), kas, Far::Agent(agent), HALF_OPEN_BOUND, log).await,
        Cut::Frozen => {
            Handle::current().pause(a);
            tokio::time::sleep(HALF_OPEN_BOUND).await;
        }
    }
    if probed {
        probe(cluster, &spec, Fault::HalfOpen, log).await;
    }
    stop.store(true, Ordering::Relaxed);
    if let Some(flood) = flood {
        let calls = flood.await.expect("the flood");
        let answered = calls.iter().filter(|c| c.result.is_ok()).count();
        tracing::info!(agent, calls = calls.len(), answered, "flooded while probed");
        log.calls.extend(calls);
    }
    if let Some(watch) = watch {
        let (call, violation) = watch.judge(cut, HALF_OPEN_BOUND).await;
        log.calls.push(call);
        log.violations.extend(violation);
    }
    if let Cut::Frozen = how {
        Handle::current().resume(a);
        // Every link of the replica was cut until it woke (and gives them up).
        let woke = Instant::now();
        log.cuts
            .extend((0..cluster.kas_nodes.len()).map(|kas| HalfOpen {
                kas,
                to_whom: Far::Agent(agent),
                from: cut,
                to: woke,
            }));
    } else {
        heal((k, a));
    }
}

/// Cuts the link `way.0` -> `way.1` (from kas `kas` to `to_whom`, or back) and waits for
/// `bound`, by when the link must have been given up: a cut in `log` meanwhile.
async fn cut_one_way(
    way: (NodeId, NodeId),
    kas: usize,
    to_whom: Far,
    bound: Duration,
    log: &mut FaultLog,
) {
    NetSim::current().clog_link(way.0, way.1);
    let from = Instant::now();
    log.cuts.push(HalfOpen {
        kas,
        to_whom,
        from,
        to: from + bound,
    });
    tokio::time::sleep(bound).await;
}

/// Lets everything through between the two nodes again, both ways.
fn heal((a, b): (NodeId, NodeId)) {
    let net = NetSim::current();
    net.unclog_link(a, b);
    net.unclog_link(b, a);
}

/// The path between kas `kas` and another goes half-open (one way drops everything, the
/// other flows, nothing resets), for longer than kas's bound for giving it up
/// ([`kas_server::kas::SILENT_WITHIN`]). Held through a probe started at that bound, of
/// the agents of `agents` reachable from every kas without that path (served by a third
/// kas, or by both): calls must go around it.
async fn half_open_kas(cluster: &Cluster, agents: &[AgentSpec], kas: usize, log: &mut FaultLog) {
    let n = cluster.kas_nodes.len();
    if n < 2 {
        return;
    }
    let mut rng = thread_rng();
    let other = (kas + rng.gen_range(1..n)) % n;
    let (a, b) = (cluster.kas_nodes[kas].id(), cluster.kas_nodes[other].id());
    tracing::info!(kas, other, "half-open between kas");
    let bound = kas_server::kas::SILENT_WITHIN;
    cut_one_way((a, b), kas, Far::Kas(other), bound, log).await;
    let around: Vec<AgentSpec> = agents
        .iter()
        .filter(|a| {
            let at: BTreeSet<usize> = (0..a.replicas.len())
                .flat_map(|r| cluster.truth.serving(a.agent, r))
                .collect();
            at.iter().any(|k| *k != kas && *k != other)
                || (at.contains(&kas) && at.contains(&other))
        })
        .cloned()
        .collect();
    probe(cluster, &around, Fault::HalfOpenKas, log).await;
    heal((a, b));
}

/// GitLab fails every token lookup, for longer than kas caches its answers: the agents
/// connected when it went (every replica served somewhere) must stay reachable through
/// every kas meanwhile, on GitLab's last yes to each (a probe while it is down).
async fn gitlab_down(cluster: &Cluster, agents: &[AgentSpec], log: &mut FaultLog) {
    let served = |agent: i64, replica: usize| !cluster.truth.serving(agent, replica).is_empty();
    let connected: Vec<AgentSpec> = agents
        .iter()
        .filter(|a| (0..a.replicas.len()).all(|r| served(a.agent, r)))
        .cloned()
        .collect();
    cluster.gitlab.set_failing(true);
    // Past the answers' cache lifetime (2 s): every lookup now asks GitLab.
    tokio::time::sleep(random_ms(2_500, 4_000)).await;
    probe(cluster, &connected, Fault::GitLabDown, log).await;
    cluster.gitlab.set_failing(false);
}

/// GitLab revokes the token of one of `agents` for [`checker::REVOKE_BOUND`] and
/// `lasting` more, then accepts it again (as a new token would be): from the bound on, no
/// call may reach the agent (invariant 11, judged at the end).
async fn revoke(cluster: &Cluster, agents: &[AgentSpec], lasting: Duration, log: &mut FaultLog) {
    let agent = agents[thread_rng().gen_range(0..agents.len())].agent;
    tracing::info!(agent, "token revoked");
    cluster.gitlab.set_revoked(agent, true);
    let from = Instant::now();
    tokio::time::sleep(checker::REVOKE_BOUND + lasting).await;
    cluster.gitlab.set_revoked(agent, false);
    log.revocations.push(Revocation {
        agent,
        from,
        to: Instant::now(),
    });
}

/// Redis loses records of live kas `kas` without a word (as an eviction under
/// `maxmemory`, or an operator's `DEL`, would): its liveness record, or the whole
/// instances key, or its records of one agent, or that agent's whole key. Nothing tells
/// the kas: it must write them again within a refresh period, and routers waiting for
/// the agent must find it again (the probe after the fault).
fn lose_records(cluster: &Cluster, agents: &[AgentSpec], kas: usize) {
    let keys = kas_core::keys::Keys::new("kas");
    let id = kas_id(kas);
    let agent = agents[thread_rng().gen_range(0..agents.len())].agent;
    let agent_key = keys.agent(kas_core::AgentId(agent));
    let instances = keys.kas_instances();
    let suffix = format!("@{id}");
    let how = thread_rng().gen_range(0..4);
    tracing::info!(kas, agent, how, "records lost");
    cluster.redis.lose(|key, field| match how {
        0 => key == instances && field == id,
        1 => key == instances,
        2 => key == agent_key && (field == id || field.ends_with(&suffix)),
        _ => key == agent_key,
    });
}

/// Restarts Redis, which keeps nothing: the master, or every shard's master at once.
async fn restart_redis(cluster: &Cluster) {
    let handle = Handle::current();
    let nodes: Vec<_> = match cluster.redis_mode {
        RedisMode::Cluster => cluster.redis_nodes.iter().map(|n| n.id()).collect(),
        _ => vec![cluster.redis_master().id()],
    };
    // Kill first: a bare restart keeps the node's sockets bound.
    for node in &nodes {
        handle.kill(*node);
    }
    // A master's node empties the data as it starts; the shards' nodes share it.
    if cluster.redis_mode == RedisMode::Cluster {
        cluster.redis.start_afresh();
    }
    tokio::time::sleep(random_ms(10, 500)).await;
    for node in nodes {
        handle.restart(node);
    }
}

/// Moves some agent's slot and up to 40 after it (or a random key's) to a random shard,
/// over `lasting`. Half the moves, always of an agent's slot, are judged (inv 13): the
/// fault points are off from [`SETTLED`] before the move until [`SETTLED`] after it, and no
/// kas may count a store error meanwhile, since a cluster client follows `MOVED` and
/// `ASK` rather than failing.
async fn move_slots(
    cluster: &Cluster,
    agents: &[AgentSpec],
    lasting: Duration,
    log: &mut FaultLog,
) {
    let judged = thread_rng().gen_bool(0.5);
    let key = match judged || thread_rng().gen_bool(0.5) {
        true => {
            let agent = agents[thread_rng().gen_range(0..agents.len())].agent;
            Keys::new("kas").agent(AgentId(agent))
        }
        false => format!("key{}", thread_rng().gen_range(0..100_000)),
    };
    let to = thread_rng().gen_range(0..SHARDS);
    let width = thread_rng().gen_range(0..=40);
    if !judged {
        cluster.redis.move_slots(&key, width, to, lasting).await;
        return;
    }
    let rates = kas_server::buggify::rates();
    kas_server::buggify::disable();
    tokio::time::sleep(SETTLED).await;
    let before = store_errors(cluster);
    cluster.redis.move_slots(&key, width, to, lasting).await;
    tokio::time::sleep(SETTLED).await;
    let after = store_errors(cluster);
    kas_server::buggify::restore(rates);
    for (kas, (before, after)) in before.into_iter().zip(after).enumerate() {
        if after > before {
            log.violations.push(format!(
                "inv 13: kas{kas} counted {} store errors while slots of {key:?} moved over {lasting:?} and nothing else failed",
                after - before
            ));
        }
    }
}

/// How long a store operation may take with no fault point on: one Redis request
/// redirected twice, each within kas's Redis timeout (1 s).
const SETTLED: Duration = Duration::from_secs(3);

/// Each kas's store errors counted so far (its `redis_errors_total`).
fn store_errors(cluster: &Cluster) -> Vec<f64> {
    (0..cluster.health.len())
        .map(|k| checker::total(&cluster.metrics(k), "kas_redis_errors_total"))
        .collect()
}

/// Fails Redis over (`fault`: the one master, or one Cluster shard's) to a replica that
/// lacks the last writes. Half the time an agent replica goes first, and the writes lost
/// include its kas deleting its records (on a cluster, two times in three its shard's):
/// the failover brings them back, and its kas must delete them again. Then, half the
/// time, the replica comes back at a random moment of the outage or just after it: its
/// records, written while routers' pub-sub is down, race the rewrite of every record and
/// the routers' catch-up lookups (calls keep waiting for it). Otherwise it stays away
/// until its kas has had [`REDELETE`] to delete them again; no kas may list it then.
async fn fail_over(cluster: &Cluster, fault: Fault, lasting: Duration, log: &mut FaultLog) {
    let handle = Handle::current();
    let gone = thread_rng()
        .gen_bool(0.5)
        .then(|| thread_rng().gen_range(0..cluster.agent_nodes.len()));
    let since = Instant::now();
    if let Some(i) = gone {
        log.agents_cut_off = true;
        handle.kill(cluster.agent_nodes[i].2.id());
        tokio::time::sleep(random_ms(100, 1_000)).await;
    }
    // A replica is promoted: the master's last writes are lost, acknowledged ones too. Up
    // to 1 s (a replica in step) or, half the time, up to 2 TTL (one that had been cut
    // off from its master).
    let most = if thread_rng().gen_bool(0.5) {
        Duration::from_secs(1)
    } else {
        MAX_REPLICATION_LAG
    };
    let mut lost = most.mul_f64(thread_rng().gen_range(0.0..1.0));
    if gone.is_some() {
        lost = lost.max(since.elapsed()).min(MAX_REPLICATION_LAG);
    }
    // Sentinel promotes within moments (the master's connections die with it, so every
    // kas sees it go). A cluster votes a replica in after its node timeout (15 s by
    // default) while the other shards serve on: kas pings every master each second and
    // sees the outage. One shorter than a ping period could go unseen, and its lost
    // writes with it (`redis-restart` seed 454 of a draw of 0.5-4 s: a record lost and
    // rewritten unannounced); no real cluster fails over that fast.
    let outage = if fault == Fault::FailoverRedis {
        random_ms(10, 500)
    } else {
        random_ms(2_000, 4_000)
    };
    let early = gone.filter(|_| thread_rng().gen_bool(0.5)).map(|i| {
        let id = cluster.agent_nodes[i].2.id();
        let back = random_ms(0, outage.as_millis() as u64 + 1_000);
        tokio::spawn(async move {
            tokio::time::sleep(back).await;
            Handle::current().restart(id);
        })
    });
    // Half the time the masters are slow meanwhile and for up to 1 s after (a promoted
    // replica catching up), so that batches may be in flight when their kas finds the
    // store back and rewrites every record.
    let slow = thread_rng().gen_bool(0.5);
    if slow {
        cluster.redis.knobs.set_latency(random_ms(50, 800));
    }
    if fault == Fault::FailoverRedis {
        // The master goes, every connection with it.
        let master = cluster.redis_master().id();
        handle.kill(master);
        cluster.redis.fail_over(lost);
        tokio::time::sleep(outage).await;
        if cluster.redis_mode == RedisMode::Sentinel {
            promote_replica(cluster, master).await;
        } else {
            handle.restart(master);
        }
    } else {
        let shard = match gone {
            Some(i) if thread_rng().gen_bool(2.0 / 3.0) => {
                let agent = AgentId(cluster.agent_nodes[i].0);
                let key = Keys::new("kas").agent(agent);
                cluster.redis.with_db(|db| db.shard(&key))
            }
            _ => thread_rng().gen_range(0..SHARDS),
        };
        // The shard's master goes, every connection with it; its replica, at an address of
        // its own, takes over; the old master comes back as the replica.
        let node = cluster.redis_nodes[cluster.redis.shard_node(shard)].id();
        handle.kill(node);
        cluster.redis.fail_shard(shard, lost);
        tokio::time::sleep(outage).await;
        cluster.redis.promote();
        handle.restart(node);
    }
    if slow {
        tokio::time::sleep(random_ms(0, 1_000)).await;
        cluster.redis.knobs.set_latency(Duration::ZERO);
    }
    if let Some(restart) = early {
        let _ = restart.await;
    } else if let Some(i) = gone {
        tokio::time::sleep(REDELETE).await;
        log.violations.extend(listed_while_gone(cluster, i).await);
        tokio::time::sleep(lasting).await;
        handle.restart(cluster.agent_nodes[i].2.id());
    }
}

/// Sentinel promotes the replica (the dead master's writes it lacks are lost already), and
/// the sentinels name it 0-1 s later, naming the dead master till then; the old master
/// comes back as a replica at a moment of that window.
async fn promote_replica(cluster: &Cluster, old: NodeId) {
    let handle = Handle::current();
    let new = cluster.redis_nodes[cluster.redis.promote_other()].id();
    // Kill first: a bare restart keeps the node's sockets bound.
    handle.kill(new);
    handle.restart(new);
    let (named, back) = (random_ms(0, 1_000), random_ms(0, 1_500));
    let old_back = tokio::spawn(async move {
        tokio::time::sleep(back).await;
        Handle::current().restart(old);
    });
    tokio::time::sleep(named).await;
    cluster.redis.name();
    let _ = old_back.await;
}

/// How long after a failover a kas has to delete again the records it had deleted in the
/// writes the promoted replica lacks: it sees the store come back at its next request
/// (a ping at most 1 s away, or a refused request), and rewrites its records at once.
const REDELETE: Duration = Duration::from_secs(2);

/// Lists agent node `i`'s replica, gone since before a failover that lost its kas's
/// deletion of its records, on a kas drawn at random, [`REDELETE`] after the failover: it
/// must not be listed (unless its records expired by themselves, the revived ones would
/// be). A kas that fails to answer is not judged.
async fn listed_while_gone(cluster: &Cluster, i: usize) -> Vec<String> {
    let (agent, replica, _) = cluster.agent_nodes[i];
    let pod = pod_name(agent, replica);
    let kas = thread_rng().gen_range(0..cluster.kas_nodes.len());
    let secret = cluster.gitlab_secret();
    let probe = async move {
        match workload::listed(&secret, kas, agent).await {
            Ok(listed) if listed.contains(&pod) => vec![format!(
                "inv 7: agent {agent}'s {pod} went before a failover, and {REDELETE:?} after it kas{kas} still lists it"
            )],
            _ => Vec::new(),
        }
    };
    cluster.caller().spawn(probe).await.unwrap_or_default()
}

/// The mean gap between the calls that flood a half-open fault's agent: more than an
/// agent's tunnels serve (`swarm` seed 4568 starved a probe at one call per 7.6 ms).
const FLOOD_EVERY: Duration = Duration::from_millis(5);
/// How long the flood runs before the cut: long enough for kas to refuse one another
/// calls for the saturated agent as busy, as a lasting overload makes them do.
const FLOOD_AHEAD: Duration = Duration::from_secs(3);

/// How long a probe's call may wait for its agent: longer than an agent's reconnection
/// delay, a pub-sub reconnection and a lookup's retries after a failure.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// A probe makes this many calls through each kas to each agent, each at a random moment
/// of [`PROBE_SPREAD`]: so that a call joins a lookup that another started and a tunnel
/// event raced (the agent's tunnel taken and given back by the calls of other kas), and
/// then nothing else happens for that agent. Mutant 28 (a call that joins a raced lookup
/// takes its stale answer and waits for an announcement that has gone by) failed 4 of
/// 1,000 `redis-restart` seeds with 2 calls in 100 ms, 12 of 500 with these.
const PROBE_CALLS: usize = 4;
/// How long after the probe starts its calls may start (see [`PROBE_CALLS`]).
const PROBE_SPREAD: Duration = Duration::from_millis(500);

/// Once `fault` has healed, with the fault points paused, calls through every kas to
/// every agent of `agents` ([`PROBE_CALLS`] each; the agents are up again by now, or
/// reconnecting): each must be answered within [`PROBE_TIMEOUT`]. A router that came out
/// of the fault wrongly sure of where an agent is (or is not), waiting for an announcement
/// that never comes, fails here, where before only such a state that lasted until the
/// healed phase was found (the next pub-sub loss mends it).
async fn probe(cluster: &Cluster, agents: &[AgentSpec], fault: Fault, log: &mut FaultLog) {
    let rates = kas_server::buggify::rates();
    kas_server::buggify::heal();
    let secret = cluster.gitlab_secret();
    let count = log.count;
    let targets: Vec<(usize, i64, String)> = (0..cluster.kas_nodes.len())
        .flat_map(|k| agents.iter().map(move |a| (k, a.agent)))
        .flat_map(|(k, agent)| {
            (0..PROBE_CALLS)
                .map(move |n| (k, agent, format!("probe{count}-{n}-kas{k}-agent{agent}")))
        })
        .collect();
    let calls = cluster
        .caller()
        .spawn(
            async move { workload::at_once(&secret, targets, PROBE_SPREAD, PROBE_TIMEOUT).await },
        )
        .await
        .expect("probe calls");
    kas_server::buggify::restore(rates);
    // The faults that last through their probe, and those probed once healed.
    let when = if matches!(
        fault,
        Fault::HalfOpen | Fault::HalfOpenKas | Fault::GitLabDown
    ) {
        "during"
    } else {
        "after"
    };
    for c in &calls {
        if let Err((code, msg)) = &c.result {
            log.violations.push(format!(
                "inv 5: {when} a {fault:?}, kas{} could not reach agent {} within {PROBE_TIMEOUT:?}: {code:?} {msg}",
                c.kas, c.agent
            ));
        }
    }
    log.calls.extend(calls);
}

/// Stops kas `kas` gracefully, keeps it down `lasting`, and starts it again.
async fn restart_gracefully(cluster: &Cluster, kas: usize, lasting: Duration, log: &mut FaultLog) {
    let from = Instant::now();
    log.violations.extend(stop_gracefully(cluster, kas).await);
    // The process exits: its sockets go with it.
    Handle::current().kill(cluster.kas_nodes[kas].id());
    back_up(cluster, kas, from, lasting, false, log).await;
}

/// Restarts kas `kas`, down since `from` (`killed`, or stopped gracefully), after
/// `lasting`, and records its outage.
async fn back_up(
    cluster: &Cluster,
    kas: usize,
    from: Instant,
    lasting: Duration,
    killed: bool,
    log: &mut FaultLog,
) {
    tokio::time::sleep(lasting).await;
    Handle::current().restart(cluster.kas_nodes[kas].id());
    log.outages.push(Outage {
        kas,
        from,
        to: Instant::now() + RESTARTING,
        killed,
    });
}

/// Stops each kas gracefully and starts it again, in turn, until `until`, with every agent
/// back on two kas before the next.
async fn rolling_restart(cluster: &Cluster, agents: &[AgentSpec], until: Instant) -> FaultLog {
    let mut log = FaultLog::default();
    let mut kas = thread_rng().gen_range(0..cluster.kas_nodes.len());
    tokio::time::sleep(random_ms(1_000, 3_000)).await;
    while Instant::now() + Duration::from_secs(5) < until {
        log.count += 1;
        tracing::info!(kas, "rolling restart");
        restart_gracefully(cluster, kas, random_ms(100, 1_500), &mut log).await;
        await_homed(cluster, agents).await;
        kas = (kas + 1) % cluster.kas_nodes.len();
    }
    log
}

/// Waits (30 s at most) until every replica of `agents` is listed on two kas. Agents
/// that dial a kas they hold already back off, so this may take a few dials; a bound
/// passed leaves the next fault to find an agent on one kas (a call then may fail, and
/// invariant 8 is not judged for it: see [`checker::check_reachable`]).
async fn await_homed(cluster: &Cluster, agents: &[AgentSpec]) -> bool {
    let secret = cluster.gitlab_secret();
    let truth = cluster.truth.clone();
    let agents: Vec<(i64, usize)> = agents.iter().map(|a| (a.agent, a.replicas.len())).collect();
    let probe = async move {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            // As kas lists them, and as the replicas see it: a connection a half-open
            // link left behind is listed until kas finds it dead, and one the replica
            // is still opening through such a link is listed before it is up.
            let mut homed = true;
            for &(agent, replicas) in &agents {
                let listed = workload::homes(&secret, 0, agent).await.unwrap_or_default();
                homed &= listed.len() == replicas && listed.iter().all(|(_, kas)| kas.len() == 2);
                homed &= (0..replicas).all(|r| truth.serving(agent, r).len() == 2);
            }
            if homed {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        false
    };
    cluster.caller().spawn(probe).await.unwrap_or(false)
}

/// Lists, on every other kas, the agents with a replica on kas `dead`, which has been down
/// for longer than the TTL: its records have expired, each field by its own time, even
/// where another kas keeps the key alive (a replica of the same agent elsewhere), so none
/// of its replicas may be listed. A kas that fails to answer is not judged.
async fn listed_while_dead(cluster: &Cluster, agents: &[AgentSpec], dead: usize) -> Vec<String> {
    let secret = cluster.gitlab_secret();
    if cluster.ha {
        return listed_on_dead(cluster, agents, dead).await;
    }
    let probe: Vec<(usize, i64, Vec<String>)> = agents
        .iter()
        .filter(|a| a.replicas.contains(&dead))
        .flat_map(|a| {
            let pods = (0..a.replicas.len())
                .filter(|&r| a.replicas[r] == dead)
                .map(|r| pod_name(a.agent, r))
                .collect::<Vec<_>>();
            (0..cluster.kas_nodes.len())
                .filter(move |&k| k != dead)
                .map(move |k| (k, a.agent, pods.clone()))
        })
        .collect();
    if probe.is_empty() {
        return Vec::new();
    }
    cluster
        .caller()
        .spawn(async move {
            let mut out = Vec::new();
            for (k, agent, gone) in probe {
                let Ok(listed) = workload::listed(&secret, k, agent).await else {
                    continue;
                };
                for pod in listed.iter().filter(|p| gone.contains(p)) {
                    out.push(format!(
                        "inv 7: kas{dead} has been down for longer than the TTL, but kas{k} lists agent {agent}'s {pod} on it"
                    ));
                }
            }
            out
        })
        .await
        .unwrap_or_default()
}

/// [`listed_while_dead`] with agent HA: any replica may be on any kas, so every listing of
/// every agent on every other kas must not name the dead kas among a replica's kas.
async fn listed_on_dead(cluster: &Cluster, agents: &[AgentSpec], dead: usize) -> Vec<String> {
    let secret = cluster.gitlab_secret();
    let address = kas_id(dead);
    let others: Vec<usize> = (0..cluster.kas_nodes.len())
        .filter(|&k| k != dead)
        .collect();
    let agents: Vec<i64> = agents.iter().map(|a| a.agent).collect();
    let probe = async move {
        let mut out = Vec::new();
        for k in others {
            for &agent in &agents {
                let Ok(homes) = workload::homes(&secret, k, agent).await else {
                    continue;
                };
                for (pod, _) in homes.iter().filter(|(_, kas)| kas.contains(&address)) {
                    out.push(format!(
                        "inv 7: kas{dead} has been down for longer than the TTL, but kas{k} lists agent {agent}'s {pod} on it"
                    ));
                }
            }
        }
        out
    };
    cluster.caller().spawn(probe).await.unwrap_or_default()
}

/// What a killed or restarted kas left must have been collected by the time the healed
/// phase ends: each kas sees the kas go (or its incarnation change) within a GC period of
/// its restart, waits out the longest record life (a project's connection records,
/// `ttl + 2 refresh` = 2 TTL here), and collects at its next period (GC period = TTL here),
/// so 4 TTL after the last fault, which the healed wait outlasts. Every field must be live.
fn expired_fields_left(cluster: &Cluster) -> Vec<String> {
    let now = kas_transport::clock::now();
    let entries = cluster.redis.with_db(|db| db.entries(Instant::now()));
    let mut out = Vec::new();
    for (key, fields) in entries {
        for (field, bytes) in fields {
            match kas_core::expiring::decode(&bytes) {
                Ok((at, _)) if at > now => {}
                Ok((at, _)) => out.push(format!(
                    "inv 6: after healing, Redis holds {key} field {field}, expired {} ms ago",
                    now.0 - at.0
                )),
                Err(e) => out.push(format!("inv 6: Redis holds {key} field {field}: {e}")),
            }
        }
    }
    out
}

/// Sends kas `kas` a SIGTERM and waits for it to stop. A kas that says it deleted its
/// registry records must have left none of this run's: no field named by its id (its
/// instance record, its agents' tunnel records) that expires later than a record written
/// at its start would (an earlier, killed run's records expire by themselves).
async fn stop_gracefully(cluster: &Cluster, kas: usize) -> Vec<String> {
    // The shutdown grace, then at most 2 s to delete the records and close connections.
    let stop_within = cluster.grace + Duration::from_secs(2);
    let slot = &cluster.stopped[kas];
    let read = || *slot.lock().unwrap_or_else(|p| p.into_inner());
    Handle::current().send_ctrl_c(cluster.kas_nodes[kas].id());
    let asked = Instant::now();
    while read().cleaned.is_none() && asked.elapsed() < stop_within {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let id = kas_id(kas);
    let run = read();
    match run.cleaned {
        None => vec![format!(
            "inv 6: kas{kas} had not stopped {stop_within:?} after its SIGTERM"
        )],
        Some(false) => Vec::new(), // Redis did not answer: the records expire by TTL
        Some(true) => {
            let ours = |bytes: &[u8]| {
                kas_core::expiring::decode(bytes)
                    .is_ok_and(|(at, _)| at >= run.started + cluster.ttl)
            };
            let entries = cluster.redis.with_db(|db| db.entries(Instant::now()));
            entries
                .into_iter()
                .filter(|(_, fields)| fields.iter().any(|(f, v)| *f == id && ours(v)))
                .map(|(key, _)| {
                    format!(
                        "inv 6: kas{kas} stopped gracefully, but Redis still holds {key} field {id}"
                    )
                })
                .collect()
        }
    }
}

/// A kind of fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// A range of a Redis Cluster's slots moved to another shard (`ASK`, then `MOVED`).
    MoveSlots,
    KillKas,
    StopKas,
    Clog,
    ClogRedis,
    RestartRedis,
    FailoverRedis,
    FailoverShard,
    SlowRedis,
    KillAgent,
    ClogNode,
    TimeJump,
    LoseRecords,
    HalfOpen,
    /// The path between two kas half-open: one way drops everything, with no reset.
    HalfOpenKas,
    GitLabSlow,
    GitLabDown,
    RevokeToken,
}

impl Fault {
    /// Whether it disturbs Redis, or kas's connections with it.
    fn touches_redis(self) -> bool {
        use Fault::*;
        matches!(
            self,
            ClogRedis
                | RestartRedis
                | FailoverRedis
                | FailoverShard
                | MoveSlots
                | SlowRedis
                | LoseRecords
        )
    }

    /// The fault as Redis in `mode` can have it: a failover is the master's, or on a
    /// cluster one shard's; slots move only on a cluster (elsewhere the master fails over).
    fn on(self, mode: RedisMode) -> Fault {
        use Fault::*;
        match (self, mode == RedisMode::Cluster) {
            (FailoverShard | MoveSlots, false) => FailoverRedis,
            (FailoverRedis, true) => FailoverShard,
            (fault, _) => fault,
        }
    }

    const ALL: [Fault; 18] = [
        Fault::MoveSlots,
        Fault::KillKas,
        Fault::StopKas,
        Fault::Clog,
        Fault::ClogRedis,
        Fault::RestartRedis,
        Fault::FailoverRedis,
        Fault::FailoverShard,
        Fault::SlowRedis,
        Fault::KillAgent,
        Fault::ClogNode,
        Fault::TimeJump,
        Fault::LoseRecords,
        Fault::HalfOpen,
        Fault::HalfOpenKas,
        Fault::GitLabSlow,
        Fault::GitLabDown,
        Fault::RevokeToken,
    ];
}

fn fault_kinds(scenario: Scenario) -> Vec<Fault> {
    use Fault::*;
    match scenario {
        Scenario::Steady => vec![],
        Scenario::KasCrash => vec![KillKas, StopKas],
        Scenario::Partition => vec![Clog, ClogRedis, ClogNode, HalfOpen, HalfOpenKas],
        Scenario::RedisRestart => vec![
            RestartRedis,
            FailoverRedis,
            FailoverShard,
            MoveSlots,
            SlowRedis,
            LoseRecords,
        ],
        Scenario::ReconnectStorm => vec![],
        Scenario::AgentChurn => vec![KillAgent, GitLabSlow, GitLabDown, RevokeToken],
        Scenario::KasCrashHa => vec![
            KillKas,
            StopKas,
            HalfOpen,
            HalfOpenKas,
            GitLabSlow,
            GitLabDown,
        ],
        Scenario::RollingRestart => vec![],
        Scenario::Swarm => {
            let all = Fault::ALL;
            let mut kinds: Vec<Fault> = all
                .into_iter()
                .filter(|_| thread_rng().gen_bool(0.5))
                .collect();
            if kinds.is_empty() {
                kinds.push(all[thread_rng().gen_range(0..all.len())]);
            }
            kinds
        }
    }
}

/// Runs `scenario` in the current madsim runtime.
pub async fn run(scenario: Scenario) -> Report {
    let Shape {
        cluster: spec,
        every,
    } = shape(scenario);
    let mut points = kas_server::buggify::enable();
    // With agent HA a kas going away is the fault, and every call must be answered
    // (invariant 9). Half the steady runs keep only the timing points, so that every
    // call there is judged too (`check_fault_free`): a call that waits for nothing fails.
    if scenario.ha() || (scenario == Scenario::Steady && thread_rng().gen_bool(0.5)) {
        kas_server::buggify::heal();
        points.retain(|p| !p.is_fault());
    }
    let traced = crate::spans::Recorder::in_half_the_runs();
    let mut cluster = Cluster::build(&spec);
    // One more agent, connecting at a random moment of the faulty phase.
    let mut agents = spec.agents.clone();
    let late_kas = thread_rng().gen_range(0..spec.kas);
    cluster.add_agent(LATE, 0, late_kas, random_ms(3_000, 15_000));
    agents.push(AgentSpec {
        agent: LATE,
        replicas: vec![late_kas],
    });
    // And one that answers every call with an `Error` frame: its calls fail, once each.
    cluster.add_scripted_agent(Script::Rogue, ROGUE, thread_rng().gen_range(0..spec.kas));
    // And one that takes every place the limits give it, judging kas's counts.
    cluster.add_scripted_agent(Script::Greedy, GREEDY, thread_rng().gen_range(0..spec.kas));
    let start = Instant::now();
    // One caller node for every phase.
    let caller = cluster.caller();
    // Where every call is judged, a greedy Kubernetes API caller crowds one more agent.
    let judged = scenario == Scenario::Steady && !points.iter().any(|p| p.is_fault());
    let greedy = judged.then(|| {
        let kas = thread_rng().gen_range(0..spec.kas);
        cluster.add_agent(crate::callers::CROWDED, 0, kas, Duration::ZERO);
        let until = start + FAULTY - Duration::from_secs(4);
        caller.spawn(async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            greedy_caller::run(kas, until).await
        })
    });
    let (mut calls, log) =
        faulty_phase(scenario, &cluster, &caller, &spec, &agents, every, start).await;
    let mut violations = log.violations.clone();
    // Requests GitLab's callers made besides `calls`.
    let mut uncounted = 0;
    if let Some(greedy) = greedy {
        let crowding = greedy.await.expect("the greedy caller runs");
        // Its agent's job is done: its tunnels' heartbeats would slow the rest of the run.
        for (agent, _, node) in &cluster.agent_nodes {
            if *agent == crate::callers::CROWDED {
                Handle::current().kill(node.id());
            }
        }
        for c in crowding.probes.iter().filter(|c| c.result.is_err()) {
            violations.push(format!(
                "inv 10: {} for agent {} through kas{} failed while a greedy caller held {} watches on it: {:?}",
                c.marker, c.agent, c.kas, crowding.held, c.result
            ));
        }
        if crowding.held != greedy_caller::SHARE {
            violations.push(format!(
                "inv 10: a greedy caller was given {} watches on agent {}, not {} (all but a quarter of the {} tunnels its one connection's pool may open; kas allows {})",
                crowding.held,
                crate::callers::CROWDED,
                greedy_caller::SHARE,
                crate::callers::CROWDED_POOL,
                crate::greedy::TUNNELS
            ));
        }
        calls.extend(crowding.probes);
        uncounted = crowding.asked;
    }
    // The fault points are faults too: off for the healed phase (timing points stay on).
    kas_server::buggify::heal();
    if scenario.ha() {
        let ha: Vec<i64> = spec.agents.iter().map(|a| a.agent).collect();
        let from = log.settled.unwrap_or(start + Duration::from_secs(1));
        let homes = cluster.truth.homes();
        violations.extend(checker::check_reachable(
            &calls,
            &cluster.truth.deliveries(),
            &homes,
            &ha,
            &log.outages,
            &log.cuts,
            from,
            HA_LIVE_TIMEOUT,
        ));
        let until = Instant::now();
        violations.extend(checker::check_available(
            &homes,
            &ha,
            &log.outages,
            &log.cuts,
            until,
        ));
    }
    if judged {
        // Calls in the first second may find kas not yet listening.
        let settled: Vec<Call> = calls
            .iter()
            .filter(|c| c.started >= start + Duration::from_secs(1))
            .cloned()
            .collect();
        violations.extend(checker::check_fault_free(
            &settled,
            &spec.agents,
            LIVE_TIMEOUT,
        ));
    }
    calls.extend(healed_phase(&cluster, &caller, spec.kas, &agents, &mut violations).await);
    violations.extend(expired_fields_left(&cluster));
    let (waited, wakeups) = liveness_phase(&mut cluster, &caller, spec.kas, &mut violations).await;
    calls.extend(waited);
    if let Some(recorder) = &traced {
        violations.extend(recorder.check());
    }
    violations.extend(judge_run(&cluster, &calls, &log, uncounted).await);
    if !violations.is_empty() {
        violations.push(format!("(buggify points on in this run: {points:?})"));
        violations.push(format!(
            "({} kas; replicas' kas by agent: {:?}; a call every {every:?} on average)",
            spec.kas,
            spec.agents
                .iter()
                .map(|a| (a.agent, &a.replicas))
                .collect::<Vec<_>>()
        ));
    }
    Report {
        stats: Stats::of(&calls, wakeups.clone()),
        wakeups,
        faults: log.count,
        violations,
    }
}

/// The faulty phase: GitLab's calls for `FAULTY` from `start` while the scenario's faults
/// strike. Returns the calls (the probes' included) and what happened.
async fn faulty_phase(
    scenario: Scenario,
    cluster: &Cluster,
    caller: &NodeHandle,
    spec: &ClusterSpec,
    agents: &[AgentSpec],
    every: Duration,
    start: Instant,
) -> (Vec<Call>, FaultLog) {
    let mut targets: Vec<i64> = agents.iter().map(|a| a.agent).collect();
    targets.push(ABSENT);
    targets.push(ROGUE);
    let until = start + FAULTY;
    let calls = caller.spawn(workload::run(
        cluster.gitlab_secret(),
        spec.kas,
        targets,
        every,
        until,
        "call",
    ));
    // With agent HA, a third of the runs start as one kas scaled out to all of them.
    let scaled = match scenario.ha() && thread_rng().gen_bool(1.0 / 3.0) {
        true => Some(scale_out(cluster, &spec.agents, start).await),
        false => None,
    };
    let mut log = FaultLog::default();
    if scenario == Scenario::ReconnectStorm {
        for _ in 0..3 {
            tokio::time::sleep(random_ms(2_000, 5_000)).await;
            let from = Instant::now();
            Handle::current().kill(cluster.kas_nodes[0].id());
            back_up(cluster, 0, from, random_ms(500, 2_000), true, &mut log).await;
            log.count += 1;
        }
    } else if scenario == Scenario::RollingRestart {
        log = rolling_restart(cluster, &spec.agents, until).await;
    } else {
        let kinds = fault_kinds(scenario);
        let (faulted, returns) = tokio::join!(
            faults(cluster, agents, &spec.agents, &kinds, until),
            store_back::watch(cluster, until)
        );
        log = faulted;
        let late = store_back::check(&returns, &log.outages, &log.stalls);
        log.violations.extend(late);
    }
    if let Some((outages, settled)) = scaled {
        log.outages.extend(outages);
        log.settled = Some(settled);
    }
    let mut calls: Vec<Call> = calls.await.expect("caller finished");
    calls.append(&mut log.calls);
    (calls, log)
}

/// Starts with one kas: every other one is down from `start` until 1.5-4 s later, when
/// the agents have met the first, which counted itself alone; they must learn of the
/// others and connect to two (inv 9), as when kas is scaled out. Returns the outages, and
/// when every replica of `agents` was on two kas (or the wait for it gave up).
async fn scale_out(
    cluster: &Cluster,
    agents: &[AgentSpec],
    start: Instant,
) -> (Vec<Outage>, Instant) {
    let first = thread_rng().gen_range(0..cluster.kas_nodes.len());
    let others: Vec<usize> = (0..cluster.kas_nodes.len())
        .filter(|k| *k != first)
        .collect();
    for &k in &others {
        Handle::current().kill(cluster.kas_nodes[k].id());
    }
    tracing::info!(first, "scaling out from one kas");
    tokio::time::sleep(random_ms(1_500, 4_000)).await;
    let mut outages = Vec::new();
    for k in others {
        Handle::current().restart(cluster.kas_nodes[k].id());
        outages.push(Outage {
            kas: k,
            from: start,
            to: Instant::now() + RESTARTING,
            killed: true,
        });
    }
    await_homed(cluster, agents).await;
    (outages, Instant::now())
}

/// Healed: agents reconnect (their backoff is capped) and records expire and are
/// rewritten (and collected: see `expired_fields_left`); then every kas must reach every
/// agent (inv 5) and list exactly its replicas (inv 7). Returns the calls made.
async fn healed_phase(
    cluster: &Cluster,
    caller: &NodeHandle,
    kas: usize,
    agents: &[AgentSpec],
    violations: &mut Vec<String>,
) -> Vec<Call> {
    tokio::time::sleep(TTL * 3 + crate::cluster::RECONNECT_MAX + Duration::from_secs(2)).await;
    let secret = cluster.gitlab_secret();
    let final_calls = caller
        .spawn({
            let secret = secret.clone();
            let agents = agents.to_vec();
            async move {
                let mut out = Vec::new();
                for k in 0..kas {
                    for a in &agents {
                        let marker = format!("final-kas{k}-agent{}", a.agent);
                        out.push(
                            workload::call(&secret, k, a.agent, marker, Duration::from_secs(10))
                                .await,
                        );
                    }
                }
                out
            }
        })
        .await
        .expect("final calls");
    violations.extend(checker::check_healed_calls(&final_calls));
    let listed = caller
        .spawn({
            let agents = agents.to_vec();
            async move {
                let mut out = Vec::new();
                for k in 0..kas {
                    for a in &agents {
                        // A read may time out under the timing points' pauses (up to 1 s
                        // in all, as long as kas's Redis timeout): that is no wrong list.
                        let mut listed = workload::listed(&secret, k, a.agent).await;
                        for _ in 0..2 {
                            if listed.is_ok() {
                                break;
                            }
                            listed = workload::listed(&secret, k, a.agent).await;
                        }
                        out.push((k, a.agent, listed));
                    }
                }
                out
            }
        })
        .await
        .expect("listing");
    violations.extend(checker::check_listed(&listed, agents));
    final_calls
}

/// Liveness: a call waits on every kas for an agent that is not connected; it connects to
/// one of them; every call must be delivered, woken by the tunnel's registration (inv 7).
/// Returns the calls and how long after the registration each was delivered.
async fn liveness_phase(
    cluster: &mut Cluster,
    caller: &NodeHandle,
    kas: usize,
    violations: &mut Vec<String>,
) -> (Vec<Call>, Vec<Duration>) {
    let live_kas = thread_rng().gen_range(0..kas);
    let secret = cluster.gitlab_secret();
    let waiting =
        caller.spawn({
            let targets = (0..kas)
                .map(|k| (k, LIVENESS, format!("wait-kas{k}")))
                .collect();
            async move {
                workload::at_once(&secret, targets, Duration::ZERO, Duration::from_secs(10)).await
            }
        });
    tokio::time::sleep(random_ms(500, 2_000)).await;
    cluster.add_agent(LIVENESS, 0, live_kas, Duration::ZERO);
    let waited = waiting.await.expect("waiting calls");
    let channel = Keys::new("kas").tunnel_events(AgentId(LIVENESS));
    let registered = cluster.redis.with_db(|db| db.first_publication(&channel));
    let truth = cluster.truth.deliveries();
    let (wakeups, woken) = checker::check_woken(&waited, &truth, registered, LIVENESS, live_kas);
    violations.extend(woken);
    (waited, wakeups)
}

/// The whole run's invariants over `calls` (and `uncounted` requests besides) and what
/// agents, Redis and kas recorded, once the run is over.
async fn judge_run(
    cluster: &Cluster,
    calls: &[Call],
    log: &FaultLog,
    uncounted: usize,
) -> Vec<String> {
    let truth = cluster.truth.deliveries();
    let mut violations = checker::check_calls(calls, &truth, &[ABSENT], &log.stalls, &log.outages);
    if !log.agents_cut_off {
        let holds = cluster.truth.holds();
        violations.extend(checker::check_holds(calls, &holds, &log.stalls));
    }
    violations.extend(checker::check_revoked(&log.revocations, &truth));
    let silences = cluster.truth.silences();
    violations.extend(checker::check_silences(
        &silences,
        &log.stalls,
        &log.outages,
        &log.cuts,
    ));
    violations.extend(cluster.redis.with_db(Db::unannounced));
    violations.extend(leaks_left(cluster, calls.len() + uncounted).await);
    violations.extend(cluster.truth.violations());
    // Every request has ended by now, and its record been written.
    let audit: Vec<Vec<String>> = (0..cluster.kas_nodes.len())
        .map(|k| cluster.audit_lines(k))
        .collect();
    violations.extend(checker::check_audit(&audit, kas_id, calls, &log.outages));
    violations
}

/// Leaks (inv 6), and hops (inv 4) over the `issued` calls: with every agent gone and
/// records expired, no tunnel, call, subscription or Redis record may remain.
async fn leaks_left(cluster: &Cluster, issued: usize) -> Vec<String> {
    for (_, _, node) in &cluster.agent_nodes {
        Handle::current().kill(node.id());
    }
    // Subscriptions outlive an agent's last call by the linger.
    let linger = crate::cluster::LINGER;
    tokio::time::sleep(TTL * 3 + Duration::from_secs(4) + linger).await;
    let mut violations = Vec::new();
    let mut routed = 0.0;
    for k in 0..cluster.health.len() {
        let metrics = cluster.metrics(k);
        violations.extend(checker::check_hops(k, &metrics));
        routed += checker::routed(&metrics);
        violations.extend(checker::check_gauges_zero(k, &metrics));
    }
    violations.extend(checker::check_routed(routed, issued));
    kas_server::buggify::disable();
    let entries = cluster.redis.with_db(|db| db.entries(Instant::now()));
    violations.extend(checker::check_records_left(&entries));
    violations
}
