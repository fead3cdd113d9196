//! One agent tunnel on the kas side: a task that owns the stream, echoes heartbeats while
//! idle, carries one call at a time when the engine hands it one, and ends it when the
//! agent asks (`Closing`) and no call is on it.

use super::call::{Delivery, Responses};
use super::handle::{EngineHandle, TunnelOrder};
use super::limits::Place;
use super::stopping::{Phase, Stop};
use super::timing::TUNNEL_GRACE;
use crate::buggify::{self, Point};
use kas_core::frame_sequence::{Direction, FrameSequence, Progress};
use kas_core::node::NodeInput;
use kas_core::{AgentId, ConnectionId, RequestId, TunnelId};
use kas_proto::frame::{Frame, frame::Kind};
use kas_transport::channel_ends::recv;
use kas_transport::clock;
use kas_transport::frames;
use kas_transport::traces::{self, KeyValue, TraceContextExt};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::StreamExt;
use tokio_stream::adapters::Map;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

/// One message (or the closing status) of a response stream to the agent, boxed.
pub type Outgoing<T> = Box<Result<T, Status>>;

/// A response stream to the agent, as the agent API returns it.
pub type OutboundStream<T> = Map<ReceiverStream<Outgoing<T>>, fn(Outgoing<T>) -> Result<T, Status>>;

/// A channel for `n` messages to the agent, and its receiving stream. Boxed: a tokio
/// channel allocates its first block of 32 slots up front, and a stream that sends a
/// few small messages in its life should not pay for 32 large ones (found measuring kas
/// memory per agent and per idle tunnel).
pub fn outbound<T>(n: usize) -> (mpsc::Sender<Outgoing<T>>, OutboundStream<T>) {
    let (tx, rx) = mpsc::channel(n);
    let unbox: fn(Outgoing<T>) -> Result<T, Status> = |b| *b;
    (tx, ReceiverStream::new(rx).map(unbox))
}

/// Everything the tunnel task needs.
pub struct Tunnel {
    /// Its id.
    pub id: TunnelId,
    /// The agent replica that opened it.
    pub connection: ConnectionId,
    /// Frames from the agent (the descriptor already read).
    pub inbound: Streaming<Frame>,
    /// Frames to the agent.
    pub outbound: mpsc::Sender<Outgoing<Frame>>,
    /// Calls from the engine; closed when the engine drops the tunnel.
    pub orders: mpsc::Receiver<Box<TunnelOrder>>,
    /// The checker, past the descriptor.
    pub sequence: FrameSequence,
    /// The engine.
    pub engine: EngineHandle,
    /// Report activity to the engine at most this often.
    pub activity_every: Duration,
    /// Turns true when kas sends its agents away.
    pub stop: Stop,
    /// Its place under `agent.max_tunnels_per_connection`, held while it runs.
    pub _slot: Place<(AgentId, ConnectionId)>,
}

enum End {
    /// The agent closed the stream or it broke.
    Gone,
    /// A streaming call's caller went away: the tunnel ends at once, and cleanly, so that
    /// the agent stops the call (as it does when GitLab kas cancels a tunnel) and opens a
    /// fresh tunnel without backing off. Waiting for the agent to end the call would hold
    /// the tunnel, perhaps its agent's only one, with nobody to answer.
    CallerGone,
    /// The agent asked kas to end the tunnel, and no call is on it.
    Closed,
    /// The engine dropped the tunnel (missed heartbeats, shutdown, connection ended).
    Dropped,
    /// The agent broke the protocol or overran a deadline: close the stream with this.
    Fault(Status),
}

