//! What talks to the engine: its commands, its handle, and the orders it gives a tunnel.
//! A leaf module, so that the engine, the forwarder and the tunnels each depend on it and
//! not on one another.

use super::call::Call;
use kas_core::node::{NodeInput, Origin};
use kas_core::{AgentId, ConnectionId, RequestId, TunnelId};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

/// How many new calls may wait for the engine before more are refused.
pub const CALL_QUEUE: usize = 4096;

/// What the engine is told besides the node's own inputs.
pub enum Command {
    /// An input for the node, as is.
    Node(NodeInput<Call>),
    /// A tunnel sent its descriptor; the reply says whether it was accepted.
    TunnelOpened {
        /// Its id.
        tunnel: TunnelId,
        /// The agent.
        agent: AgentId,
        /// The replica's connection.
        connection: ConnectionId,
        /// Where calls for it go.
        orders: Orders,
        /// Accepted, or why not.
        reply: oneshot::Sender<Result<(), Status>>,
    },
    /// Close every agent connection and delete this kas's records; reply when done. The
    /// engine stops then, ending every task it started.
    Shutdown(oneshot::Sender<()>),
}

/// A cheap, cloneable way to talk to the engine.
#[derive(Clone)]
pub struct EngineHandle {
    control: mpsc::UnboundedSender<Command>,
    calls: mpsc::Sender<Command>,
    next_id: Arc<AtomicU64>,
}

impl EngineHandle {
    /// Sends a command (dropped silently once the engine has stopped).
    pub fn send(&self, cmd: Command) {
        let _ = self.control.send(cmd);
    }

    /// Sends an input to the node (dropped silently once the engine has stopped).
    pub fn input(&self, input: NodeInput<Call>) {
        self.send(Command::Node(input));
    }

    /// Queues a new call, from GitLab (`Public`) or another kas; refused when the queue
    /// is full or the engine has stopped.
    pub fn submit(&self, request: RequestId, origin: Origin, call: Call) -> Result<(), Status> {
        let wanted = call.wanted();
        let input = match origin {
            Origin::Public => NodeInput::Route {
                request,
                wanted,
                call,
            },
            Origin::Private => NodeInput::Serve {
                request,
                wanted,
                call,
            },
        };
        self.calls
            .try_send(Command::Node(input))
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => Status::resource_exhausted(format!(
                    "kas is saturated: its queue of {CALL_QUEUE} calls waiting to be routed is full; retry"
                )),
                mpsc::error::TrySendError::Closed(_) => {
                    Status::unavailable("kas is shutting down")
                }
            })
    }

    /// A fresh call id, unique in this kas.
    pub fn next_request_id(&self) -> RequestId {
        RequestId(self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// The handle of an engine reading `control` and `calls`.
    pub(super) fn new(
        control: mpsc::UnboundedSender<Command>,
        calls: mpsc::Sender<Command>,
    ) -> Self {
        EngineHandle {
            control,
            calls,
            next_id: Arc::new(AtomicU64::new(1)),
        }
    }
}

/// Cancels a call when dropped: held by whoever waits for the call's answer, so that a
/// caller going away frees what the call holds.
pub struct CancelOnDrop(Option<(EngineHandle, RequestId)>);

impl CancelOnDrop {
    /// Arms the guard for `request`.
    pub fn new(engine: EngineHandle, request: RequestId) -> Self {
        CancelOnDrop(Some((engine, request)))
    }

    /// The call ended by itself (its end was received): nothing to cancel.
    pub fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some((engine, request)) = self.0.take() {
            engine.input(NodeInput::Cancel(request));
        }
    }
}

/// Where the engine sends a tunnel its calls. Boxed, like the frames to the agent (see
/// [`outbound`]).
pub type Orders = mpsc::Sender<Box<TunnelOrder>>;

/// A call for the tunnel to carry.
pub struct TunnelOrder {
    /// The call's id at this kas.
    pub request: RequestId,
    /// The call.
    pub call: Call,
}

#[cfg(all(test, not(madsim)))]
mod tests {
    use super::*;
    use kas_core::Time;

    fn call() -> Call {
        Call {
            agent: AgentId(1),
            connection: None,
            deadline: Time(u64::MAX),
            start: Default::default(),
            requests: Arc::new(Vec::new()),
            rest: None,
            responses: mpsc::channel(1).0,
            delivered_to: Default::default(),
            trace: Default::default(),
        }
    }

    #[test]
    fn new_calls_beyond_the_queue_are_refused_naming_it() {
        let (control, _control_rx) = mpsc::unbounded_channel();
        let (calls, calls_rx) = mpsc::channel(2);
        let engine = EngineHandle::new(control, calls);
        for origin in [Origin::Public, Origin::Private] {
            let id = engine.next_request_id();
            engine
                .submit(id, origin, call())
                .expect("room in the queue");
        }
        let refused = engine
            .submit(engine.next_request_id(), Origin::Public, call())
            .expect_err("the queue is full");
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert!(
            refused.message().contains("queue of 4096 calls"),
            "{refused:?}"
        );
        drop(calls_rx);
        let gone = engine
            .submit(engine.next_request_id(), Origin::Public, call())
            .expect_err("the engine stopped");
        assert_eq!(gone.code(), tonic::Code::Unavailable);
    }
}
