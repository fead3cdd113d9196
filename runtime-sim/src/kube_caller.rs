//! GitLab's callers of kas's Kubernetes API listener (`agent.kubernetes_api`): HTTP/1.1
//! over the simulated network, a bearer token naming the agent, and identity headers the
//! caller claims for itself, which must never get through (inv 12, see `api_server`).
//! Each request streams a body of 1-4 pieces, 0-50 ms apart, that the agent's API server
//! echoes: what comes back must be all of it, or the caller must see an error (inv 8).

use crate::api_server::{CLAIMED, USER_TOKEN};
use crate::cluster::kas_addr;
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Frame;
use madsim::rand::{Rng, thread_rng};
use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::{Code, Status};

/// The port of each kas's Kubernetes API listener.
pub const PORT: u16 = 8154;

/// One request to `agent` through kas `kas`, asking kas to wait at most `timeout` for the
/// agent (`?timeout=`, as kubectl's `--request-timeout`). The pod that answered; `mismatch`
/// says how the echo differed from the body sent when the response ended whole.
pub async fn exchange(
    kas: usize,
    agent: i64,
    marker: &str,
    timeout: Duration,
    mismatch: &mut Option<String>,
) -> Result<String, Status> {
    let unavailable = |what: &str, e: &dyn std::error::Error| {
        let cause = e.source().map(|c| format!(" ({c:?})")).unwrap_or_default();
        Status::unavailable(format!("{what}: {e}{cause}"))
    };
    let stream = tokio::net::TcpStream::connect(kas_addr(kas, PORT))
        .await
        .map_err(|e| unavailable("connect", &e))?;
    let io = hyper_util::rt::TokioIo::new(Flushed {
        stream,
        unflushed: false,
    });
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| unavailable("handshake", &e))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let pieces: Vec<Bytes> = (0..thread_rng().gen_range(1..=4))
        .map(|i| Bytes::from(format!("{marker}/{i};")))
        .collect();
    let sent: Vec<u8> = pieces.concat();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(4);
    tokio::spawn(async move {
        for p in pieces {
            let gap = Duration::from_millis(thread_rng().gen_range(0..50));
            tokio::time::sleep(gap).await;
            if tx.send(Ok(Frame::data(p))).await.is_err() {
                return;
            }
        }
    });
    let body = http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    let path = format!(
        "/api/v1/namespaces/default/pods/{marker}?timeout={}ms",
        timeout.as_millis()
    );
    let req = http::Request::post(path)
        .header("host", "kas")
        .header("authorization", format!("Bearer pat:{agent}:{USER_TOKEN}"))
        .header("impersonate-user", CLAIMED)
        .header("impersonate-group", CLAIMED)
        .header("impersonate-extra-scopes", CLAIMED)
        .header("x-remote-user", CLAIMED)
        .body(body)
        .map_err(|e| Status::internal(e.to_string()))?;
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| unavailable("request", &e))?;
    let status = resp.status();
    let pod = resp
        .headers()
        .get("x-pod")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body = resp.into_body().collect().await;
    let body = body
        .map_err(|e| unavailable("response body", &e))?
        .to_bytes();
    if !status.is_success() {
        let text = String::from_utf8_lossy(&body);
        return Err(Status::new(code(status), format!("HTTP {status}: {text}")));
    }
    if body != sent {
        *mismatch = Some(format!(
            "echoed {:?}, sent {:?}",
            String::from_utf8_lossy(&body),
            String::from_utf8_lossy(&sent)
        ));
    }
    pod.ok_or_else(|| Status::internal("the response named no pod"))
}

/// The gRPC code the checks read for kas's HTTP status, as kas maps one to the other.
fn code(status: http::StatusCode) -> Code {
    match status.as_u16() {
        401 => Code::Unauthenticated,
        403 => Code::PermissionDenied,
        404 => Code::NotFound,
        429 => Code::ResourceExhausted,
        502 => Code::Internal,
        503 => Code::Unavailable,
        504 => Code::DeadlineExceeded,
        _ => Code::Unknown,
    }
}

/// A simulated TCP stream that flushes only what was written: madsim's fails a flush with
/// nothing to send once the peer has closed, where a real socket's does nothing (hyper's
/// client flushes after the last body chunk, and a kas that had answered and closed the
/// connection by then failed the caller's read of that answer).
struct Flushed {
    stream: tokio::net::TcpStream,
    unflushed: bool,
}

impl AsyncRead for Flushed {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Flushed {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.unflushed = true;
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !std::mem::take(&mut self.unflushed) {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
