//! One id per call, from the caller's error back to every hop's log: the caller's
//! `x-gitlab-correlation-id` (as GitLab's components pass it), or one kas makes. kas
//! returns it as a response header, ends every error message it sends with it, carries it
//! to the serving kas and the agent in the call's metadata, and logs it with the call.

use futures::{Stream, StreamExt};
use kas_proto::frame::Values;
use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::{Response, Status};

/// The header (and gRPC metadata key) that carries the id, GitLab's name for it.
pub const HEADER: &str = kas_proto::frame::CORRELATION_ID;

/// The longest id taken from a caller; a longer one is replaced (it would be in every
/// log line and error about the call).
const MAX_LEN: usize = 128;

/// A call's correlation id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CorrelationId(String);

impl CorrelationId {
    /// The caller's id when it is one kas keeps (1 to 128 characters of letters, digits
    /// and `.-_:`), else a new one.
    pub fn from_caller(value: Option<&str>) -> CorrelationId {
        match value {
            Some(v) if Self::acceptable(v) => CorrelationId(v.to_owned()),
            _ => CorrelationId::make(),
        }
    }

    /// The id in gRPC metadata, or a new one.
    pub fn of(metadata: &MetadataMap) -> CorrelationId {
        Self::from_caller(metadata.get(HEADER).and_then(|v| v.to_str().ok()))
    }

    /// A new id, a ULID as GitLab's labkit makes them: 48 bits of milliseconds since the
    /// epoch and 80 random bits, in Crockford's base 32 (26 characters, sorting by time).
    pub fn make() -> CorrelationId {
        const ALPHABET: &[u8; 32] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";
        let millis = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        let bits = ((millis & ((1 << 48) - 1)) << 80) | (rand::random::<u128>() >> 48);
        let id = (0..26)
            .rev()
            .map(|i| char::from(ALPHABET[((bits >> (i * 5)) & 31) as usize]))
            .collect();
        CorrelationId(id)
    }

    fn acceptable(v: &str) -> bool {
        (1..=MAX_LEN).contains(&v.len())
            && v.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-:".contains(&b))
    }

    /// The id.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The call's metadata (or HTTP headers) for the next hops: the id under [`HEADER`].
    pub fn metadata(&self) -> [(String, Values); 1] {
        let values = Values {
            values: vec![self.0.clone()],
        };
        [(HEADER.to_owned(), values)]
    }

    /// `text` ended with the id, as every error message kas sends ends.
    pub fn suffix(&self, text: &str) -> String {
        format!("{text} (correlation id {})", self.0)
    }

    /// `status` with the id at the end of its message and in its metadata.
    pub fn status(&self, status: Status) -> Status {
        let mut with = Status::with_details_and_metadata(
            status.code(),
            self.suffix(status.message()),
            status.details().to_vec().into(),
            status.metadata().clone(),
        );
        self.insert(with.metadata_mut());
        with
    }

    /// The handler's outcome, with the id in the response's metadata or in the error.
    pub fn answer<T>(&self, outcome: Result<Response<T>, Status>) -> Result<Response<T>, Status> {
        match outcome {
            Ok(mut response) => {
                self.insert(response.metadata_mut());
                Ok(response)
            }
            Err(status) => Err(self.status(status)),
        }
    }

    /// `stream` with the id in each error it yields.
    pub fn stream<T>(
        &self,
        stream: impl Stream<Item = Result<T, Status>> + Send + 'static,
    ) -> futures::stream::BoxStream<'static, Result<T, Status>>
    where
        T: Send + 'static,
    {
        let id = self.clone();
        stream
            .map(move |item| item.map_err(|s| id.status(s)))
            .boxed()
    }

    fn insert(&self, metadata: &mut MetadataMap) {
        if let Ok(value) = MetadataValue::try_from(self.0.as_str()) {
            metadata.insert(HEADER, value);
        }
    }
}

impl fmt::Display for CorrelationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caller_s_id_is_kept_when_it_is_one_kas_may_log() {
        let kept = CorrelationId::from_caller(Some("01HZX3-abc_def.1:2"));
        assert_eq!(kept.as_str(), "01HZX3-abc_def.1:2");
        for bad in ["", "a b", "x\ny", "é", &"a".repeat(129)] {
            let made = CorrelationId::from_caller(Some(bad));
            assert_ne!(made.as_str(), bad);
            assert_eq!(made.as_str().len(), 26, "{bad:?} replaced by a new id");
        }
    }

    #[test]
    fn new_ids_are_ulids_that_differ() {
        let (a, b) = (CorrelationId::make(), CorrelationId::make());
        assert_ne!(a, b);
        assert!(CorrelationId::acceptable(a.as_str()));
        assert!(
            a.as_str()
                .chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit())
        );
        assert!(
            a.as_str().starts_with('0'),
            "48 bits of milliseconds lead: {a}"
        );
    }

    use kas_proto::frame::RequestStart;

    #[test]
    fn an_error_ends_with_the_id_and_carries_it() {
        let id = CorrelationId::from_caller(Some("abc"));
        let s = id.status(Status::unavailable("agent 3 is not connected"));
        assert_eq!(s.code(), tonic::Code::Unavailable);
        assert_eq!(s.message(), "agent 3 is not connected (correlation id abc)");
        assert_eq!(s.metadata().get(HEADER).unwrap(), "abc");
        let start = RequestStart {
            metadata: id.metadata().into(),
            ..Default::default()
        };
        assert_eq!(start.correlation_id(), "abc");
    }
}
