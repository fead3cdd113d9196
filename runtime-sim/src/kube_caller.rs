//! GitLab's callers of kas's Kubernetes API listener (`agent.kubernetes_api`): HTTP/1.1
//! over the simulated network, a bearer token naming the agent, and identity headers the
//! caller claims for itself, which must never get through (inv 12, see `api_server`).
//! A request streams a body of 1-4 pieces, 0-50 ms apart, that the agent's API server
//! echoes, or watches 1-5 events, or opens an exec or port-forward session whose bytes are
//! echoed: what comes back must be all of it, or the caller must see an error (inv 8).

use crate::callers::{CLAIMED, USER_TOKEN};
use crate::cluster::{KUBERNETES_API_PORT, kas_addr};
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

/// What a request asks of the agent's API server.
#[derive(Clone, Copy)]
enum Shape {
    /// A POST whose body is echoed as it streams.
    Echo,
    /// A watch of 1-5 events (`kubectl get -w`, `logs -f`).
    Watch(usize),
    /// An exec session: upgraded (SPDY, over a POST), its bytes echoed.
    Exec,
    /// A port-forward session: upgraded (WebSocket, over a GET, as kubectl's since
    /// Kubernetes 1.31), its bytes echoed.
    PortForward,
}

impl Shape {
    /// An upgraded session (HTTP/1.1's, whichever way the caller speaks otherwise).
    fn upgrades(self) -> bool {
        matches!(self, Shape::Exec | Shape::PortForward)
    }
}

/// What the caller of a request saw besides its outcome.
#[derive(Default)]
pub struct Seen {
    /// How what came back differed from what was expected when the response ended whole,
    /// or kas's answer broke invariant 14.
    pub mismatch: Option<String>,
    /// The response's status, once its head came (invariant 17 reads it).
    pub status: Option<u16>,
    /// The bytes of its body (or of the upgraded connection) that came back.
    pub received: usize,
}

