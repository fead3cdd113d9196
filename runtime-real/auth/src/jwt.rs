//! JWTs between GitLab and kas, and between kas replicas: HS256 with a shared secret.
//!
//! | who -> whom | secret | `iss` | `aud` |
//! |---|---|---|---|
//! | GitLab -> kas (public API) | GitLab's | `gitlab` | `gitlab-kas` |
//! | kas -> kas (private API) | kas-only | `gitlab-kas` | `gitlab-kas` |
//! | kas -> GitLab (internal API) | GitLab's | `gitlab-kas` | `gitlab` |
//!
//! Tokens travel as `authorization: Bearer <jwt>` gRPC metadata (and in the
//! `Gitlab-Kas-Api-Request` HTTP header towards GitLab).

use base64::Engine;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Issuer and audience names.
pub const GITLAB: &str = "gitlab";
/// Issuer and audience names.
pub const GITLAB_KAS: &str = "gitlab-kas";
/// Shortest secret accepted, in bytes (GitLab generates 32).
const MIN_SECRET_LEN: usize = 32;
/// Lifetime of tokens kas mints.
const TOKEN_LIFETIME: Duration = Duration::from_secs(60);
/// Longest lifetime (`exp` - `iat`, and `exp` - now) a listener accepts unless configured:
/// GitLab's and kas's tokens live a minute; a leaked ten-year token must not work.
pub const DEFAULT_MAX_TOKEN_LIFETIME: Duration = Duration::from_secs(3600);
/// Clock skew tolerated on `exp`, `nbf` and `iat`, in seconds.
const LEEWAY: u64 = 5;
/// How long kas uses a token it minted, in seconds: a forward then costs no signing, and
/// the serving kas finds the token among those it verified. A token used last has most of
/// [`TOKEN_LIFETIME`] left.
const TOKEN_REUSE: u64 = 10;
/// How many verified tokens a listener remembers (it forgets them all when full): GitLab
/// and the peer kas each use a token for many calls.
const VERIFIED_TOKENS: usize = 256;

/// A shared HS256 secret, as GitLab stores it: base64 of at least 32 random bytes.
#[derive(Clone)]
pub struct Secret(Arc<Vec<u8>>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// Why a secret file is unusable.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The content is not base64.
    #[error(
        "{path} is not base64 ({source}); generate one with `head -c 32 /dev/urandom | base64`"
    )]
    Base64 {
        /// The file.
        path: String,
        /// The decoding error.
        source: base64::DecodeError,
    },
    /// Fewer than 32 bytes.
    #[error("{path} holds {len} bytes after base64 decoding; at least {MIN_SECRET_LEN} are needed")]
    TooShort {
        /// The file.
        path: String,
        /// Its decoded length.
        len: usize,
    },
}

