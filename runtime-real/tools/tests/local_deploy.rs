//! The local deployment, brought up by the code `kas-local` (the README's first command)
//! runs, driven with the `kasctl` binary.

use kas_tools::local::{LocalDeployment, fixture_log, fixture_pods, redis_server};
use serde_json::Value;
use std::path::Path;

/// Runs kasctl; returns (success, stdout, stderr).
async fn kasctl(secret: &Path, kas: &str, args: &[&str]) -> (bool, String, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_kasctl"))
        .arg("--secret-file")
        .arg(secret)
        .args(["--kas", kas])
        .args(args)
        .output()
        .await
        .expect("kasctl runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

async fn kasctl_json(secret: &Path, kas: &str, args: &[&str]) -> Vec<Value> {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let (ok, out, err) = kasctl(secret, kas, &all).await;
    assert!(ok, "kasctl {args:?} via {kas} failed: {err}");
    match serde_json::from_str(&out) {
        Ok(Value::Array(rows)) => rows,
        other => panic!("kasctl {args:?}: not a JSON array: {other:?} from {out:?}"),
    }
}

fn field(row: &Value, key: &str) -> String {
    row[key].as_str().unwrap_or_default().to_string()
}

/// `kasctl pods` for both agents through every kas gives that agent's fixture pods (with
/// `--ca-cert-file` when the deployment runs over TLS).
async fn every_kas_routes_to_every_agent(d: &LocalDeployment) {
    let secret = d.gitlab_secret_file();
    let ca = d.ca_file().map(|p| p.display().to_string());
    for i in 0..d.kas().len() {
        let api = d.api_url(i);
        for agent in [1, 2] {
            let agent = agent.to_string();
            let mut args = match &ca {
                Some(ca) => vec!["--ca-cert-file", ca],
                None => vec![],
            };
            args.extend(["pods", "--agent", &agent]);
            let rows = kasctl_json(&secret, &api, &args).await;
            let names: Vec<String> = rows.iter().map(|r| field(r, "name")).collect();
            let expected = fixture_pods(agent.parse().unwrap());
            assert_eq!(names, expected, "agent {agent} via kas{i}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn local_deployment_with_redis_routes_through_each_kas() {
    assert!(
        redis_server::installed(),
        "redis-server must be installed (scripts/test installs it)"
    );
    let dir = tempfile::tempdir().unwrap();
    let d = LocalDeployment::start(dir.path(), true, false)
        .await
        .expect("deployment starts");
    assert_eq!(d.kas().len(), 3);
    let secret = d.gitlab_secret_file();
    every_kas_routes_to_every_agent(&d).await;

    // A pod's log, streamed through a kas other than the one holding the agent.
    let api2 = d.kas()[2].addresses.api.to_string();
    let args = ["logs", "--agent", "1", "-n", "default", "web-1"];
    let (ok, log, err) = kasctl(&secret, &api2, &args).await;
    assert!(ok, "{err}");
    assert_eq!(log, fixture_log("web-1"));
    let args = ["logs", "--agent", "1", "-n", "default", "web-9"];
    let (ok, _, err) = kasctl(&secret, &api2, &args).await;
    assert!(
        !ok && err.contains("NotFound") && err.contains("web-9"),
        "{err}"
    );

    // Both replicas of agent 2 are listed with their pod names, each on its own kas.
    let api0 = d.kas()[0].addresses.api.to_string();
    let (ok, table, err) = kasctl(&secret, &api0, &["agents", "--agent", "2"]).await;
    assert!(ok, "{err}");
    assert!(table.starts_with("AGENT  PROJECT  CONNECTION"), "{table}");
    for pod in ["gitlab-agent/agent2-aaaa", "gitlab-agent/agent2-bbbb"] {
        assert!(table.contains(pod), "{pod} missing from:\n{table}");
    }
    let rows = kasctl_json(&secret, &api0, &["agents", "--project", "100"]).await;
    // Each with its agentk's version and architecture and its cluster's version (the
    // stand-in API server's), and no warning: agentk and kas are of one build.
    for r in &rows {
        let described = (
            field(r, "version"),
            field(r, "arch"),
            field(r, "kubernetes"),
            r["warnings"].clone(),
        );
        let expected = (
            env!("CARGO_PKG_VERSION").to_string(),
            kas_agent::meta::architecture().to_string(),
            "v1.32.0-kas-local".to_string(),
            serde_json::json!([]),
        );
        assert_eq!(described, expected, "{r}");
    }
    let mut listed: Vec<(String, String, String)> = rows
        .iter()
        .map(|r| (field(r, "agent"), field(r, "pod"), field(r, "kas")))
        .collect();
    listed.sort();
    let expected: Vec<(String, String, String)> = d
        .replicas()
        .iter()
        .map(|r| {
            (
                r.agent.to_string(),
                format!("gitlab-agent/{}", r.pod),
                d.kas()[r.kas].addresses.private_api.to_string(),
            )
        })
        .collect();
    assert_eq!(listed, expected);

    // Each replica of agent 2, by its connection id, through a kas holding neither.
    for r in rows.iter().filter(|r| field(r, "agent") == "2") {
        let connection = field(r, "connection");
        let pods = kasctl_json(
            &secret,
            &api0,
            &["pods", "--agent", "2", "--connection", &connection],
        )
        .await;
        assert_eq!(pods.len(), 1, "replica {connection}");
        assert_eq!(field(&pods[0], "name"), "cart-1");
    }

    // One namespace only: the filter reaches the agent's Pods module.
    let rows = kasctl_json(
        &secret,
        &api0,
        &["pods", "--agent", "1", "-n", "kube-system"],
    )
    .await;
    let names: Vec<String> = rows.iter().map(|r| field(r, "name")).collect();
    assert_eq!(names, ["coredns-1"]);

    // What goes wrong is said plainly.
    let (ok, _, err) = kasctl(&secret, &api0, &["--timeout", "1s", "pods", "--agent", "9"]).await;
    assert!(!ok);
    assert!(
        err.contains("agent 9 is not connected (no agent connected within the deadline)"),
        "{err}"
    );
    // kasctl's own id for the call, which kas ended its error with: once, a ULID.
    let id = err
        .split("(correlation id ")
        .nth(1)
        .and_then(|rest| rest.split(')').next())
        .unwrap_or_else(|| panic!("no correlation id in: {err}"));
    assert_eq!((id.len(), err.matches(id).count()), (26, 1), "{err}");
    let wrong = dir.path().join("wrong.secret");
    std::fs::write(&wrong, "V3JvbmdXcm9uZ1dyb25nV3JvbmdXcm9uZ1dyb25nV3Jvbmc=").unwrap();
    let (ok, _, err) = kasctl(&wrong, &api0, &["agents", "--agent", "1"]).await;
    assert!(!ok);
    assert!(err.contains("kas refused the token"), "{err}");
    assert_eq!(
        err.matches("(correlation id ").count(),
        1,
        "kas's id, once: {err}"
    );
    let nobody = format!("127.0.0.1:{}", redis_server::free_port().unwrap());
    let (ok, _, err) = kasctl(&secret, &nobody, &["agents", "--agent", "1"]).await;
    assert!(!ok);
    assert!(
        err.contains(&format!("cannot reach kas at {nobody}")),
        "{err}"
    );
    assert!(err.contains("Connection refused"), "{err}");

    let stopped = d.stop().await;
    assert_eq!(
        stopped.redis_keys_left,
        Some(vec![]),
        "every record deleted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn local_deployment_without_redis_is_one_kas_in_memory() {
    let dir = tempfile::tempdir().unwrap();
    let d = LocalDeployment::start(dir.path(), false, false)
        .await
        .expect("deployment starts");
    assert_eq!(d.kas().len(), 1);
    every_kas_routes_to_every_agent(&d).await;
    let api = d.kas()[0].addresses.api.to_string();
    let rows = kasctl_json(&d.gitlab_secret_file(), &api, &["agents", "--agent", "2"]).await;
    assert_eq!(rows.len(), 2, "both replicas of agent 2: {rows:?}");
    let description = d.describe("kasctl");
    assert!(description.contains("in-memory registry"), "{description}");
    assert!(description.contains("kasctl --kas"), "{description}");
    assert_eq!(d.stop().await.redis_keys_left, None);
}

/// `kas-local --tls`: every listener and connection over TLS with a throwaway CA; kasctl
/// reaches both agents through every kas with the printed `--ca-cert-file`, and refuses
/// kas's certificate without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn local_deployment_over_tls_routes_with_the_printed_ca() {
    let dir = tempfile::tempdir().unwrap();
    let d = LocalDeployment::start(dir.path(), true, true)
        .await
        .expect("deployment starts");
    let ca = d.ca_file().expect("a CA").display().to_string();
    every_kas_routes_to_every_agent(&d).await;
    let description = d.describe("kasctl");
    assert!(
        description.contains(&format!(
            "kasctl --kas {} --ca-cert-file {ca} ",
            d.api_url(0)
        )) && description.contains("agentk --kas grpcs://"),
        "{description}"
    );
    let (ok, _, err) = kasctl(
        &d.gitlab_secret_file(),
        &d.api_url(1),
        &["agents", "--agent", "1"],
    )
    .await;
    assert!(!ok && err.contains("does not verify"), "{err}");
    assert_eq!(d.stop().await.redis_keys_left, Some(vec![]));
}
