//! The bench's world on loopback: a private redis-server (or Redis Cluster), kas processes
//! sharing it, agent tokens, and GitLab's secret.

use kas_agent::pods::{LogStream, chunks};
use kas_agent::{Modules, PODS_LIST, PODS_LOGS};
use kas_auth::jwt::Secret;
use kas_proto::pods::{ListRequest, ListResponse, LogsRequest, Pod};
use kas_server::config::ConfigWriter;
use kas_tools::local::kas_process::KasProcess;
use kas_tools::local::redis_server::RedisServer;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// How a pair of kas is configured.
#[derive(Clone, Copy, Debug)]
pub struct KasOptions {
    /// Wake waiting calls by pub-sub (else they poll).
    pub pubsub: bool,
    /// Registry record lifetime; refreshed every half of it.
    pub ttl: Duration,
    /// TLS on the agent, api and private listeners (the world's throwaway certificate).
    pub tls: bool,
    /// A Kubernetes API listener (plaintext), taking [`USER_TOKEN`] for agent 1.
    pub kubernetes_api: bool,
    /// `shutdown_grace`.
    pub grace: Duration,
    /// The (agent, api, private, observability) addresses to listen on (free ports
    /// when `None`): a kas started again where it was.
    pub listen: Option<[SocketAddr; 4]>,
    /// An OTLP/HTTP receiver to export traces to (`observability.tracing`); off when
    /// `None`.
    pub tracing: Option<SocketAddr>,
    /// Run kas under valgrind's callgrind, its counts in [`World::callgrind_file`].
    pub callgrind: bool,
}

/// The Kubernetes API token of the bench's user, for agent 1 (`pat:1:<it>`).
pub const USER_TOKEN: &str = "bench-user-token-0001";

/// Files, Redis and secrets shared by every kas the bench starts.
pub struct World {
    pub dir: PathBuf,
    /// The throwaway CA that issued the certificate of TLS kas (`World::tls_lines`).
    pub ca: PathBuf,
    pub redis: RedisServer,
    /// A Redis Cluster the kas started meanwhile use instead of `redis`.
    pub cluster: Option<RedisCluster>,
    pub gitlab: Secret,
    kas_exe: PathBuf,
    started: usize,
}

/// The token of `agent` (every agent 1..=max has one).
pub fn token(agent: i64) -> String {
    format!("bench-agent-token-{agent:08}")
}

fn write(dir: &Path, name: &str, text: &str) -> Result<PathBuf, String> {
    let path = dir.join(name);
    std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(path)
}

