//! The agent listener (agentk -> kas): `GetConfiguration`, one open stream per agent
//! replica, and `OpenTunnel`, the reverse tunnels calls travel down.

use super::handle::{Command, EngineHandle};
use super::limits::AgentLimits;
use super::live_kas::LiveKas;
use super::replicas::Replicas;
use super::stopping::{Phase, Stop};
use super::tunnel::{self, OutboundStream, Outgoing, Tunnel};
use futures::future::{Fuse, FusedFuture, FutureExt};
use kas_auth::agent_auth::{AgentAuth, AgentIdentity, AuthError};
use kas_core::frame_sequence::{Direction, FrameSequence, StreamKind};
use kas_core::node::NodeInput;
use kas_core::{ConnectionId, TunnelId};
use kas_proto::agent_api::agent_api_server::AgentApi;
use kas_proto::agent_api::{ConfigurationRequest, ConfigurationResponse};
use kas_proto::frame::{Frame, frame::Kind};
use kas_proto::registry::{
    AgentMeta, ConnectedAgentInfo, KUBERNETES_VERSION_FIELD_MAX, KasAddress, KubernetesVersion,
};
use sha2::{Digest, Sha256};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};
use tokio::sync::{mpsc, oneshot};
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status, Streaming};

/// How long an agent has to send its tunnel descriptor.
const DESCRIPTOR_TIMEOUT: Duration = Duration::from_secs(10);

/// The agent API service.
pub struct AgentService {
    /// Resolves agent tokens.
    pub auth: AgentAuth,
    /// The engine.
    pub engine: EngineHandle,
    /// This kas's private API address (recorded with each connection), its id.
    pub kas_address: SocketAddr,
    /// The kas's stop: once `Closing`, agents are asked to move and new connections and
    /// tunnels are refused; once `Leaving`, they are cut off.
    pub stop: Stop,
    /// `agent.listen.max_connection_age`.
    pub max_connection_age: Duration,
    /// How many kas are live, told to agents.
    pub live_kas: Arc<LiveKas>,
    /// Idle tunnels report activity at most this often.
    pub activity_every: Duration,
    /// Tunnel ids.
    pub next_tunnel: Arc<AtomicU64>,
    /// What one agent may hold.
    pub limits: AgentLimits,
    /// Which replica holds each open connection id.
    pub replicas: Replicas,
    /// `agent.configuration.poll_period`: how often a connected replica's token is
    /// checked again.
    pub poll_period: Duration,
    /// kas sends each replica a message at least this often, so that a link that drops
    /// what kas sends is found even with no tunnel open on it.
    pub keepalive: Duration,
}

impl AgentService {
    /// Resolves the agent token in `metadata`. Takes the metadata, not the request, so
    /// that no reference to a (non-`Sync`) request stream is held across the lookup.
    async fn authenticate(
        &self,
        metadata: MetadataMap,
        peer: Option<SocketAddr>,
    ) -> Result<AgentIdentity, Status> {
        let header = bearer(&metadata);
        let peer = peer.map(|p| p.ip());
        self.auth.resolve_bearer(header, peer).await.map_err(|e| {
            tracing::info!(error = %e, "agent token refused");
            match e {
                AuthError::InvalidToken => Status::unauthenticated(format!("agent {e}")),
                AuthError::Forbidden(_) => Status::permission_denied(e.to_string()),
                AuthError::Unavailable(_) => Status::unavailable(e.to_string()),
                AuthError::Throttled { limit, .. } => {
                    self.limits.refused(limit);
                    Status::resource_exhausted(e.to_string())
                }
            }
        })
    }
}

#[tonic::async_trait]
impl AgentApi for AgentService {
    type GetConfigurationStream = OutboundStream<ConfigurationResponse>;
    type OpenTunnelStream = OutboundStream<Frame>;

