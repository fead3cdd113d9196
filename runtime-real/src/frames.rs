//! Building and re-addressing the frames of the tunnel and forward protocols.

use kas_proto::frame::{self as f, Frame, frame::Kind};

/// Wraps one frame kind.
pub fn frame(kind: Kind) -> Frame {
    Frame { kind: Some(kind) }
}

/// The frame with its call id set to `id` (frames without one are returned unchanged).
pub fn with_request_id(mut frame: Frame, id: u64) -> Frame {
    match &mut frame.kind {
        Some(Kind::RequestStart(x)) => x.request_id = id,
        Some(Kind::Message(x)) => x.request_id = id,
        Some(Kind::CloseSend(x)) => x.request_id = id,
        Some(Kind::Header(x)) => x.request_id = id,
        Some(Kind::Trailer(x)) => x.request_id = id,
        Some(Kind::Error(x)) => x.request_id = id,
        Some(Kind::Descriptor(_) | Kind::Heartbeat(_)) | None => {}
    }
    frame
}

/// A message frame.
pub fn message(request_id: u64, data: Vec<u8>) -> Frame {
    frame(Kind::Message(f::Message { request_id, data }))
}

/// A close-send frame.
pub fn close_send(request_id: u64) -> Frame {
    frame(Kind::CloseSend(f::CloseSend { request_id }))
}

/// A trailer ending a call with `status`.
pub fn trailer(request_id: u64, status: &tonic::Status) -> Frame {
    frame(Kind::Trailer(f::Trailer {
        request_id,
        code: status.code() as i32,
        message: status.message().to_string(),
        metadata: Default::default(),
    }))
}

/// A routing refusal: the call did not reach any agent.
pub fn error(request_id: u64, status: &tonic::Status) -> Frame {
    frame(Kind::Error(f::Error {
        request_id,
        code: status.code() as i32,
        message: status.message().to_string(),
    }))
}

/// A heartbeat.
pub fn heartbeat(sequence: u64) -> Frame {
    frame(Kind::Heartbeat(f::Heartbeat { sequence }))
}

/// The status a trailer or error frame carries.
pub fn status(code: i32, message: &str) -> tonic::Status {
    tonic::Status::new(tonic::Code::from_i32(code), message)
}
