//! A greedy agent: takes every place kas's limits give one agent on one kas, gives back
//! some, in random order, and takes them again, round after round, judging kas's counts
//! (invariant 10): holding `n` connections (or tunnels on one connection) it must be given
//! exactly `max - n` more, each within [`RELEASE_BOUND`] of its place being given back,
//! and then refused, naming the limit. One more accepted is a place counted twice or
//! given back early; one fewer is a place leaked. A round in which anything else happens
//! (a refusal for another reason, a held stream ending: its kas stopped or died) is not
//! judged.

use crate::truth::Truth;
use kas_agent::{AgentClient, PODS_LIST};
use kas_proto::agent_api::agent_api_client::AgentApiClient;
use kas_proto::frame::{Descriptor, Frame, frame::Kind};
use kas_proto::registry::AgentMeta;
use kas_transport::frames;
use madsim::rand::{Rng, thread_rng};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

/// `agent.max_connections_per_agent` in the simulation.
pub const CONNECTIONS: usize = 8;
/// `agent.max_tunnels_per_connection` in the simulation.
pub const TUNNELS: usize = 16;
/// How long kas may take to count a place given back (the stream's end reaching it, with
/// a clogged link's retransmissions: up to twice the longest clog, 4 s).
const RELEASE_BOUND: Duration = Duration::from_secs(10);

/// Why a round stopped before its end.
enum Stop {
    /// Something the round does not judge happened.
    Void,
    /// kas's count was wrong.
    Wrong(String),
}

/// A held stream: its task (aborted to give the place back), whether it ended by itself,
/// and the connection id kas gave it (a connection's).
struct Held {
    task: JoinHandle<()>,
    ended: Arc<AtomicBool>,
    connection: i64,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What the round takes places of.
#[derive(Clone, Copy)]
enum Limit {
    Connections,
    Tunnels,
}

impl Limit {
    fn max(self) -> usize {
        match self {
            Limit::Connections => CONNECTIONS,
            Limit::Tunnels => TUNNELS,
        }
    }

    fn key(self) -> &'static str {
        match self {
            Limit::Connections => "agent.max_connections_per_agent",
            Limit::Tunnels => "agent.max_tunnels_per_connection",
        }
    }
}

/// Runs the greedy agent `agent` against the kas at `kas` until the node is killed; each
/// wrong count is recorded in `truth`.
pub async fn run(kas: SocketAddr, token: String, agent: i64, truth: Truth) {
    loop {
        // Rounds far enough apart to stay within the agent's request rate.
        let pause = thread_rng().gen_range(3_000..8_000);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let Ok(channel) = Endpoint::from_shared(format!("http://{kas}"))
            .expect("a valid address")
            .connect()
            .await
        else {
            continue;
        };
        if let Err(Stop::Wrong(what)) = round(&channel, &token).await {
            truth.violation(format!("inv 10: agent {agent} on kas at {kas}: {what}"));
        }
    }
}

/// One round: connections, then tunnels on one of them.
async fn round(channel: &Channel, token: &str) -> Result<(), Stop> {
    let client = AgentClient::new(channel.clone(), token);
    let mut connections = Vec::new();
    fill(&mut connections, Limit::Connections, || async {
        let meta = AgentMeta {
            pod_name: "greedy".into(),
            ..Default::default()
        };
        let (id, _, mut stream) = client.connect(meta, None).await?;
        let reading = async move { while let Ok(Some(_)) = stream.message().await {} };
        Ok(hold(reading, id.0))
    })
    .await?;
    let connection = connections.first().map_or(0, |c| c.connection);
    let mut tunnels = Vec::new();
    fill(&mut tunnels, Limit::Tunnels, || {
        tunnel(channel.clone(), token.to_string(), connection)
    })
    .await?;
    if connections
        .iter()
        .chain(&tunnels)
        .any(|h| h.ended.load(Ordering::Relaxed))
    {
        return Err(Stop::Void);
    }
    Ok(())
}

