//! Sending a call to the kas that holds a tunnel of its agent (kas -> kas, private API).
//!
//! A refusal — the kas is unreachable, rejects the request, or answers with an `Error`
//! frame — means no agent saw the call, and the router may try another kas. Anything
//! after the first answer frame is relayed to the caller and the call is never retried.

use super::call::{Call, Delivery, REST_FRAMES};
use super::handle::EngineHandle;
use super::metrics::Metrics;
use super::peers::{self, Peers, Request};
use crate::buggify::{self, Point};
use kas_core::frame_sequence::{Direction, FrameSequence, Progress, StreamKind};
use kas_core::node::NodeInput;
use kas_core::{ConnectionId, KasId, RequestId};
use kas_proto::frame::{Frame, frame::Kind};
use kas_transport::channel_ends::{recv, reserve};
use kas_transport::clock;
use kas_transport::frames;
use kas_transport::traces::{
    self, Context, KeyValue, SpanKind, Status as SpanStatus, TraceContextExt,
};
use std::time::Duration;
use tokio::sync::mpsc;
use tonic::{Status, Streaming};

/// Runs forwards over the connections to other kas.
#[derive(Clone)]
pub struct Forwarder {
    peers: Peers,
    metrics: Metrics,
}

/// How a forward ended.
enum Forwarded {
    /// Not delivered: the router may try elsewhere.
    Refused(String),
    /// Not delivered: every tunnel of the agent on that kas was busy.
    Busy(String),
    /// Delivered (completely or not): the call is over.
    Done,
}

impl Forwarder {
    /// Forwards go over `peers`.
    pub fn new(peers: Peers, metrics: Metrics) -> Self {
        Forwarder { peers, metrics }
    }