    async fn get_configuration(
        &self,
        req: Request<ConfigurationRequest>,
    ) -> Result<Response<Self::GetConfigurationStream>, Status> {
        self.refuse_while_draining()?;
        let metadata = req.metadata().clone();
        let token = Recheck {
            auth: self.auth.clone(),
            bearer: bearer(&metadata).map(str::to_owned),
            peer: req.remote_addr().map(|a| a.ip()),
            every: self.poll_period,
        };
        let identity = self.authenticate(metadata, req.remote_addr()).await?;
        let request = req.into_inner();
        let meta = request.agent_meta.unwrap_or_default();
        check_meta(&meta)?;
        let connection = match request.connection_id {
            0 => ConnectionId(rand::random::<i64>().unsigned_abs() as i64 | 1),
            id if id > 0 => ConnectionId(id),
            id => {
                return Err(Status::invalid_argument(format!(
                    "connection_id {id} is negative: propose a positive id, or 0 to let kas choose"
                )));
            }
        };
        self.limits.request(identity.agent_id)?;
        let slot = self.limits.connection(identity.agent_id)?;
        let claim =
            self.replicas
                .claim(identity.agent_id, connection, &request.replica_proof, &meta)?;
        let live_kas = self.live_kas.count().await;
        let info = ConnectedAgentInfo {
            agent_id: identity.agent_id.0,
            project_id: identity.project_id.0,
            connection_id: connection.0,
            agent_meta: Some(meta),
            connected_at: Some(kas_proto::prost_types::Timestamp::from(SystemTime::now())),
            kas_address: Some(KasAddress {
                ip: self.kas_address.ip().to_string(),
                port: u32::from(self.kas_address.port()),
            }),
            kas_addresses: Vec::new(),
            warnings: Vec::new(),
        };
        tracing::info!(agent = %identity.agent_id, %connection, "agent connected");
        self.engine.input(NodeInput::AgentConnected(Box::new(info)));
        let (tx, rx) = tunnel::outbound(2);
        let commit_id = hex(&Sha256::digest(identity.config.as_bytes())[..8]);
        let first = ConfigurationResponse {
            config: identity.config.clone(),
            commit_id,
            connection_id: connection.0,
            kas_id: self.kas_address.to_string(),
            live_kas,
            drain: false,
            stopping: false,
            max_tunnels: u32::try_from(self.limits.max_tunnels()).unwrap_or(u32::MAX),
            keepalive_millis: u32::try_from(self.keepalive.as_millis()).unwrap_or(u32::MAX),
        };
        let drain = ConfigurationResponse {
            drain: true,
            config: String::new(),
            ..first.clone()
        };
        let _ = tx.send(Box::new(Ok(first))).await;
        let engine = self.engine.clone();
        let ends = Ends {
            stop: self.stop.clone(),
            age: jittered(self.max_connection_age),
            token,
            keepalive: self.keepalive,
            live_kas: self.live_kas.clone(),
        };
        tokio::spawn(async move {
            if let Some(status) = ends.hold(&tx, drain).await {
                tracing::info!(agent = %identity.agent_id, %connection, reason = %status.message(), "ending the connection");
                let _ = tx.try_send(Box::new(Err(status)));
            }
            tracing::info!(agent = %identity.agent_id, %connection, "agent disconnected");
            engine.input(NodeInput::AgentDisconnected {
                agent: identity.agent_id,
                project: identity.project_id,
                connection,
            });
            drop((claim, slot));
        });
        Ok(Response::new(rx))
    }

