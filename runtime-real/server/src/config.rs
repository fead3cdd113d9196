//! The kas configuration file (YAML, laid out like GitLab's kas configuration), its
//! defaults and its validation.
//!
//! Every problem found is reported with the dotted path of the key at fault, and all of
//! them at once, so one edit fixes a file.

mod writer;

pub use writer::ConfigWriter;

use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The whole kas configuration.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// GitLab's internal API (agent token resolution).
    pub gitlab: Option<GitLab>,
    /// agentk -> kas listener and agent tracking.
    pub agent: Agent,
    /// GitLab -> kas listener.
    pub api: Api,
    /// kas -> kas listener.
    pub private_api: PrivateApi,
    /// Metrics and probes.
    pub observability: Observability,
    /// The shared registry; without it kas runs alone on an in-memory store.
    pub redis: Option<Redis>,
    /// How long running calls may take to finish after SIGTERM.
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
}

/// `gitlab:`
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GitLab {
    /// Base URL, e.g. `https://gitlab.example.com`.
    pub address: String,
    /// File holding the base64 shared secret GitLab and kas sign JWTs with.
    pub authentication_secret_file: PathBuf,
}

/// `agent:`
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Agent {
    /// Where agentk connects.
    pub listen: Listen,
    /// Open `GetConfiguration` streams (replicas) one agent may hold on this kas.
    pub max_connections_per_agent: usize,
    /// Open tunnels one agent connection may hold on this kas.
    pub max_tunnels_per_connection: usize,
    /// Largest message an agent may send (a module's answer), in bytes; also the largest
    /// answer one kas accepts from another.
    pub max_message_size: usize,
    /// Uncached agent-token lookups (GitLab's `agent_info`) per second, overall and per
    /// client address: unknown tokens beyond that are refused without asking GitLab.
    pub token_lookups_per_second: u32,
    /// Per client address, see `token_lookups_per_second`.
    pub token_lookups_per_second_per_address: u32,
    /// While GitLab fails, a token GitLab accepted within this long is still accepted.
    #[serde(with = "humantime_serde")]
    pub info_cache_stale_ttl: Duration,
    /// Static agent tokens (YAML); when unset, tokens are resolved through `gitlab`.
    pub tokens_file: Option<PathBuf>,
    /// How long a resolved agent token is cached.
    #[serde(with = "humantime_serde")]
    pub info_cache_ttl: Duration,
    /// How long a failed token resolution is cached.
    #[serde(with = "humantime_serde")]
    pub info_cache_error_ttl: Duration,
    /// Lifetime of a registry record unless refreshed.
    #[serde(with = "humantime_serde")]
    pub redis_conn_info_ttl: Duration,
    /// How often this kas rewrites its records.
    #[serde(with = "humantime_serde")]
    pub redis_conn_info_refresh: Duration,
    /// How often expired records are collected.
    #[serde(with = "humantime_serde")]
    pub redis_conn_info_gc: Duration,
    /// A tunnel silent (no heartbeat) for this long is closed.
    #[serde(with = "humantime_serde")]
    pub heartbeat_timeout: Duration,
    /// This kas's liveness record lives this long (at most `redis_conn_info_ttl`) and is
    /// rewritten every third of it: the connections of a kas that died without deleting
    /// them leave listings within it.
    #[serde(with = "humantime_serde")]
    pub kas_liveness_ttl: Duration,
    /// The Kubernetes API listener (kubectl and GitLab's dashboard -> kas -> agentk ->
    /// the cluster's API server); off unless set.
    pub kubernetes_api: Option<KubernetesApi>,
    /// `agent.configuration:` the agents' `GetConfiguration` streams.
    pub configuration: AgentConfiguration,
}

/// `agent.configuration:`
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AgentConfiguration {
    /// How often kas checks again the token of each connected replica (through the
    /// token cache, so GitLab is asked at most every `agent.info_cache_ttl`): a token
    /// GitLab revoked ends its connections, and their tunnels, within this period and
    /// the cache's lifetime.
    #[serde(with = "humantime_serde")]
    pub poll_period: Duration,
}

impl Default for AgentConfiguration {
    fn default() -> Self {
        AgentConfiguration {
            poll_period: Duration::from_secs(20),
        }
    }
}

