//! Invariant 17: each kas's Kubernetes API audit log (`agent.kubernetes_api.audit`)
//! records every request a caller got an answer to through it, once, as the caller saw it
//! (status, agent, the user and whom the agent acted as), with where it was served, and
//! never a caller's token or the identity a caller claimed. Only a kas killed during or
//! after a request may lack its record (what is queued dies with the process); a kas
//! that stops gracefully writes every record first. No record names a request that was
//! not made to that kas.

use super::Outage;
use crate::callers::{CLAIMED, GREEDY_TOKEN, IMPERSONATED, USER_TOKEN};
use crate::workload::Call;
use serde_json::Value;
use std::collections::BTreeMap;

/// Violations of invariant 17 by `logs` (each kas's audit lines, oldest first), given
/// the `calls` GitLab's callers made and when kas were stopped or killed (`outages`).
/// `kas_id` names kas `i` as its records do.
pub fn check_audit(
    logs: &[Vec<String>],
    kas_id: impl Fn(usize) -> String,
    calls: &[Call],
    outages: &[Outage],
) -> Vec<String> {
    let mut violations = Vec::new();
    let by_marker: BTreeMap<&str, &Call> = calls.iter().map(|c| (c.marker.as_str(), c)).collect();
    for (kas, lines) in logs.iter().enumerate() {
        let mut recorded: BTreeMap<String, usize> = BTreeMap::new();
        for line in lines {
            let mut wrong = |what: String| {
                violations.push(format!("inv 17: kas{kas}'s audit record {what}: {line}"));
            };
            if [USER_TOKEN, GREEDY_TOKEN, CLAIMED]
                .iter()
                .any(|t| line.contains(t))
            {
                wrong("holds a caller's token or claimed identity".into());
            }
            let record: Value = match serde_json::from_str(line) {
                Ok(v) => v,
                Err(e) => {
                    wrong(format!("is not JSON ({e})"));
                    continue;
                }
            };
            if record["routing_kas"] != kas_id(kas).as_str() {
                wrong(format!("names another routing kas than {}", kas_id(kas)));
            }
            let id = record["correlation_id"].as_str().unwrap_or_default();
            let Some(marker) = id.strip_prefix("sim-") else {
                // Made by kas for a request that sent none: the greedy caller's watches.
                let path = record["path"].as_str().unwrap_or_default();
                if !path.contains(crate::api_server::NO_CORRELATION_ID) {
                    wrong("has a correlation id no caller sent".into());
                }
                continue;
            };
            *recorded.entry(marker.to_string()).or_default() += 1;
            let Some(call) = by_marker
                .get(marker)
                .filter(|c| c.kas == kas && c.http.is_some())
            else {
                wrong("is of a request not made to this kas".into());
                continue;
            };
            if let Some(why) = differs(&record, call) {
                wrong(why);
            }
        }
        for (marker, n) in &recorded {
            if *n > 1 {
                violations.push(format!("inv 17: kas{kas} recorded {marker} {n} times"));
            }
        }
        for call in calls.iter().filter(|c| c.kas == kas) {
            let Some(status) = call.http.as_ref().and_then(|h| h.status) else {
                continue;
            };
            let killed = outages
                .iter()
                .any(|o| o.kas == kas && o.killed && o.from >= call.started);
            if !killed && !recorded.contains_key(&call.marker) {
                violations.push(format!(
                    "inv 17: {} was answered {status} through kas{kas}, which has no audit record of it (kas{kas} was not killed since)",
                    call.marker
                ));
            }
        }
    }
    violations
}

