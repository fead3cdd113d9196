//! The kas server: four listeners around the engine that drives the core machines.
//!
//! [`Kas::start`] binds every listener and starts serving; [`Kas::stop`] shuts down
//! gracefully, make-before-break: not ready, no new calls, and agents are asked to move
//! (they connect to another kas first, then close their connections here once their
//! running calls finish). Once every call and agent is gone, or `shutdown_grace` has
//! passed, the rest is cut off and this kas's registry records are deleted.

mod agent_api;
mod agent_version;
mod call;
pub mod correlation;
mod deadline;
mod engine;
mod forward;
mod handle;
pub mod kubernetes_api;
mod limits;
mod listener;
mod live_kas;
mod metrics;
pub mod observability;
mod peers;
mod private_api;
mod public_api;
mod replicas;
mod reply;
mod route_spans;
mod stopping;
pub mod timing;
mod tunnel;

pub use deadline::parse_grpc_timeout;
pub use peers::SILENT_WITHIN;
pub use public_api::{PODS_LIST, PODS_LOGS};

use crate::config::{Config, Listen};
#[cfg(not(madsim))]
use crate::store::MemoryStore;
use crate::store::Store;
use kas_auth::agent_auth::{
    AgentAuth, AgentIdentity, CachePolicy, Fetch, GitLabClient, StaticTokens, TokenCache,
};
use kas_auth::jwt::{self, Secret, Signer, Verifier};
use kas_core::KasId;
use kas_core::keys::Keys;
use kas_core::node::{KasNode, NodeConfig, NodeInput, NodeStats};
use kas_core::router::RouterConfig;
use kas_core::tracker::TrackerConfig;
use kas_core::tunnel_registry::RegistryConfig;
use kas_proto::agent_api::agent_api_server::AgentApiServer;
use kas_proto::private_api::kas_private_server::KasPrivateServer;
use kas_proto::public_api::kas_api_server::KasApiServer;
use kas_proto::registry::{KasAddress, KasInstanceInfo};
use kas_transport::clock;
use kas_transport::tls::{ALPN_GRPC, ALPN_GRPC_OR_HTTP1, ALPN_HTTP1};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use stopping::{Phase, Stop, Stopping};
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tonic::service::Interceptor;
use tonic::transport::Server;
use tonic::transport::server::Router;
use tonic::{Request, Status};

/// Why kas could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A listener could not bind.
    #[error("cannot listen on {what} {addr}: {source}")]
    Bind {
        /// Which listener.
        what: &'static str,
        /// Its address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// Anything else in the configuration that only shows at start.
    #[error("{0}")]
    Setup(String),
}

/// The bound addresses of a running kas.
#[derive(Clone, Copy, Debug)]
pub struct Addresses {
    /// agentk -> kas.
    pub agent: SocketAddr,
    /// GitLab -> kas.
    pub api: SocketAddr,
    /// kas -> kas (also this kas's id).
    pub private_api: SocketAddr,
    /// Metrics and probes.
    pub observability: SocketAddr,
    /// kubectl -> kas, when `agent.kubernetes_api` is set.
    pub kubernetes_api: Option<SocketAddr>,
}

/// A running kas.
pub struct Kas {
    /// Where it listens.
    pub addresses: Addresses,
    engine: handle::EngineHandle,
    /// The node's sizes.
    stats: watch::Receiver<NodeStats>,
    stopping: Stopping,
    calls_server: JoinHandle<()>,
    agents_server: JoinHandle<()>,
    observability_server: JoinHandle<()>,
    /// The Kubernetes API audit log, closed once every call has ended or been cut off.
    audit: Option<kubernetes_api::AuditLog>,
    grace: Duration,
    health: observability::Health,
}

/// A gRPC server with `listen`'s per-connection limits.
fn server(listen: &Listen) -> Server {
    Server::builder()
        .tcp_nodelay(true)
        .max_concurrent_streams(listen.max_concurrent_streams)
        .max_frame_size(kas_transport::MAX_FRAME_SIZE)
        .http2_keepalive_interval(Some(listen.keepalive_interval))
        .http2_keepalive_timeout(Some(listen.keepalive_timeout))
}

