//! The Kubernetes API through kas, driven with the real `kubectl` (Debian's
//! `kubernetes-client`, installed when missing) against the local deployment that
//! `kas-local` runs: three kas sharing a private Redis, agent 1 on kas0, agent 2's two
//! replicas on kas1 and kas2, each cluster a small local API server.

mod support;

use kas_server::kas::observability;
use kas_tools::local::{KUBE_ROUTING_TIMEOUT_SECS, LocalDeployment};
use serde_json::Value;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

/// The deployment, in a temporary directory kept alive beside it.
async fn deployment() -> (LocalDeployment, tempfile::TempDir) {
    support::ensure_package("kubectl", "kubernetes-client");
    let dir = tempfile::tempdir().expect("temp dir");
    let d = LocalDeployment::start(dir.path(), true, false)
        .await
        .expect("the local deployment starts");
    (d, dir)
}

/// Runs kubectl; (success, stdout, stderr).
async fn run(
    kubeconfig: &Path,
    cache: &Path,
    context: &str,
    args: &[&str],
) -> (bool, String, String) {
    let out = tokio::time::timeout(
        Duration::from_secs(40),
        support::kubectl(kubeconfig, cache, context, args).output(),
    )
    .await
    .unwrap_or_else(|_| panic!("kubectl {context} {args:?} did not finish in 40 s"))
    .expect("kubectl runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

async fn ok(d: &LocalDeployment, cache: &Path, context: &str, args: &[&str]) -> String {
    let (success, out, err) = run(&d.kubeconfig(), cache, context, args).await;
    assert!(
        success,
        "kubectl --context {context} {args:?} failed: {err}"
    );
    out
}

/// A running kubectl (a watch, a followed log), its standard output read line by line;
/// killed when dropped.
struct Output {
    child: Child,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    seen: Vec<String>,
}

impl Output {
    /// Starts `kubectl --context CONTEXT ARGS` against the deployment.
    fn spawn(d: &LocalDeployment, cache: &Path, context: &str, args: &[&str]) -> Output {
        let mut command = support::kubectl(&d.kubeconfig(), cache, context, args);
        command.stderr(Stdio::null());
        Output::start(command)
    }

    fn start(mut command: Command) -> Output {
        let mut child = command
            .stdout(Stdio::piped())
            .spawn()
            .expect("kubectl runs");
        let stdout = child.stdout.take().expect("piped stdout");
        Output {
            child,
            lines: BufReader::new(stdout).lines(),
            seen: Vec::new(),
        }
    }

    /// Reads until `done` says so, failing after `within` with what it read.
    async fn until(&mut self, within: Duration, done: impl Fn(&[String]) -> bool) -> &[String] {
        let end = tokio::time::Instant::now() + within;
        while !done(&self.seen) {
            match tokio::time::timeout_at(end, self.lines.next_line()).await {
                Ok(Ok(Some(line))) => self.seen.push(line),
                Ok(Ok(None)) | Ok(Err(_)) => panic!("the output ended early: {:?}", self.seen),
                Err(_) => panic!("timed out after {within:?}; read so far: {:?}", self.seen),
            }
        }
        &self.seen
    }
}

/// A plaintext HTTP client.
fn http_client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

/// A kas process (in-memory registry) whose plaintext Kubernetes API listener takes
/// `pat:1:<token>`, [`KUBE_MAX_STREAMS`] requests at once per HTTP/2 connection and
/// [`KUBE_MAX_REQUESTS`] per token.
async fn kas_with_kubernetes_api(secrets: &support::Secrets, token: &str) -> support::KasProc {
    let listen = format!("      max_concurrent_streams: {KUBE_MAX_STREAMS}\n");
    let lines = format!("    max_requests_per_token: {KUBE_MAX_REQUESTS}\n");
    support::KasProc::with_kubernetes_api(secrets, &[token], &listen, &lines).await
}

const KUBE_MAX_STREAMS: u32 = 64;
const KUBE_MAX_REQUESTS: usize = 3;

/// A caller token with `max_requests_per_token` requests open (waiting for an agent that
/// is not connected) is answered 429 naming the key, and counted; a request that ends
/// (its caller gone) gives its place back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_token_with_too_many_requests_open_is_answered_429() {
    let secrets = support::Secrets::new();
    let token = "busy-user-token-0001";
    let kas = kas_with_kubernetes_api(&secrets, token).await;
    let url = format!(
        "http://{}/api/v1/pods",
        kas.kubernetes_api.expect("a Kubernetes API listener")
    );
    let get = |timeout: &str| {
        http_client()
            .get(format!("{url}?timeout={timeout}"))
            .bearer_auth(format!("pat:1:{token}"))
            .send()
    };
    let waiting: Vec<_> = (0..KUBE_MAX_REQUESTS)
        .map(|_| tokio::spawn(get("30s")))
        .collect();
    kas.await_metric(&format!("kas_routing_calls {KUBE_MAX_REQUESTS}"))
        .await;
    let refused = get("30s").await.expect("an answer");
    assert_eq!(refused.status(), 429);
    let status: Value = refused.json().await.expect("a Status object");
    assert_eq!(status["kind"], "Status");
    let message = status["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("agent.kubernetes_api.max_requests_per_token"),
        "{message}"
    );
    kas.await_metric(
        "kas_limit_refusals_total{limit=\"agent.kubernetes_api.max_requests_per_token\"} 1",
    )
    .await;
    for w in waiting {
        w.abort();
    }
    // With the waiting callers gone, the token's next request waits for the agent again.
    support::eventually(Duration::from_secs(10), "a place back", || async {
        let r = get("1s").await.ok()?;
        (r.status() == 503).then_some(())
    })
    .await;
}

/// A client of kas's Kubernetes API listener, trusting the deployment's CA.
fn https_client(d: &LocalDeployment) -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ca = std::fs::read(d.kube_ca_file()).expect("the CA");
    reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(&ca).expect("a PEM CA"))
        .build()
        .expect("a client")
}

