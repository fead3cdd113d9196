//! The Kubernetes API listener (`agent.kubernetes_api`): kubectl, GitLab's cluster
//! dashboard and any Kubernetes client reach an agent's cluster through any kas.
//!
//! Each HTTP request (HTTP/1.1 or HTTP/2) names its agent in its bearer token (see
//! [`access`]) and becomes one streaming call to that agent's Kubernetes API module, routed
//! like any other: its head, then its body as it streams, one way; the response head and
//! body as they stream, the other. A `101 Switching Protocols` (WebSocket or SPDY: exec,
//! attach, port-forward) turns the call into a two-way byte stream. A watch or an exec
//! session lasts for as long as the client keeps it: no kas timeout applies once the call
//! reached the agent. Refusals are Kubernetes `Status` objects, which kubectl prints.

// Peer input passes through here: nothing may panic on it.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)
)]

mod audit;
mod gitlab;

pub use audit::AuditLog;
pub use gitlab::GitLabAccess;
pub use kas_auth::user_tokens::{Credential, Grant, Refusal, StaticUserTokens};

use super::call::{Call, Rest};
use super::correlation::{self, CorrelationId};
use super::handle::{CancelOnDrop, EngineHandle};
use super::limits::{Place, Places};
use super::listener::Busy;
use super::metrics::Metrics;
use super::reply::Reply;
use audit::Entry;
use axum::body::Body;
use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body::Body as _;
use kas_core::node::Origin;
use kas_core::{AgentId, KasId};
use kas_proto::frame::{Frame, RequestStart};
use kas_proto::http::{
    HttpRequest, HttpResponse, KUBERNETES_API_METHOD, RequestHead, ResponseHead, http_request,
    http_response,
};
use kas_transport::clock;
use kas_transport::frames;
use kas_transport::http_relay::{self, Incoming, Outgoing, UpgradedEnd};
use kas_transport::traces::{
    self, Context, Ending, KeyValue, SpanKind, Status as SpanStatus, TraceContextExt,
};
use prost::Message;
use sha2::{Digest, Sha256};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::mpsc;
use tonic::Status;

/// Where callers' tokens are checked.
pub enum UserTokens {
    /// A static file.
    Static(StaticUserTokens),
    /// GitLab, cached.
    GitLab(kas_auth::agent_auth::TokenCache<Grant>),
}

impl UserTokens {
    /// Checks `credential`, presented from `peer`.
    async fn check(
        &self,
        credential: &Credential,
        peer: Option<std::net::IpAddr>,
    ) -> Result<Grant, Refusal> {
        use kas_auth::agent_auth::AuthError;
        match self {
            UserTokens::Static(tokens) => tokens.check(credential),
            UserTokens::GitLab(cache) => {
                let key = credential.to_bearer();
                cache.resolve(&key, peer).await.map_err(|e| match e {
                    AuthError::InvalidToken => {
                        Refusal::Unauthenticated("the token is not valid".into())
                    }
                    AuthError::Forbidden(m) => Refusal::Forbidden(m),
                    AuthError::Unavailable(m) => Refusal::Unavailable(m),
                    e @ AuthError::Throttled { .. } => Refusal::Throttled(e.to_string()),
                })
            }
        }
    }
}

/// What the listener needs.
pub struct KubernetesApiService {
    /// The engine.
    pub engine: EngineHandle,
    /// Checks callers' tokens.
    pub tokens: UserTokens,
    /// `url_path_prefix`, ending with `/`.
    pub prefix: String,
    /// `routing_timeout`.
    pub routing_timeout: Duration,
    /// What each caller token has open.
    pub open: OpenRequests,
    /// `streaming_idle_timeout`.
    pub streaming_idle_timeout: Duration,
    /// This kas, as audit records name it.
    pub kas: KasId,
    /// The audit log, when on.
    pub audit: Option<AuditLog>,
    /// Counts refusals for want of the audit log.
    pub metrics: Metrics,
}

