//! The private listener (kas -> kas): serves a forwarded call from this kas's own tunnels,
//! never routing it further, so a call takes at most two kas hops.

use super::call::{Call, Rest};
use super::deadline::{deadline, deadline_after};
use super::handle::{CancelOnDrop, EngineHandle};
use super::stopping::{Phase, Stop};
use kas_core::frame_sequence::{Direction, FrameSequence, StreamKind};
use kas_core::node::Origin;
use kas_core::{AgentId, ConnectionId, KasId, Time};
use kas_proto::frame::{Frame, RequestStart, frame::Kind};
use kas_proto::private_api::kas_private_server::KasPrivate;
use kas_transport::frames;
use kas_transport::traces::{self, KeyValue, SpanKind};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// Request bytes buffered per forwarded call at most.
const MAX_REQUEST_BYTES: usize = 16 << 20;

/// The header a forward stream's token may come in instead of `authorization`
/// (`Bearer <jwt>` either way). HTTP/2 never indexes an `authorization` value in its header
/// table (h2, like nghttp2, guards low-entropy secrets so), so the kas -> kas token, the
/// same for a minute, was Huffman-coded on every stream and decoded on the other side
/// (about 9,000 instructions of a remote call's 378,000: docs/benchmarks.md). Under this name it is sent once
/// per connection and then as an index. HPACK only matches whole values, and a signed
/// token cannot be guessed whole, so indexing it gives a compression oracle nothing.
pub const TOKEN_HEADER: &str = "kas-private-token";

/// The answer header by which a kas says it takes [`TOKEN_HEADER`]: a routing kas sends the
/// token under it only on a connection that said so, so that an older kas (a rolling
/// upgrade, a rollback) keeps receiving `authorization`.
pub const TOKEN_HEADER_TAKEN: &str = "kas-private-token-taken";

/// The private API service.
pub struct PrivateService {
    /// The engine.
    pub engine: EngineHandle,
    /// Deadline of calls without `grpc-timeout`.
    pub default_timeout: Duration,
    /// Longest deadline honoured.
    pub max_timeout: Duration,
    /// True once this kas is stopping: streams still waiting for a call are refused.
    pub stop: Stop,
    /// This kas, as its spans name it.
    pub kas: KasId,
}

/// The answer stream of a forwarded call; dropping it (the routing kas went away) cancels
/// the call.
pub struct Answer {
    rx: ReceiverStream<Result<Frame, Status>>,
    _cancel: CancelOnDrop,
}

impl Stream for Answer {
    type Item = Result<Frame, Status>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.rx).poll_next(cx)
    }
}

#[tonic::async_trait]
impl KasPrivate for PrivateService {
    type ForwardStream = Answer;

    async fn forward(
        &self,
        req: Request<Streaming<Frame>>,
    ) -> Result<Response<Self::ForwardStream>, Status> {
        // How long the stream waits for its call: it may be opened ahead of it.
        let opened = kas_transport::clock::now();
        let wait = deadline(req.metadata(), self.default_timeout, self.max_timeout);
        let mut inbound = req.into_inner();
        let id = self.engine.next_request_id();
        let (tx, rx) = mpsc::channel(16);
        let engine = self.engine.clone();
        let (stop, max_timeout) = (self.stop.clone(), self.max_timeout);
        let kas = self.kas.clone();
        tokio::spawn(async move {
            let mut sequence = FrameSequence::new(StreamKind::Forward);
            let waiting = Waiting {
                opened,
                wait,
                max_timeout,
                stop,
            };
            let (start, requests, deadline) =
                match receive(&mut inbound, &mut sequence, waiting).await {
                    Ok(call) => call,
                    Err(Unread::Quiet) => return,
                    Err(Unread::Refused(status)) => {
                        // Nothing delivered: the routing kas may offer the call elsewhere.
                        let _ = tx.send(Ok(frames::error(id.0, &status))).await;
                        return;
                    }
                    Err(Unread::Failed(status)) => {
                        let _ = tx.send(Err(status)).await;
                        return;
                    }
                };
            let (rest_tx, rest) = match start.streaming {
                true => {
                    let (rest_tx, rest) = Rest::channel();
                    (Some(rest_tx), Some(rest))
                }
                false => (None, None),
            };
            // The serving kas's span of the call: from its arrival until its last frame
            // (it ends with the call's last clone).
            let parent = traces::from_metadata(&start.metadata);
            let trace = traces::child("kas", "kas.serve", SpanKind::Server, &parent, || {
                vec![
                    KeyValue::new("kas.id", kas.0),
                    KeyValue::new("kas.agent_id", start.agent_id),
                ]
            });
            let call = Call {
                agent: AgentId(start.agent_id),
                connection: start.connection_id.map(ConnectionId),
                deadline,
                start: Arc::new(start),
                requests: Arc::new(requests),
                rest,
                responses: tx,
                delivered_to: Default::default(),
                trace,
            };
            let responses = call.responses.clone();
            if let Err(status) = engine.submit(id, Origin::Private, call) {
                // Not delivered: a refusal, so the forwarding kas may try another.
                let _ = responses.send(Ok(frames::error(id.0, &status))).await;
                return;
            }
            if let Some(rest_tx) = rest_tx {
                pump(&mut inbound, &mut sequence, &rest_tx).await;
            }
        });
        let mut answer = Response::new(Answer {
            rx: ReceiverStream::new(rx),
            _cancel: CancelOnDrop::new(self.engine.clone(), id),
        });
        let taken = tonic::metadata::MetadataValue::from_static("1");
        answer.metadata_mut().insert(TOKEN_HEADER_TAKEN, taken);
        Ok(answer)
    }
}

