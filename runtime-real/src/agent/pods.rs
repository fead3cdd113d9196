//! The Pods module: `List` answers from the cluster's Kubernetes API, or from a fixture
//! file on machines without a cluster.

use super::modules::Modules;
use kas_proto::pods::{ListRequest, ListResponse, Pod};
use serde::Deserialize;
use std::path::Path;
use std::sync::Arc;
use tonic::Status;

/// The Pods module's list method.
pub const PODS_LIST: &str = "/kas.pods.Pods/List";

/// Where the Pods module reads pods from.
#[derive(Clone)]
pub enum PodSource {
    /// A fixed list.
    Fixture(Arc<Vec<Pod>>),
    /// The Kubernetes API.
    #[cfg(not(madsim))]
    Kube(kube::Client),
}

/// One pod of a fixture file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FixturePod {
    namespace: String,
    name: String,
    #[serde(default)]
    phase: String,
    #[serde(default)]
    node_name: String,
}

/// Pods fetched per page from the Kubernetes API.
#[cfg(not(madsim))]
const PAGE: u32 = 500;

impl PodSource {
    /// Reads a YAML list of pods (`namespace`, `name`, optional `phase`, `node_name`).
    pub fn fixture_file(path: &Path) -> Result<PodSource, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let pods: Vec<FixturePod> =
            serde_yaml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(PodSource::Fixture(Arc::new(
            pods.into_iter()
                .map(|p| Pod {
                    namespace: p.namespace,
                    name: p.name,
                    phase: p.phase,
                    node_name: p.node_name,
                })
                .collect(),
        )))
    }

    /// The Kubernetes API of the cluster this runs in (in-cluster service account), or
    /// else of the current kubeconfig context.
    #[cfg(not(madsim))]
    pub async fn kube_default() -> Result<PodSource, String> {
        kube::Client::try_default()
            .await
            .map(PodSource::Kube)
            .map_err(|e| format!("no Kubernetes API configuration (in-cluster or kubeconfig): {e}"))
    }

    /// Pods of `namespace`, or of every namespace when it is empty.
    pub async fn list(&self, namespace: &str) -> Result<Vec<Pod>, Status> {
        match self {
            PodSource::Fixture(pods) => Ok(pods
                .iter()
                .filter(|p| namespace.is_empty() || p.namespace == namespace)
                .cloned()
                .collect()),
            #[cfg(not(madsim))]
            PodSource::Kube(client) => list_kube(client, namespace).await,
        }
    }
}

/// Lists pods page by page, so that a large cluster is not one huge response.
#[cfg(not(madsim))]
async fn list_kube(client: &kube::Client, namespace: &str) -> Result<Vec<Pod>, Status> {
    use k8s_openapi::api::core::v1::Pod as KubePod;
    use kube::api::{Api, ListParams};
    let api: Api<KubePod> = if namespace.is_empty() {
        Api::all(client.clone())
    } else {
        Api::namespaced(client.clone(), namespace)
    };
    let mut params = ListParams::default().limit(PAGE);
    let mut pods = Vec::new();
    loop {
        let page = api.list(&params).await.map_err(kube_status)?;
        pods.extend(page.items.into_iter().map(|p| Pod {
            namespace: p.metadata.namespace.unwrap_or_default(),
            name: p.metadata.name.unwrap_or_default(),
            phase: p.status.and_then(|s| s.phase).unwrap_or_default(),
            node_name: p.spec.and_then(|s| s.node_name).unwrap_or_default(),
        }));
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => return Ok(pods),
        }
    }
}

/// The Kubernetes API's refusal, as the caller should read it.
#[cfg(not(madsim))]
fn kube_status(e: kube::Error) -> Status {
    match e {
        kube::Error::Api(s) if s.code == 401 || s.code == 403 => {
            Status::permission_denied(format!(
                "the Kubernetes API refused to list pods ({} {}): does the agent's service account have RBAC to list pods?",
                s.code, s.message
            ))
        }
        kube::Error::Api(s) if s.code == 404 => {
            Status::not_found(format!("the Kubernetes API answered 404: {}", s.message))
        }
        kube::Error::Api(s) => Status::unavailable(format!(
            "the Kubernetes API failed to list pods ({} {})",
            s.code, s.message
        )),
        other => Status::unavailable(format!("cannot reach the Kubernetes API: {other}")),
    }
}

impl Modules {
    /// Registers the Pods module reading from `source`.
    pub fn with_pods(mut self, source: PodSource) -> Self {
        self.unary(PODS_LIST, move |req: ListRequest| {
            let source = source.clone();
            async move {
                Ok(ListResponse {
                    pods: source.list(&req.namespace).await?,
                })
            }
        });
        self
    }
}

#[cfg(all(test, not(madsim)))]
mod tests;