/// `agent.kubernetes_api:`
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KubernetesApi {
    /// Where kubectl connects (HTTP/1.1 and HTTP/2; TLS with `certificate_file` and
    /// `key_file`). Default `0.0.0.0:8154`.
    pub listen: Listen,
    /// The path under which the Kubernetes API is served, as in GitLab's kas (`/`, or
    /// e.g. `/-/kubernetes-agent/k8s-proxy/` behind GitLab's own proxy).
    pub url_path_prefix: String,
    /// Static user and CI job tokens (YAML), for local runs; when unset, tokens are
    /// checked through `gitlab`.
    pub tokens_file: Option<PathBuf>,
    /// How long a request waits for its agent to be reachable before it is answered
    /// 503; a request's own `?timeout=` shortens it.
    #[serde(with = "humantime_serde")]
    pub routing_timeout: Duration,
    /// Requests one caller token may have open at once on this kas, whatever agents they
    /// name (watches, logs and exec sessions included); beyond it a request is answered
    /// 429.
    pub max_requests_per_token: usize,
    /// Requests one caller token may have open at once on this kas to one agent: well
    /// below the tunnels one agentk replica opens (100), so that no caller can take every
    /// tunnel of an agent from the others; beyond it a request is answered 429.
    pub max_requests_per_token_per_agent: usize,
    /// An upgraded stream (exec, attach, port-forward) on which nothing passes either way
    /// for this long is ended, freeing its tunnel (the kubelet's
    /// `streaming-connection-idle-timeout`).
    #[serde(with = "humantime_serde")]
    pub streaming_idle_timeout: Duration,
    /// The audit log: one JSON line per request this kas received (off when unset).
    pub audit: Option<Audit>,
}

/// `agent.kubernetes_api.audit:`
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Audit {
    /// The file the lines are appended to, or `stdout` (`./stdout` for a file so named).
    pub path: PathBuf,
    /// The size, in bytes, past which the file is rotated: renamed to `PATH.1` (the older
    /// ones shifting to `PATH.2` and on) and a new one started.
    #[serde(default = "default_audit_max_size")]
    pub max_size: u64,
    /// How many rotated files are kept; the oldest beyond it is deleted.
    #[serde(default = "default_audit_max_files")]
    pub max_files: usize,
}

fn default_audit_max_size() -> u64 {
    100 << 20
}

fn default_audit_max_files() -> usize {
    5
}

impl Audit {
    /// True when the lines go to standard output.
    pub fn to_stdout(&self) -> bool {
        self.path.as_os_str() == "stdout"
    }
}

impl Default for KubernetesApi {
    fn default() -> Self {
        KubernetesApi {
            listen: Listen {
                address: SocketAddr::from(([0, 0, 0, 0], 8154)),
                ..listen(8154)
            },
            url_path_prefix: "/".into(),
            tokens_file: None,
            routing_timeout: Duration::from_secs(20),
            max_requests_per_token: 500,
            max_requests_per_token_per_agent: 32,
            streaming_idle_timeout: Duration::from_secs(15 * 60),
            audit: None,
        }
    }
}

/// `api:`
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Api {
    /// Where GitLab connects; `authentication_secret_file` is GitLab's shared secret.
    pub listen: Listen,
    /// Deadline of a call that carries no `grpc-timeout`.
    #[serde(with = "humantime_serde")]
    pub default_timeout: Duration,
    /// Longest deadline honoured.
    #[serde(with = "humantime_serde")]
    pub max_timeout: Duration,
    /// Longest lifetime of GitLab's JWTs accepted (`exp` - `iat`, and `exp` - now).
    #[serde(with = "humantime_serde")]
    pub max_token_lifetime: Duration,
}

/// `private_api:`
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrivateApi {
    /// Where other kas connect; `authentication_secret_file` is shared by kas only.
    pub listen: Listen,
    /// Address other kas use to reach this one (default: `listen.address`, with the port
    /// actually bound when that is 0); it is also this kas's id in the registry. It may
    /// carry its scheme, as GitLab's `OWN_PRIVATE_API_URL` does: `grpcs://10.0.0.12:8155`
    /// must then match a private listener serving TLS, `grpc://` one that does not.
    pub advertise_address: Option<PrivateAddress>,
    /// Longest lifetime of other kas's JWTs accepted.
    #[serde(with = "humantime_serde")]
    pub max_token_lifetime: Duration,
}

/// `private_api.advertise_address`: `host:port`, or `grpc://` or `grpcs://` before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrivateAddress {
    /// The address.
    pub addr: SocketAddr,
    /// Whether the scheme said TLS (`grpcs://`), did not (`grpc://`), or was left out.
    pub tls: Option<bool>,
}

impl From<SocketAddr> for PrivateAddress {
    fn from(addr: SocketAddr) -> Self {
        PrivateAddress { addr, tls: None }
    }
}

impl std::str::FromStr for PrivateAddress {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (tls, rest) = match s.split_once("://") {
            None => (None, s),
            Some(("grpc", rest)) => (Some(false), rest),
            Some(("grpcs", rest)) => (Some(true), rest),
            Some((scheme, _)) => {
                return Err(format!("{s}: {scheme}:// is neither grpc:// nor grpcs://"));
            }
        };
        let addr = rest
            .parse()
            .map_err(|e| format!("{s}: not an IP address and port: {e}"))?;
        Ok(PrivateAddress { addr, tls })
    }
}