/// The fixture pods of `agent` as (namespace, name, phase, node), sorted.
fn fixture(agent: i64) -> Vec<(String, String, String, String)> {
    let all = [
        (1, "default", "web-1", "Running", "node-a"),
        (1, "kube-system", "coredns-1", "Running", "node-a"),
        (2, "shop", "cart-1", "Running", "node-b"),
    ];
    let mut pods: Vec<_> = all
        .iter()
        .filter(|p| p.0 == agent)
        .map(|p| {
            (
                p.1.to_string(),
                p.2.to_string(),
                p.3.to_string(),
                p.4.to_string(),
            )
        })
        .collect();
    pods.sort();
    pods
}

/// (agent, kas, namespace, pod): agent 1 (on kas0) through kas0 (local) and kas2 (remote),
/// agent 2 (on kas1 and kas2) through kas1 (local) and kas0 (remote).
const ROUTES: [(i64, usize, &str, &str); 4] = [
    (1, 0, "default", "web-1"),
    (1, 2, "default", "web-1"),
    (2, 1, "shop", "cart-1"),
    (2, 0, "shop", "cart-1"),
];

/// Agent 1 (on kas0) through kas0 (local route) and kas2 (remote); agent 2 (on kas1 and
/// kas2) through kas1 (local) and kas0 (remote): get, get -o json, logs -f and exec.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kubectl_reaches_every_agent_through_a_local_and_a_remote_kas() {
    let (d, dir) = deployment().await;
    let cache = dir.path();
    for (agent, kas, namespace, pod) in ROUTES {
        let context = format!("agent{agent}-kas{kas}");
        let table = ok(&d, cache, &context, &["get", "pods", "-A"]).await;
        for (ns, name, phase, _) in fixture(agent) {
            assert!(
                table
                    .lines()
                    .any(|l| l.starts_with(&ns) && l.contains(&name) && l.contains(&phase)),
                "{context}: {name} missing from\n{table}"
            );
        }
        let json: Value = serde_json::from_str(
            &ok(&d, cache, &context, &["get", "pods", "-A", "-o", "json"]).await,
        )
        .expect("kubectl -o json prints JSON");
        let mut listed: Vec<_> = json["items"]
            .as_array()
            .expect("a list")
            .iter()
            .map(|p| {
                let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
                (
                    s(&p["metadata"]["namespace"]),
                    s(&p["metadata"]["name"]),
                    s(&p["status"]["phase"]),
                    s(&p["spec"]["nodeName"]),
                )
            })
            .collect();
        listed.sort();
        assert_eq!(listed, fixture(agent), "{context}: -o json");

        let echoed = ok(
            &d,
            cache,
            &context,
            &[
                "exec", "-n", namespace, pod, "--", "echo", "hello", &context,
            ],
        )
        .await;
        assert_eq!(
            echoed,
            format!("hello {context}\n"),
            "{context}: exec over WebSocket"
        );

        // The fixture log, then lines the pod writes while we read.
        let mut out = Output::spawn(&d, cache, &context, &["logs", "-f", "-n", namespace, pod]);
        let lines = out
            .until(Duration::from_secs(20), |seen| {
                seen.iter().filter(|l| l.contains("tick at")).count() >= 3
            })
            .await;
        assert_eq!(lines[0], format!("{pod}: started"), "{context}: logs -f");
    }
    d.stop().await;
}

