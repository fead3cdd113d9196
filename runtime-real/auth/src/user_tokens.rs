//! Who may reach which agent's Kubernetes API, and as whom.
//!
//! A request names its agent in its bearer token, in GitLab's forms:
//! `Authorization: Bearer pat:<agent-id>:<personal access token>` (a user) and
//! `Bearer ci:<agent-id>:<CI job token>` (a CI job). The token is checked against a static
//! file ([`StaticUserTokens`], local runs) or GitLab; what comes back says whether it may
//! reach that agent and whom the agent acts as towards its API server, by GitLab's
//! impersonation rules.

// Peer input passes through here: nothing may panic on it.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)
)]
// A std hash map on purpose: looked up by client-presented tokens, never iterated into an
// output; a random seed keeps lookup cost unrelated to the tokens' content.
#![allow(clippy::disallowed_types)]

use crate::token_file;
use kas_core::AgentId;
use kas_proto::frame::Values;
use kas_proto::http::Impersonation;
use serde::Deserialize;
use std::collections::HashMap;
use std::path::Path;

/// Which of GitLab's token forms a request used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenKind {
    /// `pat:`: a user's personal access token.
    Pat,
    /// `ci:`: a CI job's token.
    Ci,
}

/// A request's credential, parsed from its `Authorization` header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credential {
    /// Its form.
    pub kind: TokenKind,
    /// The agent it asks for.
    pub agent: AgentId,
    /// The token itself.
    pub token: String,
}

/// Why a request was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// 401: no credential, a malformed one, or a token no one knows.
    Unauthenticated(String),
    /// 403: a valid token that may not reach the agent.
    Forbidden(String),
    /// 503: the token could not be checked now.
    Unavailable(String),
    /// 429: too many unknown tokens checked; names the limit.
    Throttled(String),
}

/// What GitLab's token forms look like, for errors.
const FORMS: &str = "expected \"Authorization: Bearer pat:<agent id>:<personal access token>\" or \"Bearer ci:<agent id>:<CI job token>\"";

impl Credential {
    /// The bearer token again (`pat:<agent>:<token>`): the cache key of its check.
    pub fn to_bearer(&self) -> String {
        let kind = match self.kind {
            TokenKind::Pat => "pat",
            TokenKind::Ci => "ci",
        };
        format!("{kind}:{}:{}", self.agent, self.token)
    }

    /// Parses an `Authorization` header value.
    pub fn parse(header: Option<&str>) -> Result<Credential, Refusal> {
        let header = header
            .ok_or_else(|| Refusal::Unauthenticated(format!("no Authorization header: {FORMS}")))?;
        // The scheme is case-insensitive (RFC 7235), as kube-apiserver reads it.
        let bearer = header
            .split_once(' ')
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim_start_matches(' '))
            .ok_or_else(|| Refusal::Unauthenticated(format!("not a bearer token: {FORMS}")))?;
        let mut parts = bearer.splitn(3, ':');
        let (kind, agent, token) = (parts.next(), parts.next(), parts.next());
        let kind = match kind {
            Some("pat") => TokenKind::Pat,
            Some("ci") => TokenKind::Ci,
            _ => {
                return Err(Refusal::Unauthenticated(format!(
                    "the bearer token has no pat: or ci: prefix: {FORMS}"
                )));
            }
        };
        let agent = agent
            .and_then(|a| a.parse::<i64>().ok())
            .filter(|a| *a > 0)
            .ok_or_else(|| {
                Refusal::Unauthenticated(format!(
                    "the bearer token names no agent id (a positive number): {FORMS}"
                ))
            })?;
        let token = token.filter(|t| !t.is_empty()).ok_or_else(|| {
            Refusal::Unauthenticated(format!("the bearer token has no token part: {FORMS}"))
        })?;
        Ok(Credential {
            kind,
            agent: AgentId(agent),
            token: token.to_string(),
        })
    }
}

/// How the agent acts towards its API server for a token (GitLab's `access_as`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AccessAs {
    /// As the agent itself (its service account).
    Agent,
    /// As the GitLab user: `gitlab:user:<username>`.
    User,
    /// As the CI job: `gitlab:ci_job:<job id>`.
    CiJob,
}

/// The GitLab user or job a token belongs to, as far as impersonation needs it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Caller {
    /// The user's name (the job's user for a CI token).
    pub username: String,
    /// The CI job, for a CI token.
    pub job_id: Option<i64>,
    /// The CI job's project, for a CI token.
    pub project_id: Option<i64>,
}

