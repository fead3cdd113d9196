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
// A std hash map on purpose: see `token_file`.
#![allow(clippy::disallowed_types)]

use super::{AgentIdentity, AuthError};
use crate::token_file;
use kas_core::{AgentId, ProjectId};
use serde::Deserialize;
use std::collections::HashMap;
use std::path::Path;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    token: String,
    agent_id: i64,
    project_id: i64,
    #[serde(default)]
    config: String,
}

impl token_file::Entry for Entry {
    type Value = AgentIdentity;

    fn into_pair(self) -> Result<(String, AgentIdentity), String> {
        if self.agent_id <= 0 || self.project_id <= 0 {
            return Err("agent_id and project_id must be positive".into());
        }
        let identity = AgentIdentity {
            agent_id: AgentId(self.agent_id),
            project_id: ProjectId(self.project_id),
            config: self.config,
        };
        Ok((self.token, identity))
    }
}

/// Tokens from a file, looked up in memory.
#[derive(Debug)]
pub struct StaticTokens {
    by_token: HashMap<String, AgentIdentity>,
}

impl StaticTokens {
    /// Reads and checks a tokens file; errors name the entry at fault.
    pub fn load(path: &Path) -> Result<StaticTokens, String> {
        let by_token = token_file::read::<Entry>(path, "agents")?;
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
