// axum's query extractor wants a map; it is only read by key.
#![allow(clippy::disallowed_types)]
use super::*;
use axum::Json;
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::Mutex;
use tonic::Code;

/// A local HTTP server answering like the Kubernetes API's pod list: pages of two pods
/// with a `continue` token, 403 for namespace `locked`. Records each request's query.
struct FakeApi {
    pods: Vec<(&'static str, &'static str, &'static str, &'static str)>,
    seen: Mutex<Vec<String>>,
}

fn pod_json(p: &(&str, &str, &str, &str)) -> Value {
    json!({
        "metadata": {"namespace": p.0, "name": p.1},
        "spec": {"nodeName": p.3, "containers": []},
        "status": {"phase": p.2},
    })
}

async fn list(
    State(api): State<Arc<FakeApi>>,
    namespace: Option<UrlPath<String>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let namespace = namespace.map(|UrlPath(n)| n);
    let mut seen = format!("ns={}", namespace.as_deref().unwrap_or("*"));
    for key in ["limit", "continue"] {
        if let Some(v) = q.get(key) {
            seen.push_str(&format!(" {key}={v}"));
        }
    }
    api.seen.lock().unwrap().push(seen);
    if namespace.as_deref() == Some("locked") {
        let status = json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "pods is forbidden: User \"system:serviceaccount:agent:agentk\" cannot list resource \"pods\"",
            "reason": "Forbidden", "code": 403,
        });
        return (StatusCode::FORBIDDEN, Json(status)).into_response();
    }
    let matching: Vec<_> = api
        .pods
        .iter()
        .filter(|p| namespace.as_deref().is_none_or(|n| p.0 == n))
        .collect();
    let start: usize = q.get("continue").map_or(0, |c| c.parse().unwrap());
    let page: Vec<Value> = matching
        .iter()
        .skip(start)
        .take(2)
        .map(|p| pod_json(p))
        .collect();
    let next = start + 2;
    let cont = if next < matching.len() {
        next.to_string()
    } else {
        String::new()
    };
    Json(json!({
        "apiVersion": "v1", "kind": "PodList",
        "metadata": {"resourceVersion": "42", "continue": cont},
        "items": page,
    }))
    .into_response()
}

/// The log the fake API holds for every pod: 200,000 bytes of numbered lines.
fn fake_log() -> Vec<u8> {
    (0..10_000)
        .flat_map(|i| format!("line {i:05} of the log\n").into_bytes())
        .collect()
}

async fn log(
    State(api): State<Arc<FakeApi>>,
    UrlPath((namespace, name)): UrlPath<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let mut seen = format!("log {namespace}/{name}");
    for key in ["container", "limitBytes", "follow"] {
        if let Some(v) = q.get(key) {
            seen.push_str(&format!(" {key}={v}"));
        }
    }
    api.seen.lock().unwrap().push(seen);
    if !api.pods.iter().any(|p| p.0 == namespace && p.1 == name) {
        let status = json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": format!("pods \"{name}\" not found"), "reason": "NotFound", "code": 404,
        });
        return (StatusCode::NOT_FOUND, Json(status)).into_response();
    }
    let mut body = fake_log();
    if let Some(limit) = q.get("limitBytes") {
        body.truncate(limit.parse().unwrap());
    }
    body.into_response()
}

async fn read_log(source: &PodSource, pod: &str, limit: i64) -> Result<Vec<Vec<u8>>, Status> {
    use futures::TryStreamExt;
    let req = LogsRequest {
        namespace: "shop".into(),
        pod: pod.into(),
        container: "app".into(),
        limit_bytes: limit,
    };
    let pieces: Vec<LogChunk> = source.logs(req).await?.try_collect().await?;
    Ok(pieces.into_iter().map(|c| c.data).collect())
}

