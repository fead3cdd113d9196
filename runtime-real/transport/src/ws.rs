//! gRPC through WebSocket: a WebSocket connection used as a byte stream (each write one
//! binary message, messages read back to back), as GitLab's agentk does to reach kas
//! through proxies and CDNs that pass only HTTP/1.1 and WebSocket. HTTP/2 (gRPC) runs
//! inside it unchanged.

// Peer input passes through here: nothing may panic on it.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)
)]

use futures::{Sink, Stream};
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{Bytes, Message};

/// The largest WebSocket message either side accepts: an HTTP/2 frame (at most
/// [`crate::MAX_FRAME_SIZE`] of data) with room for a header buffer written beside it, as
/// earlier writers sent them. A peer's unfinished message holds at most this much.
pub const MAX_MESSAGE: usize = crate::MAX_FRAME_SIZE as usize + 16 * 1024;

/// Writes go out in messages of at most this many bytes: the size of an HTTP/2 frame at
/// its default limit, so that a reader's unfinished message is always small.
const WRITE_PIECE: usize = 16 * 1024;

/// Bytes buffered for a peer that does not read (pongs included) before writing fails:
/// tungstenite's own write buffer and one message.
const MAX_UNSENT: usize = 2 * WRITE_BUFFER + MAX_MESSAGE;

/// tungstenite's read and write buffers (128 KiB each by default).
const WRITE_BUFFER: usize = 64 * 1024;
const READ_BUFFER: usize = 32 * 1024;

/// The WebSocket limits kas and agentk apply.
pub fn config() -> WebSocketConfig {
    WebSocketConfig::default()
        .max_message_size(Some(MAX_MESSAGE))
        .max_frame_size(Some(MAX_MESSAGE))
        .read_buffer_size(READ_BUFFER)
        .write_buffer_size(WRITE_BUFFER)
        .max_write_buffer_size(MAX_UNSENT)
}

/// A byte stream, whatever carries it (TCP, TLS, a WebSocket).
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

/// Opens, over `stream` to kas at `url` (`ws://`, or `wss://` with TLS already on it),
/// the WebSocket its gRPC connection runs in.
pub async fn upgrade(
    url: &crate::kas_url::KasUrl,
    stream: Box<dyn Io>,
) -> io::Result<WsBytes<Box<dyn Io>>> {
    let scheme = if url.tls { "wss" } else { "ws" };
    let (ws, _) = tokio_tungstenite::client_async_with_config(
        format!("{scheme}://{}/", url.authority),
        Counted::new(stream),
        Some(config()),
    )
    .await
    .map_err(to_io)?;
    Ok(WsBytes::new(ws, None))
}

/// Answers a client's WebSocket upgrade on `stream`; a message the client begins must be
/// finished within `unfinished` (see [`WsBytes`]).
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    stream: S,
    unfinished: Duration,
) -> Result<WsBytes<S>, tokio_tungstenite::tungstenite::Error> {
    let ws =
        tokio_tungstenite::accept_async_with_config(Counted::new(stream), Some(config())).await?;
    Ok(WsBytes::new(ws, Some(unfinished)))
}

/// A stream that counts the bytes read from it: bytes that arrive without completing a
/// message show a message under way.
pub struct Counted<S> {
    inner: S,
    read: u64,
}

