//! Traces across hops, exported to a real OTLP receiver: a Python server that decodes each
//! export with OpenTelemetry's own protobuf definitions (`opentelemetry-proto` from PyPI,
//! installed when missing). This test binary installs the exporter for its process, as
//! `kas-local --otlp-endpoint` does, so the local deployment's three kas and its agents all
//! export through it; each span's instrumentation scope names its component. GitLab's
//! calls continue the trace their `traceparent` names.

mod support;

use kas_tools::local::LocalDeployment;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::AsyncBufReadExt;

/// The receiver, killed when dropped (its child process with it).
struct Receiver {
    _child: tokio::process::Child,
    port: u16,
}

impl Receiver {
    async fn start(spans: &Path) -> Receiver {
        support::ensure_python_module(
            "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
            "opentelemetry-proto",
        );
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/otlp_receiver.py");
        let mut child = tokio::process::Command::new("python3")
            .arg(script)
            .arg(spans)
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 runs");
        let stdout = child.stdout.take().expect("piped");
        let line = tokio::time::timeout(
            Duration::from_secs(20),
            tokio::io::BufReader::new(stdout).lines().next_line(),
        )
        .await
        .expect("the receiver says its port within 20 s")
        .expect("read")
        .expect("a line");
        let port = line.trim().parse().expect("a port");
        Receiver {
            _child: child,
            port,
        }
    }
}

fn spans(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("the receiver writes JSON"))
        .collect()
}

/// The spans of one trace, by name; waits until every name in `names` is there.
async fn trace(path: &Path, trace_id: &str, names: &[&str]) -> BTreeMap<String, Value> {
    support::eventually(Duration::from_secs(20), "the trace's spans", || async {
        let got: BTreeMap<String, Value> = spans(path)
            .into_iter()
            .filter(|s| s["trace_id"] == trace_id)
            .map(|s| (s["name"].as_str().unwrap_or_default().to_string(), s))
            .collect();
        names.iter().all(|n| got.contains_key(*n)).then_some(got)
    })
    .await
}

/// The tree under `root`, one span a line with its offset and duration in milliseconds.
fn tree(spans: &BTreeMap<String, Value>, root: &str) -> String {
    let t0 = spans[root]["start_ns"].as_u64().unwrap_or_default();
    let mut out = String::new();
    let mut stack = vec![(root.to_string(), 0)];
    while let Some((name, depth)) = stack.pop() {
        let s = &spans[&name];
        let ms = |ns: u64| ns as f64 / 1e6;
        let start = s["start_ns"].as_u64().unwrap_or_default();
        let end = s["end_ns"].as_u64().unwrap_or_default();
        out += &format!(
            "{}{name} [{}] +{:.1} ms, {:.1} ms\n",
            "  ".repeat(depth),
            s["scope"].as_str().unwrap_or_default(),
            ms(start - t0),
            ms(end - start)
        );
        for (child, c) in spans {
            if c["parent_span_id"] == s["span_id"] {
                stack.push((child.clone(), depth + 1));
            }
        }
    }
    out
}

/// The first line of kas `i`'s audit log (in `dir`) that `wanted` takes, once written.
async fn audit_line(dir: &Path, i: usize, wanted: impl Fn(&Value) -> bool) -> Value {
    let audit = kas_tools::local::audit_log(dir, i);
    support::eventually(Duration::from_secs(10), "the audit line", || async {
        std::fs::read_to_string(&audit)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|l| wanted(l))
    })
    .await
}

