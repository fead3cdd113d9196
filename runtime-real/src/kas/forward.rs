//! Sending a call to the kas that holds a tunnel of its agent (kas -> kas, private API).
//!
//! A refusal — the kas is unreachable, rejects the request, or answers with an `Error`
//! frame — means no agent saw the call, and the router may try another kas. Anything
//! after the first answer frame is relayed to the caller and the call is never retried.

use super::call::{Call, REST_FRAMES};
use super::engine::EngineHandle;
use super::metrics::Metrics;
use super::timing::FORWARD_DRAIN;
use crate::buggify::{self, Point};
use crate::channel_ends::{recv, reserve};
use crate::clock;
use crate::frames;
use crate::jwt::Signer;
use kas_core::fixed_hash::Map;
use kas_core::frame_sequence::{Direction, FrameSequence, Progress, StreamKind};
use kas_core::node::NodeInput;
use kas_core::{KasId, RequestId};
use kas_proto::frame::{Frame, frame::Kind};
use kas_proto::private_api::kas_private_client::KasPrivateClient;

use crate::tls::KasUrl;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::Status;
use tonic::transport::Channel;

/// Opens (and reuses) connections to other kas and runs forwards.
#[derive(Clone)]
pub struct Forwarder {
    /// Connections by kas, with when each was last used.
    channels: Arc<Mutex<Map<KasId, (Channel, Instant)>>>,
    signer: Signer,
    metrics: Metrics,
    /// `agent.max_message_size`: the largest answer frame accepted from another kas.
    max_message_size: usize,
    /// How other kas are dialled.
    private_tls: PrivateTls,
}

/// Whether other kas's private listeners serve TLS (as this kas's does: replicas share one
/// configuration), and the CA file their certificates chain to (the system's roots
/// without one).
#[derive(Clone, Debug)]
pub struct PrivateTls {
    /// TLS or plaintext.
    pub tls: bool,
    /// `private_api.listen.ca_certificate_file`.
    pub ca_file: Option<std::path::PathBuf>,
}

/// A connection to a kas unused this long is dropped: kas replicas come and go with their
/// addresses, and the table must not grow with every one ever seen.
const IDLE_CHANNEL: Duration = Duration::from_secs(300);

/// How a forward ended.
enum Forwarded {
    /// Not delivered: the router may try elsewhere.
    Refused(String),
    /// Delivered (completely or not): the call is over.
    Done,
}

impl Forwarder {
    /// Forwards sign their requests with `signer` (the kas-only secret) and accept answer
    /// frames up to `max_message_size` bytes.
    pub fn new(
        signer: Signer,
        metrics: Metrics,
        max_message_size: usize,
        private_tls: PrivateTls,
    ) -> Self {
        Forwarder {
            channels: Arc::default(),
            signer,
            metrics,
            private_tls,
            max_message_size,
        }
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
            match this.forward(&kas, request, call, started, &engine).await {
                Forwarded::Done => engine.input(NodeInput::CallDone(request)),
                Forwarded::Refused(why) => {
                    tracing::debug!(%kas, %request, %why, "forward refused");
                    engine.input(NodeInput::Bounced(request));
                }
            }
        }
    }

    fn channel(&self, kas: &KasId) -> Result<Channel, String> {
        let mut channels = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        if let Some((c, used)) = channels.get_mut(kas) {
            *used = now;
            return Ok(c.clone());
        }
        let url = KasUrl::parse(&kas.0)
            .map(|url| KasUrl {
                tls: self.private_tls.tls,
                ..url
            })
            .map_err(|e| format!("bad kas address: {e}"))?;
        let channel = crate::tls::connect_lazy(
            &url,
            self.private_tls.ca_file.as_deref(),
            Duration::from_secs(2),
        )?;
        channels.retain(|_, (_, used)| now.duration_since(*used) < IDLE_CHANNEL);
        channels.insert(kas.clone(), (channel.clone(), now));
        Ok(channel)
    }

    /// Drops the connection to a kas that could not be reached: the next forward there
    /// connects afresh, and a kas that is gone for good leaves the table.
    fn forget(&self, kas: &KasId) {
        let mut channels = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        channels.remove(kas);
    }

    async fn forward(
        &self,
        kas: &KasId,
        request: RequestId,
        call: Call,
        started: tokio::time::Instant,
        engine: &EngineHandle,
    ) -> Forwarded {
        let channel = match self.channel(kas) {
            Ok(c) => c,
            Err(e) => return Forwarded::Refused(e),
        };
        let id = request.0;
        let mut sequence = FrameSequence::new(StreamKind::Forward);
        let up = call.frames(id, 1);
        for f in &up {
            if let Err(e) = sequence.check(Direction::ToAgent, f) {
                let _ = call
                    .responses
                    .send(Err(Status::internal(format!("malformed call: {e}"))))
                    .await;
                return Forwarded::Done;
            }
        }
        // The call's frames go out only once the serving kas has answered the stream's
        // headers. A forward that fails before that has sent nothing, so it is safe to
        // offer elsewhere; one that fails later may have been delivered (at most once:
        // found by the simulation, where a forward timed out after the serving kas had
        // delivered it and the call was then delivered a second time elsewhere).
        let (frames_tx, frames_rx) = mpsc::channel(up.len().max(REST_FRAMES));
        let mut req = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(frames_rx));
        req.set_timeout(clock::until(call.deadline).max(Duration::from_millis(1)));
        match self.signer.bearer().parse() {
            Ok(v) => {
                req.metadata_mut().insert("authorization", v);
            }
            Err(_) => return Forwarded::Refused("token is not valid metadata".into()),
        }
        let mut client =
            KasPrivateClient::new(channel).max_decoding_message_size(self.max_message_size);
        let mut inbound = match client.forward(req).await {
            Ok(resp) => resp.into_inner(),
            Err(status) => {
                if status.code() == tonic::Code::Unavailable {
                    self.forget(kas);
                }
                return Forwarded::Refused(status.to_string());
            }
        };
        buggify::pause(Point::ForwardAfterHeaders).await;
        for f in up {
            // Capacity holds every frame; a closed stream shows as the answer's error below.
            let _ = frames_tx.try_send(f);
        }
        // A buffered request is complete: its end goes with it. The rest of a streaming
        // call's request goes on once the serving kas says it delivered the call.
        let mut frames_tx = call.rest.is_some().then_some(frames_tx);
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
                    Err(_) => return drain(&mut inbound).await,
                },
                // A delivered streaming call is this forward's to end when its caller goes
                // away (kas's node leaves it here), even while nothing comes back.
                () = call.responses.closed(), if call.is_streaming() && !first => {
                    return drain(&mut inbound).await;
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
                frame = buggify::read(inbound.message()), if to_caller.is_none() && !finished => {
                    let frame = match frame {
                        // The serving kas numbers the call its own way.
                        Ok(Some(f)) => frames::with_request_id(f, id),
                        Ok(None) if first => {
                            return Forwarded::Refused("stream ended without an answer".into());
                        }
                        Ok(None) => {
                            let status = Status::unavailable(format!("kas {kas} ended the call without a trailer"));
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
                            return Forwarded::Refused(e.message.clone());
                        }
                        self.metrics
                            .routing_latency
                            .observe(started.elapsed().as_secs_f64());
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
                    if let Some(Kind::Delivered(_)) = frame.kind {
                        engine.input(NodeInput::Delivered(request));
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
                return drain(&mut inbound).await;
            }
        }
    }
}

