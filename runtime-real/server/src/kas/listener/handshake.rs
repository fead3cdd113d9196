//! The handshakes a TLS or WebSocket listener runs before serving a connection, each in
//! a task of its own within its limits. (Not in the simulation, which has neither TLS
//! nor WebSocket, and whose TCP cannot peek at a first byte.)

use super::{Acceptor, Guard, Guarded, LogLimit};
use crate::kas::limits::Places;
use crate::kas::metrics::Metrics;
use kas_transport::ws::Io;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::server::TlsStream;

/// Handshakes under way at once on one listener; further connections are closed at once
/// (a client left in the kernel's backlog would wait out its own timeout instead).
const MAX_HANDSHAKES: usize = 1024;

/// The first byte of every TLS connection (a handshake record).
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

impl Acceptor {
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
