//! A working deployment on this machine: Redis on a free port, three kas sharing it and
//! agents on different kas (agent 2 with two replicas) serving fixture pods; or, without
//! Redis, one kas on its in-memory registry. kas and agents run in this process, on the
//! production code paths; Redis is a child process.

pub mod balancer;
pub mod kas_process;
pub mod kube_server;
pub mod port_forward;
pub mod redis_server;

use kas_agent as agent;
use kas_agent::kubernetes_api::Upstream;
use kas_agent::{AgentOptions, Modules, PodSource};
use kas_auth::jwt::Secret;
use kas_client::api_client::ApiClient;
use kas_server::config::{Config, ConfigWriter};
use kas_server::kas::Kas;
use kas_transport::local_ca::LocalCa;
use kube_server::KubeServer;
use redis_server::RedisServer;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// How long a Kubernetes API request waits for its agent here (`routing_timeout`): short,
/// so that a stream outliving it shows in seconds.
pub const KUBE_ROUTING_TIMEOUT_SECS: u64 = 5;

/// The project both agents belong to.
pub const PROJECT: i64 = 100;

/// One agent replica of the deployment.
#[derive(Clone, Debug)]
pub struct Replica {
    /// The agent id.
    pub agent: i64,
    /// Its pod name (what `kasctl agents` shows).
    pub pod: String,
    /// Index of the kas it connects to.
    pub kas: usize,
}

/// Fixture pods of each agent: (agent, namespace, name, phase, node).
const PODS: [(i64, &str, &str, &str, &str); 3] = [
    (1, "default", "web-1", "Running", "node-a"),
    (1, "kube-system", "coredns-1", "Running", "node-a"),
    (2, "shop", "cart-1", "Running", "node-b"),
];

/// The log of fixture pod `name`.
pub fn fixture_log(name: &str) -> String {
    format!("{name}: started\n{name}: listening on :8080\n{name}: GET /healthz 200\n")
}

/// The pod names agent `agent` serves, in fixture order.
pub fn fixture_pods(agent: i64) -> Vec<&'static str> {
    PODS.iter().filter(|p| p.0 == agent).map(|p| p.2).collect()
}

/// The running deployment. [`LocalDeployment::stop`] takes it down.
pub struct LocalDeployment {
    dir: PathBuf,
    redis: Option<RedisServer>,
    kas: Vec<Kas>,
    replicas: Vec<Replica>,
    stop_agents: watch::Sender<bool>,
    agents: JoinSet<()>,
    /// The throwaway CA's certificate, when everything runs over TLS.
    ca: Option<PathBuf>,
    /// Each agent's cluster's API server, by agent.
    clusters: Vec<(i64, KubeServer)>,
    /// The Kubernetes API token of the local user, by agent (`pat:<agent>:<token>`).
    user_token: String,
}

/// What stopping found.
#[derive(Debug)]
pub struct Stopped {
    /// Keys left in Redis after every kas deleted its records (`None` without Redis).
    pub redis_keys_left: Option<Vec<String>>,
}

/// The files every kas of the deployment reads.
struct KasFiles<'a> {
    tokens: &'a Path,
    user_tokens: &'a Path,
    gitlab: &'a Path,
    kas: &'a Path,
    /// Where kas `i`'s audit log goes: `kas<i>-audit.jsonl` in it.
    dir: &'a Path,
}

/// Kas `i`'s Kubernetes API audit log in the deployment's directory `dir`.
pub fn audit_log(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("kas{i}-audit.jsonl"))
}

/// The certificate every TLS listener serves: the Kubernetes API listener always, the
/// others when `all` (the private one also trusting the CA).
struct ListenTls<'a> {
    cert: &'a Path,
    key: &'a Path,
    ca: &'a Path,
    all: bool,
}

impl ListenTls<'_> {
    /// Sets listener `listen` (a dotted key) to serve TLS, trusting the CA when `trust`.
    fn on(&self, c: ConfigWriter, listen: &str, trust: bool) -> ConfigWriter {
        let c = c
            .path(&format!("{listen}.certificate_file"), self.cert)
            .path(&format!("{listen}.key_file"), self.key);
        if trust {
            c.path(&format!("{listen}.ca_certificate_file"), self.ca)
        } else {
            c
        }
    }

    fn apply(&self, c: ConfigWriter) -> ConfigWriter {
        let c = self.on(c, "agent.kubernetes_api.listen", false);
        if !self.all {
            return c;
        }
        let c = ["agent.listen", "api.listen", "observability.listen"]
            .into_iter()
            .fold(c, |c, listen| self.on(c, listen, false));
        self.on(c, "private_api.listen", true)
    }
}