impl Secret {
    /// Reads a base64 secret file (surrounding whitespace is ignored).
    pub fn load(path: &Path) -> Result<Secret, SecretError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| SecretError::Read {
            path: p.clone(),
            source,
        })?;
        Self::from_base64(text.trim()).map_err(|e| match e {
            SecretError::Base64 { source, .. } => SecretError::Base64 { path: p, source },
            SecretError::TooShort { len, .. } => SecretError::TooShort { path: p, len },
            other => other,
        })
    }

    /// Decodes a base64 secret.
    pub fn from_base64(text: &str) -> Result<Secret, SecretError> {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(text)
            .map_err(|source| SecretError::Base64 {
                path: "secret".into(),
                source,
            })?;
        if bytes.len() < MIN_SECRET_LEN {
            return Err(SecretError::TooShort {
                path: "secret".into(),
                len: bytes.len(),
            });
        }
        Ok(Secret(Arc::new(bytes)))
    }

    /// The secret's base64 text, for writing a secret file.
    pub fn to_base64(&self) -> String {
        base64::engine::general_purpose::STANDARD.encode(self.0.as_slice())
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Claims {
    iss: String,
    aud: String,
    exp: u64,
    #[serde(default)]
    iat: u64,
    #[serde(default)]
    nbf: u64,
}

/// What a token says about time: all that is checked again when a verified token is seen
/// again.
#[derive(Clone, Copy, Debug)]
struct Times {
    exp: u64,
    iat: u64,
    nbf: u64,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

/// The `alg` of a token's header, read before any verification so that a refusal can say
/// which algorithm was offered.
fn algorithm(token: &str) -> Option<String> {
    #[derive(Deserialize)]
    struct H {
        alg: String,
    }
    let header = token.split('.').next()?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(header.trim_end_matches('='))
        .ok()?;
    serde_json::from_slice::<H>(&bytes).ok().map(|h| h.alg)
}

/// Checks the tokens one listener accepts. Cloned for every call (tonic's interceptor):
/// the key and the rules (sets of issuers, audiences and claims) are shared, not copied.
#[derive(Clone)]
pub struct Verifier {
    key: Arc<DecodingKey>,
    validation: Arc<Validation>,
    max_lifetime: Duration,
    /// Tokens whose signature and claims were verified, with their times (shared by the
    /// clones): seen again, a token is checked against the clock only.
    verified: Arc<Mutex<BTreeMap<String, Times>>>,
}

impl Verifier {
    /// Accepts HS256 tokens signed with `secret` from `issuer` to `audience`; `exp` is
    /// required and checked, `nbf` and `iat` when present must not be in the future, and
    /// the token may live [`DEFAULT_MAX_TOKEN_LIFETIME`] at most.
    pub fn new(secret: &Secret, issuer: &str, audience: &str) -> Self {
        let mut validation = Validation::new(Algorithm::HS256);
        validation.set_issuer(&[issuer]);
        validation.set_audience(&[audience]);
        validation.set_required_spec_claims(&["exp", "iss", "aud"]);
        validation.leeway = LEEWAY;
        Verifier {
            key: Arc::new(DecodingKey::from_secret(&secret.0)),
            validation: Arc::new(validation),
            max_lifetime: DEFAULT_MAX_TOKEN_LIFETIME,
            verified: Arc::default(),
        }
    }

    /// Refuses tokens valid for longer than `max` (from `iat`, and from now).
    pub fn with_max_lifetime(mut self, max: Duration) -> Self {
        self.max_lifetime = max;
        self
    }

    /// Checks the value of an `authorization` header (`Bearer <jwt>`); the error says why
    /// the token is refused.
    pub fn check_bearer(&self, header: Option<&str>) -> Result<(), String> {
        let header = header.ok_or("no authorization metadata")?;
        let token = header
            .strip_prefix("Bearer ")
            .ok_or("authorization metadata is not \"Bearer <token>\"")?;
        self.check(token)
    }

    /// Checks a bare token.
    pub fn check(&self, token: &str) -> Result<(), String> {
        self.check_at(token, unix_now())
    }

    fn check_at(&self, token: &str, now: u64) -> Result<(), String> {
        let known = self.lock().get(token).copied();
        if let Some(times) = known {
            return self.check_times(&times, now);
        }
        match algorithm(token) {
            None => return Err("malformed token: no readable header".into()),
            Some(alg) if alg != "HS256" => {
                return Err(format!("token algorithm {alg:?} is not HS256"));
            }
            Some(_) => {}
        }
        let c = jsonwebtoken::decode::<Claims>(token, &self.key, &self.validation)
            .map_err(|e| describe(&e))?
            .claims;
        let times = Times {
            exp: c.exp,
            iat: c.iat,
            nbf: c.nbf,
        };
        self.check_times(&times, now)?;
        let mut verified = self.lock();
        if verified.len() >= VERIFIED_TOKENS {
            verified.clear();
        }
        verified.insert(token.to_string(), times);
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Times>> {
        self.verified.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `exp` not past, `nbf` and `iat` not in the future, and a lifetime within the
    /// maximum. (The first check of a token has `jsonwebtoken` check `exp` too.)
    fn check_times(&self, c: &Times, now: u64) -> Result<(), String> {
        if c.exp.saturating_add(LEEWAY) < now {
            return Err("token expired".into());
        }
        let max = self.max_lifetime.as_secs();
        if c.nbf > now.saturating_add(LEEWAY) {
            return Err(format!(
                "token is not valid yet (nbf is {}s in the future)",
                c.nbf - now
            ));
        }
        if c.iat > now.saturating_add(LEEWAY) {
            return Err(format!(
                "token is issued in the future (iat is {}s ahead of this kas's clock)",
                c.iat - now
            ));
        }
        let from_now = c.exp.saturating_sub(now);
        let lifetime = if c.iat > 0 {
            c.exp.saturating_sub(c.iat).max(from_now)
        } else {
            from_now
        };
        if lifetime > max.saturating_add(LEEWAY) {
            return Err(format!(
                "token lifetime {lifetime}s exceeds the {max}s this listener accepts"
            ));
        }
        Ok(())
    }
}

fn describe(e: &jsonwebtoken::errors::Error) -> String {
    use jsonwebtoken::errors::ErrorKind as K;
    match e.kind() {
        K::ExpiredSignature => "token expired".into(),
        K::InvalidSignature => "token signature does not match the secret".into(),
        K::InvalidIssuer => "token issuer is wrong".into(),
        K::InvalidAudience => "token audience is wrong".into(),
        K::InvalidAlgorithm | K::InvalidAlgorithmName => "token algorithm is not HS256".into(),
        K::MissingRequiredClaim(c) => format!("token lacks the {c} claim"),
        K::ImmatureSignature => "token is not valid yet".into(),
        _ => format!("malformed token: {e}"),
    }
}

/// Mints tokens for one (issuer, audience) pair.
#[derive(Clone)]
pub struct Signer {
    key: EncodingKey,
    issuer: String,
    audience: String,
    /// The token in use and when it was minted (shared by the clones).
    minted: Arc<Mutex<Option<(u64, String)>>>,
}

impl Signer {
    /// Signs with `secret` as `issuer` for `audience`.
    pub fn new(secret: &Secret, issuer: &str, audience: &str) -> Self {
        Signer {
            key: EncodingKey::from_secret(&secret.0),
            issuer: issuer.into(),
            audience: audience.into(),
            minted: Arc::default(),
        }
    }

    /// A token valid for a minute, minted at most [`TOKEN_REUSE`] seconds ago.
    pub fn token(&self) -> String {
        self.token_at(unix_now())
    }

    fn token_at(&self, now: u64) -> String {
        let mut minted = self.minted.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, token)) = &*minted
            && *at <= now
            && now - *at < TOKEN_REUSE
        {
            return token.clone();
        }
        let claims = Claims {
            iss: self.issuer.clone(),
            aud: self.audience.clone(),
            iat: now,
            nbf: now.saturating_sub(5),
            exp: now + TOKEN_LIFETIME.as_secs(),
        };
        let token = jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &self.key)
            .expect("HS256 signing with a byte key cannot fail");
        *minted = Some((now, token.clone()));
        token
    }

    /// `Bearer <fresh token>`.
    pub fn bearer(&self) -> String {
        format!("Bearer {}", self.token())
    }
}

#[cfg(test)]
mod tests;
