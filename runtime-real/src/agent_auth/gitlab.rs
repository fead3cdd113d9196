//! GitLab's internal API: `GET /api/v4/internal/kubernetes/agent_info` with the agent's
//! token as `Authorization: Bearer` and a kas-signed JWT in `Gitlab-Kas-Api-Request`.

use super::{AgentIdentity, AuthError};
use crate::jwt::Signer;
use kas_core::{AgentId, ProjectId};
use serde::Deserialize;
use std::time::Duration;

/// The header GitLab expects kas's JWT in.
pub const KAS_API_REQUEST_HEADER: &str = "Gitlab-Kas-Api-Request";

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
        // TLS to GitLab uses ring; installing it twice is harmless.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(|e| format!("cannot build the GitLab HTTP client: {e}"))?;
        Ok(GitLabClient {
            http,
            url: format!(
                "{}/api/v4/internal/kubernetes/agent_info",
                base.trim_end_matches('/')
            ),
            signer,
        })
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