/// Reads the stream to its end (the serving kas ends it right after the call's), for at
/// most [`FORWARD_DRAIN`], then lets it go. Dropping it before would reset the HTTP/2
/// stream, and a server that sees many resets on one connection closes it with
/// ENHANCE_YOUR_CALM (h2's reset-flood guard), failing every call on it: found by kas-bench
/// at concurrency 16, after a relayed trailer, and again when callers that had read a
/// response's announced length let go before its trailer came. A call that has not ended
/// by then is cancelled by the reset.
async fn drain(inbound: &mut tonic::Streaming<Frame>) -> Forwarded {
    let _ = tokio::time::timeout(FORWARD_DRAIN, async {
        while let Ok(Some(_)) = inbound.message().await {}
    })
    .await;
    Forwarded::Done
}

/// What the caller is told when the stream to the serving kas broke mid-call. A broken
/// connection surfaces as Unknown; the caller should read Unavailable (retryable).
fn lost(kas: &KasId, status: Status) -> Status {
    if super::tunnel::too_large(&status) {
        Status::resource_exhausted(format!(
            "the answer relayed by kas {kas} is over agent.max_message_size: {}",
            status.message()
        ))
    } else if status.code() == tonic::Code::Unknown {
        Status::unavailable(format!(
            "lost the connection to kas {kas} during the call: {}",
            status.message()
        ))
    } else {
        status
    }
}

#[cfg(all(test, not(madsim)))]
mod tests {
    use super::*;
    use crate::jwt::Secret;

    fn forwarder() -> Forwarder {
        let secret = Secret::from_base64("c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0LXNlY3JldA==")
            .expect("a secret");
        let signer = Signer::new(&secret, "kas", "kas");
        let plain = PrivateTls {
            tls: false,
            ca_file: None,
        };
        Forwarder::new(signer, Metrics::default(), 1 << 20, plain)
    }

    fn held(f: &Forwarder) -> Vec<String> {
        let channels = f.channels.lock().unwrap();
        let mut held: Vec<String> = channels.keys().map(|k| k.0.clone()).collect();
        held.sort();
        held
    }

    #[tokio::test(start_paused = true)]
    async fn connections_to_kas_unused_for_a_while_are_dropped() {
        let f = forwarder();
        let (a, b, c) = (
            KasId("127.0.0.1:1".into()),
            KasId("127.0.0.1:2".into()),
            KasId("127.0.0.1:3".into()),
        );
        f.channel(&a).unwrap();
        f.channel(&b).unwrap();
        tokio::time::advance(IDLE_CHANNEL / 2).await;
        f.channel(&b).unwrap(); // used again: kept
        tokio::time::advance(IDLE_CHANNEL / 2 + Duration::from_secs(1)).await;
        f.channel(&c).unwrap();
        assert_eq!(held(&f), ["127.0.0.1:2", "127.0.0.1:3"]);
        f.forget(&b);
        assert_eq!(held(&f), ["127.0.0.1:3"]);
    }
}
