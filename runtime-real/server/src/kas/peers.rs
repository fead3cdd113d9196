//! Connections to the other kas, and forward streams opened on them ahead of calls.
//!
//! A forward's frames go out only on a stream whose headers the serving kas has answered:
//! a stream that fails before that has carried nothing, so its call may be offered
//! elsewhere (at most once: found by the simulation, where a forward timed out after the
//! serving kas had delivered it and the call was then delivered a second time elsewhere).
//! Opening that stream per call put a round trip on the remote route; streams are opened
//! ahead instead, and a call takes one whose headers are already answered. The serving kas
//! ends an idle stream with an `Error` frame (it waited too long, or is stopping), which a
//! call sent down it at that moment reads as a refusal: nothing was delivered.
//!
//! Several connections per peer carry the streams in turn, so that the remote route is not
//! held to one HTTP/2 connection's task.

use super::timing::FORWARD_DRAIN;
use futures::{FutureExt, StreamExt, stream};
use kas_auth::jwt::Signer;
use kas_core::KasId;
use kas_core::fixed_hash::Map;
use kas_proto::frame::Frame;
use kas_proto::private_api::kas_private_client::KasPrivateClient;
use kas_transport::tls::KasUrl;
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Status, Streaming};

/// Whether other kas's private listeners serve TLS (as this kas's does: replicas share one
/// configuration), and the CA file their certificates chain to (the system's roots
/// without one).
#[derive(Clone, Debug)]
pub struct PrivateTls {
    /// TLS or plaintext.
    pub tls: bool,
    /// `private_api.listen.ca_certificate_file`.
    pub ca_file: Option<PathBuf>,
}

/// A peer unused this long is dropped: kas replicas come and go with their addresses, and
/// the table must not grow with every one ever seen.
const IDLE_PEER: Duration = Duration::from_secs(300);
/// How long the serving kas keeps a stream opened ahead waiting for its call (its
/// `grpc-timeout`).
pub const OPENED_WAIT: Duration = Duration::from_secs(30);
/// A stream opened ahead is taken only this long after its opening: well inside
/// [`OPENED_WAIT`], so that the serving kas does not end it as the call goes out.
const OPENED_FRESH: Duration = Duration::from_secs(10);
/// Streams kept open ahead per peer: the count grows (doubling) when a call finds none,
/// and shrinks by one for each that goes stale unused.
const MIN_READY: usize = 2;
const MAX_READY: usize = 512;

/// Connections per peer: one per core (2 to 8), as each connection is driven by one task.
/// A fixed 2 in the simulation, whose runs must not depend on the machine.
pub fn connections() -> usize {
    #[cfg(madsim)]
    let n = 2;
    #[cfg(not(madsim))]
    let n = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8));
    n
}

/// The other kas: connections by kas, and streams opened ahead on them.
#[derive(Clone)]
pub struct Peers {
    table: Arc<Mutex<Map<KasId, Peer>>>,
    dial: Arc<Dial>,
}

/// How peers are reached.
struct Dial {
    signer: Signer,
    /// `agent.max_message_size`: the largest answer frame accepted from another kas.
    max_message_size: usize,
    tls: PrivateTls,
    /// Connections per peer.
    connections: usize,
}

struct Peer {
    channels: Vec<Channel>,
    /// The channel the next stream opens on.
    next: usize,
    used: Instant,
    ready: VecDeque<Opened>,
    /// Streams being opened ahead.
    opening: usize,
    /// Streams to keep ready.
    target: usize,
}

/// A forward stream that carries nothing yet; the serving kas has answered its headers.
pub struct Opened {
    send: oneshot::Sender<Request>,
    /// The serving kas's answer.
    inbound: Streaming<Frame>,
    opened: Instant,
    /// Opened ahead of the call that took it (not for it).
    pub ahead: bool,
}

/// What a forward sends: the call's frames known so far, then (for a streaming call) the
/// rest as it comes.
pub struct Request {
    /// The call's start and buffered frames.
    pub up: Vec<Frame>,
    /// A streaming call's later frames.
    pub rest: Option<mpsc::Receiver<Frame>>,
}

impl Opened {
    /// Sends the call down the stream. A stream gone meanwhile shows in its answer.
    pub fn send(self, request: Request) -> Streaming<Frame> {
        let _ = self.send.send(request);
        self.inbound
    }

    /// How long ago its headers were answered.
    pub fn age(&self) -> Duration {
        self.opened.elapsed()
    }

    /// Lets an unused stream go: its request ends empty, which the serving kas ends
    /// quietly, and its end is read so that no HTTP/2 reset is sent ([`drain`]).
    fn retire(self) {
        let Opened { send, inbound, .. } = self;
        drop(send);
        tokio::spawn(drain(inbound));
    }

