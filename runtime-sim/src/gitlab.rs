//! GitLab's internal API as kas's agent-token lookups see it (`agent_info`), simulated:
//! each kas resolves agent tokens through its own token cache (kas-auth's `TokenCache`,
//! configured as in production but for shorter lifetimes), whose lookups this answers.
//! Faults make it slow, make it fail, and revoke an agent's token.

use kas_auth::agent_auth::{AgentIdentity, AuthError, Fetch};
use kas_core::{AgentId, ProjectId};
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The project every agent belongs to.
pub const PROJECT: i64 = 100;

/// Agents `1..=MAX_AGENT` have tokens, so that agents may be added while the cluster runs.
pub const MAX_AGENT: i64 = 64;

/// The token of `agent`.
pub fn token(agent: i64) -> String {
    format!("sim-agent-token-{agent:04}-0123456789")
}

/// The agent whose token `token` is, if any.
fn agent_of(token: &str) -> Option<i64> {
    let agent: i64 = token
        .strip_prefix("sim-agent-token-")?
        .strip_suffix("-0123456789")?
        .parse()
        .ok()?;
    (1..=MAX_AGENT).contains(&agent).then_some(agent)
}

/// The simulated GitLab, shared by every kas and the fault injector.
#[derive(Clone, Debug, Default)]
pub struct GitLab {
    state: Arc<Mutex<State>>,
}

#[derive(Debug, Default)]
struct State {
    /// Every answer takes this long.
    latency: Duration,
    /// Every lookup fails, as GitLab answering 502 does.
    failing: bool,
    /// Agents whose tokens are revoked.
    revoked: BTreeSet<i64>,
}

impl GitLab {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Answers take `latency` from now on.
    pub fn set_latency(&self, latency: Duration) {
        self.lock().latency = latency;
    }

    /// Lookups fail (or succeed again) from now on.
    pub fn set_failing(&self, failing: bool) {
        self.lock().failing = failing;
    }

    /// Revokes `agent`'s token, or gives it back.
    pub fn set_revoked(&self, agent: i64, revoked: bool) {
        let mut state = self.lock();
        if revoked {
            state.revoked.insert(agent);
        } else {
            state.revoked.remove(&agent);
        }
    }

    /// The lookup a kas's token cache makes: the answer as GitLab stands when it is
    /// given, after the latency.
    pub fn agent_info(&self) -> Fetch<AgentIdentity> {
        let gitlab = self.clone();
        Arc::new(move |token: String| {
            let gitlab = gitlab.clone();
            Box::pin(async move {
                let latency = gitlab.lock().latency;
                tokio::time::sleep(latency).await;
                let state = gitlab.lock();
                if state.failing {
                    return Err(AuthError::Unavailable(
                        "simulated GitLab answered 502".into(),
                    ));
                }
                match agent_of(&token) {
                    Some(agent) if !state.revoked.contains(&agent) => Ok(AgentIdentity {
                        agent_id: AgentId(agent),
                        project_id: ProjectId(PROJECT),
                        config: String::new(),
                    }),
                    _ => Err(AuthError::InvalidToken),
                }
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[madsim::test]
    async fn answers_as_gitlab_stands_when_asked() {
        let gitlab = GitLab::default();
        let ask = gitlab.agent_info();
        let who = ask(token(7)).await.expect("a known token");
        assert_eq!(who.agent_id, AgentId(7));
        assert_eq!(
            ask("sim-agent-token-0999-0123456789".into()).await,
            Err(AuthError::InvalidToken)
        );
        gitlab.set_revoked(7, true);
        assert_eq!(ask(token(7)).await, Err(AuthError::InvalidToken));
        gitlab.set_failing(true);
        assert!(matches!(
            ask(token(8)).await,
            Err(AuthError::Unavailable(_))
        ));
        gitlab.set_failing(false);
        gitlab.set_revoked(7, false);
        assert!(ask(token(7)).await.is_ok());
    }
}