impl Tunnel {
    /// Runs until the tunnel ends, then tells the engine, once.
    pub async fn run(mut self) {
        let (end, call) = self.serve().await;
        // Closed before the call it carried ends, so that the tunnel is never offered again.
        self.engine.input(NodeInput::TunnelClosed(self.id));
        if let Some(request) = call {
            self.engine.input(NodeInput::CallDone(request));
        }
        // Calls handed over after the end never reached the agent: offer them elsewhere.
        self.orders.close();
        while let Ok(order) = self.orders.try_recv() {
            self.engine.input(NodeInput::Bounced(order.request));
        }
        let status = match end {
            End::Gone => return,
            End::CallerGone => {
                tracing::debug!(tunnel = %self.id, "the caller went away: tunnel ended");
                return;
            }
            End::Closed => {
                tracing::debug!(tunnel = %self.id, "the agent closed its tunnel");
                return;
            }
            End::Dropped if self.stop.reached(Phase::Leaving) => {
                Status::unavailable("kas is shutting down: reconnect to another kas")
            }
            End::Dropped => Status::unavailable("tunnel closed by kas: reconnect"),
            End::Fault(s) => s,
        };
        tracing::info!(tunnel = %self.id, reason = %status.message(), "closing tunnel");
        let _ = self.outbound.send(Box::new(Err(status))).await;
    }

    /// Serves until the tunnel ends; with the call it was carrying then, if any.
    async fn serve(&mut self) -> (End, Option<RequestId>) {
        let mut last_report = Instant::now();
        loop {
            tokio::select! {
                biased;
                order = self.orders.recv() => match order {
                    None => return (End::Dropped, None),
                    Some(order) => {
                        let request = order.request;
                        // Boxed: a call's state is most of the task's, and an idle
                        // tunnel should not hold room for it (2.9 KiB a tunnel unboxed).
                        match Box::pin(self.carry(order, &mut last_report)).await {
                            Ok(()) if self.sequence.is_closing() => return (End::Closed, Some(request)),
                            Ok(()) => self.engine.input(NodeInput::CallDone(request)),
                            Err(end) => return (end, Some(request)),
                        }
                    }
                },
                frame = self.inbound.message() => {
                    let frame = match frame {
                        Ok(Some(f)) => f,
                        Ok(None) | Err(_) => return (End::Gone, None),
                    };
                    if let Err(e) = self.sequence.check(Direction::FromAgent, &frame) {
                        return (End::Fault(Status::invalid_argument(format!("tunnel protocol error: {e}"))), None);
                    }
                    let hb = match frame.kind {
                        Some(Kind::Heartbeat(hb)) => hb,
                        // No call is on it: kas ends it, and never offers it again.
                        Some(Kind::Closing(_)) => return (End::Closed, None),
                        _ => return (End::Fault(Status::invalid_argument("tunnel protocol error: call frame while idle")), None),
                    };
                    let _ = self.outbound.try_send(Box::new(Ok(frames::heartbeat(hb.sequence))));
                    self.report_activity(&mut last_report, true);
                },
                () = self.stop.until(Phase::Leaving) => return (End::Dropped, None),
            }
        }
    }

    fn report_activity(&self, last: &mut Instant, force: bool) {
        if force || last.elapsed() >= self.activity_every {
            *last = Instant::now();
            self.engine.input(NodeInput::TunnelActivity(self.id));
        }
    }