/// Whom the agent acts as for `caller` reaching `agent` with `access`, by GitLab's rules;
/// `None`: as itself.
pub fn impersonation(access: AccessAs, caller: &Caller, agent: AgentId) -> Option<Impersonation> {
    let mut extra: HashMap<String, Values> = HashMap::new();
    let mut put = |k: &str, v: String| {
        extra.insert(k.to_string(), Values { values: vec![v] });
    };
    put("agent.gitlab.com/id", agent.0.to_string());
    put("agent.gitlab.com/username", caller.username.clone());
    let (user, groups) = match access {
        AccessAs::Agent => return None,
        AccessAs::User => (
            format!("gitlab:user:{}", caller.username),
            vec!["gitlab:user".to_string()],
        ),
        AccessAs::CiJob => {
            let job = caller.job_id.unwrap_or_default();
            put("agent.gitlab.com/ci_job_id", job.to_string());
            let mut groups = vec!["gitlab:ci_job".to_string()];
            if let Some(project) = caller.project_id {
                put("agent.gitlab.com/project_id", project.to_string());
                groups.push(format!("gitlab:project:{project}"));
            }
            (format!("gitlab:ci_job:{job}"), groups)
        }
    };
    Some(Impersonation {
        user,
        groups,
        extra,
    })
}

/// What a checked token allows.
#[derive(Clone, Debug, PartialEq)]
pub struct Grant {
    /// Whom the agent acts as; `None`: as itself.
    pub impersonation: Option<Impersonation>,
    /// Whose token it is (for the audit log).
    pub caller: Caller,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    token: String,
    kind: TokenKind,
    agent_ids: Vec<i64>,
    #[serde(default = "default_access_as")]
    access_as: AccessAs,
    username: String,
    #[serde(default)]
    job_id: Option<i64>,
    #[serde(default)]
    project_id: Option<i64>,
}

fn default_access_as() -> AccessAs {
    AccessAs::Agent
}

struct Known {
    kind: TokenKind,
    agents: Vec<AgentId>,
    access_as: AccessAs,
    caller: Caller,
}

/// User and CI job tokens listed in a YAML file (`agent.kubernetes_api.tokens_file`):
///
/// ```yaml
/// tokens:
///   - token: "at least sixteen characters"
///     kind: pat            # pat (a user's token) or ci (a CI job's)
///     agent_ids: [1, 2]    # the agents it reaches
///     access_as: user      # agent (default), user or ci_job: whom the agent acts as
///     username: alice
///     job_id: 42           # ci only
///     project_id: 7        # ci only
/// ```
pub struct StaticUserTokens {
    by_token: HashMap<String, Known>,
}

impl token_file::Entry for Entry {
    type Value = Known;

    fn into_pair(self) -> Result<(String, Known), String> {
        if self.agent_ids.is_empty() || self.agent_ids.iter().any(|a| *a <= 0) {
            return Err("agent_ids must list positive agent ids".into());
        }
        match (self.kind, self.access_as, self.job_id) {
            (TokenKind::Pat, AccessAs::CiJob, _) => {
                return Err("access_as ci_job needs kind ci".into());
            }
            (TokenKind::Ci, AccessAs::CiJob, None) => {
                return Err("access_as ci_job needs job_id".into());
            }
            _ => {}
        }
        let known = Known {
            kind: self.kind,
            agents: self.agent_ids.into_iter().map(AgentId).collect(),
            access_as: self.access_as,
            caller: Caller {
                username: self.username,
                job_id: self.job_id,
                project_id: self.project_id,
            },
        };
        Ok((self.token, known))
    }
}

impl StaticUserTokens {
    /// Reads and checks a tokens file; errors name the entry at fault.
    pub fn load(path: &Path) -> Result<StaticUserTokens, String> {
        let by_token = token_file::read::<Entry>(path, "tokens")?;
        Ok(StaticUserTokens { by_token })
    }

    /// Parses and checks the YAML text of a tokens file.
    pub fn parse(text: &str) -> Result<StaticUserTokens, String> {
        let by_token = token_file::parse::<Entry>(text, "tokens")?;
        Ok(StaticUserTokens { by_token })
    }

