//! The GitLab agent-token resolver against a small local HTTP server that answers like
//! GitLab's internal API.

mod support;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::get;
use kas_runtime::agent_auth::{AuthError, CachedResolver, GitLabClient};
use kas_runtime::config::Config;
use kas_runtime::jwt::{self, Secret, Signer, Verifier};
use kas_runtime::kas::Kas;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

const GOOD: &str = "good-agent-token-0123456789";
const FLAKY: &str = "flaky-agent-token-0123456789";

#[derive(Clone)]
struct FakeGitLab {
    verifier: Verifier,
    hits: Arc<AtomicUsize>,
    bad_jwt: Arc<AtomicUsize>,
}

async fn agent_info(State(g): State<FakeGitLab>, headers: HeaderMap) -> (StatusCode, String) {
    g.hits.fetch_add(1, Ordering::SeqCst);
    let jwt = headers
        .get("Gitlab-Kas-Api-Request")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if g.verifier.check(jwt).is_err() {
        g.bad_jwt.fetch_add(1, Ordering::SeqCst);
        return (StatusCode::UNAUTHORIZED, "{}".into());
    }
    match headers.get("authorization").and_then(|v| v.to_str().ok()) {
        Some(a) if a == format!("Bearer {GOOD}") => (
            StatusCode::OK,
            r#"{"project_id":10,"agent_id":7,"agent_name":"my-agent","gitaly_info":{"address":"unix:/x"},"default_branch":"main"}"#.into(),
        ),
        Some(a) if a == format!("Bearer {FLAKY}") => (StatusCode::INTERNAL_SERVER_ERROR, "boom".into()),
        _ => (StatusCode::UNAUTHORIZED, r#"{"message":"401 Unauthorized"}"#.into()),
    }
}

async fn fake_gitlab(secret: &Secret) -> (SocketAddr, FakeGitLab) {
    let state = FakeGitLab {
        verifier: Verifier::new(secret, jwt::GITLAB_KAS, jwt::GITLAB),
        hits: Arc::default(),
        bad_jwt: Arc::default(),
    };
    let app = Router::new()
        .route("/api/v4/internal/kubernetes/agent_info", get(agent_info))
        .with_state(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, state)
}

#[tokio::test]
async fn resolver_signs_its_requests_and_caches_answers_and_errors() {
    let secret = Secret::from_base64(&"R2l0TGFi".repeat(8)).unwrap();
    let (addr, gl) = fake_gitlab(&secret).await;
    let client = GitLabClient::new(
        &format!("http://{addr}/"),
        Signer::new(&secret, jwt::GITLAB_KAS, jwt::GITLAB),
        Duration::from_secs(5),
    )
    .unwrap();
    let r = CachedResolver::new(
        client,
        Duration::from_millis(400),
        Duration::from_millis(200),
    );
    let hits = || gl.hits.load(Ordering::SeqCst);

    let id = r.resolve(GOOD).await.unwrap();
    assert_eq!((id.agent_id.0, id.project_id.0), (7, 10));
    assert_eq!(r.resolve(GOOD).await.unwrap(), id);
    assert_eq!(hits(), 1, "the second answer came from the cache");

    assert_eq!(
        r.resolve("unknown-token-xxxxxxxx").await,
        Err(AuthError::InvalidToken)
    );
    assert_eq!(
        r.resolve("unknown-token-xxxxxxxx").await,
        Err(AuthError::InvalidToken)
    );
    assert_eq!(hits(), 2, "the error was cached");

    let flaky = r.resolve(FLAKY).await.unwrap_err();
    assert!(
        matches!(&flaky, AuthError::Unavailable(m) if m.contains("500")),
        "{flaky:?}"
    );
    assert_eq!(hits(), 3);

    tokio::time::sleep(Duration::from_millis(250)).await;
    let _ = r.resolve("unknown-token-xxxxxxxx").await;
    assert_eq!(hits(), 4, "the error expired after its own, shorter ttl");
    r.resolve(GOOD).await.unwrap();
    assert_eq!(hits(), 4, "the answer is still cached");
    tokio::time::sleep(Duration::from_millis(200)).await;
    r.resolve(GOOD).await.unwrap();
    assert_eq!(hits(), 5, "the answer expired");
    assert_eq!(
        gl.bad_jwt.load(Ordering::SeqCst),
        0,
        "every request carried a valid JWT"
    );

    // A kas holding the wrong secret is refused by GitLab.
    let other = Secret::from_base64(&"T3RoZXIh".repeat(8)).unwrap();
    let wrong = GitLabClient::new(
        &format!("http://{addr}"),
        Signer::new(&other, jwt::GITLAB_KAS, jwt::GITLAB),
        Duration::from_secs(5),
    )
    .unwrap();
    assert_eq!(wrong.agent_info(GOOD).await, Err(AuthError::InvalidToken));
    assert_eq!(gl.bad_jwt.load(Ordering::SeqCst), 1);

    // GitLab unreachable.
    let port = support::free_port();
    let gone = GitLabClient::new(
        &format!("http://127.0.0.1:{port}"),
        Signer::new(&secret, jwt::GITLAB_KAS, jwt::GITLAB),
        Duration::from_secs(5),
    )
    .unwrap();
    assert!(matches!(
        gone.agent_info(GOOD).await,
        Err(AuthError::Unavailable(_))
    ));
}

#[tokio::test]
async fn kas_configured_with_gitlab_authenticates_agents_through_it() {
    let secrets = support::Secrets::new();
    let (addr, _gl) = fake_gitlab(&secrets.gitlab).await;
    let yaml = format!(
        "gitlab:\n  address: http://{addr}\n  authentication_secret_file: {gs}\nagent:\n  listen:\n    address: 127.0.0.1:0\napi:\n  listen:\n    address: 127.0.0.1:0\n    authentication_secret_file: {gs}\nprivate_api:\n  listen:\n    address: 127.0.0.1:0\n    authentication_secret_file: {ks}\nobservability:\n  listen:\n    address: 127.0.0.1:0\n",
        gs = secrets.path("gitlab.secret").display(),
        ks = secrets.path("kas.secret").display(),
    );
    let config = Config::parse(&yaml, "test.yaml").unwrap();
    let kas = Kas::start(config).await.unwrap();
    let agent =
        kas_runtime::agent::AgentClient::new(support::channel(kas.addresses.agent).await, GOOD);
    let (connection, first, _stream) = agent.connect(Default::default()).await.unwrap();
    assert_eq!(first.connection_id, connection.0);
    let refused = kas_runtime::agent::AgentClient::new(
        support::channel(kas.addresses.agent).await,
        "nope-nope-nope-nope",
    );
    let err = refused.connect(Default::default()).await.err().unwrap();
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    kas.stop().await;
}
