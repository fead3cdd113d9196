//! The public listener (GitLab -> kas): registry queries answered from the store, and
//! calls routed to agents.

use super::call::{Call, Rest};
use super::correlation::CorrelationId;
use super::deadline::deadline;
use super::handle::{CancelOnDrop, EngineHandle};
use super::reply::Reply;
use crate::store::Store;
use bytes::Bytes;
use futures::stream::{BoxStream, TryStreamExt};
use kas_core::keys::{Keys, is_connection_field};
use kas_core::node::Origin;
use kas_core::{AgentId, ConnectionId, ProjectId, Time};
use kas_proto::frame::{Frame, RequestStart, frame::Kind};
use kas_proto::http::{HttpRequest, HttpResponse, KUBERNETES_API_METHOD, http_request};
use kas_proto::pods::{ListRequest, LogChunk, LogsRequest};
use kas_proto::public_api::kas_api_server::KasApi;
use kas_proto::public_api::{
    ConnectedAgentsByIdRequest, ConnectedAgentsByIdResponse, ConnectedAgentsForProjectRequest,
    ConnectedAgentsForProjectResponse, GetPodLogsRequest, GetPodsRequest, GetPodsResponse,
};
use kas_proto::registry::ConnectedAgentInfo;
use kas_transport::clock;
use kas_transport::frames;
use kas_transport::traces::{self, Context, Ending, FutureExt as _, KeyValue, SpanKind};
use prost::Message;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status, Streaming};

pub use kas_proto::pods::{LIST_METHOD as PODS_LIST, LOGS_METHOD as PODS_LOGS};

/// The public API service.
pub struct PublicService {
    /// The engine.
    pub engine: EngineHandle,
    /// The registry store.
    pub store: Store,
    /// Key names.
    pub keys: Keys,
    /// Deadline of calls without `grpc-timeout`.
    pub default_timeout: Duration,
    /// Longest deadline honoured.
    pub max_timeout: Duration,
}

impl PublicService {
    /// The connections recorded under `key` by kas that are alive (an agent's hash also
    /// holds its tunnel records, skipped here).
    async fn connections(&self, key: String) -> Result<Vec<ConnectedAgentInfo>, Status> {
        let (live, kas) = self
            .store
            .read_live_with_kas(&key, &self.keys.kas_instances(), clock::now())
            .await
            .map_err(|e| {
                tracing::warn!(error = %e, "registry read failed");
                Status::unavailable(format!("cannot read the agent registry: {e}"))
            })?;
        let records = live
            .into_iter()
            .filter(|(field, _)| is_connection_field(field))
            .filter_map(|(_, v)| ConnectedAgentInfo::decode(v.as_slice()).ok())
            .filter(|a| kas_id_of(a).is_some_and(|id| kas.contains(&id)));
        let mut listed = one_per_replica(records);
        for a in &mut listed {
            let meta = a.agent_meta.clone().unwrap_or_default();
            a.warnings = super::agent_version::warnings(&meta, env!("CARGO_PKG_VERSION"));
        }
        Ok(listed)
    }

    /// The deadline and message of a call to route, once its agent id is checked.
    fn routed<T>(&self, req: Request<T>, agent_id: fn(&T) -> i64) -> Result<(Time, T), Status> {
        let deadline = deadline(req.metadata(), self.default_timeout, self.max_timeout);
        let r = req.into_inner();
        if agent_id(&r) <= 0 {
            return Err(Status::invalid_argument("agent_id must be positive"));
        }
        Ok((deadline, r))
    }

    /// Routes a call to the agent; its answer arrives through the returned [`Reply`].
    fn call_agent(
        &self,
        id: &CorrelationId,
        agent: AgentId,
        connection: Option<ConnectionId>,
        method: &str,
        request: Vec<u8>,
        deadline: Time,
    ) -> Result<Reply, Status> {
        let requests = vec![frames::message(0, request), frames::close_send(0)];
        self.start(id, agent, connection, method, deadline, requests, None)
    }