/// How one listener takes its connections.
struct Listening {
    /// `listen.handshake_timeout` and the other handshake limits.
    #[cfg(not(madsim))] // madsim's tonic accepts by itself
    handshake: listener::HandshakeLimits,
    /// Its name in logs and metrics.
    #[cfg_attr(madsim, allow(dead_code))] // madsim's tonic accepts by itself
    what: &'static str,
    #[cfg_attr(madsim, allow(dead_code))]
    metrics: metrics::Metrics,
    /// Its TLS configuration when it serves TLS.
    tls: Option<Arc<rustls::ServerConfig>>,
    /// Whether it also takes gRPC inside WebSocket connections.
    #[cfg_attr(madsim, allow(dead_code))] // refused by the configuration check
    websocket: bool,
}

/// The TLS configuration of listener `what` (`<what>.listen`) when `listen` sets a
/// certificate; its files are watched for as long as the listener holds it.
#[cfg(not(madsim))]
fn tls_config(
    listen: &Listen,
    what: &'static str,
    alpn: &[&[u8]],
) -> Result<Option<Arc<rustls::ServerConfig>>, StartError> {
    let Some((cert_file, key_file)) = listen.tls() else {
        return Ok(None);
    };
    let setup = |e: String| StartError::Setup(format!("{what}.listen: {e}"));
    let cert = kas_transport::tls::ServerCert::load(cert_file, key_file).map_err(setup)?;
    tokio::spawn(kas_transport::tls::watch(Arc::downgrade(&cert), what));
    Ok(Some(Arc::new(
        kas_transport::tls::server_config(cert, alpn).map_err(setup)?,
    )))
}

/// In the simulation no listener serves TLS (the configuration check refuses it).
#[cfg(madsim)]
fn tls_config(
    _: &Listen,
    _: &'static str,
    _: &[&[u8]],
) -> Result<Option<Arc<rustls::ServerConfig>>, StartError> {
    Ok(None)
}

/// Serves `router` on `listener` until `signal` resolves; connections that send no HTTP/2
/// preface (or do not finish their TLS handshake) within `listen.handshake_timeout` are
/// closed.
#[cfg(not(madsim))]
async fn serve(
    router: tonic::transport::server::Router,
    listener: TcpListener,
    l: Listening,
    signal: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let guard = listener::Guard::Http2Preface(l.handshake.timeout);
    let acceptor = listener::Acceptor::new(listener, guard, l.what, l.metrics);
    if l.tls.is_none() && !l.websocket {
        return router
            .serve_with_incoming_shutdown(acceptor.into_stream(), signal)
            .await;
    }
    let incoming = acceptor.handshaking(listener::Handshakes {
        tls: l.tls,
        websocket: l.websocket,
        limits: l.handshake,
    });
    router
        .serve_with_incoming_shutdown(incoming.into_stream(), signal)
        .await
}

/// Serves `router` on `listener`'s address until `signal` resolves (madsim's tonic binds
/// the address itself; in the simulation every node has its own address, so no one can
/// take it in between).
#[cfg(madsim)]
async fn serve(
    router: tonic::transport::server::Router,
    listener: TcpListener,
    _: Listening,
    signal: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let addr = listener
        .local_addr()
        .expect("a bound listener has an address");
    drop(listener);
    router.serve_with_shutdown(addr, signal).await
}

/// Checks the JWT of every call on a listener.
#[derive(Clone)]
struct JwtCheck {
    verifier: Verifier,
    listener: &'static str,
    /// The headers the token may come in, the first present read.
    headers: &'static [&'static str],
}

impl Interceptor for JwtCheck {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let header = self
            .headers
            .iter()
            .find_map(|h| req.metadata().get(*h))
            .and_then(|v| v.to_str().ok());
        self.verifier.check_bearer(header).map_err(|reason| {
            // Refused before a handler runs: the id is given here.
            let id = correlation::CorrelationId::of(req.metadata());
            tracing::info!(listener = self.listener, %reason, correlation_id = %id, "call refused");
            id.status(Status::unauthenticated(format!(
                "{} listener: {reason}",
                self.listener
            )))
        })?;
        Ok(req)
    }
}

