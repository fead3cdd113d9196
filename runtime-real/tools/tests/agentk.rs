//! The agentk binary against a kas process: reconnects after a kas restart, backs off when
//! its token is refused, leaves cleanly on SIGTERM, and keeps its pool within the tunnels
//! kas allows, and gives up a link to kas that half died.

mod support;

use std::time::{Duration, Instant};
use support::{
    AgentkProc, Extra, GitLab, HalfOpenRelay, KasProc, Secrets, Way, agent_token, eventually,
};

const PODS: &str = "- {namespace: default, name: web-1, phase: Running, node_name: node-a}\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agentk_reconnects_after_its_kas_restarts_and_is_routable_again() {
    let secrets = Secrets::new();
    let mut kas = KasProc::start(&secrets, "kas", None, 10_000, "").await;
    let mut agentk = AgentkProc::start(
        &secrets,
        &kas.agent.to_string(),
        &agent_token(1),
        "agent1-pod",
        PODS,
        &["--min-idle-tunnels", "1"],
    );
    let gitlab = GitLab::new(&secrets, kas.api).await;
    let pods = gitlab.pods(1, None, Duration::from_secs(10)).await;
    assert_eq!(pods.expect("routed"), ["web-1"]);
    let gl = &gitlab;
    let listed = eventually(Duration::from_secs(10), "agent 1 listed", || async move {
        gl.connections(1).await.ok().filter(|c| !c.is_empty())
    })
    .await;
    assert_eq!(
        listed[0].1, "agent1-pod",
        "pod name from the downward-API environment"
    );

    assert!(kas.terminate().success());
    kas.restart(&secrets, "kas", None, 10_000).await;
    let gitlab = GitLab::new(&secrets, kas.api).await;
    // The call waits for the agent to come back, within its deadline.
    let pods = gitlab.pods(1, None, Duration::from_secs(15)).await;
    assert_eq!(pods.expect("routed after the restart"), ["web-1"]);
    assert!(agentk.running(), "agentk survived:\n{}", agentk.log_text());
    // Its log is written as it goes: wait for the lines rather than read once.
    eventually(Duration::from_secs(10), "the reconnection logged", || {
        // Asked to move as kas stopped, then connected to it again once it was back.
        let logged = agentk.count("connected kas=") >= 2
            && agentk.count("kas asked this connection to move") >= 1;
        async move { logged.then_some(()) }
    })
    .await;
    assert_eq!(agentk.count("connected kas="), 2, "{}", agentk.log_text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agentk_with_a_refused_token_says_so_and_backs_off() {
    let secrets = Secrets::new();
    let kas = KasProc::start(&secrets, "kas", None, 10_000, "").await;
    let started = Instant::now();
    let mut agentk = AgentkProc::start(
        &secrets,
        &kas.agent.to_string(),
        "not-a-token-kas-knows-0123456789",
        "bad-agent",
        PODS,
        &[],
    );
    eventually(Duration::from_secs(30), "three refusals", || {
        let n = agentk.count("kas refused the agent token");
        async move { (n >= 3).then_some(()) }
    })
    .await;
    // Backoff delays are at least 0.5 s then 1 s (jittered halves of 1 s and 2 s): three
    // attempts cannot happen faster than 1.5 s. A busy loop would make them in
    // milliseconds. (A lower bound: a slow machine only makes it later.)
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(1500),
        "3 attempts in {elapsed:?}"
    );
    assert!(
        agentk.running(),
        "agentk keeps retrying:\n{}",
        agentk.log_text()
    );
    let log = agentk.log_text();
    assert!(log.contains("check --token-file"), "{log}");
    assert!(kas.log_text().contains("agent token"), "{}", kas.log_text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agentk_leaves_on_sigterm_and_kas_forgets_it() {
    let secrets = Secrets::new();
    let kas = KasProc::start(&secrets, "kas", None, 10_000, "").await;
    let mut agentk = AgentkProc::start(
        &secrets,
        &kas.agent.to_string(),
        &agent_token(1),
        "agent1-pod",
        PODS,
        &["--min-idle-tunnels", "3"],
    );
    let gitlab = GitLab::new(&secrets, kas.api).await;
    assert_eq!(
        gitlab.pods(1, None, Duration::from_secs(10)).await.unwrap(),
        ["web-1"]
    );
    let status = agentk.terminate();
    assert!(status.success(), "{status}:\n{}", agentk.log_text());
    let log = agentk.log_text();
    assert!(log.contains("draining: closing idle tunnels"), "{log}");
    assert!(log.contains("agentk stopped"), "{log}");
    eventually(Duration::from_secs(10), "kas to drop the agent", || {
        let gitlab = &gitlab;
        async move { gitlab.connections(1).await.ok().filter(|c| c.is_empty()) }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agentk_asks_for_no_more_tunnels_than_kas_keeps() {
    let secrets = Secrets::new();
    let extra = Extra {
        agent: "  max_tunnels_per_connection: 2\n",
        ..Extra::default()
    };
    let kas = KasProc::start_extra(&secrets, "kas", None, 10_000, extra, None).await;
    // Its own pool would keep 4 idle; kas says it keeps 2.
    let _agentk = AgentkProc::start(
        &secrets,
        &kas.agent.to_string(),
        &agent_token(1),
        "agent1-pod",
        PODS,
        &["--min-idle-tunnels", "4", "--max-tunnels", "8"],
    );
    let gitlab = GitLab::new(&secrets, kas.api).await;
    let calls: Vec<_> = (0..6)
        .map(|_| {
            let gl = &gitlab;
            async move { gl.pods(1, None, Duration::from_secs(10)).await }
        })
        .collect();
    for pods in futures::future::join_all(calls).await {
        assert_eq!(pods.expect("routed, two at a time"), ["web-1"]);
    }
    let kas = &kas;
    eventually(Duration::from_secs(10), "two tunnels open", || async move {
        let text = kas.metrics().await;
        (kas_server::kas::observability::gauge(&text, "kas_tunnels")? == 2.0).then_some(())
    })
    .await;
    // An agent asking for more has them refused at once, again and again: none was.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let text = kas.metrics().await;
    let series = "kas_limit_refusals_total{limit=\"agent.max_tunnels_per_connection\"}";
    let refused = kas_server::kas::observability::gauge(&text, series).unwrap_or(0.0);
    assert_eq!(refused, 0.0, "tunnels refused:\n{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agentk_gives_up_a_link_that_drops_what_kas_sends() {
    half_open(Way::ToClient).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agentk_gives_up_a_link_that_drops_what_it_sends() {
    half_open(Way::ToServer).await;
}

/// agentk's one connection goes through a relay whose path then drops everything one
/// way, with no reset: the way that still flows keeps it looking alive to one end (kas
/// still hears the heartbeats of a link that drops what it sends; agentk still hears kas
/// on one that drops what agentk sends). Within a few heartbeats agentk finds its tunnels
/// unanswered, drops the connection and dials again (through a path that works), and
/// the agent is reachable again. HTTP/2 keepalive alone would take 50 s.
async fn half_open(way: Way) {
    let secrets = Secrets::new();
    let kas = KasProc::start(&secrets, "kas", None, 10_000, "").await;
    let relay = HalfOpenRelay::start(kas.agent).await;
    let agentk = AgentkProc::start(
        &secrets,
        &relay.address.to_string(),
        &agent_token(1),
        "agent1-pod",
        PODS,
        &[
            "--heartbeat",
            "500ms",
            "--kas-connections",
            "1",
            "--max-reconnect-delay",
            "1s",
        ],
    );
    let gitlab = GitLab::new(&secrets, kas.api).await;
    let pods = gitlab.pods(1, None, Duration::from_secs(10)).await;
    assert_eq!(pods.expect("routed"), ["web-1"]);
    relay.cut(way);
    let cut = Instant::now();
    let agentk = &agentk;
    eventually(
        Duration::from_secs(15),
        "agentk gave up the dead link and connected again",
        || {
            let replaced =
                agentk.count("the link to kas is dead") >= 1 && agentk.count("connected kas=") >= 2;
            async move { replaced.then_some(()) }
        },
    )
    .await;
    let replaced = cut.elapsed();
    let gl = &gitlab;
    eventually(
        Duration::from_secs(10),
        "the agent reachable again",
        || async move {
            let pods = gl.pods(1, None, Duration::from_secs(2)).await.ok()?;
            (pods == ["web-1"]).then_some(())
        },
    )
    .await;
    println!("{way:?} cut: agentk connected again after {replaced:?}");
}