    /// Starts a call with `requests` (a streaming one when it has the `rest`).
    #[allow(clippy::too_many_arguments)]
    fn start(
        &self,
        id: &CorrelationId,
        agent: AgentId,
        connection: Option<ConnectionId>,
        method: &str,
        deadline: Time,
        requests: Vec<Frame>,
        rest: Option<Rest>,
    ) -> Result<Reply, Status> {
        let request = self.engine.next_request_id();
        let (tx, rx) = mpsc::channel(16);
        let streaming = rest.is_some();
        // The call's span on this kas, ending with its reply: in GitLab's trace when its
        // call carried one (the handler made it current); its routing's span below it.
        let trace = traces::child(
            "kas",
            "kas.call",
            SpanKind::Server,
            &Context::current(),
            || {
                vec![
                    KeyValue::new("rpc.method", method.to_string()),
                    KeyValue::new("kas.agent_id", agent.0),
                    KeyValue::new("kas.correlation_id", id.as_str().to_string()),
                ]
            },
        );
        let call = Call {
            agent,
            connection,
            deadline,
            start: Arc::new(RequestStart {
                request_id: 0,
                agent_id: agent.0,
                connection_id: connection.map(|c| c.0),
                method: method.into(),
                metadata: id.metadata().into(),
                hops: 0,
                streaming,
                deadline_millis: None,
                // GitLab's calls are not counted in the sharing of an agent's tunnels.
                holder: None,
            }),
            requests: Arc::new(requests),
            rest,
            responses: tx,
            delivered_to: Default::default(),
            trace: traces::child("kas", "kas.route", SpanKind::Internal, &trace, || {
                let agent = KeyValue::new("kas.agent_id", agent.0);
                // A call pinned to one replica names it.
                let pinned = connection.map(|c| KeyValue::new("kas.agent_connection_id", c.0));
                std::iter::once(agent).chain(pinned).collect()
            }),
        };
        tracing::debug!(%agent, method, correlation_id = %id, trace_id = traces::trace_id(&call.trace).as_deref(), request = %request, "call routed");
        self.engine.submit(request, Origin::Public, call)?;
        let cancel = CancelOnDrop::new(self.engine.clone(), request);
        let reply = Reply::new(agent, rx, cancel, Some(deadline), streaming);
        Ok(match traces::on() {
            true => reply.traced(Ending(trace)),
            false => reply,
        })
    }

    /// Routes a unary call to the agent and returns its one response message.
    async fn call_unary(
        &self,
        id: &CorrelationId,
        agent: AgentId,
        connection: Option<ConnectionId>,
        method: &str,
        request: Vec<u8>,
        deadline: Time,
    ) -> Result<Bytes, Status> {
        let mut reply = self.call_agent(id, agent, connection, method, request, deadline)?;
        let body = reply
            .message()
            .await?
            .ok_or_else(|| Status::internal("agent answered without a response message"))?;
        match reply.message().await? {
            None => Ok(body),
            Some(_) => Err(Status::internal(
                "agent sent more than one response to a unary call",
            )),
        }
    }
}

/// The id of the kas that recorded a connection (its advertised private address).
fn kas_id_of(info: &ConnectedAgentInfo) -> Option<String> {
    let a = info.kas_address.as_ref()?;
    let ip: std::net::IpAddr = a.ip.parse().ok()?;
    let port = u16::try_from(a.port).ok()?;
    Some(std::net::SocketAddr::new(ip, port).to_string())
}

/// A pod log as GitLab receives it.
pub type LogChunks = BoxStream<'static, Result<LogChunk, Status>>;

fn log_chunk(bytes: Bytes) -> Result<LogChunk, Status> {
    LogChunk::decode(bytes)
        .map_err(|e| Status::internal(format!("agent sent a malformed log chunk: {e}")))
}

/// The response of a Kubernetes API exchange as GitLab receives it.
pub type HttpResponses = BoxStream<'static, Result<HttpResponse, Status>>;

/// The `id` metadata (`agent-id`, `connection-id`) as a positive number, if present.
fn id_metadata(metadata: &tonic::metadata::MetadataMap, key: &str) -> Result<Option<i64>, Status> {
    let Some(v) = metadata.get(key) else {
        return Ok(None);
    };
    v.to_str()
        .ok()
        .and_then(|v| v.parse::<i64>().ok())
        .filter(|n| *n > 0)
        .map(Some)
        .ok_or_else(|| Status::invalid_argument(format!("{key} must be a positive number")))
}