async fn bind(what: &'static str, addr: SocketAddr) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Bind { what, addr, source })
}

/// Where `redis` says the Redis is (the configuration was checked: exactly one is set).
pub fn redis_topology(r: &crate::config::Redis) -> Result<crate::store::RedisTopology, StartError> {
    use crate::store::RedisTopology;
    if let Some(s) = &r.sentinel {
        return Ok(RedisTopology::Sentinel {
            master_name: s.master_name.clone(),
            addresses: s.addresses.clone(),
            password: password(
                s.sentinel_password_file.as_ref(),
                "redis.sentinel.sentinel_password_file",
            )?,
        });
    }
    if let Some(c) = &r.cluster {
        return Ok(RedisTopology::Cluster(c.addresses.clone()));
    }
    let address = r.server.as_ref().map(|s| s.address.clone());
    Ok(RedisTopology::Server(address.unwrap_or_default()))
}

/// The password in the file configured at `key`, if one is, without surrounding blanks.
fn password(path: Option<&std::path::PathBuf>, key: &str) -> Result<Option<String>, StartError> {
    path.map(|f| {
        std::fs::read_to_string(f)
            .map(|p| p.trim().to_string())
            .map_err(|e| StartError::Setup(format!("{key}: {e}")))
    })
    .transpose()
}

fn secret(path: Option<&std::path::PathBuf>, key: &str) -> Result<Secret, StartError> {
    let path = path.ok_or_else(|| StartError::Setup(format!("{key} is required")))?;
    Secret::load(path).map_err(|e| StartError::Setup(format!("{key}: {e}")))
}

/// The store `config` names: Redis (a server, Sentinel or a Cluster) when it has a `redis`
/// section, else this process's memory.
#[cfg(not(madsim))]
pub fn configured_store(config: &Config) -> Result<Store, StartError> {
    let Some(r) = &config.redis else {
        return Ok(Store::new(MemoryStore::default()));
    };
    let auth = crate::store::RedisAuth {
        username: r.username.clone(),
        password: password(r.password_file.as_ref(), "redis.password_file")?,
    };
    crate::store::RedisStore::new(&redis_topology(r)?, &auth, &r.tls, r.timeout)
        .map(Store::new)
        .map_err(|e| StartError::Setup(format!("redis: {e}")))
}

/// What the listeners of one kas share while it starts.
struct Shared<'a> {
    config: &'a Config,
    engine: &'a handle::EngineHandle,
    metrics: &'a metrics::Metrics,
    /// This kas.
    kas_id: &'a KasId,
    /// The kas's stop.
    stop: Stop,
}

