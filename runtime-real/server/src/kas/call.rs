//! A routed call as the kas runtime carries it between its tasks.

use kas_core::node::Wanted;
use kas_core::{AgentId, ConnectionId, Holder, KasId, Time};
use kas_proto::frame::{Frame, RequestStart, frame::Kind};
use kas_transport::frames;
use kas_transport::traces::{self, Context};
use std::sync::{Arc, Mutex, OnceLock};
use tokio::sync::mpsc;
use tonic::Status;

/// Where the answer of a call goes: response frames (header, messages, trailer), or a
/// status when the call failed before or outside the agent.
pub type Responses = mpsc::Sender<Result<Frame, Status>>;

/// How many request frames of a streaming call wait for delivery before its caller is
/// held back (each at most a message's size).
pub const REST_FRAMES: usize = 16;

/// The rest of a streaming call's request: its frames (messages, then the close-send, each
/// numbered 0) as the caller sends them after the call started. Taken once, by the tunnel
/// or forward that delivers the call; until then the frames wait in the channel, so that a
/// call refused before delivery is offered elsewhere with nothing lost. The sender going
/// away without a close-send means the caller did.
#[derive(Clone, Debug)]
pub struct Rest(Arc<Mutex<Option<mpsc::Receiver<Frame>>>>);

impl Rest {
    /// A channel for the rest of a request: the caller's end, and the call's.
    pub fn channel() -> (mpsc::Sender<Frame>, Rest) {
        let (tx, rx) = mpsc::channel(REST_FRAMES);
        (tx, Rest(Arc::new(Mutex::new(Some(rx)))))
    }

    /// Takes the frames for delivery; `None` if they were taken already (a driver bug: a
    /// call is delivered once).
    pub fn take(&self) -> Option<mpsc::Receiver<Frame>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// One call towards an agent, whichever API it came in on.
#[derive(Clone, Debug)]
pub struct Call {
    /// The wanted agent.
    pub agent: AgentId,
    /// The wanted replica, if any.
    pub connection: Option<ConnectionId>,
    /// The caller's deadline; for a streaming call, the deadline of its routing only.
    pub deadline: Time,
    /// Method, metadata, hop count and whether it streams (its `request_id` is set per
    /// hop).
    pub start: Arc<RequestStart>,
    /// The request frames known when the call started (all of them, close-send included,
    /// unless it streams), buffered so that a call refused by one kas can be offered to
    /// the next.
    pub requests: Arc<Vec<Frame>>,
    /// The rest of a streaming call's request.
    pub rest: Option<Rest>,
    /// Where the answer goes.
    pub responses: Responses,
    /// Where a streaming call was delivered, when its caller asked to know.
    pub delivered_to: DeliveredTo,
    /// The trace span of the hop that routes it here, parent of the next hop's.
    pub trace: Context,
}

/// Where a streaming call was delivered, for whoever routed it here to record (the
/// Kubernetes API's audit log): set once, by the tunnel or forward that delivered it.
#[derive(Clone, Debug, Default)]
pub struct DeliveredTo(Option<Arc<OnceLock<Delivery>>>);

/// The kas and the agent replica that took a call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivery {
    /// The kas holding the tunnel; `None`: this one.
    pub kas: Option<KasId>,
    /// The replica whose tunnel took it, when the serving kas said.
    pub connection: Option<ConnectionId>,
}

impl DeliveredTo {
    /// One that keeps what it is told.
    pub fn watched() -> Self {
        DeliveredTo(Some(Arc::default()))
    }

    /// Records where the call went (the first word stands: a call is delivered once).
    pub fn set(&self, delivery: Delivery) {
        if let Some(cell) = &self.0 {
            let _ = cell.set(delivery);
        }
    }

    /// Where the call went, once it did.
    pub fn get(&self) -> Option<&Delivery> {
        self.0.as_ref()?.get()
    }
}

impl Call {
    /// What the call asks the kas node for.
    pub fn wanted(&self) -> Wanted {
        Wanted {
            agent: self.agent,
            connection: self.connection,
            deadline: self.deadline,
            holder: self.start.holder.map(Holder),
        }
    }

    /// True for a two-way call that lasts for as long as both ends keep it.
    pub fn is_streaming(&self) -> bool {
        self.start.streaming
    }

    /// The call's frames for the kas that serves it (its second and last hop): its start,
    /// numbered `id`, in `trace` (the forward's span), and its buffered request frames,
    /// renumbered.
    pub fn frames_to_kas(&self, id: u64, trace: &Context) -> Vec<Frame> {
        let mut start = RequestStart::clone(&self.start);
        start.hops = 1;
        traces::into_metadata(trace, &mut start.metadata);
        self.frames(id, start)
    }

    /// The call's frames for an agent's tunnel: as to a kas, in the call's trace, less what
    /// only kas reads (the caller's holder digest).
    pub fn frames_to_agent(&self, id: u64) -> Vec<Frame> {
        let mut start = RequestStart::clone(&self.start);
        start.holder = None;
        traces::into_metadata(&self.trace, &mut start.metadata);
        self.frames(id, start)
    }

    fn frames(&self, id: u64, mut start: RequestStart) -> Vec<Frame> {
        start.request_id = id;
        std::iter::once(frames::frame(Kind::RequestStart(start)))
            .chain(
                self.requests
                    .iter()
                    .map(|f| frames::with_request_id(f.clone(), id)),
            )
            .collect()
    }
}
