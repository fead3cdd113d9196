//! The GitLab agent-token resolver against a small local HTTP server that answers like
//! GitLab's internal API.

mod support;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::get;
use kas_auth::agent_auth::{AuthError, CachePolicy, CachedResolver, GitLabClient};
use kas_auth::jwt::{self, Secret, Signer, Verifier};
use kas_server::config::{Config, ConfigWriter};
use kas_server::kas::Kas;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

const GOOD: &str = "good-agent-token-0123456789";
const FLAKY: &str = "flaky-agent-token-0123456789";

#[derive(Clone)]
struct FakeGitLab {
    verifier: Verifier,
    hits: Arc<AtomicUsize>,
    bad_jwt: Arc<AtomicUsize>,
    /// Answer 502 to everything (after `delay`).
    failing: Arc<AtomicBool>,
    /// Every answer takes this long.
    delay_ms: Arc<AtomicUsize>,
    /// GOOD revoked: answered 401.
    revoked: Arc<AtomicBool>,
}

async fn agent_info(State(g): State<FakeGitLab>, headers: HeaderMap) -> (StatusCode, String) {
    g.hits.fetch_add(1, Ordering::SeqCst);
    let delay = g.delay_ms.load(Ordering::SeqCst) as u64;
    tokio::time::sleep(Duration::from_millis(delay)).await;
    if g.failing.load(Ordering::SeqCst) {
        return (StatusCode::BAD_GATEWAY, "bad gateway".into());
    }
    let jwt = headers
        .get("Gitlab-Kas-Api-Request")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if g.verifier.check(jwt).is_err() {
        g.bad_jwt.fetch_add(1, Ordering::SeqCst);
        return (StatusCode::UNAUTHORIZED, "{}".into());
    }
    match headers.get("authorization").and_then(|v| v.to_str().ok()) {
        Some(a) if a == format!("Bearer {GOOD}") && !g.revoked.load(Ordering::SeqCst) => (
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
        failing: Arc::default(),
        delay_ms: Arc::default(),
        revoked: Arc::default(),
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
    let r = client.cached(CachePolicy {
        ttl: Duration::from_millis(400),
        error_ttl: Duration::from_millis(200),
        stale_ttl: Duration::from_secs(60),
        lookups_per_second: 1000,
        lookups_per_second_per_address: 1000,
    });
    let hits = || gl.hits.load(Ordering::SeqCst);

    let id = r.resolve(GOOD, None).await.unwrap();
    assert_eq!((id.agent_id.0, id.project_id.0), (7, 10));
    assert_eq!(r.resolve(GOOD, None).await.unwrap(), id);
    assert_eq!(hits(), 1, "the second answer came from the cache");

    assert_eq!(
        r.resolve("unknown-token-xxxxxxxx", None).await,
        Err(AuthError::InvalidToken)
    );
    assert_eq!(
        r.resolve("unknown-token-xxxxxxxx", None).await,
        Err(AuthError::InvalidToken)
    );
    assert_eq!(hits(), 2, "the error was cached");

    let flaky = r.resolve(FLAKY, None).await.unwrap_err();
    assert!(
        matches!(&flaky, AuthError::Unavailable(m) if m.contains("500")),
        "{flaky:?}"
    );
    assert_eq!(hits(), 3);

    tokio::time::sleep(Duration::from_millis(250)).await;
    let _ = r.resolve("unknown-token-xxxxxxxx", None).await;
    assert_eq!(hits(), 4, "the error expired after its own, shorter ttl");
    r.resolve(GOOD, None).await.unwrap();
    assert_eq!(hits(), 4, "the answer is still cached");
    tokio::time::sleep(Duration::from_millis(200)).await;
    r.resolve(GOOD, None).await.unwrap();
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

fn resolver(addr: SocketAddr, secret: &Secret, policy: CachePolicy) -> Arc<CachedResolver> {
    let client = GitLabClient::new(
        &format!("http://{addr}"),
        Signer::new(secret, jwt::GITLAB_KAS, jwt::GITLAB),
        Duration::from_secs(5),
    )
    .unwrap();
    Arc::new(client.cached(policy))
}

const POLICY: CachePolicy = CachePolicy {
    ttl: Duration::from_millis(300),
    error_ttl: Duration::from_millis(100),
    stale_ttl: Duration::from_secs(60),
    lookups_per_second: 1000,
    lookups_per_second_per_address: 1000,
};

/// Hardening item 4: concurrent first uses of one token make one GitLab request; a token
/// GitLab accepted stays accepted while GitLab fails (within `stale_ttl`), unknown ones do
/// not.
#[tokio::test(flavor = "multi_thread")]
async fn one_request_per_token_and_the_last_good_answer_survives_gitlab_failing() {
    let secret = Secret::from_base64(&"R2l0TGFi".repeat(8)).unwrap();
    let (addr, gl) = fake_gitlab(&secret).await;
    let r = resolver(addr, &secret, POLICY);
    gl.delay_ms.store(300, Ordering::SeqCst);
    let lookups: Vec<_> = (0..300)
        .map(|_| {
            let r = r.clone();
            tokio::spawn(async move { r.resolve(GOOD, None).await })
        })
        .collect();
    for l in lookups {
        assert_eq!(l.await.unwrap().unwrap().agent_id.0, 7);
    }
    assert_eq!(
        gl.hits.load(Ordering::SeqCst),
        1,
        "one shared GitLab request"
    );

    // GitLab starts failing slowly; the cached answer expires.
    gl.failing.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let stale = r.resolve(GOOD, None).await;
    assert_eq!(stale.map(|i| i.agent_id.0), Ok(7), "the last good answer");
    assert_eq!(gl.hits.load(Ordering::SeqCst), 2, "GitLab was asked again");
    let unknown = r.resolve("never-seen-token-0123456789", None).await;
    assert!(
        matches!(unknown, Err(AuthError::Unavailable(_))),
        "{unknown:?}"
    );
    // Once GitLab is back, its answers count again.
    gl.failing.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(r.resolve(GOOD, None).await.map(|i| i.agent_id.0), Ok(7));
}

/// Hardening item 8: spraying random tokens reaches GitLab at the configured rate per
/// client address and overall, not one to one; known-good tokens are not held back.
#[tokio::test(flavor = "multi_thread")]
async fn spraying_unknown_tokens_is_rate_limited_per_address_and_overall() {
    let secret = Secret::from_base64(&"R2l0TGFi".repeat(8)).unwrap();
    let (addr, gl) = fake_gitlab(&secret).await;
    let policy = CachePolicy {
        lookups_per_second: 30,
        lookups_per_second_per_address: 10,
        ..POLICY
    };
    let r = resolver(addr, &secret, policy);
    r.resolve(GOOD, None).await.unwrap();
    let attacker = Some("127.0.0.9".parse().unwrap());
    let mut throttled = 0;
    for i in 0..3000 {
        match r
            .resolve(&format!("random-token-{i:08}-xxxx"), attacker)
            .await
        {
            Err(AuthError::Throttled { reason: m, .. }) => {
                assert!(
                    m.contains("agent.token_lookups_per_second_per_address"),
                    "{m}"
                );
                throttled += 1;
            }
            other => assert_eq!(other, Err(AuthError::InvalidToken)),
        }
    }
    let hits = gl.hits.load(Ordering::SeqCst) - 1;
    assert!(hits < 50, "{hits} GitLab requests for 3,000 sprayed tokens");
    assert!(throttled > 2900, "{throttled} throttled");
    // Another address still gets through, until the overall budget is spent too.
    let other = Some("127.0.0.10".parse().unwrap());
    let mut overall = 0;
    for i in 0..100 {
        let peer = Some(format!("127.0.1.{i}").parse().unwrap());
        if let Err(AuthError::Throttled { reason: m, .. }) =
            r.resolve(&format!("spray-{i:08}-xxxxx"), peer).await
        {
            assert!(m.contains("(limit agent.token_lookups_per_second)"), "{m}");
            overall += 1;
        }
    }
    assert!(overall > 0, "the overall limit held");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(
        r.resolve("yet-another-token-xxxxxxx", other).await,
        Err(AuthError::InvalidToken),
        "budgets refill"
    );
    // A token GitLab accepted is looked up again without a budget: here one lookup a
    // second, spent on its first use.
    let strict = CachePolicy {
        lookups_per_second: 1,
        lookups_per_second_per_address: 1,
        ..POLICY
    };
    let r = resolver(addr, &secret, strict);
    r.resolve(GOOD, attacker).await.unwrap();
    tokio::time::sleep(Duration::from_millis(350)).await; // past the ttl, not a refill
    let spray = r.resolve("one-more-random-token-xx", attacker).await;
    assert!(
        matches!(spray, Err(AuthError::Throttled { .. })),
        "{spray:?}"
    );
    assert_eq!(r.resolve(GOOD, attacker).await.map(|i| i.agent_id.0), Ok(7));
}

/// A kas on free loopback ports that resolves agent tokens through GitLab at `gitlab`,
/// with `extra` keys.
async fn kas_on_gitlab(secrets: &support::Secrets, gitlab: SocketAddr, extra: ConfigWriter) -> Kas {
    let local = SocketAddr::from(([127, 0, 0, 1], 0));
    let text = ConfigWriter::kas_in(&secrets.path(""), [local; 4])
        .unset("agent.tokens_file")
        .set("gitlab.address", format!("http://{gitlab}"))
        .path(
            "gitlab.authentication_secret_file",
            &secrets.path("gitlab.secret"),
        )
        .merge(&extra.text())
        .unwrap()
        .text();
    let config = Config::parse(&text, "test.yaml").unwrap();
    Kas::start_configured(config).await.unwrap()
}

#[tokio::test]
async fn kas_configured_with_gitlab_authenticates_agents_through_it() {
    let secrets = support::Secrets::new();
    let (addr, _gl) = fake_gitlab(&secrets.gitlab).await;
    let kas = kas_on_gitlab(&secrets, addr, ConfigWriter::new()).await;
    let agent = kas_agent::AgentClient::new(support::channel(kas.addresses.agent).await, GOOD);
    let (connection, first, stream) = agent.connect(Default::default(), None).await.unwrap();
    assert_eq!(first.connection_id, connection.0);
    let refused = kas_agent::AgentClient::new(
        support::channel(kas.addresses.agent).await,
        "nope-nope-nope-nope",
    );
    let err = refused
        .connect(Default::default(), None)
        .await
        .err()
        .unwrap();
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    // Gone before the stop: kas would wait its grace for the agent to leave.
    drop(stream);
    kas.stop().await;
}

/// A token GitLab revokes while its agent is connected: kas checks each connection's
/// token every `agent.configuration.poll_period` (through the cache), and ends the
/// connection, its tunnels with it, once GitLab refuses it; the agent cannot come back.
#[tokio::test(flavor = "multi_thread")]
async fn a_token_gitlab_revokes_ends_its_connections_and_tunnels() {
    let secrets = support::Secrets::new();
    let (addr, gl) = fake_gitlab(&secrets.gitlab).await;
    let quick = ConfigWriter::new()
        .set("agent.info_cache_ttl", "500ms")
        .set("agent.configuration.poll_period", "500ms");
    let kas = kas_on_gitlab(&secrets, addr, quick).await;
    let agent = kas_agent::AgentClient::new(support::channel(kas.addresses.agent).await, GOOD);
    let (connection, _, mut stream) = agent.connect(Default::default(), None).await.unwrap();
    let modules = std::sync::Arc::new(support::pod_modules("pod", Duration::ZERO));
    let tunnel = tokio::spawn({
        let agent = agent.clone();
        async move {
            agent
                .serve_tunnel(connection, modules, Duration::from_secs(1), None)
                .await
        }
    });
    // Still accepted a while later: the poll asks GitLab again, and it says yes.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !tunnel.is_finished(),
        "the tunnel of an accepted token ended"
    );
    gl.revoked.store(true, Ordering::SeqCst);
    let revoked = std::time::Instant::now();
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match stream.message().await {
                Ok(Some(_)) => continue,
                other => return other,
            }
        }
    })
    .await
    .expect("the connection ends within the poll period and the cache's lifetime");
    let status = ended.expect_err("ended by kas, with a status");
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    assert!(status.message().contains("revoked"), "{status:?}");
    let took = revoked.elapsed();
    let tunnel_end = tokio::time::timeout(Duration::from_secs(5), tunnel)
        .await
        .expect("its tunnel ends with it")
        .unwrap();
    assert_ne!(tunnel_end.code(), tonic::Code::Ok, "{tunnel_end:?}");
    let again = agent.connect(Default::default(), None).await.err().unwrap();
    assert_eq!(again.code(), tonic::Code::Unauthenticated, "{again:?}");
    println!("revoked token's connection ended {took:?} after GitLab revoked it");
    kas.stop().await;
}

