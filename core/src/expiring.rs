//! Expiring hash values: the encoding of every registry field and the rules for when a
//! field counts as gone.
//!
//! Many kas replicas write fields into the same hash (e.g. the tunnels of one agent), and a
//! key's `PEXPIRE` covers all its fields at once. So each field carries its own
//! `expires_at`: readers skip expired fields, and a GC pass deletes them.

use crate::time::Time;
use kas_proto::registry::ExpiringValue;
use prost::Message;

/// Why stored bytes are not a valid expiring value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "invalid expiring value: {}", self.0)
    }
}

impl std::error::Error for DecodeError {}

/// Encodes `value` so that it expires at `expires_at`.
pub fn encode(value: &[u8], expires_at: Time) -> Vec<u8> {
    ExpiringValue {
        expires_at: i64::try_from(expires_at.as_millis()).unwrap_or(i64::MAX),
        value: value.to_vec(),
    }
    .encode_to_vec()
}

/// Decodes a stored field into (expiry, payload).
pub fn decode(bytes: &[u8]) -> Result<(Time, Vec<u8>), DecodeError> {
    let v = ExpiringValue::decode(bytes).map_err(|e| DecodeError(e.to_string()))?;
    let at = u64::try_from(v.expires_at)
        .map_err(|_| DecodeError(format!("negative expires_at {}", v.expires_at)))?;
    Ok((Time(at), v.value))
}

/// A field is live strictly before its expiry instant.
pub fn is_live(expires_at: Time, now: Time) -> bool {
    now < expires_at
}

/// The live payloads among `fields` (name, stored bytes). Expired and undecodable fields
/// are skipped: one corrupt field never hides the others.
pub fn live_fields<'a, I>(fields: I, now: Time) -> Vec<(String, Vec<u8>)>
where
    I: IntoIterator<Item = (&'a str, &'a [u8])>,
{
    fields
        .into_iter()
        .filter_map(|(name, bytes)| match decode(bytes) {
            Ok((at, payload)) if is_live(at, now) => Some((name.to_owned(), payload)),
            _ => None,
        })
        .collect()
}

/// The fields a GC pass should delete: expired or undecodable.
pub fn garbage_fields<'a, I>(fields: I, now: Time) -> Vec<String>
where
    I: IntoIterator<Item = (&'a str, &'a [u8])>,
{
    fields
        .into_iter()
        .filter(|(_, bytes)| !matches!(decode(bytes), Ok((at, _)) if is_live(at, now)))
        .map(|(name, _)| name.to_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_expiry_edge() {
        let bytes = encode(b"abc", Time(1_000));
        assert_eq!(decode(&bytes).unwrap(), (Time(1_000), b"abc".to_vec()));
        assert!(is_live(Time(1_000), Time(999)));
        assert!(
            !is_live(Time(1_000), Time(1_000)),
            "expired exactly at expires_at"
        );
    }

    #[test]
    fn readers_skip_expired_and_corrupt_fields() {
        let live = encode(b"live", Time(2_000));
        let dead = encode(b"dead", Time(500));
        let corrupt = vec![0xff, 0xff, 0xff];
        let fields = [
            ("a", live.as_slice()),
            ("b", dead.as_slice()),
            ("c", corrupt.as_slice()),
        ];
        assert_eq!(
            live_fields(fields, Time(1_000)),
            vec![("a".into(), b"live".to_vec())]
        );
        assert_eq!(
            garbage_fields(fields, Time(1_000)),
            vec!["b".to_string(), "c".to_string()]
        );
    }

    #[test]
    fn negative_expiry_is_a_decode_error() {
        let bytes = ExpiringValue {
            expires_at: -5,
            value: vec![],
        }
        .encode_to_vec();
        let err = decode(&bytes).unwrap_err();
        assert!(err.to_string().contains("negative expires_at -5"), "{err}");
    }
}
