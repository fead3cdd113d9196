//! Arbitrary bytes to every decoder, and the decoded frames, in arbitrary order and
//! direction, to the frame sequence checker. Nothing may panic.
//!
//! Input layout: repeated `[flags, len, len bytes of protobuf]`. `flags` bit 0 picks the
//! direction, bit 1 the stream kind of the whole run (taken from the first chunk).
#![no_main]

use kas_core::expiring;
use kas_core::frame_sequence::{Direction, FrameSequence, StreamKind};
use kas_proto::frame::Frame;
use kas_proto::registry::{ConnectedAgentInfo, TunnelEvent};
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let _ = expiring::decode(data);
    let _ = TunnelEvent::decode(data);
    let _ = ConnectedAgentInfo::decode(data);
    let kind = match data.first() {
        Some(f) if f & 2 != 0 => StreamKind::Forward,
        _ => StreamKind::Tunnel,
    };
    let mut seq = FrameSequence::new(kind);
    let mut rest = data;
    while let [flags, len, tail @ ..] = rest {
        let n = usize::from(*len).min(tail.len());
        let (chunk, next) = tail.split_at(n);
        rest = next;
        let Ok(frame) = Frame::decode(chunk) else {
            continue;
        };
        let direction = if flags & 1 == 0 {
            Direction::ToAgent
        } else {
            Direction::FromAgent
        };
        // A real stream ends at its first error; going on explores more states.
        let _ = seq.check(direction, &frame);
    }
});
