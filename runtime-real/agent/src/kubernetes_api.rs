//! The Kubernetes API module: proxies each HTTP exchange kas routes here to the cluster's
//! API server, streaming both ways, as this agent (its service account, or its kubeconfig
//! user) or, when kas says so, as the GitLab user or CI job behind the call
//! (`Impersonate-*` headers). The caller's own credentials never reach the API server.

// Peer input passes through here: nothing may panic on it.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)
)]

#[cfg(not(madsim))]
pub mod kubeconfig;

use super::modules::{Answer, Modules, Requests};
use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use http::{HeaderMap, HeaderName, HeaderValue};
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use kas_proto::http::{
    HttpRequest, HttpResponse, Impersonation, RequestHead, ResponseHead, http_request,
};
use kas_transport::http_relay::{self, BoxError, Incoming, Outgoing};
use kas_transport::traces::{
    self, Context, KeyValue, SpanKind, Status as SpanStatus, TraceContextExt,
};
use prost::Message;
use tokio::sync::mpsc;
use tonic::Status;
use tower::ServiceExt;
use tower::util::BoxCloneSyncService;

pub use kas_proto::http::KUBERNETES_API_METHOD;

/// The prefix of `Impersonate-Extra-<key>` headers.
const IMPERSONATE_EXTRA: &str = "impersonate-extra-";

/// The cluster's API server, reached with this agent's credentials.
#[derive(Clone)]
pub struct Upstream {
    service: BoxCloneSyncService<UpRequest, http::Response<hyper::body::Incoming>, BoxError>,
}

impl Upstream {
    /// Requests go to `service`: kube's configured client in agentk (see [`kubeconfig`]),
    /// a client over the simulated network in the simulation.
    pub fn over<S>(service: S) -> Upstream
    where
        S: tower::Service<UpRequest, Response = http::Response<hyper::body::Incoming>>
            + Clone
            + Send
            + Sync
            + 'static,
        S::Error: Into<BoxError>,
        S::Future: Send + 'static,
    {
        Upstream {
            service: BoxCloneSyncService::new(service.map_err(Into::into)),
        }
    }
}

/// A request to the API server.
pub type UpRequest = http::Request<UnsyncBoxBody<Bytes, BoxError>>;

impl Upstream {
    /// Sends `req`. A plain function returning a boxed future: awaiting the service's
    /// future inside an async block trips rustc's higher-ranked lifetime inference.
    pub(crate) fn send(
        &self,
        req: UpRequest,
    ) -> futures::future::BoxFuture<'static, Result<http::Response<hyper::body::Incoming>, BoxError>>
    {
        self.service.clone().oneshot(req).boxed()
    }
}

impl Modules {
    /// Registers the Kubernetes API module, proxying to `upstream`.
    pub fn with_kubernetes_api(mut self, upstream: Upstream) -> Self {
        self.streaming(KUBERNETES_API_METHOD, move |requests| {
            proxy(upstream.clone(), requests)
        });
        self
    }
}

/// Runs one exchange in a task of its own, which ends when the answer is dropped (the
/// tunnel ended the call).
fn proxy(upstream: Upstream, requests: Requests) -> Answer {
    let (tx, rx) = mpsc::channel(16);
    // The call's trace, current while the call starts.
    let trace = Context::current();
    let task = tokio::spawn(async move {
        let mut out = Answers(tx.clone());
        if let Err(status) = exchange(upstream, requests, &mut out, &trace).await {
            let _ = tx.send(Err(status)).await;
        }
    });
    Exchange {
        answers: tokio_stream::wrappers::ReceiverStream::new(rx),
        task: task.abort_handle(),
    }
    .boxed()
}

/// The answer of one exchange; dropping it aborts the exchange.
struct Exchange {
    answers: tokio_stream::wrappers::ReceiverStream<Result<Bytes, Status>>,
    task: tokio::task::AbortHandle,
}

