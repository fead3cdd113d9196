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

#[cfg(not(madsim))]
mod handshake;
mod requests;

#[cfg(not(madsim))]
pub use handshake::{HandshakeLimits, Handshakes};

pub use requests::{Activity, Busy, RequestTimeouts};

use super::metrics::Metrics;
use requests::RequestClock;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, Sleep};

/// The bytes of the HTTP/2 connection preface, which every gRPC client sends first.
const HTTP2_PREFACE_LEN: usize = 24;

/// Accept errors are logged at most this often (the rest are counted).
const ACCEPT_LOG_EVERY: Duration = Duration::from_secs(5);

/// How long accepting pauses after an error, so that a full file table does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

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
    #[cfg_attr(madsim, allow(dead_code))] // madsim's tonic accepts by itself
    Http2Preface(Duration),
    /// Never stay silent this long while kas waits to read (HTTP/1.1).
    #[cfg_attr(madsim, allow(dead_code))] // the simulation has no observability listener
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
    #[cfg(not(madsim))] // madsim's tonic accepts by itself
    pub fn into_stream(self) -> impl futures::Stream<Item = io::Result<Guarded>> + Send {
        futures::stream::unfold(self, |mut a| async move {
            let (io, _) = a.next().await;
            Some((Ok(io), a))
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
    use kas_transport::rt::{Executor, Timer};
    let mut builder = hyper_util::server::conn::auto::Builder::new(Executor::new());
    builder
        .http2()
        .timer(Timer::new())
        .max_concurrent_streams(listen.max_concurrent_streams)
        .keep_alive_interval(listen.keepalive_interval)
        .keep_alive_timeout(listen.keepalive_timeout);
    let router = router.layer(axum::middleware::from_fn(hold_busy));
    match tls {
        None => serve_connections(acceptor, router, builder, signal).await,
        #[cfg(not(madsim))]
        Some(tls) => {
            let incoming = acceptor.handshaking(Handshakes {
                tls: Some(tls),
                websocket: false,
                limits: HandshakeLimits::of(listen),
            });
            serve_connections(incoming, router, builder, signal).await
        }
        // The configuration check refuses TLS in the simulation.
        #[cfg(madsim)]
        Some(_) => tracing::error!("agent.kubernetes_api: TLS is not simulated"),
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
    builder: hyper_util::server::conn::auto::Builder<kas_transport::rt::Executor>,
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

#[cfg(not(madsim))] // madsim's tonic accepts by itself
impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected for Guarded<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

/// Raises the open-file limit to its hard limit, so that a kas holding many agents does
/// not run out of descriptors at a low default; returns the limit now in force.
#[cfg(not(madsim))]
pub fn raise_open_files_limit() -> u64 {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!(error = %e, "cannot raise the open-file limit");
            rlimit::getrlimit(rlimit::Resource::NOFILE).map_or(0, |(soft, _)| soft)
        }
    }
}
