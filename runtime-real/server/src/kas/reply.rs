//! The answer of a call routed for a caller of this kas, as its handler reads it.

use super::handle::CancelOnDrop;
use super::timing::answer_slack;
use bytes::Bytes;
use futures::stream::{self, StreamExt};
use kas_core::{AgentId, Time};
use kas_proto::frame::{Frame, frame::Kind};
use kas_transport::clock;
use kas_transport::frames;
use kas_transport::traces::Ending;
use tokio::sync::mpsc;
use tonic::Status;

/// The answer of a routed call as it arrives; dropping it before the end cancels the call.
pub struct Reply {
    agent: AgentId,
    rx: mpsc::Receiver<Result<Frame, Status>>,
    cancel: CancelOnDrop,
    /// When to stop waiting; a streaming call's deadline applies to its first message only.
    give_up: Option<tokio::time::Instant>,
    streaming: bool,
    ended: bool,
    /// The caller's span, ended with the reply.
    _trace: Option<Ending>,
}

impl Reply {
    /// The reply of call `cancel` names, arriving on `rx`: waited for until `deadline` and
    /// [`answer_slack`] when given (for a streaming call until its first message only);
    /// without, the engine's routing deadline ends a call that reached no agent, and one
    /// that did is its ends' to end.
    pub fn new(
        agent: AgentId,
        rx: mpsc::Receiver<Result<Frame, Status>>,
        cancel: CancelOnDrop,
        deadline: Option<Time>,
        streaming: bool,
    ) -> Reply {
        let give_up = deadline.map(|d| {
            let left = clock::until(d);
            tokio::time::Instant::now() + left + answer_slack(left)
        });
        Reply {
            agent,
            rx,
            cancel,
            give_up,
            streaming,
            ended: false,
            _trace: None,
        }
    }

    /// The reply ending `trace`'s span with it.
    pub fn traced(mut self, trace: Ending) -> Reply {
        self._trace = Some(trace);
        self
    }

    /// The next response message; `None` once the agent ended the call with OK.
    pub async fn message(&mut self) -> Result<Option<Bytes>, Status> {
        while !self.ended {
            let item = match self.give_up {
                Some(at) => tokio::time::timeout(
                    at.saturating_duration_since(tokio::time::Instant::now()),
                    self.rx.recv(),
                )
                .await
                .map_err(|_| {
                    Status::deadline_exceeded(format!(
                        "agent {} did not answer by the deadline",
                        self.agent
                    ))
                })?,
                None => self.rx.recv().await,
            };
            // Whatever ends the call came from the engine, a tunnel or a forward, which
            // end it themselves. Without an end, one of them was cut off (a kas stopping
            // aborts its forwards at the end of its grace) after the call may have reached
            // an agent: Unknown, never Unavailable, which GitLab's client would send again.
            let frame = match item {
                Some(Ok(frame)) => frame,
                Some(Err(status)) => return Err(self.end(status)),
                None => {
                    return Err(self.end(Status::unknown(
                        "kas cut off its relay of the call during the call, which may have reached the agent",
                    )));
                }
            };
            match frame.kind {
                Some(Kind::Message(m)) => {
                    if self.streaming {
                        self.give_up = None;
                    }
                    return Ok(Some(m.data));
                }
                Some(Kind::Trailer(t)) if t.code == 0 => {
                    self.end(Status::ok(""));
                }
                Some(Kind::Trailer(t)) => return Err(self.end(frames::status(t.code, &t.message))),
                Some(Kind::Error(e)) => return Err(self.end(frames::status(e.code, &e.message))),
                _ => {}
            }
        }
        Ok(None)
    }

    /// The answer's messages as a stream, once the first has come: a call that reached no
    /// agent fails as a plain status, before any response headers.
    pub async fn into_stream(
        mut self,
    ) -> Result<impl futures::Stream<Item = Result<Bytes, Status>> + Send + 'static, Status> {
        let first = self.message().await?;
        let rest = stream::try_unfold(self, |mut reply| async move {
            Ok(reply.message().await?.map(|m| (m, reply)))
        });
        Ok(stream::iter(first.map(Ok)).chain(rest))
    }

    /// Marks the call ended by `status`, which it returns.
    fn end(&mut self, status: Status) -> Status {
        self.ended = true;
        self.cancel.disarm();
        status
    }
}
