//! Three kas processes sharing one redis-server, agents on different kas.

mod support;

use kas_tools::local::kas_process::http_get;
use std::time::{Duration, Instant};
use support::*;

const TTL_MS: u64 = 2000;

struct Cluster {
    redis: Redis,
    secrets: Secrets,
    kas: Vec<KasProc>,
}

async fn cluster(extra_redis: &[&str]) -> Cluster {
    let redis = Redis::start().expect("redis-server starts (scripts/test installs it)");
    let secrets = Secrets::new();
    let mut kas = Vec::new();
    for (i, extra) in extra_redis.iter().enumerate() {
        kas.push(KasProc::start(&secrets, &format!("kas{i}"), Some(&redis), TTL_MS, extra).await);
    }
    Cluster {
        redis,
        secrets,
        kas,
    }
}

impl Cluster {
    async fn gitlab(&self, i: usize) -> GitLab {
        GitLab::new(&self.secrets, self.kas[i].api).await
    }

    /// Waits until `agent` has `n` live connections in the registry.
    async fn await_connections(&self, agent: i64, n: usize) -> Vec<(i64, String)> {
        let gl = self.gitlab(0).await;
        let gl = &gl;
        eventually(
            Duration::from_secs(10),
            "agent connections",
            || async move { gl.connections(agent).await.ok().filter(|c| c.len() == n) },
        )
        .await
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn calls_through_every_kas_reach_the_right_agent_and_replica() {
    let c = cluster(&["", "", ""]).await;
    let _a1 = TestAgent::connect(c.kas[0].agent, 1, "agent1-pod", 2).await;
    let a2x = TestAgent::connect(c.kas[1].agent, 2, "agent2-pod-x", 2).await;
    let a2y = TestAgent::connect(c.kas[2].agent, 2, "agent2-pod-y", 2).await;
    c.await_connections(1, 1).await;
    let replicas = c.await_connections(2, 2).await;
    let mut names: Vec<&str> = replicas.iter().map(|(_, p)| p.as_str()).collect();
    names.sort();
    assert_eq!(names, ["agent2-pod-x", "agent2-pod-y"]);

    for i in 0..3 {
        let gl = c.gitlab(i).await;
        let t = Duration::from_secs(5);
        assert_eq!(
            gl.pods(1, None, t).await.unwrap(),
            ["agent1-pod"],
            "agent 1 via kas{i}"
        );
        let any = gl.pods(2, None, t).await.unwrap();
        assert!(
            any == ["agent2-pod-x"] || any == ["agent2-pod-y"],
            "agent 2 via kas{i}: {any:?}"
        );
        for (agent, pod) in [(&a2x, "agent2-pod-x"), (&a2y, "agent2-pod-y")] {
            let got = gl.pods(2, Some(agent.connection), t).await.unwrap();
            assert_eq!(got, [pod], "replica {} via kas{i}", agent.connection);
        }
    }
    // Local calls took no hop, the others one: both kinds happened.
    for hops in [0, 1] {
        let line = format!("kas_routed_requests_total{{outcome=\"delivered\",hops=\"{hops}\"}}");
        c.kas[0].await_metric(&line).await;
    }

    // Every registry key carries a TTL: the fields' ttl and 2.5 refresh periods (ttl / 2
    // each), so that a refresh renews it only every third period; a project's key, its
    // records' 2 ttl and 2.5 of their 3-period rewrite intervals (1.5 ttl each).
    let keys = c.redis.keys();
    for agent in [1, 2] {
        let key = format!("kas:agent:{{agent:{agent}}}");
        assert!(keys.contains(&key), "{keys:?}");
    }
    assert!(keys.contains(&"kas:kas_instances".to_string()), "{keys:?}");
    for k in &keys {
        let ttl: i64 = c.redis.cli(&["PTTL", k]).trim().parse().unwrap();
        let most = if k.contains(":conn_by_project:") {
            TTL_MS * 23 / 4
        } else {
            TTL_MS * 9 / 4
        };
        assert!(ttl > 0 && ttl <= most as i64, "{k} has PTTL {ttl}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn pod_logs_stream_whole_and_in_order_through_the_local_and_a_remote_kas() {
    let c = cluster(&["", ""]).await;
    let _a1 = TestAgent::connect(c.kas[0].agent, 1, "agent1-pod", 1).await;
    c.await_connections(1, 1).await;
    let expected = test_log("agent1-pod");
    for i in 0..2 {
        let gl = c.gitlab(i).await;
        let (log, messages) = gl.logs(1, "agent1-pod", 0).await.unwrap();
        assert_eq!(log.len(), expected.len(), "log length via kas{i}");
        assert!(log == expected, "log bytes via kas{i}");
        assert_eq!(
            messages,
            expected.len().div_ceil(64 << 10),
            "pieces via kas{i}"
        );
        let (head, _) = gl.logs(1, "agent1-pod", 1000).await.unwrap();
        assert_eq!(head, expected[..1000], "limited log via kas{i}");
        let missing = gl.logs(1, "no-such-pod", 0).await.unwrap_err();
        assert_eq!(
            missing.code(),
            tonic::Code::NotFound,
            "via kas{i}: {missing}"
        );
        assert!(missing.message().contains("no-such-pod"), "{missing}");
    }
    // kas1 forwarded its three reads to kas0, which served them from the tunnel.
    c.kas[1]
        .await_metric("kas_routed_requests_total{outcome=\"delivered\",hops=\"1\"} 3\n")
        .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn waiting_call_completes_when_its_agent_connects_elsewhere() {
    // kas0 is woken by pub-sub; kas2 has pub-sub wake-ups off, so only its poll finds it.
    let c = cluster(&["", "", "  pubsub_wakeups: false\n"]).await;
    for (via, agent) in [(0usize, 3i64), (2, 4)] {
        let gl = c.gitlab(via).await;
        let call = tokio::spawn(async move { gl.pods(agent, None, Duration::from_secs(15)).await });
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert!(
            !call.is_finished(),
            "the call for agent {agent} waits for it"
        );
        let _agent = TestAgent::connect(c.kas[1].agent, agent, "late-pod", 1).await;
        let pods = call.await.unwrap().expect("the waiting call completes");
        assert_eq!(pods, ["late-pod"], "via kas{via}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn call_for_absent_agent_fails_at_its_deadline() {
    let c = cluster(&["", ""]).await;
    let gl = c.gitlab(0).await;
    let err = gl
        .pods(7, None, Duration::from_millis(800))
        .await
        .expect_err("agent 7 never connects");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
    assert!(err.message().contains("agent 7 is not connected"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_kas_expires_and_calls_stop_going_there() {
    let mut c = cluster(&["", "", ""]).await;
    let _a1 = TestAgent::connect(c.kas[0].agent, 1, "agent1-pod", 1).await;
    let _a5 = TestAgent::connect(c.kas[2].agent, 5, "agent5-pod", 1).await;
    c.await_connections(5, 1).await;
    let gl = c.gitlab(0).await;
    assert_eq!(
        gl.pods(5, None, Duration::from_secs(5)).await.unwrap(),
        ["agent5-pod"]
    );
    let dead = c.kas[2].id();
    c.kas[2].kill9();
    let killed = Instant::now();

    // Its records expire (ttl) and the GC removes them; kas0 stops listing agent 5.
    c.await_connections(5, 0).await;
    let gl = &gl;
    eventually(
        Duration::from_secs(10),
        "expired fields collected",
        || async {
            let tunnels = c.redis.cli(&["HKEYS", "kas:agent:{agent:5}"]);
            let instances = c.redis.cli(&["HKEYS", "kas:kas_instances"]);
            (!tunnels.contains(&dead) && !instances.contains(&dead)).then_some(())
        },
    )
    .await;
    assert!(
        killed.elapsed() >= Duration::from_millis(TTL_MS / 2),
        "records outlived the kill"
    );
    let err = gl
        .pods(5, None, Duration::from_millis(700))
        .await
        .unwrap_err();
    assert!(err.message().contains("agent 5 is not connected"), "{err}");
    // Live agents are unaffected.
    assert_eq!(
        gl.pods(1, None, Duration::from_secs(5)).await.unwrap(),
        ["agent1-pod"]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn kas_rides_out_redis_down_and_refills_it_after_an_empty_restart() {
    let mut c = cluster(&["", ""]).await;
    let _a1 = TestAgent::connect(c.kas[0].agent, 1, "agent1-pod", 1).await;
    let _a6 = TestAgent::connect(c.kas[1].agent, 6, "agent6-pod", 1).await;
    // Agent 1 is in project 101, agent 6 in project 100.
    let expected: Vec<String> = [
        "kas:agent:{agent:1}",
        "kas:agent:{agent:6}",
        "kas:conn_by_project:{project:100}",
        "kas:conn_by_project:{project:101}",
        "kas:kas_instances",
    ]
    .map(String::from)
    .to_vec();
    let redis = &c.redis;
    let all_keys = || async {
        let keys = redis.keys();
        (keys == expected).then_some(keys)
    };
    eventually(Duration::from_secs(10), "registry written", all_keys).await;
    // Redis down: kas is not ready, yet serves the tunnels it holds.
    c.redis.stop();
    let obs = c.kas[0].observability;
    eventually(Duration::from_secs(10), "not ready", || async move {
        http_get(obs, "/readiness")
            .await
            .filter(|(code, _)| *code == 503)
    })
    .await;
    let gl = c.gitlab(0).await;
    assert_eq!(
        gl.pods(1, None, Duration::from_secs(5)).await.unwrap(),
        ["agent1-pod"]
    );
    // SIGKILLed and started again with `--save ""`: empty. Within one refresh period
    // (ttl / 2) plus reconnection, everything is back.
    c.redis.launch().expect("redis-server restarts on its port");
    let redis = &c.redis;
    let all_keys = || async {
        let keys = redis.keys();
        (keys == expected).then_some(keys)
    };
    eventually(
        Duration::from_millis(TTL_MS * 3),
        "registry rewritten",
        all_keys,
    )
    .await;
    eventually(Duration::from_secs(10), "ready again", || async move {
        http_get(obs, "/readiness")
            .await
            .filter(|(code, _)| *code == 200)
    })
    .await;
    assert_eq!(
        gl.pods(6, None, Duration::from_secs(5)).await.unwrap(),
        ["agent6-pod"]
    );
    let _ = &mut c;
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_lets_running_calls_finish_then_deletes_records() {
    let mut c = cluster(&["", ""]).await;
    let _a8 = TestAgent::connect_slow(
        c.kas[1].agent,
        8,
        "agent8-pod",
        1,
        Duration::from_millis(1500),
    )
    .await;
    c.await_connections(8, 1).await;
    // A call through kas0 to the agent on kas1 is running when kas1 gets SIGTERM.
    let gl = c.gitlab(0).await;
    let call = tokio::spawn(async move { gl.pods(8, None, Duration::from_secs(10)).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let status = tokio::task::block_in_place(|| c.kas[1].terminate());
    assert!(status.success(), "kas exits cleanly on SIGTERM: {status}");
    assert_eq!(
        call.await.unwrap().expect("the running call finished"),
        ["agent8-pod"]
    );
    // Deleted at once, not left to expire.
    let fields = c.redis.cli(&["HKEYS", "kas:agent:{agent:8}"]);
    assert!(fields.trim().is_empty(), "left behind: {fields}");
    let instances = c.redis.cli(&["HKEYS", "kas:kas_instances"]);
    assert!(!instances.contains(&c.kas[1].id()), "{instances}");
    assert!(instances.contains(&c.kas[0].id()), "{instances}");
    assert!(c.kas[1].log_text().contains("stopped"));
}

/// kas0 keeps forward streams opened ahead to kas1. kas1's stop ends them (it does not
/// wait out its grace for them), and once kas1 is back on the same addresses the first
/// call forwarded to it succeeds: no stream of the old process carries it.
#[tokio::test(flavor = "multi_thread")]
async fn streams_opened_ahead_neither_hold_up_a_stop_nor_outlive_their_kas() {
    let mut c = cluster(&["", ""]).await;
    let agent = TestAgent::connect(c.kas[1].agent, 1, "agent1-pod", 1).await;
    c.await_connections(1, 1).await;
    let gl = c.gitlab(0).await;
    let t = Duration::from_secs(5);
    for _ in 0..3 {
        assert_eq!(gl.pods(1, None, t).await.unwrap(), ["agent1-pod"]);
    }
    drop(agent);
    c.await_connections(1, 0).await;
    let status = tokio::task::block_in_place(|| c.kas[1].terminate());
    assert!(status.success(), "kas1 exits cleanly on SIGTERM: {status}");
    let log = c.kas[1].log_text();
    assert!(log.contains("every call ended"), "{log}");
    assert!(!log.contains("calls still running"), "{log}");

    let (secrets, redis) = (&c.secrets, &c.redis);
    c.kas[1].restart(secrets, "kas1", Some(redis), TTL_MS).await;
    let _agent = TestAgent::connect(c.kas[1].agent, 1, "agent1-pod", 1).await;
    c.await_connections(1, 1).await;
    for _ in 0..3 {
        assert_eq!(gl.pods(1, None, t).await.unwrap(), ["agent1-pod"]);
    }
}