    /// True when it may carry a call: fresh, and nothing came back on it yet (whatever
    /// comes before a call is the serving kas ending it).
    fn usable(&mut self, now: Instant) -> bool {
        now.duration_since(self.opened) < OPENED_FRESH
            && self.inbound.message().now_or_never().is_none()
    }
}

/// Reads the stream to its end (the serving kas ends it right after the call's), for at
/// most [`FORWARD_DRAIN`], then lets it go. Dropping it before would reset the HTTP/2
/// stream, and a server that sees many resets on one connection closes it with
/// ENHANCE_YOUR_CALM (h2's reset-flood guard), failing every call on it: found by kas-bench
/// at concurrency 16, after a relayed trailer, and again when callers that had read a
/// response's announced length let go before its trailer came. A call that has not ended
/// by then is cancelled by the reset.
pub async fn drain(mut inbound: Streaming<Frame>) {
    let _ = tokio::time::timeout(FORWARD_DRAIN, async {
        while let Ok(Some(_)) = inbound.message().await {}
    })
    .await;
}

impl Peers {
    /// Forwards sign their requests with `signer` (the kas-only secret), accept answer
    /// frames up to `max_message_size` bytes, and spread over `connections` connections
    /// per peer.
    pub fn new(
        signer: Signer,
        max_message_size: usize,
        tls: PrivateTls,
        connections: usize,
    ) -> Self {
        Peers {
            table: Arc::default(),
            dial: Arc::new(Dial {
                signer,
                max_message_size,
                tls,
                connections: connections.max(1),
            }),
        }
    }

    /// A stream to `kas` for one call: one opened ahead when there is one and `ahead`,
    /// else opened now. Either way, streams are opened ahead for the calls to come. An
    /// error means nothing was sent.
    pub async fn take(&self, kas: &KasId, ahead: bool) -> Result<Opened, String> {
        let now = Instant::now();
        let (taken, refill) = {
            let mut table = self.table.lock().unwrap_or_else(|p| p.into_inner());
            if !table.contains_key(kas) {
                let peer = self.dial.peer(kas, now)?;
                for (_, gone) in table.extract_if(|_, p| now.duration_since(p.used) >= IDLE_PEER) {
                    gone.retire();
                }
                table.insert(kas.clone(), peer);
            }
            let peer = table.get_mut(kas).expect("inserted");
            peer.used = now;
            // A stream opened ahead, or the channel to open one on now.
            let taken = match ahead.then(|| peer.pop(now)).flatten() {
                Some(opened) => Ok(opened),
                None => {
                    if ahead {
                        peer.target = (peer.target * 2).min(MAX_READY);
                    }
                    Err(peer.channel())
                }
            };
            let wanted = peer.target.saturating_sub(peer.ready.len() + peer.opening);
            peer.opening += wanted;
            let refill: Vec<Channel> = (0..wanted).map(|_| peer.channel()).collect();
            (taken, refill)
        };
        for channel in refill {
            let (this, kas) = (self.clone(), kas.clone());
            tokio::spawn(async move {
                let opened = this.dial.open(channel).await;
                this.opened(&kas, opened);
            });
        }
        match taken {
            Ok(opened) => Ok(opened),
            Err(channel) => match self.dial.open(channel).await {
                Ok(opened) => Ok(Opened {
                    ahead: false,
                    ..opened
                }),
                Err(status) => {
                    self.failed(kas, &status);
                    Err(status.to_string())
                }
            },
        }
    }

    /// A stream opened ahead came up (or failed).
    fn opened(&self, kas: &KasId, opened: Result<Opened, Status>) {
        let mut table = self.table.lock().unwrap_or_else(|p| p.into_inner());
        let Some(peer) = table.get_mut(kas) else {
            drop(table);
            if let Ok(o) = opened {
                o.retire();
            }
            return;
        };
        peer.opening = peer.opening.saturating_sub(1);
        match opened {
            Ok(o) => peer.ready.push_back(o),
            Err(status) => {
                drop(table);
                self.failed(kas, &status);
            }
        }
    }

    /// A kas that could not be reached is dropped: the next forward there connects
    /// afresh, and a kas that is gone for good leaves the table.
    fn failed(&self, kas: &KasId, status: &Status) {
        if status.code() != tonic::Code::Unavailable {
            return;
        }
        let gone = self
            .table
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(kas);
        if let Some(peer) = gone {
            peer.retire();
        }
    }
}

