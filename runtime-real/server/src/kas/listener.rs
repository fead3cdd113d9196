//! Accepting connections the way a server exposed to hostile clients must: accept errors
//! (a full file table) are logged, rate-limited, and backed off instead of spinning, and
//! a connection that does not start talking is closed. (6,000 silent connections once
//! held a kas at its file limit, refusing everyone and logging nothing.)
//!
//! After the handshake, gRPC listeners rely on HTTP/2 keepalive pings (tonic's
//! `http2_keepalive_*`): a peer that stops answering them is closed. The HTTP/1.1
//! observability listener has no pings, so there a connection silent while kas waits for
//! a request is closed instead.
//!
//! A TLS listener runs its handshakes concurrently, each within `listen.handshake_timeout`
//! (one slow client must not hold up the others), and guards the decrypted stream as
//! above once the handshake is done.

mod requests;

pub use requests::{Activity, Busy, RequestTimeouts};

use super::limits::Places;
use super::metrics::Metrics;
use kas_transport::ws::Io;
use requests::RequestClock;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio::time::{Instant, Sleep};
use tokio_rustls::server::TlsStream;

/// The bytes of the HTTP/2 connection preface, which every gRPC client sends first.
const HTTP2_PREFACE_LEN: usize = 24;

/// Accept errors are logged at most this often (the rest are counted).
const ACCEPT_LOG_EVERY: Duration = Duration::from_secs(5);

/// How long accepting pauses after an error, so that a full file table does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Handshakes under way at once on one listener; further connections are closed at once
/// (a client left in the kernel's backlog would wait out its own timeout instead).
const MAX_HANDSHAKES: usize = 1024;

/// The first byte of every TLS connection (a handshake record).
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// Logs one line per [`ACCEPT_LOG_EVERY`] and counts the rest.
#[derive(Default)]
struct LogLimit {
    last: Option<Instant>,
    unlogged: u64,
}

impl LogLimit {
    /// `Some(lines not logged since the last)` when a line may be logged now.
    fn allow(&mut self) -> Option<u64> {
        let now = Instant::now();
        if self.last.is_some_and(|at| now < at + ACCEPT_LOG_EVERY) {
            self.unlogged += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.unlogged))
    }
}

/// What a connection must do to stay open.
#[derive(Clone, Copy, Debug)]
pub enum Guard {
    /// Send the HTTP/2 preface within this long.
    Http2Preface(Duration),
    /// Never stay silent this long while kas waits to read (HTTP/1.1).
    ReadIdle(Duration),
    /// A listener whose requests may rightly stay silent (a watch, an upgraded exec
    /// session): timers run only while the connection has no request open (see
    /// [`requests`]).
    Requests(RequestTimeouts),
}

/// Accepts connections on one listener.
pub struct Acceptor {
    listener: TcpListener,
    guard: Guard,
    what: &'static str,
    metrics: Metrics,
    log_limit: LogLimit,
}

impl Acceptor {
    /// Accepts on `listener` (named `what` in logs), guarding each connection.
    pub fn new(listener: TcpListener, guard: Guard, what: &'static str, metrics: Metrics) -> Self {
        Acceptor {
            listener,
            guard,
            what,
            metrics,
            log_limit: LogLimit::default(),
        }
    }

    /// The next connection; errors are logged and retried.
    pub async fn next(&mut self) -> (Guarded, SocketAddr) {
        let (stream, peer) = self.accept_tcp().await;
        (Guarded::new(stream, self.guard), peer)
    }

