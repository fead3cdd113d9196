//! Part 6, the rollout: agents holding connections to two kas each through one balancer
//! (agentk's default) while every kas is restarted in turn with SIGTERM (twice), then
//! while one is killed and started again; GitLab's unary calls and long streams flow
//! through every kas that is up all along.

use crate::scale::gauge;
use crate::setup::{self, KasOptions, World};
use futures::StreamExt;
use kas_agent::{AgentOptions, Modules, PODS_LIST, PODS_LOGS};
use kas_client::api_client::ApiClient;
use kas_proto::pods::{ListRequest, LogChunk, LogsRequest};
use kas_tools::local::balancer::Balancer;
use kas_tools::local::kas_process::KasProcess;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// The part's sizes.
pub struct Sizes {
    /// Agents; every third has two replicas.
    pub agents: i64,
    /// The first agent's id (ids no other part uses).
    pub first: i64,
    /// Unary calls per second, over every kas that is up.
    pub rate: u32,
    /// Long streams open at once.
    pub streams: usize,
    /// How long each long stream lasts (less than the grace: a stop lets it finish).
    pub stream_for: Duration,
    /// kas's `shutdown_grace`.
    pub grace: Duration,
    /// Rounds of restarting every kas in turn.
    pub rounds: usize,
}

/// How long agents may take to be on two kas each again.
const HOMING: Duration = Duration::from_secs(180);

/// One piece of a long stream every this often.
const PIECE_EVERY: Duration = Duration::from_millis(100);
const PIECE: usize = 1024;

/// A duration as the table shows it.
pub fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

/// Phases the calls are counted in.
const PHASES: [&str; 2] = [
    "(a) every kas restarted in turn with SIGTERM",
    "(b) one kas SIGKILLed and restarted",
];

/// What one call or stream came to.
struct Outcome {
    phase: usize,
    agent: i64,
    kas: usize,
    at: Instant,
    /// `None`: answered (whole, for a stream).
    failed: Option<Failure>,
    stream: bool,
}

/// Why a call or stream failed.
struct Failure {
    /// The status code (or "short" for a stream that ended early).
    code: String,
    message: String,
}

impl Failure {
    fn of(status: &tonic::Status) -> Failure {
        Failure {
            code: format!("{:?}", status.code()),
            message: status.message().to_string(),
        }
    }
}

/// The modules of a rollout agent: the bench's pod list, and a log that comes one 1 KiB
/// piece every 100 ms until `limit_bytes` (a long stream).
fn modules() -> Arc<Modules> {
    let mut m = Modules::default();
    m.unary(PODS_LIST, |_: ListRequest| async { Ok(setup::pods()) });
    m.server_streaming(PODS_LOGS, |req: LogsRequest| async move {
        let pieces = usize::try_from(req.limit_bytes).unwrap_or(0) / PIECE;
        let stream = futures::stream::iter(0..pieces).then(|_| async {
            tokio::time::sleep(PIECE_EVERY).await;
            Ok(LogChunk {
                data: vec![b'x'; PIECE],
            })
        });
        Ok(stream.boxed())
    });
    Arc::new(m)
}

/// The kas, which are up, and GitLab's clients of them.
struct Fleet {
    kas: Vec<KasProcess>,
    /// Each kas's (agent, api, private, observability) addresses, kept across restarts.
    listen: Vec<[SocketAddr; 4]>,
    up: Arc<Vec<AtomicBool>>,
    clients: Arc<RwLock<Vec<ApiClient>>>,
}

fn addresses(k: &KasProcess) -> [SocketAddr; 4] {
    let a = &k.addresses;
    [a.agent, a.api, a.private_api, a.observability]
}

async fn client(world: &World, kas: &KasProcess) -> Result<ApiClient, String> {
    ApiClient::connect(
        &kas.addresses.api.to_string(),
        &world.gitlab,
        Duration::from_secs(10),
    )
    .await
}

