//! `kas-bench` runs end to end (small sizes, debug build; the scale part on a Redis
//! Cluster) and writes every section of its JSON. Its numbers are not judged here: speed
//! is measured by running it in release.

use serde_json::Value;
use std::process::Command;

#[test]
fn kas_bench_runs_every_part_and_writes_its_json() {
    let json = std::env::temp_dir().join(format!("kas-bench-smoke-{}.json", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_kas-bench"))
        .args(["--agents", "100", "--agents-per-source", "40"])
        .args(["--point", "300ms", "--wakeups", "3"])
        .args([
            "--concurrency",
            "1,16,64",
            "--callers",
            "2",
            "--unary-agents",
            "5",
        ])
        .args(["--waiting", "20", "--waiting-window", "1s", "--ttl", "2s"])
        .args(["--log-mib", "2", "--log-reads", "1", "--tls"])
        .args(["--kube-mib", "2", "--watches", "20"])
        .args([
            "--rollout-agents",
            "6",
            "--rollout-rate",
            "20",
            "--rollout-streams",
            "2",
        ])
        .args([
            "--rollout-stream",
            "1s",
            "--rollout-rounds",
            "1",
            "--rollout-grace",
            "3s",
        ])
        .args(["--rehome-agents", "20", "--redis-cluster", "3"])
        // Every part, and the instructions part, which is not run by default.
        .args([
            "--parts",
            "unary,streaming,wakeup,scale,kube,rollout,rehome,traces,instructions",
        ])
        .args(["--instructions-calls", "20", "--instructions-top", "5"])
        .arg("--json")
        .arg(&json)
        .output()
        .expect("kas-bench runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    assert_eq!(v["unary"]["callers"], 2);
    assert_eq!(
        v["unary"]["peaks"].as_array().unwrap().len(),
        7,
        "a peak per path"
    );
    let unary = v["unary"]["points"].as_array().unwrap();
    assert_eq!(
        unary.len(),
        21,
        "7 paths (2 over TLS, 2 over 5 agents) x 3 concurrencies"
    );
    assert!(
        unary.iter().any(|r| r["path"] == "remote route, 5 agents"),
        "{unary:?}"
    );
    for row in unary {
        assert!(row["calls"].as_u64().unwrap() > 0, "{row}");
        assert_eq!(row["errors"], 0, "{row}");
        for cpu in ["kas_cpu_us_per_call", "bench_cpu_us_per_call"] {
            assert!(row[cpu].as_f64().is_some(), "{cpu} read from /proc: {row}");
        }
    }
    let streaming = v["streaming"].as_array().unwrap();
    let paths: Vec<&str> = streaming
        .iter()
        .map(|r| r["path"].as_str().unwrap())
        .collect();
    assert_eq!(
        paths,
        [
            "direct",
            "local route",
            "remote route",
            "local route, TLS",
            "remote route, TLS"
        ]
    );
    for row in streaming {
        // Each read is checked to deliver the whole log; a failed read fails the bench.
        assert_eq!(row["bytes"], 2 << 20, "{row}");
        assert_eq!(row["reads"], 1, "{row}");
    }
    for row in v["wakeup"].as_array().unwrap() {
        assert_eq!(row["failed"], 0, "{row}");
        assert!(row["samples"].as_u64().unwrap() >= 1, "{row}");
    }
    assert_eq!(v["waiting_calls"].as_array().unwrap().len(), 2);
    assert_eq!(v["idle"]["agents"], 100);
    assert_eq!(v["idle"]["source_addresses"], 3, "127.0.0.1 to 127.0.0.3");
    assert_eq!(v["idle_tls"]["source_addresses"], 3);
    assert!(
        v["idle"]["routable_s"].as_f64().unwrap() >= v["idle"]["connected_s"].as_f64().unwrap()
    );
    assert!(v["idle"]["rss_bytes"]["tunnels"].as_u64().unwrap() > 0);
    assert!(v["idle_tls"]["rss_bytes"]["tunnels"].as_u64().unwrap() > 0);
    assert!(v["redis_steady"]["sent"].as_u64().unwrap() > 0);
    // Counted on every node of the cluster the scale part ran on: the writes inside the
    // scripts too.
    assert_eq!(v["redis_steady"]["redis"], "a Redis Cluster of 3 masters");
    assert!(v["redis_steady"]["by_command"]["hset"].as_u64().unwrap() > 0);
    assert!(stdout.contains("## Unary calls"), "{stdout}");
    assert!(stdout.contains("## Streaming"), "{stdout}");
    let kube = &v["kubernetes_api"];
    let paths = |part: &str| -> Vec<String> {
        kube[part]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["path"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(paths("stream"), ["direct", "local route", "remote route"]);
    assert_eq!(paths("get_pods").len(), 6, "3 paths x 2 concurrencies");
    for row in kube["stream"].as_array().unwrap() {
        // Each read is checked to deliver every byte; a short one fails the bench.
        assert_eq!(row["bytes"], 2 << 20, "{row}");
    }
    assert_eq!(kube["watch_memory"]["watches"], 20);
    let rollout = &v["rollout"];
    let phases = rollout["phases"].as_array().unwrap();
    assert_eq!(phases.len(), 2, "{rollout}");
    assert!(phases[0]["calls"].as_u64().unwrap() > 0, "{rollout}");
    assert_eq!(
        rollout["stops_ms"].as_array().unwrap().len(),
        3,
        "{rollout}"
    );
    let rehome = &v["rehome"];
    // Each share of the lost connections was replaced, the last one last.
    let replaced: Vec<f64> = rehome["replaced_ms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["ms"].as_f64().unwrap())
        .collect();
    assert_eq!(replaced.len(), 4, "{rehome}");
    assert!(replaced.is_sorted(), "{rehome}");
    assert!(
        rehome["lost_connections"].as_f64().unwrap() > 0.0,
        "{rehome}"
    );
    assert_eq!(rehome["windows"].as_array().unwrap().len(), 3, "{rehome}");
    assert!(stdout.contains("## Rollout"), "{stdout}");
    assert!(stdout.contains("## Re-homing"), "{stdout}");
    assert!(stdout.contains("## Kubernetes API"), "{stdout}");
    // Traces: off, a live receiver that took exports, and one down whose spans were lost.
    let traces = v["traces"]["points"].as_array().unwrap();
    let modes: Vec<&str> = traces
        .iter()
        .map(|r| r["traces"].as_str().unwrap())
        .collect();
    assert_eq!(modes, ["off", "on, live receiver", "on, receiver down"]);
    for row in traces {
        assert!(row["calls"].as_u64().unwrap() > 0, "{row}");
        assert_eq!(row["errors"], 0, "{row}");
    }
    assert!(
        traces[1]["exports_received"].as_u64().unwrap() > 0,
        "{traces:?}"
    );
    assert!(
        traces[2]["spans_dropped"].as_u64().unwrap() > 0,
        "{traces:?}"
    );
    assert!(stdout.contains("## Traces"), "{stdout}");
    // Instructions: both calls on both routes at both points, counted, without errors;
    // the remote route costs both kas; each profile lists its functions.
    let points = v["instructions"]["points"].as_array().unwrap();
    let shape: Vec<(&str, &str)> = points
        .iter()
        .map(|p| (p["call"].as_str().unwrap(), p["route"].as_str().unwrap()))
        .collect();
    let kube = "GET /api/v1/pods";
    let want: Vec<(&str, &str)> = ["GetPods", kube]
        .into_iter()
        .flat_map(|call| {
            [
                (call, "local"),
                (call, "local"),
                (call, "remote"),
                (call, "remote"),
            ]
        })
        .collect();
    assert_eq!(shape, want, "{points:?}");
    for p in points {
        assert_eq!(p["errors"], 0, "{p}");
        assert!(p["instructions_per_call"].as_f64().unwrap() > 0.0, "{p}");
        let routing = p["routing_kas_instructions_per_call"].as_f64();
        assert_eq!(
            routing.is_some_and(|n| n > 0.0),
            p["route"] == "remote",
            "{p}"
        );
    }
    let profiles = v["instructions"]["profiles"].as_array().unwrap();
    assert_eq!(
        profiles.len(),
        6,
        "each call's local serving, remote serving and routing kas"
    );
    for p in profiles {
        for by in ["inclusive", "own"] {
            assert_eq!(p[by].as_array().unwrap().len(), 5, "{p}");
        }
    }
    // The watches' memory came from a pair of kas of its own, all the watches open.
    assert_eq!(v["kubernetes_api"]["watch_memory"]["watches"], 20);
}
