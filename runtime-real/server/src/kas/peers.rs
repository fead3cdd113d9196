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
//!
//! A path to a peer can die without a reset, or die one way only (half-open): nothing
//! then fails, and HTTP/2's keepalive notices only after 50 s. So the answers to stream
//! openings are the peer's heartbeat: a stream opened ahead is trusted with a call only
//! while the peer has answered some opening within [`ANSWERED_FRESH`]; an opening not
//! answered within [`ANSWER_WITHIN`] is given up and its connection made anew; and while
//! openings go unanswered longer than that, the peer is silent: a call for it is refused
//! at once (nothing sent), and the router offers it elsewhere. One opening at a time asks
//! whether it answers again. Within `ANSWERED_FRESH` of a path dying no call goes down it;
//! within `ANSWERED_FRESH + ANSWER_WITHIN` calls go elsewhere without waiting.

use super::private_api;
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
use std::sync::atomic::{AtomicBool, Ordering};
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
/// See the module's doc: how recently a peer must have answered an opening for a stream
/// opened ahead to carry a call.
const ANSWERED_FRESH: Duration = Duration::from_secs(1);
/// See the module's doc: how long an opening may go unanswered.
const ANSWER_WITHIN: Duration = Duration::from_secs(2);
/// Within this long of the path to a peer dying (both ways or one), calls for it are
/// refused at once and go elsewhere (see the module's doc).
pub const SILENT_WITHIN: Duration = ANSWERED_FRESH.saturating_add(ANSWER_WITHIN);
/// Streams kept open ahead per peer: the count grows by one each time a call finds none
/// (by as many as the calls that wanted one: doubling at each miss opened 512 streams for a
/// burst of ten calls, which the simulation's serving kas took seconds to answer),
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
    url: KasUrl,
    links: Vec<Link>,
    /// The link the next stream opens on.
    next: usize,
    used: Instant,
    ready: VecDeque<Opened>,
    /// Streams being opened ahead.
    opening: usize,
    /// Streams to keep ready.
    target: usize,
    /// When the peer last answered an opening.
    answered: Option<Instant>,
    /// Since when openings have gone unanswered (none answered since).
    unanswered: Option<Instant>,
}

/// One connection to a peer, made anew (`epoch` counts) when an opening on it goes
/// unanswered.
#[derive(Clone)]
struct Link {
    channel: Channel,
    /// Its index in the peer's links.
    index: usize,
    epoch: u64,
    /// The peer said on this connection that it takes the token in
    /// [`private_api::TOKEN_HEADER`] (a connection made anew may reach another build).
    token_header: Arc<AtomicBool>,
}

/// What a call takes.
#[allow(clippy::large_enum_variant)] // one, on the stack, for the moment of a take
enum Taken {
    Ready(Opened),
    /// A stream to open now, on this link.
    Open(Link),
    /// The peer is silent: why.
    Silent(String),
}

/// A forward stream that carries nothing yet; the serving kas has answered its headers.
pub struct Opened {
    send: oneshot::Sender<Request>,
    /// The serving kas's answer.
    inbound: Streaming<Frame>,
    opened: Instant,
    /// Opened ahead of the call that took it (not for it).
    pub ahead: bool,
    /// The link it is on, and that link's epoch then.
    link: (usize, u64),
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

    /// A stream to `kas` for one call: one opened ahead when there is one and `ahead` (and
    /// the peer answered lately), else opened now. Either way, streams are opened ahead
    /// for the calls to come. An error means nothing was sent.
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
            let taken = if let Some(since) = peer.silent(now) {
                let why = format!(
                    "kas {kas} has answered no stream opened in the last {:.1} s: the path to it may be down or half-open",
                    now.duration_since(since).as_secs_f64()
                );
                Taken::Silent(why)
            } else {
                // A stream opened ahead, or the link to open one on now. Too few were
                // opened ahead only if the peer answers: else this opening asks whether
                // it still does.
                let ahead = ahead && peer.fresh(now);
                match ahead.then(|| peer.pop(now)).flatten() {
                    Some(opened) => Taken::Ready(opened),
                    None => {
                        if ahead {
                            peer.target = (peer.target + 1).min(MAX_READY);
                        }
                        Taken::Open(peer.start_opening(now))
                    }
                }
            };
            // A silent peer gets one opening at a time, which asks whether it answers again.
            let wanted = match taken {
                Taken::Silent(_) => usize::from(peer.opening == 0),
                _ => peer.target.saturating_sub(peer.ready.len() + peer.opening),
            };
            peer.opening += wanted;
            let refill: Vec<Link> = (0..wanted).map(|_| peer.start_opening(now)).collect();
            (taken, refill)
        };
        for link in refill {
            let (this, kas) = (self.clone(), kas.clone());
            tokio::spawn(async move {
                let opened = this.dial.open(&link).await;
                this.opened(&kas, &link, opened, true);
            });
        }
        match taken {
            Taken::Ready(opened) => Ok(opened),
            Taken::Silent(why) => Err(why),
            Taken::Open(link) => {
                let opened = self.dial.open(&link).await;
                let status = opened.as_ref().err().map(ToString::to_string);
                match self.opened(kas, &link, opened, false) {
                    Some(opened) => Ok(Opened {
                        ahead: false,
                        ..opened
                    }),
                    None => Err(status.unwrap_or_else(|| format!("kas {kas} is gone"))),
                }
            }
        }
    }

    /// An opening on `link` to `kas` came up (or failed); `ahead` for one opened ahead,
    /// which joins the ready streams. Returns one opened for a call.
    fn opened(
        &self,
        kas: &KasId,
        link: &Link,
        opened: Result<Opened, Status>,
        ahead: bool,
    ) -> Option<Opened> {
        let now = Instant::now();
        let mut table = self.table.lock().unwrap_or_else(|p| p.into_inner());
        let Some(peer) = table.get_mut(kas) else {
            drop(table);
            if let Ok(o) = opened {
                o.retire();
            }
            return None;
        };
        if ahead {
            peer.opening = peer.opening.saturating_sub(1);
        }
        match opened {
            Ok(o) => {
                peer.heard(now);
                if !ahead {
                    return Some(o);
                }
                if peer.current(&o) {
                    peer.ready.push_back(o);
                } else {
                    o.retire();
                }
            }
            // Answered, if only to refuse: the path works.
            Err(status) if answered(&status) => peer.heard(now),
            Err(_) => {
                if let Some(fresh) = self.dial.link(&peer.url, link) {
                    peer.renew(fresh);
                }
            }
        }
        None
    }
}