    async fn accept_tcp(&mut self) -> (TcpStream, SocketAddr) {
        loop {
            match self.listener.accept().await {
                Ok((stream, peer)) => {
                    // Without TCP_NODELAY small responses wait out the peer's delayed ACK.
                    let _ = stream.set_nodelay(true);
                    return (stream, peer);
                }
                Err(e) => {
                    self.metrics.accept_error(self.what);
                    self.log(&e);
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            }
        }
    }

    fn log(&mut self, e: &io::Error) {
        let Some(unlogged) = self.log_limit.allow() else {
            return;
        };
        let hint = if e.raw_os_error() == Some(24) {
            " (the open-file limit is reached: see kas_open_files_limit)"
        } else {
            ""
        };
        tracing::error!(
            listener = self.what,
            error = %e,
            similar_errors_not_logged = unlogged,
            "cannot accept connections{hint}"
        );
    }

    /// The connections as the stream tonic serves.
    pub fn into_stream(self) -> impl futures::Stream<Item = io::Result<Guarded>> + Send {
        futures::stream::unfold(self, |mut a| async move {
            let (io, _) = a.next().await;
            Some((Ok(io), a))
        })
    }

    /// The connections once their handshakes (see [`Handshakes`]) are done, within
    /// `handshakes.timeout`; those that fail are counted, logged now and then, and closed.
    ///
    /// A connection must send its first byte within `limits.first_byte`; one source address
    /// has at most `limits.per_address` connections in handshakes, and the listener at most
    /// [`MAX_HANDSHAKES`]: beyond either, a connection is closed as soon as it is accepted.
    /// So idle sockets cost their sender descriptors, not other clients' handshakes.
    pub fn handshaking(mut self, handshakes: Handshakes) -> Incoming {
        let local = self.listener.local_addr();
        let (tx, rx) = mpsc::channel(64);
        let limits = handshakes.limits;
        let stage = Stage {
            tls: handshakes.tls.map(tokio_rustls::TlsAcceptor::from),
            websocket: handshakes.websocket,
            limits,
            guard: self.guard,
            what: self.what,
            metrics: self.metrics.clone(),
            log_limit: Arc::default(),
            local_addr: local.as_ref().ok().copied(),
            tx,
        };
        let permits = Arc::new(Semaphore::new(MAX_HANDSHAKES));
        let per_address = Places::new(limits.per_address);
        tokio::spawn(async move {
            loop {
                let (stream, peer) = tokio::select! {
                    c = self.accept_tcp() => c,
                    () = stage.tx.closed() => return,
                };
                let Ok(permit) = permits.clone().try_acquire_owned() else {
                    stage.failed(peer, "the listener has 1024 handshakes under way");
                    continue;
                };
                let Some(place) = per_address.take(peer.ip()) else {
                    stage.failed(peer, "listen.max_handshakes_per_address reached");
                    continue;
                };
                let stage = stage.clone();
                tokio::spawn(async move {
                    stage.run(stream, peer).await;
                    drop((permit, place));
                });
            }
        });
        Incoming { rx, local }
    }
}

/// What each connection of a handshaking listener goes through, and where it goes then.
#[derive(Clone)]
struct Stage {
    tls: Option<tokio_rustls::TlsAcceptor>,
    websocket: bool,
    limits: HandshakeLimits,
    guard: Guard,
    what: &'static str,
    metrics: Metrics,
    log_limit: Arc<Mutex<LogLimit>>,
    local_addr: Option<SocketAddr>,
    tx: mpsc::Sender<(Guarded<Accepted>, SocketAddr)>,
}

impl Stage {
    /// Handshakes `stream` and hands it on, or counts and logs why it failed.
    async fn run(self, stream: TcpStream, peer: SocketAddr) {
        let info = tonic::transport::server::TcpConnectInfo {
            local_addr: self.local_addr,
            remote_addr: Some(peer),
        };
        let mut first = [0u8; 1];
        let started = tokio::time::timeout(self.limits.first_byte, stream.peek(&mut first)).await;
        if started.is_err() {
            return self.failed(peer, "no first byte within listen.first_byte_timeout");
        }
        let done = tokio::time::timeout(self.limits.timeout, self.handshake(stream, info)).await;
        let why = match done {
            Ok(Ok(conn)) => {
                let _ = self.tx.send((Guarded::new(conn, self.guard), peer)).await;
                return;
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => "no handshake within listen.handshake_timeout".into(),
        };
        self.failed(peer, &why);
    }

    /// Counts and now and then logs a connection closed before its handshake was done.
    fn failed(&self, peer: SocketAddr, why: &str) {
        self.metrics.handshake_error(self.what);
        let allowed = self
            .log_limit
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .allow();
        if let Some(unlogged) = allowed {
            tracing::info!(
                listener = self.what,
                %peer,
                error = %why,
                similar_errors_not_logged = unlogged,
                "handshake failed"
            );
        }
    }

    /// TLS (when configured), then the WebSocket upgrade (when enabled and asked for).
    async fn handshake(
        &self,
        stream: TcpStream,
        info: tonic::transport::server::TcpConnectInfo,
    ) -> io::Result<Accepted> {
        let io: Box<dyn Io> = match &self.tls {
            Some(tls) => Box::new(handshake_tls(tls, stream).await?),
            None => Box::new(stream),
        };
        let mut conn = Accepted {
            io,
            head: Vec::new(),
            info: info.clone(),
        };
        if !self.websocket || conn.starts_with(b"PRI ").await? {
            return Ok(conn);
        }
        let ws = kas_transport::ws::accept(conn, self.limits.timeout)
            .await
            .map_err(|e| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("neither HTTP/2 nor a WebSocket upgrade: {e}"),
                )
            })?;
        Ok(Accepted {
            io: Box::new(ws),
            head: Vec::new(),
            info,
        })
    }
}

impl axum::serve::Listener for Acceptor {
    type Io = Guarded;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Guarded, SocketAddr) {
        self.next().await
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}

/// A client's address, as an HTTP listener's handlers see it (`ConnectInfo<Peer>`).
#[derive(Clone, Copy, Debug)]
pub struct Peer(pub SocketAddr);

