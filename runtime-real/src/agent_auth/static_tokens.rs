//! Agent tokens listed in a YAML file:
//!
//! ```yaml
//! agents:
//!   - token: "at least sixteen characters"
//!     agent_id: 1
//!     project_id: 10
//!     config: |          # optional: the agent's configuration file
//!       observability: {}
//! ```
// A std hash map on purpose: looked up by client-presented tokens, never iterated into an
// output; a random seed keeps lookup cost unrelated to the tokens' content.
#![allow(clippy::disallowed_types)]

use super::{AgentIdentity, AuthError};
use kas_core::{AgentId, ProjectId};
use serde::Deserialize;
use std::collections::HashMap;
use std::path::Path;

const MIN_TOKEN_LEN: usize = 16;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    agents: Vec<Entry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    token: String,
    agent_id: i64,
    project_id: i64,
    #[serde(default)]
    config: String,
}

/// Tokens from a file, looked up in memory.
#[derive(Debug)]
pub struct StaticTokens {
    by_token: HashMap<String, AgentIdentity>,
}

impl StaticTokens {
    /// Reads and checks a tokens file; errors name the entry at fault.
    pub fn load(path: &Path) -> Result<StaticTokens, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        Self::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Parses and checks the YAML text of a tokens file.
    pub fn parse(text: &str) -> Result<StaticTokens, String> {
        let file: File = serde_yaml::from_str(text).map_err(|e| e.to_string())?;
        let mut by_token = HashMap::new();
        for (i, e) in file.agents.into_iter().enumerate() {
            if e.token.len() < MIN_TOKEN_LEN {
                return Err(format!(
                    "agents[{i}].token is shorter than {MIN_TOKEN_LEN} characters"
                ));
            }
            if e.agent_id <= 0 || e.project_id <= 0 {
                return Err(format!(
                    "agents[{i}]: agent_id and project_id must be positive"
                ));
            }
            let identity = AgentIdentity {
                agent_id: AgentId(e.agent_id),
                project_id: ProjectId(e.project_id),
                config: e.config,
            };
            if by_token.insert(e.token, identity).is_some() {
                return Err(format!("agents[{i}].token is listed twice"));
            }
        }
        Ok(StaticTokens { by_token })
    }

    /// Resolves a token.
    pub fn resolve(&self, token: &str) -> Result<AgentIdentity, AuthError> {
        self.by_token
            .get(token)
            .cloned()
            .ok_or(AuthError::InvalidToken)
    }
}
