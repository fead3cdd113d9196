//! Builds a simulated kas cluster: one Redis node, N kas nodes and agent replica nodes, all
//! running kas-server's and kas-agent's production code, plus GitLab caller nodes.
//!
//! Addresses: Redis `10.0.0.1:6379` (with Sentinel, its replica `10.0.0.4:6379` and the
//! sentinels `10.0.0.5:26379`; a Redis Cluster's masters at `10.0.0.11-13:6379`); kas `i` at `10.0.1.(i+1)` (agent 8150, api 8153,
//! private 8155, observability 8151, Kubernetes API 8154); agent replicas at `10.0.2.x`;
//! callers at `10.0.3.x`.

use crate::gitlab::{GitLab, MAX_AGENT, token};
use crate::redis::{NODES, RedisState, SENTINEL, SHARDS, shard_address};
use crate::redis_dial::{Path, SimDial};
use crate::truth::{Truth, pod_name};
use kas_agent::AgentOptions;
use kas_auth::jwt::Secret;
use kas_server::config::{Config, ConfigWriter};
use kas_server::kas::Kas;
use kas_server::kas::observability::Health;
use kas_server::store::{RedisStore, Store};
use madsim::rand::{Rng, thread_rng};
use madsim::runtime::{Handle, NodeHandle};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Where a kas node puts its [`Health`] when it starts.
pub type HealthSlot = Arc<std::sync::Mutex<Option<Health>>>;

/// Where a kas node says when its current run started and, once it stopped after a
/// SIGTERM (`send_ctrl_c`), whether it deleted its registry records ([`Kas::stop`]'s answer).
pub type StopSlot = Arc<std::sync::Mutex<KasRun>>;

/// See [`StopSlot`].
#[derive(Clone, Copy, Debug, Default)]
pub struct KasRun {
    /// kas's clock when this run started: the records it writes expire a TTL after.
    pub started: kas_core::Time,
    /// Set when it stopped gracefully.
    pub cleaned: Option<bool>,
}

/// Longest delay between an agent's reconnection attempts in the simulation.
pub const RECONNECT_MAX: Duration = Duration::from_secs(4);

/// One agent and the kas each of its replicas connects to.
#[derive(Clone, Debug)]
pub struct AgentSpec {
    /// The agent id (1..).
    pub agent: i64,
    /// For each replica, the index of its kas.
    pub replicas: Vec<usize>,
}

/// The cluster's shape.
#[derive(Clone, Debug)]
pub struct ClusterSpec {
    /// kas replicas.
    pub kas: usize,
    /// Agents.
    pub agents: Vec<AgentSpec>,
    /// Wake waiting calls by pub-sub (else poll only).
    pub pubsub_wakeups: bool,
    /// Registry record lifetime (refreshed every half).
    pub ttl: Duration,
    /// kas's `shutdown_grace`.
    pub grace: Duration,
    /// Agents hold connections to two kas at once, dialling any kas (as through a load
    /// balancer in front of them all); a replica's kas in `agents` is then only the first
    /// it is likely to reach. Without, each replica connects to its kas only.
    pub ha: bool,
    /// kas's `agent.listen.max_connection_age`, when shorter than a run: agents' links
    /// age out and move, make before break, while calls run.
    pub max_connection_age: Option<Duration>,
}

/// A running simulated cluster.
pub struct Cluster {
    /// The Redis node's data and fault knobs.
    pub redis: RedisState,
    /// GitLab's answers to token lookups, and their fault knobs.
    pub gitlab: GitLab,
    /// Which agent replica served which call.
    pub truth: Truth,
    /// Each kas's readiness and metrics, set when it has started (and again at restart).
    pub health: Vec<HealthSlot>,
    /// Registry record lifetime.
    pub ttl: Duration,
    /// kas's `shutdown_grace`.
    pub grace: Duration,
    /// See [`ClusterSpec::ha`].
    pub ha: bool,
    /// kas replicas.
    kas_count: usize,
    /// Each kas's report of its last graceful stop.
    pub stopped: Vec<StopSlot>,
    /// The Redis nodes ([`crate::redis::NODES`]): the master alone, or with Sentinel a
    /// replica too ([`Cluster::redis_master`] is the one serving now); or a Redis
    /// Cluster's shards' masters, in shard order.
    pub redis_nodes: Vec<NodeHandle>,
    /// How the kas reach Redis.
    pub redis_mode: RedisMode,
    /// The kas's `redis.timeout`.
    pub redis_timeout: Duration,
    /// The kas nodes, by index.
    pub kas_nodes: Vec<NodeHandle>,
    /// Agent replica nodes: (agent, replica index, node).
    pub agent_nodes: Vec<(i64, usize, NodeHandle)>,
    gitlab_secret: Secret,
    next_caller: AtomicU64,
    next_agent_ip: u8,
    /// Secrets read by kas at each (re)start; removed with the cluster.
    dir: PathBuf,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// kas `i`'s address on `port`.
pub fn kas_addr(i: usize, port: u16) -> SocketAddr {
    let last = u8::try_from(i + 1).expect("at most 254 kas");
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 1, last)), port)
}