/// Serves `router` (HTTP/1.1 and HTTP/2) on `acceptor`'s connections, after a TLS
/// handshake within `listen.handshake_timeout` when `tls` is set, at most
/// `listen.max_concurrent_streams` requests at once per HTTP/2 connection, pinging idle
/// HTTP/2 connections as the gRPC listeners do, until `signal` resolves: then it takes no
/// new connections, tells HTTP/2 clients to go elsewhere (GOAWAY) and lets running
/// requests finish. Each request holds its connection's [`Busy`] (an extension) until its
/// response body is dropped.
pub async fn serve_http(
    acceptor: Acceptor,
    router: axum::Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    listen: &crate::config::Listen,
    signal: impl Future<Output = ()> + Send + 'static,
) {
    use hyper_util::rt::{TokioExecutor, TokioTimer};
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(listen.max_concurrent_streams)
        .keep_alive_interval(listen.keepalive_interval)
        .keep_alive_timeout(listen.keepalive_timeout);
    let router = router.layer(axum::middleware::from_fn(hold_busy));
    match tls {
        None => serve_connections(acceptor, router, builder, signal).await,
        Some(tls) => {
            let incoming = acceptor.handshaking(Handshakes {
                tls: Some(tls),
                websocket: false,
                limits: HandshakeLimits::of(listen),
            });
            serve_connections(incoming, router, builder, signal).await
        }
    }
}

/// Marks the connection busy for as long as the response body lives.
async fn hold_busy(
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let busy = req.extensions().get::<Activity>().map(Activity::busy);
    if let Some(b) = &busy {
        req.extensions_mut().insert(b.clone());
    }
    let resp = next.run(req).await;
    match busy {
        None => resp,
        Some(busy) => resp.map(|body| {
            use http_body_util::BodyExt;
            // The closure owns the mark: it goes when the body does.
            axum::body::Body::new(body.map_frame(move |f| {
                let _held = &busy;
                f
            }))
        }),
    }
}

async fn serve_connections<L, S>(
    mut listener: L,
    router: axum::Router,
    builder: hyper_util::server::conn::auto::Builder<hyper_util::rt::TokioExecutor>,
    signal: impl Future<Output = ()> + Send + 'static,
) where
    L: axum::serve::Listener<Addr = SocketAddr, Io = Guarded<S>>,
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    use hyper_util::rt::TokioIo;
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    tokio::pin!(signal);
    loop {
        let (io, peer) = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut signal => break,
        };
        let mut service = router
            .clone()
            .layer(axum::Extension(axum::extract::ConnectInfo(Peer(peer))));
        if let Some(activity) = io.activity() {
            service = service.layer(axum::Extension(activity));
        }
        let service = hyper_util::service::TowerToHyperService::new(service);
        let connection = builder
            .serve_connection_with_upgrades(TokioIo::new(io), service)
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(%peer, error = %e, "HTTP connection ended");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// What a listener does with a connection before serving it.
pub struct Handshakes {
    /// TLS with this configuration.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// Accept gRPC inside a WebSocket too (`listen.websocket`): a connection that starts
    /// with an HTTP/1.1 request rather than the HTTP/2 preface is upgraded, and its
    /// WebSocket carries the HTTP/2 connection.
    pub websocket: bool,
    /// Its limits.
    pub limits: HandshakeLimits,
}

/// How long a connection may take over its handshakes, and how many one address may have
/// under way.
#[derive(Clone, Copy, Debug)]
pub struct HandshakeLimits {
    /// `listen.handshake_timeout`, for all of it.
    pub timeout: Duration,
    /// `listen.first_byte_timeout`, for its first byte.
    pub first_byte: Duration,
    /// `listen.max_handshakes_per_address`.
    pub per_address: usize,
}

impl HandshakeLimits {
    /// The limits `listen` configures.
    pub fn of(listen: &crate::config::Listen) -> Self {
        HandshakeLimits {
            timeout: listen.handshake_timeout,
            first_byte: listen.first_byte_timeout,
            per_address: listen.max_handshakes_per_address,
        }
    }
}

/// A TLS handshake; a client that speaks plaintext first is named as such.
async fn handshake_tls(
    tls: &tokio_rustls::TlsAcceptor,
    stream: TcpStream,
) -> io::Result<TlsStream<TcpStream>> {
    let mut first = [0u8; 1];
    if stream.peek(&mut first).await? == 1 && first[0] != TLS_HANDSHAKE_RECORD {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "the client spoke plaintext (first byte {:#04x}) to a TLS listener: it must use TLS (grpcs:// or https://)",
                first[0]
            ),
        ));
    }
    tls.accept(stream).await
}

/// A connection after its handshakes, with its addresses. While the handshakes tell what
/// it speaks, the bytes read for that (`head`) are kept to be read again.
pub struct Accepted {
    io: Box<dyn Io>,
    head: Vec<u8>,
    info: tonic::transport::server::TcpConnectInfo,
}

