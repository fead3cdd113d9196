use super::*;
use crate::kas::call::Delivery;
use kas_core::ConnectionId;
use std::path::Path;

fn config(path: &Path, max_size: u64, max_files: usize) -> Audit {
    Audit {
        path: path.to_path_buf(),
        max_size,
        max_files,
    }
}

fn entry(log: &AuditLog, path: &str) -> Entry {
    let uri: http::Uri = path.parse().expect("a URI");
    let id = CorrelationId::from_caller(Some("test-1"));
    log.entry(&KasId("kas0".into()), &id, None, &http::Method::GET, &uri)
}

fn lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("each line is JSON"))
        .collect()
}

/// Waits (bounded) for `done`: the writer is a task of its own.
async fn wait_for(what: &str, done: impl Fn() -> bool) {
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(std::time::Instant::now() < until, "{what}: not within 10 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_request_is_recorded_with_its_caller_route_and_outcome() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("audit.jsonl");
    let log = AuditLog::open(&config(&path, 1 << 20, 2), Metrics::default()).expect("opens");
    let mut e = entry(
        &log,
        "/k8s/api/v1/namespaces/default/pods/web/log?follow=true",
    );
    e.path("/api/v1/namespaces/default/pods/web/log?follow=true");
    let credential = Credential::parse(Some("Bearer pat:7:secret-token-value")).expect("parses");
    e.presented(&credential);
    let caller = Caller {
        username: "alice".into(),
        job_id: None,
        project_id: None,
    };
    let impersonation = Impersonation {
        user: "gitlab:user:alice".into(),
        groups: vec!["gitlab:user".into()],
        extra: Default::default(),
    };
    e.granted(&caller, Some(&impersonation));
    let delivered = e.delivered_to();
    delivered.set(Delivery {
        kas: Some(KasId("kas2".into())),
        connection: Some(ConnectionId(42)),
    });
    e.request_counter()
        .expect("counted when on")
        .fetch_add(5, Ordering::Relaxed);
    e.answered(200);
    e.responded(100);
    e.responded(23);
    // A refused one: the path outside the prefix, no caller.
    let mut refused = entry(&log, "/elsewhere");
    refused.refused(
        404,
        "/elsewhere is not under the Kubernetes API prefix /k8s/",
    );
    drop((e, refused));
    log.clone().close().await;
    let got = lines(&path);
    assert_eq!(got.len(), 2, "{got:?}");
    let l = &got[0];
    assert_eq!(l["correlation_id"], "test-1");
    assert_eq!(l["verb"], "logs");
    assert_eq!(l["method"], "GET");
    assert_eq!(
        l["path"],
        "/api/v1/namespaces/default/pods/web/log?follow=true"
    );
    assert_eq!(l["caller"]["kind"], "pat");
    assert_eq!(l["caller"]["username"], "alice");
    assert_eq!(l["agent_id"], 7);
    assert_eq!(l["routing_kas"], "kas0");
    assert_eq!(l["serving_kas"], "kas2");
    assert_eq!(l["agent_connection_id"], 42);
    assert_eq!(l["impersonated"]["user"], "gitlab:user:alice");
    assert_eq!(l["status"], 200);
    assert_eq!(l["request_bytes"], 5);
    assert_eq!(l["response_bytes"], 123);
    assert!(l["refusal"].is_null());
    assert!(
        !std::fs::read_to_string(&path)
            .expect("read")
            .contains("secret-token-value"),
        "the token is never written"
    );
    let r = &got[1];
    assert_eq!(r["status"], 404);
    assert!(r["caller"].is_null() && r["agent_id"].is_null());
    assert!(
        r["refusal"]
            .as_str()
            .expect("a reason")
            .contains("not under")
    );
}

#[tokio::test]
async fn a_stopping_log_writes_the_records_of_requests_still_open_when_they_end() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("audit.jsonl");
    let log = AuditLog::open(&config(&path, 1 << 20, 2), Metrics::default()).expect("opens");
    let open = entry(&log, "/api/v1/namespaces/default/pods/web/exec");
    let closing = tokio::spawn(log.clone().close());
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!closing.is_finished(), "the log waits for the open request");
    drop(open);
    closing.await.expect("closes");
    assert_eq!(
        lines(&path).len(),
        1,
        "the record written as the request ended"
    );
}

#[tokio::test]
async fn the_file_is_rotated_by_size_keeping_max_files() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("audit.jsonl");
    let log = AuditLog::open(&config(&path, 2048, 2), Metrics::default()).expect("opens");
    for i in 0..60 {
        drop(entry(&log, &format!("/api/v1/namespaces/n{i}/pods")));
    }
    log.clone().close().await;
    let rotated = |n: usize| dir.path().join(format!("audit.jsonl.{n}"));
    assert!(rotated(1).exists() && rotated(2).exists());
    assert!(
        !rotated(3).exists(),
        "only max_files rotated files are kept"
    );
    for p in [path.clone(), rotated(1), rotated(2)] {
        let size = std::fs::metadata(&p).expect("exists").len();
        assert!(size <= 2048, "{} is {size} bytes", p.display());
    }
    // The newest records are the current file's, the lines whole in each file.
    let current = lines(&path);
    let last = current.last().expect("records");
    assert_eq!(last["path"], "/api/v1/namespaces/n59/pods");
    let older = lines(&rotated(1));
    assert!(!older.is_empty());
}

#[test]
fn one_write_of_many_lines_is_split_between_rotated_files() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("audit.jsonl");
    let mut sink = Sink::open(&config(&path, 1000, 3)).expect("opens");
    let lines: String = (0..80).map(|i| format!("{{\"n\":{i:>60}}}\n")).collect();
    sink.write(lines.as_bytes()).expect("written");
    let mut read = Vec::new();
    for p in [
        "audit.jsonl.3",
        "audit.jsonl.2",
        "audit.jsonl.1",
        "audit.jsonl",
    ] {
        let text = std::fs::read_to_string(dir.path().join(p)).expect("kept");
        assert!(text.len() <= 1000, "{p}: {} bytes", text.len());
        read.extend(text.lines().map(str::to_string));
    }
    assert!(!dir.path().join("audit.jsonl.4").exists());
    // The newest 4 files' lines, in order, none cut.
    let want: Vec<String> = lines.lines().map(str::to_string).collect();
    assert_eq!(read, want[want.len() - read.len()..]);
}

#[tokio::test]
async fn a_log_that_cannot_be_written_refuses_until_it_can() {
    // /dev/full takes every open and fails every write (ENOSPC).
    let metrics = Metrics::default();
    let log = AuditLog::open(&config(Path::new("/dev/full"), 1 << 20, 1), metrics.clone())
        .expect("opens");
    assert!(log.failing().is_none());
    drop(entry(&log, "/api/v1/pods"));
    wait_for("the write fails", || log.failing().is_some()).await;
    let why = log.failing().expect("failing");
    assert!(why.contains("/dev/full"), "{why}");
    assert_eq!(metrics.audit_unwritable.get(), 1);
    assert!(metrics.audit_write_errors.get() >= 1);
    // The record waits, tried again each second.
    wait_for("a retry", || metrics.audit_write_errors.get() >= 2).await;
    assert_eq!(lock(&log.shared.state).queue.len(), 1);
}

#[test]
fn a_long_path_is_cut_at_a_character_boundary() {
    let long = format!("/api/v1/{}", "é".repeat(MAX_PATH));
    let cut = cut(&long);
    assert!(cut.ends_with("...(cut)"));
    assert!(cut.len() <= MAX_PATH + "...(cut)".len());
}
