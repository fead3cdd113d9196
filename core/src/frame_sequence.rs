//! The frame sequence of one tunnel or forward stream, as a checked state machine.
//!
//! A call flows as `RequestStart, Message*, CloseSend` towards the agent and
//! `Header?, Message*, Trailer` back. A tunnel stream additionally begins with the
//! agent's `Descriptor`, carries `Heartbeat`s, and carries calls one after another; a
//! forward stream (kas -> kas) carries exactly one call, and may instead be answered by a
//! single `Error`: the serving kas's "not delivered".
//!
//! A streaming call (`RequestStart.streaming`) is two-way: its request frames may keep
//! coming while the answer flows, and the agent may end it (trailer) before the request
//! side closed; request frames already under way then arrive after the end and are let
//! through as [`Progress::Late`]. On a forward, the serving kas tells the routing kas that
//! such a call was handed to a tunnel with a `Delivered` frame, before any answer frame.
//!
//! An agent ends a tunnel by asking: it sends `Closing` while it has no call on it, then
//! serves the one call kas may have sent before reading that, and kas ends the stream.
//! After `Closing` at most that one call starts.
//!
//! Only a kas may say a call was not delivered (at-most-once): an `Error` frame from an
//! agent on a tunnel, and an `Error` after any answer frame on a forward, are protocol
//! violations that end the call without a retry. (An agent's `Error` was once relayed by
//! the serving kas as a refusal, and the routing kas delivered the call again.)
//!
//! Each side of a stream feeds every frame it sends or receives here: a frame out of order
//! is a typed [`FrameError`], never a panic, and the driver ends the stream with that error.

use kas_proto::frame::{Frame, frame::Kind};

/// Which way a frame travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// From the caller towards the agent: `RequestStart`, `Message`, `CloseSend`.
    ToAgent,
    /// From the agent (or the serving kas) back: `Descriptor`, `Header`, `Message`,
    /// `Trailer`, `Error`, `Delivered`.
    FromAgent,
}

/// The kind of stream being checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamKind {
    /// agentk <-> kas reverse tunnel: descriptor first, heartbeats, sequential calls.
    Tunnel,
    /// kas -> kas forward: one call, no descriptor or heartbeats.
    Forward,
}

/// What a valid frame did to the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// The frame is valid and the stream goes on.
    Continue,
    /// The frame started call `request_id`.
    Started(u64),
    /// The frame ended call `request_id` (trailer or error).
    Finished(u64),
    /// A request frame of the call that just ended, sent before its end was seen: to drop.
    Late,
}

