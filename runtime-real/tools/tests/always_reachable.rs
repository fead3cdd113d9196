//! Agents connected to several kas at once (agentk through one load balancer) stay
//! reachable while every kas is restarted in turn: no call fails, every stop ends within
//! its grace and 2 s.

mod support;

use kas_core::ConnectionId;
use kas_tools::local::balancer::Balancer;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use support::*;

const TTL_MS: u64 = 2000;
/// The kas's `shutdown_grace` (support's configuration).
const GRACE: Duration = Duration::from_secs(2);
const PODS: &str = "- {namespace: default, name: web-1, phase: Running, node_name: node-a}\n";

/// Waits until `agent` is listed with `replicas` replicas, each connected to two kas.
async fn await_homed(gl: &GitLab, agent: i64, replicas: usize) -> Vec<(i64, String, usize)> {
    eventually(
        Duration::from_secs(30),
        &format!("agent {agent}'s {replicas} replicas each on two kas"),
        || async move {
            gl.replicas(agent)
                .await
                .ok()
                .filter(|r| r.len() == replicas && r.iter().all(|(_, _, kas)| *kas == 2))
        },
    )
    .await
}

/// What the callers saw.
#[derive(Default)]
struct Tally {
    made: AtomicUsize,
    failed: Mutex<Vec<String>>,
}

