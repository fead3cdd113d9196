//! A small Kubernetes API server for the local deployment and the tests: the fixture pods
//! of one cluster, with just enough of the API for kubectl — discovery, `get pods` (as a
//! list or, when asked, as a server-side printed table), watch, create and delete (which
//! the watchers see), logs with follow (each pod writes a line every
//! [`LOG_LINE_EVERY`]), and exec over WebSocket (`v5.channel.k8s.io`/`v4.channel.k8s.io`)
//! that echoes its command's arguments, and port-forward (see [`port_forward`]) whose ports
//! echo. Plain HTTP/1.1 on loopback: what the agent dials.
//! Two paths are test data, not Kubernetes: `/kas-local/bytes?n=N` streams N bytes (byte i
//! is i % 251), and `/kas-local/requests` counts the requests served so far by method and
//! path (what a test compares with the calls it made: at-most-once, counted at the cluster).

use super::port_forward;
use axum::body::Body;
use futures::{SinkExt, StreamExt};
use http::{HeaderValue, Request, Response, StatusCode, header};
use kas_agent::pods::FixturePodLog;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
use tokio::sync::broadcast;
use tokio_tungstenite::tungstenite::Message as WsMessage;

/// How often each pod's log gains a line (what `logs -f` shows arriving).
pub const LOG_LINE_EVERY: Duration = Duration::from_millis(300);

/// Watch events a slow watcher may fall behind by before it is cut off.
const WATCH_BACKLOG: usize = 256;

struct Pod {
    namespace: String,
    name: String,
    phase: String,
    node: String,
    log: String,
    created: SystemTime,
    resource_version: u64,
}

struct Cluster {
    pods: Mutex<(Vec<Pod>, u64)>,
    /// Requests served, by `METHOD path` (test data paths not counted).
    requests: Mutex<BTreeMap<String, u64>>,
    events: broadcast::Sender<(&'static str, Value, Value)>,
    started: SystemTime,
}

/// A running server; stopped when dropped.
pub struct KubeServer {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for KubeServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl KubeServer {
    /// Serves `pods` on a free loopback port.
    pub async fn start(pods: &[FixturePodLog]) -> std::io::Result<KubeServer> {
        Self::start_on(SocketAddr::from(([127, 0, 0, 1], 0)), pods).await
    }

    /// Serves `pods` on `addr`.
    pub async fn start_on(addr: SocketAddr, pods: &[FixturePodLog]) -> std::io::Result<KubeServer> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let now = SystemTime::now();
        let pods: Vec<Pod> = pods
            .iter()
            .enumerate()
            .map(|(i, p)| Pod {
                namespace: p.pod.namespace.clone(),
                name: p.pod.name.clone(),
                phase: p.pod.phase.clone(),
                node: p.pod.node_name.clone(),
                log: String::from_utf8_lossy(&p.log).into_owned(),
                created: now,
                resource_version: i as u64 + 1,
            })
            .collect();
        let version = pods.len() as u64;
        let cluster = Arc::new(Cluster {
            pods: Mutex::new((pods, version)),
            requests: Mutex::default(),
            events: broadcast::channel(WATCH_BACKLOG).0,
            started: now,
        });
        let routes = axum::Router::new().fallback(move |req: Request<Body>| {
            let cluster = cluster.clone();
            async move { cluster.handle(req).await }
        });
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, routes).await;
        });
        Ok(KubeServer { addr, task })
    }

    /// Its URL (`http://127.0.0.1:PORT`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Serves until the server's task ends (it does not, unless it panics).
    pub async fn serve(mut self) -> Result<(), tokio::task::JoinError> {
        (&mut self.task).await
    }
}

/// The query parameter `key`'s values.
fn params<'a>(query: &'a str, key: &'a str) -> impl Iterator<Item = String> + 'a {
    query.split('&').filter_map(move |kv| {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        (k == key).then(|| percent_decode(v))
    })
}