    /// Forwards `call` to `kas` (`waited` after its arrival), then reports `CallDone` or
    /// `Bounced`.
    pub fn run(
        &self,
        kas: KasId,
        request: RequestId,
        call: Call,
        waited: Duration,
        engine: EngineHandle,
    ) -> impl Future<Output = ()> + Send + 'static {
        let this = self.clone();
        let started = tokio::time::Instant::now()
            .checked_sub(waited)
            .unwrap_or_else(tokio::time::Instant::now);
        async move {
            let start = call.start.clone();
            let trace = traces::child("kas", "kas.forward", SpanKind::Client, &call.trace, || {
                vec![
                    KeyValue::new("kas.peer", kas.0.clone()),
                    KeyValue::new("kas.agent_id", call.agent.0),
                ]
            });
            let forwarded = this
                .forward(&kas, request, call, started, &engine, &trace)
                .await;
            let span = trace.span();
            match forwarded {
                Forwarded::Done => {
                    span.set_attribute(KeyValue::new("kas.outcome", "delivered"));
                    engine.input(NodeInput::CallDone(request));
                }
                Forwarded::Refused(why) => {
                    tracing::debug!(%kas, %request, correlation_id = start.correlation_id(), trace_id = traces::trace_id(&trace).as_deref(), %why, "forward refused");
                    span.set_attribute(KeyValue::new("kas.outcome", "refused"));
                    span.set_status(SpanStatus::error(why));
                    engine.input(NodeInput::Bounced(request));
                }
                Forwarded::Busy(why) => {
                    tracing::debug!(%kas, %request, correlation_id = start.correlation_id(), trace_id = traces::trace_id(&trace).as_deref(), %why, "forward refused: tunnels busy");
                    span.set_attribute(KeyValue::new("kas.outcome", "busy"));
                    span.set_status(SpanStatus::error(why));
                    engine.input(NodeInput::BouncedBusy(request));
                }
            }
        }
    }

    async fn forward(
        &self,
        kas: &KasId,
        request: RequestId,
        call: Call,
        started: tokio::time::Instant,
        engine: &EngineHandle,
        trace: &Context,
    ) -> Forwarded {
        let id = request.0;
        let mut sequence = FrameSequence::new(StreamKind::Forward);
        let up = call.frames_to_kas(id, trace);
        for f in &up {
            if let Err(e) = sequence.check(Direction::ToAgent, f) {
                let _ = call
                    .responses
                    .send(Err(Status::internal(format!("malformed call: {e}"))))
                    .await;
                return Forwarded::Done;
            }
        }
        let Sent {
            mut inbound,
            rest: mut frames_tx,
            first,
        } = match self.send(kas, &call, id, up, trace).await {
            Ok(sent) => sent,
            Err(e) => return Forwarded::Refused(e),
        };
        let mut first_answer = Some(first);
        let mut rest = None;
        let mut to_peer = None;
        let mut to_caller = None;
        let mut first = true;
        let mut finished = false;
        loop {
            let mut request_over = false;
            tokio::select! {
                biased;
                permit = call.responses.reserve(), if to_caller.is_some() => match permit {
                    Ok(permit) => permit.send(Ok(to_caller.take().expect("guarded"))),
                    Err(_) => return drain(inbound).await,
                },
                // A delivered streaming call is this forward's to end when its caller goes
                // away (kas's node leaves it here), even while nothing comes back.
                () = call.responses.closed(), if call.is_streaming() && !first => {
                    return drain(inbound).await;
                }
                permit = reserve(&frames_tx), if to_peer.is_some() => match permit {
                    Some(permit) => permit.send(to_peer.take().expect("guarded")),
                    // The stream is closed: its answer says why.
                    None => request_over = true,
                },
                frame = recv(&mut rest), if to_peer.is_none() && !finished => match frame {
                    Some(frame) => to_peer = Some(frames::with_request_id(frame, id)),
                    // Closed or not, the request is over; a stream ended without a
                    // close-send tells the serving kas the caller went away.
                    None => request_over = true,
                },
                frame = async {
                    match first_answer.take() {
                        Some(answer) => answer,
                        None => buggify::read(inbound.message()).await,
                    }
                }, if to_caller.is_none() && !finished => {
                    let frame = match frame {
                        // The serving kas numbers the call its own way.
                        Ok(Some(f)) => frames::with_request_id(f, id),
                        Ok(None) if first => {
                            return Forwarded::Refused("stream ended without an answer".into());
                        }
                        Ok(None) => {
                            let status = Status::unknown(format!("kas {kas} ended its stream during the call, without a trailer"));
                            let _ = call.responses.send(Err(status)).await;
                            return Forwarded::Done;
                        }
                        Err(status) => {
                            // Possibly delivered: at most once, so no retry.
                            let _ = call.responses.send(Err(lost(kas, status))).await;
                            return Forwarded::Done;
                        }
                    };
                    if first {
                        if let Some(Kind::Error(e)) = &frame.kind {
                            let why = e.message.clone();
                            return match tonic::Code::from(e.code) {
                                tonic::Code::ResourceExhausted => Forwarded::Busy(why),
                                _ => Forwarded::Refused(why),
                            };
                        }
                        self.metrics
                            .routing_latency
                            .observe(started.elapsed().as_secs_f64());
                        // Taken (delivered, or answered): the routing is over.
                        call.trace.span().end();
                        first = false;
                    }
                    let progress = match sequence.check(Direction::FromAgent, &frame) {
                        Ok(p) => p,
                        Err(e) => {
                            let msg = format!("kas {kas} broke the forward protocol: {e}");
                            let _ = call.responses.send(Err(Status::internal(msg))).await;
                            return Forwarded::Done;
                        }
                    };
                    if let Some(Kind::Delivered(d)) = &frame.kind {
                        engine.input(NodeInput::Delivered(request));
                        call.delivered_to.set(Delivery {
                            kas: Some(kas.clone()),
                            connection: d.connection_id.map(ConnectionId),
                        });
                        rest = call.rest.as_ref().and_then(|r| r.take());
                        continue;
                    }
                    if let Progress::Finished(_) = progress {
                        finished = true;
                        request_over = true;
                    }
                    to_caller = Some(frame);
                }
            }
            if request_over {
                (frames_tx, rest, to_peer) = (None, None, None);
            }
            if finished && to_caller.is_none() {
                return drain(inbound).await;
            }
        }
    }

    /// Sends the call (`up`: its frames for this hop, numbered `id`) down a stream to
    /// `kas` and reads the serving kas's first answer. A stream opened ahead that refuses
    /// (its kas ended it before the call came: see [`peers`]) is tried once more on a
    /// stream opened now: nothing was delivered.
    async fn send(
        &self,
        kas: &KasId,
        call: &Call,
        id: u64,
        mut up: Vec<Frame>,
        trace: &Context,
    ) -> Result<Sent, String> {
        let mut ahead = true;
        loop {
            // Only on a stream whose headers the serving kas answered (see `peers`).
            let opened = self.peers.take(kas, ahead).await?;
            buggify::pause(Point::ForwardAfterHeaders).await;
            // A buffered request is complete: its end goes with it. The rest of a
            // streaming call's request goes on once the serving kas says it delivered
            // the call.
            let (frames_tx, rest) = match call.rest.is_some() {
                true => {
                    let (tx, rx) = mpsc::channel(REST_FRAMES);
                    (Some(tx), Some(rx))
                }
                false => (None, None),
            };
            let was_ahead = opened.ahead;
            stamp_deadline(&mut up, call, opened.age());
            let mut inbound = opened.send(Request { up, rest });
            let answer = buggify::read(inbound.message()).await;
            let refused = matches!(
                &answer,
                Ok(Some(Frame {
                    kind: Some(Kind::Error(_))
                }))
            );
            if was_ahead && refused {
                tokio::spawn(peers::drain(inbound));
                ahead = false;
                up = call.frames_to_kas(id, trace);
                continue;
            }
            return Ok(Sent {
                inbound,
                rest: frames_tx,
                first: answer,
            });
        }
    }
}

