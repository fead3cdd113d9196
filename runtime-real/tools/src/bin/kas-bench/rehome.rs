//! Part 7, re-homing: many agents, each on two of three kas through one balancer (agentk's
//! defaults), then one kas is SIGKILLed and stays down. How long until every replica is on
//! the two kas left, and the Redis commands per second meanwhile against the steady rate
//! before: the reconnect load a dying kas puts on the rest.
//!
//! The agents run in child processes (this binary with `--host-agents`), [`HOST_AGENTS`]
//! each behind its own balancer: an agent connection costs three open files on this side
//! (the agent's socket and the balancer's two), and one process may not hold 10,000
//! agents' worth under a 20,000 open-file limit.

use crate::rollout::{connections, secs};
use crate::scale::{Commands, gauge};
use crate::setup::{self, KasOptions, World};
use kas_agent::AgentOptions;
use kas_tools::local::balancer::Balancer;
use kas_tools::local::kas_process::KasProcess;
use kas_tools::local::redis_server::RedisServer;
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Agents per child process.
const HOST_AGENTS: i64 = 2_000;

/// How long the agents may take to connect, and to re-home.
const WITHIN: Duration = Duration::from_secs(600);

/// Redis's command counters are read this often.
const SAMPLE: Duration = Duration::from_millis(250);

/// Redis commands per second over a window: the mean, and the busiest [`SAMPLE`].
struct Rates {
    commands: u64,
    took: Duration,
    peak: f64,
}

impl Rates {
    fn mean(&self) -> f64 {
        self.commands as f64 / self.took.as_secs_f64().max(1e-9)
    }
}

/// Every command Redis ran so far, inside scripts too (`INFO commandstats`).
fn commands(redis: &RedisServer) -> u64 {
    tokio::task::block_in_place(|| Commands::read(&[redis]).all())
}

/// Redis's rate, read every [`SAMPLE`] from a start.
struct Sampler<'a> {
    redis: &'a RedisServer,
    began: Instant,
    first: u64,
    last: (Instant, u64),
    peak: f64,
}

impl<'a> Sampler<'a> {
    fn start(redis: &'a RedisServer) -> Self {
        let first = commands(redis);
        let began = Instant::now();
        Sampler {
            redis,
            began,
            first,
            last: (began, first),
            peak: 0.0,
        }
    }

    /// Waits a sample's time and reads the counters: the time since the start, or an
    /// error once [`WITHIN`] has passed.
    async fn tick(&mut self) -> Result<Duration, String> {
        tokio::time::sleep(SAMPLE).await;
        let now = commands(self.redis);
        let (at, last) = self.last;
        self.peak = self
            .peak
            .max((now - last) as f64 / at.elapsed().as_secs_f64());
        self.last = (Instant::now(), now);
        match self.began.elapsed() {
            t if t > WITHIN => Err(format!("not done after {WITHIN:?}")),
            t => Ok(t),
        }
    }

    fn rates(&self) -> Rates {
        Rates {
            commands: self.last.1 - self.first,
            took: self.last.0 - self.began,
            peak: self.peak,
        }
    }
}

/// Replica connections on `kas`.
async fn on(kas: &[KasProcess]) -> f64 {
    connections(&kas.iter().collect::<Vec<_>>()).await
}

/// Shares of the lost connections whose replacement the table times.
const SHARES: [f64; 4] = [0.5, 0.9, 0.99, 1.0];

/// Runs the part with `agents` agents (ids `first..`, one replica each); prints its table
/// and returns its JSON.
pub async fn part(
    world: &mut World,
    options: KasOptions,
    agents: i64,
    first: i64,
) -> Result<Value, String> {
    let want = 2.0 * agents as f64;
    let mut kas = Vec::new();
    for _ in 0..3 {
        kas.push(world.kas(options).await?);
    }
    let addresses: Vec<String> = kas.iter().map(|k| k.addresses.agent.to_string()).collect();
    let began = Instant::now();
    let _hosts = Hosts::spawn(first, agents, &addresses.join(","))?;
    let redis = &world.redis;
    let mut sampler = Sampler::start(redis);
    loop {
        sampler.tick().await?;
        if on(&kas).await == want {
            break;
        }
    }
    let connect = sampler.rates();
    let connected_in = began.elapsed();
    println!(
        "rehome: {agents} agents each on two kas after {}",
        secs(connected_in)
    );
    // Two refresh periods of the steady state.
    let mut sampler = Sampler::start(redis);
    while sampler.tick().await? < options.ttl {}
    let steady = sampler.rates();
    let lost = gauge(&kas[1], "kas_connected_agents").await.unwrap_or(0.0);
    let mut killed = kas.remove(1);
    killed.kill();
    // When each share of the lost connections had been replaced on the kas left.
    let mut replaced = Vec::new();
    let mut sampler = Sampler::start(redis);
    let homed_in = loop {
        let t = sampler.tick().await?;
        let missing = want - on(&kas).await;
        while replaced.len() < SHARES.len() && missing <= lost * (1.0 - SHARES[replaced.len()]) {
            replaced.push(t);
        }
        if missing <= 0.0 {
            break t;
        }
    };
    // A refresh period more: the dead kas's records expire meanwhile.
    while sampler.tick().await? < homed_in + options.ttl / 2 {}
    let rehoming = sampler.rates();
    Ok(report(
        agents,
        connected_in,
        &connect,
        &steady,
        lost,
        &replaced,
        &rehoming,
    ))
}