    /// Carries one call: request frames down, answer frames up, until the trailer.
    /// `last_report` spans calls: a tunnel kept busy by one short call after another must
    /// still report its agent's frames, or kas takes it for silent and closes it mid-call.
    ///
    /// Both ways flow at once (a streaming call's request goes on while its answer
    /// streams), each through a one-frame slot, so that neither way waits on the other:
    /// an agent blocked sending its answer while kas blocks sending it request frames would
    /// hold the tunnel forever.
    async fn carry(
        &mut self,
        order: Box<TunnelOrder>,
        last_report: &mut Instant,
    ) -> Result<(), End> {
        let TunnelOrder { request, call } = *order;
        let id = request.0;
        let agent = call.agent;
        let streaming = call.is_streaming();
        let responses = call.responses.clone();
        buggify::pause(Point::TunnelBeforeFirstFrame).await;
        // A streaming call's deadline bounded its routing only: it runs until either end
        // ends it (the tunnel ends with it when its caller goes).
        let mut give_up =
            (!streaming).then(|| Instant::now() + clock::until(call.deadline) + TUNNEL_GRACE);
        if traces::on() {
            let span = call.trace.span();
            span.add_event(
                "handed to a tunnel",
                vec![KeyValue::new("kas.agent_connection_id", self.connection.0)],
            );
            // On the kas that routed it, the routing is over; a forwarded call's span
            // here is the whole call's.
            if call.start.hops == 0 {
                span.end();
            }
        }
        // A streaming call is delivered from here on: off the router's clock, and the
        // routing kas, if it came from one, hears so and streams the rest of its request.
        if streaming {
            self.engine.input(NodeInput::Delivered(request));
            if call.start.hops > 0 {
                // The channel is fresh, so there is room.
                let _ = responses.try_send(Ok(frames::delivered(id, self.connection.0)));
            } else {
                call.delivered_to.set(Delivery {
                    kas: None,
                    connection: Some(self.connection),
                });
            }
        }
        let mut rest = match &call.rest {
            Some(rest) => match rest.take() {
                Some(rx) => Some(rx),
                None => {
                    let status = Status::internal("kas delivered a streaming call twice");
                    hand(&responses, Err(status), give_up).await;
                    return Err(End::Fault(Status::internal("kas sent a malformed call")));
                }
            },
            None => None,
        };
        for frame in call.frames_to_agent(id) {
            self.send_down(frame, &responses, give_up).await?;
        }
        let outbound = self.outbound.clone();
        let mut to_agent: Option<Frame> = None;
        let mut to_caller: Option<Frame> = None;
        let mut caller_gone = false;
        let mut finished = false;
        loop {
            tokio::select! {
                biased;
                order = self.orders.recv() => match order {
                    None => {
                        hand(&responses, Err(Status::unknown("the agent's tunnel was closed during the call, which the agent may have received")), give_up).await;
                        return Err(End::Dropped);
                    }
                    Some(other) => {
                        // Never sent while a call is running; refuse it rather than mix calls.
                        self.engine.input(NodeInput::Bounced(other.request));
                    }
                },
                () = until(give_up) => {
                    if caller_gone {
                        return Err(End::Fault(Status::cancelled("the caller went away and the agent did not end the call")));
                    }
                    hand(&responses, Err(Status::deadline_exceeded(format!("agent {agent} did not answer by the deadline"))), give_up).await;
                    return Err(End::Fault(Status::deadline_exceeded("call overran its deadline")));
                }
                () = responses.closed(), if streaming && !caller_gone => return Err(End::CallerGone),
                permit = responses.reserve(), if to_caller.is_some() => match permit {
                    Ok(permit) => permit.send(Ok(to_caller.take().expect("guarded"))),
                    Err(_) => {
                        // Gone: keep draining, the tunnel is reused after the trailer.
                        caller_gone = true;
                        (rest, to_caller) = (None, None);
                    }
                },
                permit = outbound.reserve(), if to_agent.is_some() => match permit {
                    Ok(permit) => permit.send(Box::new(Ok(to_agent.take().expect("guarded")))),
                    Err(_) => {
                        hand(&responses, Err(agent_lost()), give_up).await;
                        return Err(End::Gone);
                    }
                },
                frame = recv(&mut rest), if to_agent.is_none() && !finished => match frame {
                    Some(frame) => {
                        let frame = frames::with_request_id(frame, id);
                        Self::check_down(&mut self.sequence, &frame, &responses, give_up).await?;
                        to_agent = Some(frame);
                    }
                    None => {
                        rest = None;
                        if !self.sequence.request_closed() {
                            // The caller dropped its request without closing it: its end
                            // of the call is gone, whatever it still reads.
                            caller_gone = true;
                            to_caller = None;
                            give_up = Some(Instant::now() + TUNNEL_GRACE);
                        }
                    }
                },
                frame = buggify::read(self.inbound.message()), if to_caller.is_none() && !finished => {
                    let (frame, progress) = Self::up(&mut self.sequence, frame, agent, &responses, give_up).await?;
                    self.report_activity(last_report, false);
                    // A close that crossed this call: the call goes on, and the tunnel ends
                    // after it.
                    if matches!(frame.kind, Some(Kind::Heartbeat(_) | Kind::Closing(_))) {
                        continue;
                    }
                    if let Progress::Finished(_) = progress {
                        finished = true;
                        (rest, to_agent) = (None, None);
                    }
                    if !caller_gone {
                        to_caller = Some(frame);
                    }
                },
            }
            if finished && to_caller.is_none() {
                return Ok(());
            }
        }
    }

