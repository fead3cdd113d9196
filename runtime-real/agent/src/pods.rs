//! The Pods module: `List` and `Logs` answer from the cluster's Kubernetes API, or from a
//! fixture file on machines without a cluster.

use super::modules::Modules;
use futures::stream::{self, BoxStream, StreamExt};
use kas_proto::pods::{ListRequest, ListResponse, LogChunk, LogsRequest, Pod};
use kas_transport::traces::{
    self, Context, KeyValue, SpanKind, Status as SpanStatus, TraceContextExt,
};
use serde::Deserialize;
use std::path::Path;
use std::sync::Arc;
use tonic::Status;

pub use kas_proto::pods::{LIST_METHOD as PODS_LIST, LOGS_METHOD as PODS_LOGS};

/// Largest log piece sent in one message.
pub const LOG_CHUNK: usize = 64 * 1024;

/// How much of a log `Logs` sends when the request sets no limit.
pub const DEFAULT_LOG_LIMIT: i64 = 64 << 20;

/// A pod's log as it is read, in pieces of at most [`LOG_CHUNK`] bytes.
pub type LogStream = BoxStream<'static, Result<LogChunk, Status>>;

/// A pod of a fixture, with its log.
#[derive(Clone, Debug)]
pub struct FixturePodLog {
    /// The pod.
    pub pod: Pod,
    /// What `Logs` returns for it.
    pub log: Arc<[u8]>,
}

/// Where the Pods module reads pods from.
#[derive(Clone)]
pub enum PodSource {
    /// A fixed list.
    Fixture(Arc<Vec<FixturePodLog>>),
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
    /// The pod's log text.
    #[serde(default)]
    log: String,
}

/// Reads a YAML list of pods (`namespace`, `name`, optional `phase`, `node_name`, `log`).
pub fn read_fixture(path: &Path) -> Result<Arc<Vec<FixturePodLog>>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let pods: Vec<FixturePod> =
        serde_yaml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(Arc::new(
        pods.into_iter()
            .map(|p| FixturePodLog {
                pod: Pod {
                    namespace: p.namespace,
                    name: p.name,
                    phase: p.phase,
                    node_name: p.node_name,
                },
                log: p.log.into_bytes().into(),
            })
            .collect(),
    ))
}

/// Pods fetched per page from the Kubernetes API.
#[cfg(not(madsim))]
const PAGE: u32 = 500;

impl PodSource {
    /// Reads a YAML list of pods (see [`read_fixture`]).
    pub fn fixture_file(path: &Path) -> Result<PodSource, String> {
        read_fixture(path).map(PodSource::Fixture)
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
                .map(|p| &p.pod)
                .filter(|p| namespace.is_empty() || p.namespace == namespace)
                .cloned()
                .collect()),
            #[cfg(not(madsim))]
            PodSource::Kube(client) => list_kube(client, namespace).await,
        }
    }

    /// The current log of the pod `req` names, up to its limit.
    pub async fn logs(&self, req: LogsRequest) -> Result<LogStream, Status> {
        if req.namespace.is_empty() || req.pod.is_empty() {
            return Err(Status::invalid_argument(
                "a log request needs both namespace and pod",
            ));
        }
        let limit = match req.limit_bytes {
            0 => DEFAULT_LOG_LIMIT,
            n if n > 0 => n,
            n => {
                return Err(Status::invalid_argument(format!(
                    "limit_bytes must not be negative, got {n}"
                )));
            }
        };
        let limit = usize::try_from(limit).unwrap_or(usize::MAX);
        match self {
            PodSource::Fixture(pods) => {
                let pod = pods
                    .iter()
                    .find(|p| p.pod.namespace == req.namespace && p.pod.name == req.pod)
                    .ok_or_else(|| {
                        Status::not_found(format!("no pod {}/{}", req.namespace, req.pod))
                    })?;
                Ok(chunks(pod.log.clone(), limit))
            }
            #[cfg(not(madsim))]
            PodSource::Kube(client) => logs_kube(client, req, limit).await,
        }
    }
}

