//! A misbehaving agent: each call it receives gets one misbehaviour, drawn at random (see
//! [`Misbehaviour`]) — an `Error` frame, which only a kas may send (kas's "not
//! delivered"; an outside probe once made kas deliver such a call four times), a second
//! trailer, an answer without a message, an answer after the deadline, silence (with
//! heartbeats) until kas gives up, or a disconnection mid-call. Every call it receives is
//! recorded in the ground truth, so a kas that took any of these for a refusal and offered
//! the call again shows as a second delivery (inv 3), and one that waited on it too long
//! as a late end or a tunnel held past the deadline (inv 2).
//!
//! It speaks the tunnel protocol frame by frame, reopening each tunnel kas closes for the
//! violation, and heartbeats like agentk.

use crate::truth::pod_name;
use crate::truth::{Delivery, Truth};
use kas_agent::{AgentClient, PODS_LIST, PODS_LOGS};
use kas_proto::agent_api::agent_api_client::AgentApiClient;
use kas_proto::frame::{Descriptor, Frame, frame::Kind};
use kas_proto::pods::{ListRequest, ListResponse, LogChunk, Pod};
use kas_transport::frames;
use prost::Message;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

/// Tunnels the rogue agent keeps open.
const TUNNELS: usize = 2;

/// What the rogue agent does with a call it received.
#[derive(Clone, Copy, Debug)]
enum Misbehaviour {
    /// Answers with an `Error` frame.
    ErrorFrame,
    /// Answers, then sends a second trailer.
    SecondTrailer,
    /// Sends a trailer without any message (a unary call needs one).
    EmptyAnswer,
    /// Answers 6 s later: past every caller's deadline (at most 5 s) and kas's grace.
    TooLate,
    /// Never answers, heartbeating on, until kas closes the tunnel; records when.
    Silent,
    /// Drops the tunnel mid-call.
    Disconnect,
}

impl Misbehaviour {
    fn draw() -> Self {
        use madsim::rand::{Rng, thread_rng};
        match thread_rng().gen_range(0..6) {
            0 => Misbehaviour::ErrorFrame,
            1 => Misbehaviour::SecondTrailer,
            2 => Misbehaviour::EmptyAnswer,
            3 => Misbehaviour::TooLate,
            4 => Misbehaviour::Silent,
            _ => Misbehaviour::Disconnect,
        }
    }
}

/// A call left unanswered; dropped with its tunnel, it records when.
struct Unanswered(Truth, String);

impl Drop for Unanswered {
    fn drop(&mut self) {
        self.0.release(&self.1);
    }
}

/// Runs the rogue replica 0 of `agent` against the kas at `kas` until the node is killed.
pub async fn run(kas: SocketAddr, token: String, agent: i64, truth: Truth) {
    loop {
        if let Ok(channel) = Endpoint::from_shared(format!("http://{kas}"))
            .expect("a valid address")
            .connect()
            .await
        {
            serve(channel, &token, agent, &truth).await;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// One connection: `GetConfiguration`, then tunnels until the configuration stream ends.
async fn serve(channel: Channel, token: &str, agent: i64, truth: &Truth) {
    let client = AgentClient::new(channel.clone(), token);
    let Ok((connection, _, mut config)) = client.connect(Default::default(), None).await else {
        return;
    };
    let tunnels: Vec<_> = (0..TUNNELS)
        .map(|_| {
            let (channel, token, truth) = (channel.clone(), token.to_string(), truth.clone());
            tokio::spawn(async move {
                loop {
                    tunnel(channel.clone(), &token, connection.0, agent, &truth).await;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            })
        })
        .collect();
    while let Ok(Some(_)) = config.message().await {}
    for t in tunnels {
        t.abort();
    }
}

/// One tunnel, until kas closes it.
async fn tunnel(channel: Channel, token: &str, connection: i64, agent: i64, truth: &Truth) {
    let (tx, rx) = mpsc::channel::<Frame>(8);
    let descriptor = frames::frame(Kind::Descriptor(Descriptor {
        methods: vec![PODS_LIST.into(), PODS_LOGS.into()],
        connection_id: connection,
        ..Default::default()
    }));
    if tx.send(descriptor).await.is_err() {
        return;
    }
    let mut req = tonic::Request::new(ReceiverStream::new(rx));
    let Ok(bearer) = format!("Bearer {token}").parse() else {
        return;
    };
    req.metadata_mut().insert("authorization", bearer);
    let Ok(resp) = AgentApiClient::new(channel).open_tunnel(req).await else {
        return;
    };
    let mut inbound = resp.into_inner();
    let mut beat = tokio::time::interval(Duration::from_millis(500));
    let mut marker = None;
    // Whether the call is a log stream (its answer is a chunk, not a pod list).
    let mut streaming = false;
    // The unanswered call, while silent: released when the tunnel ends, however it ends.
    let mut _silent: Option<Unanswered> = None;
    loop {
        let frame = tokio::select! {
            biased;
            f = inbound.message() => f,
            _ = beat.tick() => {
                let _ = tx.send(frames::heartbeat(0)).await;
                continue;
            }
        };
        let Ok(Some(frame)) = frame else { return };
        match frame.kind {
            Some(Kind::RequestStart(start)) => streaming = start.method == PODS_LOGS,
            Some(Kind::Message(m)) => {
                // A log request's namespace is its field 1 too.
                marker = ListRequest::decode(m.data).ok().map(|r| r.namespace);
            }
            Some(Kind::CloseSend(c)) => {
                let marker = marker.take().unwrap_or_default();
                truth.record(Delivery {
                    marker: marker.clone(),
                    agent,
                    replica: 0,
                    at: Instant::now(),
                });
                let id = c.request_id;
                let ok = tonic::Status::ok("");
                let pods = ListResponse {
                    pods: vec![Pod {
                        name: pod_name(agent, 0),
                        ..Default::default()
                    }],
                };
                let chunk = LogChunk {
                    data: pod_name(agent, 0).into_bytes(),
                };
                let answer = || {
                    if streaming {
                        frames::message(id, chunk.encode_to_vec())
                    } else {
                        frames::message(id, pods.encode_to_vec())
                    }
                };
                let frames = match Misbehaviour::draw() {
                    Misbehaviour::ErrorFrame => {
                        let refusal = tonic::Status::unavailable(format!(
                            "connection {connection} is not connected"
                        ));
                        vec![frames::error(id, &refusal)]
                    }
                    Misbehaviour::SecondTrailer => {
                        vec![answer(), frames::trailer(id, &ok), frames::trailer(id, &ok)]
                    }
                    Misbehaviour::EmptyAnswer => vec![frames::trailer(id, &ok)],
                    Misbehaviour::TooLate => {
                        tokio::time::sleep(Duration::from_secs(6)).await;
                        vec![answer(), frames::trailer(id, &ok)]
                    }
                    Misbehaviour::Silent => {
                        truth.hold(marker.clone());
                        _silent = Some(Unanswered(truth.clone(), marker));
                        continue;
                    }
                    Misbehaviour::Disconnect => return,
                };
                for f in frames {
                    let _ = tx.send(f).await;
                }
            }
            _ => {}
        }
    }
}
