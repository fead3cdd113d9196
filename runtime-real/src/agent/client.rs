//! The agent's side of the agent API: `GetConfiguration`, and reverse tunnels that serve
//! calls with the agent's [`Modules`].

use super::modules::Modules;
use crate::frames;
use futures::StreamExt;
use kas_core::ConnectionId;
use kas_core::frame_sequence::{Direction, FrameSequence, StreamKind};
use kas_core::tunnel_pool::{PoolInput, Slot};
use kas_proto::agent_api::agent_api_client::AgentApiClient;
use kas_proto::agent_api::{ConfigurationRequest, ConfigurationResponse};
use kas_proto::frame::{Descriptor, Frame, frame::Kind};
use kas_proto::registry::AgentMeta;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Request, Status, Streaming};

/// A client of one kas's agent listener, authenticated with the agent token.
#[derive(Clone)]
pub struct AgentClient {
    client: AgentApiClient<Channel>,
    token: String,
}

/// How a tunnel reports to its pool, and how the pool closes it.
pub struct TunnelHooks {
    /// The tunnel's slot in the pool.
    pub slot: Slot,
    /// Receives `Opened`, `Claimed` and `Released` for this slot.
    pub reports: mpsc::UnboundedSender<PoolInput>,
    /// Fires when the pool wants the tunnel closed; honoured while it is idle.
    pub close: oneshot::Receiver<()>,
}

impl TunnelHooks {
    fn report(&self, input: PoolInput) {
        let _ = self.reports.send(input);
    }
}

impl AgentClient {
    /// A client over `channel` presenting `token`.
    pub fn new(channel: Channel, token: impl Into<String>) -> Self {
        AgentClient {
            client: AgentApiClient::new(channel),
            token: token.into(),
        }
    }

    fn request<T>(&self, msg: T) -> Result<Request<T>, Status> {
        let mut req = Request::new(msg);
        let value = format!("Bearer {}", self.token)
            .parse()
            .map_err(|_| Status::invalid_argument("agent token is not valid metadata"))?;
        req.metadata_mut().insert("authorization", value);
        Ok(req)
    }

    /// Opens `GetConfiguration`: returns the connection id kas gave this replica, the first
    /// configuration, and the stream, which must stay open for the connection to live.
    pub async fn connect(
        &self,
        meta: AgentMeta,
    ) -> Result<
        (
            ConnectionId,
            ConfigurationResponse,
            Streaming<ConfigurationResponse>,
        ),
        Status,
    > {
        let req = self.request(ConfigurationRequest {
            agent_meta: Some(meta),
            commit_id: String::new(),
        })?;
        let mut stream = self
            .client
            .clone()
            .get_configuration(req)
            .await?
            .into_inner();
        let first = stream
            .message()
            .await?
            .ok_or_else(|| Status::unavailable("kas closed GetConfiguration at once"))?;
        Ok((ConnectionId(first.connection_id), first, stream))
    }

    /// Opens one tunnel for `connection` and serves calls on it until it ends. Sends a
    /// heartbeat every `heartbeat`. Returns the status that ended the tunnel: OK when kas
    /// ended it cleanly or the pool closed it.
    pub async fn serve_tunnel(
        &self,
        connection: ConnectionId,
        modules: Arc<Modules>,
        heartbeat: Duration,
        hooks: Option<TunnelHooks>,
    ) -> Status {
        let (tx, rx) = mpsc::channel(16);
        let descriptor = frames::frame(Kind::Descriptor(Descriptor {
            methods: modules.methods(),
            connection_id: connection.0,
        }));
        let mut sequence = FrameSequence::new(StreamKind::Tunnel);
        if let Err(e) = sequence.check(Direction::FromAgent, &descriptor) {
            return Status::internal(format!("agent descriptor rejected: {e}"));
        }
        let _ = tx.send(descriptor).await;
        let req = match self.request(ReceiverStream::new(rx)) {
            Ok(r) => r,
            Err(s) => return s,
        };
        let inbound = match self.client.clone().open_tunnel(req).await {
            Ok(r) => r.into_inner(),
            Err(s) => return s,
        };
        let mut heartbeat = tokio::time::interval(heartbeat);
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let tunnel = Tunnel {
            tx,
            inbound,
            modules,
            heartbeat,
            sequence,
            beats: 0,
            hooks,
        };
        match tunnel.serve().await {
            Ok(()) => Status::ok("tunnel closed"),
            Err(s) => s,
        }
    }
}