/// GitLab's user and CI job authorization, as kas's Kubernetes API listener asks it:
/// `authorize_proxy_user` for `pat:` tokens, `job/allowed_agents` for `ci:` ones.
mod kubernetes_api_tokens {
    use super::*;
    use axum::Json;
    use axum::routing::post;
    use kas_auth::agent_auth::AuthError;
    use kas_server::kas::kubernetes_api::{Credential, GitLabAccess};
    use serde_json::{Value, json};

    const ALICE: &str = "glpat-alice-0123456789";
    const JOB: &str = "job-token-0123456789";

    async fn authorize_proxy_user(
        State(g): State<FakeGitLab>,
        headers: HeaderMap,
        Json(body): Json<Value>,
    ) -> (StatusCode, Json<Value>) {
        g.hits.fetch_add(1, Ordering::SeqCst);
        let jwt = headers
            .get("Gitlab-Kas-Api-Request")
            .and_then(|v| v.to_str().ok());
        if g.verifier.check(jwt.unwrap_or_default()).is_err() {
            return (StatusCode::UNAUTHORIZED, Json(json!({})));
        }
        assert_eq!(body["access_type"], "personal_access_token");
        if body["access_key"] != ALICE {
            return (
                StatusCode::UNAUTHORIZED,
                Json(json!({"message": "401 Unauthorized"})),
            );
        }
        match body["agent_id"].as_i64() {
            Some(1) => (
                StatusCode::OK,
                Json(json!({
                    "agent": {"id": 1, "config_project": {"id": 10}},
                    "user": {"id": 5, "username": "alice"},
                    "access_as": {"user": {"projects": [], "groups": []}},
                })),
            ),
            _ => (
                StatusCode::FORBIDDEN,
                Json(json!({"message": "403 Forbidden"})),
            ),
        }
    }

