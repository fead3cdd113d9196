//! Callers' tokens checked by GitLab, as GitLab's kas does: a user's personal access token
//! with `POST /api/v4/internal/kubernetes/authorize_proxy_user`, a CI job's token with
//! `GET /api/v4/job/allowed_agents`; both requests carry kas's JWT in
//! `Gitlab-Kas-Api-Request`. Answers are cached like agent tokens' (see
//! [`TokenCache`]).

use kas_auth::agent_auth::{AuthError, CachePolicy, Fetch, GitLabApi, TokenCache};
use kas_auth::jwt::Signer;
use kas_auth::user_tokens::{AccessAs, Caller, Credential, Grant, TokenKind, impersonation};
use kas_core::AgentId;
use serde::Deserialize;
use std::sync::Arc;
use std::time::Duration;

/// GitLab's `access_as` (unknown kinds are refused, not guessed at).
#[derive(Deserialize, Default)]
struct AccessAsJson {
    agent: Option<serde_json::Value>,
    user: Option<serde_json::Value>,
    ci_job: Option<serde_json::Value>,
}

impl AccessAsJson {
    fn kind(&self) -> Option<AccessAs> {
        match (&self.agent, &self.user, &self.ci_job) {
            (Some(_), None, None) => Some(AccessAs::Agent),
            (None, Some(_), None) => Some(AccessAs::User),
            (None, None, Some(_)) => Some(AccessAs::CiJob),
            _ => None,
        }
    }
}

#[derive(Deserialize)]
struct User {
    username: String,
}

#[derive(Deserialize)]
struct Id {
    id: i64,
}

/// `authorize_proxy_user`'s answer (fields kas uses).
#[derive(Deserialize)]
struct ProxyUser {
    user: User,
    access_as: AccessAsJson,
}

#[derive(Deserialize)]
struct AllowedAgent {
    id: i64,
    #[serde(default)]
    configuration: Configuration,
}

#[derive(Deserialize, Default)]
struct Configuration {
    access_as: Option<AccessAsJson>,
}

/// `allowed_agents`'s answer (fields kas uses).
#[derive(Deserialize)]
struct AllowedAgents {
    allowed_agents: Vec<AllowedAgent>,
    job: Id,
    project: Id,
    user: User,
}

/// A client of GitLab's user and CI job authorization.
pub struct GitLabAccess {
    api: GitLabApi,
}

impl GitLabAccess {
    /// A client of the GitLab at `base`, signing with `signer`.
    pub fn new(base: &str, signer: Signer, timeout: Duration) -> Result<Self, String> {
        Ok(GitLabAccess {
            api: GitLabApi::new(base, signer, timeout)?,
        })
    }

    /// The checks behind a cache with `policy`, keyed by the whole credential (the same
    /// token may reach one agent and not another).
    pub fn cached(self, policy: CachePolicy) -> TokenCache<Grant> {
        let this = Arc::new(self);
        let fetch: Fetch<Grant> = Arc::new(move |bearer: String| {
            let this = this.clone();
            Box::pin(async move {
                let credential = Credential::parse(Some(&format!("Bearer {bearer}")))
                    .map_err(|_| AuthError::InvalidToken)?;
                this.authorize(&credential).await
            })
        });
        TokenCache::new(fetch, policy)
    }

    /// Asks GitLab what `credential` may do.
    pub async fn authorize(&self, credential: &Credential) -> Result<Grant, AuthError> {
        let agent = credential.agent;
        let request = match credential.kind {
            TokenKind::Pat => self
                .api
                .request(
                    reqwest::Method::POST,
                    "/api/v4/internal/kubernetes/authorize_proxy_user",
                )
                .json(&serde_json::json!({
                    "agent_id": agent.0,
                    "access_type": "personal_access_token",
                    "access_key": credential.token,
                    "csrf_token": "",
                })),
            TokenKind::Ci => self
                .api
                .request(reqwest::Method::GET, "/api/v4/job/allowed_agents")
                .header("Job-Token", &credential.token),
        };
        let resp = self.api.send(request).await?;
        let status = resp.status();
        match status.as_u16() {
            200..=299 => {}
            401 => return Err(AuthError::InvalidToken),
            403 | 404 => {
                return Err(AuthError::Forbidden(format!(
                    "GitLab says the token may not reach agent {agent}"
                )));
            }
            _ => {
                return Err(AuthError::Unavailable(format!(
                    "GitLab answered {status} to the token check"
                )));
            }
        }
        let malformed = |e: reqwest::Error| {
            AuthError::Unavailable(format!(
                "GitLab's answer to the token check is malformed: {e}"
            ))
        };
        let (access, caller) = match credential.kind {
            TokenKind::Pat => {
                let answer: ProxyUser = resp.json().await.map_err(malformed)?;
                let caller = Caller {
                    username: answer.user.username,
                    ..Caller::default()
                };
                (answer.access_as.kind(), caller)
            }
            TokenKind::Ci => {
                let answer: AllowedAgents = resp.json().await.map_err(malformed)?;
                let allowed = answer
                    .allowed_agents
                    .into_iter()
                    .find(|a| AgentId(a.id) == agent)
                    .ok_or_else(|| {
                        AuthError::Forbidden(format!(
                            "the CI job may not reach agent {agent} (not in its allowed agents)"
                        ))
                    })?;
                let caller = Caller {
                    username: answer.user.username,
                    job_id: Some(answer.job.id),
                    project_id: Some(answer.project.id),
                };
                // An agent that configures no access_as gives CI jobs its own access.
                let access = match allowed.configuration.access_as {
                    None => Some(AccessAs::Agent),
                    Some(a) => a.kind(),
                };
                (access, caller)
            }
        };
        let access = access.ok_or_else(|| {
            AuthError::Forbidden(format!(
                "agent {agent}'s access_as is one kas does not support (agent, user or ci_job)"
            ))
        })?;
        Ok(Grant {
            impersonation: impersonation(access, &caller, agent),
            caller,
        })
    }
}
