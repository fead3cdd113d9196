//! Test fixtures: a private redis-server, kas processes, agents and a GitLab-side client,
//! all on loopback.
#![allow(dead_code, missing_docs)] // each test binary uses a different part

use kas_agent::{AgentClient, Modules};
use kas_auth::jwt::{self, Secret, Signer};
use kas_client::api_client::ApiClient;
use kas_core::ConnectionId;
use kas_proto::pods::{ListRequest, ListResponse, LogsRequest, Pod};
use kas_proto::registry::AgentMeta;
use kas_server::config::ConfigWriter;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;
use tonic::transport::Channel;

pub use kas_tools::local::kas_process::KasProcess;
pub use kas_tools::local::redis_server::RedisServer as Redis;

/// A free TCP port on 127.0.0.1 (bound, then released).
/// The workspace binary `name` (`kas`, `agentk`), beside this test's directory: another
/// crate's binary, which `scripts/test` builds first (`cargo build --workspace --bins`).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/PROFILE/deps");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is not built: run `cargo build --workspace --bins` first",
        path.display()
    );
    path
}

pub fn free_port() -> u16 {
    kas_tools::local::redis_server::free_port().expect("a free loopback port")
}

/// Polls `f` every 50 ms until it returns `Some`, or panics after `within` naming `what`.
pub async fn eventually<T, F, Fut>(within: Duration, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let end = Instant::now() + within;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            Instant::now() < end,
            "timed out after {within:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Secrets and the agent tokens file, in a temporary directory.
pub struct Secrets {
    pub dir: tempfile::TempDir,
    pub gitlab: Secret,
    pub kas: Secret,
}

/// The token of agent `n` in the tokens file (agents 1..=9, project 100 + n % 2).
pub fn agent_token(n: i64) -> String {
    format!("test-agent-token-{n:04}-abcdefgh")
}

impl Secrets {
    pub fn new() -> Secrets {
        let dir = tempfile::tempdir().expect("temp dir");
        let gitlab = Secret::from_base64(&"R2l0TGFi".repeat(8)).expect("secret");
        let kas = Secret::from_base64(&"S2FzS2Fz".repeat(8)).expect("secret");
        std::fs::write(dir.path().join("gitlab.secret"), gitlab.to_base64()).unwrap();
        std::fs::write(dir.path().join("kas.secret"), kas.to_base64()).unwrap();
        let mut tokens = String::from("agents:\n");
        for n in 1..=9 {
            tokens += &format!(
                "  - token: {}\n    agent_id: {n}\n    project_id: {}\n",
                agent_token(n),
                100 + n % 2
            );
        }
        std::fs::write(dir.path().join("tokens.yaml"), tokens).unwrap();
        Secrets { dir, gitlab, kas }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// GitLab's signer (public API).
    pub fn gitlab_signer(&self) -> Signer {
        Signer::new(&self.gitlab, jwt::GITLAB, jwt::GITLAB_KAS)
    }

    /// The kas-only signer (private API).
    pub fn kas_signer(&self) -> Signer {
        Signer::new(&self.kas, jwt::GITLAB_KAS, jwt::GITLAB_KAS)
    }
}

/// `config` with `lines` (indented as in the file) set under the dotted `section`.
fn merge(config: ConfigWriter, section: &str, lines: &str) -> ConfigWriter {
    if lines.trim().is_empty() {
        return config;
    }
    let mut text = String::new();
    for (depth, name) in section.split('.').enumerate() {
        text += &format!("{}{name}:\n", "  ".repeat(depth));
    }
    text += lines;
    config
        .merge(&text)
        .unwrap_or_else(|e| panic!("the test's lines under {section}: {e}\n{text}"))
}

/// Extra configuration lines, each section's keys indented as in the file.
#[derive(Clone, Copy, Default)]
pub struct Extra<'a> {
    /// Under `agent:` (two spaces).
    pub agent: &'a str,
    /// Under `agent.listen:` (four spaces).
    pub agent_listen: &'a str,
    /// Under `api.listen:` (four spaces).
    pub api_listen: &'a str,
    /// Under `private_api.listen:` (four spaces).
    pub private_listen: &'a str,
    /// Under `observability.listen:` (four spaces).
    pub observability_listen: &'a str,
    /// Under `redis:` (two spaces), when there is one.
    pub redis: &'a str,
    /// A Redis of the test's own at this address, instead of `redis`.
    pub redis_at: Option<&'a str>,
    /// The `redis:` section's lines naming a Sentinel or Cluster setup (two spaces in),
    /// instead of `server:`.
    pub redis_topology: Option<&'a str>,
    /// Run kas with this open-file limit (soft and hard).
    pub open_files: Option<u64>,
}

/// A kas process.
pub struct KasProc {
    process: KasProcess,
    pub agent: SocketAddr,
    pub api: SocketAddr,
    pub private: SocketAddr,
    pub observability: SocketAddr,
    /// The Kubernetes API listener, when configured.
    pub kubernetes_api: Option<SocketAddr>,
    pub log: PathBuf,
}

impl KasProc {
    /// Starts kas on free ports with `redis` (or the in-memory store) and waits until it is
    /// live. `extra_redis` is appended to the `redis:` section.
    pub async fn start(
        secrets: &Secrets,
        name: &str,
        redis: Option<&Redis>,
        ttl_ms: u64,
        extra_redis: &str,
    ) -> KasProc {
        // Port 0 everywhere: kas binds what is free and logs the addresses, so no port is
        // ever picked by the test and then taken by someone else.
        Self::start_on(secrets, name, redis, ttl_ms, extra_redis, None).await
    }

    /// Starts kas again on the addresses this one had (after it stopped), with `redis`
    /// (or the in-memory store) and records living `ttl_ms`.
    pub async fn restart(
        &mut self,
        secrets: &Secrets,
        name: &str,
        redis: Option<&Redis>,
        ttl_ms: u64,
    ) {
        let at = [self.agent, self.api, self.private, self.observability];
        *self = Self::start_on(secrets, name, redis, ttl_ms, "", Some(at)).await;
    }

    /// Like `start`, with `listen` = (agent, api, private, observability) addresses.
    pub async fn start_on(
        secrets: &Secrets,
        name: &str,
        redis: Option<&Redis>,
        ttl_ms: u64,
        extra_redis: &str,
        listen: Option<[SocketAddr; 4]>,
    ) -> KasProc {
        let extra = Extra {
            redis: extra_redis,
            ..Extra::default()
        };
        Self::start_extra(secrets, name, redis, ttl_ms, extra, listen).await
    }

    /// Like `start_on`, with `extra` keys in the configuration's sections.
    pub async fn start_extra(
        secrets: &Secrets,
        name: &str,
        redis: Option<&Redis>,
        ttl_ms: u64,
        extra: Extra<'_>,
        listen: Option<[SocketAddr; 4]>,
    ) -> KasProc {
        let listen = listen.unwrap_or_else(|| ["127.0.0.1:0".parse().unwrap(); 4]);
        // Registry records live `ttl_ms`, refreshed every half of it.
        let (ttl, half) = (
            Duration::from_millis(ttl_ms),
            Duration::from_millis(ttl_ms / 2),
        );
        let mut config = ConfigWriter::kas_in(secrets.dir.path(), listen)
            .duration("agent.redis_conn_info_ttl", ttl)
            .duration("agent.redis_conn_info_refresh", half)
            .duration("agent.redis_conn_info_gc", half)
            .set("agent.heartbeat_timeout", "3s")
            .set("shutdown_grace", "2s");
        let redis_address = extra
            .redis_at
            .map(str::to_string)
            .or(redis.map(Redis::address));
        if extra.redis_topology.is_some() || redis_address.is_some() {
            config = config
                .set("redis.key_prefix", "kas")
                .set("redis.timeout", "1s");
        }
        config = match (extra.redis_topology, redis_address) {
            (Some(lines), _) => merge(config, "redis", lines),
            (None, Some(address)) => config.set("redis.server.address", address),
            (None, None) => config,
        };
        for (section, lines) in [
            ("agent", extra.agent),
            ("agent.listen", extra.agent_listen),
            ("api.listen", extra.api_listen),
            ("private_api.listen", extra.private_listen),
            ("observability.listen", extra.observability_listen),
            ("redis", extra.redis),
        ] {
            config = merge(config, section, lines);
        }
        let config = config.text();
        let path = secrets.path(&format!("{name}.yaml"));
        std::fs::write(&path, config).unwrap();
        let log = secrets.path(&format!("{name}.log"));
        let mut exe = bin("kas");
        if let Some(n) = extra.open_files {
            let script = secrets.path(&format!("{name}.sh"));
            let text = format!(
                "#!/bin/sh\nulimit -n {n}\nexec '{}' \"$@\"\n",
                exe.display()
            );
            std::fs::write(&script, text).unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
            exe = script;
        }
        let process = KasProcess::spawn(
            &exe,
            &path,
            "info,kas_server=debug,kas_auth=debug,kas_transport=debug",
            &log,
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        let a = process.addresses;
        KasProc {
            process,
            agent: a.agent,
            api: a.api,
            private: a.private_api,
            observability: a.observability,
            kubernetes_api: a.kubernetes_api,
            log,
        }
    }

    /// SIGKILL: no goodbye, nothing deleted.
    pub fn kill9(&mut self) {
        self.process.kill();
    }

    /// A kas (in-memory registry) with a plaintext Kubernetes API listener taking each of
    /// `tokens` for agents 1 and 2 (`pat:<agent>:<token>`); `listen` lines go under its
    /// `listen:` (six spaces in), `lines` under `agent.kubernetes_api:` (four; lines two
    /// in, after them, are `agent:` keys).
    pub async fn with_kubernetes_api(
        secrets: &Secrets,
        tokens: &[&str],
        listen: &str,
        lines: &str,
    ) -> KasProc {
        Self::with_kubernetes_api_on(secrets, "kas", None, tokens, listen, lines).await
    }

    /// Like `with_kubernetes_api`, named `name`, with `redis` (or the in-memory registry).
    pub async fn with_kubernetes_api_on(
        secrets: &Secrets,
        name: &str,
        redis: Option<&Redis>,
        tokens: &[&str],
        listen: &str,
        lines: &str,
    ) -> KasProc {
        let users = secrets.path("users.yaml");
        let mut text = "tokens:\n".to_string();
        for token in tokens {
            text += &format!(
                "  - {{token: {token}, kind: pat, agent_ids: [1, 2], username: u-{token}}}\n"
            );
        }
        std::fs::write(&users, text).unwrap();
        let agent_lines = format!(
            "  kubernetes_api:\n    listen:\n      address: 127.0.0.1:0\n{listen}    tokens_file: {}\n{lines}",
            users.display()
        );
        let extra = Extra {
            agent: &agent_lines,
            ..Extra::default()
        };
        KasProc::start_extra(secrets, name, redis, 10_000, extra, None).await
    }

    /// Freezes the process (SIGSTOP: a kas cut off, its connections open), or thaws it.
    pub fn freeze(&self, frozen: bool) {
        let pid = self.process.pid().expect("kas is running").to_string();
        let signal = if frozen { "-STOP" } else { "-CONT" };
        let status = std::process::Command::new("kill")
            .args([signal, &pid])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill {signal} {pid}");
        if frozen {
            // The signal is delivered after kill returns: wait (at most 5 s) until every
            // thread shows stopped, or a request sent at once may still be answered.
            let end = Instant::now() + Duration::from_secs(5);
            while !all_threads_stopped(&pid) {
                assert!(Instant::now() < end, "kas {pid} did not stop within 5 s");
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }

    /// Its resident memory, in bytes.
    pub fn rss(&self) -> u64 {
        self.process.resident_bytes().expect("kas is running")
    }

    /// Its open file descriptors.
    pub fn open_fds(&self) -> usize {
        let pid = self.process.pid().expect("kas is running");
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    /// SIGTERM, then waits for the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        self.process.terminate().expect("kas was running")
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn id(&self) -> String {
        self.private.to_string()
    }

    pub async fn metrics(&self) -> String {
        self.process.metrics().await.unwrap_or_default()
    }

    /// Waits (up to 10 s) until the metrics contain `needle`; returns them. Metrics are
    /// recorded after the answer reaches the caller, so a single read right after a call
    /// may not show it yet.
    pub async fn await_metric(&self, needle: &str) -> String {
        eventually(Duration::from_secs(10), needle, || async {
            let m = self.metrics().await;
            m.contains(needle).then_some(m)
        })
        .await
    }
}

/// A loopback channel to `addr`.
pub async fn channel(addr: SocketAddr) -> Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("connect")
}

/// GitLab's side: a public API client that signs every call.
pub struct GitLab {
    api: ApiClient,
}

impl GitLab {
    pub async fn new(secrets: &Secrets, api: SocketAddr) -> GitLab {
        GitLab {
            api: ApiClient::connect(&api.to_string(), &secrets.gitlab, Duration::from_secs(5))
                .await
                .expect("connect"),
        }
    }

    /// A client of kas's public API at `url` (`grpcs://` for TLS), trusting the CA
    /// certificates in `ca` (the system's roots without).
    pub async fn at(secrets: &Secrets, url: &str, ca: Option<&Path>) -> Result<GitLab, String> {
        let api =
            ApiClient::connect_with_ca(url, ca, &secrets.gitlab, Duration::from_secs(5)).await?;
        Ok(GitLab { api })
    }

    /// The pod names agent `agent` (its replica `connection`) lists.
    pub async fn pods(
        &self,
        agent: i64,
        connection: Option<ConnectionId>,
        timeout: Duration,
    ) -> Result<Vec<String>, tonic::Status> {
        let api = self.api.with_timeout(timeout);
        let pods = api.pods(agent, connection.map(|c| c.0), "").await?;
        Ok(pods.into_iter().map(|p| p.name).collect())
    }

    /// The log of `pod` that agent `agent` streams (at most `limit` bytes; 0: all), and the
    /// number of messages it came in.
    pub async fn logs(
        &self,
        agent: i64,
        pod: &str,
        limit: i64,
    ) -> Result<(Vec<u8>, usize), tonic::Status> {
        let mut stream = self
            .api
            .pod_logs(agent, None, "default", pod, "", limit)
            .await?;
        let (mut log, mut messages) = (Vec::new(), 0);
        while let Some(chunk) = stream.message().await? {
            log.extend_from_slice(&chunk.data);
            messages += 1;
        }
        Ok((log, messages))
    }

    /// The log stream of agent `agent`'s pod `pod` with deadline `timeout`, left to the
    /// caller to read, or not.
    pub async fn log_stream(
        &self,
        agent: i64,
        pod: &str,
        timeout: Duration,
    ) -> Result<tonic::Streaming<kas_proto::pods::LogChunk>, tonic::Status> {
        let api = self.api.with_timeout(timeout);
        api.pod_logs(agent, None, "default", pod, "", 0).await
    }

    /// The live connections of agent `agent`: (connection id, pod name), sorted.
    /// The agent's replicas as listed: (connection id, pod name, how many kas it is
    /// connected to), sorted.
    pub async fn replicas(&self, agent: i64) -> Result<Vec<(i64, String, usize)>, tonic::Status> {
        let mut v: Vec<(i64, String, usize)> = self
            .api
            .agents_by_id(agent)
            .await?
            .into_iter()
            .map(|a| {
                let kas = a.kas_addresses.len();
                (
                    a.connection_id,
                    a.agent_meta.unwrap_or_default().pod_name,
                    kas,
                )
            })
            .collect();
        v.sort();
        Ok(v)
    }

    pub async fn connections(&self, agent: i64) -> Result<Vec<(i64, String)>, tonic::Status> {
        let mut v: Vec<(i64, String)> = self
            .api
            .agents_by_id(agent)
            .await?
            .into_iter()
            .map(|a| (a.connection_id, a.agent_meta.unwrap_or_default().pod_name))
            .collect();
        v.sort();
        Ok(v)
    }
}

/// The log of a `TestAgent`'s pod `pod`: numbered lines, about 300 KiB (five pieces).
pub fn test_log(pod: &str) -> Vec<u8> {
    (0..10_000)
        .flat_map(|i| format!("{pod} line {i:05}: GET /healthz 200\n").into_bytes())
        .collect()
}

/// The fixture pod `pod`'s modules: `List` (taking `delay`), and `Logs` answering
/// [`test_log`].
pub fn pod_modules(pod: &str, delay: Duration) -> Modules {
    let pods = vec![Pod {
        namespace: "default".into(),
        name: pod.into(),
        phase: "Running".into(),
        node_name: "node-1".into(),
    }];
    let mut modules = Modules::default();
    modules.unary(kas_agent::PODS_LIST, move |_: ListRequest| {
        let pods = pods.clone();
        async move {
            tokio::time::sleep(delay).await;
            Ok(ListResponse { pods })
        }
    });
    let log: Arc<[u8]> = test_log(pod).into();
    let name = pod.to_string();
    modules.server_streaming(kas_agent::PODS_LOGS, move |req: LogsRequest| {
        let (log, name) = (log.clone(), name.clone());
        async move {
            if req.pod != name {
                return Err(tonic::Status::not_found(format!("no pod {}", req.pod)));
            }
            let limit = match req.limit_bytes {
                0 => usize::MAX,
                n => n as usize,
            };
            Ok(kas_agent::pods::chunks(log, limit))
        }
    });
    modules
}

/// One agent replica: a `GetConfiguration` stream and idle tunnels serving one fixture pod
/// named `pod` (`List`, and `Logs` answering [`test_log`]). Dropping it disconnects.
pub struct TestAgent {
    pub connection: ConnectionId,
    tasks: Vec<JoinHandle<()>>,
}

impl TestAgent {
    pub async fn connect(
        kas_agent: SocketAddr,
        agent: i64,
        pod: &str,
        tunnels: usize,
    ) -> TestAgent {
        Self::connect_slow(kas_agent, agent, pod, tunnels, Duration::ZERO).await
    }

    /// Like `connect`, but every pod list takes `delay`.
    pub async fn connect_slow(
        kas_agent: SocketAddr,
        agent: i64,
        pod: &str,
        tunnels: usize,
        delay: Duration,
    ) -> TestAgent {
        let modules = pod_modules(pod, delay);
        Self::connect_with(kas_agent, agent, pod, tunnels, modules).await
    }

    /// Connects as replica `pod` of `agent` with `tunnels` tunnels serving `modules`.
    pub async fn connect_with(
        kas_agent: SocketAddr,
        agent: i64,
        pod: &str,
        tunnels: usize,
        modules: Modules,
    ) -> TestAgent {
        Self::connect_as(kas_agent, agent, pod, tunnels, modules, None)
            .await
            .expect("GetConfiguration")
    }

    /// Connects as replica `replica` (its connection id and proof), or as one kas names
    /// when `None`; `Err` when kas refuses the `GetConfiguration` stream.
    pub async fn connect_as(
        kas_agent: SocketAddr,
        agent: i64,
        pod: &str,
        tunnels: usize,
        modules: Modules,
        replica: Option<(ConnectionId, &[u8])>,
    ) -> Result<TestAgent, tonic::Status> {
        let proof = replica.map(|r| r.1.to_vec()).unwrap_or_default();
        let client =
            AgentClient::new(channel(kas_agent).await, agent_token(agent)).with_proof(proof);
        let meta = AgentMeta {
            version: "test".into(),
            pod_namespace: "default".into(),
            pod_name: pod.into(),
            ..Default::default()
        };
        let (connection, _, mut stream) = client.connect(meta, replica.map(|r| r.0)).await?;
        let mut tasks = vec![tokio::spawn(async move {
            while let Ok(Some(_)) = stream.message().await {}
        })];
        let modules = Arc::new(modules);
        for _ in 0..tunnels {
            let (client, modules) = (client.clone(), modules.clone());
            tasks.push(tokio::spawn(async move {
                // Reopen after each call-free end, as agentk keeps its pool.
                loop {
                    let status = client
                        .serve_tunnel(
                            connection,
                            modules.clone(),
                            Duration::from_millis(500),
                            None,
                        )
                        .await;
                    if status.code() != tonic::Code::Ok {
                        return;
                    }
                }
            }));
        }
        Ok(TestAgent { connection, tasks })
    }
}

impl Drop for TestAgent {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// An `agentk` process serving fixture pods, logging to a file.
pub struct AgentkProc {
    child: Option<Child>,
    pub log: PathBuf,
}

impl AgentkProc {
    /// Starts agentk with `--kas kas` (`host:port`, or a URL: `grpcs://` for TLS) and
    /// `token`, as pod `pod`, serving `pods` (YAML fixture text), with `extra` flags.
    pub fn start(
        secrets: &Secrets,
        kas: &str,
        token: &str,
        pod: &str,
        pods: &str,
        extra: &[&str],
    ) -> AgentkProc {
        Self::start_env(secrets, kas, token, pod, pods, extra, &[])
    }

    /// Like `start`, with `env` set too.
    pub fn start_env(
        secrets: &Secrets,
        kas: &str,
        token: &str,
        pod: &str,
        pods: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> AgentkProc {
        let token_file = secrets.path(&format!("{pod}.token"));
        std::fs::write(&token_file, token).unwrap();
        let fixture = secrets.path(&format!("{pod}.pods.yaml"));
        std::fs::write(&fixture, pods).unwrap();
        let log = secrets.path(&format!("{pod}.agentk.log"));
        let child = Command::new(bin("agentk"))
            .arg("--kas")
            .arg(kas)
            .arg("--token-file")
            .arg(&token_file)
            .arg("--pods-fixture")
            .arg(&fixture)
            .args(["--log", "info,kas_agent=debug,kas_transport=debug"])
            .args(extra)
            .env("POD_NAMESPACE", "gitlab-agent")
            .env("POD_NAME", pod)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("agentk starts");
        AgentkProc {
            child: Some(child),
            log,
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Log lines containing `needle`.
    pub fn count(&self, needle: &str) -> usize {
        self.log_text()
            .lines()
            .filter(|l| l.contains(needle))
            .count()
    }

    /// True while the process runs.
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }

    /// SIGTERM, then waits for the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("running");
        let _ = Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status();
        c.wait().expect("agentk exits")
    }
}

impl Drop for AgentkProc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A throwaway CA and the certificates it issues, as PEM files in a directory.
pub struct Pki {
    dir: PathBuf,
    name: String,
    ca: kas_transport::local_ca::LocalCa,
}

impl Pki {
    /// A CA named `name`; its certificate is `DIR/NAME-ca.pem`.
    pub fn new(dir: &Path, name: &str) -> Pki {
        let ca = kas_transport::local_ca::LocalCa::new(&format!("{name} test CA")).unwrap();
        std::fs::write(dir.join(format!("{name}-ca.pem")), &ca.pem).unwrap();
        Pki {
            dir: dir.to_path_buf(),
            name: name.into(),
            ca,
        }
    }

    pub fn ca(&self) -> PathBuf {
        self.dir.join(format!("{}-ca.pem", self.name))
    }

    /// A certificate for 127.0.0.1 and localhost, written as `DIR/FILE.crt` and
    /// `DIR/FILE.key`; their paths.
    pub fn issue(&self, file: &str) -> (PathBuf, PathBuf) {
        let (cert, key) = self.ca.issue().unwrap();
        let (c, k) = (
            self.dir.join(format!("{file}.crt")),
            self.dir.join(format!("{file}.key")),
        );
        // Written beside and renamed, as a Secret's files are swapped.
        std::fs::write(c.with_extension("crt.new"), cert).unwrap();
        std::fs::write(k.with_extension("key.new"), key).unwrap();
        std::fs::rename(c.with_extension("crt.new"), &c).unwrap();
        std::fs::rename(k.with_extension("key.new"), &k).unwrap();
        (c, k)
    }
}

/// The `listen:` lines that make a listener serve `cert` and `key`.
pub fn tls_lines(cert: &Path, key: &Path) -> String {
    format!(
        "    certificate_file: {}\n    key_file: {}\n",
        cert.display(),
        key.display()
    )
}

/// Installs Debian's `package` when `binary` is not on PATH (as root, with apt-get); fails
/// the test, naming the package, when it is still missing: never a silent skip.
pub fn ensure_package(binary: &str, package: &str) {
    let present = || {
        Command::new("sh")
            .args(["-c", &format!("command -v {binary}")])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !present() {
        let _ = Command::new("apt-get")
            .args(["install", "-y", "-qq", package])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status();
    }
    assert!(present(), "{binary} is missing: apt-get install {package}");
}

/// `kubectl --context CONTEXT ARGS` with `kubeconfig` (and its own cache directory under
/// `cache`), killed when dropped.
pub fn kubectl(
    kubeconfig: &Path,
    cache: &Path,
    context: &str,
    args: &[&str],
) -> tokio::process::Command {
    let mut c = tokio::process::Command::new("kubectl");
    c.env("KUBECONFIG", kubeconfig)
        .env("HOME", cache)
        .arg("--cache-dir")
        .arg(cache.join("kube-cache"))
        .args(["--context", context, "--request-timeout", "30s"])
        .args(args)
        .stdin(Stdio::null())
        .kill_on_drop(true);
    c
}

/// Python's `module`, installed with pip as `package` when missing (on Debian's Python
/// too, which pip may change only when told to).
pub fn ensure_python_module(module: &str, package: &str) {
    let present = || {
        Command::new("python3")
            .args(["-c", &format!("import {module}")])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    ensure_package("python3", "python3");
    ensure_package("pip3", "python3-pip");
    for extra in [&[][..], &["--break-system-packages"][..]] {
        if present() {
            break;
        }
        let _ = Command::new("pip3")
            .args(["install", "--quiet", package])
            .args(extra)
            .status();
    }
    assert!(
        present(),
        "python3's {module} is missing: pip3 install {package}"
    );
}

/// A write of three fields to `key` for the GC tests: `live` (expiring after `now`),
/// `dead` (expiring at `now`) and `junk` (not an expiring value), publishing `publish`.
pub fn gc_fixture(
    key: &str,
    now: kas_core::Time,
    publish: Vec<(String, Vec<u8>)>,
) -> kas_core::tracker::KeyWrite {
    use kas_core::{Time, expiring};
    kas_core::tracker::KeyWrite {
        key: key.to_string(),
        delete: vec![],
        set: vec![
            ("live".into(), expiring::encode(b"payload", Time(now.0 + 1))),
            ("dead".into(), expiring::encode(b"payload", now)),
            ("junk".into(), b"not an expiring value".to_vec()),
        ],
        expire: kas_core::tracker::KeyExpiry::Keep,
        publish,
        announce: vec![],
    }
}

/// Asserts that of each [`gc_fixture`] key only the `live` field is left.
pub async fn only_live_left(store: &kas_server::store::Store, keys: &[String]) {
    for key in keys {
        let fields: Vec<String> = store
            .read(key)
            .await
            .unwrap()
            .into_iter()
            .map(|(f, _)| f)
            .collect();
        assert_eq!(fields, ["live"], "{key}");
    }
}

/// Whether every thread of process `pid` is stopped (state `T` in /proc).
fn all_threads_stopped(pid: &str) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|task| {
        std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| {
            // The state follows the command name, which is in parentheses.
            stat.rsplit_once(") ")
                .is_some_and(|(_, rest)| rest.starts_with('T') || rest.starts_with('t'))
        })
    })
}

/// Which way a [`HalfOpenRelay`] drops bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Way {
    /// From the client (agentk) to the server (kas).
    ToServer,
    /// From the server to the client.
    ToClient,
}

/// The cut one relayed connection reads: none, or the way it drops.
type Cut = Arc<std::sync::Mutex<Option<Way>>>;

/// A TCP relay in front of one server whose connections, once cut, drop one way: bytes
/// read and thrown away, with no reset, as a path that half died (a middlebox that lost
/// its state for a flow, one route withdrawn) does. Connections accepted after the cut
/// pass both ways. Dropping it closes everything.
pub struct HalfOpenRelay {
    pub address: SocketAddr,
    /// The cuts of the connections open since the last cut.
    open: Arc<std::sync::Mutex<Vec<Cut>>>,
    task: JoinHandle<()>,
}

impl HalfOpenRelay {
    pub async fn start(server: SocketAddr) -> HalfOpenRelay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let open: Arc<std::sync::Mutex<Vec<_>>> = Arc::default();
        let registry = open.clone();
        let task = tokio::spawn(async move {
            let mut relays = tokio::task::JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((client, _)) = accepted else { continue };
                        let cut = Arc::new(std::sync::Mutex::new(None));
                        registry.lock().unwrap().push(cut.clone());
                        relays.spawn(async move {
                            let Ok(upstream) = tokio::net::TcpStream::connect(server).await else { return };
                            let (client_in, client_out) = client.into_split();
                            let (server_in, server_out) = upstream.into_split();
                            tokio::join!(
                                pass(client_in, server_out, cut.clone(), Way::ToServer),
                                pass(server_in, client_out, cut, Way::ToClient),
                            );
                        });
                    }
                    Some(_) = relays.join_next() => {}
                }
            }
        });
        HalfOpenRelay {
            address,
            open,
            task,
        }
    }

    /// From now on, every connection open now drops what goes `way`.
    pub fn cut(&self, way: Way) {
        for cut in self.open.lock().unwrap().drain(..) {
            *cut.lock().unwrap() = Some(way);
        }
    }
}

impl Drop for HalfOpenRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies `from` to `to` until `from` ends, dropping what it reads once `cut` is `way`.
async fn pass(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    cut: Cut,
    way: Way,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if *cut.lock().unwrap() == Some(way) {
            continue;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    // The end passes on unless this way is cut: a dead path carries no FIN either.
    if *cut.lock().unwrap() != Some(way) {
        let _ = to.shutdown().await;
    }
}