impl<'de> Deserialize<'de> for PrivateAddress {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// `observability:`
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Observability {
    /// `/metrics`, `/liveness`, `/readiness`.
    pub listen: Listen,
    /// Traces of calls, exported over OTLP/HTTP (off when unset).
    pub tracing: Option<Tracing>,
}

/// `observability.tracing:` (GitLab kas's keys, and a sampling ratio).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tracing {
    /// The collector's OTLP/HTTP traces URL, e.g. `https://collector:4318/v1/traces`.
    pub otlp_endpoint: String,
    /// A file holding the token sent as `Private-Token` with each export.
    #[serde(default)]
    pub otlp_token_secret_file: Option<PathBuf>,
    /// PEM CA certificates trusted for an `https` endpoint (the system's without).
    #[serde(default)]
    pub otlp_ca_certificate_file: Option<PathBuf>,
    /// The share of new traces recorded, 0 to 1; a caller's `traceparent` sampled flag is
    /// followed.
    #[serde(default = "default_sampling_ratio")]
    pub sampling_ratio: f64,
}

fn default_sampling_ratio() -> f64 {
    1.0
}

#[cfg(not(madsim))]
impl Tracing {
    /// The exporter's settings, the token read from its file.
    pub fn export(&self) -> Result<kas_transport::traces::Export, String> {
        let token = match &self.otlp_token_secret_file {
            Some(f) => Some(
                std::fs::read_to_string(f)
                    .map_err(|e| {
                        format!(
                            "observability.tracing.otlp_token_secret_file: {}: {e}",
                            f.display()
                        )
                    })?
                    .trim()
                    .to_string(),
            ),
            None => None,
        };
        Ok(kas_transport::traces::Export {
            endpoint: self.otlp_endpoint.clone(),
            token,
            ca_file: self.otlp_ca_certificate_file.clone(),
            sampling_ratio: self.sampling_ratio,
        })
    }
}

/// A listener.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Listen {
    /// `host:port` (IP literal).
    pub address: SocketAddr,
    /// JWT secret file, where the listener checks tokens.
    #[serde(default)]
    pub authentication_secret_file: Option<PathBuf>,
    /// HTTP/2 `SETTINGS_MAX_CONCURRENT_STREAMS`: calls (or tunnels) open at once on one
    /// connection; clients queue beyond it.
    #[serde(default = "default_max_concurrent_streams")]
    pub max_concurrent_streams: u32,
    /// A new connection that has not sent its first request (HTTP/2 preface or an HTTP
    /// request line) within this long is closed.
    #[serde(default = "default_handshake_timeout", with = "humantime_serde")]
    pub handshake_timeout: Duration,
    /// On a listener with TLS or WebSocket: a new connection that has sent nothing within
    /// this long is closed, before its handshake starts.
    #[serde(default = "default_first_byte_timeout", with = "humantime_serde")]
    pub first_byte_timeout: Duration,
    /// On a listener with TLS or WebSocket: connections from one IP address in their
    /// handshakes at once; more are closed as soon as they are accepted (the listener
    /// takes at most 1024 at once in all).
    #[serde(default = "default_max_handshakes_per_address")]
    pub max_handshakes_per_address: usize,
    /// kas pings an idle connection this often and closes it when a ping is not answered
    /// within `keepalive_timeout` (HTTP/2). On the observability listener (HTTP/1.1), a
    /// connection silent for `keepalive_interval` while kas waits for a request is closed.
    #[serde(default = "default_keepalive_interval", with = "humantime_serde")]
    pub keepalive_interval: Duration,
    /// See `keepalive_interval`.
    #[serde(default = "default_keepalive_timeout", with = "humantime_serde")]
    pub keepalive_timeout: Duration,
    /// `agent.listen` only: `GetConfiguration` and `OpenTunnel` requests one agent token
    /// may make per minute (GitLab's key); beyond it they are refused with
    /// `ResourceExhausted`. Default 1000.
    #[serde(default)]
    pub connections_per_token_per_minute: Option<u32>,
    /// `agent.listen` only: an agent connection older than this (jittered by up to a
    /// tenth, so that agents connected together do not move together) is asked to move:
    /// the agent connects again, then lets the old connection's calls finish and closes
    /// it, so that agents spread over kas replicas added since. GitLab's key; default 2h.
    #[serde(default, deserialize_with = "some_duration")]
    pub max_connection_age: Option<Duration>,
    /// PEM certificate chain (leaf first) this listener serves: TLS (1.2 and 1.3) is on
    /// iff both this and `key_file` are set. Both files are re-read when they change.
    #[serde(default)]
    pub certificate_file: Option<PathBuf>,
    /// PEM private key of `certificate_file`.
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// `private_api.listen` only: PEM CA certificates that the other kas's private
    /// listener certificates must chain to, when they serve TLS (default: the system's
    /// roots).
    #[serde(default)]
    pub ca_certificate_file: Option<PathBuf>,
    /// `agent.kubernetes_api.listen` only: a connection with no request open must send a
    /// whole request head within this long of its first byte (nginx's
    /// `client_header_timeout`; a shorter default, hyper's).
    #[serde(default = "default_request_head_timeout", with = "humantime_serde")]
    pub request_head_timeout: Duration,
    /// `agent.kubernetes_api.listen` only: a connection with no request open and silent
    /// this long is closed (nginx's `keepalive_timeout`). Open watches and upgraded
    /// streams are judged by HTTP/2 pings and `agent.kubernetes_api.streaming_idle_timeout`.
    #[serde(default = "default_idle_timeout", with = "humantime_serde")]
    pub idle_timeout: Duration,
    /// `agent.listen` only: also accept agents whose gRPC comes inside a WebSocket
    /// (agentk's `wss://`/`ws://`, through proxies that pass only HTTP/1.1). Plain gRPC
    /// is still accepted on the same port.
    #[serde(default)]
    pub websocket: bool,
}