impl Shared<'_> {
    /// How listener `what` accepts: `alpn` is what it speaks; an agent listener behind a
    /// proxy that passes only HTTP/1.1 also takes WebSocket upgrades.
    fn listening(
        &self,
        listen: &Listen,
        what: &'static str,
        alpn: &'static [&'static [u8]],
    ) -> Result<Listening, StartError> {
        let alpn = if listen.websocket {
            ALPN_GRPC_OR_HTTP1
        } else {
            alpn
        };
        Ok(Listening {
            #[cfg(not(madsim))]
            handshake: listener::HandshakeLimits::of(listen),
            what,
            metrics: self.metrics.clone(),
            tls: tls_config(listen, what, alpn)?,
            websocket: listen.websocket,
        })
    }

    /// Serves the calls' listeners (public, private, Kubernetes API) until kas starts
    /// stopping: they stop together, so no call starts during shutdown and running ones
    /// finish. With them, the Kubernetes API audit log when it is on.
    fn serve_calls(
        &self,
        public: Router,
        private: Router,
        api_l: TcpListener,
        private_l: TcpListener,
        kube_l: Option<TcpListener>,
    ) -> Result<(JoinHandle<()>, Option<kubernetes_api::AuditLog>), StartError> {
        let config = self.config;
        let api_listening = self.listening(&config.api.listen, "api", ALPN_GRPC)?;
        let private_listening =
            self.listening(&config.private_api.listen, "private_api", ALPN_GRPC)?;
        let closing = || self.stop.reaches(Phase::Closing);
        let api_server = serve(public, api_l, api_listening, closing());
        let private_server = serve(private, private_l, private_listening, closing());
        let (kube_server, audit) = kubernetes_api_server(self, kube_l, closing())?;
        let served = tokio::spawn(async move {
            let (a, p, ()) = tokio::join!(api_server, private_server, kube_server);
            for r in [a, p] {
                if let Err(e) = r {
                    tracing::error!(error = %e, "call listener failed");
                }
            }
        });
        Ok((served, audit))
    }

    /// The public API (GitLab -> kas) behind GitLab's JWT.
    fn public_router(&self, store: Store, keys: Keys, gitlab_secret: &Secret) -> Router {
        let config = self.config;
        let public = KasApiServer::with_interceptor(
            public_api::PublicService {
                engine: self.engine.clone(),
                store,
                keys,
                default_timeout: config.api.default_timeout,
                max_timeout: config.api.max_timeout,
            },
            JwtCheck {
                verifier: Verifier::new(gitlab_secret, jwt::GITLAB, jwt::GITLAB_KAS)
                    .with_max_lifetime(config.api.max_token_lifetime),
                listener: "api",
                headers: &["authorization"],
            },
        );
        server(&config.api.listen).add_service(public)
    }

    /// The private API (kas -> kas) behind the replicas' JWT.
    fn private_router(&self, private_secret: &Secret) -> Router {
        let config = self.config;
        let private = KasPrivateServer::with_interceptor(
            private_api::PrivateService {
                engine: self.engine.clone(),
                stop: self.stop.clone(),
                default_timeout: config.api.default_timeout,
                max_timeout: config.api.max_timeout,
                kas: self.kas_id.clone(),
            },
            JwtCheck {
                verifier: Verifier::new(private_secret, jwt::GITLAB_KAS, jwt::GITLAB_KAS)
                    .with_max_lifetime(config.private_api.max_token_lifetime),
                listener: "private_api",
                headers: &[private_api::TOKEN_HEADER, "authorization"],
            },
        );
        server(&config.private_api.listen).add_service(private)
    }

    /// The agent API (agentk -> kas), advertising `advertise` to agents.
    fn agent_router(
        &self,
        auth: AgentAuth,
        advertise: SocketAddr,
        live_kas: Arc<live_kas::LiveKas>,
    ) -> Router {
        let a = &self.config.agent;
        let agents = AgentApiServer::new(agent_api::AgentService {
            auth,
            engine: self.engine.clone(),
            kas_address: advertise,
            stop: self.stop.clone(),
            max_connection_age: a.max_connection_age(),
            live_kas,
            activity_every: a.heartbeat_timeout / 4,
            poll_period: a.configuration.poll_period,
            // 15 s by default: an agent hearing nothing for three of these (45 s) gives
            // the link up, within kas's own heartbeat timeout (60 s).
            keepalive: a.heartbeat_timeout / 4,
            next_tunnel: Arc::default(),
            replicas: replicas::Replicas::default(),
            limits: limits::AgentLimits::new(
                limits::AgentLimitsConfig {
                    requests_per_minute: a.connections_per_token_per_minute(),
                    connections_per_agent: a.max_connections_per_agent,
                    tunnels_per_connection: a.max_tunnels_per_connection,
                },
                self.metrics.clone(),
            ),
        })
        .max_decoding_message_size(a.max_message_size);

        server(&a.listen).add_service(agents)
    }
}