/// Kas `i`'s id, as its records and the audit log name it: its private address.
pub fn kas_id(i: usize) -> String {
    kas_addr(i, 8155).to_string()
}

/// Each kas's audit log rotates at this size (the least kas takes), into at most
/// [`AUDIT_FILES`] files: small, so that runs rotate it (a run's kas records 3-15
/// requests, about 600 bytes each), and many, so that no record is dropped (invariant 17
/// reads them all).
const AUDIT_ROTATE: u64 = 4 << 10;

/// See [`AUDIT_ROTATE`].
const AUDIT_FILES: usize = 64;

/// Kas `i`'s audit log in `dir`; its rotated files add `.1` (the newest) and on.
fn audit_path(dir: &std::path::Path, i: usize) -> PathBuf {
    dir.join(format!("audit-kas{i}.jsonl"))
}

/// An agent that is not agentk.
#[derive(Clone, Copy, Debug)]
pub enum Script {
    /// Misbehaves on every call ([`crate::rogue`]).
    Rogue,
    /// Takes every place the limits give it ([`crate::greedy`]).
    Greedy,
}

/// The index of the kas whose id (its private address, as kas advertises it) is `id`.
fn kas_index(id: &String) -> usize {
    let ip = id.parse::<SocketAddr>().map(|a| a.ip());
    match ip {
        Ok(IpAddr::V4(ip)) if ip.octets()[..3] == [10, 0, 1] => usize::from(ip.octets()[3] - 1),
        _ => panic!("kas id {id} is not a simulated kas's private address"),
    }
}

/// Writes the secrets the kas configs name; returns their directory, emptied first: one
/// left by a run that was killed, under a process id reused since, would hand this run
/// its audit records (a 5,000-seed sweep after a killed one failed `kas-crash-ha` seed
/// 232 with inv 17, "kas0's audit record is of a request not made to this kas").
fn write_files() -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "kas-sim-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    std::fs::write(dir.join("gitlab.secret"), "R2l0TGFi".repeat(8)).unwrap();
    std::fs::write(dir.join("kas.secret"), "S2FzS2Fz".repeat(8)).unwrap();
    std::fs::write(dir.join("user-tokens.yaml"), crate::callers::tokens_file()).unwrap();
    dir
}

/// The store a simulated kas runs on: the production Redis store, reaching the simulated
/// Redis node its configuration names over the simulated network.
fn sim_store(config: &Config, path: Path) -> Store {
    let r = config
        .redis
        .as_ref()
        .expect("a simulated kas has a redis section");
    let topology = kas_server::kas::redis_topology(r).expect("the redis section's topology");
    let dial = Arc::new(SimDial {
        timeout: r.timeout,
        path,
    });
    let store = RedisStore::over(&topology, dial.clone(), dial, r.timeout);
    Store::new(store.expect("the simulated Redis node's address"))
}

/// The `redis.timeout`s a run may have.
const REDIS_TIMEOUTS: [Duration; 2] = [Duration::from_secs(1), Duration::from_secs(3)];

/// The port of each kas's Kubernetes API listener.
pub const KUBERNETES_API_PORT: u16 = 8154;

/// How the kas reach Redis in a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RedisMode {
    /// One server.
    Server,
    /// The master Sentinel names, with a replica it may promote.
    Sentinel,
    /// A Redis Cluster of [`SHARDS`] masters.
    Cluster,
}

/// How long a kas keeps a subscription nobody waits on (`redis.subscription_linger`;
/// 60 s in production): short, so that runs unsubscribe and subscribe again, and the leak
/// check, which waits for the last subscription to go, need not wait a minute.
pub const LINGER: Duration = Duration::from_secs(6);