/// `log`, up to `limit` bytes, in pieces of [`LOG_CHUNK`].
pub fn chunks(log: Arc<[u8]>, limit: usize) -> LogStream {
    let end = log.len().min(limit);
    stream::iter((0..end).step_by(LOG_CHUNK).map(move |at| {
        Ok(LogChunk {
            data: log[at..end.min(at + LOG_CHUNK)].to_vec(),
        })
    }))
    .boxed()
}

/// Streams a pod's log from the Kubernetes API as it arrives.
#[cfg(not(madsim))]
async fn logs_kube(
    client: &kube::Client,
    req: LogsRequest,
    limit: usize,
) -> Result<LogStream, Status> {
    use futures::AsyncReadExt;
    use k8s_openapi::api::core::v1::Pod as KubePod;
    use kube::api::{Api, LogParams};
    let api: Api<KubePod> = Api::namespaced(client.clone(), &req.namespace);
    let params = LogParams {
        container: (!req.container.is_empty()).then_some(req.container),
        limit_bytes: i64::try_from(limit).ok(),
        ..LogParams::default()
    };
    let reader = Box::pin(
        api.log_stream(&req.pod, &params)
            .await
            .map_err(|e| kube_status(e, "read the log of"))?,
    );
    Ok(
        stream::try_unfold((reader, limit), |(mut reader, left)| async move {
            if left == 0 {
                return Ok(None);
            }
            let mut data = vec![0; LOG_CHUNK.min(left)];
            let n = reader.read(&mut data).await.map_err(|e| {
                Status::unavailable(format!("reading the log from the Kubernetes API: {e}"))
            })?;
            if n == 0 {
                return Ok(None);
            }
            data.truncate(n);
            Ok(Some((LogChunk { data }, (reader, left - n))))
        })
        .boxed(),
    )
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
        let page = api
            .list(&params)
            .await
            .map_err(|e| kube_status(e, "list"))?;
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

/// The Kubernetes API's refusal to `action` pods, as the caller should read it.
#[cfg(not(madsim))]
fn kube_status(e: kube::Error, action: &str) -> Status {
    match e {
        kube::Error::Api(s) if s.code == 401 || s.code == 403 => {
            Status::permission_denied(format!(
                "the Kubernetes API refused to {action} pods ({} {}): does the agent's service account have RBAC to {action} pods?",
                s.code, s.message
            ))
        }
        kube::Error::Api(s) if s.code == 404 => {
            Status::not_found(format!("the Kubernetes API answered 404: {}", s.message))
        }
        kube::Error::Api(s) => Status::unavailable(format!(
            "the Kubernetes API failed to {action} pods ({} {})",
            s.code, s.message
        )),
        other => Status::unavailable(format!("cannot reach the Kubernetes API: {other}")),
    }
}

impl Modules {
    /// Registers the Pods module reading from `source`.
    pub fn with_pods(mut self, source: PodSource) -> Self {
        let lister = source.clone();
        self.unary(PODS_LIST, move |req: ListRequest| {
            let source = lister.clone();
            async move {
                let at = || vec![KeyValue::new("k8s.namespace.name", req.namespace.clone())];
                let pods = traced("pods.list", at, source.list(&req.namespace)).await?;
                Ok(ListResponse { pods })
            }
        });
        self.server_streaming(PODS_LOGS, move |req: LogsRequest| {
            let source = source.clone();
            async move {
                let at = || {
                    vec![
                        KeyValue::new("k8s.namespace.name", req.namespace.clone()),
                        KeyValue::new("k8s.pod.name", req.pod.clone()),
                    ]
                };
                traced("pods.logs", at, source.logs(req.clone())).await
            }
        });
        self
    }
}

/// `read` from the pod source in a span `name` of the call's trace (the current context):
/// the time a list, or the opening of a log, takes in the Kubernetes API.
async fn traced<T>(
    name: &'static str,
    attributes: impl FnOnce() -> Vec<KeyValue>,
    read: impl Future<Output = Result<T, Status>>,
) -> Result<T, Status> {
    let cx = traces::child(
        "agentk",
        name,
        SpanKind::Client,
        &Context::current(),
        attributes,
    );
    let _ending = traces::Ending(cx.clone());
    let result = read.await;
    if let Err(status) = &result {
        cx.span()
            .set_status(SpanStatus::error(status.message().to_string()));
    }
    result
}

#[cfg(all(test, not(madsim)))]
mod tests;