async fn fake_api() -> (PodSource, Arc<FakeApi>) {
    let api = Arc::new(FakeApi {
        pods: vec![
            ("default", "web-1", "Running", "node-a"),
            ("default", "web-2", "Pending", ""),
            ("kube-system", "coredns-1", "Running", "node-a"),
            ("shop", "cart-1", "Running", "node-b"),
            ("shop", "cart-2", "Succeeded", "node-b"),
        ],
        seen: Mutex::new(Vec::new()),
    });
    let app = axum::Router::new()
        .route("/api/v1/pods", get(list))
        .route("/api/v1/namespaces/{namespace}/pods", get(list))
        .route("/api/v1/namespaces/{namespace}/pods/{name}/log", get(log))
        .with_state(api.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let config = kube::Config::new(url.parse().unwrap());
    let client = kube::Client::try_from(config).expect("kube client for a plain-HTTP API");
    (PodSource::Kube(client), api)
}

fn names(pods: &[Pod]) -> Vec<String> {
    pods.iter()
        .map(|p| format!("{}/{} {} {}", p.namespace, p.name, p.phase, p.node_name))
        .collect()
}

#[tokio::test]
async fn kube_source_lists_every_page_of_all_namespaces() {
    let (source, api) = fake_api().await;
    let pods = source.list("").await.expect("listed");
    assert_eq!(
        names(&pods),
        [
            "default/web-1 Running node-a",
            "default/web-2 Pending ",
            "kube-system/coredns-1 Running node-a",
            "shop/cart-1 Running node-b",
            "shop/cart-2 Succeeded node-b",
        ]
    );
    assert_eq!(
        *api.seen.lock().unwrap(),
        [
            "ns=* limit=500",
            "ns=* limit=500 continue=2",
            "ns=* limit=500 continue=4"
        ]
    );
}

#[tokio::test]
async fn kube_source_lists_one_namespace() {
    let (source, api) = fake_api().await;
    let pods = source.list("shop").await.expect("listed");
    assert_eq!(
        names(&pods),
        ["shop/cart-1 Running node-b", "shop/cart-2 Succeeded node-b"]
    );
    assert_eq!(*api.seen.lock().unwrap(), ["ns=shop limit=500"]);
}

#[tokio::test]
async fn kube_refusal_names_rbac() {
    let (source, _) = fake_api().await;
    let err = source.list("locked").await.expect_err("forbidden");
    assert_eq!(err.code(), Code::PermissionDenied);
    assert!(err.message().contains("403"), "{}", err.message());
    assert!(err.message().contains("RBAC"), "{}", err.message());
}

#[tokio::test]
async fn unreachable_kube_api_is_unavailable() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = kube::Config::new(format!("http://127.0.0.1:{port}").parse().unwrap());
    let source = PodSource::Kube(kube::Client::try_from(config).unwrap());
    let err = source.list("").await.expect_err("nothing listens");
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    assert!(
        err.message().contains("cannot reach the Kubernetes API"),
        "{}",
        err.message()
    );
}

#[tokio::test]
async fn fixture_file_filters_by_namespace_and_names_bad_fields() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("pods.yaml");
    std::fs::write(
        &good,
        "- {namespace: default, name: web-1, phase: Running, node_name: node-a}\n- {namespace: shop, name: cart-1}\n",
    )
    .unwrap();
    let source = PodSource::fixture_file(&good).unwrap();
    assert_eq!(
        names(&source.list("").await.unwrap()),
        ["default/web-1 Running node-a", "shop/cart-1  "]
    );
    assert_eq!(
        names(&source.list("shop").await.unwrap()),
        ["shop/cart-1  "]
    );
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "- {namespace: default, nam: web-1}\n").unwrap();
    let err = PodSource::fixture_file(&bad).err().expect("unknown field");
    assert!(err.contains("unknown field `nam`"), "{err}");
    assert!(err.contains("bad.yaml"), "{err}");
}

#[tokio::test]
async fn kube_source_streams_a_log_in_pieces_up_to_its_limit() {
    let (source, api) = fake_api().await;
    let pieces = read_log(&source, "cart-1", 150_000).await.expect("log");
    assert!(pieces.iter().all(|p| !p.is_empty() && p.len() <= LOG_CHUNK));
    assert_eq!(pieces.concat(), fake_log()[..150_000]);
    let whole = read_log(&source, "cart-1", 0).await.expect("log");
    assert_eq!(
        whole.concat(),
        fake_log(),
        "the default cap is above 200,000 bytes"
    );
    assert_eq!(
        *api.seen.lock().unwrap(),
        [
            "log shop/cart-1 container=app limitBytes=150000",
            format!("log shop/cart-1 container=app limitBytes={DEFAULT_LOG_LIMIT}").as_str(),
        ]
    );
    let err = read_log(&source, "gone-1", 0)
        .await
        .expect_err("no such pod");
    assert_eq!(err.code(), Code::NotFound, "{err}");
    assert!(err.message().contains("gone-1"), "{}", err.message());
}

#[tokio::test]
async fn log_requests_are_checked_before_any_read() {
    let (source, api) = fake_api().await;
    let err = read_log(&source, "cart-1", -1).await.expect_err("negative");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("limit_bytes"), "{}", err.message());
    let err = read_log(&source, "", 0).await.expect_err("no pod");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("namespace and pod"),
        "{}",
        err.message()
    );
    assert!(api.seen.lock().unwrap().is_empty());
}

#[tokio::test]
async fn fixture_logs_come_in_pieces_up_to_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pods.yaml");
    let text = "x".repeat(LOG_CHUNK * 2 + 10);
    std::fs::write(
        &path,
        format!("- {{namespace: shop, name: cart-1, log: {text}}}\n- {{namespace: shop, name: cart-2}}\n"),
    )
    .unwrap();
    let source = PodSource::fixture_file(&path).unwrap();
    let sizes = |p: Vec<Vec<u8>>| p.iter().map(Vec::len).collect::<Vec<_>>();
    assert_eq!(
        sizes(read_log(&source, "cart-1", 0).await.unwrap()),
        [LOG_CHUNK, LOG_CHUNK, 10]
    );
    assert_eq!(
        sizes(
            read_log(&source, "cart-1", LOG_CHUNK as i64 + 1)
                .await
                .unwrap()
        ),
        [LOG_CHUNK, 1]
    );
    assert!(read_log(&source, "cart-2", 0).await.unwrap().is_empty());
    let err = read_log(&source, "cart-3", 0)
        .await
        .expect_err("no such pod");
    assert_eq!(err.code(), Code::NotFound);
    assert!(err.message().contains("shop/cart-3"), "{}", err.message());
}