    async fn open_tunnel(
        &self,
        req: Request<Streaming<Frame>>,
    ) -> Result<Response<Self::OpenTunnelStream>, Status> {
        self.refuse_while_draining()?;
        let metadata = req.metadata().clone();
        let identity = self.authenticate(metadata, req.remote_addr()).await?;
        self.limits.request(identity.agent_id)?;
        let mut inbound = req.into_inner();
        let mut sequence = FrameSequence::new(StreamKind::Tunnel);
        let first = match tokio::time::timeout(DESCRIPTOR_TIMEOUT, inbound.message()).await {
            Err(_) => return Err(Status::deadline_exceeded("no tunnel descriptor within 10s")),
            Ok(Err(s)) => return Err(s),
            Ok(Ok(None)) => {
                return Err(Status::invalid_argument(
                    "tunnel closed before its descriptor",
                ));
            }
            Ok(Ok(Some(f))) => f,
        };
        sequence
            .check(Direction::FromAgent, &first)
            .map_err(|e| Status::invalid_argument(format!("tunnel protocol error: {e}")))?;
        let Some(Kind::Descriptor(descriptor)) = first.kind else {
            return Err(Status::invalid_argument(
                "tunnel protocol error: tunnel must begin with a descriptor",
            ));
        };
        let connection = ConnectionId(descriptor.connection_id);
        self.replicas
            .check_tunnel(identity.agent_id, connection, &descriptor.replica_proof)?;
        let slot = self.limits.tunnel(identity.agent_id, connection)?;
        let tunnel = TunnelId(self.next_tunnel.fetch_add(1, Ordering::Relaxed));
        let (orders_tx, orders) = mpsc::channel(1);
        let (reply_tx, reply) = oneshot::channel();
        self.engine.send(Command::TunnelOpened {
            tunnel,
            agent: identity.agent_id,
            connection,
            orders: orders_tx,
            reply: reply_tx,
        });
        reply
            .await
            .map_err(|_| Status::unavailable("kas is shutting down"))??;
        let (outbound, frames) = tunnel::outbound(16);
        let task = Tunnel {
            id: tunnel,
            connection,
            inbound,
            outbound,
            orders,
            sequence,
            engine: self.engine.clone(),
            activity_every: self.activity_every,
            stop: self.stop.clone(),
            _slot: slot,
        };
        tokio::spawn(task.run());
        Ok(Response::new(frames))
    }
}

impl AgentService {
    /// Refuses a new connection or tunnel while kas stops: the agent is moving away.
    fn refuse_while_draining(&self) -> Result<(), Status> {
        if self.stop.reached(Phase::Closing) {
            return Err(Status::unavailable(format!(
                "kas {} is shutting down: connect to another kas",
                self.kas_address
            )));
        }
        Ok(())
    }
}

/// The `authorization` header's value, if any.
fn bearer(metadata: &MetadataMap) -> Option<&str> {
    metadata.get("authorization")?.to_str().ok()
}

/// How kas checks a connected replica's token again.
struct Recheck {
    auth: AgentAuth,
    /// The `authorization` header the replica connected with.
    bearer: Option<String>,
    peer: Option<std::net::IpAddr>,
    every: Duration,
}

impl Recheck {
    /// What ends the connection if GitLab no longer accepts its token; `None` while it
    /// does, or cannot say (a token it accepted is kept while it fails).
    async fn refused(&self) -> Option<Status> {
        let header = self.bearer.as_deref();
        match self.auth.resolve_bearer(header, self.peer).await {
            Err(e @ AuthError::InvalidToken) => Some(Status::unauthenticated(format!(
                "agent {e} any more: GitLab revoked it"
            ))),
            Err(e @ AuthError::Forbidden(_)) => Some(Status::permission_denied(e.to_string())),
            _ => None,
        }
    }
}

/// What ends a replica's `GetConfiguration` stream besides the agent.
struct Ends {
    stop: Stop,
    /// The connection's age limit, jittered.
    age: Duration,
    /// Its token, checked every `agent.configuration.poll_period`.
    token: Recheck,
    /// A message goes to the agent this often.
    keepalive: Duration,
    /// Told again in each keepalive (as last read): an agent that connected while it
    /// counted fewer kas (others starting, or their records lost with a Redis failover)
    /// learns of more.
    live_kas: Arc<LiveKas>,
}

