//! A cache in front of GitLab: answers are kept for `ttl`, errors for `error_ttl`.
//! Tokens are keyed by their SHA-256, so the cache holds no token in clear.

use super::{AgentIdentity, AuthError, GitLabClient};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

/// Entries kept at most; expired ones are swept when the cache is full.
const MAX_ENTRIES: usize = 100_000;

type Entry = (Instant, Result<AgentIdentity, AuthError>);

/// GitLab's resolver with a cache.
pub struct CachedResolver {
    client: GitLabClient,
    ttl: Duration,
    error_ttl: Duration,
    entries: Mutex<HashMap<[u8; 32], Entry>>,
}

impl CachedResolver {
    /// Caches answers of `client` for `ttl` and its errors for `error_ttl`.
    pub fn new(client: GitLabClient, ttl: Duration, error_ttl: Duration) -> Self {
        CachedResolver {
            client,
            ttl,
            error_ttl,
            entries: Mutex::new(HashMap::new()),
        }
    }

    /// Resolves `token`, from the cache when a fresh entry exists.
    pub async fn resolve(&self, token: &str) -> Result<AgentIdentity, AuthError> {
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let now = Instant::now();
        if let Some((until, answer)) = self.lock().get(&key)
            && *until > now
        {
            return answer.clone();
        }
        let answer = self.client.agent_info(token).await;
        let ttl = if answer.is_ok() {
            self.ttl
        } else {
            self.error_ttl
        };
        let mut entries = self.lock();
        if entries.len() >= MAX_ENTRIES {
            entries.retain(|_, (until, _)| *until > now);
        }
        if entries.len() < MAX_ENTRIES {
            entries.insert(key, (Instant::now() + ttl, answer.clone()));
        }
        answer
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], Entry>> {
        // A poisoned lock only means another resolve panicked mid-insert; the map is
        // still a valid cache.
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }
}