/// `kubectl port-forward` through a local and a remote kas, for each agent, both in
/// SPDY tunnelled in WebSocket (kubectl's default since 1.31) and on a plain SPDY upgrade:
/// two connections one after the other each get back exactly the 1 MiB they sent (the
/// local API server's pod ports echo).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn port_forward_carries_bytes_both_ways_over_websocket_and_spdy() {
    let (d, dir) = deployment().await;
    let cache = dir.path();
    let sent: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    for (agent, kas, namespace, pod) in ROUTES {
        let context = format!("agent{agent}-kas{kas}");
        for websocket in [true, false] {
            let what = format!("{context}, websocket {websocket}");
            let mut command = support::kubectl(
                &d.kubeconfig(),
                cache,
                &context,
                &["port-forward", "-n", namespace, pod, ":8080"],
            );
            // At -v=6 kubectl says when it falls back from WebSocket to SPDY.
            let log = dir
                .path()
                .join(format!("port-forward-{agent}-{kas}-{websocket}.log"));
            command
                .env("KUBECTL_PORT_FORWARD_WEBSOCKETS", websocket.to_string())
                .arg("-v=6")
                .stderr(std::fs::File::create(&log).expect("a log file"));
            let mut out = Output::start(command);
            let lines = out
                .until(Duration::from_secs(20), |seen| {
                    seen.iter()
                        .any(|l| l.starts_with("Forwarding from 127.0.0.1:"))
                })
                .await;
            let port: u16 = lines
                .iter()
                .find_map(|l| l.strip_prefix("Forwarding from 127.0.0.1:"))
                .and_then(|l| l.split_whitespace().next())
                .and_then(|p| p.parse().ok())
                .unwrap_or_else(|| panic!("{what}: no local port in {lines:?}"));
            for connection in 0..2 {
                let stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .expect("kubectl's local port");
                let (mut read, mut write) = stream.into_split();
                let to_send = sent.clone();
                let writer = tokio::spawn(async move {
                    write.write_all(&to_send).await.expect("sent");
                    write.shutdown().await.expect("half-closed");
                });
                let mut got = Vec::new();
                tokio::time::timeout(Duration::from_secs(20), read.read_to_end(&mut got))
                    .await
                    .unwrap_or_else(|_| panic!("{what}: connection {connection} hung"))
                    .expect("read");
                writer.await.unwrap();
                assert!(
                    got == sent,
                    "{what}: connection {connection} echoed {} of {} bytes{}",
                    got.len(),
                    sent.len(),
                    if got.len() == sent.len() {
                        ", different"
                    } else {
                        ""
                    }
                );
            }
            let log = std::fs::read_to_string(&log).expect("kubectl's log");
            // A WebSocket upgrade is a GET, SPDY's a POST.
            let method = if websocket { "GET" } else { "POST" };
            assert!(
                log.lines()
                    .any(|l| l.contains(&format!("{method} https://"))
                        && l.contains("/portforward")
                        && l.contains("101 Switching Protocols"))
                    && !log.contains("fallback to secondary dialer"),
                "{what}: not the transport asked for:\n{log}"
            );
        }
    }
    d.stop().await;
}

/// A log followed through a remote kas keeps flowing past the deadline that bounded its
/// routing (the deployment's `routing_timeout`, which is also the forward's gRPC deadline),
/// and when kubectl goes away the call ends on both kas.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_followed_log_outlives_its_routing_deadline_and_ends_with_its_caller() {
    let (d, dir) = deployment().await;
    let cache = dir.path();
    let mut out = Output::spawn(
        &d,
        cache,
        "agent1-kas2",
        &["logs", "-f", "-n", "default", "web-1"],
    );
    out.until(Duration::from_secs(20), |seen| {
        seen.iter().any(|l| l.contains("tick at"))
    })
    .await;
    let started = std::time::Instant::now();
    let past = Duration::from_secs(KUBE_ROUTING_TIMEOUT_SECS * 2);
    tokio::time::sleep(past).await;
    let ticks = |seen: &[String]| seen.iter().filter(|l| l.contains("tick at")).count();
    let before = ticks(out.until(Duration::ZERO, |_| true).await);
    // Still flowing, well past the deadline.
    let more = before + 2;
    out.until(Duration::from_secs(5), |seen| ticks(seen) >= more)
        .await;
    assert!(started.elapsed() >= past);
    let calls = |i: usize| observability::gauge(&d.kas()[i].health().metrics_text(), "kas_calls");
    assert_eq!(calls(2), Some(1.0), "the routing kas holds the call");
    assert_eq!(calls(0), Some(1.0), "the serving kas holds the call");
    let _ = out.child.kill().await;
    support::eventually(
        Duration::from_secs(10),
        "both kas to end the call",
        || async { (calls(0) == Some(0.0) && calls(2) == Some(0.0)).then_some(()) },
    )
    .await;
    d.stop().await;
}

/// A watch through a remote kas sees a deletion made through another kas.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_watch_through_a_remote_kas_sees_an_event_the_test_causes() {
    let (d, dir) = deployment().await;
    let cache = dir.path();
    let mut out = Output::spawn(&d, cache, "agent1-kas2", &["get", "pods", "-A", "-w"]);
    let coredns = |n: usize| {
        move |seen: &[String]| seen.iter().filter(|l| l.contains("coredns-1")).count() >= n
    };
    out.until(Duration::from_secs(20), coredns(1)).await; // the list
    ok(
        &d,
        cache,
        "agent1-kas1",
        &[
            "delete",
            "pod",
            "-n",
            "kube-system",
            "coredns-1",
            "--wait=false",
        ],
    )
    .await;
    out.until(Duration::from_secs(20), coredns(2)).await; // the deletion's event
    drop(out);
    let after = ok(&d, cache, "agent1-kas0", &["get", "pods", "-A"]).await;
    assert!(
        !after.contains("coredns-1"),
        "deleted, yet listed:\n{after}"
    );
    d.stop().await;
}