/// One request to `agent` through kas `kas`, asking kas to wait at most `timeout` for the
/// agent (`?timeout=`, as kubectl's `--request-timeout`): an echoed body, a watch or an
/// exec or port-forward session. The pod that answered.
pub async fn exchange(
    kas: usize,
    agent: i64,
    marker: &str,
    timeout: Duration,
    seen: &mut Seen,
) -> Result<String, Status> {
    let mismatch = &mut seen.mismatch;
    let shape = match thread_rng().gen_range(0..8) {
        0 | 1 => Shape::Watch(thread_rng().gen_range(1..=5)),
        2 => Shape::Exec,
        3 => Shape::PortForward,
        _ => Shape::Echo,
    };
    // Half of the others over HTTP/2 (prior knowledge, as kubectl's Go client speaks it
    // to a plain-text listener).
    let h2 = !shape.upgrades() && thread_rng().gen_bool(0.5);
    let mut sender = Sender::connect(kas, h2).await?;
    let pieces: Vec<Bytes> = (0..thread_rng().gen_range(1..=4))
        .map(|i| Bytes::from(format!("{marker}/{i};")))
        .collect();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(4);
    // Only a POST to echo has a body: a watch and an upgrade have none, as kubectl's.
    let body = match shape {
        Shape::Echo => {
            let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
            http_body_util::StreamBody::new(stream).boxed_unsync()
        }
        Shape::Watch(_) | Shape::Exec | Shape::PortForward => {
            http_body_util::Empty::new().boxed_unsync()
        }
    };
    let query = format!("timeout={}ms", timeout.as_millis());
    // HTTP/2 names the scheme and authority in every request.
    let origin = if h2 { "http://kas" } else { "" };
    let pod_path = format!("{origin}/api/v1/namespaces/default/pods/{marker}");
    let req = match shape {
        Shape::Echo => http::Request::post(format!("{pod_path}?{query}")),
        Shape::Watch(n) => http::Request::get(format!("{pod_path}?watch=1&{query}"))
            .header(crate::api_server::EVENTS, n),
        Shape::Exec => http::Request::post(format!("{pod_path}/exec?{query}"))
            .header("connection", "Upgrade")
            .header("upgrade", "SPDY/3.1"),
        Shape::PortForward => {
            http::Request::get(format!("{pod_path}/portforward?ports=8080&{query}"))
                .header("connection", "Upgrade")
                .header("upgrade", "websocket")
                .header("sec-websocket-version", "13")
                .header("sec-websocket-key", "c2ltLXBvcnQtZm9yd2FyZA==")
                .header("sec-websocket-protocol", "SPDY/3.1+portforward.k8s.io")
        }
    };
    let correlation_id = crate::api_server::correlation_id(marker);
    let req = if h2 { req } else { req.header("host", "kas") };
    let req = req
        .header(crate::api_server::CORRELATION, &correlation_id)
        .header("authorization", format!("Bearer pat:{agent}:{USER_TOKEN}"))
        .header("impersonate-user", CLAIMED)
        .header("impersonate-group", CLAIMED)
        .header("impersonate-extra-scopes", CLAIMED)
        .header("x-remote-user", CLAIMED)
        .body(body)
        .map_err(|e| Status::internal(e.to_string()))?;
    let sent: Vec<u8> = pieces.concat();
    if matches!(shape, Shape::Echo) {
        tokio::spawn(async move {
            for p in pieces {
                let gap = Duration::from_millis(thread_rng().gen_range(0..50));
                tokio::time::sleep(gap).await;
                if tx.send(Ok(Frame::data(p))).await.is_err() {
                    return;
                }
            }
        });
    }
    let mut resp = sender
        .send(req)
        .await
        .map_err(|e| failed(Code::Unknown, "request", &e))?;
    let status = resp.status();
    seen.status = Some(status.as_u16());
    let answered_id = resp
        .headers()
        .get(crate::api_server::CORRELATION)
        .map(|v| v.as_bytes());
    if answered_id != Some(correlation_id.as_bytes()) {
        *mismatch = Some(format!(
            "inv 14: sent correlation id {correlation_id}, kas answered {answered_id:?}"
        ));
        return Err(Status::internal("kas answered with another correlation id"));
    }
    let pod = resp
        .headers()
        .get("x-pod")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let got = if shape.upgrades() && status == http::StatusCode::SWITCHING_PROTOCOLS {
        let io = hyper::upgrade::on(&mut resp)
            .await
            .map_err(|e| failed(Code::Unknown, "upgrade", &e))?;
        exec(io, &sent).await?
    } else {
        let body = resp.into_body().collect().await;
        let body = body
            .map_err(|e| failed(Code::Unknown, "response body", &e))?
            .to_bytes();
        if !status.is_success() {
            let text = String::from_utf8_lossy(&body);
            // kas's own refusals (Status objects) end with the id; the API server's never do.
            let said = format!("(correlation id {correlation_id})\"");
            if status != http::StatusCode::NOT_FOUND && !text.contains(&said) {
                *mismatch = Some(format!(
                    "inv 14: kas's refusal does not end with {said}: {text}"
                ));
            }
            return Err(Status::new(code(status), format!("HTTP {status}: {text}")));
        }
        body.to_vec()
    };
    seen.received = got.len();
    let expected = match shape {
        Shape::Watch(n) => (0..n)
            .map(|i| crate::api_server::event(marker, i))
            .collect::<String>()
            .into_bytes(),
        Shape::Echo | Shape::Exec | Shape::PortForward => sent,
    };
    if got != expected {
        *mismatch = Some(format!(
            "got {:?}, expected {:?}",
            String::from_utf8_lossy(&got),
            String::from_utf8_lossy(&expected)
        ));
    }
    pod.ok_or_else(|| Status::internal("the response named no pod"))
}

type Body = http_body_util::combinators::UnsyncBoxBody<Bytes, Infallible>;

/// A connection to kas's Kubernetes API listener, over HTTP/1.1 or HTTP/2.
enum Sender {
    Http1(hyper::client::conn::http1::SendRequest<Body>),
    Http2(hyper::client::conn::http2::SendRequest<Body>),
}

