//! `kas-bench`: routing overhead, wake-up latency, idle tunnel cost and Redis cost of the
//! kas router, measured in one run on loopback, printed as tables and written as JSON.

mod deadlines;
mod instructions;
mod kube;
mod rehome;
mod rollout;
mod scale;
mod setup;
mod stats;
mod streaming;
mod traces;
mod unary;
mod wakeup;

use clap::Parser;
use kas_client::api_client::ApiClient;
use kas_tools::local::kas_process::KasProcess;
use scale::{Commands, Fleet, await_gauge};
use serde_json::{Value, json};
use setup::{KasOptions, World};
use stats::ms;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Benchmarks the kas router on loopback against a private redis-server and prints tables
/// (and writes them as JSON). Run it in release mode, beside the release `kas` binary:
///
///   cargo build --release --bin kas --bin kas-bench && target/release/kas-bench
///
/// 1. Unary latency and throughput at each --concurrency (default 1 to 1,024 calls in
///    flight) on three paths: direct (GitLab calling the agent's Pods service), local
///    route (the kas holding the tunnel) and remote route (another kas, which forwards),
///    each as a ratio to direct, over --callers client connections per path; both routes
///    again with calls spread over --unary-agents agents; then each path's peak and how
///    far below it the higher concurrencies fall.
/// 2. Streaming throughput: a pod log of --log-mib MiB in 64 KiB messages, read whole on
///    the same three paths, as a ratio to direct.
///    With --tls, parts 1 and 2 also measure both routes over TLS on every hop.
/// 3. Wake-up latency: a call waits on kas B, its agent connects to kas A; from the
///    tunnel's registration to delivery, with pub-sub and with polling only.
///    And the Redis commands per waiting call per second, both ways.
/// 4. kas resident memory per connected agent and per idle tunnel at --agents agents, and
///    Redis commands per agent per minute at steady state.
/// 5. The Kubernetes API (kas-local's API server behind the agent): `GET /api/v1/pods`
///    latency and a --kube-mib MiB response's throughput through the local and remote
///    routes as ratios to the API server dialled directly, and kas memory per open watch
///    (--watches at once) on both kas of the remote route.
/// 6. The rollout: --rollout-agents agents, each replica on two of three kas through one
///    balancer (agentk's default), while every kas is restarted in turn with SIGTERM
///    (twice) and then one is killed and restarted, under GitLab calls through every kas
///    that is up: calls made and failed, long streams cut, the longest time an agent was
///    unreachable, and how long each kas took to stop.
/// 7. Re-homing: --rehome-agents agents, each on two of three kas through one balancer;
///    one kas is killed and stays down: how long until every agent is on the two left, and
///    Redis's commands per second meanwhile, against the steady rate before.
/// 8. Traces: the remote route's unary calls at --traces-concurrency with kas exporting no
///    spans, every span to a live OTLP/HTTP receiver (in this process), and to a receiver
///    that is down: p50, calls/s and kas CPU per call, as ratios to off.
/// 9. Instructions (only when asked for: `--parts instructions`; needs valgrind): kas's
///    instructions per call on each route (GitLab's unary GetPods, then a Kubernetes API
///    `GET /api/v1/pods`), counted by callgrind over --instructions-calls calls at 1 and
///    16 in flight, and each kas's top functions by inclusive and by own count. Unlike CPU
///    time, comparable across machines and loads.
///
/// kas runs as child processes (`kas` next to this binary); agents and GitLab's client run
/// in this process.
#[derive(Parser)]
#[command(version, about, long_about)]
struct Args {
    /// Agents for the idle-cost and Redis-cost part (each on its own TCP connection).
    #[arg(long, default_value_t = 10_000)]
    agents: i64,
    /// Agent connections per loopback source address in that part: they come from
    /// 127.0.0.1, 127.0.0.2, ... in turn, this many at most on each, so that no address
    /// runs out of ephemeral ports (about 28,000 each with Linux's default range). kas
    /// needs a descriptor per agent: raise its open-file limit (`ulimit -n`) past --agents.
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(i64).range(1..))]
    agents_per_source: i64,
    /// Runs the idle-cost and Redis-cost part on a Redis Cluster of this many masters (3 or more, no
    /// replicas; made with `redis-cli --cluster create`) instead of one redis-server, and
    /// counts the commands of every node. 0: one redis-server.
    #[arg(long, default_value_t = 0, value_parser = cluster_masters)]
    redis_cluster: usize,
    /// Calls in flight at the unary part's points, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256,1024")]
    concurrency: Vec<usize>,
    /// Agents the unary part's many-agents paths spread their calls over (each with a pool
    /// of 2 idle tunnels, on the local route's kas); 0 leaves those paths out.
    #[arg(long, default_value_t = 1_000)]
    unary_agents: i64,
    /// Client connections (HTTP/2) each path's unary calls are spread over, in turn.
    #[arg(long, default_value_t = 1)]
    callers: usize,
    /// How long each latency point is measured (after a warm-up of a third of it).
    #[arg(long, value_name = "DURATION", default_value = "3s", value_parser = humantime::parse_duration)]
    point: Duration,
    /// Wake-up samples with pub-sub (polling only: a third of them).
    #[arg(long, default_value_t = 60)]
    wakeups: usize,
    /// Calls waiting at once for the Redis cost of waiting calls.
    #[arg(long, default_value_t = 1_000)]
    waiting: i64,
    /// How long the Redis commands of waiting calls are counted.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    waiting_window: Duration,
    /// Registry record TTL of the kas (refreshed every half): the Redis cost is counted over
    /// nine refresh periods, after a wait of three TTLs.
    #[arg(long, value_name = "DURATION", default_value = "20s", value_parser = humantime::parse_duration)]
    ttl: Duration,
    /// Size of the log read in the streaming part, in MiB.
    #[arg(long, value_name = "MIB", default_value_t = 64)]
    log_mib: i64,
    /// Timed reads of the log per path (after one warm-up read); the median counts.
    #[arg(long, default_value_t = 5)]
    log_reads: usize,
    /// The parts to run, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "unary,streaming,wakeup,scale,kube,rollout,rehome,traces"
    )]
    parts: Vec<Part>,
    /// Size of the response body streamed through the Kubernetes API, in MiB.
    #[arg(long, value_name = "MIB", default_value_t = 1024)]
    kube_mib: u64,
    /// Kubernetes API watches held open at once to measure kas memory per watch.
    #[arg(long, default_value_t = 1000)]
    watches: usize,
    /// Agents in the rollout part (every third with two replicas).
    #[arg(long, default_value_t = 100)]
    rollout_agents: i64,
    /// Unary calls per second in the rollout part.
    #[arg(long, default_value_t = 200)]
    rollout_rate: u32,
    /// Long streams open at once in the rollout part, each lasting --rollout-stream.
    #[arg(long, default_value_t = 10)]
    rollout_streams: usize,
    /// How long each long stream of the rollout part lasts.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = humantime::parse_duration)]
    rollout_stream: Duration,
    /// Rounds of restarting every kas in turn in the rollout part.
    #[arg(long, default_value_t = 2)]
    rollout_rounds: usize,
    /// The kas's `shutdown_grace` in the rollout part.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    rollout_grace: Duration,
    /// Agents in the re-homing part (one replica each, agentk's defaults).
    #[arg(long, default_value_t = 10_000)]
    rehome_agents: i64,
    /// (Internal: the re-homing part's child processes.) Run agents FIRST..FIRST+COUNT
    /// dialling --host-kas through a balancer, until stdin closes.
    #[arg(long, hide = true, num_args = 2, value_names = ["FIRST", "COUNT"])]
    host_agents: Option<Vec<i64>>,
    /// (Internal.) The kas agent addresses for --host-agents, comma-separated.
    #[arg(long, hide = true, value_delimiter = ',')]
    host_kas: Vec<std::net::SocketAddr>,
    /// Calls in flight in the traces part.
    #[arg(long, default_value_t = 64)]
    traces_concurrency: usize,
    /// Calls counted at each point of the instructions part.
    #[arg(long, default_value_t = 2_000)]
    instructions_calls: usize,
    /// Functions listed per kas and route in the instructions part.
    #[arg(long, default_value_t = 25)]
    instructions_top: usize,
    /// Where to write the results as JSON.
    #[arg(long, value_name = "FILE", default_value = "kas-bench.json")]
    json: PathBuf,
    /// Also measure the routed paths of parts 1 and 2 over TLS on every hop (GitLab ->
    /// kas, kas -> kas, kas -> agent), in the same tables as plaintext.
    #[arg(long)]
    tls: bool,
}