/// The forwards to other kas, signed with the replicas' secret.
fn forwarder(
    config: &Config,
    private_secret: &Secret,
    metrics: &metrics::Metrics,
) -> forward::Forwarder {
    let signer = Signer::new(private_secret, jwt::GITLAB_KAS, jwt::GITLAB_KAS);
    let listen = &config.private_api.listen;
    let peers = peers::Peers::new(
        signer,
        config.agent.max_message_size,
        peers::PrivateTls {
            tls: listen.tls().is_some(),
            ca_file: listen.ca_certificate_file.clone(),
        },
        peers::connections(),
    );
    forward::Forwarder::new(peers, metrics.clone())
}

impl Addresses {
    /// Logs where kas `kas` listens.
    fn announce(&self, kas: &KasId) {
        tracing::info!(
            %kas,
            agent = %self.agent,
            api = %self.api,
            private_api = %self.private_api,
            observability = %self.observability,
            kubernetes_api = %self.kubernetes_api.map_or("off".into(), |a| a.to_string()),
            "kas started"
        );
    }
}

/// Every listener of one kas, bound, and their addresses.
struct Bound {
    agent: TcpListener,
    api: TcpListener,
    private: TcpListener,
    observability: TcpListener,
    kubernetes_api: Option<TcpListener>,
    addresses: Addresses,
}

impl Bound {
    /// Binds each listener `config` names, refusing with the key of the one that fails.
    async fn new(config: &Config) -> Result<Bound, StartError> {
        let agent = bind("agent.listen.address", config.agent.listen.address).await?;
        let api = bind("api.listen.address", config.api.listen.address).await?;
        let private = bind(
            "private_api.listen.address",
            config.private_api.listen.address,
        )
        .await?;
        let observability = bind(
            "observability.listen.address",
            config.observability.listen.address,
        )
        .await?;
        let kubernetes_api = match &config.agent.kubernetes_api {
            Some(k) => Some(bind("agent.kubernetes_api.listen.address", k.listen.address).await?),
            None => None,
        };
        let local = |l: &TcpListener| l.local_addr().map_err(|e| StartError::Setup(e.to_string()));
        let addresses = Addresses {
            agent: local(&agent)?,
            api: local(&api)?,
            private_api: local(&private)?,
            observability: local(&observability)?,
            kubernetes_api: kubernetes_api.as_ref().map(local).transpose()?,
        };
        Ok(Bound {
            agent,
            api,
            private,
            observability,
            kubernetes_api,
            addresses,
        })
    }
}

/// The node of kas `kas_id` as `config` sets it (advertised at `advertise`).
fn node_config(config: &Config, kas_id: &KasId, keys: &Keys, advertise: SocketAddr) -> NodeConfig {
    let a = &config.agent;
    // Drawn before the incarnation, so that each simulation seed keeps its schedule.
    let seed = rand::random();
    let instance = KasInstanceInfo {
        version: env!("CARGO_PKG_VERSION").into(),
        commit: String::new(),
        address: Some(KasAddress {
            ip: advertise.ip().to_string(),
            port: u32::from(advertise.port()),
        }),
        incarnation: rand::random(),
    };
    let defaults = NodeConfig::new(kas_id.clone(), keys.clone());
    NodeConfig {
        wakeups: config.redis.as_ref().is_none_or(|r| r.pubsub_wakeups),
        instance,
        seed,
        tracker: TrackerConfig {
            ttl: a.redis_conn_info_ttl,
            refresh: a.redis_conn_info_refresh,
            gc: a.redis_conn_info_gc,
            liveness: a.kas_liveness_ttl,
            ..defaults.tracker.clone()
        },
        router: RouterConfig {
            grace: timing::ROUTE_GRACE,
            linger: config
                .redis
                .as_ref()
                .map_or(Duration::ZERO, |r| r.subscription_linger),
            // Each call's steps, for its trace: only when traces are exported.
            steps: kas_transport::traces::on(),
            ..defaults.router
        },
        registry: RegistryConfig {
            heartbeat_timeout: a.heartbeat_timeout,
            tunnels_per_connection: a.max_tunnels_per_connection,
        },
        ..defaults
    }
}

impl Kas {
    /// [`Kas::start`] on the store the configuration names ([`configured_store`]).
    #[cfg(not(madsim))]
    pub async fn start_configured(config: Config) -> Result<Kas, StartError> {
        let store = configured_store(&config)?;
        Kas::start(config, store).await
    }