    async fn allowed_agents(
        State(g): State<FakeGitLab>,
        headers: HeaderMap,
    ) -> (StatusCode, Json<Value>) {
        g.hits.fetch_add(1, Ordering::SeqCst);
        if headers.get("Job-Token").and_then(|v| v.to_str().ok()) != Some(JOB) {
            return (StatusCode::UNAUTHORIZED, Json(json!({})));
        }
        (
            StatusCode::OK,
            Json(json!({
                "allowed_agents": [
                    {"id": 2, "config_project": {"id": 20}, "configuration": {"access_as": {"ci_job": {}}}},
                    {"id": 3, "config_project": {"id": 30}},
                ],
                "job": {"id": 42},
                "pipeline": {"id": 41},
                "project": {"id": 7, "groups": []},
                "user": {"id": 5, "username": "alice"},
            })),
        )
    }

    fn bearer(s: &str) -> Credential {
        Credential::parse(Some(&format!("Bearer {s}"))).unwrap()
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn user_and_ci_job_tokens_are_checked_by_gitlab_with_gitlabs_impersonation() {
        let secret = Secret::from_base64(&"R2l0TGFi".repeat(8)).unwrap();
        let state = FakeGitLab {
            verifier: Verifier::new(&secret, jwt::GITLAB_KAS, jwt::GITLAB),
            hits: Arc::default(),
            bad_jwt: Arc::default(),
            failing: Arc::default(),
            delay_ms: Arc::default(),
            revoked: Arc::default(),
        };
        let app = Router::new()
            .route(
                "/api/v4/internal/kubernetes/authorize_proxy_user",
                post(authorize_proxy_user),
            )
            .route("/api/v4/job/allowed_agents", get(allowed_agents))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        let access = GitLabAccess::new(
            &format!("http://{addr}/"),
            Signer::new(&secret, jwt::GITLAB_KAS, jwt::GITLAB),
            Duration::from_secs(5),
        )
        .unwrap();

        let alice = access
            .authorize(&bearer(&format!("pat:1:{ALICE}")))
            .await
            .unwrap();
        let who = alice.impersonation.expect("access as the user");
        assert_eq!(who.user, "gitlab:user:alice");
        assert_eq!(who.groups, ["gitlab:user"]);
        assert_eq!(who.extra["agent.gitlab.com/id"].values, ["1"]);
        assert!(matches!(
            access.authorize(&bearer(&format!("pat:2:{ALICE}"))).await,
            Err(AuthError::Forbidden(m)) if m.contains("agent 2")
        ));
        assert_eq!(
            access.authorize(&bearer("pat:1:glpat-wrong")).await,
            Err(AuthError::InvalidToken)
        );

        let job = access
            .authorize(&bearer(&format!("ci:2:{JOB}")))
            .await
            .unwrap();
        let who = job.impersonation.expect("access as the CI job");
        assert_eq!(who.user, "gitlab:ci_job:42");
        assert_eq!(who.groups, ["gitlab:ci_job", "gitlab:project:7"]);
        assert_eq!(who.extra["agent.gitlab.com/ci_job_id"].values, ["42"]);
        let own = access
            .authorize(&bearer(&format!("ci:3:{JOB}")))
            .await
            .unwrap();
        assert_eq!(
            own.impersonation, None,
            "no access_as: the agent's own access"
        );
        assert!(matches!(
            access.authorize(&bearer(&format!("ci:4:{JOB}"))).await,
            Err(AuthError::Forbidden(m)) if m.contains("not in its allowed agents")
        ));
        assert_eq!(
            access.authorize(&bearer("ci:2:not-the-job")).await,
            Err(AuthError::InvalidToken)
        );

        // Cached: concurrent first uses of one credential make one request, and the
        // refusal of another is cached too.
        let cache = Arc::new(access.cached(POLICY));
        let before = state.hits.load(Ordering::SeqCst);
        let key = format!("pat:1:{ALICE}");
        let lookups: Vec<_> = (0..50)
            .map(|_| {
                let (cache, key) = (cache.clone(), key.clone());
                tokio::spawn(async move { cache.resolve(&key, None).await })
            })
            .collect();
        for l in lookups {
            assert!(l.await.unwrap().is_ok());
        }
        let forbidden = format!("pat:2:{ALICE}");
        for _ in 0..3 {
            assert!(matches!(
                cache.resolve(&forbidden, None).await,
                Err(AuthError::Forbidden(_))
            ));
        }
        assert_eq!(state.hits.load(Ordering::SeqCst) - before, 2);
    }
}