impl Peer {
    /// The first usable stream ready; stale ones are let go.
    fn pop(&mut self, now: Instant) -> Option<Opened> {
        while let Some(mut opened) = self.ready.pop_front() {
            if opened.usable(now) {
                return Some(opened);
            }
            self.target = self.target.saturating_sub(1).max(MIN_READY);
            opened.retire();
        }
        None
    }

    /// The next channel in turn.
    fn channel(&mut self) -> Channel {
        self.next = (self.next + 1) % self.channels.len();
        self.channels[self.next].clone()
    }

    fn retire(self) {
        for opened in self.ready {
            opened.retire();
        }
    }
}

impl Dial {
    fn peer(&self, kas: &KasId, now: Instant) -> Result<Peer, String> {
        let url = KasUrl::parse(&kas.0)
            .map(|url| KasUrl {
                tls: self.tls.tls,
                ..url
            })
            .map_err(|e| format!("bad kas address: {e}"))?;
        let channels = (0..self.connections)
            .map(|_| {
                kas_transport::tls::connect_lazy(
                    &url,
                    self.tls.ca_file.as_deref(),
                    Duration::from_secs(2),
                )
            })
            .collect::<Result<_, _>>()?;
        Ok(Peer {
            channels,
            next: 0,
            used: now,
            ready: VecDeque::new(),
            opening: 0,
            target: MIN_READY,
        })
    }

    /// Opens a forward stream on `channel` and waits for its headers.
    async fn open(&self, channel: Channel) -> Result<Opened, Status> {
        let (send, request) = oneshot::channel::<Request>();
        let body = stream::once(request).flat_map(|request| match request {
            Ok(Request { up, rest }) => {
                let rest = rest.map(ReceiverStream::new);
                stream::iter(up)
                    .chain(stream::iter(rest).flatten())
                    .left_stream()
            }
            Err(_) => stream::empty().right_stream(),
        });
        let mut req = tonic::Request::new(body);
        req.set_timeout(OPENED_WAIT);
        let bearer = self
            .signer
            .bearer()
            .parse()
            .map_err(|_| Status::internal("token is not valid metadata"))?;
        req.metadata_mut().insert("authorization", bearer);
        let mut client =
            KasPrivateClient::new(channel).max_decoding_message_size(self.max_message_size);
        let inbound = client.forward(req).await?.into_inner();
        Ok(Opened {
            send,
            inbound,
            opened: Instant::now(),
            ahead: true,
        })
    }
}

#[cfg(all(test, not(madsim)))]
mod tests {
    use super::*;
    use kas_auth::jwt::Secret;

    fn peers() -> Peers {
        let secret = Secret::from_base64("c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0LXNlY3JldA==")
            .expect("a secret");
        let signer = Signer::new(&secret, "kas", "kas");
        let plain = PrivateTls {
            tls: false,
            ca_file: None,
        };
        Peers::new(signer, 1 << 20, plain, 2)
    }

    fn held(p: &Peers) -> Vec<String> {
        let table = p.table.lock().unwrap();
        let mut held: Vec<String> = table.keys().map(|k| k.0.clone()).collect();
        held.sort();
        held
    }

    /// Nothing listens on these ports: each take fails (Unavailable) and drops its peer,
    /// unless the peer is still there from before, which the test arranges by hand.
    #[tokio::test(start_paused = true)]
    async fn peers_unused_for_a_while_are_dropped_and_unreachable_ones_at_once() {
        let p = peers();
        let (a, b, c) = (
            KasId("127.0.0.1:1".into()),
            KasId("127.0.0.1:2".into()),
            KasId("127.0.0.1:3".into()),
        );
        let now = Instant::now();
        for k in [&a, &b] {
            let peer = p.dial.peer(k, now).unwrap();
            p.table.lock().unwrap().insert(k.clone(), peer);
        }
        tokio::time::advance(IDLE_PEER / 2).await;
        p.table.lock().unwrap().get_mut(&b).unwrap().used = Instant::now();
        tokio::time::advance(IDLE_PEER / 2 + Duration::from_secs(1)).await;
        let peer = p.dial.peer(&c, Instant::now()).unwrap();
        p.table.lock().unwrap().insert(c.clone(), peer);
        // A take of a new peer sweeps the idle ones (a) out; b was used since.
        let d = KasId("127.0.0.1:4".into());
        assert!(p.take(&d, true).await.is_err(), "nothing listens there");
        assert_eq!(held(&p), ["127.0.0.1:2", "127.0.0.1:3"]);
        // Unreachable: dropped.
        assert!(p.take(&b, true).await.is_err());
        assert_eq!(held(&p), ["127.0.0.1:3"]);
    }
}