    /// Binds all listeners and starts serving, with its registry in `store` (the
    /// simulation passes its own).
    pub async fn start(config: Config, store: Store) -> Result<Kas, StartError> {
        let auth = agent_auth(&config)?;
        Kas::start_authenticating(config, store, auth).await
    }

    /// [`Kas::start`], asking GitLab about agent tokens through `agent_info` (the
    /// simulation's GitLab) instead of what the configuration names, cached as it says.
    pub async fn start_with_gitlab(
        config: Config,
        store: Store,
        agent_info: Fetch<AgentIdentity>,
    ) -> Result<Kas, StartError> {
        let cache = TokenCache::new(agent_info, cache_policy(&config.agent));
        let auth = AgentAuth::GitLab(Arc::new(cache));
        Kas::start_authenticating(config, store, auth).await
    }

    async fn start_authenticating(
        config: Config,
        store: Store,
        auth: AgentAuth,
    ) -> Result<Kas, StartError> {
        let Bound {
            agent: agent_l,
            api: api_l,
            private: private_l,
            observability: obs_l,
            kubernetes_api: kube_l,
            addresses,
        } = Bound::new(&config).await?;
        let advertise = match config.private_api.advertise_address {
            Some(a) => a.addr,
            None => addresses.private_api,
        };
        let kas_id = KasId(advertise.to_string());

        let gitlab_secret = secret(
            config.api.listen.authentication_secret_file.as_ref(),
            "api.listen.authentication_secret_file",
        )?;
        let private_secret = secret(
            config
                .private_api
                .listen
                .authentication_secret_file
                .as_ref(),
            "private_api.listen.authentication_secret_file",
        )?;
        let keys = Keys::new(
            config
                .redis
                .as_ref()
                .map_or("gitlab-kas", |r| r.key_prefix.as_str()),
        );

        let a = &config.agent;
        let metrics = metrics::Metrics::default();
        #[cfg(not(madsim))]
        metrics
            .open_files_limit
            .set(i64::try_from(listener::raise_open_files_limit()).unwrap_or(i64::MAX));
        let (store_ready_tx, store_ready) = watch::channel(true);
        let (stats_tx, stats) = watch::channel(NodeStats::default());
        let (stopping, stop) = Stopping::new();
        let node = KasNode::new(
            clock::now(),
            node_config(&config, &kas_id, &keys, advertise),
        );
        let engine = engine::spawn(engine::EngineParts {
            node,
            store: store.clone(),
            forwarder: forwarder(&config, &private_secret, &metrics),
            metrics: metrics.clone(),
            store_ready: store_ready_tx,
            stats: stats_tx,
        });

        let live_kas = Arc::new(live_kas::LiveKas::new(store.clone(), keys.kas_instances()));
        let shared = Shared {
            config: &config,
            engine: &engine,
            metrics: &metrics,
            kas_id: &kas_id,
            stop: stop.clone(),
        };
        let public = shared.public_router(store, keys, &gitlab_secret);
        let private = shared.private_router(&private_secret);
        let agents = shared.agent_router(auth, advertise, live_kas);
        let (calls_server, audit) =
            shared.serve_calls(public, private, api_l, private_l, kube_l)?;
        let agent_listening = shared.listening(&a.listen, "agent", ALPN_GRPC)?;
        let obs_listening =
            shared.listening(&config.observability.listen, "observability", ALPN_HTTP1)?;
        let closed = stop.reaches(Phase::Closed);
        let agents_server = tokio::spawn(async move {
            let r = serve(agents, agent_l, agent_listening, closed).await;
            if let Err(e) = r {
                tracing::error!(error = %e, "agent listener failed");
            }
        });
        let health = observability::Health {
            metrics,
            store_ready,
            stop: stop.clone(),
        };
        let observability_server = tokio::spawn(observability::serve(
            obs_l,
            config.observability.listen.clone(),
            obs_listening.tls,
            health.clone(),
            stop.reaches(Phase::Stopped),
        ));
        addresses.announce(&kas_id);
        Ok(Kas {
            addresses,
            engine,
            stats,
            stopping,
            calls_server,
            agents_server,
            observability_server,
            audit,
            grace: config.shutdown_grace,
            health,
        })
    }