/// The child processes hosting the agents; killed when dropped.
struct Hosts(Vec<Child>);

impl Hosts {
    /// Agents `first..first + agents`, [`HOST_AGENTS`] per child, dialling kas at `kas`
    /// (comma-separated) through each child's balancer.
    fn spawn(first: i64, agents: i64, kas: &str) -> Result<Hosts, String> {
        let exe = std::env::current_exe().map_err(|e| format!("where is kas-bench? {e}"))?;
        let mut hosts = Hosts(Vec::new());
        for from in (first..first + agents).step_by(HOST_AGENTS as usize) {
            let count = HOST_AGENTS.min(first + agents - from);
            let child = Command::new(&exe)
                .args(["--host-agents", &from.to_string(), &count.to_string()])
                .args(["--host-kas", kas])
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .spawn()
                .map_err(|e| format!("{}: {e}", exe.display()))?;
            hosts.0.push(child);
        }
        Ok(hosts)
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A child process's work: runs agents `first..first + count` (agentk's defaults, one
/// replica each) through a balancer in front of `kas`, until its stdin closes (the bench
/// is done with it, or gone).
pub async fn host(first: i64, count: i64, kas: Vec<SocketAddr>) -> Result<(), String> {
    let balancer = Balancer::start(kas)
        .await
        .map_err(|e| format!("balancer: {e}"))?;
    let (stop, shutdown) = watch::channel(false);
    let tasks: Vec<_> = (first..first + count)
        .map(|agent| {
            let meta = kas_proto::registry::AgentMeta {
                version: "bench".into(),
                pod_name: format!("rehome-{agent}"),
                ..Default::default()
            };
            let mut o = AgentOptions::new(balancer.address.to_string(), setup::token(agent), meta);
            o.seed = rand::random();
            tokio::spawn(kas_agent::run(
                o,
                setup::modules(|| {}).into(),
                shutdown.clone(),
            ))
        })
        .collect();
    let _ = tokio::task::spawn_blocking(|| {
        use std::io::Read;
        std::io::stdin().read_to_end(&mut Vec::new())
    })
    .await;
    let _ = stop.send(true);
    for t in tasks {
        let _ = t.await;
    }
    Ok(())
}

fn report(
    agents: i64,
    connected_in: Duration,
    connect: &Rates,
    steady: &Rates,
    lost: f64,
    replaced: &[Duration],
    rehoming: &Rates,
) -> Value {
    println!("\n## Re-homing after a kas dies (agents on two of three kas, one killed)\n");
    println!(
        "{agents} agents, agentk's defaults (2 kas, 2 idle tunnels each), through balancers; the killed kas held {lost} of their connections. Redis commands are counted inside scripts too, sampled every {}.\n",
        secs(SAMPLE)
    );
    println!("| lost connections replaced | 50% | 90% | 99% | all |");
    println!("|---|---|---|---|---|");
    let cells: Vec<String> = replaced.iter().map(|d| secs(*d)).collect();
    println!("| after the kill | {} |", cells.join(" | "));
    println!(
        "\n| window | took | Redis commands | mean /s | peak /s (in {}) |",
        secs(SAMPLE)
    );
    println!("|---|---|---|---|---|");
    let rows = [
        ("every agent connecting at once", connect),
        ("steady, two refresh periods", steady),
        ("after the kill: re-homing, then a refresh period", rehoming),
    ];
    let mut json_rows = Vec::new();
    for (name, r) in rows {
        println!(
            "| {name} | {} | {} | {:.0} | {:.0} |",
            secs(r.took),
            r.commands,
            r.mean(),
            r.peak
        );
        json_rows.push(json!({
            "window": name,
            "took_ms": r.took.as_secs_f64() * 1e3,
            "commands": r.commands,
            "mean_per_s": r.mean(),
            "peak_per_s": r.peak,
        }));
    }
    println!(
        "\nEvery agent on two kas {} after they started. Re-homing against the steady state: mean rate {:.2}x, peak {:.2}x (the steady peaks are the registry GC's).",
        secs(connected_in),
        rehoming.mean() / steady.mean().max(1e-9),
        rehoming.peak / steady.peak.max(1e-9)
    );
    json!({
        "agents": agents,
        "lost_connections": lost,
        "connected_ms": connected_in.as_secs_f64() * 1e3,
        "replaced_ms": SHARES.iter().zip(replaced).map(|(share, d)| json!({"share": share, "ms": d.as_secs_f64() * 1e3})).collect::<Vec<_>>(),
        "windows": json_rows,
    })
}