impl World {
    /// Starts Redis and writes secrets and tokens for agents `1..=max_agent` into a new
    /// directory under the system temp dir.
    pub fn start(max_agent: i64) -> Result<World, String> {
        let dir = std::env::temp_dir().join(format!("kas-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let secret =
            |bytes: [u8; 32]| Secret::from_base64(&base64(&bytes)).map_err(|e| e.to_string());
        let gitlab = secret(rand::random())?;
        write(&dir, "gitlab.secret", &gitlab.to_base64())?;
        write(&dir, "kas.secret", &secret(rand::random())?.to_base64())?;
        let mut tokens = String::from("agents:\n");
        for agent in 1..=max_agent {
            let _ = writeln!(
                tokens,
                "  - {{token: {}, agent_id: {agent}, project_id: {}}}",
                token(agent),
                100 + agent % 100
            );
        }
        write(&dir, "tokens.yaml", &tokens)?;
        write(
            &dir,
            "user-tokens.yaml",
            &format!(
                "tokens:\n  - {{token: {USER_TOKEN}, kind: pat, agent_ids: [1], username: bench}}\n"
            ),
        )?;
        let local_ca = kas_transport::local_ca::LocalCa::new("kas-bench throwaway CA")?;
        let (cert, key) = local_ca.issue()?;
        let ca = write(&dir, "ca.pem", &local_ca.pem)?;
        write(&dir, "kas.crt", &cert)?;
        write(&dir, "kas.key", &key)?;
        let kas_exe = std::env::current_exe()
            .map_err(|e| format!("where is kas-bench? {e}"))?
            .with_file_name("kas");
        if !kas_exe.exists() {
            return Err(format!(
                "{} is missing: build it with `cargo build --release --bin kas`",
                kas_exe.display()
            ));
        }
        Ok(World {
            redis: RedisServer::start()?,
            cluster: None,
            dir,
            ca,
            gitlab,
            kas_exe,
            started: 0,
        })
    }

    /// Where callgrind writes the counts of the kas of process `pid`; a dump on request
    /// ([`KasOptions::callgrind`]) gets `.1`, `.2`, ... appended.
    pub fn callgrind_file(&self, pid: &str) -> PathBuf {
        self.dir.join(format!("callgrind.{pid}"))
    }

    /// Starts one kas process.
    pub async fn kas(&mut self, options: KasOptions) -> Result<KasProcess, String> {
        self.started += 1;
        let name = format!("kas{}", self.started);
        let d = &self.dir;
        let listen = options
            .listen
            .unwrap_or_else(|| [SocketAddr::from(([127, 0, 0, 1], 0)); 4]);
        let mut config = ConfigWriter::kas_in(d, listen)
            .duration("agent.redis_conn_info_ttl", options.ttl)
            .duration("agent.redis_conn_info_refresh", options.ttl / 2)
            .duration("agent.redis_conn_info_gc", options.ttl)
            .set("api.max_timeout", "120s")
            .set("redis.key_prefix", "kas")
            .set("redis.pubsub_wakeups", options.pubsub)
            .duration("shutdown_grace", options.grace);
        config = match &self.cluster {
            Some(c) => {
                let nodes: Vec<String> = c.nodes.iter().map(RedisServer::address).collect();
                config.set("redis.cluster.addresses", nodes)
            }
            None => config.set("redis.server.address", self.redis.address()),
        };
        if options.tls {
            for listen in ["agent.listen", "api.listen", "private_api.listen"] {
                config = config
                    .path(&format!("{listen}.certificate_file"), &d.join("kas.crt"))
                    .path(&format!("{listen}.key_file"), &d.join("kas.key"));
            }
            config = config.path("private_api.listen.ca_certificate_file", &d.join("ca.pem"));
        }
        // Each open watch holds a tunnel of the agent: a stream on its connection, and
        // on the connection between the two kas.
        if options.kubernetes_api {
            config = config
                .set("agent.kubernetes_api.listen.address", "127.0.0.1:0")
                .path(
                    "agent.kubernetes_api.tokens_file",
                    &d.join("user-tokens.yaml"),
                )
                .set("agent.max_tunnels_per_connection", 10_000)
                // The bench is one caller holding --watches watches of one agent at once.
                .set("agent.kubernetes_api.max_requests_per_token", 100_000)
                .set(
                    "agent.kubernetes_api.max_requests_per_token_per_agent",
                    100_000,
                )
                .set("agent.listen.max_concurrent_streams", 10_000)
                .set("private_api.listen.max_concurrent_streams", 10_000);
        }
        if let Some(receiver) = options.tracing {
            config = config.set(
                "observability.tracing.otlp_endpoint",
                format!("http://{receiver}/v1/traces"),
            );
        }
        let path = write(&self.dir, &format!("{name}.yaml"), &config.text())?;
        let launcher: Vec<String> = match options.callgrind {
            true => vec![
                "valgrind".into(),
                "--tool=callgrind".into(),
                format!(
                    "--callgrind-out-file={}",
                    self.callgrind_file("%p").display()
                ),
            ],
            false => Vec::new(),
        };
        KasProcess::spawn_under(
            &launcher,
            &self.kas_exe,
            &path,
            // "kas started" (with the addresses) is logged at info.
            "warn,kas_server::kas=info",
            &self.dir.join(format!("{name}.log")),
        )
        .await
    }

    /// The Redis that kas started now use: the cluster's nodes, or the one server.
    pub fn redis_nodes(&self) -> Vec<&RedisServer> {
        match &self.cluster {
            Some(c) => c.nodes.iter().collect(),
            None => vec![&self.redis],
        }
    }
}

/// A Redis Cluster of masters only (no replicas), on loopback.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts `masters` cluster-enabled servers (their node files in `dir`), joins them
    /// with `redis-cli --cluster create` (which takes 3 or more), and waits until every
    /// node says the cluster is ok.
    pub fn start(masters: usize, dir: &Path) -> Result<RedisCluster, String> {
        let conf = dir.join("nodes-PORT.conf").display().to_string();
        let args = ["--cluster-enabled", "yes", "--cluster-config-file", &conf];
        let nodes = (0..masters)
            .map(|_| RedisServer::start_with(&args))
            .collect::<Result<Vec<_>, _>>()?;
        let addresses: Vec<String> = nodes.iter().map(RedisServer::address).collect();
        let created = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .map_err(|e| format!("cannot run redis-cli: {e}"))?;
        if !created.status.success() {
            return Err(format!(
                "redis-cli --cluster create failed: {}",
                String::from_utf8_lossy(&created.stdout)
            ));
        }
        let end = Instant::now() + Duration::from_secs(30);
        let ok = |n: &RedisServer| n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok");
        while !nodes.iter().all(ok) {
            if Instant::now() > end {
                return Err("the Redis Cluster was not ok on every node within 30 s".into());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(RedisCluster { nodes })
    }
}

impl Drop for World {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn base64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The pod list every bench agent answers (ten pods, about 600 bytes encoded).
pub fn pods() -> ListResponse {
    ListResponse {
        pods: (0..10)
            .map(|i| Pod {
                namespace: "bench".into(),
                name: format!("web-{i:02}-7d9f8c6b5d-x2x9q"),
                phase: "Running".into(),
                node_name: format!("node-{i}"),
            })
            .collect(),
    }
}

/// The log every bench pod has: 256 MiB of text lines, shared.
fn log() -> Arc<[u8]> {
    static LOG: OnceLock<Arc<[u8]>> = OnceLock::new();
    LOG.get_or_init(|| {
        let line = b"2026-11-21T09:42:59.123456Z INFO  request served path=/api/v1/items status=200 took=1.2ms\n";
        line.iter()
            .copied()
            .cycle()
            .take(256 << 20)
            .collect::<Vec<u8>>()
            .into()
    })
    .clone()
}

/// What `Logs` answers on every path: the first `limit_bytes` of the shared log, in 64 KiB
/// pieces (copied out of it, as an agent copies what it reads from the Kubernetes API).
pub fn logs(req: &LogsRequest) -> LogStream {
    chunks(log(), usize::try_from(req.limit_bytes).unwrap_or(0))
}

/// An agent's modules answering [`pods`] (calling `seen` on each call first) and [`logs`].
pub fn modules(seen: impl Fn() + Send + Sync + 'static) -> Modules {
    let mut m = Modules::default();
    m.unary(PODS_LIST, move |_: ListRequest| {
        seen();
        async { Ok(pods()) }
    });
    m.server_streaming(PODS_LOGS, |req: LogsRequest| async move { Ok(logs(&req)) });
    m
}
