//! Each agent replica's Kubernetes API server, behind agentk's production Kubernetes API
//! module (`kas_agent::kubernetes_api`), which reaches it by HTTP/1.1 over an in-memory
//! pipe (a cluster's API server is beside its agent, not across the faults). It answers as
//! the checks need: it records each request's marker (the last segment of its path) as a
//! delivery, names its pod in `x-pod`, and echoes the request's body as it streams in (or
//! the bytes of an upgraded connection, as an exec session; or sends a watch's events). The
//! module is wrapped so that the simulation sees what kas sent the agent, and both reports
//! a caller's credential or claimed identity that reached either (inv 12): kas must drop
//! them (agentk drops them again, as defence in depth).

use crate::callers::{CLAIMED, IMPERSONATED, USER_TOKEN};
use crate::truth::{Delivery, Truth};
use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::TokioIo;
use kas_agent::kubernetes_api::{KUBERNETES_API_METHOD, UpRequest, Upstream};
use kas_agent::modules::{Answer, Modules};
use kas_proto::http::{HttpRequest, http_request};
use kas_transport::http_relay::BoxError;
use madsim::rand::{Rng, thread_rng};
use prost::Message;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// GitLab's correlation id header.
pub const CORRELATION: &str = kas_proto::frame::CORRELATION_ID;

/// The correlation id a caller sends with the request `marker`: kas must answer with it,
/// end its refusals with it and carry it to the API server (inv 14).
pub fn correlation_id(marker: &str) -> String {
    format!("sim-{marker}")
}

/// The marker prefix of requests sent without a correlation id (the greedy caller's): kas
/// makes one, a ULID.
pub const NO_CORRELATION_ID: &str = "greedy-";

/// One replica's API server.
#[derive(Clone)]
struct ApiServer {
    truth: Truth,
    agent: i64,
    replica: usize,
    pod: Arc<str>,
}

/// Registers agentk's Kubernetes API module in `modules`, in front of this replica's API
/// server, with what reaches the agent checked first.
pub fn register(modules: &mut Modules, truth: Truth, agent: i64, replica: usize, pod: &str) {
    let server = ApiServer {
        truth: truth.clone(),
        agent,
        replica,
        pod: pod.into(),
    };
    let upstream = Upstream::over(tower::service_fn(move |req: UpRequest| {
        let server = server.clone();
        async move { server.send(req).await }
    }));
    let inner = Modules::default().with_kubernetes_api(upstream);
    modules.streaming(KUBERNETES_API_METHOD, move |requests| {
        checked(&truth, agent, &inner, requests)
    });
}

/// Hands the call to agentk's module, looking at the request head on the way.
fn checked(
    truth: &Truth,
    agent: i64,
    inner: &Modules,
    mut requests: kas_agent::modules::Requests,
) -> Answer {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let truth = truth.clone();
    tokio::spawn(async move {
        let Some(first) = requests.recv().await else {
            return;
        };
        if let Ok(Some(http_request::Kind::Head(head))) =
            HttpRequest::decode(first.clone()).map(|m| m.kind)
        {
            for (name, values) in &head.headers {
                if name == "authorization" || values.values.iter().any(|v| v.contains(CLAIMED)) {
                    truth.violation(format!(
                        "inv 12: kas sent agent {agent} the caller's header {name}: {:?} ({})",
                        values.values, head.path
                    ));
                }
            }
        }
        if tx.send(first).await.is_err() {
            return;
        }
        while let Some(m) = requests.recv().await {
            if tx.send(m).await.is_err() {
                return;
            }
        }
    });
    inner.call(KUBERNETES_API_METHOD, rx)
}

