//! GetPods' answer kept as the bytes the agent encoded.
//!
//! `kas.pods.ListResponse` (the agent's answer) and `kas.public_api.GetPodsResponse`
//! (GitLab's) have one wire format, `repeated kas.pods.Pod pods = 1`, so the kas serving
//! GitLab's call passes the agent's bytes on instead of decoding every pod and encoding it
//! again (about a fifth of a local call's instructions). The pods are GitLab's to decode.

use crate::pods::{ListResponse, Pod};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use prost::encoding::{self, DecodeContext, WireType};
use prost::{DecodeError, Message};
use std::fmt;

/// The `pods` field's number in both messages.
const PODS: u32 = 1;

/// GetPods' answer: an encoded `repeated kas.pods.Pod pods = 1`.
#[derive(Clone, Default, PartialEq)]
pub struct GetPodsResponse {
    encoded: Bytes,
}

impl GetPodsResponse {
    /// An agent's encoded `ListResponse` as GitLab's answer, once it is well-formed at
    /// its top level: every field's key valid, every length within the message, `pods`
    /// length-delimited. A hostile agent's pods may still be malformed inside; only the
    /// callers who asked that agent see it (their decode fails).
    pub fn from_list(encoded: Bytes) -> Result<Self, DecodeError> {
        check(encoded.clone())?;
        Ok(GetPodsResponse { encoded })
    }

    /// The pods, decoded.
    pub fn pods(&self) -> Result<Vec<Pod>, DecodeError> {
        ListResponse::decode(self.encoded.clone()).map(|list| list.pods)
    }
}

/// Walks `buf`'s fields without decoding their values.
fn check(mut buf: Bytes) -> Result<(), DecodeError> {
    while buf.has_remaining() {
        let (tag, wire_type) = encoding::decode_key(&mut buf)?;
        if tag == PODS {
            encoding::check_wire_type(WireType::LengthDelimited, wire_type)?;
        }
        encoding::skip_field(wire_type, tag, &mut buf, DecodeContext::default())?;
    }
    Ok(())
}

impl fmt::Debug for GetPodsResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GetPodsResponse")
            .field("encoded_len", &self.encoded.len())
            .finish()
    }
}

impl Message for GetPodsResponse {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        buf.put_slice(&self.encoded);
    }

    /// Decoding a whole message keeps its bytes (merging two encodings is appending them).
    fn merge(&mut self, mut buf: impl Buf) -> Result<(), DecodeError> {
        let more = buf.copy_to_bytes(buf.remaining());
        check(more.clone())?;
        self.encoded = if self.encoded.is_empty() {
            more
        } else {
            [&self.encoded[..], &more[..]].concat().into()
        };
        Ok(())
    }

    /// Field by field (this message inside another): `pods` kept, the rest skipped.
    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        if tag != PODS {
            return encoding::skip_field(wire_type, tag, buf, ctx);
        }
        let mut pod = Bytes::new();
        encoding::bytes::merge(wire_type, &mut pod, buf, ctx)?;
        let mut encoded = BytesMut::with_capacity(self.encoded.len() + pod.len() + 11);
        encoded.put_slice(&self.encoded);
        encoding::bytes::encode(PODS, &pod, &mut encoded);
        self.encoded = encoded.freeze();
        Ok(())
    }

    fn encoded_len(&self) -> usize {
        self.encoded.len()
    }

    fn clear(&mut self) {
        self.encoded = Bytes::new();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str) -> Pod {
        Pod {
            name: name.into(),
            ..Default::default()
        }
    }

    #[test]
    fn the_agents_bytes_pass_unchanged_and_decode_as_its_pods() {
        let list = ListResponse {
            pods: vec![pod("a"), pod("b")],
        };
        let bytes = Bytes::from(list.encode_to_vec());
        let answer = GetPodsResponse::from_list(bytes.clone()).unwrap();
        assert_eq!(answer.encode_to_vec(), bytes);
        assert_eq!(answer.pods().unwrap(), list.pods);
        // As GitLab's client decodes it, whole and field by field.
        let decoded = GetPodsResponse::decode(bytes.clone()).unwrap();
        assert_eq!(decoded.pods().unwrap(), list.pods);
        let mut nested = Vec::new();
        encoding::message::encode(1, &answer, &mut nested);
        let mut by_field = GetPodsResponse::default();
        let mut buf = &nested[..];
        let (_, wire_type) = encoding::decode_key(&mut buf).unwrap();
        encoding::message::merge(wire_type, &mut by_field, &mut buf, DecodeContext::default())
            .unwrap();
        assert_eq!(by_field.pods().unwrap(), list.pods);
    }

    #[test]
    fn a_list_cut_short_or_with_pods_of_the_wrong_kind_is_refused() {
        let bytes = ListResponse {
            pods: vec![pod("a")],
        }
        .encode_to_vec();
        let cut = Bytes::copy_from_slice(&bytes[..bytes.len() - 1]);
        assert!(GetPodsResponse::from_list(cut).is_err());
        // `pods = 1` as a varint.
        assert!(GetPodsResponse::from_list(Bytes::from_static(&[0x08, 0x01])).is_err());
        // Field number 0.
        assert!(GetPodsResponse::from_list(Bytes::from_static(&[0x02, 0x00])).is_err());
        // An unknown field passes (a newer agent's); GitLab's client skips it.
        let answer = GetPodsResponse::from_list(Bytes::from_static(&[0x10, 0x05])).unwrap();
        assert_eq!(answer.pods().unwrap(), vec![]);
    }
}