/// Refusals are Kubernetes `Status` objects with the right code, which kubectl prints.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refusals_are_kubernetes_status_objects() {
    let (d, dir) = deployment().await;
    let cache = dir.path();
    let url = d.kubernetes_api_url(1).expect("a Kubernetes API listener");
    let client = https_client(&d);
    let get = |bearer: Option<String>| {
        let mut r = client.get(format!("{url}/api/v1/pods"));
        if let Some(b) = bearer {
            r = r.bearer_auth(b);
        }
        async move {
            let resp = r.send().await.expect("kas answers");
            let code = resp.status().as_u16();
            // kas made an id for the call (the caller sent none) and ended its error with it.
            let id = resp.headers()["x-gitlab-correlation-id"]
                .to_str()
                .unwrap()
                .to_owned();
            let status: Value = resp.json().await.expect("a JSON body");
            let ended = format!("(correlation id {id})");
            assert!(
                id.len() == 26 && status["message"].as_str().unwrap().ends_with(&ended),
                "{status}"
            );
            (code, status)
        }
    };
    let token = d.user_bearer(1);
    let secret = token.rsplit(':').next().unwrap().to_string();
    for (bearer, code, reason, says) in [
        (None, 401, "Unauthorized", "no Authorization header"),
        (
            Some(format!("pat:1:{secret}x")),
            401,
            "Unauthorized",
            "not valid",
        ),
        (
            Some(format!("ci:1:{secret}")),
            401,
            "Unauthorized",
            "not valid",
        ),
        (
            Some(format!("pat:4:{secret}")),
            403,
            "Forbidden",
            "does not give access to agent 4",
        ),
    ] {
        let (got, status) = get(bearer.clone()).await;
        assert_eq!(got, code, "{bearer:?}: {status}");
        assert_eq!(status["kind"], "Status", "{status}");
        assert_eq!(status["reason"], reason, "{status}");
        assert_eq!(status["code"], code, "{status}");
        assert!(
            status["message"].as_str().unwrap().contains(says),
            "{status}"
        );
    }
    // Agent 3 may be reached, but never connects: 503 after the request's own timeout.
    let started = std::time::Instant::now();
    let resp = client
        .get(format!("{url}/api/v1/pods?timeout=2s"))
        .bearer_auth(format!("pat:3:{secret}"))
        .header("x-gitlab-correlation-id", "caller-id-1")
        .send()
        .await
        .expect("kas answers");
    assert_eq!(resp.status().as_u16(), 503);
    assert_eq!(resp.headers()["x-gitlab-correlation-id"], "caller-id-1");
    let status: Value = resp.json().await.expect("a Status");
    assert_eq!(status["reason"], "ServiceUnavailable", "{status}");
    let message = status["message"].as_str().unwrap();
    assert!(
        message.contains("agent 3 is not connected")
            && message.ends_with("(correlation id caller-id-1)"),
        "{status}"
    );
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "answered before the timeout"
    );
    // kubectl says so (its discovery prints the reason, not the message).
    let mut kubeconfig = std::fs::read_to_string(d.kubeconfig()).unwrap();
    kubeconfig = kubeconfig.replace(&d.user_bearer(1), &format!("pat:4:{secret}"));
    let other = dir.path().join("kubeconfig-agent4");
    std::fs::write(&other, kubeconfig).unwrap();
    let (success, _, err) = run(&other, cache, "agent1-kas0", &["get", "pods"]).await;
    assert!(!success);
    assert!(err.contains("Error from server (Forbidden)"), "{err}");
    d.stop().await;
}

/// A 100 MiB response arrives whole, byte for byte, through a remote kas.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_100_mib_response_arrives_whole_through_a_remote_kas() {
    let (d, _dir) = deployment().await;
    let url = d.kubernetes_api_url(0).expect("a Kubernetes API listener");
    let client = https_client(&d);
    const N: u64 = 100 << 20;
    // Agent 2 is on kas1 and kas2: kas0 forwards.
    let mut resp = client
        .get(format!("{url}/kas-local/bytes?n={N}"))
        .bearer_auth(d.user_bearer(2))
        .send()
        .await
        .expect("kas answers");
    assert_eq!(resp.status().as_u16(), 200);
    let mut at = 0u64;
    while let Some(chunk) = resp.chunk().await.expect("the body streams") {
        for (i, b) in chunk.iter().enumerate() {
            let want = ((at + i as u64) % 251) as u8;
            assert_eq!(*b, want, "byte {} differs", at + i as u64);
        }
        at += chunk.len() as u64;
    }
    assert_eq!(at, N);
    d.stop().await;
}