/// The configuration keys of [`OpenRequests`]'s limits.
const MAX_REQUESTS_PER_TOKEN: &str = "agent.kubernetes_api.max_requests_per_token";
const MAX_REQUESTS_PER_TOKEN_PER_AGENT: &str =
    "agent.kubernetes_api.max_requests_per_token_per_agent";

/// A digest of a caller's token, so that the tokens themselves are not kept.
type TokenKey = [u8; 32];

/// Requests each caller token has open at once, under `max_requests_per_token` in all and
/// `max_requests_per_token_per_agent` to each agent.
#[derive(Clone)]
pub struct OpenRequests {
    per_token: Places<TokenKey>,
    per_agent: Places<(TokenKey, AgentId)>,
    metrics: Metrics,
}

/// A request's places under both limits, held until dropped: with the response's body or
/// upgraded stream.
pub struct Open {
    /// Whom the request counts against in the sharing of the agent's tunnels: its token's
    /// digest, the same on every kas.
    holder: u64,
    _token: Place<TokenKey>,
    _agent: Place<(TokenKey, AgentId)>,
}

impl OpenRequests {
    /// At most `max` requests per token and `max_per_agent` to one agent; refusals counted
    /// in `metrics`.
    pub fn new(max: usize, max_per_agent: usize, metrics: Metrics) -> Self {
        OpenRequests {
            per_token: Places::new(max),
            per_agent: Places::new(max_per_agent),
            metrics,
        }
    }

    /// Places for one more request of `credential`'s token.
    fn open(&self, credential: &Credential) -> Result<Open, Refusal> {
        let key: TokenKey = Sha256::digest(credential.token.as_bytes()).into();
        let refuse = |limit: &'static str, what: String| {
            self.metrics.limit_refused(limit);
            Refusal::Throttled(format!("{what} (limit {limit})"))
        };
        let agent = self
            .per_agent
            .take((key, credential.agent))
            .ok_or_else(|| {
                let what = format!(
                    "this token already has {} requests open to agent {} on this kas",
                    self.per_agent.max(),
                    credential.agent
                );
                refuse(MAX_REQUESTS_PER_TOKEN_PER_AGENT, what)
            })?;
        let token = self.per_token.take(key).ok_or_else(|| {
            let what = format!(
                "this token already has {} requests open on this kas",
                self.per_token.max()
            );
            refuse(MAX_REQUESTS_PER_TOKEN, what)
        })?;
        Ok(Open {
            holder: key.first_chunk().map_or(0, |b| u64::from_le_bytes(*b)),
            _token: token,
            _agent: agent,
        })
    }
}

/// The agent's answer, and the caller's places under its token's limits (and its
/// connection's busy mark) for as long as the answer is read; its audit record is written
/// when it is dropped.
struct Answer {
    reply: Reply,
    entry: Entry,
    /// The request's span, ended with the answer.
    _trace: Option<Ending>,
    _open: Open,
    _busy: Option<Busy>,
}

impl Incoming for Answer {
    async fn recv(&mut self) -> Result<Option<Bytes>, String> {
        let next = self.reply.recv().await;
        match &next {
            Ok(Some(message)) => self.entry.responded(message.len()),
            Ok(None) => {}
            Err(e) => self.entry.broke(e),
        }
        next
    }
}

