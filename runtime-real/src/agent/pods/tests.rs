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