/// SIGTERM while a watch streams through kas (a kas process, agentk proxying to a local
/// API server named by its KUBECONFIG): kas stops within `shutdown_grace` (2 s) and a
/// little, ending the watch rather than waiting for it; the client sees its stream end, and
/// an HTTP/2 client is told to go elsewhere (GOAWAY) first.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_ends_an_open_watch_within_the_shutdown_grace() {
    use support::{AgentkProc, Secrets, agent_token, eventually};
    let secrets = Secrets::new();
    let fixture = secrets.path("pods.yaml");
    std::fs::write(
        &fixture,
        "- {namespace: default, name: web-1, phase: Running}\n",
    )
    .unwrap();
    let pods = kas_agent::pods::read_fixture(&fixture).unwrap();
    let cluster = kas_tools::local::kube_server::KubeServer::start(&pods)
        .await
        .unwrap();
    let kubeconfig = secrets.path("agent-kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters:\n- name: c\n  cluster:\n    server: {}\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: u\nusers:\n- name: u\n  user: {{}}\n",
            cluster.url()
        ),
    )
    .unwrap();
    let mut kas = kas_with_kubernetes_api(&secrets, "watch-user-token-0001").await;
    let _agentk = AgentkProc::start_env(
        &secrets,
        &kas.agent.to_string(),
        &agent_token(1),
        "agent1",
        "[]",
        &[],
        &[("KUBECONFIG", kubeconfig.to_str().unwrap())],
    );
    let url = format!(
        "http://{}",
        kas.kubernetes_api.expect("a Kubernetes API listener")
    );
    let client = http_client();
    let get = |path: &str| {
        client
            .get(format!("{url}{path}"))
            .bearer_auth("pat:1:watch-user-token-0001")
            .send()
    };
    eventually(
        Duration::from_secs(20),
        "the agent to serve its API",
        || async { get("/api/v1/pods").await.ok().filter(|r| r.status() == 200) },
    )
    .await;
    let mut watch = get("/api/v1/pods?watch=true").await.expect("a watch");
    assert_eq!(watch.status(), 200);
    let first = watch
        .chunk()
        .await
        .expect("the watch streams")
        .expect("an event");
    assert!(String::from_utf8_lossy(&first).contains("web-1"));
    // A second watch on an HTTP/2 connection spoken by hand, to see kas's frames.
    let address = kas.kubernetes_api.expect("a Kubernetes API listener");
    let mut frames = h2_watch(address, "pat:1:watch-user-token-0001").await;
    let first_data = tokio::time::timeout(Duration::from_secs(10), async {
        let mut limit = None;
        while let Some((kind, stream, payload)) = frames.recv().await {
            if kind == H2_SETTINGS {
                // Entries of six bytes: a 16-bit id, a 32-bit value.
                limit = limit.or(payload
                    .chunks_exact(6)
                    .find(|e| e[..2] == [0, 3]) // SETTINGS_MAX_CONCURRENT_STREAMS
                    .map(|e| u32::from_be_bytes(e[2..].try_into().unwrap())));
            }
            if (kind, stream) == (H2_DATA, 1) {
                assert_eq!(
                    limit,
                    Some(KUBE_MAX_STREAMS),
                    "listen.max_concurrent_streams"
                );
                return;
            }
        }
        panic!("the HTTP/2 connection ended before the watch streamed");
    });
    first_data.await.expect("the HTTP/2 watch streams");
    let started = std::time::Instant::now();
    let status = tokio::task::spawn_blocking(move || kas.terminate())
        .await
        .unwrap();
    let took = started.elapsed();
    assert!(status.success(), "kas exited {status}");
    assert!(
        took < Duration::from_secs(4),
        "kas took {took:?} to stop with a watch open"
    );
    let end = tokio::time::timeout(Duration::from_secs(2), async {
        loop {
            match watch.chunk().await {
                Ok(Some(_)) => continue,
                other => return other.map(|_| ()),
            }
        }
    })
    .await;
    assert!(end.is_ok(), "the watch was still open after kas stopped");
    let mut after = Vec::new();
    while let Ok(Some(frame)) = tokio::time::timeout(Duration::from_secs(2), frames.recv()).await {
        after.push(frame);
    }
    assert!(
        after.iter().any(|(kind, _, _)| *kind == H2_GOAWAY),
        "kas stopped without a GOAWAY telling the client to go elsewhere: {after:?}"
    );
}

const H2_DATA: u8 = 0;
const H2_HEADERS: u8 = 1;
const H2_SETTINGS: u8 = 4;
const H2_GOAWAY: u8 = 7;

fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    f.extend_from_slice(&[kind, flags]);
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// `GET /api/v1/pods?watch=true` as stream 1 of a prior-knowledge HTTP/2 connection:
/// the (type, stream, payload) of each frame kas sends, until the connection ends. Settings are
/// acknowledged; the watch's few bytes fit the default windows.
async fn h2_watch(
    address: std::net::SocketAddr,
    token: &str,
) -> tokio::sync::mpsc::UnboundedReceiver<(u8, u32, Vec<u8>)> {
    let mut io = tokio::net::TcpStream::connect(address).await.expect("kas");
    let mut block = Vec::new();
    let authority = address.to_string();
    let bearer = format!("Bearer {token}");
    for (name, value) in [
        (":method", "GET"),
        (":scheme", "http"),
        (":authority", authority.as_str()),
        (":path", "/api/v1/pods?watch=true"),
        ("authorization", bearer.as_str()),
    ] {
        // HPACK: a literal field not indexed, with a literal name; all shorter than 127.
        block.push(0);
        for w in [name, value] {
            block.push(w.len() as u8);
            block.extend_from_slice(w.as_bytes());
        }
    }
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend(h2_frame(H2_SETTINGS, 0, 0, &[]));
    hello.extend(h2_frame(H2_HEADERS, 0x4 | 0x1, 1, &block)); // END_HEADERS, END_STREAM
    io.write_all(&hello).await.expect("sent");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let mut head = [0u8; 9];
            if io.read_exact(&mut head).await.is_err() {
                return;
            }
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let mut payload = vec![0; len];
            if io.read_exact(&mut payload).await.is_err() {
                return;
            }
            let (kind, flags) = (head[3], head[4]);
            let stream = u32::from_be_bytes(head[5..9].try_into().unwrap()) & 0x7fff_ffff;
            if kind == H2_SETTINGS && flags & 1 == 0 {
                let _ = io.write_all(&h2_frame(H2_SETTINGS, 1, 0, &[])).await;
            }
            let _ = tx.send((kind, stream, payload));
        }
    });
    rx
}

/// The Python `kubernetes` client (PyPI's, installed with pip when missing) lists pods
/// through a remote kas: a second outside client.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_python_kubernetes_client_lists_pods_through_kas() {
    support::ensure_python_module("kubernetes", "kubernetes");
    let (d, dir) = deployment().await;
    let script = dir.path().join("list.py");
    std::fs::write(
        &script,
        "import sys\n\
         from kubernetes import client\n\
         c = client.Configuration()\n\
         c.host, c.ssl_ca_cert = sys.argv[1], sys.argv[2]\n\
         c.api_key = {'authorization': 'Bearer ' + sys.argv[3]}\n\
         pods = client.CoreV1Api(client.ApiClient(c)).list_pod_for_all_namespaces().items\n\
         for p in sorted(pods, key=lambda p: (p.metadata.namespace, p.metadata.name)):\n\
         \x20   print(p.metadata.namespace, p.metadata.name, p.status.phase, p.spec.node_name)\n",
    )
    .unwrap();
    // Agent 1 is on kas0: kas2 forwards.
    let out = Command::new("python3")
        .arg(&script)
        .arg(d.kubernetes_api_url(2).expect("a Kubernetes API listener"))
        .arg(d.kube_ca_file())
        .arg(d.user_bearer(1))
        .output()
        .await
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed = String::from_utf8_lossy(&out.stdout).into_owned();
    let expected: String = fixture(1)
        .into_iter()
        .map(|(ns, name, phase, node)| format!("{ns} {name} {phase} {node}\n"))
        .collect();
    assert_eq!(listed, expected);
    d.stop().await;
}

/// An agent's answers that are not HTTP are refused as 502, naming the agent, and kas
/// goes on serving: garbage, a body before its head, a 101 nobody asked for, a head with
/// 30,000 headers (it once panicked kas) or 30,000 values of one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agents_answers_that_are_not_http_are_a_bad_gateway() {
    use kas_proto::http::{HttpRequest, HttpResponse, ResponseHead, http_request, http_response};
    use prost::Message;
    use support::{Secrets, TestAgent};
    let secrets = Secrets::new();
    let kas = kas_with_kubernetes_api(&secrets, "hostile-user-token-01").await;
    let mut modules = kas_agent::Modules::default();
    modules.streaming(kas_proto::http::KUBERNETES_API_METHOD, |mut requests| {
        let answer = async move {
            let head = requests.recv().await.unwrap_or_default();
            let path = match HttpRequest::decode(head).ok().and_then(|m| m.kind) {
                Some(http_request::Kind::Head(h)) => h.path,
                _ => String::new(),
            };
            let head = |status| HttpResponse {
                kind: Some(http_response::Kind::Head(ResponseHead {
                    status,
                    headers: Default::default(),
                })),
            };
            let messages: Vec<Vec<u8>> = match path.as_str() {
                "/garbage" => vec![vec![0xff, 0xff, 0xff]],
                "/body-first" => vec![
                    HttpResponse {
                        kind: Some(http_response::Kind::Data(bytes::Bytes::from_static(b"x"))),
                    }
                    .encode_to_vec(),
                ],
                "/switch" => vec![head(101).encode_to_vec()],
                "/many-headers" | "/many-values" => {
                    let mut h = head(200);
                    if let Some(http_response::Kind::Head(head)) = &mut h.kind {
                        let values = |values| kas_proto::frame::Values { values };
                        head.headers = if path == "/many-headers" {
                            (0..30_000)
                                .map(|i| (format!("x-h{i}"), values(vec!["v".into()])))
                                .collect()
                        } else {
                            [("x-h".into(), values(vec!["v".into(); 30_000]))].into()
                        };
                    }
                    vec![h.encode_to_vec()]
                }
                _ => vec![head(200).encode_to_vec()],
            };
            futures::stream::iter(messages.into_iter().map(|m| Ok(m.into())))
        };
        futures::StreamExt::boxed(futures::StreamExt::flatten(futures::stream::once(answer)))
    });
    let _agent = TestAgent::connect_with(kas.agent, 1, "hostile", 2, modules).await;
    let url = format!(
        "http://{}",
        kas.kubernetes_api.expect("a Kubernetes API listener")
    );
    let client = http_client();
    let get = |path: &str| {
        let r = client
            .get(format!("{url}{path}"))
            .bearer_auth("pat:1:hostile-user-token-01")
            .send();
        async move {
            let r = r.await.expect("kas answers");
            (r.status().as_u16(), r.text().await.unwrap_or_default())
        }
    };
    support::eventually(Duration::from_secs(20), "the agent to answer", || async {
        (get("/ok").await.0 == 200).then_some(())
    })
    .await;
    for (path, says) in [
        ("/garbage", "agent 1 sent a malformed HTTP response"),
        (
            "/body-first",
            "agent 1 answered without an HTTP response head",
        ),
        ("/switch", "agent 1 answered with HTTP status 101"),
        (
            "/many-headers",
            "30000 header values; at most 256 are relayed",
        ),
        (
            "/many-values",
            "30000 header values; at most 256 are relayed",
        ),
    ] {
        let (code, body) = get(path).await;
        assert_eq!(code, 502, "{path}: {body}");
        assert!(body.contains(says), "{path}: {body}");
    }
    assert_eq!(get("/ok").await.0, 200, "kas goes on serving");
}

