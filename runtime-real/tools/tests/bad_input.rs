//! Bad tokens, malformed frames and broken configuration: each gets a clear error, and
//! kas keeps serving everyone else.

mod support;

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use kas_agent::AgentClient;
use kas_auth::jwt::Secret;
use kas_proto::agent_api::ConfigurationRequest;
use kas_proto::agent_api::agent_api_client::AgentApiClient;
use kas_proto::frame::{Descriptor, Frame, RequestStart, frame::Kind};
use kas_proto::private_api::kas_private_client::KasPrivateClient;
use kas_proto::public_api::ConnectedAgentsByIdRequest;
use kas_proto::public_api::kas_api_client::KasApiClient;
use kas_transport::frames;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use support::*;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A token with these claims signed by `secret` (HS256).
fn token(secret: &Secret, iss: &str, aud: &str, exp: u64) -> String {
    let claims = serde_json::json!({"iss": iss, "aud": aud, "exp": exp, "iat": now()});
    let key = EncodingKey::from_secret(&STANDARD.decode(secret.to_base64()).unwrap());
    jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &key).unwrap()
}

/// A token with `iat`, `nbf` and `exp` as given (0: left out), signed by `secret`.
fn timed_token(secret: &Secret, iss: &str, aud: &str, iat: u64, nbf: u64, exp: u64) -> String {
    let mut claims = serde_json::json!({"iss": iss, "aud": aud, "exp": exp});
    for (k, v) in [("iat", iat), ("nbf", nbf)] {
        if v > 0 {
            claims[k] = v.into();
        }
    }
    let key = EncodingKey::from_secret(&STANDARD.decode(secret.to_base64()).unwrap());
    jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &key).unwrap()
}