/// A simulated kas's configuration: production defaults but for the short record TTL that
/// lets a run see records expire and the short [`LINGER`]; Redis as `mode` says.
fn kas_config(
    i: usize,
    dir: &std::path::Path,
    spec: &ClusterSpec,
    mode: RedisMode,
    redis_timeout: Duration,
) -> Config {
    let listen = [8150, 8153, 8155, 8151].map(|port| kas_addr(i, port));
    let text = ConfigWriter::kas_in(dir, listen)
        // Agent tokens resolved through GitLab (the simulation's, see `gitlab`), cached for
        // 2 s, failures for 1 s, and each connection's token checked again every second.
        .unset("agent.tokens_file")
        .set("gitlab.address", "http://gitlab.sim")
        .path(
            "gitlab.authentication_secret_file",
            &dir.join("gitlab.secret"),
        )
        .set("agent.info_cache_ttl", "2s")
        .set("agent.info_cache_error_ttl", "1s")
        .set("agent.configuration.poll_period", "1s")
        .duration("agent.redis_conn_info_ttl", spec.ttl)
        .duration("agent.redis_conn_info_refresh", spec.ttl / 2)
        .duration("agent.redis_conn_info_gc", spec.ttl)
        // Shorter than the records, as in production (30 s against 300 s): the instance
        // record is rewritten on its own, and a kas's records outlive its liveness.
        .duration("agent.kas_liveness_ttl", spec.ttl / 2)
        // Low enough for the greedy agent to reach them often; above what the others use.
        .set(
            "agent.max_connections_per_agent",
            crate::greedy::CONNECTIONS,
        )
        .set("agent.max_tunnels_per_connection", crate::greedy::TUNNELS)
        .set("agent.heartbeat_timeout", "3s")
        .set(
            "agent.kubernetes_api.listen.address",
            kas_addr(i, KUBERNETES_API_PORT).to_string(),
        )
        .path(
            "agent.kubernetes_api.tokens_file",
            &dir.join("user-tokens.yaml"),
        )
        .path("agent.kubernetes_api.audit.path", &audit_path(dir, i))
        .set("agent.kubernetes_api.audit.max_size", AUDIT_ROTATE)
        .set("agent.kubernetes_api.audit.max_files", AUDIT_FILES)
        .set("redis.key_prefix", "kas")
        .duration("redis.timeout", redis_timeout)
        .set("redis.pubsub_wakeups", spec.pubsub_wakeups)
        .duration("redis.subscription_linger", LINGER)
        .duration("shutdown_grace", spec.grace);
    let text = match spec.max_connection_age {
        Some(age) => text.duration("agent.listen.max_connection_age", age),
        None => text,
    };
    let text = match mode {
        RedisMode::Sentinel => text
            .set("redis.sentinel.master_name", crate::redis::MASTER_NAME)
            .set("redis.sentinel.addresses", vec![SENTINEL.to_string()]),
        RedisMode::Server => text.set("redis.server.address", NODES[0].to_string()),
        RedisMode::Cluster => text.set(
            "redis.cluster.addresses",
            (0..SHARDS)
                .map(|s| shard_address(s).to_string())
                .collect::<Vec<_>>(),
        ),
    }
    .text();
    Config::parse(&text, &format!("kas{i}.yaml")).unwrap_or_else(|e| panic!("{e}"))
}

impl Cluster {
    /// Kas `kas`'s audit records, oldest first, its rotated files' included.
    pub fn audit_lines(&self, kas: usize) -> Vec<String> {
        let path = audit_path(&self.dir, kas);
        let numbered = |n: usize| PathBuf::from(format!("{}.{n}", path.display()));
        assert!(
            !numbered(AUDIT_FILES).exists(),
            "kas{kas}'s audit log filled its {AUDIT_FILES} files: raise AUDIT_FILES"
        );
        (1..AUDIT_FILES)
            .rev()
            .map(numbered)
            .chain([path.clone()])
            .filter_map(|p| std::fs::read_to_string(p).ok())
            .flat_map(|text| text.lines().map(str::to_owned).collect::<Vec<_>>())
            .collect()
    }