/// Requests that ended normally are counted delivered, through a remote kas too, not
/// cancelled: a caller that read its whole answer did not go away. (Counted cancelled, their
/// forwards were aborted mid-stream, resetting HTTP/2 streams between the kas until the
/// serving kas's reset-flood guard closed the connection: a 429 for every call on it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_that_end_normally_are_delivered_not_cancelled() {
    let (d, _dir) = deployment().await;
    let url = d.kubernetes_api_url(0).expect("a Kubernetes API listener");
    let client = https_client(&d);
    // Agent 2 is on kas1 and kas2: kas0 forwards every one.
    const N: usize = 20;
    for _ in 0..N {
        let resp = client
            .get(format!("{url}/api/v1/pods"))
            .bearer_auth(d.user_bearer(2))
            .send()
            .await
            .expect("kas answers");
        assert_eq!(resp.status().as_u16(), 200);
        resp.bytes().await.expect("the whole answer");
    }
    let routed = |outcome: &str| -> f64 {
        d.kas()[0]
            .health()
            .metrics_text()
            .lines()
            .filter(|l| l.starts_with(&format!("kas_routed_requests_total{{outcome=\"{outcome}\"")))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let counted = support::eventually(Duration::from_secs(10), "every request counted", || async {
        let counted = routed("delivered") + routed("cancelled");
        (counted >= N as f64).then_some(counted)
    })
    .await;
    let metrics = d.kas()[0].health().metrics_text();
    let lines: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("kas_routed"))
        .collect();
    assert_eq!(routed("cancelled"), 0.0, "{counted} counted: {lines:?}");
    d.stop().await;
}

/// The lines of kas `i`'s audit log in the deployment's directory, each JSON.
fn audit_lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("a broken line {l:?}: {e}")))
        .collect()
}

/// Waits (10 s at most) for a line of the audit log at `path` that `wanted` picks: kas
/// writes a request's line once the request is over.
async fn audit_line(path: &Path, wanted: impl Fn(&Value) -> bool) -> Value {
    support::eventually(Duration::from_secs(10), "the audit line", || async {
        audit_lines(path).into_iter().find(|l| wanted(l))
    })
    .await
}