impl KubernetesApiService {
    /// The service as an axum router: every path is the Kubernetes API's.
    pub fn router(self) -> axum::Router {
        let this = Arc::new(self);
        axum::Router::new().fallback(move |req: Request<Body>| {
            let this = this.clone();
            async move {
                let peer = req
                    .extensions()
                    .get::<axum::extract::ConnectInfo<super::listener::Peer>>()
                    .map(|c| c.0.0.ip());
                let caller_id = req.headers().get(correlation::HEADER);
                let id = CorrelationId::from_caller(caller_id.and_then(|v| v.to_str().ok()));
                let parent = traces::from_headers(req.headers());
                let trace = traces::child(
                    "kas",
                    "kubernetes_api.request",
                    SpanKind::Server,
                    &parent,
                    || {
                        vec![
                            KeyValue::new("http.request.method", req.method().to_string()),
                            KeyValue::new("url.path", req.uri().path().to_string()),
                            KeyValue::new("kas.id", this.kas.0.clone()),
                            KeyValue::new("kas.correlation_id", id.as_str().to_string()),
                        ]
                    },
                );
                // Dropped at the end of the request, or here on a refusal: recorded either
                // way.
                let mut entry = Entry::default();
                let answer = match this.audit_entry(&id, peer, &req) {
                    Ok(e) => {
                        entry = e;
                        entry.traced(traces::trace_id(&trace));
                        this.proxy(req, peer, &id, &mut entry, &trace).await
                    }
                    Err(refusal) => Err(refusal),
                };
                let mut resp = match answer {
                    Ok(resp) => resp,
                    Err(refusal) => {
                        tracing::debug!(correlation_id = %id, trace_id = traces::trace_id(&trace).as_deref(), error = ?refusal, "Kubernetes API request refused");
                        let (code, reason, message) = refusal.status();
                        entry.refused(code.as_u16(), &message);
                        let span = trace.span();
                        span.set_attribute(KeyValue::new(
                            "http.response.status_code",
                            i64::from(code.as_u16()),
                        ));
                        span.set_status(SpanStatus::error(message.clone()));
                        span.end();
                        kubernetes_status(code, reason, &id.suffix(&message))
                    }
                };
                if let Ok(value) = HeaderValue::from_str(id.as_str()) {
                    resp.headers_mut().insert(correlation::HEADER, value);
                }
                resp
            }
        })
    }

    /// The audit record of `req`, or its refusal while the audit log cannot take one.
    fn audit_entry(
        &self,
        id: &CorrelationId,
        peer: Option<std::net::IpAddr>,
        req: &Request<Body>,
    ) -> Result<Entry, Failure> {
        let Some(log) = &self.audit else {
            return Ok(Entry::default());
        };
        match log.failing() {
            Some(why) => {
                self.metrics.audit_refusals.inc();
                Err(Failure::AuditLog(why))
            }
            None => Ok(log.entry(&self.kas, id, peer, req.method(), req.uri())),
        }
    }

    /// Admission, in a span of its own: the token (GitLab's answer, or the cache's) and
    /// the caller's limits. A refusal is carried by the request's span.
    async fn admit(
        &self,
        credential: &Credential,
        peer: Option<std::net::IpAddr>,
        entry: &mut Entry,
        trace: &Context,
    ) -> Result<(Grant, Open), Failure> {
        let admission = traces::child("kas", "kas.admission", SpanKind::Internal, trace, Vec::new);
        let admitted = async {
            let grant = self.tokens.check(credential, peer).await?;
            entry.granted(&grant.caller, grant.impersonation.as_ref());
            let open = self.open.open(credential)?;
            Ok((grant, open))
        }
        .await;
        let span = admission.span();
        span.set_attribute(KeyValue::new("kas.admitted", admitted.is_ok()));
        span.end();
        admitted
    }