#[tokio::test(flavor = "multi_thread")]
async fn no_call_fails_while_every_kas_restarts_in_turn() {
    let redis = Redis::start().expect("redis-server starts (scripts/test installs it)");
    let secrets = Secrets::new();
    let mut kas = Vec::new();
    for i in 0..3 {
        kas.push(KasProc::start(&secrets, &format!("kas{i}"), Some(&redis), TTL_MS, "").await);
    }
    let lb = Balancer::start(kas.iter().map(|k| k.agent).collect())
        .await
        .unwrap();
    let flags = [
        "--kas-connections",
        "2",
        "--min-idle-tunnels",
        "2",
        "--max-reconnect-delay",
        "2s",
        // Below kas's heartbeat_timeout here (3 s): agentk's default (10 s) is for kas's
        // (60 s), and idle tunnels would be closed as silent, racing the calls sent down
        // them.
        "--heartbeat",
        "1s",
    ];
    let lb_address = lb.address.to_string();
    let start = |agent: i64, pod: &str| {
        AgentkProc::start(
            &secrets,
            &lb_address,
            &agent_token(agent),
            pod,
            PODS,
            &flags,
        )
    };
    let agents = [
        start(1, "agent1-a"),
        start(1, "agent1-b"),
        start(2, "agent2-a"),
    ];
    let gl0 = GitLab::new(&secrets, kas[0].api).await;
    let replicas = await_homed(&gl0, 1, 2).await;
    await_homed(&gl0, 2, 1).await;

    // GitLab calls through every kas that is up (as a load balancer that follows readiness
    // would send them): unpinned for both agents, and pinned to each replica of agent 1.
    let mut clients = Vec::new();
    for k in &kas {
        clients.push(Arc::new(GitLab::new(&secrets, k.api).await));
    }
    let clients = Arc::new(RwLock::new(clients));
    let up: Arc<[AtomicBool; 3]> = Arc::new(std::array::from_fn(|_| AtomicBool::new(true)));
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let mut wanted: Vec<(i64, Option<ConnectionId>)> = vec![(1, None), (2, None)];
    wanted.extend(replicas.iter().map(|(c, _, _)| (1, Some(ConnectionId(*c)))));
    let mut callers = Vec::new();
    for (agent, replica) in wanted {
        let (clients, up, stop, tally) = (clients.clone(), up.clone(), stop.clone(), tally.clone());
        callers.push(tokio::spawn(async move {
            let mut turn = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let i = turn % 3;
                turn += 1;
                if !up[i].load(Ordering::Relaxed) {
                    continue;
                }
                let gl = clients.read().unwrap()[i].clone();
                match gl.pods(agent, replica, Duration::from_secs(10)).await {
                    Ok(pods) if pods == ["web-1"] => {
                        tally.made.fetch_add(1, Ordering::Relaxed);
                    }
                    answer => tally.failed.lock().unwrap().push(format!(
                        "agent {agent} replica {replica:?} through kas{i}: {answer:?}"
                    )),
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }));
    }

    let mut stops = Vec::new();
    for round in 0..2 {
        for i in 0..3 {
            // Not ready: callers stop choosing it; calls under way run on.
            up[i].store(false, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(300)).await;
            let began = Instant::now();
            let status = tokio::task::block_in_place(|| kas[i].terminate());
            stops.push((round, i, began.elapsed()));
            assert!(status.success(), "kas{i} exits cleanly: {status}");
            let name = format!("kas{i}");
            kas[i].restart(&secrets, &name, Some(&redis), TTL_MS).await;
            clients.write().unwrap()[i] = Arc::new(GitLab::new(&secrets, kas[i].api).await);
            up[i].store(true, Ordering::Relaxed);
            // Every replica is back on two kas before the next one stops.
            await_homed(&gl0, 1, 2).await;
            await_homed(&gl0, 2, 1).await;
        }
    }
    stop.store(true, Ordering::Relaxed);
    for c in callers {
        c.await.unwrap();
    }

    let failed = tally.failed.lock().unwrap().clone();
    let made = tally.made.load(Ordering::Relaxed);
    eprintln!(
        "{made} calls answered, {} failed; stops: {stops:?}",
        failed.len()
    );
    assert!(
        failed.is_empty(),
        "{} of {made} calls failed: {failed:#?}",
        failed.len()
    );
    assert!(made >= 100, "only {made} calls were made");
    for (round, i, took) in &stops {
        assert!(
            *took <= GRACE + Duration::from_secs(2),
            "round {round}: kas{i} took {took:?} to stop"
        );
    }
    // The agents moved make-before-break when asked, rather than only being cut off.
    let moved: usize = agents
        .iter()
        .map(|a| a.count("kas asked this connection to move"))
        .sum();
    assert!(moved >= 6, "agents were asked to move {moved} times");
}

/// A connection older than `agent.listen.max_connection_age` is asked to move: the agent
/// connects again first, then drains the old connection, and no call fails.
///
/// kas goes on sending calls down the old connection's idle tunnels while the agent
/// closes them (this kas is not stopping). Before the agent asked kas to end its tunnels
/// (`Closing`), a call sent down one as it closed failed in about one run in three.
#[tokio::test(flavor = "multi_thread")]
async fn an_old_connection_is_asked_to_move_and_no_call_fails() {
    let secrets = Secrets::new();
    let extra = Extra {
        agent_listen: "    max_connection_age: 2s\n",
        ..Extra::default()
    };
    let kas = KasProc::start_extra(&secrets, "kas", None, 10_000, extra, None).await;
    let agentk = AgentkProc::start(
        &secrets,
        &kas.agent.to_string(),
        &agent_token(1),
        "agent1-pod",
        PODS,
        &["--min-idle-tunnels", "2", "--heartbeat", "1s"],
    );
    let gitlab = Arc::new(GitLab::new(&secrets, kas.api).await);
    let tally = Arc::new(Tally::default());
    // Eight callers at once, so that calls are often on their way down idle tunnels.
    let callers: Vec<_> = (0..8)
        .map(|_| {
            let (gitlab, tally) = (gitlab.clone(), tally.clone());
            tokio::spawn(async move {
                let began = Instant::now();
                while began.elapsed() < Duration::from_secs(8) {
                    match gitlab.pods(1, None, Duration::from_secs(5)).await {
                        Ok(pods) if pods == ["web-1"] => {
                            tally.made.fetch_add(1, Ordering::Relaxed);
                        }
                        answer => tally.failed.lock().unwrap().push(format!("{answer:?}")),
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
        })
        .collect();
    for caller in callers {
        caller.await.unwrap();
    }
    eventually(Duration::from_secs(10), "two moves", || {
        let moved = agentk.count("kas asked this connection to move");
        async move { (moved >= 2).then_some(()) }
    })
    .await;
    let log = kas.log_text();
    assert!(log.contains("max_connection_age"), "{log}");
    let answered = tally.made.load(Ordering::Relaxed);
    let failed = tally.failed.lock().unwrap().clone();
    assert!(answered > 100, "{answered} answered, failed: {failed:?}");
    assert!(
        failed.is_empty(),
        "{answered} answered, failed: {failed:#?}"
    );
    // The last call, after the moves, is answered.
    let pods = gitlab.pods(1, None, Duration::from_secs(5)).await;
    assert_eq!(pods.expect("answered after the moves"), ["web-1"]);
}