/// Starts three kas sharing `redis`, or one on its memory: each with a config file written
/// by `write`.
async fn start_kas(
    write: impl Fn(&str, String) -> Result<PathBuf, String>,
    redis: Option<&RedisServer>,
    files: &KasFiles<'_>,
    tls: &ListenTls<'_>,
) -> Result<Vec<Kas>, String> {
    let kas_count = if redis.is_some() { 3 } else { 1 };
    let mut kas = Vec::new();
    for i in 0..kas_count {
        let mut config = ConfigWriter::new()
            .set("agent.listen.address", "127.0.0.1:0")
            .path("agent.tokens_file", files.tokens)
            .set("agent.kubernetes_api.listen.address", "127.0.0.1:0")
            .path("agent.kubernetes_api.tokens_file", files.user_tokens)
            .path("agent.kubernetes_api.audit.path", &audit_log(files.dir, i))
            .set(
                "agent.kubernetes_api.routing_timeout",
                format!("{KUBE_ROUTING_TIMEOUT_SECS}s"),
            )
            .set("api.listen.address", "127.0.0.1:0")
            .path("api.listen.authentication_secret_file", files.gitlab)
            .set("private_api.listen.address", "127.0.0.1:0")
            .path("private_api.listen.authentication_secret_file", files.kas)
            .set("observability.listen.address", "127.0.0.1:0")
            .set("shutdown_grace", "2s");
        config = tls.apply(config);
        if let Some(r) = redis {
            config = config
                .set("redis.server.address", r.address())
                .set("redis.key_prefix", "kas");
        }
        let path = write(&format!("kas{i}.yaml"), config.text())?;
        let config = Config::load(&path, None).map_err(|e| e.to_string())?;
        kas.push(
            Kas::start_configured(config)
                .await
                .map_err(|e| format!("kas{i}: {e}"))?,
        );
    }
    Ok(kas)
}

/// Starts the agent replicas, each on its kas only (the deployment's contexts name the
/// route, local or remote, a call takes), until `shutdown` turns true.
async fn start_agents(
    dir: &Path,
    replicas: &[Replica],
    tokens: &[String],
    kas: &[Kas],
    clusters: &[(i64, KubeServer)],
    ca: Option<&PathBuf>,
    shutdown: &watch::Receiver<bool>,
) -> Result<JoinSet<()>, String> {
    let mut agents = JoinSet::new();
    for r in replicas {
        let source = PodSource::fixture_file(&dir.join(format!("pods-agent{}.yaml", r.agent)))?;
        let meta = kas_agent::meta::own("gitlab-agent", &r.pod);
        let token = tokens[usize::try_from(r.agent - 1).unwrap_or(0)].clone();
        let url = url(ca.is_some(), kas[r.kas].addresses.agent);
        let mut options = AgentOptions::new(url, token, meta);
        options.ca_cert_file = ca.cloned();
        options.seed = rand::random();
        options.kas_connections = 1;
        let cluster = clusters
            .iter()
            .find(|(n, _)| *n == r.agent)
            .map(|(_, c)| c.url())
            .ok_or_else(|| format!("no cluster for agent {}", r.agent))?;
        let upstream = kube::Config::new(
            cluster
                .parse()
                .map_err(|e| format!("cluster URL {cluster}: {e}"))?,
        );
        let upstream = Upstream::new(upstream)?;
        options.meta.kubernetes_version = Some(
            kas_agent::meta::cluster_version(&upstream)
                .await
                .map_err(|e| format!("agent {}'s cluster: {e}", r.agent))?,
        );
        let modules = Modules::default()
            .with_pods(source)
            .with_kubernetes_api(upstream);
        agents.spawn(agent::run(options, Arc::new(modules), shutdown.clone()));
    }
    Ok(agents)
}