impl Listen {
    /// The certificate and key files when this listener serves TLS.
    pub fn tls(&self) -> Option<(&std::path::Path, &std::path::Path)> {
        Some((self.certificate_file.as_deref()?, self.key_file.as_deref()?))
    }
}

impl Agent {
    /// `agent.listen.connections_per_token_per_minute`, or its default.
    pub fn connections_per_token_per_minute(&self) -> u32 {
        self.listen.connections_per_token_per_minute.unwrap_or(1000)
    }

    /// `agent.listen.max_connection_age`, or its default.
    pub fn max_connection_age(&self) -> Duration {
        self.listen
            .max_connection_age
            .unwrap_or(Duration::from_secs(2 * 3600))
    }
}

/// A duration (`90s`, `2h`) of a key that is unset unless given.
fn some_duration<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    humantime_serde::deserialize(d).map(Some)
}

fn default_max_concurrent_streams() -> u32 {
    1000
}

fn default_handshake_timeout() -> Duration {
    Duration::from_secs(10)
}

fn default_first_byte_timeout() -> Duration {
    Duration::from_secs(3)
}

fn default_max_handshakes_per_address() -> usize {
    64
}

fn default_request_head_timeout() -> Duration {
    Duration::from_secs(30)
}

fn default_idle_timeout() -> Duration {
    Duration::from_secs(40)
}

fn default_keepalive_interval() -> Duration {
    Duration::from_secs(30)
}

fn default_keepalive_timeout() -> Duration {
    Duration::from_secs(20)
}

/// `redis:`
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Redis {
    /// One server. Exactly one of `server`, `sentinel` and `cluster` is set.
    #[serde(default)]
    pub server: Option<RedisServer>,
    /// A master found through Redis Sentinel, followed through failovers.
    #[serde(default)]
    pub sentinel: Option<RedisSentinel>,
    /// A Redis Cluster.
    #[serde(default)]
    pub cluster: Option<RedisCluster>,
    /// Prefix of every key and channel.
    #[serde(default = "default_key_prefix")]
    pub key_prefix: String,
    /// File holding the Redis password (AUTH), if any.
    #[serde(default)]
    pub password_file: Option<PathBuf>,
    /// Redis 6+ ACL user that `password_file`'s password belongs to (default: Redis's
    /// `default` user).
    #[serde(default)]
    pub username: Option<String>,
    /// TLS to Redis.
    #[serde(default)]
    pub tls: RedisTls,
    /// Timeout of one Redis command or connection attempt.
    #[serde(default = "default_redis_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// Wake waiting calls through pub-sub tunnel events (default). `false` leaves only the
    /// backoff poll: for measurements and tests, never for production.
    #[serde(default = "default_true")]
    pub pubsub_wakeups: bool,
    /// How long kas keeps an agent's tunnel-event subscription after the agent's last
    /// call, and with it the kas known to hold its tunnels: calls within it skip the Redis
    /// lookup. `0s` unsubscribes at once.
    #[serde(default = "default_subscription_linger", with = "humantime_serde")]
    pub subscription_linger: Duration,
}

/// `redis.tls:`
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisTls {
    /// Connect with TLS (`rediss://`).
    #[serde(default)]
    pub enabled: bool,
    /// PEM CA certificates Redis's certificate must chain to (default: the system's roots).
    #[serde(default)]
    pub ca_certificate_file: Option<PathBuf>,
    /// PEM client certificate, for a Redis that checks clients' (`tls-auth-clients yes`).
    #[serde(default)]
    pub certificate_file: Option<PathBuf>,
    /// PEM private key of `certificate_file`.
    #[serde(default)]
    pub key_file: Option<PathBuf>,
}

pub use kas_transport::DEFAULT_MAX_MESSAGE_SIZE;

/// `redis.subscription_linger`'s default.
const DEFAULT_SUBSCRIPTION_LINGER: Duration = Duration::from_secs(60);

fn default_subscription_linger() -> Duration {
    DEFAULT_SUBSCRIPTION_LINGER
}

fn default_true() -> bool {
    true
}

/// `redis.server:`
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisServer {
    /// `host:port`.
    pub address: String,
}

/// `redis.sentinel:` (GitLab kas's keys).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisSentinel {
    /// The name the sentinels monitor the master under.
    pub master_name: String,
    /// The sentinels, `host:port` each; asked in turn for the master's address.
    pub addresses: Vec<String>,
    /// File holding the sentinels' password, if they require one.
    #[serde(default)]
    pub sentinel_password_file: Option<PathBuf>,
}

