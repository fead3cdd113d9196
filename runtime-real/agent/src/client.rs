//! The agent's side of the agent API: `GetConfiguration`, and reverse tunnels that serve
//! calls with the agent's [`Modules`].

use super::modules::Modules;
use futures::StreamExt;
use kas_core::ConnectionId;
use kas_core::frame_sequence::{Direction, FrameSequence, StreamKind};
use kas_core::tunnel_pool::{PoolInput, Slot};
use kas_proto::agent_api::agent_api_client::AgentApiClient;
use kas_proto::agent_api::{ConfigurationRequest, ConfigurationResponse};
use kas_proto::frame::{Descriptor, Frame, frame::Kind};
use kas_proto::registry::AgentMeta;
use kas_transport::channel_ends::reserve;
use kas_transport::frames;
use kas_transport::traces::{self, Context, KeyValue, SpanKind};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Request, Status, Streaming};
use tracing::Instrument;

/// A client of one kas's agent listener, authenticated with the agent token.
#[derive(Clone)]
pub struct AgentClient {
    client: AgentApiClient<Channel>,
    token: String,
    /// The replica's proof, sent with its connection id (see `ConfigurationRequest`).
    proof: Vec<u8>,
}

/// How a tunnel reports to its pool, and how the pool closes it.
pub struct TunnelHooks {
    /// The tunnel's slot in the pool.
    pub slot: Slot,
    /// Receives `Opened`, `Claimed` and `Released` for this slot.
    pub reports: mpsc::UnboundedSender<PoolInput>,
    /// Fires when the pool wants the tunnel closed; honoured while it is idle: the agent
    /// asks kas to end it, serves the call that may cross that request, and waits for kas
    /// to end the stream (at most [`CLOSE_WAIT`] while idle).
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
            proof: Vec::new(),
        }
    }

    /// The same client proving it is the replica that drew `proof`.
    pub fn with_proof(self, proof: Vec<u8>) -> Self {
        AgentClient { proof, ..self }
    }

    fn request<T>(&self, msg: T) -> Result<Request<T>, Status> {
        let mut req = Request::new(msg);
        let value = format!("Bearer {}", self.token)
            .parse()
            .map_err(|_| Status::invalid_argument("agent token is not valid metadata"))?;
        req.metadata_mut().insert("authorization", value);
        Ok(req)
    }

    /// Opens `GetConfiguration` as replica `connection` (kas draws an id when `None`):
    /// returns the replica's connection id, the first configuration, and the stream,
    /// which must stay open for the connection to live.
    pub async fn connect(
        &self,
        meta: AgentMeta,
        connection: Option<ConnectionId>,
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
            connection_id: connection.map_or(0, |c| c.0),
            replica_proof: self.proof.clone(),
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
    /// ended it cleanly or the pool closed it; [`kas_silent`] when kas answered neither
    /// the opening nor, while the tunnel was idle, [`UNANSWERED_HEARTBEATS`] heartbeats in
    /// a row (the link to kas is dead one way or both).
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
            replica_proof: self.proof.clone(),
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
        let wait = heartbeat * UNANSWERED_HEARTBEATS;
        let mut client = self.client.clone();
        let inbound = match tokio::time::timeout(wait, client.open_tunnel(req)).await {
            Ok(Ok(r)) => r.into_inner(),
            Ok(Err(s)) => return s,
            Err(_) => {
                return silent(format!(
                    "kas did not answer a tunnel's opening within {wait:?}"
                ));
            }
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
            unanswered: 0,
            hooks,
            closing: false,
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
    /// Heartbeats sent while idle since kas last sent anything (kas echoes each one).
    unanswered: u32,
    hooks: Option<TunnelHooks>,
    /// The agent has sent `Closing`.
    closing: bool,
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

    /// Receives the next frame from kas while idle, heartbeating meanwhile, and asks kas
    /// to end the tunnel when the pool closes it. `None`: kas ended the tunnel, or did not
    /// within [`CLOSE_WAIT`] of being asked.
    async fn next(&mut self) -> Result<Option<Frame>, Status> {
        // Since the agent asked kas to end the tunnel: it is idle, so only kas is late.
        let mut close_wait = self
            .closing
            .then(|| tokio::time::Instant::now() + CLOSE_WAIT);
        loop {
            tokio::select! {
                biased;
                frame = self.inbound.message() => {
                    self.unanswered = 0;
                    return frame;
                }
                () = close_requested(&mut self.hooks), if !self.closing => {
                    // Closing the stream here would cut a call kas may be sending.
                    let frame = frames::closing();
                    self.sequence
                        .check(Direction::FromAgent, &frame)
                        .map_err(|e| Status::internal(format!("agent close out of order: {e}")))?;
                    self.tx
                        .send(frame)
                        .await
                        .map_err(|_| Status::unavailable("tunnel closed"))?;
                    self.closing = true;
                    close_wait = Some(tokio::time::Instant::now() + CLOSE_WAIT);
                }
                () = tokio::time::sleep_until(close_wait.unwrap_or_else(tokio::time::Instant::now)), if close_wait.is_some() => {
                    tracing::warn!(wait = ?CLOSE_WAIT, "kas did not end a tunnel the agent asked it to end: dropping it");
                    return Ok(None);
                }
                _ = self.heartbeat.tick() => {
                    // Counted only while idle, where kas answers each: during a call its
                    // frames are the call's, and may rightly pause for as long as it runs.
                    if self.unanswered >= UNANSWERED_HEARTBEATS {
                        let (n, over) = (self.unanswered, self.heartbeat.period() * self.unanswered);
                        return Err(silent(format!("kas answered none of the last {n} heartbeats ({over:?})")));
                    }
                    self.beat().await?;
                    self.unanswered += 1;
                }
            }
        }
    }

    async fn serve(mut self) -> Result<(), Status> {
        self.report(PoolInput::Opened);
        loop {
            let Some(frame) = self.next().await? else {
                return Ok(());
            };
            self.check_down(&frame)?;
            // Anything else is a late request frame of the call that just ended: dropped.
            if let Some(Kind::RequestStart(s)) = frame.kind {
                self.report(PoolInput::Claimed);
                // The call's trace span, child of the kas span that handed it here.
                let parent = traces::from_metadata(&s.metadata);
                let trace =
                    traces::child("agentk", "agentk.call", SpanKind::Server, &parent, || {
                        vec![
                            KeyValue::new("rpc.method", s.method.clone()),
                            KeyValue::new("kas.correlation_id", s.correlation_id().to_string()),
                        ]
                    });
                // The call's lines carry the ids kas gave it (see kas's `correlation`), and
                // its trace's.
                let span = tracing::debug_span!(
                    "call",
                    request = s.request_id,
                    method = %s.method,
                    correlation_id = s.correlation_id(),
                    trace_id = traces::trace_id(&trace).as_deref(),
                );
                let _ending = traces::Ending(trace.clone());
                if !self
                    .call(s.request_id, &s.method, trace)
                    .instrument(span)
                    .await?
                {
                    return Ok(());
                }
                self.unanswered = 0;
                self.report(PoolInput::Released);
            }
        }
    }

    fn check_down(&mut self, frame: &Frame) -> Result<(), Status> {
        self.sequence
            .check(Direction::ToAgent, frame)
            .map(drop)
            .map_err(|e| Status::internal(format!("kas broke the tunnel protocol: {e}")))
    }

    /// Runs one call: its request messages to the module as kas sends them, the module's
    /// answer to kas as it comes, both at once, each through a one-frame slot so that
    /// neither way waits on the other. False when kas ended the tunnel meanwhile.
    async fn call(&mut self, id: u64, method: &str, trace: Context) -> Result<bool, Status> {
        let (requests, rx) = mpsc::channel(REQUEST_MESSAGES);
        let mut requests = Some(requests);
        // A module reads the call's trace as the current context when it starts.
        let mut answer = {
            let _current = trace.attach();
            self.modules.call(method, rx)
        };
        let mut to_module: Option<bytes::Bytes> = None;
        let mut to_kas: Option<(Frame, bool)> = None;
        let tx = self.tx.clone();
        loop {
            let mut request_over = false;
            tokio::select! {
                biased;
                permit = tx.reserve(), if to_kas.is_some() => {
                    let permit = permit.map_err(|_| Status::unavailable("tunnel closed"))?;
                    let (frame, last) = to_kas.take().expect("guarded");
                    permit.send(frame);
                    if last {
                        return Ok(true);
                    }
                }
                permit = reserve(&requests), if to_module.is_some() => match permit {
                    Some(permit) => permit.send(to_module.take().expect("guarded")),
                    // The module no longer reads its requests: the rest is dropped.
                    None => request_over = true,
                },
                next = answer.next(), if to_kas.is_none() => {
                    let (frame, last) = match next {
                        Some(Ok(bytes)) => (frames::message(id, bytes), false),
                        Some(Err(status)) => {
                            tracing::debug!(code = ?status.code(), error = %status.message(), "call answered with an error");
                            (frames::trailer(id, &status), true)
                        }
                        None => (frames::trailer(id, &Status::ok("")), true),
                    };
                    self.sequence
                        .check(Direction::FromAgent, &frame)
                        .map_err(|e| Status::internal(format!("agent answer out of order: {e}")))?;
                    to_kas = Some((frame, last));
                }
                frame = self.inbound.message(), if to_module.is_none() => {
                    let Some(frame) = frame? else {
                        return Ok(false);
                    };
                    self.check_down(&frame)?;
                    match frame.kind {
                        Some(Kind::Message(m)) if requests.is_some() => to_module = Some(m.data),
                        Some(Kind::CloseSend(_)) => request_over = true,
                        _ => {}
                    }
                }
                _ = self.heartbeat.tick() => self.beat().await?,
            }
            if request_over {
                (requests, to_module) = (None, None);
            }
        }
    }
}

/// Heartbeats an idle tunnel sends without hearing from kas before it takes the link to
/// kas for dead (a path that drops one way, with no reset, looks alive to the way that
/// still flows): the tunnel ends with [`kas_silent`], and so does its connection.
pub const UNANSWERED_HEARTBEATS: u32 = 3;

/// What ends a tunnel whose kas went silent, as `how`.
fn silent(how: String) -> Status {
    Status::unavailable(format!("{KAS_SILENT}: {how}"))
}

const KAS_SILENT: &str = "the link to kas is dead";

/// Whether a tunnel ended because kas went silent: its connection is dead with it.
pub fn kas_silent(status: &Status) -> bool {
    status.code() == tonic::Code::Unavailable && status.message().starts_with(KAS_SILENT)
}

/// How long an idle tunnel waits for kas to end it once the agent asked.
pub const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// How many request messages wait for a module before kas is held back.
const REQUEST_MESSAGES: usize = 16;