fn param(query: &str, key: &str) -> Option<String> {
    params(query, key).next()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn rfc3339(t: SystemTime) -> String {
    let secs = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let days = secs / 86_400;
    let (h, m, s) = (secs % 86_400 / 3600, secs % 3600 / 60, secs % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let mo = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(mo <= 2);
    format!("{y:04}-{mo:02}-{d:02}T{h:02}:{m:02}:{s:02}Z")
}

impl Pod {
    fn metadata(&self) -> Value {
        json!({
            "name": self.name,
            "namespace": self.namespace,
            "uid": format!("uid-{}-{}", self.namespace, self.name),
            "resourceVersion": self.resource_version.to_string(),
            "creationTimestamp": rfc3339(self.created),
        })
    }

    fn object(&self) -> Value {
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": self.metadata(),
            "spec": {"nodeName": self.node, "containers": [{"name": "main", "image": "fixture"}]},
            "status": {"phase": self.phase},
        })
    }

    fn row(&self) -> Value {
        let age = SystemTime::now()
            .duration_since(self.created)
            .unwrap_or_default()
            .as_secs();
        json!({
            "cells": [self.name, "1/1", self.phase, 0, format!("{age}s")],
            "object": {
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": self.metadata(),
            },
        })
    }
}

fn table(rows: Vec<Value>, resource_version: u64) -> Value {
    let column = |name: &str, kind: &str, format: &str| json!({"name": name, "type": kind, "format": format, "description": "", "priority": 0});
    json!({
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version.to_string()},
        "columnDefinitions": [
            column("Name", "string", "name"),
            column("Ready", "string", ""),
            column("Status", "string", ""),
            column("Restarts", "integer", ""),
            column("Age", "string", ""),
        ],
        "rows": rows,
    })
}

fn json_response(code: StatusCode, body: &Value) -> Response<Body> {
    let mut resp = Response::new(Body::from(body.to_string()));
    *resp.status_mut() = code;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

fn status(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    json_response(
        code,
        &json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code.as_u16(),
        }),
    )
}

fn not_found(what: &str) -> Response<Body> {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("{what} not found"),
    )
}

impl Cluster {
    async fn handle(self: Arc<Self>, req: Request<Body>) -> Response<Body> {
        let path = req.uri().path().to_string();
        let query = req.uri().query().unwrap_or("").to_string();
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        let as_table = req
            .headers()
            .get(header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|a| a.contains("as=Table"));
        let method = req.method().clone();
        if segments.first() != Some(&"kas-local") {
            let mut requests = self.requests.lock().unwrap_or_else(|p| p.into_inner());
            *requests.entry(format!("{method} {path}")).or_default() += 1;
        }
        match (method.as_str(), segments.as_slice()) {
            ("GET", ["version"]) => json_response(
                StatusCode::OK,
                &json!({"major": "1", "minor": "32", "gitVersion": "v1.32.0-kas-local", "platform": "linux/amd64"}),
            ),
            ("GET", ["api"]) => json_response(
                StatusCode::OK,
                &json!({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}),
            ),
            ("GET", ["apis"]) => json_response(
                StatusCode::OK,
                &json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": []}),
            ),
            ("GET", ["api", "v1"]) => json_response(StatusCode::OK, &resources()),
            ("GET", ["kas-local", "bytes"]) => bytes(&query),
            ("GET", ["kas-local", "requests"]) => {
                let requests = self.requests.lock().unwrap_or_else(|p| p.into_inner());
                json_response(StatusCode::OK, &json!(*requests))
            }
            ("GET", ["api", "v1", "pods"]) => self.list(None, &query, as_table),
            ("GET", ["api", "v1", "namespaces", ns, "pods"]) => {
                self.list(Some(ns), &query, as_table)
            }
            ("POST", ["api", "v1", "namespaces", ns, "pods"]) => {
                let ns = ns.to_string();
                self.create(&ns, req.into_body()).await
            }
            ("GET", ["api", "v1", "namespaces", ns, "pods", name]) => self.get(ns, name),
            ("DELETE", ["api", "v1", "namespaces", ns, "pods", name]) => self.delete(ns, name),
            ("GET", ["api", "v1", "namespaces", ns, "pods", name, "log"]) => {
                self.log(ns, name, &query)
            }
            ("GET" | "POST", ["api", "v1", "namespaces", ns, "pods", name, "exec"]) => {
                if self.find(ns, name).is_none() {
                    return not_found(&format!("pods \"{name}\""));
                }
                exec(req, &query)
            }
            ("GET" | "POST", ["api", "v1", "namespaces", ns, "pods", name, "portforward"]) => {
                if self.find(ns, name).is_none() {
                    return not_found(&format!("pods \"{name}\""));
                }
                port_forward(req)
            }
            _ => not_found(&format!("{method} {path}")),
        }
    }