/// `redis.cluster:`
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisCluster {
    /// Some of the cluster's nodes, `host:port` each: the rest are discovered from them.
    pub addresses: Vec<String>,
}

fn default_key_prefix() -> String {
    "gitlab-kas".into()
}

fn default_redis_timeout() -> Duration {
    Duration::from_secs(5)
}

fn listen(port: u16) -> Listen {
    Listen {
        address: SocketAddr::from(([127, 0, 0, 1], port)),
        authentication_secret_file: None,
        max_concurrent_streams: default_max_concurrent_streams(),
        handshake_timeout: default_handshake_timeout(),
        first_byte_timeout: default_first_byte_timeout(),
        max_handshakes_per_address: default_max_handshakes_per_address(),
        keepalive_interval: default_keepalive_interval(),
        keepalive_timeout: default_keepalive_timeout(),
        request_head_timeout: default_request_head_timeout(),
        idle_timeout: default_idle_timeout(),
        connections_per_token_per_minute: None,
        max_connection_age: None,
        certificate_file: None,
        key_file: None,
        ca_certificate_file: None,
        websocket: false,
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            gitlab: None,
            agent: Agent::default(),
            api: Api::default(),
            private_api: PrivateApi::default(),
            observability: Observability::default(),
            redis: None,
            shutdown_grace: Duration::from_secs(10),
        }
    }
}

impl Default for Agent {
    fn default() -> Self {
        Agent {
            listen: listen(8150),
            max_connections_per_agent: 100,
            max_tunnels_per_connection: 200,
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            token_lookups_per_second: 100,
            token_lookups_per_second_per_address: 10,
            info_cache_stale_ttl: Duration::from_secs(3600),
            tokens_file: None,
            info_cache_ttl: Duration::from_secs(300),
            info_cache_error_ttl: Duration::from_secs(60),
            redis_conn_info_ttl: Duration::from_secs(300),
            redis_conn_info_refresh: Duration::from_secs(240),
            redis_conn_info_gc: Duration::from_secs(600),
            heartbeat_timeout: Duration::from_secs(60),
            kas_liveness_ttl: Duration::from_secs(30),
            kubernetes_api: None,
            configuration: AgentConfiguration::default(),
        }
    }
}

impl Default for Api {
    fn default() -> Self {
        Api {
            listen: listen(8153),
            default_timeout: Duration::from_secs(30),
            max_timeout: Duration::from_secs(600),
            max_token_lifetime: kas_auth::jwt::DEFAULT_MAX_TOKEN_LIFETIME,
        }
    }
}

impl Default for PrivateApi {
    fn default() -> Self {
        PrivateApi {
            listen: listen(8155),
            advertise_address: None,
            max_token_lifetime: kas_auth::jwt::DEFAULT_MAX_TOKEN_LIFETIME,
        }
    }
}

impl Default for Observability {
    fn default() -> Self {
        Observability {
            listen: listen(8151),
            tracing: None,
        }
    }
}

/// Why a configuration was rejected: one line per problem, each naming its key.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration {file}:\n  - {}", problems.join("\n  - "))]
pub struct ConfigError {
    /// The file (or `<defaults>`).
    pub file: String,
    /// Every problem found.
    pub problems: Vec<String>,
}

impl Config {
    /// Reads, parses and validates a configuration file; `advertise_address`, when given
    /// (from the environment), replaces `private_api.advertise_address` before validation.
    pub fn load(
        path: &Path,
        advertise_address: Option<PrivateAddress>,
    ) -> Result<Config, ConfigError> {
        let file = path.display().to_string();
        let fail = |p: String| ConfigError {
            file: file.clone(),
            problems: vec![p],
        };
        let text = std::fs::read_to_string(path).map_err(|e| fail(format!("cannot read: {e}")))?;
        Self::parse_with(&text, &file, advertise_address)
    }