impl PublicService {
    async fn kubernetes_request(
        &self,
        id: &CorrelationId,
        req: Request<Streaming<HttpRequest>>,
    ) -> Result<Response<HttpResponses>, Status> {
        let deadline = deadline(req.metadata(), self.default_timeout, self.max_timeout);
        let agent = id_metadata(req.metadata(), "agent-id")?
            .ok_or_else(|| Status::invalid_argument("agent-id metadata is required"))?;
        let connection = id_metadata(req.metadata(), "connection-id")?.map(ConnectionId);
        let mut inbound = req.into_inner();
        let mut head = tokio::time::timeout(clock::until(deadline), inbound.message())
            .await
            .map_err(|_| Status::deadline_exceeded("no request head by the deadline"))??
            .filter(|m| matches!(m.kind, Some(http_request::Kind::Head(_))))
            .ok_or_else(|| {
                Status::invalid_argument("the first message must be the request head")
            })?;
        // The API server's logs can name the call too.
        if let Some(http_request::Kind::Head(h)) = &mut head.kind {
            h.headers.extend(id.metadata());
        }
        let (rest_tx, rest) = Rest::channel();
        let requests = vec![frames::message(0, head.encode_to_vec())];
        let reply = self.start(
            id,
            AgentId(agent),
            connection,
            KUBERNETES_API_METHOD,
            deadline,
            requests,
            Some(rest),
        )?;
        tokio::spawn(async move {
            // A request stream that broke ends unclosed: the caller is gone.
            while let Ok(next) = inbound.message().await {
                let frame = match next {
                    Some(m) => frames::message(0, m.encode_to_vec()),
                    None => frames::close_send(0),
                };
                let close = matches!(frame.kind, Some(Kind::CloseSend(_)));
                if rest_tx.send(frame).await.is_err() || close {
                    return;
                }
            }
        });
        let messages = reply.into_stream().await?.and_then(|bytes| async move {
            HttpResponse::decode(bytes)
                .map_err(|e| Status::internal(format!("agent sent a malformed HTTP message: {e}")))
        });
        Ok(Response::new(id.stream(messages)))
    }

    async fn pod_logs(
        &self,
        id: &CorrelationId,
        req: Request<GetPodLogsRequest>,
    ) -> Result<Response<LogChunks>, Status> {
        let (deadline, r) = self.routed(req, |r| r.agent_id)?;
        if r.namespace.is_empty() || r.pod.is_empty() {
            return Err(Status::invalid_argument(
                "a log request needs both namespace and pod",
            ));
        }
        let logs = LogsRequest {
            namespace: r.namespace,
            pod: r.pod,
            container: r.container,
            limit_bytes: r.limit_bytes,
        }
        .encode_to_vec();
        let reply = self.call_agent(
            id,
            AgentId(r.agent_id),
            r.connection_id.map(ConnectionId),
            PODS_LOGS,
            logs,
            deadline,
        )?;
        let chunks = reply
            .into_stream()
            .await?
            .and_then(|bytes| async move { log_chunk(bytes) });
        Ok(Response::new(id.stream(chunks)))
    }

    async fn pods(
        &self,
        id: &CorrelationId,
        req: Request<GetPodsRequest>,
    ) -> Result<Response<GetPodsResponse>, Status> {
        let (deadline, r) = self.routed(req, |r| r.agent_id)?;
        let list = ListRequest {
            namespace: r.namespace,
        }
        .encode_to_vec();
        let answer = self
            .call_unary(
                id,
                AgentId(r.agent_id),
                r.connection_id.map(ConnectionId),
                PODS_LIST,
                list,
                deadline,
            )
            .await?;
        GetPodsResponse::from_list(answer)
            .map(Response::new)
            .map_err(|e| Status::internal(format!("agent sent a malformed pod list: {e}")))
    }
}

/// Each call gets its correlation id (see [`correlation`](super::correlation)) in its
/// answer or error.
#[tonic::async_trait]
impl KasApi for PublicService {
    type GetPodLogsStream = LogChunks;
    type MakeKubernetesRequestStream = HttpResponses;

    async fn make_kubernetes_request(
        &self,
        req: Request<Streaming<HttpRequest>>,
    ) -> Result<Response<HttpResponses>, Status> {
        let id = CorrelationId::of(req.metadata());
        let trace = traces::from_headers(req.metadata().as_ref());
        id.answer(self.kubernetes_request(&id, req).with_context(trace).await)
    }

    async fn get_pod_logs(
        &self,
        req: Request<GetPodLogsRequest>,
    ) -> Result<Response<LogChunks>, Status> {
        let id = CorrelationId::of(req.metadata());
        let trace = traces::from_headers(req.metadata().as_ref());
        id.answer(self.pod_logs(&id, req).with_context(trace).await)
    }