/// The kas a request reached writes its audit line: `kubectl exec` through a remote kas
/// names the routing and the serving kas, the agent's replica, the caller and the verb; a
/// request for an agent that never connects names its refusal under the correlation id
/// its caller sees.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_kas_a_request_reached_audits_it_with_its_route_and_caller() {
    let (d, dir) = deployment().await;
    let cache = dir.path();
    let args = ["exec", "-n", "default", "web-1", "--", "echo", "audited"];
    assert_eq!(ok(&d, cache, "agent1-kas2", &args).await, "audited\n");
    let kas = |i: usize| Value::from(d.kas()[i].addresses.private_api.to_string());
    let log = |i: usize| kas_tools::local::audit_log(dir.path(), i);
    let exec = audit_line(&log(2), |l| l["verb"] == "exec").await;
    assert_eq!(exec["routing_kas"], kas(2), "{exec}");
    assert_eq!(exec["serving_kas"], kas(0), "{exec}");
    assert!(exec["agent_connection_id"].as_i64().is_some(), "{exec}");
    assert_eq!(exec["agent_id"], 1, "{exec}");
    assert_eq!(exec["caller"]["kind"], "pat", "{exec}");
    assert_eq!(exec["caller"]["username"], "local", "{exec}");
    assert_eq!(exec["status"], 101, "{exec}");
    assert!(exec["response_bytes"].as_u64() > Some(0), "{exec}");
    assert_eq!(exec["correlation_id"].as_str().map(str::len), Some(26));
    assert!(
        exec["path"]
            .as_str()
            .is_some_and(|p| p.starts_with("/api/v1/namespaces/default/pods/web-1/exec?")),
        "{exec}"
    );
    assert!(
        exec["refusal"].is_null() && exec["error"].is_null(),
        "{exec}"
    );
    // kas0, which served it, wrote no line of it.
    assert!(!audit_lines(&log(0)).iter().any(|l| l["verb"] == "exec"));

    let url = d.kubernetes_api_url(1).expect("a Kubernetes API listener");
    let secret = d.user_bearer(1).rsplit(':').next().unwrap().to_string();
    let resp = https_client(&d)
        .get(format!("{url}/api/v1/pods?timeout=1s"))
        .bearer_auth(format!("pat:3:{secret}"))
        .send()
        .await
        .expect("kas answers");
    assert_eq!(resp.status().as_u16(), 503);
    let id = resp.headers()["x-gitlab-correlation-id"].clone();
    let id = id.to_str().unwrap();
    let refused = audit_line(&log(1), |l| l["correlation_id"] == id).await;
    assert_eq!(refused["status"], 503, "{refused}");
    assert_eq!(refused["verb"], "list", "{refused}");
    assert!(refused["serving_kas"].is_null(), "{refused}");
    assert!(
        refused["refusal"]
            .as_str()
            .is_some_and(|r| r.contains("agent 3 is not connected")),
        "{refused}"
    );
    let all = std::fs::read_to_string(log(1)).unwrap() + &std::fs::read_to_string(log(2)).unwrap();
    assert!(!all.contains(&secret), "a caller's token in the audit log");
    d.stop().await;
}

/// A small tmpfs mounted for the test, unmounted when dropped.
struct SmallDisk(std::path::PathBuf);

impl SmallDisk {
    fn mount(at: &Path) -> SmallDisk {
        std::fs::create_dir_all(at).unwrap();
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=256k", "tmpfs"])
            .arg(at)
            .output()
            .expect("mount runs");
        assert!(
            out.status.success(),
            "mounting a 256 KiB tmpfs (the test needs root): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        SmallDisk(at.to_path_buf())
    }

    /// Fills the disk to its last byte with `filler`.
    fn fill(&self) -> std::path::PathBuf {
        use std::io::Write;
        let filler = self.0.join("filler");
        let mut f = std::fs::File::create(&filler).unwrap();
        let block = [0u8; 4096];
        while f.write_all(&block).is_ok() {}
        let byte = [0u8; 1];
        while f.write_all(&byte).is_ok() {}
        filler
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// A full disk under the audit log: the record that could not be written waits, kas
/// answers new requests 503 naming `agent.kubernetes_api.audit` (counted), and once there
/// is room again it writes every waiting record, whole, and takes requests again by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_disk_under_the_audit_log_refuses_requests_until_there_is_room() {
    let secrets = support::Secrets::new();
    let dir = tempfile::tempdir().unwrap();
    let disk = SmallDisk::mount(&dir.path().join("disk"));
    let path = disk.0.join("audit.jsonl");
    let lines = format!("    audit:\n      path: {}\n", path.display());
    let kas =
        support::KasProc::with_kubernetes_api(&secrets, &["audit-user-token-01"], "", &lines).await;
    let url = format!(
        "http://{}/api/v1/pods",
        kas.kubernetes_api.expect("a Kubernetes API listener")
    );
    // No token: refused at once, and recorded.
    let get = || async { http_client().get(&url).send().await.expect("kas answers") };
    let mut answered = 0;
    assert_eq!(get().await.status(), 401);
    answered += 1;
    audit_line(&path, |l| l["status"] == 401).await;

    let filler = disk.fill();
    // The records of the requests that reach kas before its write fails wait; then 503.
    let until = std::time::Instant::now() + Duration::from_secs(10);
    let refused = loop {
        let resp = get().await;
        if resp.status() != 401 {
            break resp;
        }
        answered += 1;
        assert!(std::time::Instant::now() < until, "no 503 within 10 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(refused.status(), 503);
    let status: Value = refused.json().await.expect("a Status");
    let message = status["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("agent.kubernetes_api.audit") && message.contains("No space left"),
        "{status}"
    );
    eprintln!("refused while the disk is full: {message}");
    kas.await_metric("kas_audit_unwritable 1").await;
    assert!(kas.log_text().contains("the audit log cannot be written"));

    std::fs::remove_file(filler).unwrap();
    support::eventually(Duration::from_secs(10), "requests taken again", || async {
        (get().await.status() == 401).then_some(())
    })
    .await;
    answered += 1;
    kas.await_metric("kas_audit_unwritable 0").await;
    let metrics = kas.metrics().await;
    assert!(
        !metrics.contains("kas_audit_refusals_total 0"),
        "refusals counted: {metrics}"
    );
    // Every request answered has its line, whole: none lost to the full disk.
    support::eventually(Duration::from_secs(10), "every record", || async {
        (audit_lines(&path).len() == answered).then_some(())
    })
    .await;
    drop(disk);
}