    /// Readiness and metrics, as `/readiness` and `/metrics` serve them.
    pub fn health(&self) -> &observability::Health {
        &self.health
    }

    /// Shuts down gracefully (see the module docs). True when this kas's registry records
    /// were deleted; false when they are left to expire by TTL (Redis did not answer).
    pub async fn stop(mut self) -> bool {
        tracing::info!("shutting down: asking agents to move, letting running calls finish");
        let until = tokio::time::Instant::now() + self.grace;
        self.stopping.enter(Phase::Closing);
        self.engine.input(NodeInput::Drain);
        let left = || until.saturating_duration_since(tokio::time::Instant::now());
        if tokio::time::timeout(left(), &mut self.calls_server)
            .await
            .is_err()
        {
            tracing::warn!("calls still running after the shutdown grace period: cut off");
        }
        let gone = self.stats.wait_for(|s| s.calls == 0 && s.connections == 0);
        if let Ok(Ok(_)) = tokio::time::timeout(left(), gone).await {
            tracing::info!("every call ended and every agent moved away");
        } else {
            let s = *self.stats.borrow();
            tracing::warn!(
                calls = s.calls,
                agent_connections = s.connections,
                "still here after the shutdown grace period: cut off"
            );
        }
        self.stopping.enter(Phase::Leaving);
        let (done_tx, done) = oneshot::channel();
        self.engine.send(handle::Command::Shutdown(done_tx));
        let cleaned = tokio::time::timeout(timing::STOP_CLEANUP, done)
            .await
            .is_ok_and(|r| r.is_ok());
        if !cleaned {
            tracing::warn!(
                within = ?timing::STOP_CLEANUP,
                "could not delete this kas's registry records; they expire by TTL"
            );
        }
        // What is left is connection teardown: bounded, so that a stop always ends
        // within the grace and a little more.
        self.stopping.enter(Phase::Closed);
        // The calls cut off have failed with the tunnels: their callers are told so (a
        // reset stream, an error status) before their connections close. (Closed at
        // exit instead, an HTTP/2 connection that sent GOAWAY reads to kubectl as the
        // normal end of a watch: fleet test, "restart kas1".)
        if !self.calls_server.is_finished()
            && tokio::time::timeout(timing::STOP_LISTENER, &mut self.calls_server)
                .await
                .is_err()
        {
            self.calls_server.abort();
        }
        if tokio::time::timeout(timing::STOP_LISTENER, &mut self.agents_server)
            .await
            .is_err()
        {
            self.agents_server.abort();
        }
        // Every call has ended or been cut off: the last records are being queued. (Closed
        // with the listener instead, an exec session's, which outlives its connection's
        // graceful end, was lost: simulation, invariant 17.)
        if let Some(audit) = self.audit.take() {
            audit.close().await;
        }
        self.stopping.enter(Phase::Stopped);
        if tokio::time::timeout(timing::STOP_LISTENER, &mut self.observability_server)
            .await
            .is_err()
        {
            self.observability_server.abort();
        }
        tracing::info!("stopped");
        cleaned
    }
}

/// The Kubernetes API listener's server, when `agent.kubernetes_api` is set (it stops
/// with the other call listeners), and its audit log, when on.
fn kubernetes_api_server(
    shared: &Shared<'_>,
    listener: Option<TcpListener>,
    signal: impl Future<Output = ()> + Send + 'static,
) -> Result<
    (
        impl Future<Output = ()> + Send + 'static,
        Option<kubernetes_api::AuditLog>,
    ),
    StartError,