/// `alg: none`, unsigned.
fn unsigned_token() -> String {
    let header = URL_SAFE_NO_PAD.encode(br#"{"alg":"none","typ":"JWT"}"#);
    let claims = URL_SAFE_NO_PAD.encode(
        serde_json::json!({"iss": "gitlab", "aud": "gitlab-kas", "exp": now() + 60}).to_string(),
    );
    format!("{header}.{claims}.")
}

async fn public_call(kas: &KasProc, authorization: Option<String>) -> Result<(), tonic::Status> {
    let mut client = KasApiClient::new(channel(kas.api).await);
    let mut req = tonic::Request::new(ConnectedAgentsByIdRequest { agent_id: 1 });
    if let Some(a) = authorization {
        req.metadata_mut()
            .insert("authorization", a.parse().unwrap());
    }
    client.connected_agents_by_id(req).await.map(|_| ())
}

/// A forwarded call with the token `authorization` in `header`; the answer's first frame,
/// and whether the answer said the token may come in `kas-private-token`.
async fn private_call(
    kas: &KasProc,
    header: &'static str,
    authorization: Option<String>,
) -> Result<(Frame, bool), tonic::Status> {
    let mut client = KasPrivateClient::new(channel(kas.private).await);
    let start = frames::frame(Kind::RequestStart(RequestStart {
        request_id: 1,
        agent_id: 1,
        method: "/kas.pods.Pods/List".into(),
        hops: 1,
        ..Default::default()
    }));
    let frames = vec![start, frames::message(1, vec![]), frames::close_send(1)];
    let mut req = tonic::Request::new(futures::stream::iter(frames));
    req.set_timeout(Duration::from_secs(2));
    if let Some(a) = authorization {
        req.metadata_mut().insert(header, a.parse().unwrap());
    }
    let answer = client.forward(req).await?;
    let taken = answer.metadata().get("kas-private-token-taken").is_some();
    let first = answer.into_inner().message().await?;
    Ok((first.expect("an answer frame"), taken))
}

#[tokio::test(flavor = "multi_thread")]
async fn every_bad_token_is_unauthenticated_and_kas_keeps_serving() {
    let s = Secrets::new();
    let kas = KasProc::start(&s, "kas", None, 2000, "").await;
    let other = Secret::from_base64(&"T3RoZXIh".repeat(8)).unwrap();
    let later = now() + 60;
    let bearer = |t: String| Some(format!("Bearer {t}"));
    let public_cases = [
        ("missing", None),
        ("not bearer", Some("Basic abc".to_string())),
        ("malformed", bearer("not.a.jwt".into())),
        (
            "expired",
            bearer(token(&s.gitlab, "gitlab", "gitlab-kas", now() - 120)),
        ),
        (
            "wrong secret",
            bearer(token(&other, "gitlab", "gitlab-kas", later)),
        ),
        (
            "wrong issuer",
            bearer(token(&s.gitlab, "someone", "gitlab-kas", later)),
        ),
        (
            "wrong audience",
            bearer(token(&s.gitlab, "gitlab", "gitlab", later)),
        ),
        ("alg none", bearer(unsigned_token())),
        ("private token", Some(s.kas_signer().bearer())),
    ];
    for (case, auth) in public_cases {
        let err = public_call(&kas, auth).await.expect_err(case);
        assert_eq!(err.code(), Code::Unauthenticated, "{case}: {err}");
        assert!(err.message().starts_with("api listener: "), "{case}: {err}");
    }
    let private_cases = [
        ("missing", None),
        ("public token", Some(s.gitlab_signer().bearer())),
        (
            "expired",
            bearer(token(&s.kas, "gitlab-kas", "gitlab-kas", now() - 120)),
        ),
    ];
    for (case, auth) in private_cases {
        for header in ["authorization", "kas-private-token"] {
            let err = private_call(&kas, header, auth.clone())
                .await
                .expect_err(case);
            assert_eq!(
                err.code(),
                Code::Unauthenticated,
                "{case} in {header}: {err}"
            );
        }
    }
    // The private token's own header is the private listener's only: the public one does
    // not read it.
    let mut client = KasApiClient::new(channel(kas.api).await);
    let mut req = tonic::Request::new(ConnectedAgentsByIdRequest { agent_id: 1 });
    let valid = s.gitlab_signer().bearer().parse().unwrap();
    req.metadata_mut().insert("kas-private-token", valid);
    let err = client
        .connected_agents_by_id(req)
        .await
        .expect_err("no authorization");
    assert_eq!(err.code(), Code::Unauthenticated, "{err}");
    // The reasons are logged.
    let log = kas.log_text();
    for reason in [
        "token expired",
        "signature does not match",
        "issuer is wrong",
        "audience is wrong",
        r#"algorithm "none" is not HS256"#,
    ] {
        assert!(log.contains(reason), "log lacks {reason:?}:\n{log}");
    }
    // Still serving: valid tokens work on both listeners.
    public_call(&kas, Some(s.gitlab_signer().bearer()))
        .await
        .expect("valid public token");
    // In either header (a kas that has not yet seen this one say it takes the token's
    // own header sends `authorization`), and the answer says the own header is taken.
    for header in ["authorization", "kas-private-token"] {
        let (refusal, taken) = private_call(&kas, header, Some(s.kas_signer().bearer()))
            .await
            .expect("valid private token");
        assert!(
            matches!(refusal.kind, Some(Kind::Error(_))),
            "no tunnel here: {refusal:?}"
        );
        assert!(
            taken,
            "the answer to a call with {header} names no kas-private-token-taken"
        );
    }
}

/// Hardening item 7: future `nbf` or `iat`, and tokens valid for years, are refused on both
/// the public and the private listener.
#[tokio::test(flavor = "multi_thread")]
async fn tokens_not_yet_valid_or_valid_too_long_are_unauthenticated() {
    let s = Secrets::new();
    let kas = KasProc::start(&s, "kas", None, 2000, "").await;
    let n = now();
    let cases = |secret: &Secret, iss: &str| {
        [
            (
                "nbf in an hour",
                timed_token(secret, iss, "gitlab-kas", n, n + 3600, n + 3660),
                "not valid yet",
            ),
            (
                "iat in an hour",
                timed_token(secret, iss, "gitlab-kas", n + 3600, 0, n + 3660),
                "issued in the future",
            ),
            (
                "ten years",
                timed_token(secret, iss, "gitlab-kas", n, n, n + 10 * 365 * 86_400),
                "exceeds",
            ),
            (
                "exp 2^64-1",
                timed_token(secret, iss, "gitlab-kas", 0, 0, u64::MAX),
                "exceeds",
            ),
        ]
    };
    for (case, t, reason) in cases(&s.gitlab, "gitlab") {
        let err = public_call(&kas, Some(format!("Bearer {t}")))
            .await
            .expect_err(case);
        assert_eq!(err.code(), Code::Unauthenticated, "public, {case}: {err}");
        assert!(err.message().contains(reason), "public, {case}: {err}");
    }
    for (case, t, reason) in cases(&s.kas, "gitlab-kas") {
        let err = private_call(&kas, "kas-private-token", Some(format!("Bearer {t}")))
            .await
            .expect_err(case);
        assert_eq!(err.code(), Code::Unauthenticated, "private, {case}: {err}");
        assert!(err.message().contains(reason), "private, {case}: {err}");
    }
    // A minute-long token, as GitLab mints them, still works.
    let fine = timed_token(&s.gitlab, "gitlab", "gitlab-kas", n, n, n + 60);
    public_call(&kas, Some(format!("Bearer {fine}")))
        .await
        .expect("valid token");
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_agent_tokens_are_unauthenticated() {
    let s = Secrets::new();
    let kas = KasProc::start(&s, "kas", None, 2000, "").await;
    for token in ["", "not-a-known-token-at-all", "short"] {
        let client = AgentClient::new(channel(kas.agent).await, token);
        let err = client
            .connect(Default::default(), None)
            .await
            .expect_err("refused");
        assert_eq!(err.code(), Code::Unauthenticated, "{token:?}: {err}");
        let status = client
            .serve_tunnel(
                kas_core::ConnectionId(1),
                Default::default(),
                Duration::from_secs(1),
                None,
            )
            .await;
        assert_eq!(status.code(), Code::Unauthenticated, "{token:?}: {status}");
    }
}

/// Opens a tunnel whose frames the test writes itself.
async fn raw_tunnel(
    kas: &KasProc,
    agent: i64,
    first: Frame,
) -> (
    tokio::sync::mpsc::Sender<Frame>,
    Result<tonic::Streaming<Frame>, tonic::Status>,
) {
    let mut client = AgentApiClient::new(channel(kas.agent).await);
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    tx.send(first).await.unwrap();
    let mut req = tonic::Request::new(ReceiverStream::new(rx));
    req.metadata_mut().insert(
        "authorization",
        format!("Bearer {}", agent_token(agent)).parse().unwrap(),
    );
    (tx, client.open_tunnel(req).await.map(|r| r.into_inner()))
}

#[tokio::test(flavor = "multi_thread")]
async fn malformed_tunnel_frames_are_refused_without_harm_to_others() {
    let s = Secrets::new();
    let kas = KasProc::start(&s, "kas", None, 2000, "").await;
    let _good = TestAgent::connect(kas.agent, 1, "good-pod", 1).await;

    // A tunnel must begin with a descriptor.
    let (_tx, r) = raw_tunnel(&kas, 2, frames::heartbeat(1)).await;
    let err = r.expect_err("refused");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert!(err.message().contains("descriptor"), "{err}");

    // A descriptor naming a connection that is not open.
    let bogus = frames::frame(Kind::Descriptor(Descriptor {
        methods: vec![],
        connection_id: 12345,
        ..Default::default()
    }));
    let (_tx, r) = raw_tunnel(&kas, 2, bogus).await;
    let err = r.expect_err("refused");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");

    // An agent answering for a call that does not exist.
    let agent = AgentClient::new(channel(kas.agent).await, agent_token(2));
    let (connection, _, _config) = agent.connect(Default::default(), None).await.unwrap();
    let descriptor = frames::frame(Kind::Descriptor(Descriptor {
        methods: vec![kas_agent::PODS_LIST.into()],
        connection_id: connection.0,
        ..Default::default()
    }));
    let (tx, r) = raw_tunnel(&kas, 2, descriptor).await;
    let mut inbound = r.expect("tunnel accepted");
    let liar = tokio::spawn(async move {
        while let Ok(Some(f)) = inbound.message().await {
            if let Some(Kind::CloseSend(_)) = f.kind {
                let wrong = frames::trailer(999_999, &tonic::Status::ok(""));
                let _ = tx.send(wrong).await;
            }
        }
    });
    let gl = GitLab::new(&s, kas.api).await;
    let err = gl
        .pods(2, None, Duration::from_secs(5))
        .await
        .expect_err("protocol error");
    assert_eq!(err.code(), Code::Internal, "{err}");
    assert!(err.message().contains("broke the tunnel protocol"), "{err}");
    liar.await.unwrap(); // kas closed the broken tunnel
    // Everyone else is still served.
    assert_eq!(
        gl.pods(1, None, Duration::from_secs(5)).await.unwrap(),
        ["good-pod"]
    );
    let config = AgentApiClient::new(channel(kas.agent).await)
        .get_configuration(ConfigurationRequest::default())
        .await
        .expect_err("no token");
    assert_eq!(config.code(), Code::Unauthenticated);
}

#[tokio::test(flavor = "multi_thread")]
async fn forwarded_call_with_wrong_hop_count_is_refused() {
    let s = Secrets::new();
    let kas = KasProc::start(&s, "kas", None, 2000, "").await;
    let mut client = KasPrivateClient::new(channel(kas.private).await);
    let start = frames::frame(Kind::RequestStart(RequestStart {
        request_id: 1,
        agent_id: 1,
        hops: 2,
        ..Default::default()
    }));
    let mut req = tonic::Request::new(futures::stream::iter(vec![start, frames::close_send(1)]));
    req.metadata_mut()
        .insert("authorization", s.kas_signer().bearer().parse().unwrap());
    let mut answer = client.forward(req).await.unwrap().into_inner();
    let err = answer.message().await.expect_err("refused");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert!(err.message().contains("hop count 2"), "{err}");
}

#[test]
fn kas_rejects_a_broken_config_file_naming_each_key() {
    let s = Secrets::new();
    let path = s.path("broken.yaml");
    std::fs::write(
        &path,
        "agent:\n  redis_conn_info_ttl: 10s\n  redis_conn_info_refresh: 20s\napi:\n  listen:\n    address: 127.0.0.1:1\n    authentication_secret_file: /nonexistent/secret\n",
    )
    .unwrap();
    let out = std::process::Command::new(bin("kas"))
        .arg("--config")
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    for key in [
        "agent.redis_conn_info_refresh (20s) must be less than agent.redis_conn_info_ttl (10s)",
        "api.listen.authentication_secret_file: cannot read /nonexistent/secret",
        "private_api.listen.authentication_secret_file is required",
        "agent.tokens_file or gitlab",
    ] {
        assert!(err.contains(key), "stderr lacks {key:?}:\n{err}");
    }
    std::fs::write(&path, "agent:\n  listen:\n    adress: 127.0.0.1:1\n").unwrap();
    let out = std::process::Command::new(bin("kas"))
        .args(["--check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown field `adress`"), "{err}");
    assert!(err.contains("line 3"), "{err}");
}
