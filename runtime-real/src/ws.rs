//! gRPC through WebSocket: a WebSocket connection used as a byte stream (each write one
//! binary message, messages read back to back), as GitLab's agentk does to reach kas
//! through proxies and CDNs that pass only HTTP/1.1 and WebSocket. HTTP/2 (gRPC) runs
//! inside it unchanged.

use futures::{Sink, Stream};
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{Bytes, Message};

/// The largest WebSocket message either side accepts: HTTP/2 frames are at most 16 KiB
/// by default and writers send what they have, so this is only a cap on a peer's misuse.
pub const MAX_MESSAGE: usize = 1 << 20;

/// The WebSocket limits kas and agentk apply.
pub fn config() -> WebSocketConfig {
    WebSocketConfig::default()
        .max_message_size(Some(MAX_MESSAGE))
        .max_frame_size(Some(MAX_MESSAGE))
}

/// A byte stream, whatever carries it (TCP, TLS, a WebSocket).
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

/// Opens, over `stream` to kas at `url` (`ws://`, or `wss://` with TLS already on it),
/// the WebSocket its gRPC connection runs in.
pub async fn upgrade(
    url: &crate::tls::KasUrl,
    stream: Box<dyn Io>,
) -> io::Result<WsBytes<Box<dyn Io>>> {
    let scheme = if url.tls { "wss" } else { "ws" };
    let (ws, _) = tokio_tungstenite::client_async_with_config(
        format!("{scheme}://{}/", url.authority),
        stream,
        Some(config()),
    )
    .await
    .map_err(to_io)?;
    Ok(WsBytes::new(ws))
}

/// A WebSocket connection as a byte stream.
pub struct WsBytes<S> {
    ws: WebSocketStream<S>,
    /// What is left of the message being read.
    pending: Bytes,
}

impl<S> WsBytes<S> {
    /// Wraps an open WebSocket connection.
    pub fn new(ws: WebSocketStream<S>) -> Self {
        WsBytes {
            ws,
            pending: Bytes::new(),
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

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for WsBytes<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        while self.pending.is_empty() {
            match ready!(Pin::new(&mut self.ws).poll_next(cx)) {
                Some(Ok(Message::Binary(b))) => self.pending = b,
                // Pings are answered by tungstenite itself; text has no place here.
                Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => {}
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
        let n = buf.len().min(MAX_MESSAGE);
        Pin::new(&mut self.ws)
            .start_send(Message::binary(Bytes::copy_from_slice(&buf[..n])))
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
            let ws = tokio_tungstenite::accept_async_with_config(tcp, Some(config()))
                .await
                .unwrap();
            let mut s = WsBytes::new(ws);
            let mut got = vec![0u8; 300_000];
            s.read_exact(&mut got).await.unwrap();
            s.write_all(&got).await.unwrap();
            s.shutdown().await.unwrap();
        });
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (ws, _) = tokio_tungstenite::client_async_with_config(
            format!("ws://{addr}/"),
            tcp,
            Some(config()),
        )
        .await
        .unwrap();
        let mut c = WsBytes::new(ws);
        let sent: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        c.write_all(&sent).await.unwrap();
        c.flush().await.unwrap();
        let mut back = Vec::new();
        c.read_to_end(&mut back).await.unwrap();
        assert_eq!(back, sent);
        server.await.unwrap();
    }
}
