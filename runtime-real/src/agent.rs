//! The agent side of the agent API: the `GetConfiguration` connection and reverse tunnels
//! that serve calls with the agent's modules.
//!
//! A module registers its methods in [`Modules`]; a tunnel carries any registered method
//! without kas knowing about it.

use crate::frames;
use futures::future::BoxFuture;
use kas_core::ConnectionId;
use kas_core::frame_sequence::{Direction, FrameSequence, StreamKind};
use kas_proto::agent_api::agent_api_client::AgentApiClient;
use kas_proto::agent_api::{ConfigurationRequest, ConfigurationResponse};
use kas_proto::frame::{Descriptor, Frame, frame::Kind};
use kas_proto::pods::{ListRequest, ListResponse, Pod};
use kas_proto::registry::AgentMeta;
use prost::Message;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Request, Status, Streaming};

/// The Pods module's list method.
pub const PODS_LIST: &str = "/kas.pods.Pods/List";

type Handler = Arc<dyn Fn(Vec<u8>) -> BoxFuture<'static, Result<Vec<u8>, Status>> + Send + Sync>;

/// The methods this agent serves, by full gRPC method name.
#[derive(Clone, Default)]
pub struct Modules {
    handlers: HashMap<String, Handler>,
}

impl Modules {
    /// Registers a unary method.
    pub fn unary<Req, Resp, F, Fut>(&mut self, method: &str, f: F)
    where
        Req: Message + Default + 'static,
        Resp: Message + 'static,
        F: Fn(Req) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Resp, Status>> + Send + 'static,
    {
        let f = Arc::new(f);
        let handler: Handler = Arc::new(move |bytes: Vec<u8>| {
            let f = f.clone();
            Box::pin(async move {
                let req = Req::decode(bytes.as_slice())
                    .map_err(|e| Status::invalid_argument(format!("malformed request: {e}")))?;
                Ok(f(req).await?.encode_to_vec())
            })
        });
        self.handlers.insert(method.to_string(), handler);
    }

    /// The Pods module answering from a fixed list of pods.
    pub fn with_fixture_pods(mut self, pods: Vec<Pod>) -> Self {
        let pods = Arc::new(pods);
        self.unary(PODS_LIST, move |req: ListRequest| {
            let pods = pods.clone();
            async move {
                let pods = pods
                    .iter()
                    .filter(|p| req.namespace.is_empty() || p.namespace == req.namespace)
                    .cloned()
                    .collect();
                Ok(ListResponse { pods })
            }
        });
        self
    }

    /// The registered method names, sorted.
    pub fn methods(&self) -> Vec<String> {
        let mut m: Vec<String> = self.handlers.keys().cloned().collect();
        m.sort();
        m
    }

    async fn call(&self, method: &str, request: Vec<u8>) -> Result<Vec<u8>, Status> {
        let handler = self
            .handlers
            .get(method)
            .ok_or_else(|| Status::unimplemented(format!("agent does not serve {method}")))?;
        handler(request).await
    }
}

/// A client of one kas's agent listener, authenticated with the agent token.
#[derive(Clone)]
pub struct AgentClient {
    client: AgentApiClient<Channel>,
    token: String,
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
    /// heartbeat every `heartbeat`. Returns the status that ended the tunnel.
    pub async fn serve_tunnel(
        &self,
        connection: ConnectionId,
        modules: Arc<Modules>,
        heartbeat: Duration,
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
        match Tunnel::new(tx, inbound, modules, heartbeat, sequence)
            .serve()
            .await
        {
            Ok(()) => Status::ok("kas closed the tunnel"),
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
}

impl Tunnel {
    fn new(
        tx: mpsc::Sender<Frame>,
        inbound: Streaming<Frame>,
        modules: Arc<Modules>,
        every: Duration,
        sequence: FrameSequence,
    ) -> Self {
        let mut heartbeat = tokio::time::interval(every);
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Tunnel {
            tx,
            inbound,
            modules,
            heartbeat,
            sequence,
            beats: 0,
        }
    }

    async fn beat(&mut self) -> Result<(), Status> {
        self.beats += 1;
        self.tx
            .send(frames::heartbeat(self.beats))
            .await
            .map_err(|_| Status::unavailable("tunnel closed"))
    }

    /// Receives the next frame from kas, heartbeating meanwhile. `None`: kas ended it.
    async fn next(&mut self) -> Result<Option<Frame>, Status> {
        loop {
            tokio::select! {
                biased;
                frame = self.inbound.message() => return frame,
                _ = self.heartbeat.tick() => self.beat().await?,
            }
        }
    }

    async fn serve(mut self) -> Result<(), Status> {
        let mut request: Option<(u64, String, Vec<u8>)> = None;
        loop {
            let Some(frame) = self.next().await? else {
                return Ok(());
            };
            self.sequence
                .check(Direction::ToAgent, &frame)
                .map_err(|e| Status::internal(format!("kas broke the tunnel protocol: {e}")))?;
            match frame.kind {
                Some(Kind::RequestStart(s)) => request = Some((s.request_id, s.method, Vec::new())),
                Some(Kind::Message(m)) => {
                    if let Some((_, _, body)) = &mut request {
                        body.extend_from_slice(&m.data);
                    }
                }
                Some(Kind::CloseSend(_)) => {
                    if let Some((id, method, body)) = request.take() {
                        self.answer(id, &method, body).await?;
                    }
                }
                _ => {}
            }
        }
    }

    /// Runs the module and sends its answer, heartbeating while it runs.
    async fn answer(&mut self, id: u64, method: &str, body: Vec<u8>) -> Result<(), Status> {
        let modules = self.modules.clone();
        let call = modules.call(method, body);
        tokio::pin!(call);
        let result = loop {
            tokio::select! {
                biased;
                r = &mut call => break r,
                _ = self.heartbeat.tick() => self.beat().await?,
            }
        };
        let out = match result {
            Ok(bytes) => vec![
                frames::message(id, bytes),
                frames::trailer(id, &Status::ok("")),
            ],
            Err(status) => vec![frames::trailer(id, &status)],
        };
        for f in out {
            self.sequence
                .check(Direction::FromAgent, &f)
                .map_err(|e| Status::internal(format!("agent answer out of order: {e}")))?;
            self.tx
                .send(f)
                .await
                .map_err(|_| Status::unavailable("tunnel closed"))?;
        }
        Ok(())
    }
}