impl ApiServer {
    /// Sends `req` to this API server on a connection of its own.
    async fn send(self, req: UpRequest) -> Result<http::Response<Incoming>, BoxError> {
        let (client, server) = tokio::io::duplex(64 * 1024);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| self.clone().answer(req));
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(server), service)
                .with_upgrades();
            let _ = conn.await;
        });
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(client)).await?;
        tokio::spawn(async move {
            let _ = conn.with_upgrades().await;
        });
        Ok(sender.send_request(req).await?)
    }

    /// Records the request and checks who it came as; after 0-100 ms, answers an upgrade
    /// (exec, port-forward) by echoing the upgraded bytes, a watch (`x-sim-events: N`) with N events
    /// 0-300 ms apart, anything else by echoing its body as it streams in.
    async fn answer(
        self,
        req: http::Request<Incoming>,
    ) -> Result<http::Response<Body>, Infallible> {
        let path = req.uri().path();
        let marker = ["/exec", "/portforward"]
            .iter()
            .find_map(|s| path.strip_suffix(s))
            .unwrap_or(path);
        let marker = marker.rsplit('/').next().unwrap_or_default().to_string();
        for (name, value) in req.headers() {
            let value = String::from_utf8_lossy(value.as_bytes());
            let claimed = value.contains(CLAIMED) || value.contains(USER_TOKEN);
            let identity = name == "impersonate-user" && value != IMPERSONATED;
            if claimed || identity {
                self.truth.violation(format!(
                    "inv 12: agent {}'s API server got {name}: {value} ({marker})",
                    self.agent
                ));
            }
        }
        let id = req.headers().get(CORRELATION);
        let expected = correlation_id(&marker);
        let carried = id.map(|v| v.as_bytes());
        // The greedy caller sends none: kas made one, a ULID.
        let made = |v: &[u8]| v.len() == 26 && v.iter().all(u8::is_ascii_alphanumeric);
        let right = match carried {
            Some(v) if marker.starts_with(NO_CORRELATION_ID) => made(v),
            Some(v) => v == expected.as_bytes(),
            None => false,
        };
        if !right {
            self.truth.violation(format!(
                "inv 14: agent {}'s API server got correlation id {id:?} for {marker}, the caller sent {expected} {names:?}",
                self.agent, names = req.headers().keys().collect::<Vec<_>>()
            ));
        }
        self.truth.record(Delivery {
            marker: marker.clone(),
            agent: self.agent,
            replica: self.replica,
            at: Instant::now(),
        });
        let took = Duration::from_millis(thread_rng().gen_range(0..100));
        tokio::time::sleep(took).await;
        let events = req
            .headers()
            .get(EVENTS)
            .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
        let mut resp = if req.headers().contains_key(http::header::UPGRADE) {
            echo_upgraded(req)
        } else if let Some(n) = events {
            http::Response::new(watch(marker, n))
        } else {
            http::Response::new(req.into_body().map_err(BoxError::from).boxed_unsync())
        };
        if let Ok(pod) = http::HeaderValue::from_str(&self.pod) {
            resp.headers_mut().insert("x-pod", pod);
        }
        Ok(resp)
    }
}

/// A response body.
type Body = UnsyncBoxBody<Bytes, BoxError>;

/// The header that makes a GET a watch of this many events.
pub const EVENTS: &str = "x-sim-events";

/// The `i`th event of the watch `marker`, as its caller expects it.
pub fn event(marker: &str, i: usize) -> String {
    format!("{{\"type\":\"MODIFIED\",\"object\":\"{marker}/{i}\"}}\n")
}

/// A watch's `n` events, 0-300 ms apart, then its end; a long one's (a greedy caller's
/// held watches) 1-3 s apart, which keeps the simulation quick.
fn watch(marker: String, n: usize) -> Body {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
    let gaps = if n > 100 { 1_000..3_000 } else { 0..300 };
    tokio::spawn(async move {
        for i in 0..n {
            let gap = Duration::from_millis(thread_rng().gen_range(gaps.clone()));
            tokio::time::sleep(gap).await;
            if tx
                .send(Ok(Frame::data(event(&marker, i).into())))
                .await
                .is_err()
            {
                return;
            }
        }
    });
    StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed_unsync()
}

/// `101 Switching Protocols`, then every byte the caller sends, back, until it closes.
fn echo_upgraded(req: http::Request<Incoming>) -> http::Response<Body> {
    let upgrade = req.headers().get(http::header::UPGRADE).cloned();
    tokio::spawn(async move {
        let Ok(io) = hyper::upgrade::on(req).await else {
            return;
        };
        let (mut reader, mut writer) = tokio::io::split(TokioIo::new(io));
        let _ = tokio::io::copy(&mut reader, &mut writer).await;
    });
    let mut resp = http::Response::new(Empty::new().map_err(BoxError::from).boxed_unsync());
    *resp.status_mut() = http::StatusCode::SWITCHING_PROTOCOLS;
    resp.headers_mut().insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("upgrade"),
    );
    if let Some(u) = upgrade {
        resp.headers_mut().insert(http::header::UPGRADE, u);
    }
    resp
}
