//! The codec of every generated client and server: prost encoding with small initial
//! buffers.
//!
//! tonic's default codec gives every stream an 8 KiB encode and an 8 KiB decode buffer up
//! front. kas holds one long-lived, mostly idle stream per agent tunnel, so those buffers
//! were most of an idle tunnel's memory. Buffers still grow to fit any message.

use std::marker::PhantomData;
use tonic::codec::{BufferSettings, Codec};
use tonic_prost::{ProstDecoder, ProstEncoder};

/// Initial size of a stream's encode and decode buffers: an idle tunnel's heartbeats fit,
/// and a call's larger frames grow them. 512 held an idle tunnel at 6.35-7.16 KiB of kas
/// memory, 256 at 5.75-6.27 (kas-bench at 10,000 agents); small calls' throughput did not
/// move beyond the runs' noise (see README, "Many agents on one kas").
pub const INITIAL_BUFFER: usize = 256;

/// Encoded messages are handed to HTTP/2 once this many bytes are buffered (tonic's
/// default), so large messages still go out in large writes.
pub const YIELD_THRESHOLD: usize = 32 * 1024;

/// A prost codec whose streams start with [`INITIAL_BUFFER`]-byte buffers.
#[derive(Debug)]
pub struct LeanCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for LeanCodec<T, U> {
    fn default() -> Self {
        LeanCodec(PhantomData)
    }
}

fn settings() -> BufferSettings {
    BufferSettings::new(INITIAL_BUFFER, YIELD_THRESHOLD)
}

impl<T, U> Codec for LeanCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(settings())
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::new(settings())
    }
}
