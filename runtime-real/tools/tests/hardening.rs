//! What an outside probe broke, each reproduced against kas processes on loopback: a
//! misbehaving agent, oversized agent metadata, JWT claims, limits and timeouts.

mod support;

use kas_agent::{AgentClient, PODS_LIST, PODS_LOGS};
use kas_proto::frame::{Descriptor, Frame, frame::Kind};
use kas_transport::frames;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use support::Extra;
use support::*;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

/// An agent written frame by frame: `tunnels` tunnels of one connection of `agent` on
/// `kas`, answering every call with what `answer` makes of its request id. Counts the calls
/// it receives.
struct RawAgent {
    received: Arc<AtomicUsize>,
    _tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl RawAgent {
    async fn start(
        kas: &KasProc,
        agent: i64,
        tunnels: usize,
        answer: fn(u64) -> Vec<Frame>,
    ) -> RawAgent {
        let client = AgentClient::new(channel(kas.agent).await, agent_token(agent));
        let (connection, _, mut config) = client.connect(Default::default(), None).await.unwrap();
        let received = Arc::new(AtomicUsize::new(0));
        let mut tasks = vec![tokio::spawn(async move {
            while let Ok(Some(_)) = config.message().await {}
        })];
        for _ in 0..tunnels {
            let (tx, mut inbound) = tunnel(kas, agent, connection.0, &[PODS_LIST, PODS_LOGS])
                .await
                .expect("tunnel accepted");
            let received = received.clone();
            tasks.push(tokio::spawn(async move {
                while let Ok(Some(f)) = inbound.message().await {
                    match f.kind {
                        Some(Kind::RequestStart(_)) => {
                            received.fetch_add(1, Ordering::SeqCst);
                        }
                        Some(Kind::CloseSend(c)) => {
                            for frame in answer(c.request_id) {
                                let _ = tx.send(frame).await;
                            }
                        }
                        _ => {}
                    }
                }
            }));
        }
        RawAgent {
            received,
            _tasks: tasks,
        }
    }

    fn received(&self) -> usize {
        self.received.load(Ordering::SeqCst)
    }
}

/// Item 1: an agent's `Error` frame is not kas's "not delivered": the call, routed through
/// another kas, reaches the agent once and fails as a protocol violation.
#[tokio::test(flavor = "multi_thread")]
async fn an_agents_error_frame_ends_the_call_without_a_second_delivery() {
    let redis = Redis::start().expect("redis-server starts (scripts/test installs it)");
    let s = Secrets::new();
    let holder = KasProc::start(&s, "kas0", Some(&redis), 10_000, "").await;
    let router = KasProc::start(&s, "kas1", Some(&redis), 10_000, "").await;
    let agent = RawAgent::start(&holder, 2, 4, |id| {
        let refusal = tonic::Status::unavailable("connection 1 is not connected");
        vec![frames::error(id, &refusal)]
    })
    .await;
    let gl = GitLab::new(&s, router.api).await;
    eventually(Duration::from_secs(10), "agent 2 listed", || async {
        gl.connections(2).await.ok().filter(|c| c.len() == 1)
    })
    .await;
    let err = gl
        .pods(2, None, Duration::from_secs(4))
        .await
        .expect_err("the agent broke the protocol");
    assert_eq!(err.code(), Code::Internal, "{err}");
    assert!(err.message().contains("broke the tunnel protocol"), "{err}");
    // The other three tunnels stay free: a retry would reach one of them at once.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(agent.received(), 1, "the call reached the agent once");
}

/// Item 3: agent metadata over Kubernetes' own limits is refused, naming the field, and
/// never reaches the registry or the project's listing.
#[tokio::test(flavor = "multi_thread")]
async fn oversized_agent_metadata_is_refused_naming_the_field() {
    use kas_proto::registry::{AgentMeta, KubernetesVersion};
    let s = Secrets::new();
    let kas = KasProc::start(&s, "kas", None, 10_000, "").await;
    let client = AgentClient::new(channel(kas.agent).await, agent_token(1));
    let long = |n: usize| "x".repeat(n);
    let cases = [
        (
            "agent_meta.pod_name",
            AgentMeta {
                pod_name: long(2 << 20),
                ..Default::default()
            },
        ),
        (
            "agent_meta.pod_name",
            AgentMeta {
                pod_name: long(254),
                ..Default::default()
            },
        ),
        (
            "agent_meta.pod_namespace",
            AgentMeta {
                pod_namespace: long(64),
                ..Default::default()
            },
        ),
        (
            "agent_meta.version",
            AgentMeta {
                version: long(65),
                ..Default::default()
            },
        ),
        (
            "agent_meta.commit",
            AgentMeta {
                commit: long(65),
                ..Default::default()
            },
        ),
        (
            "agent_meta.architecture",
            AgentMeta {
                architecture: long(33),
                ..Default::default()
            },
        ),
        (
            "agent_meta.kubernetes_version.git_version",
            AgentMeta {
                kubernetes_version: Some(KubernetesVersion {
                    git_version: long(65),
                    ..Default::default()
                }),
                ..Default::default()
            },
        ),
        (
            "agent_meta.kubernetes_version.platform",
            AgentMeta {
                kubernetes_version: Some(KubernetesVersion {
                    platform: long(1 << 20),
                    ..Default::default()
                }),
                ..Default::default()
            },
        ),
    ];
    for (field, meta) in cases {
        let err = client.connect(meta, None).await.expect_err(field);
        assert_eq!(err.code(), Code::InvalidArgument, "{field}: {err}");
        assert!(err.message().starts_with(field), "{field}: {err}");
    }
    // At the limits, accepted and listed.
    let fits = AgentMeta {
        version: long(64),
        commit: long(64),
        pod_namespace: long(63),
        pod_name: long(253),
        architecture: long(32),
        kubernetes_version: Some(KubernetesVersion {
            major: long(64),
            minor: long(64),
            git_version: long(64),
            platform: long(64),
        }),
        max_tunnels: u32::MAX,
    };
    let (_connection, _, _config) = client.connect(fits, None).await.expect("within limits");
    let gl = GitLab::new(&s, kas.api).await;
    let listed = eventually(Duration::from_secs(10), "agent 1 listed", || async {
        gl.connections(1).await.ok().filter(|c| !c.is_empty())
    })
    .await;
    assert_eq!(listed.len(), 1, "only the valid connection: {listed:?}");
    assert_eq!(listed[0].1.len(), 253);
}

/// A pod list of about `bytes` bytes, as an agent's answer message.
fn pod_list(bytes: usize) -> Vec<u8> {
    use kas_proto::pods::{ListResponse, Pod};
    use prost::Message;
    let pods = (0..bytes / 100)
        .map(|i| Pod {
            namespace: "default".into(),
            name: format!("pod-{i:0>80}"),
            ..Default::default()
        })
        .collect();
    ListResponse { pods }.encode_to_vec()
}

/// Item 9: an agent's status message is passed on cut to 1 KiB; an answer over
/// `agent.max_message_size` fails naming that key, on the local and the remote route; a
/// 6.5 MB answer fits the default.
#[tokio::test(flavor = "multi_thread")]
async fn agent_statuses_are_truncated_and_answer_sizes_are_limited_by_name() {
    let redis = Redis::start().expect("redis-server starts (scripts/test installs it)");
    let s = Secrets::new();
    let small = Extra {
        agent: "  max_message_size: 1048576\n",
        ..Extra::default()
    };
    let holder = KasProc::start_extra(&s, "kas0", Some(&redis), 10_000, small, None).await;
    let other = KasProc::start(&s, "kas1", Some(&redis), 10_000, "").await;
    let _verbose = RawAgent::start(&holder, 1, 1, |id| {
        let long = "x".repeat(200_000);
        vec![frames::trailer(id, &tonic::Status::not_found(long))]
    })
    .await;
    // Each answer over the limit costs the agent its tunnel (kas closes it).
    let _huge = RawAgent::start(&holder, 2, 3, |id| {
        vec![
            frames::message(id, pod_list(2 << 20)),
            frames::trailer(id, &tonic::Status::ok("")),
        ]
    })
    .await;
    let _big = RawAgent::start(&other, 3, 1, |id| {
        vec![
            frames::message(id, pod_list(6_500_000)),
            frames::trailer(id, &tonic::Status::ok("")),
        ]
    })
    .await;
    let t = Duration::from_secs(5);
    for kas in [&holder, &other] {
        let gl = GitLab::new(&s, kas.api).await;
        eventually(Duration::from_secs(10), "agents listed", || async {
            let all = [1, 2, 3].map(|a| gl.connections(a));
            let all = futures::future::join_all(all).await;
            all.iter()
                .all(|c| c.as_ref().is_ok_and(|c| c.len() == 1))
                .then_some(())
        })
        .await;
        let err = gl.pods(1, None, t).await.expect_err("the agent's status");
        assert_eq!(err.code(), Code::NotFound, "{err}");
        assert!(err.message().len() < 1200, "{} bytes", err.message().len());
        // Then the call's correlation id, as every error from kas.
        assert!(
            err.message()
                .contains("(truncated by kas from 200000 bytes) (correlation id "),
            "{err}"
        );
        let err = gl.pods(2, None, t).await.expect_err("over the limit");
        assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
        assert!(err.message().contains("agent.max_message_size"), "{err}");
        // Agent 3 is on kas1 (default limit); kas0 accepts 1 MiB from other kas too.
        let answer = gl.pods(3, None, t).await;
        if kas.api == other.api {
            assert_eq!(answer.expect("6.5 MB fits the default").len(), 65_000);
        } else {
            let err = answer.expect_err("over kas0's limit for relayed answers");
            assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
            assert!(err.message().contains("agent.max_message_size"), "{err}");
        }
    }
}

/// Item 5: connections per agent, tunnels per connection and requests per minute are
/// capped, each refusal naming its key and counted.
#[tokio::test(flavor = "multi_thread")]
async fn agent_connections_tunnels_and_request_rate_are_capped() {
    let s = Secrets::new();
    let caps = Extra {
        agent: "  max_connections_per_agent: 2\n  max_tunnels_per_connection: 2\n",
        ..Extra::default()
    };
    let kas = KasProc::start_extra(&s, "kas", None, 10_000, caps, None).await;
    let client = AgentClient::new(channel(kas.agent).await, agent_token(1));
    let (c1, _, _s1) = client.connect(Default::default(), None).await.unwrap();
    let (_c2, _, _s2) = client.connect(Default::default(), None).await.unwrap();
    let err = client
        .connect(Default::default(), None)
        .await
        .expect_err("third");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    assert!(
        err.message().contains("agent.max_connections_per_agent"),
        "{err}"
    );
    let other = AgentClient::new(channel(kas.agent).await, agent_token(2));
    other
        .connect(Default::default(), None)
        .await
        .expect("agent 2 has its own limit");

    let mut open = Vec::new();
    for _ in 0..2 {
        open.push(tunnel(&kas, 1, c1.0, &[]).await.expect("within the limit"));
    }
    let err = tunnel(&kas, 1, c1.0, &[]).await.expect_err("third tunnel");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    assert!(
        err.message().contains("agent.max_tunnels_per_connection"),
        "{err}"
    );
    drop(open.pop());
    eventually(Duration::from_secs(5), "a freed tunnel place", || async {
        tunnel(&kas, 1, c1.0, &[]).await.ok()
    })
    .await;

    let rate = Extra {
        agent_listen: "    connections_per_token_per_minute: 4\n",
        ..Extra::default()
    };
    let limited = KasProc::start_extra(&s, "limited", None, 10_000, rate, None).await;
    let client = AgentClient::new(channel(limited.agent).await, agent_token(3));
    let mut streams = Vec::new();
    for _ in 0..4 {
        streams.push(
            client
                .connect(Default::default(), None)
                .await
                .expect("within the rate"),
        );
    }
    let err = client
        .connect(Default::default(), None)
        .await
        .expect_err("fifth");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    assert!(
        err.message().contains("connections_per_token_per_minute"),
        "{err}"
    );

    // At least one each: waiting for the freed tunnel place may be refused again.
    for (kas, key) in [
        (&kas, "agent.max_connections_per_agent"),
        (&kas, "agent.max_tunnels_per_connection"),
        (&limited, "agent.listen.connections_per_token_per_minute"),
    ] {
        let series = format!("kas_limit_refusals_total{{limit=\"{key}\"}}");
        eventually(Duration::from_secs(5), &series, || async {
            let text = kas.metrics().await;
            (kas_server::kas::observability::gauge(&text, &series)? >= 1.0).then_some(())
        })
        .await;
    }
}

/// Opens a tunnel of `agent`'s connection `connection` serving `methods`: the frames to
/// send, and the inbound stream once kas accepted it.
async fn tunnel(
    kas: &KasProc,
    agent: i64,
    connection: i64,
    methods: &[&str],
) -> Result<(tokio::sync::mpsc::Sender<Frame>, tonic::Streaming<Frame>), tonic::Status> {
    let mut api =
        kas_proto::agent_api::agent_api_client::AgentApiClient::new(channel(kas.agent).await);
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let descriptor = frames::frame(Kind::Descriptor(Descriptor {
        methods: methods.iter().map(|m| m.to_string()).collect(),
        connection_id: connection,
        ..Default::default()
    }));
    tx.send(descriptor).await.unwrap();
    let mut req = tonic::Request::new(ReceiverStream::new(rx));
    req.metadata_mut().insert(
        "authorization",
        format!("Bearer {}", agent_token(agent)).parse().unwrap(),
    );
    let inbound = api.open_tunnel(req).await?.into_inner();
    Ok((tx, inbound))
}

/// Item 5: no more than `max_concurrent_streams` calls of one connection run at once; the
/// rest wait their turn (HTTP/2 flow control) and all complete.
#[tokio::test(flavor = "multi_thread")]
async fn concurrent_streams_per_connection_are_capped() {
    let s = Secrets::new();
    let cap = Extra {
        api_listen: "    max_concurrent_streams: 5\n",
        ..Extra::default()
    };
    let kas = KasProc::start_extra(&s, "kas", None, 10_000, cap, None).await;
    let delay = Duration::from_millis(300);
    let _agent = TestAgent::connect_slow(kas.agent, 1, "slow-pod", 20, delay).await;
    let gl = Arc::new(GitLab::new(&s, kas.api).await);
    eventually(Duration::from_secs(10), "agent 1 listed", || async {
        gl.connections(1).await.ok().filter(|c| c.len() == 1)
    })
    .await;
    let calls: Vec<_> = (0..20)
        .map(|_| {
            let gl = gl.clone();
            tokio::spawn(async move { gl.pods(1, None, Duration::from_secs(20)).await })
        })
        .collect();
    let mut most = 0.0f64;
    while !calls.iter().all(|c| c.is_finished()) {
        let m = kas.metrics().await;
        if let Some(n) = kas_server::kas::observability::gauge(&m, "kas_calls") {
            most = most.max(n);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for c in calls {
        assert_eq!(
            c.await.unwrap().expect("every call completes"),
            ["slow-pod"]
        );
    }
    assert!(most >= 1.0, "calls were seen running");
    assert!(most <= 5.0, "{most} calls ran at once on one connection");
}

/// Item 6: connections that never start talking are closed after `handshake_timeout`, on
/// every listener (a half-sent HTTP request on the observability one too); accept errors
/// at the open-file limit are logged and counted, and kas recovers; the open-file limit
/// is raised to the hard limit and exported.
#[tokio::test(flavor = "multi_thread")]
async fn silent_connections_are_closed_and_a_full_file_table_is_reported() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = Secrets::new();
    let timeouts = Extra {
        agent_listen: "    handshake_timeout: 1s\n",
        api_listen: "    handshake_timeout: 1s\n",
        observability_listen: "    handshake_timeout: 1s\n",
        open_files: Some(64),
        ..Extra::default()
    };
    let kas = KasProc::start_extra(&s, "kas", None, 10_000, timeouts, None).await;
    let metrics = kas.metrics().await;
    let limit = kas_server::kas::observability::gauge(&metrics, "kas_open_files_limit");
    assert_eq!(limit, Some(64.0), "the hard limit, exported");

    // Silent or half-talking connections on each listener are closed by kas.
    let mut silent = Vec::new();
    for addr in [kas.agent, kas.api, kas.observability] {
        silent.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    let mut half = tokio::net::TcpStream::connect(kas.observability)
        .await
        .unwrap();
    half.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    silent.push(half);
    for mut c in silent {
        let mut buf = [0u8; 64];
        let read = tokio::time::timeout(Duration::from_secs(5), async {
            // Whatever kas writes (its HTTP/2 settings) is read until it closes.
            loop {
                match c.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(read.is_ok(), "kas closed a silent connection within 5 s");
    }

    // Past the file limit: accepts fail, are logged once and counted, and kas recovers
    // when the silent connections it holds time out.
    let mut flood = Vec::new();
    for _ in 0..80 {
        if let Ok(c) = tokio::net::TcpStream::connect(kas.api).await {
            flood.push(c);
        }
    }
    eventually(Duration::from_secs(10), "accept errors counted", || async {
        let m = kas.metrics().await;
        m.contains("kas_accept_errors_total{listener=\"api\"}")
            .then_some(())
    })
    .await;
    assert!(
        kas.log_text().contains("the open-file limit is reached"),
        "{}",
        kas.log_text()
    );
    drop(flood);
    let gl = GitLab::new(&s, kas.api).await;
    eventually(Duration::from_secs(10), "kas serving again", || async {
        gl.connections(1).await.ok()
    })
    .await;
}

/// Item 10: the connections of a kas that was SIGKILLed leave the listings of the other
/// kas once its liveness record expires (`agent.kas_liveness_ttl`, 3 s here), long before
/// their own records would (300 s here).
#[tokio::test(flavor = "multi_thread")]
async fn a_killed_kas_s_agents_leave_listings_within_its_liveness_ttl() {
    let redis = Redis::start().expect("redis-server starts (scripts/test installs it)");
    let s = Secrets::new();
    let live = Extra {
        agent: "  kas_liveness_ttl: 3s\n",
        ..Extra::default()
    };
    let mut doomed = KasProc::start_extra(&s, "kas0", Some(&redis), 300_000, live, None).await;
    let survivor = KasProc::start_extra(&s, "kas1", Some(&redis), 300_000, live, None).await;
    let _a1 = TestAgent::connect(doomed.agent, 1, "agent1-pod", 1).await;
    let _a3 = TestAgent::connect(survivor.agent, 3, "agent3-pod", 1).await;
    let gl = GitLab::new(&s, survivor.api).await;
    eventually(Duration::from_secs(10), "agent 1 listed", || async {
        gl.connections(1).await.ok().filter(|c| c.len() == 1)
    })
    .await;
    // Past a few heartbeats, the live kas stays listed.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(gl.connections(1).await.unwrap().len(), 1, "kas0 is alive");
    doomed.kill9();
    let killed = std::time::Instant::now();
    eventually(
        Duration::from_secs(10),
        "agent 1 gone from listings",
        || async { gl.connections(1).await.ok().filter(|c| c.is_empty()) },
    )
    .await;
    let gone_after = killed.elapsed();
    assert!(gone_after < Duration::from_secs(8), "{gone_after:?}");
    // Its records are still in Redis: readers skip them.
    assert!(redis.keys().contains(&"kas:agent:{agent:1}".to_string()));
    assert_eq!(
        gl.connections(3).await.unwrap().len(),
        1,
        "kas1's own agent stays"
    );
    let err = gl.pods(1, None, Duration::from_secs(1)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    assert!(err.message().contains("agent 1 is not connected"), "{err}");
}

/// Item 6: a client that sends the HTTP/2 preface and then stops answering is closed once
/// a keepalive ping goes unanswered (`keepalive_interval` + `keepalive_timeout`).
#[tokio::test(flavor = "multi_thread")]
async fn a_connection_that_stops_answering_pings_is_closed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = Secrets::new();
    let keepalive = Extra {
        agent_listen: "    keepalive_interval: 1s\n    keepalive_timeout: 1s\n",
        ..Extra::default()
    };
    let kas = KasProc::start_extra(&s, "kas", None, 10_000, keepalive, None).await;
    let mut c = tokio::net::TcpStream::connect(kas.agent).await.unwrap();
    // The preface and an empty SETTINGS frame; then nothing, not even ACKs.
    c.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let mut buf = [0u8; 256];
    let closed = tokio::time::timeout(Duration::from_secs(15), async {
        loop {
            match c.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {} // kas's SETTINGS, its ACK of ours, its PINGs
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "kas closed the unresponsive connection");
    // Past the preface timeout (10 s by default) is not what closed it.
    assert!(
        started.elapsed() < Duration::from_secs(9),
        "{:?}",
        started.elapsed()
    );
}

/// A tunnel kept busy by one short call after another for longer than
/// `agent.heartbeat_timeout` (3 s here) reports its agent's frames and stays open: kas took
/// such a tunnel for silent and closed it mid-call (found by the simulation, steady seed
/// 153 of 5,000), since each call started its activity clock afresh.
#[tokio::test(flavor = "multi_thread")]
async fn a_tunnel_busy_with_back_to_back_calls_is_not_taken_for_silent() {
    let s = Secrets::new();
    let kas = KasProc::start(&s, "kas", None, 10_000, "").await;
    let _agent =
        TestAgent::connect_slow(kas.agent, 1, "agent1-pod", 1, Duration::from_millis(100)).await;
    let gl = GitLab::new(&s, kas.api).await;
    eventually(Duration::from_secs(10), "agent 1 listed", || async {
        gl.connections(1).await.ok().filter(|c| c.len() == 1)
    })
    .await;
    // Two callers, one tunnel: the next call is always waiting when one ends.
    let until = std::time::Instant::now() + Duration::from_secs(5);
    let caller = |name: &'static str| {
        let gl = &gl;
        async move {
            let mut calls = 0;
            while std::time::Instant::now() < until {
                let pods = gl.pods(1, None, Duration::from_secs(3)).await;
                assert_eq!(
                    pods.map_err(|e| e.to_string()),
                    Ok(vec!["agent1-pod".to_string()]),
                    "{name}'s call {calls}"
                );
                calls += 1;
            }
            calls
        }
    };
    let (a, b) = tokio::join!(caller("first"), caller("second"));
    assert!(
        a + b >= 20,
        "{a} + {b} calls in 5 s: the tunnel was not kept busy"
    );
}

/// A caller that opens a log stream and stops reading it does not hold the agent's tunnel
/// past the call's end, on the local route or the remote one: the answer's channels fill
/// up, and a tunnel waited for room without a bound, so on the local route it stayed busy
/// for as long as the caller kept its stream open (on the remote route the router's grace
/// ended the forward). Now every wait for room ends with the deadline and its grace, and
/// the tunnel, whose answer was not drained, is closed.
#[tokio::test(flavor = "multi_thread")]
async fn a_log_stream_left_unread_does_not_hold_the_tunnel() {
    use kas_proto::pods::LogChunk;
    use kas_server::kas::observability::gauge;
    use prost::Message;
    let redis = Redis::start().expect("redis-server starts (scripts/test installs it)");
    let s = Secrets::new();
    let holder = KasProc::start(&s, "kas0", Some(&redis), 10_000, "").await;
    let router = KasProc::start(&s, "kas1", Some(&redis), 10_000, "").await;
    // 32 MiB of log per call: more than every window and channel on the way can hold.
    let _agent = RawAgent::start(&holder, 1, 2, |id| {
        let chunk = LogChunk {
            data: vec![b'x'; 512 << 10],
        }
        .encode_to_vec();
        (0..64)
            .map(|_| frames::message(id, chunk.clone()))
            .chain([frames::trailer(id, &tonic::Status::ok(""))])
            .collect()
    })
    .await;
    let mut unread = Vec::new();
    for kas in [&holder, &router] {
        let gl = GitLab::new(&s, kas.api).await;
        eventually(Duration::from_secs(10), "agent 1 listed", || async {
            gl.connections(1).await.ok().filter(|c| c.len() == 1)
        })
        .await;
        let mut stream = gl
            .log_stream(1, "pod", Duration::from_secs(2))
            .await
            .expect("the stream opens");
        let first = stream.message().await.expect("a first chunk");
        assert_eq!(first.map(|c| c.data.len()), Some(512 << 10));
        unread.push((gl, stream));
    }
    // Deadline 2 s, then TUNNEL_GRACE and ROUTE_GRACE (2 s each): well within 10 s.
    for (name, kas) in [("kas0", &holder), ("kas1", &router)] {
        eventually(
            Duration::from_secs(10),
            &format!("{name} ends the unread calls"),
            || async { (gauge(&kas.metrics().await, "kas_calls") == Some(0.0)).then_some(()) },
        )
        .await;
    }
    eventually(
        Duration::from_secs(5),
        "kas0 closes both tunnels",
        || async { (gauge(&holder.metrics().await, "kas_tunnels") == Some(0.0)).then_some(()) },
    )
    .await;
    drop(unread);
}

/// Second round, item 8: a delivered unary call the agent never answers ends
/// `DEADLINE_EXCEEDED` through a remote kas too (tonic's timer answered `CANCELLED` first),
/// and a call meanwhile through the kas holding the agent's only tunnel is told it was
/// busy, through that kas and through the other alike (it read "not connected" there).
#[tokio::test(flavor = "multi_thread")]
async fn an_unanswered_call_through_a_remote_kas_ends_deadline_exceeded() {
    let redis = Redis::start().expect("redis-server starts (scripts/test installs it)");
    let s = Secrets::new();
    let holder = KasProc::start(&s, "kas0", Some(&redis), 10_000, "").await;
    let router = KasProc::start(&s, "kas1", Some(&redis), 10_000, "").await;
    let agent = RawAgent::start(&holder, 2, 1, |_| Vec::new()).await;
    let (local, remote) = (
        GitLab::new(&s, holder.api).await,
        GitLab::new(&s, router.api).await,
    );
    eventually(Duration::from_secs(10), "agent 2 listed", || async {
        remote.connections(2).await.ok().filter(|c| c.len() == 1)
    })
    .await;
    let unanswered =
        tokio::spawn(async move { remote.pods(2, None, Duration::from_millis(2500)).await });
    eventually(Duration::from_secs(5), "the call delivered", || async {
        (agent.received() == 1).then_some(())
    })
    .await;
    // Within the tunnel's heartbeat timeout (3 s): this agent sends no heartbeats.
    let other = GitLab::new(&s, router.api).await;
    let wait = Duration::from_millis(1000);
    let (here, there) = tokio::join!(local.pods(2, None, wait), other.pods(2, None, wait));
    for err in [here, there] {
        let err = err.expect_err("the only tunnel is busy");
        assert_eq!(err.code(), Code::DeadlineExceeded, "{err}");
        assert!(err.message().contains("was busy"), "{err}");
    }
    let err = unanswered.await.unwrap().expect_err("never answered");
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err}");
}

/// Second round, item 8: kasctl's client gives up at its own deadline when kas stops
/// answering (frozen, its connection open), as a Go gRPC client does.
#[tokio::test(flavor = "multi_thread")]
async fn the_api_client_gives_up_at_its_deadline_when_kas_stops_answering() {
    let s = Secrets::new();
    let kas = KasProc::start(&s, "kas", None, 10_000, "").await;
    let gl = GitLab::new(&s, kas.api).await;
    gl.connections(1).await.expect("kas answers");
    let client = kas_client::api_client::ApiClient::connect(
        &kas.api.to_string(),
        &s.gitlab,
        Duration::from_secs(2),
    )
    .await
    .expect("connects");
    kas.freeze(true);
    let started = std::time::Instant::now();
    let answer = tokio::time::timeout(Duration::from_secs(10), client.agents_by_id(1)).await;
    let took = started.elapsed();
    kas.freeze(false);
    let err = answer
        .expect("gave up by itself")
        .expect_err("kas is frozen");
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err}");
    assert!(took < Duration::from_secs(3), "gave up after {took:?}");
}
