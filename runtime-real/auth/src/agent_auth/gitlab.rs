//! GitLab's internal API: `GET /api/v4/internal/kubernetes/agent_info` with the agent's
//! token as `Authorization: Bearer` and a kas-signed JWT in `Gitlab-Kas-Api-Request`.

use super::{AgentIdentity, AuthError, CachePolicy, CachedResolver, Fetch};
use crate::jwt::Signer;
use kas_core::{AgentId, ProjectId};
use serde::Deserialize;
use std::time::Duration;

/// The header GitLab expects kas's JWT in.
pub const KAS_API_REQUEST_HEADER: &str = "Gitlab-Kas-Api-Request";

/// GitLab's internal API as kas calls it: every request signed with kas's JWT, each
/// giving up after the client's timeout. Agent tokens and callers' tokens are checked
/// through it.
pub struct GitLabApi {
    http: reqwest::Client,
    base: String,
    signer: Signer,
}

impl GitLabApi {
    /// The API of the GitLab at `base` (e.g. `https://gitlab.example.com`), signing with
    /// `signer`; requests give up after `timeout`.
    pub fn new(base: &str, signer: Signer, timeout: Duration) -> Result<Self, String> {
        // TLS to GitLab uses ring; installing it twice is harmless.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(|e| format!("cannot build the GitLab HTTP client: {e}"))?;
        Ok(GitLabApi {
            http,
            base: base.trim_end_matches('/').to_string(),
            signer,
        })
    }

    /// A request for `path` (from `/api/v4/...`), not yet signed.
    pub fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http.request(method, format!("{}{path}", self.base))
    }

    /// Signs and sends `request`; a failure to get any answer is `Unavailable`.
    pub async fn send(
        &self,
        request: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, AuthError> {
        request
            .header(KAS_API_REQUEST_HEADER, self.signer.token())
            .send()
            .await
            .map_err(|e| AuthError::Unavailable(format!("GitLab request failed: {e}")))
    }
}

/// The fields of GitLab's answer that kas uses (others are ignored).
#[derive(Deserialize)]
struct AgentInfo {
    project_id: i64,
    agent_id: i64,
}

/// A client of GitLab's internal agent API.
pub struct GitLabClient {
    api: GitLabApi,
}

impl GitLabClient {
    /// A client of the GitLab at `base` (e.g. `https://gitlab.example.com`).
    pub fn new(base: &str, signer: Signer, timeout: Duration) -> Result<Self, String> {
        Ok(GitLabClient {
            api: GitLabApi::new(base, signer, timeout)?,
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
        let request = self
            .api
            .request(
                reqwest::Method::GET,
                "/api/v4/internal/kubernetes/agent_info",
            )
            .bearer_auth(token);
        let resp = self.api.send(request).await?;
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
