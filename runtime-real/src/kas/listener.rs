//! Accepting connections the way a server exposed to hostile clients must: accept errors
//! (a full file table) are logged, rate-limited, and backed off instead of spinning, and
//! a connection that does not start talking is closed. (6,000 silent connections once
//! held a kas at its file limit, refusing everyone and logging nothing.)
//!
//! After the handshake, gRPC listeners rely on HTTP/2 keepalive pings (tonic's
//! `http2_keepalive_*`): a peer that stops answering them is closed. The HTTP/1.1
//! observability listener has no pings, so there a connection silent while kas waits for
//! a request is closed instead.

use super::metrics::Metrics;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
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

/// What a connection must do to stay open.
#[derive(Clone, Copy, Debug)]
pub enum Guard {
    /// Send the HTTP/2 preface within this long.
    Http2Preface(Duration),
    /// Never stay silent this long while kas waits to read (HTTP/1.1).
    ReadIdle(Duration),
}

/// Accepts connections on one listener.
pub struct Acceptor {
    listener: TcpListener,
    guard: Guard,
    what: &'static str,
    metrics: Metrics,
    last_log: Option<Instant>,
    unlogged: u64,
}

impl Acceptor {
    /// Accepts on `listener` (named `what` in logs), guarding each connection.
    pub fn new(listener: TcpListener, guard: Guard, what: &'static str, metrics: Metrics) -> Self {
        Acceptor {
            listener,
            guard,
            what,
            metrics,
            last_log: None,
            unlogged: 0,
        }
    }

    /// The next connection; errors are logged and retried.
    pub async fn next(&mut self) -> (Guarded, SocketAddr) {
        loop {
            match self.listener.accept().await {
                Ok((stream, peer)) => {
                    // Without TCP_NODELAY small responses wait out the peer's delayed ACK.
                    let _ = stream.set_nodelay(true);
                    return (Guarded::new(stream, self.guard), peer);
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
        let now = Instant::now();
        if self.last_log.is_some_and(|at| now < at + ACCEPT_LOG_EVERY) {
            self.unlogged += 1;
            return;
        }
        self.last_log = Some(now);
        let hint = if e.raw_os_error() == Some(24) {
            " (the open-file limit is reached: see kas_open_files_limit)"
        } else {
            ""
        };
        tracing::error!(
            listener = self.what,
            error = %e,
            similar_errors_not_logged = std::mem::take(&mut self.unlogged),
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

/// A TCP connection closed with `TimedOut` when it breaks its [`Guard`].
pub struct Guarded {
    inner: TcpStream,
    /// Preface bytes still expected, and until when.
    preface: Option<(usize, Pin<Box<Sleep>>)>,
    /// The read-idle limit and its timer.
    idle: Option<(Duration, Pin<Box<Sleep>>)>,
}

impl Guarded {
    fn new(inner: TcpStream, guard: Guard) -> Self {
        let timer = |d: Duration| Box::pin(tokio::time::sleep(d));
        let (preface, idle) = match guard {
            Guard::Http2Preface(d) => (Some((HTTP2_PREFACE_LEN, timer(d))), None),
            Guard::ReadIdle(d) => (None, Some((d, timer(d)))),
        };
        Guarded {
            inner,
            preface,
            idle,
        }
    }

    fn timed_out(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        if let Some((_, sleep)) = &mut self.preface
            && sleep.as_mut().poll(cx).is_ready()
        {
            return Some(io::Error::new(
                io::ErrorKind::TimedOut,
                "no HTTP/2 preface within listen.handshake_timeout",
            ));
        }
        if let Some((_, sleep)) = &mut self.idle
            && sleep.as_mut().poll(cx).is_ready()
        {
            return Some(io::Error::new(
                io::ErrorKind::TimedOut,
                "connection silent for listen.handshake_timeout",
            ));
        }
        None
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
    }
}

impl AsyncRead for Guarded {
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

impl AsyncWrite for Guarded {
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

impl tonic::transport::server::Connected for Guarded {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

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