/// A frame that breaks the protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FrameError {
    /// The frame has no kind set (e.g. an empty or unknown message).
    Empty,
    /// A frame kind that never travels in this direction or on this kind of stream.
    WrongDirection {
        /// The frame kind, e.g. `"trailer"`.
        kind: &'static str,
        /// The direction it was seen travelling.
        direction: Direction,
    },
    /// The tunnel's first frame from the agent was not a descriptor, or a call started
    /// before the descriptor arrived.
    DescriptorMissing,
    /// A second descriptor on one tunnel.
    DescriptorTwice,
    /// A call frame arrived while no call is open.
    BeforeStart {
        /// The frame kind.
        kind: &'static str,
    },
    /// A `RequestStart` while a call is open, or a second call on a forward stream.
    SecondStart {
        /// The id of the call that is still open (or already done on a forward stream).
        open: u64,
    },
    /// A frame names a call other than the open one.
    UnknownRequest {
        /// The id the frame carries.
        got: u64,
        /// The open call's id.
        open: u64,
    },
    /// A trailer or error for a call that has already ended.
    TrailerTwice {
        /// The call's id.
        request_id: u64,
    },
    /// A request frame after the caller's `CloseSend`.
    AfterCloseSend {
        /// The frame kind.
        kind: &'static str,
    },
    /// A second header, or a header after a response message.
    HeaderOutOfOrder,
    /// An `Error` frame (kas's "not delivered") from an agent, or after the call's answer
    /// began: only a kas may refuse a call, and only before anything else came back.
    MisplacedError {
        /// The call's id.
        request_id: u64,
    },
    /// A `Delivered` frame twice, or after the answer began.
    DeliveredOutOfOrder,
    /// A second `Closing` on one tunnel.
    ClosingTwice,
    /// A call started after the agent's `Closing`, other than the one call that crossed it.
    StartAfterClosing,
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Empty => write!(f, "frame has no kind"),
            FrameError::WrongDirection { kind, direction } => {
                write!(
                    f,
                    "a {kind} frame cannot travel {direction:?} on this stream"
                )
            }
            FrameError::DescriptorMissing => write!(f, "tunnel must begin with a descriptor"),
            FrameError::DescriptorTwice => write!(f, "second descriptor on one tunnel"),
            FrameError::BeforeStart { kind } => write!(f, "{kind} frame before any request start"),
            FrameError::SecondStart { open } => {
                write!(f, "request start while request {open} is still open")
            }
            FrameError::UnknownRequest { got, open } => {
                write!(
                    f,
                    "frame for unknown request {got} (open request is {open})"
                )
            }
            FrameError::TrailerTwice { request_id } => {
                write!(f, "request {request_id} already ended")
            }
            FrameError::AfterCloseSend { kind } => write!(f, "{kind} frame after close-send"),
            FrameError::HeaderOutOfOrder => write!(f, "header after a message or a header"),
            FrameError::MisplacedError { request_id } => write!(
                f,
                "error frame for request {request_id}: only kas may refuse a call, and only before answering it (an agent ends a call with a trailer)"
            ),
            FrameError::DeliveredOutOfOrder => {
                write!(f, "delivered frame twice or after the answer began")
            }
            FrameError::ClosingTwice => write!(f, "second closing frame on one tunnel"),
            FrameError::StartAfterClosing => write!(
                f,
                "request start after the agent closed the tunnel (only a call sent before kas read the close may follow it)"
            ),
        }
    }
}

impl std::error::Error for FrameError {}

#[derive(Clone, Debug)]
struct OpenCall {
    id: u64,
    request_closed: bool,
    response_started: bool,
    delivered: bool,
}

/// Checks the frames of one stream. See the module docs for the grammar.
#[derive(Clone, Debug)]
pub struct FrameSequence {
    kind: StreamKind,
    descriptor_seen: bool,
    open: Option<OpenCall>,
    last_finished: Option<u64>,
    /// The last finished call ended before its request side closed.
    late_requests: bool,
    /// Calls that may still start after the agent's `Closing`; `None` before it.
    starts_after_closing: Option<u8>,
}

impl FrameSequence {
    /// A fresh stream of `kind`.
    pub fn new(kind: StreamKind) -> Self {
        FrameSequence {
            kind,
            descriptor_seen: false,
            open: None,
            last_finished: None,
            late_requests: false,
            starts_after_closing: None,
        }
    }

    /// True once the agent has sent `Closing`.
    pub fn is_closing(&self) -> bool {
        self.starts_after_closing.is_some()
    }

    /// True when no call is open (a tunnel is idle, a forward stream is not yet used or done).
    pub fn is_idle(&self) -> bool {
        self.open.is_none()
    }

    /// True once a tunnel has received its descriptor (always true for forward streams).
    pub fn is_ready(&self) -> bool {
        self.kind == StreamKind::Forward || self.descriptor_seen
    }

    /// True unless a call is open whose request side has not closed yet.
    pub fn request_closed(&self) -> bool {
        self.open.as_ref().is_none_or(|c| c.request_closed)
    }

    /// The open call's id.
    pub fn open_request(&self) -> Option<u64> {
        self.open.as_ref().map(|c| c.id)
    }

