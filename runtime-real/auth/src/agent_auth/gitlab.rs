//! GitLab's internal API: `GET /api/v4/internal/kubernetes/agent_info` with the agent's
//! token as `Authorization: Bearer` and a kas-signed JWT in `Gitlab-Kas-Api-Request`.

use super::{AgentIdentity, AuthError, CachePolicy, CachedResolver, Fetch};
use crate::jwt::Signer;
use kas_core::{AgentId, ProjectId};
use serde::Deserialize;
use std::time::Duration;

/// The header GitLab expects kas's JWT in.
pub const KAS_API_REQUEST_HEADER: &str = "Gitlab-Kas-Api-Request";

/// An HTTP client for GitLab's API whose requests give up after `timeout`.
pub fn http_client(timeout: Duration) -> Result<reqwest::Client, String> {
    // TLS to GitLab uses ring; installing it twice is harmless.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .timeout(timeout)
        .build()
        .map_err(|e| format!("cannot build the GitLab HTTP client: {e}"))
}

/// The fields of GitLab's answer that kas uses (others are ignored).
#[derive(Deserialize)]
struct AgentInfo {
    project_id: i64,
    agent_id: i64,
}

/// A client of GitLab's internal agent API.
pub struct GitLabClient {
    http: reqwest::Client,
    url: String,
    signer: Signer,
}

impl GitLabClient {
    /// A client of the GitLab at `base` (e.g. `https://gitlab.example.com`).
    pub fn new(base: &str, signer: Signer, timeout: Duration) -> Result<Self, String> {
        Ok(GitLabClient {
            http: http_client(timeout)?,
            url: format!(
                "{}/api/v4/internal/kubernetes/agent_info",
                base.trim_end_matches('/')
            ),
            signer,
        })
    }

    /// [`GitLabClient::agent_info`] behind a cache with `policy`.
    pub fn cached(self, policy: CachePolicy) -> CachedResolver {
        let client = std::sync::Arc::new(self);
        let fetch: Fetch<AgentIdentity> = std::sync::Arc::new(move |token: String| {
            let client = client.clone();
            Box::pin(async move { client.agent_info(&token).await })
        });
        CachedResolver::new(fetch, policy)
    }

    /// Asks GitLab whose token this is.
    pub async fn agent_info(&self, token: &str) -> Result<AgentIdentity, AuthError> {
        let resp = self
            .http
            .get(&self.url)
            .bearer_auth(token)
            .header(KAS_API_REQUEST_HEADER, self.signer.token())
            .send()
            .await
            .map_err(|e| AuthError::Unavailable(format!("GitLab request failed: {e}")))?;
        let status = resp.status();
        if status == reqwest::StatusCode::UNAUTHORIZED || status == reqwest::StatusCode::NOT_FOUND {
            return Err(AuthError::InvalidToken);
        }
        if !status.is_success() {
            return Err(AuthError::Unavailable(format!(
                "GitLab answered {status} to agent_info"
            )));
        }
        let info: AgentInfo = resp.json().await.map_err(|e| {
            AuthError::Unavailable(format!("GitLab's agent_info is malformed: {e}"))
        })?;
        Ok(AgentIdentity {
            agent_id: AgentId(info.agent_id),
            project_id: ProjectId(info.project_id),
            config: String::new(),
        })
    }
}