/// True when `status`, an opening's failure, came from the peer (it refused the stream),
/// not from a path that did not carry the opening or its answer.
fn answered(status: &Status) -> bool {
    !matches!(
        status.code(),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::DeadlineExceeded
    )
}

impl Peer {
    /// The peer answered an opening at `now`.
    fn heard(&mut self, now: Instant) {
        self.answered = Some(now);
        self.unanswered = None;
    }

    /// True when the peer answered an opening lately enough for the streams opened ahead
    /// to be trusted with a call.
    fn fresh(&self, now: Instant) -> bool {
        self.answered
            .is_some_and(|at| now.duration_since(at) < ANSWERED_FRESH)
    }

    /// The first usable stream ready; stale ones are let go.
    fn pop(&mut self, now: Instant) -> Option<Opened> {
        while let Some(mut opened) = self.ready.pop_front() {
            if self.current(&opened) && opened.usable(now) {
                return Some(opened);
            }
            self.target = self.target.saturating_sub(1).max(MIN_READY);
            opened.retire();
        }
        None
    }

    /// Since when openings have gone unanswered, if for longer than [`ANSWER_WITHIN`].
    fn silent(&self, now: Instant) -> Option<Instant> {
        self.unanswered
            .filter(|since| now.duration_since(*since) >= ANSWER_WITHIN)
    }

    /// The link the next opening goes on, in turn.
    fn start_opening(&mut self, now: Instant) -> Link {
        self.unanswered.get_or_insert(now);
        self.next = (self.next + 1) % self.links.len();
        self.links[self.next].clone()
    }

    /// True when `opened` is on a link not made anew since.
    fn current(&self, opened: &Opened) -> bool {
        let (index, epoch) = opened.link;
        self.links.get(index).is_some_and(|l| l.epoch == epoch)
    }

    /// Puts `fresh` in place of the link it renews (unless that was renewed already) and
    /// lets the streams ready on the old one go.
    fn renew(&mut self, fresh: Link) {
        let Some(old) = self.links.get_mut(fresh.index) else {
            return;
        };
        if old.epoch + 1 != fresh.epoch {
            return;
        }
        *old = fresh;
        let (keep, stale): (VecDeque<Opened>, VecDeque<Opened>) = std::mem::take(&mut self.ready)
            .into_iter()
            .partition(|o| self.current(o));
        self.ready = keep;
        for o in stale {
            o.retire();
        }
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
        let links = (0..self.connections)
            .map(|index| {
                Ok(Link {
                    channel: self.channel(&url)?,
                    index,
                    epoch: 0,
                    token_header: Arc::default(),
                })
            })
            .collect::<Result<_, String>>()?;
        Ok(Peer {
            url,
            links,
            next: 0,
            used: now,
            ready: VecDeque::new(),
            opening: 0,
            target: MIN_READY,
            answered: None,
            unanswered: None,
        })
    }

    fn channel(&self, url: &KasUrl) -> Result<Channel, String> {
        kas_transport::tls::connect_lazy(url, self.tls.ca_file.as_deref(), Duration::from_secs(2))
    }

    /// A new connection in place of `old`.
    fn link(&self, url: &KasUrl, old: &Link) -> Option<Link> {
        Some(Link {
            channel: self.channel(url).ok()?,
            index: old.index,
            epoch: old.epoch + 1,
            token_header: Arc::default(),
        })
    }