impl Accepted {
    /// True when the stream starts with `prefix` (read, and kept to be read again).
    async fn starts_with(&mut self, prefix: &[u8]) -> io::Result<bool> {
        use tokio::io::AsyncReadExt;
        while self.head.len() < prefix.len() {
            let mut b = [0u8; 8];
            let want = prefix.len() - self.head.len();
            let n = self.io.read(&mut b[..want]).await?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            self.head.extend_from_slice(&b[..n]);
        }
        Ok(self.head == prefix)
    }
}

impl AsyncRead for Accepted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.head.is_empty() {
            let n = buf.remaining().min(self.head.len());
            let rest = self.head.split_off(n);
            buf.put_slice(&self.head);
            self.head = rest;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Accepted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Accepted {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.info.clone()
    }
}

/// A listener's connections, handshakes done (see [`Acceptor::handshaking`]).
pub struct Incoming {
    rx: mpsc::Receiver<(Guarded<Accepted>, SocketAddr)>,
    local: io::Result<SocketAddr>,
}

impl Incoming {
    /// The connections as the stream tonic serves.
    pub fn into_stream(self) -> impl futures::Stream<Item = io::Result<Guarded<Accepted>>> + Send {
        futures::stream::unfold(self.rx, |mut rx| async move {
            let (io, _) = rx.recv().await?;
            Some((Ok(io), rx))
        })
    }
}

impl axum::serve::Listener for Incoming {
    type Io = Guarded<Accepted>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, SocketAddr) {
        match self.rx.recv().await {
            Some(c) => c,
            // The accepting task ends only when this receiver is gone.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.local
            .as_ref()
            .map(|a| *a)
            .map_err(|e| io::Error::new(e.kind(), e.to_string()))
    }
}

/// A connection (TCP, or TLS over TCP) closed with `TimedOut` when it breaks its [`Guard`].
pub struct Guarded<S = TcpStream> {
    inner: S,
    /// Preface bytes still expected, and until when.
    preface: Option<(usize, Pin<Box<Sleep>>)>,
    /// What a connection that sends too few of them is told.
    preface_error: &'static str,
    /// The read-idle limit and its timer.
    idle: Option<(Duration, Pin<Box<Sleep>>)>,
    /// The timers between requests.
    requests: Option<RequestClock>,
}

impl<S> Guarded<S> {
    fn new(inner: S, guard: Guard) -> Self {
        let timer = |d: Duration| Box::pin(tokio::time::sleep(d));
        let (preface, idle, requests) = match guard {
            Guard::Http2Preface(d) => (Some((HTTP2_PREFACE_LEN, timer(d))), None, None),
            Guard::ReadIdle(d) => (None, Some((d, timer(d))), None),
            Guard::Requests(t) => (None, None, Some(RequestClock::new(t))),
        };
        Guarded {
            inner,
            preface,
            preface_error: "no HTTP/2 preface within listen.handshake_timeout",
            idle,
            requests,
        }
    }

    /// What the connection has open, when its guard counts requests.
    pub fn activity(&self) -> Option<Activity> {
        self.requests.as_ref().map(RequestClock::activity)
    }

    fn timed_out(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        if let Some((_, sleep)) = &mut self.preface
            && sleep.as_mut().poll(cx).is_ready()
        {
            return Some(io::Error::new(io::ErrorKind::TimedOut, self.preface_error));
        }
        if let Some((_, sleep)) = &mut self.idle
            && sleep.as_mut().poll(cx).is_ready()
        {
            return Some(io::Error::new(
                io::ErrorKind::TimedOut,
                "connection silent for listen.handshake_timeout",
            ));
        }
        self.requests.as_mut().and_then(|r| r.expired(cx))
    }

    fn received(&mut self, n: usize) {
        if let Some((left, _)) = &mut self.preface {
            *left = left.saturating_sub(n);
            if *left == 0 {
                self.preface = None;
            }
        }
        if let Some((d, sleep)) = &mut self.idle {
            sleep.as_mut().reset(Instant::now() + *d);
        }
        if let Some(r) = &mut self.requests {
            r.received(n);
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Guarded<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let n = buf.filled().len() - before;
                self.received(n);
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match self.timed_out(cx) {
                Some(e) => Poll::Ready(Err(e)),
                None => Poll::Pending,
            },
            other => other,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Guarded<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected for Guarded<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

/// Raises the open-file limit to its hard limit, so that a kas holding many agents does
/// not run out of descriptors at a low default; returns the limit now in force.
pub fn raise_open_files_limit() -> u64 {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!(error = %e, "cannot raise the open-file limit");
            rlimit::getrlimit(rlimit::Resource::NOFILE).map_or(0, |(soft, _)| soft)
        }
    }
}