    /// Checks one frame travelling in `direction`.
    pub fn check(&mut self, direction: Direction, frame: &Frame) -> Result<Progress, FrameError> {
        let kind = frame.kind.as_ref().ok_or(FrameError::Empty)?;
        let name = kind_name(kind);
        let wrong = || FrameError::WrongDirection {
            kind: name,
            direction,
        };
        match (direction, kind) {
            (_, Kind::Heartbeat(_)) if self.kind == StreamKind::Tunnel => Ok(Progress::Continue),
            (Direction::FromAgent, Kind::Descriptor(_)) if self.kind == StreamKind::Tunnel => {
                if self.descriptor_seen {
                    return Err(FrameError::DescriptorTwice);
                }
                self.descriptor_seen = true;
                Ok(Progress::Continue)
            }
            (Direction::FromAgent, _) if !self.is_ready() => Err(FrameError::DescriptorMissing),
            (Direction::FromAgent, Kind::Closing(_)) if self.kind == StreamKind::Tunnel => {
                if self.is_closing() {
                    return Err(FrameError::ClosingTwice);
                }
                // Sent while idle at the agent: a call kas started before reading it
                // crossed it; if kas had none open, one may still be on its way.
                self.starts_after_closing = Some(u8::from(self.open.is_none()));
                Ok(Progress::Continue)
            }
            (Direction::ToAgent, Kind::RequestStart(start)) => self.start(start.request_id),
            (Direction::ToAgent, Kind::Message(m)) => self.request_frame(m.request_id, name, false),
            (Direction::ToAgent, Kind::CloseSend(c)) => {
                self.request_frame(c.request_id, name, true)
            }
            (Direction::FromAgent, Kind::Header(h)) => {
                let call = self.call_mut(h.request_id, name)?;
                if call.response_started {
                    return Err(FrameError::HeaderOutOfOrder);
                }
                call.response_started = true;
                Ok(Progress::Continue)
            }
            (Direction::FromAgent, Kind::Message(m)) => {
                self.call_mut(m.request_id, name)?.response_started = true;
                Ok(Progress::Continue)
            }
            (Direction::FromAgent, Kind::Trailer(t)) => self.finish(t.request_id, name),
            (Direction::FromAgent, Kind::Delivered(d)) if self.kind == StreamKind::Forward => {
                let call = self.call_mut(d.request_id, name)?;
                if call.delivered || call.response_started {
                    return Err(FrameError::DeliveredOutOfOrder);
                }
                call.delivered = true;
                Ok(Progress::Continue)
            }
            (Direction::FromAgent, Kind::Error(e)) => {
                let call = self.call_mut(e.request_id, name)?;
                let answered = call.response_started || call.delivered;
                if answered || self.kind == StreamKind::Tunnel {
                    return Err(FrameError::MisplacedError {
                        request_id: e.request_id,
                    });
                }
                self.finish(e.request_id, name)
            }
            _ => Err(wrong()),
        }
    }

    fn start(&mut self, id: u64) -> Result<Progress, FrameError> {
        if let Some(open) = &self.open {
            return Err(FrameError::SecondStart { open: open.id });
        }
        if self.kind == StreamKind::Forward
            && let Some(done) = self.last_finished
        {
            return Err(FrameError::SecondStart { open: done });
        }
        if !self.is_ready() {
            return Err(FrameError::DescriptorMissing);
        }
        if let Some(left) = &mut self.starts_after_closing {
            *left = left.checked_sub(1).ok_or(FrameError::StartAfterClosing)?;
        }
        self.open = Some(OpenCall {
            id,
            request_closed: false,
            response_started: false,
            delivered: false,
        });
        self.late_requests = false;
        Ok(Progress::Started(id))
    }

    fn request_frame(
        &mut self,
        id: u64,
        name: &'static str,
        close: bool,
    ) -> Result<Progress, FrameError> {
        if self.open.is_none() && self.late_requests && self.last_finished == Some(id) {
            self.late_requests = !close;
            return Ok(Progress::Late);
        }
        let call = self.call_mut(id, name)?;
        if call.request_closed {
            return Err(FrameError::AfterCloseSend { kind: name });
        }
        call.request_closed = close;
        Ok(Progress::Continue)
    }

    fn finish(&mut self, id: u64, name: &'static str) -> Result<Progress, FrameError> {
        self.late_requests = !self.call_mut(id, name)?.request_closed;
        self.open = None;
        self.last_finished = Some(id);
        Ok(Progress::Finished(id))
    }

    fn call_mut(&mut self, id: u64, name: &'static str) -> Result<&mut OpenCall, FrameError> {
        match (&mut self.open, self.last_finished) {
            (Some(call), _) if call.id != id => Err(FrameError::UnknownRequest {
                got: id,
                open: call.id,
            }),
            (Some(call), _) => Ok(call),
            (None, Some(done)) if done == id && matches!(name, "trailer" | "error") => {
                Err(FrameError::TrailerTwice { request_id: id })
            }
            (None, _) => Err(FrameError::BeforeStart { kind: name }),
        }
    }
}