    async fn proxy(
        &self,
        mut req: Request<Body>,
        peer: Option<std::net::IpAddr>,
        id: &CorrelationId,
        entry: &mut Entry,
        trace: &Context,
    ) -> Result<Response<Body>, Failure> {
        let path = self.path(req.uri())?;
        entry.path(&path);
        let auth = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        let credential = Credential::parse(auth)?;
        entry.presented(&credential);
        let (grant, open) = self.admit(&credential, peer, entry, trace).await?;
        let upgrade =
            http_relay::wants_upgrade(req.headers()).then(|| hyper::upgrade::on(&mut req));
        let mut headers = http_relay::to_values(req.headers());
        // The caller's credentials and any identity it claims stay here: whom the agent
        // acts as is the grant's to say.
        headers.retain(|name, _| http_relay::caller_may_set(name));
        // The API server's logs can name the call too, and its trace continue ours.
        headers.extend(id.metadata());
        let route = traces::child("kas", "kas.route", SpanKind::Internal, trace, || {
            vec![KeyValue::new("kas.agent_id", credential.agent.0)]
        });
        traces::into_metadata(&route, &mut headers);
        http_relay::check_size(&headers).map_err(Failure::HeadersTooLarge)?;
        let end_stream = upgrade.is_none() && req.body().is_end_stream();
        let head = HttpRequest {
            kind: Some(http_request::Kind::Head(RequestHead {
                method: req.method().as_str().to_string(),
                path: path.clone(),
                headers,
                impersonation: grant.impersonation,
                end_stream,
            })),
        };
        let asked = request_timeout(&path);
        let wait = asked.map_or(self.routing_timeout, |t| t.min(self.routing_timeout));
        // A request without a body (most: a get, a watch, a log) goes whole, its close-send
        // too, so that a forward need not wait to hear the call delivered before the agent
        // has all of it; another streams its body, an upgrade's the upgraded bytes.
        let mut requests = vec![frames::message(0, head.encode_to_vec())];
        let (rest_tx, rest) = if end_stream {
            requests.push(frames::close_send(0));
            (None, None)
        } else {
            let (tx, rest) = Rest::channel();
            let to_agent = ToAgent {
                frames: tx,
                relayed: entry.request_counter(),
            };
            (Some(to_agent), Some(rest))
        };
        let (tx, rx) = mpsc::channel(16);
        let agent = credential.agent;
        let deadline = clock::now() + wait;
        let call = Call {
            agent,
            connection: None,
            deadline,
            start: Arc::new(RequestStart {
                request_id: 0,
                agent_id: agent.0,
                connection_id: None,
                method: KUBERNETES_API_METHOD.into(),
                metadata: id.metadata().into(),
                hops: 0,
                streaming: true,
                deadline_millis: None,
                holder: Some(open.holder),
            }),
            requests: Arc::new(requests),
            rest,
            responses: tx,
            delivered_to: entry.delivered_to(),
            trace: route,
        };
        let id = self.engine.next_request_id();
        self.engine
            .submit(id, Origin::Public, call)
            .map_err(Failure::Call)?;
        let cancel = CancelOnDrop::new(self.engine.clone(), id);
        // The caller's `?timeout=` bounds its wait for the response head too, as it bounds
        // the request in kube-apiserver (a silent agent held a caller that asked for 1 s for
        // good); without one, the head may take as long as the API server takes.
        let head_by = asked.map(|t| clock::now() + t);
        let mut from_agent = Answer {
            reply: Reply::new(agent, rx, cancel, head_by, true),
            // Taken from the caller's once the answer is under way.
            entry: Entry::default(),
            _trace: None,
            _open: open,
            _busy: req.extensions().get::<Busy>().cloned(),
        };
        let idle = Some(self.streaming_idle_timeout);
        let upgrading = match (upgrade, rest_tx) {
            (Some(on_upgrade), Some(out)) => Some((on_upgrade, out)),
            (None, Some(mut out)) => {
                let body = req.into_body();
                tokio::spawn(async move {
                    // A body that broke drops the request unclosed: the caller is gone.
                    if let Ok(true) = http_relay::send_body::<HttpRequest, _>(body, &mut out).await
                    {
                        out.close().await;
                    }
                });
                None
            }
            _ => None,
        };
        // (The routing's span ends with the routing, in the engine.)
        let head = response_head(&mut from_agent.reply, agent).await?;
        // 1xx heads other than an asked-for upgrade's 101 have no place here.
        let status = StatusCode::from_u16(u16::try_from(head.status).unwrap_or(0))
            .ok()
            .filter(|s| {
                !s.is_informational()
                    || (*s == StatusCode::SWITCHING_PROTOCOLS && upgrading.is_some())
            })
            .ok_or_else(|| {
                Failure::Agent(format!(
                    "agent {agent} answered with HTTP status {}",
                    head.status
                ))
            })?;
        let mut headers = http::HeaderMap::new();
        http_relay::add_values(&head.headers, &mut headers).map_err(|e| {
            Failure::Agent(format!("agent {agent} answered with a bad header: {e}"))
        })?;
        entry.answered(status.as_u16());
        from_agent.entry = std::mem::take(entry);
        trace.span().set_attribute(KeyValue::new(
            "http.response.status_code",
            i64::from(status.as_u16()),
        ));
        from_agent._trace = Some(Ending(trace.clone()));
        Ok(relay(agent, from_agent, (status, headers), upgrading, idle))
    }