struct Tunnel {
    tx: mpsc::Sender<Frame>,
    inbound: Streaming<Frame>,
    modules: Arc<Modules>,
    heartbeat: tokio::time::Interval,
    sequence: FrameSequence,
    beats: u64,
    hooks: Option<TunnelHooks>,
}

/// Resolves when the pool asks for the close, never without hooks.
async fn close_requested(hooks: &mut Option<TunnelHooks>) {
    match hooks {
        Some(h) => {
            if (&mut h.close).await.is_err() {
                // The pool is gone: the connection is ending and will drop the tunnel.
                std::future::pending::<()>().await
            }
        }
        None => std::future::pending().await,
    }
}

impl Tunnel {
    fn report(&self, input: impl FnOnce(Slot) -> PoolInput) {
        if let Some(h) = &self.hooks {
            h.report(input(h.slot));
        }
    }

    async fn beat(&mut self) -> Result<(), Status> {
        self.beats += 1;
        self.tx
            .send(frames::heartbeat(self.beats))
            .await
            .map_err(|_| Status::unavailable("tunnel closed"))
    }

    /// Receives the next frame from kas, heartbeating meanwhile. `None`: kas ended the
    /// tunnel, or the pool closed it while idle (`idle`).
    async fn next(&mut self, idle: bool) -> Result<Option<Frame>, Status> {
        loop {
            tokio::select! {
                biased;
                frame = self.inbound.message() => return frame,
                () = close_requested(&mut self.hooks), if idle => return Ok(None),
                _ = self.heartbeat.tick() => self.beat().await?,
            }
        }
    }

    async fn serve(mut self) -> Result<(), Status> {
        self.report(PoolInput::Opened);
        let mut request: Option<(u64, String, Vec<u8>)> = None;
        loop {
            let Some(frame) = self.next(request.is_none()).await? else {
                return Ok(());
            };
            self.sequence
                .check(Direction::ToAgent, &frame)
                .map_err(|e| Status::internal(format!("kas broke the tunnel protocol: {e}")))?;
            match frame.kind {
                Some(Kind::RequestStart(s)) => {
                    self.report(PoolInput::Claimed);
                    request = Some((s.request_id, s.method, Vec::new()));
                }
                Some(Kind::Message(m)) => {
                    if let Some((_, _, body)) = &mut request {
                        body.extend_from_slice(&m.data);
                    }
                }
                Some(Kind::CloseSend(_)) => {
                    if let Some((id, method, body)) = request.take() {
                        self.answer(id, &method, body).await?;
                        self.report(PoolInput::Released);
                    }
                }
                _ => {}
            }
        }
    }

    /// Runs the module and sends its answer as it comes, heartbeating while it runs.
    async fn answer(&mut self, id: u64, method: &str, body: Vec<u8>) -> Result<(), Status> {
        let mut answer = self.modules.call(method, body);
        loop {
            let next = tokio::select! {
                biased;
                next = answer.next() => next,
                _ = self.heartbeat.tick() => {
                    self.beat().await?;
                    continue;
                }
            };
            let (frame, last) = match next {
                Some(Ok(bytes)) => (frames::message(id, bytes), false),
                Some(Err(status)) => (frames::trailer(id, &status), true),
                None => (frames::trailer(id, &Status::ok("")), true),
            };
            self.sequence
                .check(Direction::FromAgent, &frame)
                .map_err(|e| Status::internal(format!("agent answer out of order: {e}")))?;
            self.tx
                .send(frame)
                .await
                .map_err(|_| Status::unavailable("tunnel closed"))?;
            if last {
                return Ok(());
            }
        }
    }
}