impl LocalDeployment {
    /// Starts the deployment with its files (secrets, tokens, configs, fixture pods) in
    /// `dir`, with Redis when `with_redis`, every listener and every connection over TLS
    /// when `tls` (a throwaway CA and a certificate for 127.0.0.1 in `dir`), and returns
    /// once every kas lists every replica.
    pub async fn start(dir: &Path, with_redis: bool, tls: bool) -> Result<LocalDeployment, String> {
        let write = |name: &str, text: String| {
            let path = dir.join(name);
            std::fs::write(&path, text)
                .map(|()| path)
                .map_err(|e| format!("{}: {e}", dir.join(name).display()))
        };
        let random_secret = || Secret::from_base64(&base64_of(&rand::random::<[u8; 32]>()));
        let gitlab = random_secret().map_err(|e| e.to_string())?;
        let kas_secret = random_secret().map_err(|e| e.to_string())?;
        let gitlab_file = write("gitlab.secret", gitlab.to_base64())?;
        let kas_file = write("kas.secret", kas_secret.to_base64())?;
        let tokens: Vec<String> = (1..=2)
            .map(|n| format!("local-agent-{n}-{:016x}", rand::random::<u64>()))
            .collect();
        let mut tokens_yaml = String::from("agents:\n");
        for (n, token) in (1..).zip(&tokens) {
            let _ = writeln!(
                tokens_yaml,
                "  - {{token: {token}, agent_id: {n}, project_id: {PROJECT}}}"
            );
            write(&format!("agent{n}.token"), format!("{token}\n"))?;
            let mut pods = String::new();
            for p in PODS.iter().filter(|p| p.0 == n) {
                let _ = writeln!(
                    pods,
                    "- {{namespace: {}, name: {}, phase: {}, node_name: {}, log: {:?}}}",
                    p.1,
                    p.2,
                    p.3,
                    p.4,
                    fixture_log(p.2)
                );
            }
            write(&format!("pods-agent{n}.yaml"), pods)?;
        }
        let tokens_file = write("tokens.yaml", tokens_yaml)?;
        // One user who reaches both agents' clusters as each agent, and agent 3's, which
        // never connects.
        let user_token = format!("local-user-{:016x}", rand::random::<u64>());
        let user_tokens_file = write(
            "user-tokens.yaml",
            format!(
                "tokens:\n  - {{token: {user_token}, kind: pat, agent_ids: [1, 2, 3], access_as: agent, username: local}}\n"
            ),
        )?;
        let mut clusters = Vec::new();
        for n in 1..=2 {
            let pods = agent::pods::read_fixture(&dir.join(format!("pods-agent{n}.yaml")))?;
            let server = KubeServer::start(&pods)
                .await
                .map_err(|e| format!("cluster of agent {n}: {e}"))?;
            clusters.push((n, server));
        }
        // Every TLS listener serves the same certificate; the private one also trusts the
        // CA. The Kubernetes API listener always serves TLS: kubectl sends no token over
        // plaintext.
        let local_ca = LocalCa::new("kas-local throwaway CA")?;
        let (cert, key) = local_ca.issue()?;
        let ca_file = write("ca.pem", local_ca.pem.clone())?;
        let (cert, key) = (write("kas.crt", cert)?, write("kas.key", key)?);
        let ca = tls.then(|| ca_file.clone());

        let redis = if with_redis {
            Some(RedisServer::start()?)
        } else {
            None
        };
        let kas = start_kas(
            &write,
            redis.as_ref(),
            &KasFiles {
                tokens: &tokens_file,
                user_tokens: &user_tokens_file,
                gitlab: &gitlab_file,
                kas: &kas_file,
                dir,
            },
            &ListenTls {
                cert: &cert,
                key: &key,
                ca: &ca_file,
                all: tls,
            },
        )
        .await?;
        let kas_count = kas.len();

        let replicas = vec![
            Replica {
                agent: 1,
                pod: "agent1-7d9f".into(),
                kas: 0,
            },
            Replica {
                agent: 2,
                pod: "agent2-aaaa".into(),
                kas: 1 % kas_count,
            },
            Replica {
                agent: 2,
                pod: "agent2-bbbb".into(),
                kas: 2 % kas_count,
            },
        ];
        let (stop_agents, shutdown) = watch::channel(false);
        let agents = start_agents(
            dir,
            &replicas,
            &tokens,
            &kas,
            &clusters,
            ca.as_ref(),
            &shutdown,
        )
        .await?;
        let deployment = LocalDeployment {
            dir: dir.to_path_buf(),
            redis,
            kas,
            replicas,
            stop_agents,
            agents,
            ca,
            clusters,
            user_token,
        };
        deployment.write_kubeconfig()?;
        deployment.wait_until_listed(&gitlab).await?;
        Ok(deployment)
    }