    /// The path and query under `url_path_prefix`, as the API server sees it.
    fn path(&self, uri: &http::Uri) -> Result<String, Failure> {
        let full = uri.path_and_query().map_or("/", |p| p.as_str());
        let rest = full.strip_prefix(self.prefix.as_str()).ok_or_else(|| {
            Failure::NotFound(format!(
                "{} is not under the Kubernetes API prefix {}",
                uri.path(),
                self.prefix
            ))
        })?;
        Ok(format!("/{rest}"))
    }
}

/// The upgrade a request asked for, and where its upgraded bytes go.
type Upgrading = Option<(hyper::upgrade::OnUpgrade, ToAgent)>;

/// The response to the caller, `status` with `headers`, its body or upgraded stream
/// relayed from `from_agent` (agent `agent`'s answer).
fn relay(
    agent: AgentId,
    mut from_agent: Answer,
    (status, headers): (StatusCode, http::HeaderMap),
    upgrading: Upgrading,
    idle: Option<Duration>,
) -> Response<Body> {
    let mut resp = Response::new(Body::empty());
    *resp.status_mut() = status;
    *resp.headers_mut() = headers;
    match upgrading {
        Some((on_upgrade, mut out)) if status == StatusCode::SWITCHING_PROTOCOLS => {
            tokio::spawn(async move {
                let Ok(io) = on_upgrade.await else { return };
                let end = UpgradedEnd::Caller;
                let relay = http_relay::relay_upgraded::<HttpResponse, HttpRequest>(
                    io,
                    end,
                    idle,
                    &mut from_agent,
                    &mut out,
                );
                if let Err(e) = relay.await {
                    tracing::debug!(%agent, error = %e, "upgraded stream ended");
                }
            });
        }
        upgrading => {
            if let Some((_, mut out)) = upgrading {
                // Refused: the upgrade's request is over.
                tokio::spawn(async move { out.close().await });
            }
            *resp.body_mut() = Body::new(http_relay::recv_body::<HttpResponse, _>(from_agent));
        }
    }
    resp
}

/// A request's own `?timeout=` (kubectl's `--request-timeout`), e.g. `32s` or `1m0s`.
fn request_timeout(path: &str) -> Option<Duration> {
    let query = path.split_once('?')?.1;
    let value = query
        .split('&')
        .find_map(|kv| kv.strip_prefix("timeout="))?;
    humantime::parse_duration(value).ok()
}

/// The request's messages after its head: body or upgraded bytes, then the close-send;
/// counted for the audit log when it is on.
struct ToAgent {
    frames: mpsc::Sender<Frame>,
    relayed: Option<Arc<AtomicU64>>,
}

impl Outgoing for ToAgent {
    async fn send(&mut self, message: Bytes) -> bool {
        if let Some(n) = &self.relayed {
            n.fetch_add(message.len() as u64, Ordering::Relaxed);
        }
        self.frames.send(frames::message(0, message)).await.is_ok()
    }

    async fn close(&mut self) {
        let _ = self.frames.send(frames::close_send(0)).await;
    }
}

/// The response head, which comes first.
async fn response_head(reply: &mut Reply, agent: AgentId) -> Result<ResponseHead, Failure> {
    let first = reply
        .message()
        .await
        .map_err(Failure::Call)?
        .ok_or_else(|| {
            Failure::Agent(format!(
                "agent {agent} ended the call without an HTTP response"
            ))
        })?;
    match HttpResponse::decode(first).map(|m| m.kind) {
        Ok(Some(http_response::Kind::Head(head))) => Ok(head),
        Ok(_) => Err(Failure::Agent(format!(
            "agent {agent} answered without an HTTP response head"
        ))),
        Err(e) => Err(Failure::Agent(format!(
            "agent {agent} sent a malformed HTTP response: {e}"
        ))),
    }
}