    async fn get_pods(
        &self,
        req: Request<GetPodsRequest>,
    ) -> Result<Response<GetPodsResponse>, Status> {
        let id = CorrelationId::of(req.metadata());
        let trace = traces::from_headers(req.metadata().as_ref());
        id.answer(self.pods(&id, req).with_context(trace).await)
    }

    async fn connected_agents_for_project(
        &self,
        req: Request<ConnectedAgentsForProjectRequest>,
    ) -> Result<Response<ConnectedAgentsForProjectResponse>, Status> {
        let id = CorrelationId::of(req.metadata());
        let project = ProjectId(req.into_inner().project_id);
        let agents = self
            .connections(self.keys.connections_by_project(project))
            .await;
        id.answer(agents.map(|agents| Response::new(ConnectedAgentsForProjectResponse { agents })))
    }

    async fn connected_agents_by_id(
        &self,
        req: Request<ConnectedAgentsByIdRequest>,
    ) -> Result<Response<ConnectedAgentsByIdResponse>, Status> {
        let id = CorrelationId::of(req.metadata());
        let agent = AgentId(req.into_inner().agent_id);
        let agents = self.connections(self.keys.agent(agent)).await;
        id.answer(agents.map(|agents| Response::new(ConnectedAgentsByIdResponse { agents })))
    }
}

/// One entry per replica, with every kas it is connected to in `kas_addresses` (sorted),
/// from the records of each kas; the replica's other fields are from its earliest
/// connection. Sorted by agent, then replica.
fn one_per_replica(
    records: impl IntoIterator<Item = ConnectedAgentInfo>,
) -> Vec<ConnectedAgentInfo> {
    let mut replicas: std::collections::BTreeMap<(i64, i64), ConnectedAgentInfo> =
        std::collections::BTreeMap::new();
    let since = |a: &ConnectedAgentInfo| a.connected_at.map(|t| (t.seconds, t.nanos));
    for mut record in records {
        let address = record.kas_address.clone();
        record.kas_addresses.clear();
        let replica = replicas
            .entry((record.agent_id, record.connection_id))
            .or_insert_with(|| record.clone());
        if since(&record) < since(replica) {
            let addresses = std::mem::take(&mut replica.kas_addresses);
            *replica = ConnectedAgentInfo {
                kas_addresses: addresses,
                ..record
            };
        }
        replica.kas_addresses.extend(address);
    }
    let mut agents: Vec<ConnectedAgentInfo> = replicas.into_values().collect();
    for a in &mut agents {
        a.kas_addresses
            .sort_by(|x, y| (&x.ip, x.port).cmp(&(&y.ip, y.port)));
        a.kas_addresses.dedup();
    }
    agents
}

#[cfg(test)]
mod tests {
    use super::*;
    use kas_proto::prost_types::Timestamp;
    use kas_proto::registry::KasAddress;

    fn record(agent: i64, replica: i64, port: u32, at: i64, pod: &str) -> ConnectedAgentInfo {
        ConnectedAgentInfo {
            agent_id: agent,
            connection_id: replica,
            connected_at: Some(Timestamp {
                seconds: at,
                nanos: 0,
            }),
            kas_address: Some(KasAddress {
                ip: "127.0.0.1".into(),
                port,
            }),
            agent_meta: Some(kas_proto::registry::AgentMeta {
                pod_name: pod.into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_replica_on_several_kas_is_listed_once_with_each_kas() {
        let listed = one_per_replica([
            record(1, 10, 8155, 50, "late"),
            record(2, 20, 8155, 10, "other"),
            record(1, 10, 8055, 40, "early"),
            record(1, 11, 8255, 60, "second-replica"),
        ]);
        let summary: Vec<(i64, i64, String, Vec<u32>)> = listed
            .iter()
            .map(|a| {
                let pod = a.agent_meta.as_ref().unwrap().pod_name.clone();
                let ports = a.kas_addresses.iter().map(|k| k.port).collect();
                (a.agent_id, a.connection_id, pod, ports)
            })
            .collect();
        assert_eq!(
            summary,
            [
                (1, 10, "early".to_string(), vec![8055, 8155]),
                (1, 11, "second-replica".to_string(), vec![8255]),
                (2, 20, "other".to_string(), vec![8155]),
            ]
        );
        assert_eq!(listed[0].kas_address.as_ref().unwrap().port, 8055);
    }
}
