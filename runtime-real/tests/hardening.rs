//! What an outside probe broke, each reproduced against kas processes on loopback: a
//! misbehaving agent, oversized agent metadata, JWT claims, limits and timeouts.

mod support;

use kas_proto::frame::{Descriptor, Frame, frame::Kind};
use kas_runtime::agent::AgentClient;
use kas_runtime::frames;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
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
        let (connection, _, mut config) = client.connect(Default::default()).await.unwrap();
        let received = Arc::new(AtomicUsize::new(0));
        let mut tasks = vec![tokio::spawn(async move {
            while let Ok(Some(_)) = config.message().await {}
        })];
        for _ in 0..tunnels {
            let mut api = kas_proto::agent_api::agent_api_client::AgentApiClient::new(
                channel(kas.agent).await,
            );
            let (tx, rx) = tokio::sync::mpsc::channel(8);
            let descriptor = frames::frame(Kind::Descriptor(Descriptor {
                methods: vec![kas_runtime::agent::PODS_LIST.into()],
                connection_id: connection.0,
            }));
            tx.send(descriptor).await.unwrap();
            let mut req = tonic::Request::new(ReceiverStream::new(rx));
            req.metadata_mut().insert(
                "authorization",
                format!("Bearer {}", agent_token(agent)).parse().unwrap(),
            );
            let mut inbound = api.open_tunnel(req).await.unwrap().into_inner();
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
    use kas_proto::registry::AgentMeta;
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
    ];
    for (field, meta) in cases {
        let err = client.connect(meta).await.expect_err(field);
        assert_eq!(err.code(), Code::InvalidArgument, "{field}: {err}");
        assert!(err.message().starts_with(field), "{field}: {err}");
    }
    // At the limits, accepted and listed.
    let fits = AgentMeta {
        version: long(64),
        commit: long(64),
        pod_namespace: long(63),
        pod_name: long(253),
    };
    let (_connection, _, _config) = client.connect(fits).await.expect("within limits");
    let gl = GitLab::new(&s, kas.api).await;
    let listed = eventually(Duration::from_secs(10), "agent 1 listed", || async {
        gl.connections(1).await.ok().filter(|c| !c.is_empty())
    })
    .await;
    assert_eq!(listed.len(), 1, "only the valid connection: {listed:?}");
    assert_eq!(listed[0].1.len(), 253);
}
