//! A cache in front of GitLab's token checks (an agent's token, or a user's or CI job's
//! for the Kubernetes API): answers are kept for `ttl`, errors for `error_ttl`. Tokens are
//! keyed by their SHA-256, so the cache holds no token in clear.
//!
//! - One GitLab request per token at a time: concurrent lookups share it (300 concurrent
//!   first uses of one token once made 300 requests).
//! - The newest answer wins: an answer to a request older than the cached one's is
//!   dropped (a slow 502 once replaced a fresh 200 and locked a valid agent out).
//! - While GitLab fails, a token it accepted within `stale_ttl` is still accepted.
//! - Lookups of tokens not known to be good are rate-limited, overall and per client
//!   address, so that spraying random tokens does not reach GitLab one to one.
// Std hash maps on purpose: keys are client input (tokens, addresses), and a random seed
// resists hash flooding; they are looked up and pruned, never iterated into an output.
#![allow(clippy::disallowed_types)]

use super::{AgentIdentity, AuthError};
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use kas_transport::rate::{Bucket, Rate};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// Entries kept at most; stale ones are swept when the cache is full.
const MAX_ENTRIES: usize = 100_000;
/// Client addresses whose lookup rate is tracked at most.
const MAX_ADDRESSES: usize = 10_000;

type Key = [u8; 32];
/// A GitLab request in flight, shared by every lookup of its token.
type Flight<T> = Shared<BoxFuture<'static, Result<T, AuthError>>>;

/// Asks GitLab about one token.
pub type Fetch<T> = Arc<dyn Fn(String) -> BoxFuture<'static, Result<T, AuthError>> + Send + Sync>;

struct Entry<T> {
    answer: Result<T, AuthError>,
    until: Instant,
    /// When the request behind `answer` was sent.
    asked_at: Instant,
    /// GitLab's last acceptance of the token, and when it answered.
    last_good: Option<(Instant, T)>,
}

/// How long answers are kept, and how fast unknown tokens may be looked up.
#[derive(Clone, Copy, Debug)]
pub struct CachePolicy {
    /// Accepted tokens are cached this long (`agent.info_cache_ttl`).
    pub ttl: Duration,
    /// Refusals and failures this long (`agent.info_cache_error_ttl`).
    pub error_ttl: Duration,
    /// A token accepted this recently is still accepted while GitLab fails
    /// (`agent.info_cache_stale_ttl`).
    pub stale_ttl: Duration,
    /// Lookups of tokens not known to be good, per second (`agent.token_lookups_per_second`).
    pub lookups_per_second: u32,
    /// The same, per client address (`agent.token_lookups_per_second_per_address`).
    pub lookups_per_second_per_address: u32,
}

struct State<T> {
    entries: HashMap<Key, Entry<T>>,
    flights: HashMap<Key, Flight<T>>,
    overall: Bucket,
    per_address: HashMap<IpAddr, Bucket>,
}

/// GitLab's token check with a cache.
pub struct TokenCache<T> {
    fetch: Fetch<T>,
    policy: CachePolicy,
    state: Arc<Mutex<State<T>>>,
}

/// The agent-token resolver: GitLab's `agent_info`, cached.
pub type CachedResolver = TokenCache<AgentIdentity>;

fn rate(per_second: u32) -> Rate {
    Rate {
        events: per_second,
        per: Duration::from_secs(1),
    }
}

impl<T: Clone + Send + Sync + 'static> TokenCache<T> {
    /// Caches answers of `fetch` as `policy` says.
    pub fn new(fetch: Fetch<T>, policy: CachePolicy) -> Self {
        let overall = rate(policy.lookups_per_second).bucket(Instant::now());
        TokenCache {
            fetch,
            policy,
            state: Arc::new(Mutex::new(State {
                entries: HashMap::new(),
                flights: HashMap::new(),
                overall,
                per_address: HashMap::new(),
            })),
        }
    }

    /// Resolves `token`, presented by a client at `peer`, from the cache when a fresh
    /// entry exists.
    pub async fn resolve(&self, token: &str, peer: Option<IpAddr>) -> Result<T, AuthError> {
        let key: Key = Sha256::digest(token.as_bytes()).into();
        let flight = {
            let mut state = lock(&self.state);
            let now = Instant::now();
            if let Some(e) = state.entries.get(&key)
                && e.until > now
            {
                return e.answer.clone();
            }
            match state.flights.get(&key) {
                Some(f) => f.clone(),
                None => {
                    let known = state.entries.get(&key).is_some_and(|e| {
                        e.last_good
                            .as_ref()
                            .is_some_and(|(at, _)| now < *at + self.policy.stale_ttl)
                    });
                    if !known {
                        self.admit(&mut state, peer, now)?;
                    }
                    let f = self.ask(key, token.to_string(), now);
                    state.flights.insert(key, f.clone());
                    f
                }
            }
        };
        flight.await
    }

    /// Takes a lookup from the overall and the per-address budgets.
    fn admit(
        &self,
        state: &mut State<T>,
        peer: Option<IpAddr>,
        now: Instant,
    ) -> Result<(), AuthError> {
        let overall = rate(self.policy.lookups_per_second);
        let per_address = rate(self.policy.lookups_per_second_per_address);
        let throttled = |limit: &'static str, what: String| AuthError::Throttled {
            limit,
            reason: format!("{what} (limit {limit})"),
        };
        if let Some(ip) = peer {
            if state.per_address.len() >= MAX_ADDRESSES {
                state
                    .per_address
                    .retain(|_, b| !per_address.is_full(b, now));
            }
            let bucket = state
                .per_address
                .entry(ip)
                .or_insert(per_address.bucket(now));
            if !per_address.take(bucket, now) {
                return Err(throttled(
                    "agent.token_lookups_per_second_per_address",
                    format!(
                        "more than {} unknown tokens per second from {ip}",
                        per_address.events
                    ),
                ));
            }
        }
        if !overall.take(&mut state.overall, now) {
            return Err(throttled(
                "agent.token_lookups_per_second",
                format!("more than {} unknown tokens per second", overall.events),
            ));
        }
        Ok(())
    }

    /// Starts GitLab's request for `token`; its answer is recorded by the task, whether or
    /// not anyone still waits for it.
    fn ask(&self, key: Key, token: String, asked_at: Instant) -> Flight<T> {
        let fetch = self.fetch.clone();
        let state = self.state.clone();
        let policy = self.policy;
        let task = tokio::spawn(async move {
            let answer = fetch(token).await;
            record(&state, policy, key, asked_at, answer)
        });
        async move {
            task.await.unwrap_or_else(|e| {
                Err(AuthError::Unavailable(format!("token lookup failed: {e}")))
            })
        }
        .boxed()
        .shared()
    }
}