/// How long a forward stream waits for its call, which may come well after the stream
/// was opened (ahead of it).
struct Waiting {
    /// When its headers came.
    opened: Time,
    /// Its own deadline (`grpc-timeout`): the wait for a call.
    wait: Time,
    max_timeout: Duration,
    /// True once this kas is stopping.
    stop: Stop,
}

/// Why a forward stream carries no call to deliver.
enum Unread {
    /// The routing kas let a stream it opened ahead go unused.
    Quiet,
    /// Not taken (this kas is stopping, no call came, or it came past its deadline): an
    /// `Error` frame tells the routing kas nothing was delivered.
    Refused(Status),
    /// The call broke the protocol.
    Failed(Status),
}

/// Waits for the call on a forward stream and reads it: its start, its buffered request
/// frames, and its deadline (counted from the stream's opening, see
/// `RequestStart.deadline_millis`).
async fn receive(
    inbound: &mut Streaming<Frame>,
    sequence: &mut FrameSequence,
    mut waiting: Waiting,
) -> Result<(RequestStart, Vec<Frame>, Time), Unread> {
    let first = tokio::select! {
        first = tokio::time::timeout(kas_transport::clock::until(waiting.wait), next(inbound, sequence)) => first,
        () = waiting.stop.until(Phase::Closing) => {
            return Err(Unread::Refused(Status::unavailable("kas is stopping")));
        }
    };
    let first = match first {
        Ok(Ok(Some(first))) => first,
        Ok(Ok(None)) => return Err(Unread::Quiet),
        Ok(Err(status)) => return Err(malformed(status)),
        Err(_) => {
            let status = Status::deadline_exceeded("no call came on this forward stream");
            return Err(Unread::Refused(status));
        }
    };
    let deadline = match &first.kind {
        Some(Kind::RequestStart(RequestStart {
            deadline_millis: Some(ms),
            ..
        })) => deadline_after(
            waiting.opened,
            Duration::from_millis(*ms),
            waiting.max_timeout,
        ),
        _ => waiting.wait,
    };
    if deadline <= kas_transport::clock::now() {
        // Held up on the way past its deadline: the routing kas has given up on it.
        let status = Status::deadline_exceeded("the call came after its deadline");
        return Err(Unread::Refused(status));
    }
    let read = tokio::time::timeout(
        kas_transport::clock::until(deadline),
        read_call(first, inbound, sequence),
    );
    match read.await {
        Ok(Ok((start, requests))) => Ok((start, requests, deadline)),
        Ok(Err(status)) => Err(malformed(status)),
        Err(_) => Err(Unread::Failed(Status::deadline_exceeded(
            "call not received by its deadline",
        ))),
    }
}

fn malformed(status: Status) -> Unread {
    tracing::info!(error = %status.message(), "malformed forwarded call refused");
    Unread::Failed(status)
}

/// Reads `RequestStart, Message*, CloseSend` (a streaming call: its `RequestStart`
/// alone), checking the grammar and the hop count.
async fn read_call(
    first: Frame,
    inbound: &mut Streaming<Frame>,
    sequence: &mut FrameSequence,
) -> Result<(RequestStart, Vec<Frame>), Status> {
    let mut start = None;
    let mut requests = Vec::new();
    let mut bytes = 0usize;
    let mut first = Some(first);
    loop {
        let frame = match first.take() {
            Some(f) => f,
            None => next(inbound, sequence).await?.ok_or_else(|| {
                Status::invalid_argument("forward stream ended before close-send")
            })?,
        };
        match &frame.kind {
            Some(Kind::RequestStart(s)) => {
                if s.hops != 1 {
                    return Err(Status::invalid_argument(format!(
                        "forwarded call has hop count {}, expected 1: kas never forwards a forwarded call",
                        s.hops
                    )));
                }
                if s.streaming {
                    return Ok((s.clone(), requests));
                }
                start = Some(s.clone());
            }
            Some(Kind::Message(m)) => {
                bytes += m.data.len();
                if bytes > MAX_REQUEST_BYTES {
                    return Err(Status::resource_exhausted(
                        "forwarded request exceeds 16 MiB",
                    ));
                }
                requests.push(frame);
            }
            Some(Kind::CloseSend(_)) => {
                requests.push(frame);
                let start = start.ok_or_else(|| Status::invalid_argument("no request start"))?;
                return Ok((start, requests));
            }
            _ => {}
        }
    }
}

/// The next request frame from the routing kas, checked.
async fn next(
    inbound: &mut Streaming<Frame>,
    sequence: &mut FrameSequence,
) -> Result<Option<Frame>, Status> {
    let Some(frame) = inbound.message().await? else {
        return Ok(None);
    };
    sequence
        .check(Direction::ToAgent, &frame)
        .map_err(|e| Status::invalid_argument(format!("forward protocol error: {e}")))?;
    Ok(Some(frame))
}

/// Passes a streaming call's request frames on to whichever tunnel delivers it, until its
/// close-send. Ending without one (the stream broke, or broke the protocol) drops the
/// sender, which the tunnel takes for the caller going away.
async fn pump(
    inbound: &mut Streaming<Frame>,
    sequence: &mut FrameSequence,
    rest: &mpsc::Sender<Frame>,
) {
    loop {
        match next(inbound, sequence).await {
            Ok(Some(frame)) => {
                let close = matches!(frame.kind, Some(Kind::CloseSend(_)));
                if rest.send(frame).await.is_err() || close {
                    return;
                }
            }
            Ok(None) => return,
            Err(status) => {
                tracing::info!(error = %status.message(), "forwarded request stream broke");
                return;
            }
        }
    }
}
