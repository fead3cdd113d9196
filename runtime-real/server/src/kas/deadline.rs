//! The caller's deadline, from gRPC's `grpc-timeout` metadata.

use super::timing::DEADLINE_MARGIN;
use kas_core::Time;
use kas_transport::clock;
use std::time::Duration;
use tonic::metadata::MetadataMap;

/// The call's deadline: `grpc-timeout` when present (capped at `max`), else `default`.
/// kas gives up a tenth of the timeout (at most half a second) early, so that the caller
/// hears why ("agent N is not connected") before its own timer fires.
pub fn deadline(metadata: &MetadataMap, default: Duration, max: Duration) -> Time {
    let timeout = metadata
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(parse_grpc_timeout)
        .unwrap_or(default);
    deadline_after(clock::now(), timeout, max)
}

/// The deadline of a call with `timeout` (capped at `max`) from `start`, less the margin.
pub fn deadline_after(start: Time, timeout: Duration, max: Duration) -> Time {
    let timeout = timeout.min(max);
    start + (timeout - (timeout / 10).min(DEADLINE_MARGIN))
}

/// Parses `grpc-timeout` (`<up to 8 digits><H|M|S|m|u|n>`).
pub fn parse_grpc_timeout(value: &str) -> Option<Duration> {
    if value.len() < 2 || value.len() > 9 {
        return None;
    }
    let (digits, unit) = value.split_at(value.len() - 1);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_parse_and_garbage_does_not() {
        assert_eq!(parse_grpc_timeout("5S"), Some(Duration::from_secs(5)));
        assert_eq!(parse_grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse_grpc_timeout("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(parse_grpc_timeout("10u"), Some(Duration::from_micros(10)));
        for bad in ["", "S", "5", "5x", "-5S", "123456789S", "5 S"] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad:?}");
        }
    }
}