    fn find(&self, ns: &str, name: &str) -> Option<Value> {
        let pods = self.pods.lock().unwrap_or_else(|p| p.into_inner());
        pods.0
            .iter()
            .find(|p| p.namespace == ns && p.name == name)
            .map(Pod::object)
    }

    fn list(&self, ns: Option<&str>, query: &str, as_table: bool) -> Response<Body> {
        let (items, rows, version) = {
            let pods = self.pods.lock().unwrap_or_else(|p| p.into_inner());
            let mine: Vec<&Pod> = pods
                .0
                .iter()
                .filter(|p| ns.is_none_or(|ns| p.namespace == ns))
                .collect();
            (
                mine.iter().map(|p| p.object()).collect::<Vec<_>>(),
                mine.iter().map(|p| p.row()).collect::<Vec<_>>(),
                pods.1,
            )
        };
        if param(query, "watch").is_some_and(|w| w == "true" || w == "1") {
            let since = param(query, "resourceVersion")
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
            return self.watch(
                ns.map(str::to_string),
                since,
                version,
                as_table,
                items,
                rows,
            );
        }
        let body = if as_table {
            table(rows, version)
        } else {
            json!({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": version.to_string()}, "items": items})
        };
        json_response(StatusCode::OK, &body)
    }

    /// Events after `since`: the current pods as ADDED when `since` is 0, then changes.
    fn watch(
        &self,
        ns: Option<String>,
        since: u64,
        version: u64,
        as_table: bool,
        items: Vec<Value>,
        rows: Vec<Value>,
    ) -> Response<Body> {
        let events = self.events.subscribe();
        let initial: Vec<Result<String, std::io::Error>> = if since == 0 {
            items
                .into_iter()
                .zip(rows)
                .map(|(item, row)| Ok(line(&event("ADDED", item, row, as_table, version))))
                .collect()
        } else {
            Vec::new()
        };
        // A watcher that falls too far behind is cut off, as the API server does.
        let changes = futures::stream::unfold(events, move |mut events| {
            let ns = ns.clone();
            async move {
                loop {
                    let (kind, item, row) = events.recv().await.ok()?;
                    let here = item["metadata"]["namespace"].as_str();
                    if ns.is_none() || here == ns.as_deref() {
                        let e = event(kind, item, row, as_table, 0);
                        return Some((Ok(line(&e)), events));
                    }
                }
            }
        });
        let stream = futures::stream::iter(initial).chain(changes);
        let mut resp = Response::new(Body::from_stream(stream));
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        resp
    }

    async fn create(&self, ns: &str, body: Body) -> Response<Body> {
        let Ok(bytes) = axum::body::to_bytes(body, 1 << 20).await else {
            return status(StatusCode::BAD_REQUEST, "BadRequest", "unreadable body");
        };
        let Ok(obj) = serde_json::from_slice::<Value>(&bytes) else {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "the body is not JSON",
            );
        };
        let Some(name) = obj["metadata"]["name"].as_str() else {
            return status(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid",
                "metadata.name is required",
            );
        };
        let (object, row) = {
            let mut pods = self.pods.lock().unwrap_or_else(|p| p.into_inner());
            if pods.0.iter().any(|p| p.namespace == ns && p.name == name) {
                return status(
                    StatusCode::CONFLICT,
                    "AlreadyExists",
                    &format!("pods \"{name}\" already exists"),
                );
            }
            pods.1 += 1;
            let pod = Pod {
                namespace: ns.to_string(),
                name: name.to_string(),
                phase: "Pending".into(),
                node: String::new(),
                log: String::new(),
                created: SystemTime::now(),
                resource_version: pods.1,
            };
            let out = (pod.object(), pod.row());
            pods.0.push(pod);
            out
        };
        let _ = self.events.send(("ADDED", object.clone(), row));
        json_response(StatusCode::CREATED, &object)
    }

    fn get(&self, ns: &str, name: &str) -> Response<Body> {
        match self.find(ns, name) {
            Some(pod) => json_response(StatusCode::OK, &pod),
            None => not_found(&format!("pods \"{name}\"")),
        }
    }

    fn delete(&self, ns: &str, name: &str) -> Response<Body> {
        let (object, row) = {
            let mut pods = self.pods.lock().unwrap_or_else(|p| p.into_inner());
            let Some(i) = pods
                .0
                .iter()
                .position(|p| p.namespace == ns && p.name == name)
            else {
                return not_found(&format!("pods \"{name}\""));
            };
            pods.1 += 1;
            let mut pod = pods.0.remove(i);
            pod.resource_version = pods.1;
            (pod.object(), pod.row())
        };
        let _ = self.events.send(("DELETED", object.clone(), row));
        json_response(StatusCode::OK, &object)
    }

    fn log(&self, ns: &str, name: &str, query: &str) -> Response<Body> {
        let Some(log) = ({
            let pods = self.pods.lock().unwrap_or_else(|p| p.into_inner());
            pods.0
                .iter()
                .find(|p| p.namespace == ns && p.name == name)
                .map(|p| p.log.clone())
        }) else {
            return not_found(&format!("pods \"{name}\""));
        };
        let mut resp = if param(query, "follow").is_some_and(|f| f == "true") {
            let name = name.to_string();
            let started = self.started;
            let ticks = tokio::time::interval_at(
                tokio::time::Instant::now() + LOG_LINE_EVERY,
                LOG_LINE_EVERY,
            );
            let lines = futures::stream::unfold(ticks, move |mut ticks| {
                let name = name.clone();
                async move {
                    ticks.tick().await;
                    let at = SystemTime::now()
                        .duration_since(started)
                        .unwrap_or_default();
                    let line = format!("{name}: tick at {} ms\n", at.as_millis());
                    Some((Ok::<_, std::io::Error>(line), ticks))
                }
            });
            let stream = futures::stream::once(async move { Ok(log) }).chain(lines);
            Response::new(Body::from_stream(stream))
        } else {
            Response::new(Body::from(log))
        };
        resp.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        resp
    }
}

/// Test data, not Kubernetes: `?n=N` bytes of a fixed pattern (byte `i` is `i % 251`),
/// streamed in 64 KiB pieces.
fn bytes(query: &str) -> Response<Body> {
    let total: u64 = param(query, "n").and_then(|n| n.parse().ok()).unwrap_or(0);
    const PIECE: u64 = 64 * 1024;
    // Byte i is i % 251: each piece is a slice of one pattern, so that making the bytes
    // costs nothing beside what carries them (a benchmark measures the carrying).
    let pattern = bytes::Bytes::from_iter((0..PIECE + 251).map(|i| (i % 251) as u8));
    let pieces = futures::stream::iter((0..total).step_by(PIECE as usize).map(move |at| {
        let from = (at % 251) as usize;
        let len = (total - at).min(PIECE) as usize;
        Ok::<_, std::io::Error>(pattern.slice(from..from + len))
    }));
    let mut resp = Response::new(Body::from_stream(pieces));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    resp
}

/// A watch event's line.
fn line(event: &Value) -> String {
    event.to_string() + "\n"
}

fn event(kind: &str, item: Value, row: Value, as_table: bool, version: u64) -> Value {
    let object = if as_table {
        table(vec![row], version)
    } else {
        item
    };
    json!({"type": kind, "object": object})
}

fn resources() -> Value {
    let r = |name: &str, kind: &str, verbs: &[&str]| json!({"name": name, "singularName": "", "namespaced": true, "kind": kind, "verbs": verbs});
    json!({
        "kind": "APIResourceList",
        "groupVersion": "v1",
        "resources": [
            r("pods", "Pod", &["create", "delete", "get", "list", "watch"]),
            r("pods/log", "Pod", &["get"]),
            r("pods/exec", "PodExecOptions", &["create", "get"]),
        ],
    })
}

/// The comma-separated values of header `name` (offered protocols).
fn listed(req: &Request<Body>, name: impl header::AsHeaderName) -> Vec<String> {
    req.headers()
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|p| p.trim().to_string())
        .collect()
}