    /// Parses and validates YAML text; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Config, ConfigError> {
        Self::parse_with(text, file, None)
    }

    fn parse_with(
        text: &str,
        file: &str,
        advertise_address: Option<PrivateAddress>,
    ) -> Result<Config, ConfigError> {
        let mut config: Config = if text.trim().is_empty() {
            Config::default()
        } else {
            serde_path_to_error::deserialize(serde_yaml::Deserializer::from_str(text)).map_err(
                |e| ConfigError {
                    file: file.into(),
                    problems: vec![yaml_problem(&e)],
                },
            )?
        };
        if advertise_address.is_some() {
            config.private_api.advertise_address = advertise_address;
        }
        config.validate().map_err(|problems| ConfigError {
            file: file.into(),
            problems,
        })?;
        Ok(config)
    }

    /// The address other kas reach this one on, which is also its registry id.
    pub fn advertise_address(&self) -> SocketAddr {
        self.private_api
            .advertise_address
            .map_or(self.private_api.listen.address, |a| a.addr)
    }

    fn validate(&self) -> Result<(), Vec<String>> {
        let mut p = Vec::new();
        self.check_nonzero(&mut p);
        self.check_listeners(&mut p);
        self.check_timings_and_secrets(&mut p);
        self.check_kubernetes_api(&mut p);
        self.check_tracing(&mut p);
        self.check_sockets(&mut p);
        self.check_agent_auth(&mut p);
        self.check_redis(&mut p);
        if p.is_empty() { Ok(()) } else { Err(p) }
    }

    /// Durations and counts that must not be zero.
    fn check_nonzero(&self, p: &mut Vec<String>) {
        let a = &self.agent;
        for (key, d) in [
            ("agent.redis_conn_info_ttl", a.redis_conn_info_ttl),
            ("agent.redis_conn_info_refresh", a.redis_conn_info_refresh),
            ("agent.redis_conn_info_gc", a.redis_conn_info_gc),
            ("agent.heartbeat_timeout", a.heartbeat_timeout),
            ("agent.kas_liveness_ttl", a.kas_liveness_ttl),
            (
                "agent.configuration.poll_period",
                a.configuration.poll_period,
            ),
            ("api.default_timeout", self.api.default_timeout),
            ("api.max_token_lifetime", self.api.max_token_lifetime),
            (
                "private_api.max_token_lifetime",
                self.private_api.max_token_lifetime,
            ),
        ] {
            if d.is_zero() {
                p.push(format!("{key} must be greater than zero"));
            }
        }
        for (key, n) in [
            (
                "agent.max_connections_per_agent",
                a.max_connections_per_agent,
            ),
            (
                "agent.max_tunnels_per_connection",
                a.max_tunnels_per_connection,
            ),
            ("agent.max_message_size", a.max_message_size),
            (
                "agent.token_lookups_per_second",
                a.token_lookups_per_second as usize,
            ),
            (
                "agent.token_lookups_per_second_per_address",
                a.token_lookups_per_second_per_address as usize,
            ),
            (
                "agent.listen.connections_per_token_per_minute",
                a.connections_per_token_per_minute() as usize,
            ),
        ] {
            if n == 0 {
                p.push(format!("{key} must be greater than zero"));
            }
        }
    }

    /// Each listener's TLS files and settings.
    fn check_listeners(&self, p: &mut Vec<String>) {
        let a = &self.agent;
        let kube = a.kubernetes_api.as_ref();
        let kube_listen = kube.map(|k| ("agent.kubernetes_api.listen", &k.listen));
        for (key, c) in [
            ("agent.listen", &a.listen),
            ("api.listen", &self.api.listen),
            ("private_api.listen", &self.private_api.listen),
            ("observability.listen", &self.observability.listen),
        ]
        .into_iter()
        .chain(kube_listen)
        {
            match (&c.certificate_file, &c.key_file) {
                (Some(_), None) => p.push(format!(
                    "{key}.key_file is required with {key}.certificate_file"
                )),
                (None, Some(_)) => p.push(format!(
                    "{key}.certificate_file is required with {key}.key_file"
                )),
                #[cfg(not(madsim))]
                (Some(cert), Some(k)) => {
                    if let Err(e) = kas_transport::tls::ServerCert::load(cert, k) {
                        p.push(format!("{key}: {e}"));
                    }
                }
                #[cfg(madsim)]
                (Some(_), Some(_)) => p.push(format!("{key}: TLS is not simulated")),
                (None, None) => {}
            }
            if let Some(ca) = &c.ca_certificate_file {
                if key != "private_api.listen" {
                    p.push(format!(
                        "{key}.ca_certificate_file applies to private_api.listen only"
                    ));
                }
                if let Err(e) = kas_transport::tls::read_certificates(ca) {
                    p.push(format!("{key}.ca_certificate_file: {e}"));
                }
            }
            if key != "agent.listen" && c.websocket {
                p.push(format!("{key}.websocket applies to agent.listen only"));
            }
            #[cfg(madsim)]
            if c.websocket {
                p.push(format!("{key}.websocket: WebSocket is not simulated"));
            }
            if key != "agent.listen" && c.connections_per_token_per_minute.is_some() {
                p.push(format!(
                    "{key}.connections_per_token_per_minute applies to agent.listen only"
                ));
            }
            match c.max_connection_age {
                Some(_) if key != "agent.listen" => p.push(format!(
                    "{key}.max_connection_age applies to agent.listen only"
                )),
                Some(age) if age < Duration::from_secs(1) => p.push(format!(
                    "{key}.max_connection_age must be at least 1s (agents would move without end)"
                )),
                _ => {}
            }
            if c.max_concurrent_streams == 0 {
                p.push(format!(
                    "{key}.max_concurrent_streams must be greater than zero"
                ));
            }
            for (name, d) in [
                ("handshake_timeout", c.handshake_timeout),
                ("keepalive_interval", c.keepalive_interval),
                ("keepalive_timeout", c.keepalive_timeout),
            ] {
                if d.is_zero() {
                    p.push(format!("{key}.{name} must be greater than zero"));
                }
            }
        }
    }

    /// Timings that must be ordered, and the API secrets.
    fn check_timings_and_secrets(&self, p: &mut Vec<String>) {
        let a = &self.agent;
        if a.redis_conn_info_refresh >= a.redis_conn_info_ttl {
            p.push(format!(
                "agent.redis_conn_info_refresh ({}) must be less than agent.redis_conn_info_ttl ({}), or records expire before they are refreshed",
                humantime::format_duration(a.redis_conn_info_refresh),
                humantime::format_duration(a.redis_conn_info_ttl)
            ));
        }
        if self.api.max_timeout < self.api.default_timeout {
            p.push("api.max_timeout must not be less than api.default_timeout".into());
        }
        for (key, l) in [
            ("api.listen", &self.api.listen),
            ("private_api.listen", &self.private_api.listen),
        ] {
            match &l.authentication_secret_file {
                None => p.push(format!("{key}.authentication_secret_file is required")),
                Some(f) => {
                    if let Err(e) = kas_auth::jwt::Secret::load(f) {
                        p.push(format!("{key}.authentication_secret_file: {e}"));
                    }
                }
            }
        }
    }

    /// `observability.tracing`.
    fn check_tracing(&self, p: &mut Vec<String>) {
        let Some(t) = &self.observability.tracing else {
            return;
        };
        match t.otlp_endpoint.parse::<http::Uri>() {
            Ok(u) if matches!(u.scheme_str(), Some("http" | "https")) => {}
            _ => p.push(format!(
                "observability.tracing.otlp_endpoint {:?} is not an http:// or https:// URL",
                t.otlp_endpoint
            )),
        }
        if !(0.0..=1.0).contains(&t.sampling_ratio) {
            p.push(format!(
                "observability.tracing.sampling_ratio {} is not between 0 and 1",
                t.sampling_ratio
            ));
        }
        if let Some(f) = &t.otlp_token_secret_file
            && let Err(e) = std::fs::read_to_string(f)
        {
            p.push(format!(
                "observability.tracing.otlp_token_secret_file: {}: {e}",
                f.display()
            ));
        }
    }

    /// The Kubernetes API proxy's section.
    fn check_kubernetes_api(&self, p: &mut Vec<String>) {
        let kube = self.agent.kubernetes_api.as_ref();
        if let Some(k) = kube {
            if !k.url_path_prefix.starts_with('/') {
                p.push(format!(
                    "agent.kubernetes_api.url_path_prefix {:?} must start with /",
                    k.url_path_prefix
                ));
            }
            if k.routing_timeout.is_zero() {
                p.push("agent.kubernetes_api.routing_timeout must be greater than zero".into());
            }
            if k.max_requests_per_token == 0 {
                p.push(
                    "agent.kubernetes_api.max_requests_per_token must be greater than zero".into(),
                );
            }
            if let Some(a) = &k.audit {
                if a.max_size < 4096 {
                    p.push(format!(
                        "agent.kubernetes_api.audit.max_size {} is below 4096 bytes",
                        a.max_size
                    ));
                }
                if a.path.as_os_str().is_empty() {
                    p.push("agent.kubernetes_api.audit.path is empty".into());
                }
            }
            match &k.tokens_file {
                Some(f) => {
                    if let Err(e) = kas_auth::user_tokens::StaticUserTokens::load(f) {
                        p.push(format!("agent.kubernetes_api.tokens_file: {e}"));
                    }
                }
                None if self.gitlab.is_none() => p.push(
                    "agent.kubernetes_api needs tokens_file or gitlab to check its callers' tokens"
                        .into(),
                ),
                None => {}
            }
        }
    }

    /// Listener addresses, each its own, and the address other kas dial.
    fn check_sockets(&self, p: &mut Vec<String>) {
        let kube = self.agent.kubernetes_api.as_ref();
        let kube_address = kube.map(|k| ("agent.kubernetes_api.listen.address", k.listen.address));
        let listeners = [
            ("agent.listen.address", self.agent.listen.address),
            ("api.listen.address", self.api.listen.address),
            (
                "private_api.listen.address",
                self.private_api.listen.address,
            ),
            (
                "observability.listen.address",
                self.observability.listen.address,
            ),
        ];
        let listeners: Vec<_> = listeners.into_iter().chain(kube_address).collect();
        for (i, (k1, a1)) in listeners.iter().enumerate() {
            for (k2, a2) in &listeners[i + 1..] {
                if a1 == a2 && a1.port() != 0 {
                    p.push(format!(
                        "{k1} and {k2} are both {a1}: each listener needs its own socket"
                    ));
                }
            }
        }
        if let Some(PrivateAddress {
            addr,
            tls: Some(tls),
        }) = self.private_api.advertise_address
            && tls != self.private_api.listen.tls().is_some()
        {
            let (scheme, serves) = match tls {
                true => (
                    "grpcs",
                    "plaintext: set its certificate_file and key_file, or use grpc://",
                ),
                false => ("grpc", "TLS: use grpcs://"),
            };
            p.push(format!(
                "private_api.advertise_address {scheme}://{addr}: private_api.listen serves {serves}"
            ));
        }
        let adv = self.advertise_address();
        if adv.ip().is_unspecified() {
            p.push(format!(
                "private_api.advertise_address is required when private_api.listen.address is {} (other kas cannot dial it)",
                self.private_api.listen.address
            ));
        }
    }

    /// How agents are authenticated: a tokens file, or GitLab.
    fn check_agent_auth(&self, p: &mut Vec<String>) {
        let a = &self.agent;
        match (&a.tokens_file, &self.gitlab) {
            (Some(f), _) => {
                if let Err(e) = kas_auth::agent_auth::StaticTokens::load(f) {
                    p.push(format!("agent.tokens_file: {e}"));
                }
            }
            (None, None) => p.push(
                "agent.tokens_file or gitlab (address and authentication_secret_file) is required to authenticate agents".into(),
            ),
            (None, Some(g)) => {
                if !(g.address.starts_with("http://") || g.address.starts_with("https://")) {
                    p.push(format!(
                        "gitlab.address {:?} must start with http:// or https://",
                        g.address
                    ));
                }
                if let Err(e) = kas_auth::jwt::Secret::load(&g.authentication_secret_file) {
                    p.push(format!("gitlab.authentication_secret_file: {e}"));
                }
            }
        }
    }

    /// The `redis` section: one topology, its files, its TLS.
    fn check_redis(&self, p: &mut Vec<String>) {
        if let Some(r) = &self.redis {
            if r.key_prefix.is_empty() || r.key_prefix.contains(['{', '}', ' ']) {
                p.push(format!(
                    "redis.key_prefix {:?} must be non-empty without braces or spaces",
                    r.key_prefix
                ));
            }
            let set = [
                r.server.is_some(),
                r.sentinel.is_some(),
                r.cluster.is_some(),
            ];
            if set.iter().filter(|s| **s).count() != 1 {
                p.push("redis: set exactly one of server, sentinel and cluster".into());
            }
            if r.server.as_ref().is_some_and(|s| s.address.is_empty()) {
                p.push("redis.server.address is required".into());
            }
            if let Some(s) = &r.sentinel {
                if s.master_name.is_empty() {
                    p.push("redis.sentinel.master_name is required".into());
                }
                if s.addresses.is_empty() || s.addresses.iter().any(String::is_empty) {
                    p.push(
                        "redis.sentinel.addresses: list at least one sentinel, none empty".into(),
                    );
                }
                if let Some(f) = &s.sentinel_password_file
                    && let Err(e) = std::fs::read_to_string(f)
                {
                    p.push(format!(
                        "redis.sentinel.sentinel_password_file {}: {e}",
                        f.display()
                    ));
                }
            }
            if let Some(c) = &r.cluster
                && (c.addresses.is_empty() || c.addresses.iter().any(String::is_empty))
            {
                p.push("redis.cluster.addresses: list at least one node, none empty".into());
            }
            if let Some(f) = &r.password_file
                && let Err(e) = std::fs::read_to_string(f)
            {
                p.push(format!("redis.password_file {}: {e}", f.display()));
            }
            if r.username.as_deref().is_some_and(str::is_empty) {
                p.push("redis.username must not be empty when set".into());
            }
            let t = &r.tls;
            let files = [
                ("ca_certificate_file", &t.ca_certificate_file),
                ("certificate_file", &t.certificate_file),
                ("key_file", &t.key_file),
            ];
            for (key, file) in files {
                match file {
                    Some(_) if !t.enabled => p.push(format!(
                        "redis.tls.{key} is set but redis.tls.enabled is false"
                    )),
                    Some(f) if key != "key_file" => {
                        if let Err(e) = kas_transport::tls::read_certificates(f) {
                            p.push(format!("redis.tls.{key}: {e}"));
                        }
                    }
                    _ => {}
                }
            }
            if t.certificate_file.is_some() != t.key_file.is_some() {
                p.push("redis.tls.certificate_file and redis.tls.key_file go together".into());
            }
        }
    }
}

/// A YAML error with the dotted path of the key at fault and its line, when known.
fn yaml_problem(e: &serde_path_to_error::Error<serde_yaml::Error>) -> String {
    let path = e.path().to_string();
    let inner = e.inner();
    let at = match inner.location() {
        Some(l) => format!(" (line {})", l.line()),
        None => String::new(),
    };
    let message = inner.to_string();
    // serde_yaml appends its own "at line N column M"; the path says more.
    let message = message.split(" at line ").next().unwrap_or(&message);
    if path == "." {
        format!("{message}{at}")
    } else {
        format!("{path}: {message}{at}")
    }
}

/// Durations written as `300s`, `5m`, `250ms`.
mod humantime_serde {
    use serde::{Deserialize, Deserializer};
    use std::time::Duration;

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(&s).map_err(|e| {
            serde::de::Error::custom(format!(
                "invalid duration {s:?} ({e}); write e.g. \"300s\", \"5m\" or \"250ms\""
            ))
        })
    }
}

#[cfg(test)]
mod tests;