    /// Kas `kas`'s metrics now (OpenMetrics text); empty while it has not started.
    pub fn metrics(&self, kas: usize) -> String {
        self.health[kas]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|h| h.metrics_text())
            .unwrap_or_default()
    }

    /// The Redis node that is the master now (on a cluster, a random shard's).
    pub fn redis_master(&self) -> &NodeHandle {
        match self.redis_mode {
            RedisMode::Cluster => {
                let shard = thread_rng().gen_range(0..SHARDS);
                &self.redis_nodes[self.redis.shard_node(shard)]
            }
            _ => &self.redis_nodes[self.redis.master()],
        }
    }

    /// Creates every node; they start at once.
    pub fn build(spec: &ClusterSpec) -> Cluster {
        let handle = Handle::current();
        let dir = write_files();
        let redis = RedisState::default();
        let gitlab = GitLab::default();
        let truth = Truth::default();
        let health: Vec<HealthSlot> = (0..spec.kas).map(|_| HealthSlot::default()).collect();
        let stopped: Vec<StopSlot> = (0..spec.kas).map(|_| StopSlot::default()).collect();
        // A third of the runs find the master through Sentinel, with a replica it may
        // promote; a third run on a Redis Cluster.
        let redis_mode = [RedisMode::Server, RedisMode::Sentinel, RedisMode::Cluster]
            [thread_rng().gen_range(0..3)];
        let redis_nodes = match redis_mode {
            RedisMode::Cluster => redis.shard_nodes(),
            _ => (0..if redis_mode == RedisMode::Sentinel {
                2
            } else {
                1
            })
                .map(|i| {
                    let state = redis.clone();
                    handle
                        .create_node()
                        .name(format!("redis{i}"))
                        .ip(NODES[i].ip())
                        .init(move || state.clone().serve(i))
                        .build()
                })
                .collect(),
        };
        if redis_mode == RedisMode::Sentinel {
            let state = redis.clone();
            handle
                .create_node()
                .name("sentinel")
                .ip(SENTINEL.ip())
                .init(move || state.clone().serve_sentinel())
                .build();
        }
        // Half the runs wait 3 s for Redis's answers (production waits 5): a command held
        // by a clog then lands after what it wrote was due, and a read can outlast several
        // keepalives; the others 1 s.
        let redis_timeout = REDIS_TIMEOUTS[thread_rng().gen_range(0..REDIS_TIMEOUTS.len())];
        tracing::info!(?redis_mode, ?redis_timeout, "this run's Redis");
        let kas_nodes = (0..spec.kas)
            .map(|i| {
                let config = kas_config(i, &dir, spec, redis_mode, redis_timeout);
                let (slot, stop_slot) = (health[i].clone(), stopped[i].clone());
                let gitlab = gitlab.clone();
                let path = Path {
                    client: kas_addr(i, 0).ip(),
                    knobs: redis.knobs.clone(),
                };
                handle
                    .create_node()
                    .name(format!("kas{i}"))
                    .ip(kas_addr(i, 0).ip())
                    .init(move || {
                        let (config, slot) = (config.clone(), slot.clone());
                        let store = sim_store(&config, path.clone());
                        let stop_slot = stop_slot.clone();
                        let agent_info = gitlab.agent_info();
                        async move {
                            let report = |cleaned| {
                                stop_slot.lock().unwrap_or_else(|p| p.into_inner()).cleaned =
                                    Some(cleaned)
                            };
                            *stop_slot.lock().unwrap_or_else(|p| p.into_inner()) = KasRun {
                                started: kas_transport::clock::now(),
                                cleaned: None,
                            };
                            // Watched from the start, so that a SIGTERM never kills the node.
                            let sigterm = madsim::signal::ctrl_c();
                            tokio::pin!(sigterm);
                            let kas = tokio::select! {
                                kas = Kas::start_with_gitlab(config, store, agent_info) => kas.expect("kas starts"),
                                _ = &mut sigterm => return report(false),
                            };
                            *slot.lock().unwrap_or_else(|p| p.into_inner()) =
                                Some(kas.health().clone());
                            let _ = sigterm.await;
                            report(kas.stop().await);
                        }
                    })
                    .build()
            })
            .collect();
        Cluster {
            redis,
            gitlab,
            truth,
            health,
            ttl: spec.ttl,
            grace: spec.grace,
            ha: spec.ha,
            kas_count: spec.kas,
            stopped,
            redis_nodes,
            redis_mode,
            redis_timeout,
            kas_nodes,
            agent_nodes: Vec::new(),
            gitlab_secret: Secret::load(&dir.join("gitlab.secret")).expect("secret"),
            next_caller: AtomicU64::new(0),
            next_agent_ip: 0,
            dir,
        }
        .with_agents(&spec.agents)
    }

    fn with_agents(mut self, agents: &[AgentSpec]) -> Cluster {
        for a in agents {
            for (replica, &kas) in a.replicas.iter().enumerate() {
                self.add_agent(a.agent, replica, kas, Duration::ZERO);
            }
        }
        self
    }

    /// Creates the node of replica `replica` of `agent`, connecting to kas `kas` (to any
    /// two, when the cluster is [`ClusterSpec::ha`]) after `delay` (at once after a
    /// restart of the node).
    pub fn add_agent(&mut self, agent: i64, replica: usize, kas: usize, delay: Duration) {
        assert!(
            (1..=MAX_AGENT).contains(&agent),
            "agent ids are 1..={MAX_AGENT}"
        );
        self.next_agent_ip += 1;
        let ip = self.next_agent_ip;
        let pod = pod_name(agent, replica);
        let truth = self.truth.clone();
        let (ha, kas_count) = (self.ha, self.kas_count);
        // Half the replicas keep two tunnels only: a call then waits for one or takes
        // another replica's, and a pinned call must not. (Not one: kas keeps an agent's
        // only tunnel for GitLab's calls, and the probes make Kubernetes API calls too.)
        // The greedy caller's agent keeps fewer than kas allows: kas must share out what
        // its pool may open, not kas's limit.
        let few_tunnels = agent != crate::callers::CROWDED && thread_rng().gen_bool(0.5);
        // The delay applies to the first start only.
        let delay = Arc::new(AtomicU64::new(
            u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
        ));
        let node = Handle::current()
            .create_node()
            .name(pod.clone())
            .ip(IpAddr::V4(Ipv4Addr::new(10, 0, 2, ip)))
            .init(move || {
                let meta = kas_agent::meta::own("default", &pod);
                let mut options =
                    AgentOptions::new(kas_addr(kas, 8150).to_string(), token(agent), meta);
                options.kas_connections = if ha { 2 } else { 1 };
                if ha {
                    options.kas = (0..kas_count)
                        .map(|k| kas_addr(k, 8150).to_string())
                        .collect();
                }
                options.seed = u64::from(ip);
                options.heartbeat = Duration::from_millis(500);
                if few_tunnels {
                    options.pool.min_idle = 1;
                    options.pool.max = 2;
                } else if agent == crate::callers::CROWDED {
                    options.pool.max = crate::callers::CROWDED_POOL;
                }
                // Reconnect delays capped at 4 s (the default cap is 60 s), so that the
                // healed phase may expect every agent back within its settle time.
                options.reconnect.max = RECONNECT_MAX;
                let mut modules = truth.module(agent, replica, &pod);
                crate::api_server::register(&mut modules, truth.clone(), agent, replica, &pod);
                let modules = Arc::new(modules);
                let (stop, shutdown) = tokio::sync::watch::channel(false);
                let delay = Duration::from_millis(delay.swap(0, Ordering::Relaxed));
                let truth = truth.clone();
                async move {
                    // A restarted node starts with no connection; its old ones died with it.
                    truth.homed(agent, replica, Vec::new());
                    let (serving, mut homes) = tokio::sync::watch::channel(Vec::new());
                    let (silent, mut silences) = tokio::sync::mpsc::unbounded_channel();
                    let silent_truth = truth.clone();
                    tokio::spawn(async move {
                        while let Some(kas) = silences.recv().await {
                            silent_truth.silent(agent, replica, kas_index(&kas));
                        }
                    });
                    tokio::spawn(async move {
                        while homes.changed().await.is_ok() {
                            let kas = homes.borrow_and_update().iter().map(kas_index).collect();
                            truth.homed(agent, replica, kas);
                        }
                    });
                    tokio::time::sleep(delay).await;
                    let reports = kas_agent::Reports { serving, silent };
                    kas_agent::run_reporting(options, modules, shutdown, reports).await;
                    drop(stop);
                }
            })
            .build();
        self.agent_nodes.push((agent, replica, node));
    }

    /// Creates the node of agent `agent` (one replica) on kas `kas`, speaking the agent
    /// API by a script of its own rather than as agentk.
    pub fn add_scripted_agent(&mut self, script: Script, agent: i64, kas: usize) {
        self.next_agent_ip += 1;
        let ip = self.next_agent_ip;
        let truth = self.truth.clone();
        let (kas, token) = (kas_addr(kas, 8150), token(agent));
        let node = Handle::current()
            .create_node()
            .name(format!("{script:?}{agent}").to_lowercase())
            .ip(IpAddr::V4(Ipv4Addr::new(10, 0, 2, ip)))
            .init(move || {
                let (token, truth) = (token.clone(), truth.clone());
                async move {
                    match script {
                        Script::Rogue => crate::rogue::run(kas, token, agent, truth).await,
                        Script::Greedy => crate::greedy::run(kas, token, agent, truth).await,
                    }
                }
            })
            .build();
        self.agent_nodes.push((agent, 0, node));
    }

    /// A new GitLab caller node.
    pub fn caller(&self) -> NodeHandle {
        let n = self.next_caller.fetch_add(1, Ordering::Relaxed) + 1;
        let last = u8::try_from(n).expect("at most 254 callers");
        Handle::current()
            .create_node()
            .name(format!("gitlab{n}"))
            .ip(IpAddr::V4(Ipv4Addr::new(10, 0, 3, last)))
            .build()
    }

    /// GitLab's secret.
    pub fn gitlab_secret(&self) -> Secret {
        self.gitlab_secret.clone()
    }
}