impl Incoming for Reply {
    async fn recv(&mut self) -> Result<Option<Bytes>, String> {
        self.message().await.map_err(|s| s.message().to_string())
    }
}

/// Why a request got no response from its agent's API server.
#[derive(Debug)]
enum Failure {
    /// Refused by the token check.
    Refused(Refusal),
    /// The path is not under the prefix.
    NotFound(String),
    /// kas could not route the call, or it failed on the way.
    Call(Status),
    /// The agent answered something that is not an HTTP response.
    Agent(String),
    /// The request's headers are more than kas relays.
    HeadersTooLarge(String),
    /// The audit log cannot take the request's record.
    AuditLog(String),
}

impl From<Refusal> for Failure {
    fn from(r: Refusal) -> Self {
        Failure::Refused(r)
    }
}

impl Failure {
    /// The HTTP status, the Kubernetes `Status` reason and the message of the response,
    /// which kubectl prints as the error.
    fn status(self) -> (StatusCode, &'static str, String) {
        match self {
            Failure::Refused(Refusal::Unauthenticated(m)) => {
                (StatusCode::UNAUTHORIZED, "Unauthorized", m)
            }
            Failure::Refused(Refusal::Forbidden(m)) => (StatusCode::FORBIDDEN, "Forbidden", m),
            Failure::Refused(Refusal::Throttled(m)) => {
                (StatusCode::TOO_MANY_REQUESTS, "TooManyRequests", m)
            }
            Failure::Refused(Refusal::Unavailable(m)) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                m.clone(),
            ),
            Failure::NotFound(m) => (StatusCode::NOT_FOUND, "NotFound", m),
            Failure::Agent(m) => (StatusCode::BAD_GATEWAY, "InternalError", m),
            Failure::HeadersTooLarge(m) => (
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "RequestEntityTooLarge",
                format!("the request's headers: {m}"),
            ),
            Failure::AuditLog(m) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                format!(
                    "kas takes no Kubernetes API requests while its audit log ({}) cannot be written: {m}",
                    audit::KEY
                ),
            ),
            Failure::Call(s) => {
                let (code, reason) = match s.code() {
                    tonic::Code::DeadlineExceeded => (StatusCode::GATEWAY_TIMEOUT, "Timeout"),
                    tonic::Code::ResourceExhausted => {
                        (StatusCode::TOO_MANY_REQUESTS, "TooManyRequests")
                    }
                    tonic::Code::InvalidArgument => (StatusCode::BAD_REQUEST, "BadRequest"),
                    tonic::Code::Unimplemented => (StatusCode::NOT_IMPLEMENTED, "InternalError"),
                    tonic::Code::Unavailable => {
                        (StatusCode::SERVICE_UNAVAILABLE, "ServiceUnavailable")
                    }
                    _ => (StatusCode::BAD_GATEWAY, "InternalError"),
                };
                (code, reason, s.message().to_string())
            }
        }
    }
}

/// A Kubernetes `Status` object as the response.
fn kubernetes_status(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    let body = serde_json::json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code.as_u16(),
    });
    let mut resp = Response::new(Body::from(body.to_string()));
    *resp.status_mut() = code;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// Serves the listener until `signal` resolves: then it takes no new connections, tells
/// HTTP/2 clients to go elsewhere (GOAWAY) and lets running requests finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    service: KubernetesApiService,
    tls: Option<Arc<rustls::ServerConfig>>,
    listen: &crate::config::Listen,
    metrics: super::metrics::Metrics,
    signal: impl Future<Output = ()> + Send + 'static,
) {
    use super::listener::{Acceptor, Guard, RequestTimeouts};
    // A watch or an exec session may rightly stay silent: timers run between requests.
    let guard = Guard::Requests(RequestTimeouts {
        first_byte: listen.handshake_timeout,
        head: listen.request_head_timeout,
        idle: listen.idle_timeout,
    });
    let acceptor = Acceptor::new(listener, guard, "kubernetes_api", metrics);
    super::listener::serve_http(acceptor, service.router(), tls, listen, signal).await;
}