fn lock<T>(state: &Mutex<State<T>>) -> std::sync::MutexGuard<'_, State<T>> {
    // A poisoned lock only means a panic mid-update of one entry; the map is still a
    // valid cache.
    state.lock().unwrap_or_else(|p| p.into_inner())
}

/// Stores GitLab's `answer` to a request sent at `asked_at` and returns what the cache
/// answers now.
fn record<T: Clone>(
    state: &Mutex<State<T>>,
    policy: CachePolicy,
    key: Key,
    asked_at: Instant,
    answer: Result<T, AuthError>,
) -> Result<T, AuthError> {
    let mut state = lock(state);
    state.flights.remove(&key);
    let now = Instant::now();
    if state.entries.len() >= MAX_ENTRIES {
        state.entries.retain(|_, e| {
            e.until > now
                || e.last_good
                    .as_ref()
                    .is_some_and(|(at, _)| now < *at + policy.stale_ttl)
        });
    }
    if let Some(p) = state.entries.get(&key)
        && p.asked_at > asked_at
    {
        // A newer request already answered: it wins.
        return p.answer.clone();
    }
    let last_good = state
        .entries
        .remove(&key)
        .and_then(|p| p.last_good)
        .filter(|(at, _)| now < *at + policy.stale_ttl);
    let entry = match answer {
        Ok(id) => Entry {
            answer: Ok(id.clone()),
            until: now + policy.ttl,
            asked_at,
            last_good: Some((now, id)),
        },
        // Revoked or refused: no stale acceptance.
        Err(e @ (AuthError::InvalidToken | AuthError::Forbidden(_))) => Entry {
            answer: Err(e),
            until: now + policy.error_ttl,
            asked_at,
            last_good: None,
        },
        Err(e) => {
            if last_good.is_some() {
                tracing::warn!(error = %e, "GitLab failed: accepting the token as GitLab last answered");
            }
            Entry {
                answer: last_good.as_ref().map(|(_, id)| id.clone()).ok_or(e),
                until: now + policy.error_ttl,
                asked_at,
                last_good,
            }
        }
    };
    let answer = entry.answer.clone();
    state.entries.insert(key, entry);
    answer
}

#[cfg(test)]
mod tests {
    use super::*;
    use kas_core::{AgentId, ProjectId};

    fn policy() -> CachePolicy {
        CachePolicy {
            ttl: Duration::from_secs(300),
            error_ttl: Duration::from_secs(60),
            stale_ttl: Duration::ZERO,
            lookups_per_second: 1,
            lookups_per_second_per_address: 1,
        }
    }

    fn state() -> Mutex<State<AgentIdentity>> {
        Mutex::new(State {
            entries: HashMap::new(),
            flights: HashMap::new(),
            overall: rate(1).bucket(Instant::now()),
            per_address: HashMap::new(),
        })
    }

    #[tokio::test]
    async fn a_late_answer_to_an_older_request_does_not_replace_a_newer_one() {
        let id = AgentIdentity {
            agent_id: AgentId(7),
            project_id: ProjectId(10),
            config: String::new(),
        };
        let s = state();
        let older = Instant::now();
        let newer = older + Duration::from_millis(10);
        let key = [1; 32];
        // The newer request's 200 arrives first, the older one's 502 after it.
        assert_eq!(
            record(&s, policy(), key, newer, Ok(id.clone())),
            Ok(id.clone())
        );
        let late = Err(AuthError::Unavailable("GitLab answered 502".into()));
        assert_eq!(record(&s, policy(), key, older, late), Ok(id.clone()));
        assert_eq!(lock(&s).entries[&key].answer, Ok(id));
        // An answer to a newer request does replace it.
        let revoked = record(
            &s,
            policy(),
            key,
            newer + Duration::from_millis(1),
            Err(AuthError::InvalidToken),
        );
        assert_eq!(revoked, Err(AuthError::InvalidToken));
    }
}
