//! TLS on kas's listeners against kas processes on loopback: routing through three kas
//! with TLS on the agent, api and private listeners (agentk dialling `grpcs://`), clear
//! errors for an untrusted certificate and for plaintext on either side, a certificate
//! replaced on disk served to new connections while tunnels stay up, and what the gRPC
//! listeners negotiate (`openssl s_client`: TLS 1.2 and 1.3 only, ALPN `h2`).

mod support;

use std::path::Path;
use std::time::{Duration, Instant};
use support::*;

const PODS: &str = "- {namespace: default, name: web-1, phase: Running, node_name: node-a}\n";

/// A kas whose agent, api and private listeners serve `cert` and `key`.
async fn tls_kas(s: &Secrets, name: &str, redis: Option<&Redis>, ca: &Path) -> KasProc {
    let (cert, key) = (s.path("kas.crt"), s.path("kas.key"));
    let lines = tls_lines(&cert, &key);
    let private = format!("{lines}    ca_certificate_file: {}\n", ca.display());
    let extra = Extra {
        agent_listen: &lines,
        api_listen: &lines,
        private_listen: &private,
        ..Extra::default()
    };
    KasProc::start_extra(s, name, redis, 10_000, extra, None).await
}

#[tokio::test(flavor = "multi_thread")]
async fn calls_route_through_three_kas_with_tls_on_every_hop() {
    let redis = Redis::start().expect("redis-server starts (scripts/test installs it)");
    let s = Secrets::new();
    let pki = Pki::new(s.dir.path(), "one");
    pki.issue("kas");
    let mut fleet = Vec::new();
    for name in ["kas0", "kas1", "kas2"] {
        fleet.push(tls_kas(&s, name, Some(&redis), &pki.ca()).await);
    }
    let ca = pki.ca().display().to_string();
    let agentk = AgentkProc::start(
        &s,
        &format!("grpcs://{}", fleet[0].agent),
        &agent_token(1),
        "agent1-pod",
        PODS,
        &["--ca-cert-file", &ca],
    );
    for kas in &fleet {
        let gl = GitLab::at(&s, &format!("grpcs://{}", kas.api), Some(&pki.ca()))
            .await
            .expect("a client trusting the CA connects");
        let pods = gl.pods(1, None, Duration::from_secs(10)).await;
        assert_eq!(
            pods.map_err(|e| e.to_string()),
            Ok(vec!["web-1".to_string()]),
            "through {}:\n{}",
            kas.api,
            agentk.log_text()
        );
    }
    // Two of the three calls crossed the private listener (TLS, verified with its CA).
    for kas in &fleet[1..] {
        let m = kas.await_metric("kas_routing_latency_seconds_count").await;
        assert!(
            !m.contains("kas_routing_latency_seconds_count 0\n"),
            "{} forwarded nothing",
            kas.api
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn untrusted_certificates_and_plaintext_fail_fast_with_clear_errors() {
    let s = Secrets::new();
    let pki = Pki::new(s.dir.path(), "one");
    pki.issue("kas");
    let other = Pki::new(s.dir.path(), "other");
    let kas = tls_kas(&s, "kas", None, &pki.ca()).await;
    let tls_url = format!("grpcs://{}", kas.api);

    // Plaintext to the TLS port: the client fails at once, kas logs why (first: kas logs
    // one failed handshake per listener in 5 s).
    let started = Instant::now();
    let plain = GitLab::at(&s, &format!("grpc://{}", kas.api), None)
        .await
        .expect("TCP connects");
    let err = plain
        .pods(1, None, Duration::from_secs(5))
        .await
        .expect_err("no gRPC over plaintext");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "took {:?}",
        started.elapsed()
    );
    // hyper says it as a reset, a broken pipe or a cancelled request, as the race goes (a
    // request never sent is reported as not delivered, the transport's error behind it).
    let transport = std::iter::successors(std::error::Error::source(&err), |e| e.source())
        .any(|e| e.is::<tonic::transport::Error>());
    assert!(transport, "not a transport failure: {err}");
    eventually(
        Duration::from_secs(5),
        "kas logs the plaintext client",
        || async {
            kas.log_text()
                .contains("the client spoke plaintext (first byte 0x50) to a TLS listener")
                .then_some(())
        },
    )
    .await;
    let plaintext = eventually(
        Duration::from_secs(5),
        "the failed handshake counted",
        || async { Some(handshake_errors(&kas).await).filter(|n| *n >= 1) },
    )
    .await;

    // A client that trusts another CA (or only the system's roots) is refused, naming the
    // host and the reason.
    for ca in [Some(other.ca()), None] {
        let err = GitLab::at(&s, &tls_url, ca.as_deref())
            .await
            .err()
            .expect("refused");
        assert!(
            err.contains(&format!(
                "the certificate of kas at {} does not verify",
                kas.api
            )) && err.contains("UnknownIssuer"),
            "{err}"
        );
    }
    eventually(Duration::from_secs(5), "both refusals counted", || async {
        (handshake_errors(&kas).await >= plaintext + 2).then_some(())
    })
    .await;

    // TLS to a plaintext port: the client says kas did not answer with TLS.
    let plain_kas = KasProc::start(&s, "plain", None, 10_000, "").await;
    let started = Instant::now();
    let err = GitLab::at(&s, &format!("grpcs://{}", plain_kas.api), Some(&pki.ca()))
        .await
        .err()
        .expect("refused");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "took {:?}",
        started.elapsed()
    );
    assert!(err.contains("did not answer with TLS"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_certificate_replaced_on_disk_is_served_while_tunnels_stay_up() {
    let s = Secrets::new();
    let first = Pki::new(s.dir.path(), "first");
    first.issue("kas");
    let kas = tls_kas(&s, "kas", None, &first.ca()).await;
    let ca = first.ca().display().to_string();
    let agentk = AgentkProc::start(
        &s,
        &format!("grpcs://{}", kas.agent),
        &agent_token(1),
        "agent1-pod",
        PODS,
        &["--ca-cert-file", &ca],
    );
    let url = format!("grpcs://{}", kas.api);
    let gl = GitLab::at(&s, &url, Some(&first.ca()))
        .await
        .expect("connects");
    let listed = eventually(Duration::from_secs(10), "agent 1 listed", || async {
        gl.connections(1).await.ok().filter(|c| c.len() == 1)
    })
    .await;

    // cert-manager renews with a new CA: the files change in place.
    let second = Pki::new(s.dir.path(), "second");
    second.issue("kas");
    let renewed = eventually(
        Duration::from_secs(15),
        "the new certificate served",
        || {
            let (s, url, ca) = (&s, &url, second.ca());
            async move { GitLab::at(s, url, Some(&ca)).await.ok() }
        },
    )
    .await;
    let err = GitLab::at(&s, &url, Some(&first.ca())).await.err();
    assert!(
        err.as_deref()
            .is_some_and(|e| e.contains("does not verify")),
        "a new connection still got the old certificate: {err:?}"
    );
    assert!(kas.log_text().contains("certificate reloaded"));
    // The agent's connection and tunnels from before the renewal still carry calls.
    assert_eq!(
        renewed.connections(1).await.expect("listed"),
        listed,
        "the agent reconnected"
    );
    let pods = renewed.pods(1, None, Duration::from_secs(5)).await;
    assert_eq!(pods.expect("routed"), ["web-1"]);
    assert_eq!(agentk.count("connected kas="), 1, "{}", agentk.log_text());
}

/// `openssl s_client` against the api listener: TLS 1.3 and 1.2 with ALPN `h2`, nothing
/// older.
#[tokio::test(flavor = "multi_thread")]
async fn grpc_listeners_speak_tls_1_2_and_1_3_with_alpn_h2_only() {
    ensure_openssl();
    let s = Secrets::new();
    let pki = Pki::new(s.dir.path(), "one");
    pki.issue("kas");
    let kas = tls_kas(&s, "kas", None, &pki.ca()).await;
    let s_client = |version: &str| {
        let out = std::process::Command::new("openssl")
            .args(["s_client", "-connect", &kas.api.to_string(), "-alpn", "h2"])
            .args([version, "-CAfile", &pki.ca().display().to_string()])
            .stdin(std::process::Stdio::null())
            .output()
            .expect("openssl runs");
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
    };
    for (version, name) in [("-tls1_3", "TLSv1.3"), ("-tls1_2", "TLSv1.2")] {
        let out = s_client(version);
        assert!(
            out.contains(&format!("Protocol  : {name}")) || out.contains(&format!("New, {name}")),
            "{version}:\n{out}"
        );
        assert!(out.contains("ALPN protocol: h2"), "{version}:\n{out}");
        assert!(
            out.contains("Verify return code: 0 (ok)"),
            "{version}:\n{out}"
        );
    }
    let old = s_client("-tls1_1");
    assert!(
        old.contains("no peer certificate available") && old.contains("Cipher is (NONE)"),
        "TLS 1.1 was accepted:\n{old}"
    );
}

/// The observability listener over TLS: `/liveness` answers through `openssl s_client`
/// with ALPN `http/1.1`, and a plaintext request gets nothing.
#[tokio::test(flavor = "multi_thread")]
async fn the_observability_listener_serves_http_1_1_over_tls() {
    ensure_openssl();
    let s = Secrets::new();
    let pki = Pki::new(s.dir.path(), "one");
    let (cert, key) = pki.issue("kas");
    let lines = tls_lines(&cert, &key);
    let extra = Extra {
        observability_listen: &lines,
        ..Extra::default()
    };
    let kas = KasProc::start_extra(&s, "kas", None, 10_000, extra, None).await;
    let mut child = std::process::Command::new("openssl")
        .args([
            "s_client",
            "-quiet",
            "-connect",
            &kas.observability.to_string(),
        ])
        .args([
            "-alpn",
            "http/1.1",
            "-CAfile",
            &pki.ca().display().to_string(),
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("openssl runs");
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"GET /liveness HTTP/1.0\r\nHost: kas\r\n\r\n")
        .unwrap();
    let out = child.wait_with_output().expect("openssl exits");
    let answer = String::from_utf8_lossy(&out.stdout);
    assert!(
        answer.starts_with("HTTP/1.0 200") && answer.ends_with("ok\n"),
        "{answer}"
    );
    let plain = kas_tools::local::kas_process::http_get(kas.observability, "/liveness").await;
    assert_eq!(plain, None, "plaintext HTTP answered on a TLS listener");
}

/// `kas_handshake_errors_total` of the api listener.
async fn handshake_errors(kas: &KasProc) -> u64 {
    let m = kas.metrics().await;
    m.lines()
        .find_map(|l| l.strip_prefix("kas_handshake_errors_total{listener=\"api\"} "))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// openssl, installed with apt-get when missing (as root), never skipped.
fn ensure_openssl() {
    let present = || {
        std::process::Command::new("openssl")
            .arg("version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !present() {
        let _ = std::process::Command::new("apt-get")
            .args(["install", "-y", "-qq", "openssl"])
            .status();
    }
    assert!(present(), "openssl is missing: apt-get install openssl");
}
