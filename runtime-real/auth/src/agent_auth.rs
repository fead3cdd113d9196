//! Agent authentication: an agent's bearer token resolves to (agent id, project id).
//!
//! Two resolvers: a static tokens file (local runs, tests) and GitLab's internal API,
//! whose answers are cached. [`AgentAuth`] picks one from the configuration.

mod cache;
mod gitlab;
mod static_tokens;

pub use cache::{CachePolicy, CachedResolver, Fetch, TokenCache};
pub use gitlab::{GitLabApi, GitLabClient};
pub use static_tokens::StaticTokens;

use kas_core::{AgentId, ProjectId};
use std::net::IpAddr;

/// Who an agent token belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentIdentity {
    /// The agent.
    pub agent_id: AgentId,
    /// Its configuration project.
    pub project_id: ProjectId,
    /// The agent's configuration file (YAML) served on `GetConfiguration`.
    pub config: String,
}

/// Why a token did not resolve.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// The token is unknown or revoked.
    #[error("token is not valid")]
    InvalidToken,
    /// The token is valid but may not do what it was presented for.
    #[error("{0}")]
    Forbidden(String),
    /// The resolver could not answer (GitLab unreachable or erroring).
    #[error("cannot check the agent token: {0}")]
    Unavailable(String),
    /// Too many lookups of unknown tokens: refused without asking GitLab.
    #[error("agent token not checked: {reason}")]
    Throttled {
        /// The configuration key of the limit that was hit.
        limit: &'static str,
        /// What was exceeded, naming the limit.
        reason: String,
    },
}

/// The configured resolver.
#[derive(Clone)]
pub enum AgentAuth {
    /// Tokens from a file.
    Static(std::sync::Arc<StaticTokens>),
    /// GitLab's internal API, cached.
    GitLab(std::sync::Arc<CachedResolver>),
}

impl AgentAuth {
    /// Resolves `token`, presented by a client at `peer`.
    pub async fn resolve(
        &self,
        token: &str,
        peer: Option<IpAddr>,
    ) -> Result<AgentIdentity, AuthError> {
        match self {
            AgentAuth::Static(s) => s.resolve(token),
            AgentAuth::GitLab(g) => g.resolve(token, peer).await,
        }
    }

    /// Resolves the token of an `authorization: Bearer <token>` header.
    pub async fn resolve_bearer(
        &self,
        header: Option<&str>,
        peer: Option<IpAddr>,
    ) -> Result<AgentIdentity, AuthError> {
        let token = header
            .and_then(|h| h.strip_prefix("Bearer "))
            .filter(|t| !t.is_empty())
            .ok_or(AuthError::InvalidToken)?;
        self.resolve(token, peer).await
    }
}