impl Sender {
    /// Connects to kas `kas` (nothing sent yet: a failure is `Unavailable`).
    async fn connect(kas: usize, h2: bool) -> Result<Sender, Status> {
        use hyper::client::conn::{http1, http2};
        let io = dial(kas)
            .await
            .map_err(|e| failed(Code::Unavailable, "connect", &e))?;
        let handshake = |e: hyper::Error| failed(Code::Unavailable, "handshake", &e);
        if h2 {
            let (sender, conn) = http2::handshake(kas_transport::rt::Executor::new(), io)
                .await
                .map_err(handshake)?;
            tokio::spawn(conn);
            return Ok(Sender::Http2(sender));
        }
        let (sender, conn) = http1::handshake(io).await.map_err(handshake)?;
        tokio::spawn(async move {
            let _ = conn.with_upgrades().await;
        });
        Ok(Sender::Http1(sender))
    }

    async fn send(
        &mut self,
        req: http::Request<Body>,
    ) -> hyper::Result<http::Response<hyper::body::Incoming>> {
        match self {
            Sender::Http1(s) => s.send_request(req).await,
            Sender::Http2(s) => s.send_request(req).await,
        }
    }
}

/// An upgraded session: sends `sent` 0-50 ms a piece apart, reads as many bytes back,
/// closes.
async fn exec(io: hyper::upgrade::Upgraded, sent: &[u8]) -> Result<Vec<u8>, Status> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut reader, mut writer) = tokio::io::split(hyper_util::rt::TokioIo::new(io));
    let mut got = vec![0; sent.len()];
    let send = async {
        for piece in sent.chunks(8) {
            let gap = Duration::from_millis(thread_rng().gen_range(0..50));
            tokio::time::sleep(gap).await;
            writer.write_all(piece).await?;
            writer.flush().await?;
        }
        Ok::<_, io::Error>(())
    };
    let (sent, read) = tokio::join!(send, reader.read_exact(&mut got));
    sent.and(read.map(drop))
        .map_err(|e| failed(Code::Unknown, "upgraded session", &e))?;
    Ok(got)
}

/// The caller's own failure as GitLab's client would report it: `Unavailable` (not
/// delivered) only before the request was sent, `Unknown` once kas may have it.
fn failed(code: Code, what: &str, e: &dyn std::error::Error) -> Status {
    let cause = e.source().map(|c| format!(" ({c})")).unwrap_or_default();
    Status::new(code, format!("{what}: {e}{cause}"))
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

/// A connection to kas `kas`'s Kubernetes API listener, for hyper.
pub async fn dial(kas: usize) -> io::Result<hyper_util::rt::TokioIo<Flushed>> {
    let stream = tokio::net::TcpStream::connect(kas_addr(kas, KUBERNETES_API_PORT)).await?;
    Ok(hyper_util::rt::TokioIo::new(Flushed {
        stream,
        unflushed: false,
    }))
}

/// An endless watch (the API server's events 1-3 s apart) of `path` through kas `kas` with
/// the bearer `token` and `correlation_id`, over a connection of its own: its response,
/// once the head came within 3 s, and the connection's task.
pub async fn endless_watch(
    kas: usize,
    path: &str,
    token: &str,
    correlation_id: Option<&str>,
) -> Option<(
    http::Response<hyper::body::Incoming>,
    tokio::task::JoinHandle<()>,
)> {
    let io = dial(kas).await.ok()?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await.ok()?;
    let req = http::Request::get(path)
        .header("host", "kas")
        .header("authorization", format!("Bearer {token}"))
        .header(crate::api_server::EVENTS, 1_000_000);
    let req = match correlation_id {
        Some(id) => req.header(crate::api_server::CORRELATION, id),
        None => req,
    };
    let req = req.body(http_body_util::Empty::<Bytes>::new()).ok()?;
    let task = tokio::spawn(async move {
        let _ = conn.await;
    });
    let resp = tokio::time::timeout(Duration::from_secs(3), sender.send_request(req)).await;
    match resp {
        Ok(Ok(resp)) => Some((resp, task)),
        _ => {
            task.abort();
            None
        }
    }
}

/// A simulated TCP stream that flushes only what was written. madsim's sends a message for
/// every flush, an empty one too, which wakes the peer: hyper flushes at each poll, so two
/// hyper ends of a held connection (a watch) sent each other empty messages for as long as
/// it lasted (three quarters of a run's instructions with a greedy caller's watches), and
/// once the peer has closed, an empty flush fails where a real socket's does nothing (a
/// kas that had answered and closed failed the caller's read of that answer).
pub struct Flushed {
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