/// Runs kubectl through kas2 (agent 1's replica is on kas0: the call is forwarded); it
/// must succeed.
async fn through_kas2(d: &LocalDeployment, cache: &Path, args: &[&str]) {
    let out = support::kubectl(&d.kubeconfig(), cache, "agent1-kas2", args)
        .output()
        .await
        .expect("kubectl runs");
    assert!(
        out.status.success(),
        "kubectl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// GitLab's GetPods for agent 1 through kas2, with `traceparent`.
async fn gitlab_call(d: &LocalDeployment, traceparent: &str) {
    use kas_auth::jwt::{self, Secret, Signer};
    use kas_proto::public_api::GetPodsRequest;
    use kas_proto::public_api::kas_api_client::KasApiClient;
    let secret = std::fs::read_to_string(d.gitlab_secret_file()).expect("the secret");
    let secret = Secret::from_base64(secret.trim()).expect("a secret");
    let signer = Signer::new(&secret, jwt::GITLAB, jwt::GITLAB_KAS);
    let url = format!("http://{}", d.kas()[2].addresses.api);
    let channel = tonic::transport::Channel::from_shared(url)
        .expect("a URL")
        .connect()
        .await
        .expect("kas2's public API");
    let mut req = tonic::Request::new(GetPodsRequest {
        agent_id: 1,
        ..Default::default()
    });
    let metadata = req.metadata_mut();
    metadata.insert("authorization", signer.bearer().parse().expect("ascii"));
    metadata.insert("traceparent", traceparent.parse().expect("ascii"));
    KasApiClient::new(channel)
        .get_pods(req)
        .await
        .expect("GitLab's call is answered");
}

/// `kubectl exec` through a remote kas is one trace: the routing kas's request and routing
/// spans, its forward, the serving kas's span, agentk's call and its request to the API
/// server, each the child of the one before, from both kas and agentk; the routing kas's
/// audit line names the same trace. With the receiver gone, calls still succeed and the
/// spans lost are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_exec_through_a_remote_kas_is_one_trace_across_kas_and_agentk() {
    support::ensure_package("kubectl", "kubernetes-client");
    let dir = tempfile::tempdir().expect("temp dir");
    let spans_file = dir.path().join("spans.jsonl");
    let receiver = Receiver::start(&spans_file).await;
    let export = kas_transport::traces::Export {
        endpoint: format!("http://127.0.0.1:{}/v1/traces", receiver.port),
        token: Some("otlp-test-token".into()),
        ca_file: None,
        sampling_ratio: 1.0,
    };
    let installed = kas_transport::traces::install("kas-local", export).expect("installs");
    let d = LocalDeployment::start(dir.path(), true, false)
        .await
        .expect("the local deployment starts");
    let cache = dir.path();
    let args = ["exec", "-n", "default", "web-1", "--", "echo", "traced"];
    through_kas2(&d, cache, &args).await;

    let line = audit_line(dir.path(), 2, |l| l["verb"] == "exec").await;
    let trace_id = line["trace_id"].as_str().expect("a trace id").to_string();
    assert_eq!(trace_id.len(), 32, "{line}");
    let chain = [
        "kubernetes_api.request",
        "kas.route",
        "kas.forward",
        "kas.serve",
        "agentk.call",
        "kubernetes_api.upstream",
    ];
    let got = trace(
        &spans_file,
        &trace_id,
        &[&chain[..], &["kas.admission"]].concat(),
    )
    .await;
    eprintln!("{}", tree(&got, chain[0]));
    for pair in chain.windows(2) {
        assert_eq!(
            got[pair[1]]["parent_span_id"], got[pair[0]]["span_id"],
            "{} is a child of {}",
            pair[1], pair[0]
        );
    }
    assert_eq!(got[chain[0]]["parent_span_id"], "", "a new trace");
    let admission = &got["kas.admission"];
    assert_eq!(admission["parent_span_id"], got[chain[0]]["span_id"]);
    assert_eq!(admission["attributes"]["kas.admitted"], true);
    assert!(admission["end_ns"].as_u64() <= got["kas.route"]["start_ns"].as_u64());
    for (name, scope) in [("kas.serve", "kas"), ("agentk.call", "agentk")] {
        assert_eq!(got[name]["scope"], scope, "{name}");
    }
    let request = &got["kubernetes_api.request"];
    assert_eq!(request["attributes"]["http.response.status_code"], 101);
    assert_eq!(
        request["attributes"]["kas.correlation_id"],
        line["correlation_id"]
    );
    let kas0 = Value::from(d.kas()[0].addresses.private_api.to_string());
    assert_eq!(got["kas.forward"]["attributes"]["kas.peer"], kas0);
    assert_eq!(got["kas.serve"]["attributes"]["kas.id"], kas0);
    let events = |name: &str| got[name]["events"].as_array().cloned().unwrap_or_default();
    // One attempt, at kas0: found by a lookup, or known from the agent's subscription.
    let route = &got["kas.route"];
    assert_eq!(route["attributes"]["kas.attempts"], 1, "{route}");
    match got.get("kas.lookup") {
        Some(lookup) => {
            assert_eq!(lookup["parent_span_id"], route["span_id"]);
            assert_eq!(lookup["attributes"]["kas.found"], 1, "{lookup}");
        }
        None => assert!(
            events("kas.route").contains(&Value::from("found")),
            "{route}"
        ),
    }
    assert!(
        events("kas.route").contains(&Value::from("attempt")),
        "{route}"
    );
    // The routing ended when kas0 took the call, well before the session did.
    assert!(got["kas.route"]["end_ns"].as_u64() <= got["kas.forward"]["end_ns"].as_u64());
    for event in ["routed", "handed to a tunnel"] {
        assert!(
            events("kas.serve").contains(&Value::from(event)),
            "{:?}",
            got["kas.serve"]
        );
    }
    assert_eq!(
        got["kubernetes_api.upstream"]["attributes"]["http.response.status_code"],
        101
    );
    assert_eq!(request["private_token"], "otlp-test-token");
    // Each hop's span starts after the one it is a child of (clocks of one machine).
    for pair in chain.windows(2) {
        assert!(got[pair[1]]["start_ns"].as_u64() >= got[pair[0]]["start_ns"].as_u64());
    }

    // GitLab's call carrying its own trace context: kas's span continues that trace.
    let (gitlab_trace, gitlab_span) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    gitlab_call(&d, &format!("00-{gitlab_trace}-{gitlab_span}-01")).await;
    let got = trace(
        &spans_file,
        gitlab_trace,
        &[
            "kas.call",
            "kas.forward",
            "kas.serve",
            "agentk.call",
            "pods.list",
        ],
    )
    .await;
    assert_eq!(got["kas.call"]["parent_span_id"], gitlab_span);
    assert_eq!(
        got["agentk.call"]["parent_span_id"],
        got["kas.serve"]["span_id"]
    );
    // The Pods module's read, in agentk's call.
    assert_eq!(
        got["pods.list"]["parent_span_id"],
        got["agentk.call"]["span_id"]
    );
    assert_eq!(got["pods.list"]["scope"], "agentk");

    // Agent 3 never connects: the routing finds no kas, and the call waits for one to be
    // announced until kas gives up; the trace says so. (kubectl first asks for `/version`
    // and gives up on it after 5 s: its audit line is not the one read.)
    let token = d.user_bearer(3);
    let args = ["--token", &token, "get", "--raw", "/api/v1/pods"];
    let out = support::kubectl(&d.kubeconfig(), cache, "agent1-kas1", &args)
        .output()
        .await
        .expect("kubectl runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("agent 3 is not connected"), "{stderr}");
    let line = audit_line(dir.path(), 1, |l| l["agent_id"] == 3 && l["verb"] == "list").await;
    let trace_id = line["trace_id"].as_str().expect("a trace id");
    let names = ["kubernetes_api.request", "kas.route", "kas.wait"];
    let got = trace(&spans_file, trace_id, &names).await;
    eprintln!("{}", tree(&got, names[0]));
    let route = &got["kas.route"];
    let wait = &got["kas.wait"];
    assert_eq!(wait["parent_span_id"], route["span_id"]);
    assert_eq!(wait["attributes"]["kas.wait.reason"], "no_tunnel");
    assert!(wait["end_ns"].as_u64() <= route["end_ns"].as_u64());
    assert_eq!(route["status"], 2, "an error: {route}");
    // Looked up, or known from the subscription the `/version` request left.
    match got.get("kas.lookup") {
        Some(lookup) => {
            assert_eq!(lookup["parent_span_id"], route["span_id"]);
            assert_eq!(lookup["attributes"]["kas.found"], 0, "{lookup}");
        }
        None => {
            let events = route["events"].as_array().cloned().unwrap_or_default();
            assert!(events.contains(&Value::from("found")), "{route}");
        }
    }

    // The receiver gone: calls go on, the spans they made are counted as dropped.
    drop(receiver);
    for _ in 0..3 {
        through_kas2(&d, cache, &["get", "pods", "-A"]).await;
    }
    let metrics = format!("http://{}/metrics", d.kas()[2].addresses.observability);
    support::eventually(
        Duration::from_secs(20),
        "spans counted as dropped",
        || async {
            let text = reqwest::get(&metrics).await.ok()?.text().await.ok()?;
            let line = text
                .lines()
                .find(|l| l.starts_with("kas_traces_dropped_total "))?;
            let n: u64 = line.rsplit(' ').next()?.parse().ok()?;
            (n > 0).then_some(())
        },
    )
    .await;
    d.stop().await;
    installed.shutdown();
}