impl<S> Counted<S> {
    fn new(inner: S) -> Self {
        Counted { inner, read: 0 }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        ready!(Pin::new(&mut self.inner).poll_read(cx, buf))?;
        self.read += (buf.filled().len() - before) as u64;
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
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
}

/// A WebSocket connection as a byte stream.
///
/// What a peer can make it hold is bounded: a message at most [`MAX_MESSAGE`]; pongs and
/// writes the peer does not read at most [`MAX_UNSENT`], and once a pong cannot be sent
/// nothing more is read until it is (a ping flood stops being read, as HTTP/2 does with
/// its own pings); and where `unfinished` is set, bytes that keep arriving without
/// completing a message for that long end the connection.
pub struct WsBytes<S> {
    ws: WebSocketStream<Counted<S>>,
    /// What is left of the message being read.
    pending: Bytes,
    /// A ping was read: its pong must be sent before more is read.
    answering: bool,
    /// How long a message may stay unfinished.
    unfinished: Option<Duration>,
    /// Bytes read when a message last completed, or when waiting last began.
    read_mark: u64,
    /// When the message under way must be finished.
    finish_by: Option<Pin<Box<Sleep>>>,
}

impl<S> WsBytes<S> {
    fn new(ws: WebSocketStream<Counted<S>>, unfinished: Option<Duration>) -> Self {
        WsBytes {
            ws,
            pending: Bytes::new(),
            answering: false,
            unfinished,
            read_mark: 0,
            finish_by: None,
        }
    }
}

fn to_io(e: tokio_tungstenite::tungstenite::Error) -> io::Error {
    use tokio_tungstenite::tungstenite::Error;
    match e {
        Error::Io(e) => e,
        Error::ConnectionClosed | Error::AlreadyClosed => {
            io::Error::new(io::ErrorKind::NotConnected, "WebSocket closed")
        }
        other => io::Error::new(io::ErrorKind::InvalidData, other),
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> WsBytes<S> {
    /// On waiting for more: arms the unfinished-message timer when bytes came in since the
    /// last message without completing another; an error once it ran out.
    fn check_unfinished(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        let Some(limit) = self.unfinished else {
            return Ok(());
        };
        let read = self.ws.get_ref().read;
        if read != self.read_mark && self.finish_by.is_none() {
            self.finish_by = Some(Box::pin(tokio::time::sleep(limit)));
        }
        self.read_mark = read;
        let expired = self
            .finish_by
            .as_mut()
            .is_some_and(|t| t.as_mut().poll(cx).is_ready());
        if expired {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("a WebSocket message left unfinished for {limit:?}"),
            ));
        }
        Ok(())
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for WsBytes<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        while self.pending.is_empty() {
            if self.answering {
                ready!(Pin::new(&mut self.ws).poll_flush(cx)).map_err(to_io)?;
                self.answering = false;
            }
            let next = match Pin::new(&mut self.ws).poll_next(cx) {
                Poll::Pending => {
                    self.check_unfinished(cx)?;
                    return Poll::Pending;
                }
                Poll::Ready(next) => next,
            };
            self.finish_by = None;
            self.read_mark = self.ws.get_ref().read;
            match next {
                Some(Ok(Message::Binary(b))) => self.pending = b,
                // tungstenite queues the pong; it is sent before anything more is read.
                Some(Ok(Message::Ping(_))) => self.answering = true,
                Some(Ok(Message::Pong(_) | Message::Frame(_))) => {}
                Some(Ok(Message::Text(_))) => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "a text WebSocket message where only binary ones carry gRPC",
                    )));
                }
                Some(Ok(Message::Close(_))) | None => return Poll::Ready(Ok(())),
                Some(Err(e)) => return Poll::Ready(Err(to_io(e))),
            }
        }
        let n = buf.remaining().min(self.pending.len());
        let chunk = self.pending.split_to(n);
        buf.put_slice(&chunk);
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for WsBytes<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        ready!(Pin::new(&mut self.ws).poll_ready(cx)).map_err(to_io)?;
        let n = buf.len().min(WRITE_PIECE);
        Pin::new(&mut self.ws)
            .start_send(Message::binary(Bytes::copy_from_slice(
                buf.get(..n).unwrap_or_default(),
            )))
            .map_err(to_io)?;
        Poll::Ready(Ok(n))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.ws).poll_flush(cx).map_err(to_io)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.ws).poll_close(cx).map_err(to_io)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn bytes_cross_in_both_directions_and_close_reads_as_the_end() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let mut s = accept(tcp, Duration::from_secs(5)).await.unwrap();
            let mut got = vec![0u8; 300_000];
            s.read_exact(&mut got).await.unwrap();
            s.write_all(&got).await.unwrap();
            s.shutdown().await.unwrap();
        });
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (ws, _) = tokio_tungstenite::client_async_with_config(
            format!("ws://{addr}/"),
            Counted::new(tcp),
            Some(config()),
        )
        .await
        .unwrap();
        let mut c = WsBytes::new(ws, None);
        let sent: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        c.write_all(&sent).await.unwrap();
        c.flush().await.unwrap();
        let mut back = Vec::new();
        c.read_to_end(&mut back).await.unwrap();
        assert_eq!(back, sent);
        server.await.unwrap();
    }
}