/// A part of the bench.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Part {
    /// Unary latency and throughput (1).
    Unary,
    /// Streaming throughput (2).
    Streaming,
    /// Wake-up latency and the Redis cost of waiting calls (3).
    Wakeup,
    /// Idle cost and Redis cost at --agents agents (4).
    Scale,
    /// The Kubernetes API: latency, a long stream's throughput, memory per watch (5).
    Kube,
    /// Agents on several kas while every kas restarts in turn, and one is killed (6).
    Rollout,
    /// Many agents re-homing after a kas dies: time, and Redis's load (7).
    Rehome,
    /// What traces cost a routed call: off, exported, the receiver down (8).
    Traces,
    /// kas's instructions per call on each route, under callgrind (9; not by default).
    Instructions,
}

/// The value of the first `key: value` line of `file` (a /proc file), or "?".
fn machine_fact(file: &str, key: &str) -> String {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == key).then(|| v.trim().to_string())
        })
        .unwrap_or_else(|| "?".into())
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kas-bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some([first, count]) = args.host_agents.as_deref() {
        raise_file_limit();
        let hosted = runtime.block_on(rehome::host(*first, *count, args.host_kas.clone()));
        return match hosted {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kas-bench agent host: {e}");
                ExitCode::FAILURE
            }
        };
    }
    match runtime.block_on(run(&args)) {
        Ok(results) => {
            let text = serde_json::to_string_pretty(&results).unwrap_or_default();
            if let Err(e) = std::fs::write(&args.json, text + "\n") {
                eprintln!("kas-bench: {}: {e}", args.json.display());
                return ExitCode::FAILURE;
            }
            println!("\nresults written to {}", args.json.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kas-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Raises the open-file limit to its hard limit; returns the new limit.
fn raise_file_limit() -> u64 {
    rlimit::increase_nofile_limit(u64::MAX).unwrap_or(1024)
}

async fn pair(world: &mut World, options: KasOptions) -> Result<(KasProcess, KasProcess), String> {
    Ok((world.kas(options).await?, world.kas(options).await?))
}

/// Parts 2 and 3 on a fresh pair of kas: `samples` wake-ups with agents `first..`, then
/// the Redis commands of waiting calls.
async fn waiting_parts(
    world: &mut World,
    options: KasOptions,
    first: i64,
    samples: usize,
    args: &Args,
) -> Result<(wakeup::Wakeups, Commands), String> {
    let (a, b) = pair(world, options).await?;
    let gitlab_b = gitlab(world, &b, false).await?;
    let redis = world.redis.address();
    let woken = wakeup::measure(&redis, &gitlab_b, &a, first, samples).await?;
    let waiting = scale::waiting_calls(
        &world.redis,
        &gitlab_b,
        &b,
        args.waiting,
        args.waiting_window,
    )
    .await?;
    Ok((woken, waiting))
}

/// GitLab's client of `kas`, over TLS (trusting the world's CA) when `tls`.
async fn gitlab(world: &World, kas: &KasProcess, tls: bool) -> Result<ApiClient, String> {
    let addr = kas.addresses.api;
    let (url, ca) = if tls {
        (format!("grpcs://{addr}"), Some(world.ca.as_path()))
    } else {
        (addr.to_string(), None)
    };
    ApiClient::connect_with_ca(&url, ca, &world.gitlab, Duration::from_secs(10)).await
}

/// `n` more clients of kas's public API, each on a connection of its own.
async fn gitlabs(
    world: &World,
    kas: &KasProcess,
    tls: bool,
    n: usize,
) -> Result<Vec<ApiClient>, String> {
    let mut clients = Vec::with_capacity(n);
    for _ in 0..n {
        clients.push(gitlab(world, kas, tls).await?);
    }
    Ok(clients)
}

async fn run(args: &Args) -> Result<Value, String> {
    let files = raise_file_limit();
    // Each end of an agent's connection is in its own process: kas, or this one.
    let agents = args
        .agents
        .min(i64::try_from(files).unwrap_or(i64::MAX) - 1_000);
    if agents < args.agents && args.parts.contains(&Part::Scale) {
        println!(
            "open-file limit {files}: measuring {agents} agents instead of {}",
            args.agents
        );
    }
    let poll_samples = (args.wakeups / 3).max(1);
    // Tokens: agents 1..=agents for the idle part, then one per wake-up sample, then the
    // rollout's, then the re-homing part's.
    let rollout_first = agents.max(1) + (args.wakeups + poll_samples) as i64 + 1;
    let rehome_first = rollout_first + args.rollout_agents.max(1);
    let mut world = World::start(rehome_first - 1 + args.rehome_agents.max(1))?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "kas-bench: {cores} cores, redis {}, loopback",
        world
            .redis
            .cli(&["INFO", "server"])
            .lines()
            .find_map(|l| l.strip_prefix("redis_version:"))
            .unwrap_or("?")
            .trim()
    );
    let pubsub = KasOptions {
        pubsub: true,
        ttl: args.ttl,
        tls: false,
        kubernetes_api: false,
        grace: Duration::from_secs(1),
        listen: None,
        tracing: None,
        callgrind: false,
    };
    let mut results = json!({
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "kas_version": env!("CARGO_PKG_VERSION"),
        "build": if cfg!(debug_assertions) { "debug" } else { "release" },
        "machine": {
            "cores": cores,
            "cpu": machine_fact("/proc/cpuinfo", "model name"),
            "memory": machine_fact("/proc/meminfo", "MemTotal"),
            "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
            "open_file_limit": files,
        },
    });
    if args.parts.contains(&Part::Unary) || args.parts.contains(&Part::Streaming) {
        routed_parts(&mut world, pubsub, args, &mut results).await?;
    }
    if args.parts.contains(&Part::Wakeup) {
        let first_wakeup = agents.max(1) + 1;
        waiting_section(
            &mut world,
            pubsub,
            first_wakeup,
            poll_samples,
            args,
            &mut results,
        )
        .await?;
    }
    if args.parts.contains(&Part::Scale) {
        scale_section(&mut world, pubsub, agents, args, &mut results).await?;
    }
    if args.parts.contains(&Part::Kube) {
        let sizes = kube::Sizes {
            point: args.point,
            stream_bytes: args.kube_mib << 20,
            stream_reads: args.log_reads,
            watches: args.watches,
        };
        results["kubernetes_api"] = kube::part(&mut world, pubsub, &sizes).await?;
    }
    if args.parts.contains(&Part::Rollout) {
        let sizes = rollout::Sizes {
            agents: args.rollout_agents.max(1),
            first: rollout_first,
            rate: args.rollout_rate,
            streams: args.rollout_streams,
            stream_for: args.rollout_stream,
            grace: args.rollout_grace,
            rounds: args.rollout_rounds,
        };
        results["rollout"] = rollout::part(&mut world, pubsub, &sizes).await?;
    }
    if args.parts.contains(&Part::Rehome) {
        let agents = args.rehome_agents.max(1);
        results["rehome"] = rehome::part(&mut world, pubsub, agents, rehome_first).await?;
    }
    if args.parts.contains(&Part::Traces) {
        let concurrency = args.traces_concurrency;
        results["traces"] = traces::part(&mut world, pubsub, concurrency, args.point).await?;
    }
    if args.parts.contains(&Part::Instructions) {
        let (calls, top) = (args.instructions_calls.max(1), args.instructions_top);
        results["instructions"] = instructions::part(&mut world, pubsub, calls, top).await?;
    }
    Ok(results)
}

/// A running agent: stops when the sender is dropped or sent true.
type RunningAgent = (
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<()>,
);

/// An agent (a warm pool of 16 tunnels, at most 256) serving the bench's Pods module on kas
/// `kas`, dialled over TLS when `tls`.
async fn warm_agent(
    world: &World,
    kas: &KasProcess,
    agent: i64,
    tls: bool,
) -> Result<RunningAgent, String> {
    agent_with(world, kas, agent, tls, setup::modules(|| {}).into(), 256).await
}

/// An agent (a warm pool of 16 tunnels, at most `max_tunnels`) serving `modules` on kas
/// `kas`, dialled over TLS when `tls`.
async fn agent_with(
    world: &World,
    kas: &KasProcess,
    agent: i64,
    tls: bool,
    modules: std::sync::Arc<kas_agent::Modules>,
    max_tunnels: usize,
) -> Result<RunningAgent, String> {
    let addr = kas.addresses.agent;
    let url = if tls {
        format!("grpcs://{addr}")
    } else {
        addr.to_string()
    };
    let mut options = kas_agent::AgentOptions::new(
        url,
        setup::token(agent),
        kas_proto::registry::AgentMeta {
            version: "bench".into(),
            pod_name: "bench-agent".into(),
            ..Default::default()
        },
    );
    options.ca_cert_file = tls.then(|| world.ca.clone());
    // On this kas only: the routes measured are through it or through another.
    options.kas_connections = 1;
    options.pool.min_idle = 16;
    options.pool.max = max_tunnels;
    let (stop, shutdown) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(kas_agent::run(options, modules, shutdown));
    await_gauge(kas, "kas_tunnels", 16.0, Duration::from_secs(20)).await?;
    Ok((stop, task))
}

/// Agents `first..first + n` on `kas`, each with a pool of 2 idle tunnels (at most 16),
/// once kas holds all their tunnels.
async fn many_agents(kas: &KasProcess, first: i64, n: i64) -> Result<Vec<RunningAgent>, String> {
    let before = scale::gauge(kas, "kas_tunnels").await.unwrap_or(0.0);
    let mut running = Vec::new();
    for agent in first..first + n {
        let mut options = kas_agent::AgentOptions::new(
            kas.addresses.agent.to_string(),
            setup::token(agent),
            kas_proto::registry::AgentMeta {
                version: "bench".into(),
                pod_name: format!("bench-agent-{agent}"),
                ..Default::default()
            },
        );
        options.kas_connections = 1;
        options.pool.min_idle = 2;
        options.pool.max = 16;
        let (stop, shutdown) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(kas_agent::run(
            options,
            setup::modules(|| {}).into(),
            shutdown,
        ));
        running.push((stop, task));
    }
    let all = before + 2.0 * n as f64;
    await_gauge(kas, "kas_tunnels", all, Duration::from_secs(60)).await?;
    Ok(running)
}

/// Stops `agents` and waits (up to 15 s each) for them to leave.
async fn stop(agents: Vec<RunningAgent>) {
    for (stop, _) in &agents {
        let _ = stop.send(true);
    }
    for (_, task) in agents {
        let _ = tokio::time::timeout(Duration::from_secs(15), task).await;
    }
}

/// Parts 1 and 2: agent 1 on kas A (a warm tunnel pool), a direct Pods server, and with
/// --tls agent 2 on kas TA of a pair serving TLS.
async fn routed_parts(
    world: &mut World,
    pubsub: KasOptions,
    args: &Args,
    results: &mut Value,
) -> Result<(), String> {
    let (a, b) = pair(world, pubsub).await?;
    let mut agents = vec![warm_agent(world, &a, 1, false).await?];
    let direct_addr = unary::serve_direct().await?;
    let direct = unary::direct_client(direct_addr).await?;
    let (gitlab_a, gitlab_b) = (
        gitlab(world, &a, false).await?,
        gitlab(world, &b, false).await?,
    );
    // The unary part's extra client connections, per route (--callers).
    let callers = if args.parts.contains(&Part::Unary) {
        args.callers.max(1) - 1
    } else {
        0
    };
    let mut extra = vec![
        gitlabs(world, &a, false, callers).await?,
        gitlabs(world, &b, false, callers).await?,
    ];
    let mut routes = vec![
        ("local route", gitlab_a, 1),
        ("remote route", gitlab_b.clone(), 1),
    ];
    let tls_pair = if args.tls {
        let (ta, tb) = pair(
            world,
            KasOptions {
                tls: true,
                ..pubsub
            },
        )
        .await?;
        agents.push(warm_agent(world, &ta, 2, true).await?);
        routes.push(("local route, TLS", gitlab(world, &ta, true).await?, 2));
        routes.push(("remote route, TLS", gitlab(world, &tb, true).await?, 2));
        extra.push(gitlabs(world, &ta, true, callers).await?);
        extra.push(gitlabs(world, &tb, true, callers).await?);
        Some((ta, tb))
    } else {
        None
    };
    if args.parts.contains(&Part::Unary) {
        // Agents 3.. on kas A (tokens exist for 1..=--agents and beyond).
        let many = args
            .unary_agents
            .clamp(0, args.agents.saturating_sub(2).max(0));
        let many_agents = many_agents(&a, 3, many).await?;
        let many_names = [
            format!("local route, {many} agents"),
            format!("remote route, {many} agents"),
        ];
        let mut directs = vec![unary::direct(direct.clone())];
        for _ in 0..callers {
            directs.push(unary::direct(unary::direct_client(direct_addr).await?));
        }
        let mut paths = vec![("direct", unary::in_turn(directs))];
        for ((name, gl, agent), more) in routes.iter().zip(&extra) {
            let mut calls = vec![unary::routed(gl.clone(), *agent)];
            calls.extend(more.iter().map(|g| unary::routed(g.clone(), *agent)));
            paths.push((*name, unary::in_turn(calls)));
        }
        if many > 0 {
            // The plaintext routes, first in `routes`.
            for (((_, gl, _), more), label) in routes.iter().zip(&extra).zip(&many_names) {
                let mut calls = vec![unary::spread(gl.clone(), 3, many)];
                calls.extend(more.iter().map(|g| unary::spread(g.clone(), 3, many)));
                paths.push((label.as_str(), unary::in_turn(calls)));
            }
        }
        let kas: Vec<u32> = [&a, &b]
            .into_iter()
            .chain(tls_pair.iter().flat_map(|(ta, tb)| [ta, tb]))
            .filter_map(|k| k.pid())
            .collect();
        results["unary"] = unary_part(&paths, &kas, args).await;
        stop(many_agents).await;
        results["deadlines"] = deadlines::part(
            unary::routed(gitlab_b.clone(), 1),
            gitlab_b.clone(),
            args.point,
        )
        .await;
    }
    if args.parts.contains(&Part::Streaming) {
        // A read may take long on a slow build: calls get a minute.
        let minute = Duration::from_secs(60);
        let mut paths = vec![("direct", streaming::Path::Direct(direct))];
        for (name, gl, agent) in &routes {
            paths.push((
                *name,
                streaming::Path::Routed(gl.with_timeout(minute), *agent),
            ));
        }
        results["streaming"] = streaming_part(&paths, args).await?;
    }
    stop(agents).await;
    drop(tls_pair);
    Ok(())
}

/// Part 1: each path at each `--concurrency`, then each path's peak; with the CPU time
/// per call of the kas processes `kas` (all of them, the idle ones too) and of this one.
async fn unary_part(paths: &[(&str, unary::CallFn)], kas: &[u32], args: &Args) -> Value {
    let warmup = args.point / 3;
    println!(
        "\n## Unary calls (a 10-pod list, {} bytes)\n",
        prost::Message::encoded_len(&setup::pods())
    );
    println!("{} client connection(s) per path\n", args.callers.max(1));
    println!(
        "kas CPU: every kas process's user and system time over the point, per call (direct \
         calls pass no kas); bench CPU: this process's (the client and the agents)\n"
    );
    println!(
        "| path | concurrency | p50 ms | p99 ms | calls/s | p50 / direct | calls/s / direct | kas CPU µs per call | bench CPU µs per call | errors |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for &concurrency in &args.concurrency {
        let mut base: Option<unary::Point> = None;
        for (name, call) in paths {
            let p = unary::measure(call.clone(), concurrency, warmup, args.point, kas).await;
            let b = base.get_or_insert_with(|| p.clone());
            let p50 = p.latencies.quantile(0.5);
            let ratio = p50.as_secs_f64() / b.latencies.quantile(0.5).as_secs_f64().max(1e-9);
            let tput = p.per_second / b.per_second.max(1e-9);
            let micros = |d: Duration| d.as_secs_f64() * 1e6;
            let (kas_cpu, bench_cpu) = p
                .cpu_per_call
                .map_or((None, None), |(k, b)| (Some(micros(k)), Some(micros(b))));
            let shown = |v: Option<f64>| v.map_or("?".to_string(), |v| format!("{v:.1}"));
            println!(
                "| {name} | {concurrency} | {:.3} | {:.3} | {:.0} | {ratio:.2} | {:.0}% | {} | {} | {} |",
                ms(p50),
                ms(p.latencies.quantile(0.99)),
                p.per_second,
                tput * 100.0,
                shown(kas_cpu),
                shown(bench_cpu),
                p.errors
            );
            if let Some(e) = &p.first_error {
                println!("|   first error: {e} | | | | | | | | | |");
            }
            rows.push(json!({
                "path": name, "concurrency": concurrency,
                "p50_ms": ms(p50), "p99_ms": ms(p.latencies.quantile(0.99)),
                "calls_per_s": p.per_second, "p50_ratio_to_direct": ratio,
                "throughput_ratio_to_direct": tput, "kas_cpu_us_per_call": kas_cpu,
                "bench_cpu_us_per_call": bench_cpu, "calls": p.latencies.len(), "errors": p.errors, "first_error": p.first_error,
            }));
        }
    }
    let peaks = peaks(paths, &rows);
    json!({ "callers": args.callers.max(1), "points": rows, "peaks": peaks })
}

/// Each path's peak throughput, and the lowest throughput at a higher concurrency as a
/// share of it (a collapse under load shows there).
fn peaks(paths: &[(&str, unary::CallFn)], rows: &[Value]) -> Value {
    println!(
        "\n| path | peak calls/s | at concurrency | lowest above it, calls/s | at concurrency | lowest / peak |"
    );
    println!("|---|---|---|---|---|---|");
    let mut out = Vec::new();
    for (name, _) in paths {
        let points: Vec<(u64, f64)> = rows
            .iter()
            .filter(|r| r["path"] == *name)
            .map(|r| {
                let c = r["concurrency"].as_u64().unwrap_or(0);
                (c, r["calls_per_s"].as_f64().unwrap_or(0.0))
            })
            .collect();
        let Some(&(peak_at, peak)) = points.iter().max_by(|a, b| a.1.total_cmp(&b.1)) else {
            continue;
        };
        let lowest = points
            .iter()
            .filter(|(c, _)| *c > peak_at)
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .copied();
        let (low_at, low) = lowest.unwrap_or((peak_at, peak));
        let share = low / peak.max(1e-9);
        println!(
            "| {name} | {peak:.0} | {peak_at} | {low:.0} | {low_at} | {:.0}% |",
            share * 100.0
        );
        out.push(json!({
            "path": name, "peak_calls_per_s": peak, "peak_concurrency": peak_at,
            "lowest_above_calls_per_s": low, "lowest_above_concurrency": low_at, "lowest_to_peak": share,
        }));
    }
    Value::Array(out)
}

/// Part 2: the log read whole, --log-reads times per path.
async fn streaming_part(paths: &[(&str, streaming::Path)], args: &Args) -> Result<Value, String> {
    let bytes = args.log_mib << 20;
    println!(
        "\n## Streaming: a {} MiB pod log in 64 KiB messages (median of {} reads)\n",
        args.log_mib, args.log_reads
    );
    println!("| path | MB/s | fastest read ms | slowest read ms | MB/s / direct |");
    println!("|---|---|---|---|---|");
    let mut rows = Vec::new();
    let mut direct = None;
    for (name, path) in paths {
        let reads = path
            .measure(bytes, args.log_reads.max(1))
            .await
            .map_err(|e| format!("streaming through {name}: {e}"))?;
        let rate = reads.median_mb_per_s(bytes);
        let ratio = rate / *direct.get_or_insert(rate);
        let (fastest, slowest) = (reads.0[0], reads.0[reads.0.len() - 1]);
        println!(
            "| {name} | {rate:.0} | {:.1} | {:.1} | {:.0}% |",
            ms(fastest),
            ms(slowest),
            ratio * 100.0
        );
        rows.push(json!({
            "path": name, "bytes": bytes, "reads": reads.0.len(), "mb_per_s": rate,
            "fastest_ms": ms(fastest), "slowest_ms": ms(slowest), "ratio_to_direct": ratio,
        }));
    }
    Ok(Value::Array(rows))
}

/// Part 3 with pub-sub and polling only, each on a fresh pair of kas, wake-up samples
/// using agents `first..`.
async fn waiting_section(
    world: &mut World,
    pubsub: KasOptions,
    first_wakeup: i64,
    poll_samples: usize,
    args: &Args,
    results: &mut Value,
) -> Result<(), String> {
    let (woken, waiting_pubsub) =
        waiting_parts(world, pubsub, first_wakeup, args.wakeups, args).await?;
    let polling = KasOptions {
        pubsub: false,
        ..pubsub
    };
    let first_polled = first_wakeup + args.wakeups as i64;
    let (polled, waiting_poll) =
        waiting_parts(world, polling, first_polled, poll_samples, args).await?;
    println!(
        "\n## Wake-up: a call waits on kas B, its agent connects to kas A (registration to delivery)\n"
    );
    println!("| mode | samples | p50 ms | p99 ms | failed |");
    println!("|---|---|---|---|---|");
    let mut wake_json = Vec::new();
    for (mode, w) in [("pub-sub", &woken), ("polling only", &polled)] {
        println!(
            "| {mode} | {} | {:.2} | {:.2} | {} |",
            w.latencies.len(),
            ms(w.latencies.quantile(0.5)),
            ms(w.latencies.quantile(0.99)),
            w.failed
        );
        wake_json.push(json!({
            "mode": mode, "samples": w.latencies.len(), "failed": w.failed,
            "p50_ms": ms(w.latencies.quantile(0.5)), "p99_ms": ms(w.latencies.quantile(0.99)),
        }));
    }
    let window = args.waiting_window.as_secs_f64();
    println!(
        "\n## Redis commands of {} calls waiting {window:.0} s for absent agents\n",
        args.waiting
    );
    println!("| mode | commands sent | per waiting call per second | by command |");
    println!("|---|---|---|---|");
    let mut waiting_json = Vec::new();
    for (mode, c) in [
        ("pub-sub", &waiting_pubsub),
        ("polling only", &waiting_poll),
    ] {
        let sent = c.sent(&scale::IN_SCRIPTS);
        let per = sent as f64 / args.waiting as f64 / window;
        println!("| {mode} | {sent} | {per:.4} | {:?} |", c.calls);
        waiting_json.push(
            json!({"mode": mode, "commands_sent": sent, "per_call_per_s": per, "by_command": c.calls}),
        );
    }
    results["wakeup"] = Value::Array(wake_json);
    results["waiting_calls"] = Value::Array(waiting_json);
    Ok(())
}

/// The kas's resident memory with no agents, with `agents` connected (`GetConfiguration`
/// open), then with one idle tunnel each.
struct Idle {
    rss: [u64; 3],
    /// The loopback addresses the agents connected from.
    sources: usize,
    /// From the first dial until kas counted every agent connected, then until it held a
    /// tunnel of each (every agent routable).
    connected: Duration,
    routable: Duration,
}

impl Idle {
    /// Measures it, and returns the fleet still connected.
    async fn measure(
        kas: &KasProcess,
        agents: i64,
        per_source: i64,
        tls_ca: Option<&Path>,
    ) -> Result<(Idle, Fleet), String> {
        let rss0 = kas.resident_bytes().unwrap_or(0);
        let sources = scale::sources(agents, per_source);
        let start = Instant::now();
        let mut fleet = Fleet::connect(kas, agents, &sources, tls_ca).await?;
        let n = agents as f64;
        await_gauge(kas, "kas_connected_agents", n, Duration::from_secs(60)).await?;
        let connected = start.elapsed();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let rss1 = kas.resident_bytes().unwrap_or(0);
        let start = Instant::now();
        fleet.open_tunnels(setup::modules(|| {}).into());
        await_gauge(kas, "kas_tunnels", n, Duration::from_secs(60)).await?;
        let routable = connected + start.elapsed();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let rss2 = kas.resident_bytes().unwrap_or(0);
        Ok((
            Idle {
                rss: [rss0, rss1, rss2],
                sources: sources.len(),
                connected,
                routable,
            },
            fleet,
        ))
    }

    /// KiB per agent, then per tunnel.
    fn per_agent(&self, agents: i64) -> (f64, f64) {
        let each = |bytes: u64| bytes as f64 / agents as f64 / 1024.0;
        let [r0, r1, r2] = self.rss;
        (each(r1.saturating_sub(r0)), each(r2.saturating_sub(r1)))
    }

    fn json(&self, agents: i64) -> Value {
        let [none, with_agents, tunnels] = self.rss;
        let (kib_agent, kib_tunnel) = self.per_agent(agents);
        json!({
            "agents": agents,
            "rss_bytes": {"none": none, "agents": with_agents, "tunnels": tunnels},
            "kib_per_agent": kib_agent,
            "kib_per_tunnel": kib_tunnel,
            "source_addresses": self.sources,
            "connected_s": self.connected.as_secs_f64(),
            "routable_s": self.routable.as_secs_f64(),
        })
    }
}

/// Refresh periods over which the steady state's Redis commands are counted: whole cycles
/// of key renewals (a refresh renews an agent's key every third period, and a project's,
/// rewritten every third period, every ninth; see `kas_core::tracker::KeyExpiry` and
/// `LISTING_REFRESHES`).
const COUNTED_REFRESHES: u32 = 9;

/// `--redis-cluster`: 0, or 3 masters or more.
fn cluster_masters(v: &str) -> Result<usize, String> {
    match v
        .parse::<usize>()
        .map_err(|e| format!("not a count: {e}"))?
    {
        1 | 2 => Err("a Redis Cluster needs 3 masters or more (0: one redis-server)".into()),
        n => Ok(n),
    }
}

/// Part 4: idle cost (and with --tls, over TLS too) and Redis cost at `agents` agents.
async fn scale_section(
    world: &mut World,
    pubsub: KasOptions,
    agents: i64,
    args: &Args,
    results: &mut Value,
) -> Result<(), String> {
    if args.redis_cluster > 0 {
        world.cluster = Some(setup::RedisCluster::start(args.redis_cluster, &world.dir)?);
    }
    let kas = world.kas(pubsub).await?;
    let (idle, fleet) = Idle::measure(&kas, agents, args.agents_per_source, None).await?;
    // Steady state: the first writes are done, and so is the one GC of each new key (at
    // the first GC period, every ttl, that starts once its records could have expired: a
    // ttl after an agent's key was written, two after a project's); count
    // COUNTED_REFRESHES refresh periods.
    tokio::time::sleep(args.ttl * 3).await;
    let refresh = args.ttl / 2;
    let window = refresh * COUNTED_REFRESHES;
    let before = Commands::read(&world.redis_nodes());
    tokio::time::sleep(window).await;
    let steady = Commands::read(&world.redis_nodes()).since(&before);
    drop(fleet);
    drop(kas);
    let tls = if args.tls {
        let kas = world
            .kas(KasOptions {
                tls: true,
                ..pubsub
            })
            .await?;
        let ca = world.ca.clone();
        Some(
            Idle::measure(&kas, agents, args.agents_per_source, Some(&ca))
                .await?
                .0,
        )
    } else {
        None
    };
    world.cluster = None;
    let minutes = window.as_secs_f64() / 60.0;
    let mib = |b: u64| b as f64 / 1048576.0;
    println!(
        "\n## One kas with {agents} agents (each on its own connection, from {} loopback address{})\n",
        idle.sources,
        if idle.sources == 1 { "" } else { "es" }
    );
    println!("| | kas RSS MiB | KiB each | over TLS: RSS MiB | KiB each |");
    println!("|---|---|---|---|---|");
    let (agent_kib, tunnel_kib) = idle.per_agent(agents);
    let tls_cols = |i: usize| match &tls {
        Some(t) => {
            let (a, tu) = t.per_agent(agents);
            let each = [String::new(), format!("{a:.2}"), format!("{tu:.2}")];
            format!("{:.1} | {}", mib(t.rss[i]), each[i])
        }
        None => "| ".into(),
    };
    println!(
        "| no agents | {:.1} | | {} |",
        mib(idle.rss[0]),
        tls_cols(0)
    );
    println!(
        "| + {agents} agents (GetConfiguration open) | {:.1} | {agent_kib:.2} per agent | {} |",
        mib(idle.rss[1]),
        tls_cols(1)
    );
    println!(
        "| + one idle tunnel each | {:.1} | {tunnel_kib:.2} per tunnel | {} |",
        mib(idle.rss[2]),
        tls_cols(2)
    );
    let secs = |i: &Idle| {
        let (c, r) = (i.connected.as_secs_f64(), i.routable.as_secs_f64());
        format!("{c:.2} s connected, {r:.2} s routable")
    };
    println!(
        "\nFrom the first dial until kas counted every agent, and until it held a tunnel of each: {}{}",
        secs(&idle),
        tls.as_ref()
            .map(|t| format!("; over TLS: {}", secs(t)))
            .unwrap_or_default()
    );
    let sent_per_agent_min = steady.sent(&scale::IN_SCRIPTS) as f64 / agents as f64 / minutes;
    let all_per_agent_min = steady.all() as f64 / agents as f64 / minutes;
    let on = match args.redis_cluster {
        0 => "one redis-server".to_string(),
        n => format!("a Redis Cluster of {n} masters"),
    };
    println!(
        "\n## Redis at steady state ({on}), {agents} agents, refresh every {refresh:?}, over {window:?}\n"
    );
    println!("| commands | total | per agent per minute | per agent per refresh | by command |");
    println!("|---|---|---|---|---|");
    let per_refresh = |n: u64| n as f64 / agents as f64 / f64::from(COUNTED_REFRESHES);
    println!(
        "| sent by kas | {} | {sent_per_agent_min:.4} | {:.4} | |",
        steady.sent(&scale::IN_SCRIPTS),
        per_refresh(steady.sent(&scale::IN_SCRIPTS))
    );
    println!(
        "| run by Redis (inside scripts too) | {} | {all_per_agent_min:.3} | {:.3} | {:?} |",
        steady.all(),
        per_refresh(steady.all()),
        steady.calls
    );
    let usec = steady.sent_usec(&scale::IN_SCRIPTS);
    println!(
        "| Redis CPU µs for them (`usec` of what kas sent; scripts' include their commands) | {usec} | {:.3} | {:.3} | {:?} |",
        usec as f64 / agents as f64 / minutes,
        per_refresh(usec),
        steady.usec
    );

    results["idle"] = idle.json(agents);
    if let Some(t) = &tls {
        results["idle_tls"] = t.json(agents);
    }
    results["redis_steady"] = json!({
        "agents": agents, "redis": on, "refresh_s": refresh.as_secs_f64(), "window_s": window.as_secs_f64(),
        "sent": steady.sent(&scale::IN_SCRIPTS), "all": steady.all(), "by_command": steady.calls,
        "sent_per_agent_per_minute": sent_per_agent_min,
        "all_per_agent_per_minute": all_per_agent_min,
        "sent_per_agent_per_refresh": per_refresh(steady.sent(&scale::IN_SCRIPTS)),
        "all_per_agent_per_refresh": per_refresh(steady.all()),
        "redis_usec": usec, "redis_usec_per_agent_per_refresh": per_refresh(usec),
        "usec_by_command": steady.usec,
    });
    Ok(())
}
