//! Who may call: JWTs between GitLab and kas and between kas replicas, agent tokens (a
//! file, or GitLab's API behind a cache), callers' tokens for the Kubernetes API (who may
//! reach which agent, and as whom), and the token-file loader both share.

pub mod agent_auth;
pub mod jwt;
pub mod token_file;
pub mod user_tokens;