    /// Checks `credential`.
    pub fn check(&self, credential: &Credential) -> Result<Grant, Refusal> {
        let known = self
            .by_token
            .get(&credential.token)
            .filter(|k| k.kind == credential.kind)
            .ok_or_else(|| Refusal::Unauthenticated("the token is not valid".into()))?;
        if !known.agents.contains(&credential.agent) {
            return Err(Refusal::Forbidden(format!(
                "the token does not give access to agent {}",
                credential.agent
            )));
        }
        Ok(Grant {
            impersonation: impersonation(known.access_as, &known.caller, credential.agent),
            caller: known.caller.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gitlab_token_forms_parse_and_malformed_ones_are_named() {
        let c = Credential::parse(Some("Bearer pat:12:glpat-abc:def")).unwrap();
        assert_eq!(
            c,
            Credential {
                kind: TokenKind::Pat,
                agent: AgentId(12),
                token: "glpat-abc:def".into()
            }
        );
        assert_eq!(
            Credential::parse(Some("Bearer ci:3:job")).unwrap().kind,
            TokenKind::Ci
        );
        // The scheme in any case (RFC 7235), as kube-apiserver takes it.
        for scheme in ["bearer", "BEARER", "bEaReR"] {
            let header = format!("{scheme} pat:12:glpat-abc:def");
            assert_eq!(Credential::parse(Some(&header)).unwrap(), c, "{header}");
        }
        for (header, says) in [
            (Some("Bearerpat:1:t"), "not a bearer token"),
            (None, "no Authorization header"),
            (Some("Basic abc"), "not a bearer token"),
            (Some("Bearer xyz:1:t"), "no pat: or ci: prefix"),
            (Some("Bearer pat:-1:t"), "names no agent id"),
            (Some("Bearer pat:x:t"), "names no agent id"),
            (Some("Bearer pat:1:"), "no token part"),
            (Some("Bearer pat:1"), "no token part"),
        ] {
            match Credential::parse(header) {
                Err(Refusal::Unauthenticated(m)) => assert!(m.contains(says), "{m}"),
                other => panic!("{header:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_static_token_reaches_its_agents_only_with_its_form_and_impersonates_by_gitlab_rules() {
        let tokens = StaticUserTokens::parse(
            "tokens:\n\
             - {token: alice-token-000001, kind: pat, agent_ids: [1, 2], access_as: user, username: alice}\n\
             - {token: ci-job-token-00042, kind: ci, agent_ids: [2], access_as: ci_job, username: bob, job_id: 42, project_id: 7}\n\
             - {token: agent-access-00001, kind: pat, agent_ids: [1], username: carol}\n",
        )
        .unwrap();
        let cred = |kind, agent, token: &str| Credential {
            kind,
            agent: AgentId(agent),
            token: token.into(),
        };
        let alice = tokens
            .check(&cred(TokenKind::Pat, 2, "alice-token-000001"))
            .unwrap()
            .impersonation
            .unwrap();
        assert_eq!(alice.user, "gitlab:user:alice");
        assert_eq!(alice.groups, ["gitlab:user"]);
        assert_eq!(alice.extra["agent.gitlab.com/id"].values, ["2"]);
        let job = tokens
            .check(&cred(TokenKind::Ci, 2, "ci-job-token-00042"))
            .unwrap()
            .impersonation
            .unwrap();
        assert_eq!(job.user, "gitlab:ci_job:42");
        assert_eq!(job.groups, ["gitlab:ci_job", "gitlab:project:7"]);
        let carol = tokens
            .check(&cred(TokenKind::Pat, 1, "agent-access-00001"))
            .unwrap();
        assert_eq!(carol.impersonation, None, "access as the agent itself");
        assert!(matches!(
            tokens.check(&cred(TokenKind::Ci, 1, "ci-job-token-00042")),
            Err(Refusal::Forbidden(m)) if m.contains("agent 1")
        ));
        assert!(
            matches!(
                tokens.check(&cred(TokenKind::Ci, 1, "alice-token-000001")),
                Err(Refusal::Unauthenticated(_))
            ),
            "a user token presented as a CI job's"
        );
        assert!(matches!(
            tokens.check(&cred(TokenKind::Pat, 1, "unknown-token-0000")),
            Err(Refusal::Unauthenticated(_))
        ));
    }

    #[test]
    fn a_bad_tokens_file_names_the_entry_at_fault() {
        for (text, says) in [
            (
                "tokens:\n- {token: short, kind: pat, agent_ids: [1], username: a}\n",
                "tokens[0].token is shorter",
            ),
            (
                "tokens:\n- {token: long-enough-token-1, kind: pat, agent_ids: [], username: a}\n",
                "tokens[0]: agent_ids",
            ),
            (
                "tokens:\n- {token: long-enough-token-1, kind: pat, agent_ids: [1], access_as: ci_job, username: a}\n",
                "needs kind ci",
            ),
            (
                "tokens:\n- {token: long-enough-token-1, kind: ci, agent_ids: [1], access_as: ci_job, username: a}\n",
                "needs job_id",
            ),
            (
                "tokens:\n- {token: long-enough-token-1, kind: pat, agent_ids: [1], username: a}\n- {token: long-enough-token-1, kind: ci, agent_ids: [1], username: a}\n",
                "tokens[1].token is listed twice",
            ),
            (
                "tokens:\n- {token: long-enough-token-1, kind: jwt, agent_ids: [1], username: a}\n",
                "unknown variant",
            ),
        ] {
            let e = StaticUserTokens::parse(text).err().expect(text);
            assert!(e.contains(says), "{e}");
        }
    }
}
