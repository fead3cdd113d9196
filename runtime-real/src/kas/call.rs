//! A routed call as the kas runtime carries it between its tasks.

use crate::frames;
use kas_core::node::Wanted;
use kas_core::{AgentId, ConnectionId, Time};
use kas_proto::frame::{Frame, RequestStart, frame::Kind};
use std::sync::Arc;
use tokio::sync::mpsc;
use tonic::Status;

/// Where the answer of a call goes: response frames (header, messages, trailer), or a
/// status when the call failed before or outside the agent.
pub type Responses = mpsc::Sender<Result<Frame, Status>>;

/// One call towards an agent, whichever API it came in on.
#[derive(Clone, Debug)]
pub struct Call {
    /// The wanted agent.
    pub agent: AgentId,
    /// The wanted replica, if any.
    pub connection: Option<ConnectionId>,
    /// The caller's deadline.
    pub deadline: Time,
    /// Method, metadata and hop count (its `request_id` is set per hop).
    pub start: RequestStart,
    /// The request messages and the close-send, buffered so that a call refused by one kas
    /// can be offered to the next.
    pub requests: Arc<Vec<Frame>>,
    /// Where the answer goes.
    pub responses: Responses,
}

impl Call {
    /// What the call asks the kas node for.
    pub fn wanted(&self) -> Wanted {
        Wanted {
            agent: self.agent,
            connection: self.connection,
            deadline: self.deadline,
        }
    }

    /// The call's frames for one hop: its start (numbered `id`, with `hops`) and its
    /// buffered request frames, renumbered.
    pub fn frames(&self, id: u64, hops: u32) -> Vec<Frame> {
        let mut start = self.start.clone();
        start.request_id = id;
        start.hops = hops;
        std::iter::once(frames::frame(Kind::RequestStart(start)))
            .chain(
                self.requests
                    .iter()
                    .map(|f| frames::with_request_id(f.clone(), id)),
            )
            .collect()
    }
}