/// Takes every place of `limit` (until refused for it), gives back a random number of
/// them and takes them again.
async fn fill<F, Fut>(held: &mut Vec<Held>, limit: Limit, mut open: F) -> Result<(), Stop>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Held, Status>>,
{
    take_all(held, limit, &mut open).await?;
    let give_back = thread_rng().gen_range(1..=held.len());
    for _ in 0..give_back {
        let i = thread_rng().gen_range(0..held.len());
        held.swap_remove(i);
    }
    take_all(held, limit, &mut open).await
}

/// Takes places of `limit` until `held` holds its maximum, waiting up to
/// [`RELEASE_BOUND`] for places given back to be counted; then one more must be refused.
async fn take_all<F, Fut>(held: &mut Vec<Held>, limit: Limit, open: &mut F) -> Result<(), Stop>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Held, Status>>,
{
    let deadline = Instant::now() + RELEASE_BOUND;
    loop {
        if held.iter().any(|h| h.ended.load(Ordering::Relaxed)) {
            return Err(Stop::Void);
        }
        let full = held.len() >= limit.max();
        match open().await {
            Ok(h) if full => {
                drop(h);
                // kas may have closed a held stream meanwhile (a tunnel whose heartbeats a
                // clock jump or a clog held back) and told this agent, which has yet to
                // read it: then its place was free.
                if any_ends(held).await {
                    return Err(Stop::Void);
                }
                return Err(Stop::Wrong(format!(
                    "holding {} places of {} (its maximum), one more was given",
                    held.len(),
                    limit.key()
                )));
            }
            Ok(h) => held.push(h),
            Err(s) if !refused_by(&s, limit) => return Err(Stop::Void),
            Err(_) if full => return Ok(()),
            Err(s) if Instant::now() >= deadline => {
                return Err(Stop::Wrong(format!(
                    "holding {} places of {} (maximum {}), one more was refused {RELEASE_BOUND:?} after the others were given back: {}",
                    held.len(),
                    limit.key(),
                    limit.max(),
                    s.message()
                )));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Whether one of `held` ends by itself within [`RELEASE_BOUND`].
async fn any_ends(held: &[Held]) -> bool {
    let deadline = Instant::now() + RELEASE_BOUND;
    while Instant::now() < deadline {
        if held.iter().any(|h| h.ended.load(Ordering::Relaxed)) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// Whether `status` is kas's refusal for `limit`.
fn refused_by(status: &Status, limit: Limit) -> bool {
    status.code() == Code::ResourceExhausted && status.message().contains(limit.key())
}

/// Runs `stream` (a held stream's reading) in a task, noting when it ends by itself.
fn hold(stream: impl std::future::Future<Output = ()> + Send + 'static, connection: i64) -> Held {
    let ended = Arc::new(AtomicBool::new(false));
    let flag = ended.clone();
    let task = tokio::spawn(async move {
        stream.await;
        flag.store(true, Ordering::Relaxed);
    });
    Held {
        task,
        ended,
        connection,
    }
}

/// Opens a tunnel of `connection`, heartbeating, serving nothing (no call names this
/// agent).
async fn tunnel(channel: Channel, token: String, connection: i64) -> Result<Held, Status> {
    let (tx, rx) = mpsc::channel::<Frame>(8);
    let descriptor = frames::frame(Kind::Descriptor(Descriptor {
        methods: vec![PODS_LIST.into()],
        connection_id: connection,
        ..Default::default()
    }));
    let _ = tx.send(descriptor).await;
    let mut req = tonic::Request::new(ReceiverStream::new(rx));
    let bearer = format!("Bearer {token}")
        .parse()
        .map_err(|_| Status::internal("the token is not a header value"))?;
    req.metadata_mut().insert("authorization", bearer);
    let mut inbound = AgentApiClient::new(channel)
        .open_tunnel(req)
        .await?
        .into_inner();
    Ok(hold(
        async move {
            let mut beat = tokio::time::interval(Duration::from_millis(500));
            loop {
                tokio::select! {
                    f = inbound.message() => if !matches!(f, Ok(Some(_))) { return },
                    _ = beat.tick() => { let _ = tx.send(frames::heartbeat(0)).await; }
                }
            }
        },
        connection,
    ))
}