    /// Opens a forward stream on `link` and waits for its headers, for at most
    /// [`ANSWER_WITHIN`].
    async fn open(&self, link: &Link) -> Result<Opened, Status> {
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
        let header = match link.token_header.load(Ordering::Relaxed) {
            true => private_api::TOKEN_HEADER,
            false => "authorization",
        };
        req.metadata_mut().insert(header, bearer);
        let mut client = KasPrivateClient::new(link.channel.clone())
            .max_decoding_message_size(self.max_message_size);
        let answer = tokio::time::timeout(ANSWER_WITHIN, client.forward(req))
            .await
            .map_err(|_| {
                Status::unavailable(format!(
                    "no answer to a stream's opening within {ANSWER_WITHIN:?}"
                ))
            })??;
        if answer
            .metadata()
            .contains_key(private_api::TOKEN_HEADER_TAKEN)
        {
            link.token_header.store(true, Ordering::Relaxed);
        }
        let inbound = answer.into_inner();
        Ok(Opened {
            send,
            inbound,
            opened: Instant::now(),
            ahead: true,
            link: (link.index, link.epoch),
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

    /// Nothing listens on these ports: each take fails (Unavailable).
    #[tokio::test(start_paused = true)]
    async fn peers_unused_for_a_while_are_dropped() {
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
        // A take of a new peer sweeps the idle ones (a) out; b was used since.
        assert!(p.take(&c, true).await.is_err(), "nothing listens there");
        assert_eq!(held(&p), ["127.0.0.1:2", "127.0.0.1:3"]);
    }

    /// A peer whose openings go unanswered for `ANSWER_WITHIN` is silent: calls for it are
    /// refused at once, naming why, while one opening at a time asks again.
    #[tokio::test(start_paused = true)]
    async fn a_peer_that_answers_no_opening_is_refused_at_once_after_a_while() {
        let p = peers();
        let b = KasId("127.0.0.1:2".into());
        let first = p.take(&b, true).await.err().expect("nothing listens there");
        assert!(!first.contains("answered no stream"), "{first}");
        tokio::time::advance(ANSWER_WITHIN).await;
        let started = Instant::now();
        let then = p.take(&b, true).await.err().expect("still nothing there");
        assert!(then.contains("has answered no stream"), "{then}");
        assert_eq!(started.elapsed(), Duration::ZERO, "refused without waiting");
        assert_eq!(held(&p), ["127.0.0.1:2"], "kept, to be asked again");
    }

    /// A private listener that records which header each forward stream's token came in,
    /// and says it takes `kas-private-token` when `taken` (as a kas of an older build does
    /// not).
    struct Listener {
        taken: bool,
        seen: Arc<Mutex<Vec<&'static str>>>,
    }

    #[tonic::async_trait]
    impl kas_proto::private_api::kas_private_server::KasPrivate for Listener {
        type ForwardStream = stream::Pending<Result<Frame, Status>>;

        async fn forward(
            &self,
            req: tonic::Request<Streaming<Frame>>,
        ) -> Result<tonic::Response<Self::ForwardStream>, Status> {
            let header = [private_api::TOKEN_HEADER, "authorization"]
                .into_iter()
                .find(|h| req.metadata().contains_key(*h))
                .unwrap_or("none");
            self.seen.lock().unwrap().push(header);
            let mut answer = tonic::Response::new(stream::pending());
            if self.taken {
                let yes = tonic::metadata::MetadataValue::from_static("1");
                answer
                    .metadata_mut()
                    .insert(private_api::TOKEN_HEADER_TAKEN, yes);
            }
            Ok(answer)
        }
    }

    /// The token headers a peer saw on the streams of 8 takes (and those opened ahead).
    async fn headers_seen(taken: bool) -> Vec<&'static str> {
        use kas_proto::private_api::kas_private_server::KasPrivateServer;
        let seen = Arc::default();
        let listener = Listener {
            taken,
            seen: Arc::clone(&seen),
        };
        let socket = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let kas = KasId(socket.local_addr().unwrap().to_string());
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(socket);
        let server = tonic::transport::Server::builder()
            .add_service(KasPrivateServer::new(listener))
            .serve_with_incoming(incoming);
        let server = tokio::spawn(server);
        let p = peers();
        for _ in 0..8 {
            p.take(&kas, true).await.expect("the peer answers").retire();
        }
        server.abort();
        seen.lock().unwrap().clone()
    }

    /// The token goes in `kas-private-token`, which HTTP/2 indexes, only on a connection
    /// whose peer said it takes it; an older kas keeps receiving `authorization`.
    #[tokio::test]
    async fn the_token_moves_to_its_own_header_only_where_the_peer_takes_it() {
        let new = headers_seen(true).await;
        assert_eq!(new.first(), Some(&"authorization"), "{new:?}");
        assert_eq!(new.last(), Some(&private_api::TOKEN_HEADER), "{new:?}");
        let old = headers_seen(false).await;
        assert!(old.len() >= 8, "{old:?}");
        assert!(old.iter().all(|h| *h == "authorization"), "{old:?}");
    }
}