/// How `record` differs from what `call`'s caller sent and saw, if it does.
fn differs(record: &Value, call: &Call) -> Option<String> {
    if record["agent_id"] != call.agent {
        return Some(format!("names another agent than {}", call.agent));
    }
    if !record["path"]
        .as_str()
        .is_some_and(|p| p.contains(&call.marker))
    {
        return Some("has another path".into());
    }
    // A request refused before its token was read names no caller.
    let caller = &record["caller"];
    if !caller.is_null()
        && (caller["username"] != "sim" || record["impersonated"]["user"] != IMPERSONATED)
    {
        return Some(format!(
            "names another caller than sim, acting as {IMPERSONATED}"
        ));
    }
    let seen = call.http.as_ref()?;
    if let Some(status) = seen.status.filter(|s| record["status"] != *s) {
        return Some(format!(
            "has another status than the {status} its caller saw"
        ));
    }
    if call.result.is_err() {
        return None;
    }
    // Answered whole: where, and (framing included) at least what the caller received.
    let served = ["serving_kas", "agent_connection_id"]
        .iter()
        .all(|f| !record[*f].is_null());
    if !served {
        return Some("of a request an agent answered does not say where it was served".into());
    }
    let counted = record["response_bytes"].as_u64().unwrap_or(0);
    if counted < seen.received as u64 {
        return Some(format!(
            "counts {counted} response bytes, fewer than the {} its caller received",
            seen.received
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::Http;
    use std::time::Duration;
    use tokio::time::Instant;

    /// A request through kas 0's Kubernetes API listener for agent 1 that `status` answered.
    fn request(marker: &str, status: Option<u16>) -> Call {
        Call {
            two_way: true,
            http: Some(Http {
                status,
                received: 10,
            }),
            ..Call::sample(marker, 0, 1, Instant::now())
        }
    }

    /// kas 0's record of `marker`, answered `status`.
    fn record(marker: &str, status: u16) -> String {
        serde_json::json!({
            "correlation_id": format!("sim-{marker}"),
            "routing_kas": "kas0",
            "serving_kas": "kas0",
            "agent_connection_id": 7,
            "agent_id": 1,
            "path": format!("/api/v1/namespaces/default/pods/{marker}"),
            "caller": {"kind": "pat", "username": "sim"},
            "impersonated": {"user": IMPERSONATED, "groups": []},
            "status": status,
            "response_bytes": 12,
        })
        .to_string()
    }

    fn checked(lines: &[String], calls: &[Call], outages: &[Outage]) -> Vec<String> {
        check_audit(&[lines.to_vec()], |i| format!("kas{i}"), calls, outages)
    }

    #[madsim::test]
    async fn every_answered_request_has_one_record_as_its_caller_saw_it() {
        let calls = [request("a", Some(200)), request("b", None)];
        assert!(checked(&[record("a", 200)], &calls, &[]).is_empty());
        let missing = checked(&[], &calls, &[]);
        assert!(missing[0].contains("no audit record of it"), "{missing:?}");
        assert_eq!(missing.len(), 1, "b never got an answer: {missing:?}");
        let twice = checked(&[record("a", 200), record("a", 200)], &calls, &[]);
        assert!(twice[0].contains("recorded a 2 times"), "{twice:?}");
        let other = checked(&[record("a", 504)], &calls, &[]);
        assert!(
            other[0].contains("another status than the 200"),
            "{other:?}"
        );
        let short = record("a", 200).replace("\"response_bytes\":12", "\"response_bytes\":9");
        let fewer = checked(&[short], &calls, &[]);
        assert!(fewer[0].contains("fewer than the 10"), "{fewer:?}");
    }

    #[madsim::test]
    async fn a_record_of_no_request_or_with_a_secret_is_reported() {
        let calls = [request("a", Some(200))];
        let unknown = checked(&[record("a", 200), record("z", 200)], &calls, &[]);
        assert!(unknown[0].contains("not made to this kas"), "{unknown:?}");
        let leaked = record("a", 200).replace("sim\"", &format!("{USER_TOKEN}\""));
        let found = checked(&[leaked], &calls, &[]);
        assert!(found[0].contains("token"), "{found:?}");
    }

    #[madsim::test]
    async fn only_a_kill_since_the_request_excuses_a_missing_record() {
        let calls = [request("a", Some(200))];
        let at = |killed: bool, from: Instant| Outage {
            kas: 0,
            from,
            to: from + Duration::from_secs(1),
            killed,
        };
        let later = calls[0].started + Duration::from_secs(1);
        assert!(checked(&[], &calls, &[at(true, later)]).is_empty());
        assert_eq!(checked(&[], &calls, &[at(false, later)]).len(), 1);
        let before = calls[0].started - Duration::from_millis(1);
        assert_eq!(checked(&[], &calls, &[at(true, before)]).len(), 1);
    }
}
