//! GitLab's side of kas's public API: a client that signs every call with GitLab's secret.

use kas_auth::jwt::{self, Secret, Signer};
use kas_proto::http::{HttpRequest, HttpResponse};
use kas_proto::pods::{LogChunk, Pod};
use kas_proto::public_api::kas_api_client::KasApiClient;
use kas_proto::public_api::{
    ConnectedAgentsByIdRequest, ConnectedAgentsForProjectRequest, GetPodLogsRequest, GetPodsRequest,
};
use kas_proto::registry::ConnectedAgentInfo;
use kas_transport::tls::{self, KasUrl};
use std::path::Path;
use std::time::Duration;
use tonic::transport::Channel;
use tonic::{Status, Streaming};

/// A public API client of one kas.
#[derive(Clone)]
pub struct ApiClient {
    client: KasApiClient<Channel>,
    signer: Signer,
    timeout: Duration,
    /// Sent as `x-gitlab-correlation-id` on every call, when set: kas then logs the calls
    /// under it and ends its errors with it (else kas makes one per call).
    correlation_id: Option<String>,
}

impl ApiClient {
    /// Connects to kas's public API at `addr` (`host:port`, `grpc://` or `grpcs://`, see
    /// [`KasUrl`]). Each call carries `timeout` as its deadline, which is also the connect
    /// timeout.
    pub async fn connect(addr: &str, secret: &Secret, timeout: Duration) -> Result<Self, String> {
        Self::connect_with_ca(addr, None, secret, timeout).await
    }

    /// As [`ApiClient::connect`]; over TLS, kas's certificate must chain to the PEM CA
    /// certificates in `ca_file` (the system's roots without one).
    pub async fn connect_with_ca(
        addr: &str,
        ca_file: Option<&Path>,
        secret: &Secret,
        timeout: Duration,
    ) -> Result<Self, String> {
        let url = KasUrl::parse(addr)?;
        let channel = tls::connect(&url, ca_file, None, timeout).await?;
        Ok(ApiClient {
            // As large as kas lets an agent answer by default.
            client: KasApiClient::new(channel)
                .max_decoding_message_size(kas_transport::DEFAULT_MAX_MESSAGE_SIZE),
            signer: Signer::new(secret, jwt::GITLAB, jwt::GITLAB_KAS),
            timeout,
            correlation_id: None,
        })
    }

    /// The same client (same connection) with calls carrying `timeout` instead.
    pub fn with_timeout(&self, timeout: Duration) -> ApiClient {
        ApiClient {
            timeout,
            ..self.clone()
        }
    }

    /// The same client with calls carrying the correlation id `id`.
    pub fn with_correlation_id(&self, id: impl Into<String>) -> ApiClient {
        ApiClient {
            correlation_id: Some(id.into()),
            ..self.clone()
        }
    }

    /// `call`, given up at the call's deadline as a Go gRPC client does: a kas that does
    /// not answer (cut off, stopped) must not hold the caller past its timeout.
    /// (tonic's own timer on `grpc-timeout` says `CANCELLED`: that is the same deadline.)
    async fn within<T>(&self, call: impl Future<Output = Result<T, Status>>) -> Result<T, Status> {
        let expired = || {
            Status::deadline_exceeded(format!(
                "kas did not answer within the timeout ({:?})",
                self.timeout
            ))
        };
        match tokio::time::timeout(self.timeout, call).await {
            Err(_) => Err(expired()),
            Ok(Err(s))
                if s.code() == tonic::Code::Cancelled && s.message() == "Timeout expired" =>
            {
                Err(expired())
            }
            Ok(Err(s)) if not_taken(&s) => {
                let mut not_delivered = Status::unavailable(format!(
                    "kas closed the connection before taking the call (not delivered): {}",
                    s.message()
                ));
                // The transport's error stays readable behind it.
                not_delivered.set_source(std::sync::Arc::new(s));
                Err(not_delivered)
            }
            Ok(answer) => answer,
        }
    }

    fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        r.set_timeout(self.timeout);
        if let Ok(v) = self.signer.bearer().parse() {
            r.metadata_mut().insert("authorization", v);
        }
        if let Some(v) = self.correlation_id.as_ref().and_then(|id| id.parse().ok()) {
            r.metadata_mut().insert(kas_proto::frame::CORRELATION_ID, v);
        }
        r
    }

    /// The connected replicas of the agents of `project`.
    pub async fn agents_for_project(
        &self,
        project: i64,
    ) -> Result<Vec<ConnectedAgentInfo>, Status> {
        let req = self.request(ConnectedAgentsForProjectRequest {
            project_id: project,
        });
        let mut client = self.client.clone();
        let resp = self
            .within(client.connected_agents_for_project(req))
            .await?;
        Ok(resp.into_inner().agents)
    }

    /// The connected replicas of `agent`.
    pub async fn agents_by_id(&self, agent: i64) -> Result<Vec<ConnectedAgentInfo>, Status> {
        let req = self.request(ConnectedAgentsByIdRequest { agent_id: agent });
        let mut client = self.client.clone();
        let resp = self.within(client.connected_agents_by_id(req)).await?;
        Ok(resp.into_inner().agents)
    }

    /// The pods of `namespace` (all when empty) that `agent` (its replica `connection`,
    /// when given) lists, routed through kas.
    pub async fn pods(
        &self,
        agent: i64,
        connection: Option<i64>,
        namespace: &str,
    ) -> Result<Vec<Pod>, Status> {
        let req = self.request(GetPodsRequest {
            agent_id: agent,
            connection_id: connection,
            namespace: namespace.into(),
        });
        let mut client = self.client.clone();
        let answer = self.within(client.get_pods(req)).await?.into_inner();
        answer
            .pods()
            .map_err(|e| Status::internal(format!("kas sent a malformed pod list: {e}")))
    }

    /// One HTTP exchange with `agent`'s Kubernetes API (its replica `connection`, when
    /// given): `requests` is the head, then the body or upgraded bytes, ending when it ends.
    pub async fn kubernetes_request(
        &self,
        agent: i64,
        connection: Option<i64>,
        requests: impl tokio_stream::Stream<Item = HttpRequest> + Send + 'static,
    ) -> Result<Streaming<HttpResponse>, Status> {
        let mut req = self.request(requests);
        let ids =
            std::iter::once(("agent-id", agent)).chain(connection.map(|c| ("connection-id", c)));
        for (key, id) in ids {
            if let Ok(v) = id.to_string().parse() {
                req.metadata_mut().insert(key, v);
            }
        }
        let mut client = self.client.clone();
        Ok(self
            .within(client.make_kubernetes_request(req))
            .await?
            .into_inner())
    }

    /// The log of `namespace/pod` (its `container`, when not empty; at most about
    /// `limit_bytes`, the agent's cap when 0), streamed from `agent` through kas.
    pub async fn pod_logs(
        &self,
        agent: i64,
        connection: Option<i64>,
        namespace: &str,
        pod: &str,
        container: &str,
        limit_bytes: i64,
    ) -> Result<Streaming<LogChunk>, Status> {
        let req = self.request(GetPodLogsRequest {
            agent_id: agent,
            connection_id: connection,
            namespace: namespace.into(),
            pod: pod.into(),
            container: container.into(),
            limit_bytes,
        });
        let mut client = self.client.clone();
        Ok(self.within(client.get_pod_logs(req)).await?.into_inner())
    }
}

/// Whether `status` says the call never reached kas: the connection closed before the
/// request was sent (hyper: canceled), or kas's GOAWAY left the stream unprocessed (HTTP/2
/// promises such a stream was not acted on). A stopping kas's connections end so; grpc-go
/// retries such calls transparently, and here they become Unavailable, which a caller may
/// offer to another kas without risking a second delivery.
#[cfg(not(madsim))]
fn not_taken(status: &Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(e) = source {
        if e.downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_canceled)
        {
            return true;
        }
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            return (h2.is_go_away() && h2.is_remote())
                || h2.reason() == Some(h2::Reason::REFUSED_STREAM);
        }
        source = e.source();
    }
    false
}

/// The simulated transport has no connections to close under a call.
#[cfg(madsim)]
fn not_taken(_: &Status) -> bool {
    false
}
