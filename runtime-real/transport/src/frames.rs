//! Building and re-addressing the frames of the tunnel and forward protocols.

// Peer input passes through here: nothing may panic on it.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)
)]

use bytes::Bytes;
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
        Some(Kind::Delivered(x)) => x.request_id = id,
        Some(Kind::Descriptor(_) | Kind::Heartbeat(_) | Kind::Closing(_)) | None => {}
    }
    frame
}

/// A message frame.
pub fn message(request_id: u64, data: impl Into<Bytes>) -> Frame {
    let data = data.into();
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

/// The serving kas's word that a streaming call was handed to a tunnel.
pub fn delivered(request_id: u64, connection_id: i64) -> Frame {
    frame(Kind::Delivered(f::Delivered {
        request_id,
        connection_id: Some(connection_id),
    }))
}

/// A heartbeat.
pub fn heartbeat(sequence: u64) -> Frame {
    frame(Kind::Heartbeat(f::Heartbeat { sequence }))
}

/// The agent's request that kas end an idle tunnel.
pub fn closing() -> Frame {
    frame(Kind::Closing(f::Closing {}))
}

/// Longest status message passed on, in bytes. The message travels as the
/// `grpc-message` header: a 200 KB one from an agent once made the caller fail on its
/// metadata size limit instead of reading the agent's status.
pub const MAX_STATUS_MESSAGE: usize = 1024;

/// The status a trailer or error frame carries, its message cut to
/// [`MAX_STATUS_MESSAGE`] bytes (on a character boundary) and marked as cut.
pub fn status(code: i32, message: &str) -> tonic::Status {
    let code = tonic::Code::from_i32(code);
    if message.len() <= MAX_STATUS_MESSAGE {
        return tonic::Status::new(code, message);
    }
    let mut end = MAX_STATUS_MESSAGE;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    let cut = format!(
        "{}... (truncated by kas from {} bytes)",
        &message[..end],
        message.len()
    );
    tonic::Status::new(code, cut)
}

#[cfg(test)]
mod tests {
    #[test]
    fn long_status_messages_are_cut_on_a_character_boundary() {
        let short = super::status(5, "no pod x");
        assert_eq!(
            (short.code(), short.message()),
            (tonic::Code::NotFound, "no pod x")
        );
        let long = "é".repeat(100_000); // 200,000 bytes, two per character
        let cut = super::status(5, &long);
        assert_eq!(cut.code(), tonic::Code::NotFound);
        assert!(
            cut.message().len() < super::MAX_STATUS_MESSAGE + 64,
            "{}",
            cut.message().len()
        );
        assert!(
            cut.message()
                .ends_with("(truncated by kas from 200000 bytes)")
        );
        assert!(cut.message().starts_with("éé"));
    }
}