impl futures::Stream for Exchange {
    type Item = Result<Bytes, Status>;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.answers.poll_next_unpin(cx)
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The answer's messages.
struct Answers(mpsc::Sender<Result<Bytes, Status>>);

impl Outgoing for Answers {
    async fn send(&mut self, message: Bytes) -> bool {
        self.0.send(Ok(message)).await.is_ok()
    }
}

/// The request's messages after its head.
struct Pieces(Requests);

impl Incoming for Pieces {
    async fn recv(&mut self) -> Result<Option<Bytes>, String> {
        Ok(self.0.recv().await)
    }
}

async fn exchange(
    upstream: Upstream,
    mut requests: Requests,
    out: &mut Answers,
    trace: &Context,
) -> Result<(), Status> {
    let first = requests
        .recv()
        .await
        .ok_or_else(|| Status::invalid_argument("the HTTP request had no head"))?;
    let head = match HttpRequest::decode(first).map(|m| m.kind) {
        Ok(Some(http_request::Kind::Head(head))) => head,
        Ok(_) => {
            return Err(Status::invalid_argument(
                "the HTTP request did not start with its head",
            ));
        }
        Err(e) => {
            return Err(Status::invalid_argument(format!(
                "malformed HTTP request: {e}"
            )));
        }
    };
    let headers = request_headers(&head)?;
    let empty = || {
        http_body_util::Empty::new()
            .map_err(BoxError::from)
            .boxed_unsync()
    };
    // An upgrade's request has no body: what follows the head is the upgraded stream.
    let (body, mut upgraded) = if http_relay::wants_upgrade(&headers) {
        (empty(), Some(Pieces(requests)))
    } else if head.end_stream {
        // Without a body: one that streams would end only with the close-send (and go
        // chunked but for a GET, HEAD or CONNECT).
        (empty(), None)
    } else {
        (
            http_relay::recv_body::<HttpRequest, _>(Pieces(requests)),
            None,
        )
    };
    let method = http::Method::from_bytes(head.method.as_bytes()).map_err(|_| {
        Status::invalid_argument(format!("{:?} is not an HTTP method", head.method))
    })?;
    let mut req = http::Request::builder()
        .method(method)
        .uri(&head.path)
        .body(body)
        .map_err(|e| Status::invalid_argument(format!("bad request path {:?}: {e}", head.path)))?;
    *req.headers_mut() = headers;
    // The API server's request, in the call's trace: it gets the span as its parent.
    let sent = traces::child(
        "agentk",
        "kubernetes_api.upstream",
        SpanKind::Client,
        trace,
        || {
            vec![
                KeyValue::new("http.request.method", head.method.clone()),
                KeyValue::new("url.path", req.uri().path().to_string()),
            ]
        },
    );
    let _ending = traces::Ending(sent.clone());
    traces::into_headers(&sent, req.headers_mut());
    let resp = upstream.send(req).await;
    let mut resp = resp.map_err(|e| {
        let status = Status::unavailable(format!("cannot reach the Kubernetes API server: {e}"));
        sent.span()
            .set_status(SpanStatus::error(status.message().to_string()));
        status
    })?;
    let status = resp.status();
    sent.span().set_attribute(KeyValue::new(
        "http.response.status_code",
        i64::from(status.as_u16()),
    ));
    let headers = http_relay::to_values(resp.headers());
    http_relay::check_size(&headers)
        .map_err(|e| Status::unavailable(format!("the API server's response head: {e}")))?;
    let head = HttpResponse {
        kind: Some(kas_proto::http::http_response::Kind::Head(ResponseHead {
            status: u32::from(status.as_u16()),
            headers,
        })),
    };
    if !out.send(http_relay::encode(head)).await {
        return Ok(());
    }
    if status == http::StatusCode::SWITCHING_PROTOCOLS {
        let pieces = upgraded
            .as_mut()
            .ok_or_else(|| Status::unavailable("the API server switched protocols unasked"))?;
        let io = hyper::upgrade::on(&mut resp).await.map_err(|e| {
            Status::unavailable(format!("the API server's upgraded connection failed: {e}"))
        })?;
        let end = http_relay::UpgradedEnd::Server;
        return http_relay::relay_upgraded::<HttpRequest, HttpResponse>(io, end, None, pieces, out)
            .await
            .map_err(Status::unavailable);
    }
    match http_relay::send_body::<HttpResponse, _>(resp.into_body(), out).await {
        Ok(_) => Ok(()),
        Err(e) => Err(Status::unavailable(format!(
            "the API server's response: {e}"
        ))),
    }
}

/// The headers sent to the API server for `head`: the caller's, less what the caller may
/// not set, with kas's impersonation.
fn request_headers(head: &RequestHead) -> Result<HeaderMap, Status> {
    let mut headers = HeaderMap::new();
    http_relay::add_values(&head.headers, &mut headers).map_err(Status::invalid_argument)?;
    // kas dropped them already: this is defence in depth, not the guard.
    let barred: Vec<HeaderName> = headers
        .keys()
        .filter(|n| !http_relay::caller_may_set(n.as_str()))
        .cloned()
        .collect();
    for name in barred {
        headers.remove(name);
    }
    if let Some(who) = &head.impersonation {
        impersonate(who, &mut headers).map_err(Status::invalid_argument)?;
    }
    Ok(headers)
}

/// Sets the `Impersonate-*` headers for `who`.
fn impersonate(who: &Impersonation, headers: &mut HeaderMap) -> Result<(), String> {
    let value = |v: &str| {
        HeaderValue::from_str(v).map_err(|_| format!("impersonation value {v:?} is not valid HTTP"))
    };
    headers.insert("impersonate-user", value(&who.user)?);
    for g in &who.groups {
        headers.append("impersonate-group", value(g)?);
    }
    let mut extra: Vec<_> = who.extra.iter().collect();
    extra.sort_by(|a, b| a.0.cmp(b.0));
    for (key, vs) in extra {
        // Keys are case-insensitive in headers; Kubernetes percent-encodes what headers
        // cannot carry, which a GitLab key (`agent.gitlab.com/id`) needs for its `/`.
        let name = format!("{IMPERSONATE_EXTRA}{}", percent_encode(key));
        let name = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("impersonation extra key {key:?} is not valid HTTP"))?;
        for v in &vs.values {
            headers.append(name.clone(), value(v)?);
        }
    }
    Ok(())
}