> {
    let Shared {
        config,
        engine,
        metrics,
        kas_id,
        ..
    } = *shared;
    let setup = match (&config.agent.kubernetes_api, listener) {
        (Some(k), Some(listener)) => {
            let tokens = match &k.tokens_file {
                Some(file) => kubernetes_api::UserTokens::Static(
                    kubernetes_api::StaticUserTokens::load(file).map_err(|e| {
                        StartError::Setup(format!("agent.kubernetes_api.tokens_file: {e}"))
                    })?,
                ),
                None => {
                    let (address, signer) = gitlab_api(config)?;
                    let access = kubernetes_api::GitLabAccess::new(
                        &address,
                        signer,
                        Duration::from_secs(10),
                    )
                    .map_err(StartError::Setup)?;
                    kubernetes_api::UserTokens::GitLab(access.cached(cache_policy(&config.agent)))
                }
            };
            let audit = k
                .audit
                .as_ref()
                .map(|a| kubernetes_api::AuditLog::open(a, metrics.clone()))
                .transpose()
                .map_err(StartError::Setup)?;
            let mut prefix = k.url_path_prefix.clone();
            if !prefix.ends_with('/') {
                prefix.push('/');
            }
            let service = kubernetes_api::KubernetesApiService {
                engine: engine.clone(),
                tokens,
                prefix,
                routing_timeout: k.routing_timeout,
                open: kubernetes_api::OpenRequests::new(
                    k.max_requests_per_token,
                    k.max_requests_per_token_per_agent,
                    metrics.clone(),
                ),
                streaming_idle_timeout: k.streaming_idle_timeout,
                kas: kas_id.clone(),
                audit,
                metrics: metrics.clone(),
            };
            let what = "agent.kubernetes_api";
            let tls = tls_config(&k.listen, what, ALPN_GRPC_OR_HTTP1)?;
            Some((listener, service, tls, k.listen.clone()))
        }
        _ => None,
    };
    let audit = setup.as_ref().and_then(|s| s.1.audit.clone());
    let metrics = metrics.clone();
    let served = async move {
        match setup {
            Some((listener, service, tls, listen)) => {
                kubernetes_api::serve(listener, service, tls, &listen, metrics, signal).await;
            }
            None => signal.await,
        }
    };
    Ok((served, audit))
}

fn agent_auth(config: &Config) -> Result<AgentAuth, StartError> {
    if let Some(f) = &config.agent.tokens_file {
        let tokens = StaticTokens::load(f)
            .map_err(|e| StartError::Setup(format!("agent.tokens_file: {e}")))?;
        return Ok(AgentAuth::Static(Arc::new(tokens)));
    }
    let (address, signer) = gitlab_api(config)
        .map_err(|_| StartError::Setup("agent.tokens_file or gitlab is required".into()))?;
    let client =
        GitLabClient::new(&address, signer, Duration::from_secs(10)).map_err(StartError::Setup)?;
    Ok(AgentAuth::GitLab(Arc::new(
        client.cached(cache_policy(&config.agent)),
    )))
}

/// GitLab's address, and how kas signs its requests to GitLab's internal API.
fn gitlab_api(config: &Config) -> Result<(String, Signer), StartError> {
    let g = config
        .gitlab
        .as_ref()
        .ok_or_else(|| StartError::Setup("gitlab is required".into()))?;
    let secret = Secret::load(&g.authentication_secret_file)
        .map_err(|e| StartError::Setup(format!("gitlab.authentication_secret_file: {e}")))?;
    Ok((
        g.address.clone(),
        Signer::new(&secret, jwt::GITLAB_KAS, jwt::GITLAB),
    ))
}

/// How answers of GitLab's token checks are cached (`agent.info_cache_*`,
/// `agent.token_lookups_*`); agents' and the Kubernetes API's callers' tokens have a
/// cache, and budgets, each.
fn cache_policy(a: &crate::config::Agent) -> CachePolicy {
    CachePolicy {
        ttl: a.info_cache_ttl,
        error_ttl: a.info_cache_error_ttl,
        stale_ttl: a.info_cache_stale_ttl,
        lookups_per_second: a.token_lookups_per_second,
        lookups_per_second_per_address: a.token_lookups_per_second_per_address,
    }
}