/// Accepts a WebSocket upgrade in the first of `protocols` the client offers: the 101 to
/// answer with, and the WebSocket once the connection is handed over.
#[allow(clippy::result_large_err)] // the Err is the refusal to answer with
fn accept_websocket(
    req: &mut Request<Body>,
    protocols: &[&'static str],
    what: &str,
) -> Result<(Response<Body>, impl Future<Output = Option<Ws>> + use<>), Response<Body>> {
    let offered = listed(req, header::SEC_WEBSOCKET_PROTOCOL);
    let Some(protocol) = protocols.iter().find(|p| offered.iter().any(|o| o == *p)) else {
        return Err(status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            &format!(
                "{what} here speaks WebSocket {} only",
                protocols.join(" or ")
            ),
        ));
    };
    let Some(key) = req.headers().get(header::SEC_WEBSOCKET_KEY).cloned() else {
        return Err(status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "not a WebSocket upgrade",
        ));
    };
    let on_upgrade = hyper::upgrade::on(req);
    let ws = async move {
        let io = on_upgrade.await.ok()?;
        Some(
            tokio_tungstenite::WebSocketStream::from_raw_socket(
                hyper_util::rt::TokioIo::new(io),
                tokio_tungstenite::tungstenite::protocol::Role::Server,
                None,
            )
            .await,
        )
    };
    let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(key.as_bytes());
    let mut resp = switching(HeaderValue::from_static("websocket"));
    let h = resp.headers_mut();
    h.insert(
        header::SEC_WEBSOCKET_ACCEPT,
        HeaderValue::from_str(&accept).expect("base64 is a valid header value"),
    );
    h.insert(
        header::SEC_WEBSOCKET_PROTOCOL,
        HeaderValue::from_static(protocol),
    );
    Ok((resp, ws))
}

