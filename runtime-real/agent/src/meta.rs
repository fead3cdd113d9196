//! What agentk tells kas about itself when it connects (`AgentMeta`): its version and
//! architecture, the pod it runs in, and the version of its cluster's API server, which
//! kas shows in listings and warns about.

use crate::kubernetes_api::Upstream;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use kas_proto::registry::{AgentMeta, KUBERNETES_VERSION_FIELD_MAX, KubernetesVersion};
use kas_transport::http_relay::BoxError;
use std::time::Duration;

/// How long agentk waits for the API server's `/version` before connecting without it.
pub const VERSION_TIMEOUT: Duration = Duration::from_secs(5);

/// The most of `/version`'s body read: the real one is a few hundred bytes.
const VERSION_BODY_LIMIT: usize = 16 * 1024;

/// This agentk's metadata, without the cluster's version (see [`cluster_version`]).
pub fn own(pod_namespace: &str, pod_name: &str) -> AgentMeta {
    AgentMeta {
        version: env!("CARGO_PKG_VERSION").into(),
        commit: String::new(),
        pod_namespace: pod_namespace.into(),
        pod_name: pod_name.into(),
        kubernetes_version: None,
        architecture: architecture().into(),
        // Set per connection from the tunnel pool's maximum.
        max_tunnels: 0,
    }
}

/// Go's name for this build's architecture (`GOARCH`), as GitLab's agentk images are
/// tagged and kas lists them.
pub fn architecture() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    }
}

/// The API server's version, from its `/version` (within [`VERSION_TIMEOUT`]).
pub async fn cluster_version(upstream: &Upstream) -> Result<KubernetesVersion, String> {
    let read = async {
        let body = Empty::<Bytes>::new().map_err(BoxError::from).boxed_unsync();
        let req = http::Request::get("/version")
            .body(body)
            .map_err(|e| e.to_string())?;
        let resp = upstream.send(req).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), VERSION_BODY_LIMIT)
            .collect()
            .await
            .map_err(|e| format!("reading its body: {e}"))?
            .to_bytes();
        if !status.is_success() {
            return Err(format!("HTTP {status}"));
        }
        parse(&body)
    };
    tokio::time::timeout(VERSION_TIMEOUT, read)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {VERSION_TIMEOUT:?}")))
        .map_err(|e| format!("the API server's /version: {e}"))
}

/// The fields of a `/version` body that kas lists.
fn parse(body: &[u8]) -> Result<KubernetesVersion, String> {
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Info {
        #[serde(default)]
        major: String,
        #[serde(default)]
        minor: String,
        #[serde(default)]
        git_version: String,
        #[serde(default)]
        platform: String,
    }
    let info: Info = serde_json::from_slice(body).map_err(|e| format!("not a version: {e}"))?;
    Ok(KubernetesVersion {
        major: cut(info.major),
        minor: cut(info.minor),
        git_version: cut(info.git_version),
        platform: cut(info.platform),
    })
}

/// `s` cut to what kas accepts, at a character boundary.
fn cut(mut s: String) -> String {
    let mut end = s.len().min(KUBERNETES_VERSION_FIELD_MAX);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.truncate(end);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_fields_kas_lists_from_an_api_server_s_version() {
        let body = br#"{"major":"1","minor":"32","gitVersion":"v1.32.0","gitCommit":"x","platform":"linux/amd64"}"#;
        let v = parse(body).unwrap();
        assert_eq!(
            (v.major.as_str(), v.minor.as_str(), v.git_version.as_str()),
            ("1", "32", "v1.32.0")
        );
        assert_eq!(v.platform, "linux/amd64");
        assert!(parse(b"<html>").unwrap_err().contains("not a version"));
        let long = format!(r#"{{"gitVersion":"v1.{}"}}"#, "é".repeat(40));
        let cut = parse(long.as_bytes()).unwrap().git_version;
        assert_eq!(
            cut.len(),
            KUBERNETES_VERSION_FIELD_MAX - 1,
            "at a character boundary"
        );
    }

    #[test]
    fn names_the_architecture_as_go_does() {
        assert!(
            ["amd64", "arm64"].contains(&architecture()),
            "{}",
            architecture()
        );
    }
}