    /// Waits until every kas lists every replica, or fails after 20 s.
    async fn wait_until_listed(&self, gitlab: &Secret) -> Result<(), String> {
        let end = Instant::now() + Duration::from_secs(20);
        for i in 0..self.kas.len() {
            let api = ApiClient::connect_with_ca(
                &self.api_url(i),
                self.ca.as_deref(),
                gitlab,
                Duration::from_secs(5),
            )
            .await?;
            loop {
                let listed = api.agents_for_project(PROJECT).await.map(|a| a.len());
                if listed.as_ref().is_ok_and(|n| *n == self.replicas.len()) {
                    break;
                }
                if Instant::now() > end {
                    return Err(format!(
                        "kas{i} did not list all {} agent replicas within 20 s (last answer: {listed:?})",
                        self.replicas.len()
                    ));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(())
    }

    /// The running kas instances.
    pub fn kas(&self) -> &[Kas] {
        &self.kas
    }

    /// The agent replicas.
    pub fn replicas(&self) -> &[Replica] {
        &self.replicas
    }

    /// The public API of kas `i`, as kasctl takes it (`grpcs://` with TLS).
    pub fn api_url(&self, i: usize) -> String {
        url(self.ca.is_some(), self.kas[i].addresses.api)
    }

    /// The throwaway CA's certificate, for `--ca-cert-file`, when everything runs over TLS.
    pub fn ca_file(&self) -> Option<&Path> {
        self.ca.as_deref()
    }

    /// The kubeconfig with a context per agent and kas (`agent<N>-kas<I>`), whose
    /// current context is `agent1-kas0`.
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.join("kubeconfig")
    }

    /// The local user's bearer token for `agent`'s cluster, in GitLab's `pat:` form.
    pub fn user_bearer(&self, agent: i64) -> String {
        format!("pat:{agent}:{}", self.user_token)
    }

    /// The Kubernetes API URL of kas `i` (always TLS, with the throwaway CA).
    pub fn kubernetes_api_url(&self, i: usize) -> Option<String> {
        Some(format!("https://{}", self.kas[i].addresses.kubernetes_api?))
    }

    /// The throwaway CA's certificate, which the Kubernetes API listeners' certificate
    /// (and every listener's, with TLS) chains to.
    pub fn kube_ca_file(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// The API server of `agent`'s cluster, dialled directly (not through kas).
    pub fn cluster_url(&self, agent: i64) -> Option<String> {
        self.clusters
            .iter()
            .find(|(n, _)| *n == agent)
            .map(|(_, c)| c.url())
    }

    fn write_kubeconfig(&self) -> Result<(), String> {
        let path = self.kube_ca_file();
        let pem = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let ca = format!("\n    certificate-authority-data: {}", base64_of(&pem));
        let mut clusters = String::new();
        let mut users = String::new();
        let mut contexts = String::new();
        for i in 0..self.kas.len() {
            let Some(url) = self.kubernetes_api_url(i) else {
                continue;
            };
            let _ = write!(
                clusters,
                "\n- name: kas{i}\n  cluster:\n    server: {url}{ca}"
            );
        }
        for agent in [1, 2] {
            let _ = write!(
                users,
                "\n- name: agent{agent}\n  user:\n    token: {}",
                self.user_bearer(agent)
            );
            for i in 0..self.kas.len() {
                let _ = write!(
                    contexts,
                    "\n- name: agent{agent}-kas{i}\n  context:\n    cluster: kas{i}\n    user: agent{agent}"
                );
            }
        }
        let text = format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: agent1-kas0\nclusters:{clusters}\nusers:{users}\ncontexts:{contexts}\n"
        );
        std::fs::write(self.kubeconfig(), text)
            .map_err(|e| format!("{}: {e}", self.kubeconfig().display()))
    }

    /// GitLab's secret, for `kasctl --secret-file`.
    pub fn gitlab_secret_file(&self) -> PathBuf {
        self.dir.join("gitlab.secret")
    }

    /// What runs where, and `kasctl` commands to try (`kasctl` is the path to show).
    pub fn describe(&self, kasctl: &str) -> String {
        let mut s = String::new();
        let dir = self.dir.display();
        let _ = writeln!(
            s,
            "Local kas deployment (configs, secrets and fixture pods in {dir}):"
        );
        match &self.redis {
            Some(r) => {
                let _ = writeln!(s, "  redis     {}", r.address());
            }
            None => {
                let _ = writeln!(
                    s,
                    "  (no redis-server on PATH: one kas on its in-memory registry)"
                );
            }
        }
        let metrics = if self.ca.is_some() { "https" } else { "http" };
        for (i, k) in self.kas.iter().enumerate() {
            let a = &k.addresses;
            let _ = writeln!(
                s,
                "  kas{i}      agent {}  api {}  private {}  metrics {metrics}://{}/metrics",
                a.agent, a.api, a.private_api, a.observability
            );
        }
        if let Some(ca) = &self.ca {
            let _ = writeln!(
                s,
                "  TLS on every listener and connection: certificate {dir}/kas.crt for 127.0.0.1, issued by the throwaway CA {}",
                ca.display()
            );
        }
        for r in &self.replicas {
            let _ = writeln!(
                s,
                "  agent {}   pod gitlab-agent/{}  on kas{}  serving {}",
                r.agent,
                r.pod,
                r.kas,
                fixture_pods(r.agent).join(", ")
            );
        }
        let n = self.kas.len();
        let ca = match &self.ca {
            Some(ca) => format!(" --ca-cert-file {}", ca.display()),
            None => String::new(),
        };
        let kasctl = |i: usize| format!("{kasctl} --kas {}{ca}", self.api_url(i % n));
        let _ = writeln!(s, "\nTry (any kas routes to any agent):");
        let _ = writeln!(
            s,
            "  export KASCTL_SECRET_FILE={}",
            self.gitlab_secret_file().display()
        );
        let _ = writeln!(s, "  {} agents --project {PROJECT}", kasctl(0));
        let _ = writeln!(s, "  {} pods --agent 1", kasctl(2));
        let _ = writeln!(
            s,
            "  {} pods --agent 2 --connection <CONNECTION from 'agents'>",
            kasctl(0)
        );
        let _ = writeln!(
            s,
            "  {} --timeout 2s pods --agent 9     # not connected",
            kasctl(1)
        );
        let kubeconfig = self.kubeconfig();
        let _ = writeln!(
            s,
            "\nkubectl through kas (a context per agent and kas: agent<N>-kas<I>); each kas \
             writes one JSON line per request to its audit log, {}:",
            audit_log(&self.dir, 0)
                .display()
                .to_string()
                .replace("kas0-", "kas<I>-")
        );
        let _ = writeln!(s, "  export KUBECONFIG={}", kubeconfig.display());
        let last = n - 1;
        for cmd in [
            "--context agent1-kas0 get pods -A".to_string(),
            format!("--context agent2-kas{last} get pods -A -o wide"),
            "--context agent1-kas0 get pods -A -w".to_string(),
            format!("--context agent1-kas{last} logs -f -n default web-1"),
            format!(
                "--context agent2-kas{} exec -n shop cart-1 -- echo hello",
                1 % n
            ),
            format!(
                "--context agent1-kas{last} port-forward -n default web-1 :8080   # its ports echo"
            ),
        ] {
            let _ = writeln!(s, "  kubectl {cmd}");
        }
        let _ = writeln!(
            s,
            "\nAnother replica of agent 2: agentk --kas {}{ca} --token-file {dir}/agent2.token --pods-fixture {dir}/pods-agent2.yaml",
            url(self.ca.is_some(), self.kas[0].addresses.agent)
        );
        s
    }

    /// Stops the agents (their calls finish), then every kas (each deletes its records),
    /// then Redis, reporting the keys left behind.
    pub async fn stop(mut self) -> Stopped {
        let _ = self.stop_agents.send(true);
        while self.agents.join_next().await.is_some() {}
        futures::future::join_all(self.kas.drain(..).map(Kas::stop)).await;
        let redis_keys_left = self.redis.as_mut().map(|r| {
            let keys = r.keys();
            r.stop();
            keys
        });
        Stopped { redis_keys_left }
    }
}

/// `addr` as a client dials it: `grpcs://` over TLS, bare otherwise.
fn url(tls: bool, addr: std::net::SocketAddr) -> String {
    if tls {
        format!("grpcs://{addr}")
    } else {
        addr.to_string()
    }
}

fn base64_of(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}