type Ws = tokio_tungstenite::WebSocketStream<hyper_util::rt::TokioIo<hyper::upgrade::Upgraded>>;

/// A 101 switching to `protocol`.
fn switching(protocol: HeaderValue) -> Response<Body> {
    let mut resp = Response::new(Body::empty());
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = resp.headers_mut();
    h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    h.insert(header::UPGRADE, protocol);
    resp
}

/// Exec: a WebSocket in Kubernetes' channel protocol whose stdout is the command's
/// arguments after the first, joined by spaces (`echo` behaviour), then success.
fn exec(mut req: Request<Body>, query: &str) -> Response<Body> {
    let protocols = ["v5.channel.k8s.io", "v4.channel.k8s.io"];
    let (resp, ws) = match accept_websocket(&mut req, &protocols, "exec") {
        Ok(accepted) => accepted,
        Err(refusal) => return refusal,
    };
    let command: Vec<String> = params(query, "command").collect();
    let output = command
        .iter()
        .skip(1)
        .cloned()
        .collect::<Vec<_>>()
        .join(" ")
        + "\n";
    tokio::spawn(async move {
        let Some(mut ws) = ws.await else { return };
        let mut stdout = vec![1u8];
        stdout.extend_from_slice(output.as_bytes());
        let mut done = vec![3u8];
        done.extend_from_slice(br#"{"metadata":{},"status":"Success"}"#);
        for m in [stdout, done] {
            if ws.send(WsMessage::binary(m)).await.is_err() {
                return;
            }
        }
        let normal = tokio_tungstenite::tungstenite::protocol::CloseFrame {
            code: tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode::Normal,
            reason: "".into(),
        };
        let _ = ws.close(Some(normal)).await;
        // Read until the client closes too.
        while let Some(Ok(_)) = ws.next().await {}
    });
    resp
}

/// Port-forward: SPDY in a WebSocket (kubectl 1.31+) or on a plain SPDY upgrade; every
/// port echoes (see [`port_forward`]).
fn port_forward(mut req: Request<Body>) -> Response<Body> {
    let upgrade = req
        .headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    if upgrade == "websocket" {
        return match accept_websocket(&mut req, &[port_forward::WS_PROTOCOL], "port-forward") {
            Ok((resp, ws)) => {
                tokio::spawn(async move {
                    if let Some(ws) = ws.await {
                        let _ = port_forward::serve_websocket(ws).await;
                    }
                });
                resp
            }
            Err(refusal) => refusal,
        };
    }
    let offers_protocol = listed(&req, "x-stream-protocol-version")
        .iter()
        .any(|p| p == port_forward::PROTOCOL);
    if !upgrade.eq_ignore_ascii_case(port_forward::SPDY) || !offers_protocol {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "port-forward here speaks portforward.k8s.io over SPDY/3.1 or WebSocket only",
        );
    }
    let on_upgrade = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        if let Ok(io) = on_upgrade.await {
            let _ = port_forward::serve(hyper_util::rt::TokioIo::new(io)).await;
        }
    });
    let mut resp = switching(HeaderValue::from_static(port_forward::SPDY));
    resp.headers_mut().insert(
        "x-stream-protocol-version",
        HeaderValue::from_static(port_forward::PROTOCOL),
    );
    resp
}