/// A call sent to the serving kas.
struct Sent {
    /// The serving kas's answer.
    inbound: Streaming<Frame>,
    /// Where a streaming call's later frames go.
    rest: Option<mpsc::Sender<Frame>>,
    /// What the serving kas answered first.
    first: Result<Option<Frame>, Status>,
}

/// Sets the call's deadline in its start frame (`up`'s first), counted from the opening
/// of the stream it goes down, `age` ago.
fn stamp_deadline(up: &mut [Frame], call: &Call, age: Duration) {
    if let Some(Frame {
        kind: Some(Kind::RequestStart(start)),
    }) = up.first_mut()
    {
        let ms = (age + clock::until(call.deadline)).as_millis();
        start.deadline_millis = Some(u64::try_from(ms).unwrap_or(u64::MAX));
    }
}

/// Reads the stream to its end (the serving kas ends it right after the call's): see
/// [`peers::drain`].
async fn drain(inbound: Streaming<Frame>) -> Forwarded {
    peers::drain(inbound).await;
    Forwarded::Done
}

/// What the caller is told when the stream to the serving kas broke mid-call (it may
/// have handed the call to the agent). The serving kas refuses with an `Error` frame, never
/// with the stream's status, so a status here is a broken connection or a broken protocol.
/// A broken connection surfaces as Unknown (an I/O error) or Unavailable (HTTP/2 keepalive
/// timed out; madsim's reset), and the caller reads both as Unknown: `Unavailable` would
/// tell it the call was not delivered, and it would send it again (the fleet test saw a
/// list served twice).
fn lost(kas: &KasId, status: Status) -> Status {
    if super::tunnel::too_large(&status) {
        Status::resource_exhausted(format!(
            "the answer relayed by kas {kas} is over agent.max_message_size: {}",
            status.message()
        ))
    } else if matches!(
        status.code(),
        tonic::Code::Unknown | tonic::Code::Unavailable
    ) {
        Status::unknown(format!(
            "lost the connection to kas {kas} during the call, which may have reached the agent: {}",
            status.message()
        ))
    } else {
        status
    }
}

#[cfg(all(test, not(madsim)))]
mod tests {
    use super::*;

    #[test]
    fn a_broken_forward_never_tells_the_caller_it_was_not_delivered() {
        let kas = KasId("10.0.0.2:8155".into());
        for broken in [
            Status::unavailable("keep-alive timed out"),
            Status::unknown("transport error"),
        ] {
            let told = lost(&kas, broken);
            assert_eq!(told.code(), tonic::Code::Unknown, "{told:?}");
            assert!(told.message().contains("during the call"), "{told:?}");
        }
        let protocol = lost(&kas, Status::internal("h2 protocol error"));
        assert_eq!(protocol.code(), tonic::Code::Internal);
        let big = lost(&kas, Status::out_of_range("message too large"));
        assert_eq!(big.code(), tonic::Code::ResourceExhausted);
    }
}