/// Waits (at most `within`) until every replica is connected to two kas: the kas's
/// `kas_connected_agents` gauges (replicas connected to each) add up to twice the
/// replicas. (Listings would not do after a kill: a kas started again on the same address
/// has the same id, and its previous run's records stay live until they expire.) How long
/// it took.
async fn await_homed(
    kas: &[KasProcess],
    replicas: usize,
    within: Duration,
) -> Result<Duration, String> {
    let began = Instant::now();
    let mut connected = 0.0;
    while began.elapsed() < within {
        connected = connections(&kas.iter().collect::<Vec<_>>()).await;
        if connected == 2.0 * replicas as f64 {
            return Ok(began.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!(
        "{connected} replica connections, not {} (every replica on two kas), after {within:?}",
        2 * replicas
    ))
}

/// Replica connections on `kas`: their `kas_connected_agents` gauges added up.
pub async fn connections(kas: &[&KasProcess]) -> f64 {
    let mut connected = 0.0;
    for k in kas {
        connected += gauge(k, "kas_connected_agents").await.unwrap_or(0.0);
    }
    connected
}

/// Runs the part; prints its table and returns its JSON.
pub async fn part(world: &mut World, options: KasOptions, sizes: &Sizes) -> Result<Value, String> {
    let options = KasOptions {
        grace: sizes.grace,
        ..options
    };
    let mut kas = Vec::new();
    for _ in 0..3 {
        kas.push(world.kas(options).await?);
    }
    let listen: Vec<[SocketAddr; 4]> = kas.iter().map(addresses).collect();
    let balancer = Balancer::start(listen.iter().map(|l| l[0]).collect())
        .await
        .map_err(|e| format!("balancer: {e}"))?;
    let mut clients = Vec::new();
    for k in &kas {
        clients.push(client(world, k).await?);
    }
    let mut fleet = Fleet {
        kas,
        listen,
        up: Arc::new((0..3).map(|_| AtomicBool::new(true)).collect()),
        clients: Arc::new(RwLock::new(clients)),
    };

    // Agents through the balancer, agentk's defaults but for a warm pool of 2 tunnels.
    let (stop_agents, shutdown) = watch::channel(false);
    let mut replicas = Vec::new();
    let mut tasks = Vec::new();
    for agent in sizes.first..sizes.first + sizes.agents {
        let n = if agent % 3 == 0 { 2 } else { 1 };
        replicas.push((agent, n));
        for r in 0..n {
            let meta = kas_proto::registry::AgentMeta {
                version: "bench".into(),
                pod_name: format!("rollout-{agent}-{r}"),
                ..Default::default()
            };
            let lb = balancer.address.to_string();
            let mut o = AgentOptions::new(lb, setup::token(agent), meta);
            o.seed = rand::random();
            o.pool.min_idle = 2;
            tasks.push(tokio::spawn(kas_agent::run(o, modules(), shutdown.clone())));
        }
    }
    let replicas: usize = replicas.iter().map(|r| r.1).sum();
    let homed_at_start = await_homed(&fleet.kas, replicas, HOMING).await?;
    println!(
        "rollout: {} agents ({replicas} replicas) each on two kas after {}",
        sizes.agents,
        secs(homed_at_start)
    );

    // GitLab's load.
    let gitlab = Arc::new(Load {
        agents: (sizes.first, sizes.agents),
        up: fleet.up.clone(),
        clients: fleet.clients.clone(),
        phase: AtomicUsize::new(0),
        done: AtomicBool::new(false),
        outcomes: Mutex::default(),
    });
    let mut load = vec![tokio::spawn(gitlab.clone().unary(sizes.rate))];
    for s in 0..sizes.streams {
        load.push(tokio::spawn(gitlab.clone().streams(s, sizes.stream_for)));
    }

    // (a) every kas in turn, SIGTERM, `rounds` times.
    let mut stops = Vec::new();
    let mut rehomed = Vec::new();
    for _ in 0..sizes.rounds {
        for i in 0..3 {
            // Not ready: GitLab and the balancer stop choosing it; calls under way run on.
            fleet.up[i].store(false, Ordering::Relaxed);
            balancer.set_ready(i, false);
            tokio::time::sleep(Duration::from_millis(300)).await;
            let began = Instant::now();
            fleet.kas[i].terminate();
            stops.push(began.elapsed());
            restart(world, &mut fleet, i, options).await?;
            balancer.set_ready(i, true);
            rehomed.push(await_homed(&fleet.kas, replicas, HOMING).await?);
        }
    }
    // (b) one kas killed, then started again.
    gitlab.phase.store(1, Ordering::Relaxed);
    tokio::time::sleep(sizes.stream_for).await;
    fleet.up[1].store(false, Ordering::Relaxed);
    balancer.set_ready(1, false);
    let killed_at = Instant::now();
    fleet.kas[1].kill();
    restart(world, &mut fleet, 1, options).await?;
    balancer.set_ready(1, true);
    await_homed(&fleet.kas, replicas, HOMING).await?;
    let rehomed_after_kill = killed_at.elapsed();
    tokio::time::sleep(sizes.stream_for).await;
    gitlab.done.store(true, Ordering::Relaxed);
    for l in load {
        let _ = l.await;
    }
    let _ = stop_agents.send(true);
    for t in tasks {
        let _ = t.await;
    }
    let outcomes = std::mem::take(&mut *gitlab.outcomes.lock().expect("not poisoned"));
    Ok(report(
        &outcomes,
        &stops,
        &rehomed,
        rehomed_after_kill,
        killed_at,
        &fleet.listen[1][2].to_string(),
        sizes,
    ))
}

/// Starts kas `i` again on its addresses, with a fresh GitLab client; then it is up.
async fn restart(
    world: &mut World,
    fleet: &mut Fleet,
    i: usize,
    options: KasOptions,
) -> Result<(), String> {
    let again = KasOptions {
        listen: Some(fleet.listen[i]),
        ..options
    };
    fleet.kas[i] = world.kas(again).await?;
    let c = client(world, &fleet.kas[i]).await?;
    fleet.clients.write().expect("not poisoned")[i] = c;
    fleet.up[i].store(true, Ordering::Relaxed);
    Ok(())
}

/// The next kas that is up, in turn after `turn`.
fn next_up(up: &[AtomicBool], turn: &mut usize) -> Option<usize> {
    for _ in 0..up.len() {
        *turn += 1;
        let i = *turn % up.len();
        if up[i].load(Ordering::Relaxed) {
            return Some(i);
        }
    }
    None
}

/// GitLab's side: what it calls, through which kas, and what came of it.
struct Load {
    /// The first agent's id, and how many.
    agents: (i64, i64),
    up: Arc<Vec<AtomicBool>>,
    clients: Arc<RwLock<Vec<ApiClient>>>,
    /// The phase calls started now count in.
    phase: AtomicUsize,
    done: AtomicBool,
    outcomes: Mutex<Vec<Outcome>>,
}

impl Load {
    /// A random agent, and the client of the next kas up after `turn`.
    fn pick(&self, turn: &mut usize) -> Option<(usize, i64, ApiClient)> {
        let i = next_up(&self.up, turn)?;
        let (first, agents) = self.agents;
        let agent = first + rand::random::<i64>().rem_euclid(agents);
        let api = self.clients.read().expect("not poisoned")[i].clone();
        Some((i, agent, api))
    }

    fn record(&self, outcome: Outcome) {
        self.outcomes.lock().expect("not poisoned").push(outcome);
    }

    /// Unary calls at `rate` per second, each for a random agent through the next kas up.
    async fn unary(self: Arc<Self>, rate: u32) {
        let mut tick = tokio::time::interval(Duration::from_secs(1) / rate.max(1));
        let mut turn = 0;
        let mut calls = Vec::new();
        while !self.done.load(Ordering::Relaxed) {
            tick.tick().await;
            let Some((i, agent, api)) = self.pick(&mut turn) else {
                continue;
            };
            let (phase, load) = (self.phase.load(Ordering::Relaxed), self.clone());
            calls.push(tokio::spawn(async move {
                let at = Instant::now();
                let answer = api.pods(agent, None, "").await;
                let failed = answer.err().map(|s| Failure::of(&s));
                load.record(Outcome {
                    phase,
                    agent,
                    kas: i,
                    at,
                    failed,
                    stream: false,
                });
            }));
        }
        for c in calls {
            let _ = c.await;
        }
    }

    /// Long streams, one after another: a log read whole over `length`, through the next
    /// kas up (the `n`th stream starts at the `n`th), for a random agent.
    async fn streams(self: Arc<Self>, n: usize, length: Duration) {
        let pieces = (length.as_millis() / PIECE_EVERY.as_millis()).max(1) as usize;
        let mut turn = n;
        while !self.done.load(Ordering::Relaxed) {
            let Some((i, agent, api)) = self.pick(&mut turn) else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let api = api.with_timeout(length * 3 + Duration::from_secs(10));
            let phase = self.phase.load(Ordering::Relaxed);
            let at = Instant::now();
            let limit = i64::try_from(pieces * PIECE).unwrap_or(i64::MAX);
            let failed = match api
                .pod_logs(agent, None, "default", "rollout", "", limit)
                .await
            {
                Err(s) => Some(Failure::of(&s)),
                Ok(mut log) => {
                    let mut bytes = 0;
                    loop {
                        match log.message().await {
                            Ok(Some(chunk)) => bytes += chunk.data.len(),
                            Ok(None) if bytes == pieces * PIECE => break None,
                            Ok(None) => {
                                break Some(Failure {
                                    code: "short".into(),
                                    message: format!("{bytes} bytes"),
                                });
                            }
                            Err(s) => {
                                eprintln!("rollout: a long stream through kas{i} was cut: {s}");
                                break Some(Failure::of(&s));
                            }
                        }
                    }
                }
            };
            self.record(Outcome {
                phase,
                agent,
                kas: i,
                at,
                failed,
                stream: true,
            });
        }
    }
}

/// The longest time any agent went from a failed call to its next answered one (or to
/// the end of the phase).
fn longest_unreachable(outcomes: &[&Outcome]) -> Duration {
    let mut by_agent: BTreeMap<i64, Vec<&Outcome>> = BTreeMap::new();
    for o in outcomes.iter().filter(|o| !o.stream) {
        by_agent.entry(o.agent).or_default().push(o);
    }
    let mut longest = Duration::ZERO;
    for calls in by_agent.values_mut() {
        calls.sort_by_key(|o| o.at);
        let mut failing_since: Option<Instant> = None;
        for o in calls.iter() {
            match (&o.failed, failing_since) {
                (Some(_), None) => failing_since = Some(o.at),
                (None, Some(since)) => {
                    longest = longest.max(o.at - since);
                    failing_since = None;
                }
                _ => {}
            }
        }
        if let (Some(since), Some(last)) = (failing_since, calls.last()) {
            longest = longest.max(last.at - since);
        }
    }
    longest
}

/// Where a failure in (b) came from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Cause {
    /// It entered the killed kas before it died (GitLab's connection to it broke).
    Entered,
    /// Another kas had forwarded it to the killed kas, where it was delivered: the error
    /// names the killed kas's private address.
    Forwarded,
    /// Anything else: against the goal.
    Other,
}

fn cause(o: &Outcome, f: &Failure, killed_at: Instant, killed_private: &str) -> Cause {
    if o.kas == 1 && o.at <= killed_at {
        Cause::Entered
    } else if f.message.contains(killed_private) {
        Cause::Forwarded
    } else {
        Cause::Other
    }
}

fn report(
    outcomes: &[Outcome],
    stops: &[Duration],
    rehomed: &[Duration],
    rehomed_after_kill: Duration,
    killed_at: Instant,
    killed_private: &str,
    sizes: &Sizes,
) -> Value {
    println!("\n## Rollout (agents on two kas each through one balancer)\n");
    println!(
        "{} agents, {} unary calls/s and {} long streams of {} at a time, through every kas that is up; kas shutdown_grace {}.\n",
        sizes.agents,
        sizes.rate,
        sizes.streams,
        secs(sizes.stream_for),
        secs(sizes.grace)
    );
    println!(
        "| phase | calls | failed (by status) | long streams | streams cut (by status) | longest an agent was unreachable (failures of the killed kas aside) |"
    );
    println!("|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for (p, name) in PHASES.iter().enumerate() {
        let of: Vec<&Outcome> = outcomes.iter().filter(|o| o.phase == p).collect();
        let calls: Vec<&&Outcome> = of.iter().filter(|o| !o.stream).collect();
        let streams: Vec<&&Outcome> = of.iter().filter(|o| o.stream).collect();
        let mut failed: BTreeMap<String, usize> = BTreeMap::new();
        for o in &calls {
            if let Some(f) = &o.failed {
                *failed.entry(f.code.clone()).or_default() += 1;
            }
        }
        let mut cut: BTreeMap<String, usize> = BTreeMap::new();
        for o in &streams {
            if let Some(f) = &o.failed {
                *cut.entry(f.code.clone()).or_default() += 1;
            }
        }
        // A call that failed with the killed kas says nothing of its agent's reach.
        let judged: Vec<&Outcome> = of
            .iter()
            .copied()
            .filter(|o| {
                o.phase == 0
                    || o.failed
                        .as_ref()
                        .is_none_or(|f| cause(o, f, killed_at, killed_private) == Cause::Other)
            })
            .collect();
        let unreachable = longest_unreachable(&judged);
        println!(
            "| {name} | {} | {} {failed:?} | {} | {} {cut:?} | {} |",
            calls.len(),
            failed.values().sum::<usize>(),
            streams.len(),
            cut.values().sum::<usize>(),
            secs(unreachable)
        );
        rows.push(json!({
            "phase": name,
            "calls": calls.len(),
            "failed": failed,
            "streams": streams.len(),
            "streams_cut": cut,
            "longest_unreachable_ms": unreachable.as_secs_f64() * 1e3,
        }));
    }
    // In (b), where each failure came from.
    let (mut entered, mut forwarded, mut other) = (0, 0, 0);
    for o in outcomes.iter().filter(|o| o.phase == 1) {
        if let Some(f) = &o.failed {
            *match cause(o, f, killed_at, killed_private) {
                Cause::Entered => &mut entered,
                Cause::Forwarded => &mut forwarded,
                Cause::Other => &mut other,
            } += 1;
        }
    }
    let longest_stop = stops.iter().max().copied().unwrap_or_default();
    println!(
        "\nkas stops (SIGTERM to exit): {}; the longest {} (goal: within the grace + 2 s = {}).",
        stops
            .iter()
            .map(|d| secs(*d))
            .collect::<Vec<_>>()
            .join(", "),
        secs(longest_stop),
        secs(sizes.grace + Duration::from_secs(2))
    );
    println!(
        "Every replica on two kas again, after each restart: {}; after the kill: {}.",
        rehomed
            .iter()
            .map(|d| secs(*d))
            .collect::<Vec<_>>()
            .join(", "),
        secs(rehomed_after_kill)
    );
    println!(
        "In (b), failures: {entered} entered the killed kas before it died, {forwarded} were forwarded to it by another kas (delivered there), {other} other."
    );
    json!({
        "phases": rows,
        "stops_ms": stops.iter().map(|d| d.as_secs_f64() * 1e3).collect::<Vec<_>>(),
        "rehomed_ms": rehomed.iter().map(|d| d.as_secs_f64() * 1e3).collect::<Vec<_>>(),
        "rehomed_after_kill_ms": rehomed_after_kill.as_secs_f64() * 1e3,
        "failed_through_killed_kas": entered,
        "failed_forwarded_to_killed_kas": forwarded,
        "failed_otherwise": other,
    })
}