    /// Checks a frame kas is about to send the agent; a malformed one fails the call.
    async fn check_down(
        sequence: &mut FrameSequence,
        frame: &Frame,
        responses: &Responses,
        give_up: Option<Instant>,
    ) -> Result<(), End> {
        if let Err(e) = sequence.check(Direction::ToAgent, frame) {
            let status = Status::internal(format!("malformed call: {e}"));
            hand(responses, Err(status), give_up).await;
            return Err(End::Fault(Status::internal("kas sent a malformed call")));
        }
        Ok(())
    }

    /// Checks and sends one of the call's first frames.
    async fn send_down(
        &mut self,
        frame: Frame,
        responses: &Responses,
        give_up: Option<Instant>,
    ) -> Result<(), End> {
        Self::check_down(&mut self.sequence, &frame, responses, give_up).await?;
        // Past the call's opening frame, what was queued before may have reached it.
        let opening = matches!(frame.kind, Some(Kind::RequestStart(_)));
        if self.outbound.send(Box::new(Ok(frame))).await.is_err() {
            let status = if opening { agent_gone() } else { agent_lost() };
            hand(responses, Err(status), give_up).await;
            return Err(End::Gone);
        }
        Ok(())
    }

    /// Checks what the agent sent during a call; what breaks the call fails it.
    async fn up(
        sequence: &mut FrameSequence,
        frame: Result<Option<Frame>, Status>,
        agent: kas_core::AgentId,
        responses: &Responses,
        give_up: Option<Instant>,
    ) -> Result<(Frame, Progress), End> {
        let frame = match frame {
            Ok(Some(f)) => f,
            Err(s) if too_large(&s) => {
                let msg = format!(
                    "agent {agent} answered with a message over agent.max_message_size: {}",
                    s.message()
                );
                hand(responses, Err(Status::resource_exhausted(msg)), give_up).await;
                return Err(End::Fault(Status::resource_exhausted(
                    "message over agent.max_message_size",
                )));
            }
            Ok(None) | Err(_) => {
                hand(responses, Err(agent_lost()), give_up).await;
                return Err(End::Gone);
            }
        };
        match sequence.check(Direction::FromAgent, &frame) {
            Ok(progress) => Ok((frame, progress)),
            Err(e) => {
                let msg = format!("agent {agent} broke the tunnel protocol: {e}");
                hand(responses, Err(Status::internal(msg)), give_up).await;
                Err(End::Fault(Status::invalid_argument(format!(
                    "tunnel protocol error: {e}"
                ))))
            }
        }
    }
}

/// True for tonic's refusal of a message over the decoding limit.
pub fn too_large(status: &Status) -> bool {
    status.code() == tonic::Code::OutOfRange && status.message().contains("too large")
}

/// Hands the error that ends a call to the caller, waiting for room until `by` (or
/// [`TUNNEL_GRACE`] for a streaming call) at the latest. A caller that stops reading its
/// answer (a log stream left unread) fills the answer's channel: waiting without a bound
/// kept the tunnel busy for as long as the caller held its stream open.
async fn hand(responses: &Responses, item: Result<Frame, Status>, by: Option<Instant>) {
    let by = by.unwrap_or_else(|| Instant::now() + TUNNEL_GRACE);
    let left = by.saturating_duration_since(Instant::now());
    let _ = tokio::time::timeout(left, responses.send(item)).await;
}

/// Resolves at `at`, never without one.
async fn until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The tunnel went before the call's opening frame could be queued on it: nothing
/// reached the agent (`Unavailable`: not delivered).
fn agent_gone() -> Status {
    Status::unavailable("the agent disconnected before the call reached it")
}

/// The tunnel went during the call: the agent may have received it, so the caller must
/// not take it for a refusal (`Unavailable`) and send it again.
fn agent_lost() -> Status {
    Status::unknown("the agent disconnected during the call, which it may have received")
}