fn kind_name(kind: &Kind) -> &'static str {
    match kind {
        Kind::Descriptor(_) => "descriptor",
        Kind::RequestStart(_) => "request start",
        Kind::Message(_) => "message",
        Kind::CloseSend(_) => "close-send",
        Kind::Header(_) => "header",
        Kind::Trailer(_) => "trailer",
        Kind::Error(_) => "error",
        Kind::Heartbeat(_) => "heartbeat",
        Kind::Delivered(_) => "delivered",
        Kind::Closing(_) => "closing",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kas_proto::frame as f;

    fn fr(kind: Kind) -> Frame {
        Frame { kind: Some(kind) }
    }
    fn start(id: u64) -> Frame {
        fr(Kind::RequestStart(f::RequestStart {
            request_id: id,
            agent_id: 1,
            ..Default::default()
        }))
    }
    fn msg(id: u64) -> Frame {
        fr(Kind::Message(f::Message {
            request_id: id,
            data: vec![1].into(),
        }))
    }
    fn close(id: u64) -> Frame {
        fr(Kind::CloseSend(f::CloseSend { request_id: id }))
    }
    fn header(id: u64) -> Frame {
        fr(Kind::Header(f::Header {
            request_id: id,
            ..Default::default()
        }))
    }
    fn trailer(id: u64) -> Frame {
        fr(Kind::Trailer(f::Trailer {
            request_id: id,
            ..Default::default()
        }))
    }
    fn descriptor() -> Frame {
        fr(Kind::Descriptor(f::Descriptor::default()))
    }
    use Direction::{FromAgent as Up, ToAgent as Down};

    fn ready_tunnel() -> FrameSequence {
        let mut s = FrameSequence::new(StreamKind::Tunnel);
        assert_eq!(s.check(Up, &descriptor()), Ok(Progress::Continue));
        s
    }

    #[test]
    fn full_call_then_reuse_of_tunnel() {
        let mut s = ready_tunnel();
        for id in [1, 2] {
            assert_eq!(s.check(Down, &start(id)), Ok(Progress::Started(id)));
            assert_eq!(s.check(Down, &msg(id)), Ok(Progress::Continue));
            assert_eq!(s.check(Down, &close(id)), Ok(Progress::Continue));
            assert_eq!(s.check(Up, &header(id)), Ok(Progress::Continue));
            assert_eq!(s.check(Up, &msg(id)), Ok(Progress::Continue));
            assert_eq!(s.check(Up, &trailer(id)), Ok(Progress::Finished(id)));
            assert!(s.is_idle());
        }
    }

    #[test]
    fn message_before_start() {
        let mut s = ready_tunnel();
        assert_eq!(
            s.check(Down, &msg(1)),
            Err(FrameError::BeforeStart { kind: "message" })
        );
    }

    #[test]
    fn second_start() {
        let mut s = ready_tunnel();
        s.check(Down, &start(1)).unwrap();
        assert_eq!(
            s.check(Down, &start(2)),
            Err(FrameError::SecondStart { open: 1 })
        );
        let mut fwd = FrameSequence::new(StreamKind::Forward);
        fwd.check(Down, &start(1)).unwrap();
        fwd.check(Up, &trailer(1)).unwrap();
        assert_eq!(
            fwd.check(Down, &start(2)),
            Err(FrameError::SecondStart { open: 1 })
        );
    }

    #[test]
    fn unknown_request() {
        let mut s = ready_tunnel();
        s.check(Down, &start(1)).unwrap();
        assert_eq!(
            s.check(Up, &msg(9)),
            Err(FrameError::UnknownRequest { got: 9, open: 1 })
        );
    }

    #[test]
    fn trailer_twice() {
        let mut s = ready_tunnel();
        s.check(Down, &start(4)).unwrap();
        s.check(Up, &trailer(4)).unwrap();
        assert_eq!(
            s.check(Up, &trailer(4)),
            Err(FrameError::TrailerTwice { request_id: 4 })
        );
    }

    fn error(id: u64) -> Frame {
        fr(Kind::Error(f::Error {
            request_id: id,
            ..Default::default()
        }))
    }

    #[test]
    fn only_a_kas_refuses_and_only_before_answering() {
        // An agent's error frame on a tunnel never ends a call as "not delivered".
        let mut s = ready_tunnel();
        s.check(Down, &start(1)).unwrap();
        assert_eq!(
            s.check(Up, &error(1)),
            Err(FrameError::MisplacedError { request_id: 1 })
        );
        // The serving kas may refuse a forwarded call as its first answer frame...
        let mut fwd = FrameSequence::new(StreamKind::Forward);
        fwd.check(Down, &start(2)).unwrap();
        assert_eq!(fwd.check(Up, &error(2)), Ok(Progress::Finished(2)));
        // ...but not once the agent's answer has begun.
        for first in [header(3), msg(3)] {
            let mut fwd = FrameSequence::new(StreamKind::Forward);
            fwd.check(Down, &start(3)).unwrap();
            fwd.check(Up, &first).unwrap();
            assert_eq!(
                fwd.check(Up, &error(3)),
                Err(FrameError::MisplacedError { request_id: 3 })
            );
        }
    }

    #[test]
    fn descriptor_rules() {
        let mut s = FrameSequence::new(StreamKind::Tunnel);
        assert_eq!(s.check(Up, &header(1)), Err(FrameError::DescriptorMissing));
        assert_eq!(s.check(Down, &start(1)), Err(FrameError::DescriptorMissing));
        s.check(Up, &descriptor()).unwrap();
        assert_eq!(s.check(Up, &descriptor()), Err(FrameError::DescriptorTwice));
        let mut fwd = FrameSequence::new(StreamKind::Forward);
        assert!(matches!(
            fwd.check(Up, &descriptor()),
            Err(FrameError::WrongDirection { .. })
        ));
    }

    fn any_frame() -> impl proptest::strategy::Strategy<Value = Frame> {
        use proptest::strategy::Strategy;
        (0u8..11, 0u64..3).prop_map(|(k, id)| match k {
            0 => descriptor(),
            1 => start(id),
            2 => msg(id),
            3 => close(id),
            4 => header(id),
            5 => trailer(id),
            6 => error(id),
            7 => fr(Kind::Heartbeat(f::Heartbeat { sequence: id })),
            8 => delivered(id),
            9 => closing(),
            _ => Frame { kind: None },
        })
    }

    proptest::proptest! {
        /// Any sequence of frames in any direction yields results or typed errors, never a
        /// panic; a call ends only after it started, and then the stream is idle.
        #[test]
        fn arbitrary_sequences_never_panic(
            forward in proptest::bool::ANY,
            frames in proptest::collection::vec((proptest::bool::ANY, any_frame()), 0..40),
        ) {
            let kind = if forward { StreamKind::Forward } else { StreamKind::Tunnel };
            let mut s = FrameSequence::new(kind);
            let mut open = None;
            for (up, frame) in frames {
                match s.check(if up { Up } else { Down }, &frame) {
                    Ok(Progress::Started(id)) => open = Some(id),
                    Ok(Progress::Finished(id)) => {
                        proptest::prop_assert_eq!(open.take(), Some(id));
                        proptest::prop_assert!(s.is_idle());
                    }
                    Ok(Progress::Late) => proptest::prop_assert!(open.is_none()),
                    Ok(Progress::Continue) | Err(_) => {}
                }
                proptest::prop_assert_eq!(s.open_request(), open);
            }
        }
    }

    #[test]
    fn ordering_errors() {
        let mut s = ready_tunnel();
        s.check(Down, &start(1)).unwrap();
        s.check(Down, &close(1)).unwrap();
        assert_eq!(
            s.check(Down, &msg(1)),
            Err(FrameError::AfterCloseSend { kind: "message" })
        );
        s.check(Up, &msg(1)).unwrap();
        assert_eq!(s.check(Up, &header(1)), Err(FrameError::HeaderOutOfOrder));
        assert!(matches!(
            s.check(Down, &trailer(1)),
            Err(FrameError::WrongDirection { .. })
        ));
        assert_eq!(s.check(Up, &Frame { kind: None }), Err(FrameError::Empty));
        let hb = fr(Kind::Heartbeat(f::Heartbeat { sequence: 1 }));
        assert_eq!(s.check(Up, &hb), Ok(Progress::Continue));
    }

    fn closing() -> Frame {
        fr(Kind::Closing(f::Closing {}))
    }

    #[test]
    fn after_closing_only_the_call_that_crossed_it_starts() {
        // Idle when the close arrives: kas may have sent one call before reading it.
        let mut s = ready_tunnel();
        assert_eq!(s.check(Up, &closing()), Ok(Progress::Continue));
        assert!(s.is_closing());
        assert_eq!(s.check(Up, &closing()), Err(FrameError::ClosingTwice));
        s.check(Down, &start(1)).unwrap();
        s.check(Down, &close(1)).unwrap();
        s.check(Up, &trailer(1)).unwrap();
        assert_eq!(s.check(Down, &start(2)), Err(FrameError::StartAfterClosing));
        // Read by kas during a call: that call was the crossing one, no other follows.
        let mut s = ready_tunnel();
        s.check(Down, &start(1)).unwrap();
        s.check(Up, &closing()).unwrap();
        s.check(Up, &trailer(1)).unwrap();
        assert_eq!(s.check(Down, &start(2)), Err(FrameError::StartAfterClosing));
        // Never on a forward stream, and never towards the agent.
        let mut fwd = FrameSequence::new(StreamKind::Forward);
        assert!(matches!(
            fwd.check(Up, &closing()),
            Err(FrameError::WrongDirection { .. })
        ));
        assert!(matches!(
            ready_tunnel().check(Down, &closing()),
            Err(FrameError::WrongDirection { .. })
        ));
    }

    fn delivered(id: u64) -> Frame {
        fr(Kind::Delivered(f::Delivered {
            request_id: id,
            connection_id: None,
        }))
    }

    #[test]
    fn a_two_way_call_interleaves_and_its_late_request_frames_are_let_through() {
        let mut s = ready_tunnel();
        s.check(Down, &start(1)).unwrap();
        s.check(Up, &header(1)).unwrap();
        s.check(Down, &msg(1)).unwrap();
        s.check(Up, &msg(1)).unwrap();
        assert_eq!(s.check(Up, &trailer(1)), Ok(Progress::Finished(1)));
        // Sent before the trailer was seen: dropped, not a protocol error.
        assert_eq!(s.check(Down, &msg(1)), Ok(Progress::Late));
        assert_eq!(s.check(Down, &close(1)), Ok(Progress::Late));
        // Nothing after the close-send, and nothing for another call.
        assert_eq!(
            s.check(Down, &msg(1)),
            Err(FrameError::BeforeStart { kind: "message" })
        );
        s.check(Down, &start(2)).unwrap();
        s.check(Down, &close(2)).unwrap();
        s.check(Up, &trailer(2)).unwrap();
        assert_eq!(
            s.check(Down, &msg(2)),
            Err(FrameError::BeforeStart { kind: "message" })
        );
    }

    #[test]
    fn delivered_comes_once_on_a_forward_before_the_answer_and_forbids_a_refusal() {
        let mut fwd = FrameSequence::new(StreamKind::Forward);
        fwd.check(Down, &start(1)).unwrap();
        assert_eq!(fwd.check(Up, &delivered(1)), Ok(Progress::Continue));
        assert_eq!(
            fwd.check(Up, &delivered(1)),
            Err(FrameError::DeliveredOutOfOrder)
        );
        assert_eq!(
            fwd.check(Up, &error(1)),
            Err(FrameError::MisplacedError { request_id: 1 })
        );
        fwd.check(Up, &header(1)).unwrap();
        assert_eq!(fwd.check(Up, &trailer(1)), Ok(Progress::Finished(1)));

        let mut answered = FrameSequence::new(StreamKind::Forward);
        answered.check(Down, &start(2)).unwrap();
        answered.check(Up, &msg(2)).unwrap();
        assert_eq!(
            answered.check(Up, &delivered(2)),
            Err(FrameError::DeliveredOutOfOrder)
        );
        // Agents never send it.
        let mut tunnel = ready_tunnel();
        tunnel.check(Down, &start(3)).unwrap();
        assert!(matches!(
            tunnel.check(Up, &delivered(3)),
            Err(FrameError::WrongDirection { .. })
        ));
    }
}