/// Percent-encodes everything but unreserved characters (RFC 3986), as Kubernetes expects
/// of `Impersonate-Extra-` keys.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::disallowed_types)] // prost's header maps, built for the test
    use super::*;
    use kas_proto::frame::Values;

    #[test]
    fn callers_credentials_impersonation_and_front_proxy_headers_never_reach_the_cluster() {
        let values = |v: &str| Values {
            values: vec![v.into()],
        };
        let mut sent = std::collections::HashMap::new();
        for name in [
            "authorization",
            "Impersonate-User",
            "impersonate-group",
            "impersonate-uid",
            "impersonate-extra-scopes",
            "X-Remote-User",
            "x-remote-group",
            "X-Remote-Extra-Scopes",
        ] {
            sent.insert(name.to_string(), values("mallory"));
        }
        sent.insert("accept".into(), values("application/json"));
        let head = RequestHead {
            method: "GET".into(),
            path: "/api/v1/pods".into(),
            headers: sent,
            impersonation: Some(Impersonation {
                user: "gitlab:user:alice".into(),
                ..Default::default()
            }),
            end_stream: false,
        };
        let headers = request_headers(&head).unwrap();
        let mut names: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
        names.sort_unstable();
        assert_eq!(names, ["accept", "impersonate-user"]);
        assert_eq!(headers["impersonate-user"], "gitlab:user:alice");
    }
}