impl Ends {
    /// Holds the stream until the agent closes it (`None`) or kas cuts it off (with the
    /// status to close it with): kas leaves, or GitLab no longer accepts the token. Once
    /// kas drains, or the connection is `age` old, the agent is asked to move with
    /// `drain`. The ask is sent without waiting: an agent that does not read its stream
    /// is cut off with the rest. Keepalives wait on neither Redis nor GitLab: the token
    /// is rechecked beside them and the live kas count is the last one read, so that a
    /// slow store or GitLab never silences the link (`redis-restart` seed 123 once: a
    /// count read through a failing Redis Cluster shard held keepalives back 2.25 s, and
    /// the agents gave their links up as dead).
    async fn hold(
        self,
        tx: &mpsc::Sender<Outgoing<ConfigurationResponse>>,
        drain: ConfigurationResponse,
    ) -> Option<Status> {
        let Ends {
            mut stop,
            age,
            token,
            keepalive: every_beat,
            live_kas,
        } = self;
        let old = tokio::time::sleep(age);
        tokio::pin!(old);
        let every = token.every;
        let mut recheck = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        recheck.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut checking = std::pin::pin!(token.refused().fuse());
        checking.set(Fuse::terminated());
        let keepalive = ConfigurationResponse {
            keepalive_millis: drain.keepalive_millis,
            ..ConfigurationResponse::default()
        };
        let beat = tokio::time::Instant::now() + every_beat;
        let mut beats = tokio::time::interval_at(beat, every_beat);
        beats.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // What the agent was asked: to move (for age), then to leave (kas stopping).
        let (mut asked, mut leave) = (false, false);
        let mut closing = stop.clone();
        loop {
            let (why, stopping) = tokio::select! {
                biased;
                () = tx.closed() => return None,
                () = stop.until(Phase::Leaving) => return Some(leaving()),
                _ = beats.tick() => {
                    let keepalive = ConfigurationResponse { live_kas: live_kas.latest(), ..keepalive.clone() };
                    // Not waited for: an agent that does not read is cut off elsewhere.
                    let _ = tx.try_send(Box::new(Ok(keepalive)));
                    continue;
                }
                _ = recheck.tick(), if checking.is_terminated() => {
                    checking.set(token.refused().fuse());
                    continue;
                }
                refused = &mut checking => match refused {
                    None => continue,
                    refused => return refused,
                },
                () = closing.until(Phase::Closing), if !leave => ("kas is shutting down", true),
                () = &mut old, if !asked => ("the connection reached agent.listen.max_connection_age", false),
            };
            (asked, leave) = (true, stopping);
            tracing::info!(
                connection = drain.connection_id,
                reason = why,
                "asking the agent to move"
            );
            let ask = ConfigurationResponse {
                stopping,
                ..drain.clone()
            };
            let _ = tx.try_send(Box::new(Ok(ask)));
        }
    }
}

/// Why kas closes a replica's stream as it leaves.
fn leaving() -> Status {
    Status::unavailable("kas is shutting down: reconnect to another kas")
}

/// `age` less up to a tenth of it, drawn at random: agents that connected together are
/// not all asked to move at once.
fn jittered(age: Duration) -> Duration {
    age.mul_f64(1.0 - rand::random::<f64>() / 10.0)
}

/// The longest value of each agent-reported field: what Kubernetes allows for names (a
/// DNS subdomain for a pod, a DNS label for a namespace) and a few dozen characters for
/// version and commit. Every listing of the agent's project carries these, so one agent
/// must not be able to grow it past what GitLab reads (once: 2 MiB pod names).
const META_LIMITS: [(&str, usize); 9] = [
    ("agent_meta.version", 64),
    ("agent_meta.commit", 64),
    ("agent_meta.pod_namespace", 63),
    ("agent_meta.pod_name", 253),
    ("agent_meta.architecture", 32),
    (
        "agent_meta.kubernetes_version.major",
        KUBERNETES_VERSION_FIELD_MAX,
    ),
    (
        "agent_meta.kubernetes_version.minor",
        KUBERNETES_VERSION_FIELD_MAX,
    ),
    (
        "agent_meta.kubernetes_version.git_version",
        KUBERNETES_VERSION_FIELD_MAX,
    ),
    (
        "agent_meta.kubernetes_version.platform",
        KUBERNETES_VERSION_FIELD_MAX,
    ),
];

/// Refuses agent metadata with a field over its limit, naming the field.
fn check_meta(meta: &AgentMeta) -> Result<(), Status> {
    let none = KubernetesVersion::default();
    let k8s = meta.kubernetes_version.as_ref().unwrap_or(&none);
    let values = [
        &meta.version,
        &meta.commit,
        &meta.pod_namespace,
        &meta.pod_name,
        &meta.architecture,
        &k8s.major,
        &k8s.minor,
        &k8s.git_version,
        &k8s.platform,
    ];
    for ((field, max), value) in META_LIMITS.iter().zip(values) {
        if value.len() > *max {
            return Err(Status::invalid_argument(format!(
                "{field} is {} bytes long; at most {max} are accepted",
                value.len()
            )));
        }
    }
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
