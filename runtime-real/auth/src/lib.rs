//! Who may call: JWTs between GitLab and kas and between kas replicas, agent tokens (a
//! file, or GitLab's API behind a cache), and the token-file loader that user tokens share.

pub mod agent_auth;
pub mod jwt;
pub mod token_file;
