//! Invariant 11: a token GitLab revokes after accepting it stops being served within a
//! bound: no call reaches its agent from then on, through any kas.

use crate::truth::Delivery;
use std::time::Duration;
use tokio::time::Instant;

/// Within this long of GitLab revoking a token, its agent's connections must have ended:
/// the simulation's `agent.configuration.poll_period` (1 s), its `agent.info_cache_ttl`
/// (2 s, for which kas may keep GitLab's last yes), and a second to spare.
pub const REVOKE_BOUND: Duration = Duration::from_secs(4);

/// GitLab refused `agent`'s token from `from` until `to`.
#[derive(Clone, Copy, Debug)]
pub struct Revocation {
    /// The agent.
    pub agent: i64,
    /// When GitLab revoked its token.
    pub from: Instant,
    /// When it accepted it again.
    pub to: Instant,
}

/// Violations of invariant 11 by `truth`: a call delivered to an agent between
/// [`REVOKE_BOUND`] after its token was revoked and its reinstatement.
pub fn check_revoked(revocations: &[Revocation], truth: &[Delivery]) -> Vec<String> {
    truth
        .iter()
        .filter_map(|d| {
            let r = revocations
                .iter()
                .find(|r| r.agent == d.agent && r.from + REVOKE_BOUND <= d.at && d.at <= r.to)?;
            Some(format!(
                "inv 11: {} reached agent {} replica {} {:?} after GitLab revoked its token (bound {REVOKE_BOUND:?})",
                d.marker,
                d.agent,
                d.replica,
                d.at - r.from
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[madsim::test]
    async fn a_call_served_past_the_bound_of_a_revocation_is_reported() {
        let t0 = Instant::now();
        let s = |ms: u64| t0 + Duration::from_millis(ms);
        let delivered = |agent: i64, at: u64| Delivery {
            marker: format!("c{agent}-{at}"),
            agent,
            replica: 0,
            at: s(at),
        };
        let revoked = Revocation {
            agent: 1,
            from: s(1_000),
            to: s(9_000),
        };
        let truth = [
            delivered(1, 2_000), // within the bound
            delivered(1, 6_000), // past it: reported
            delivered(2, 6_000), // another agent
            delivered(1, 9_500), // reinstated
        ];
        let found = check_revoked(&[revoked], &truth);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].starts_with("inv 11: c1-6000"), "{found:?}");
    }
}
