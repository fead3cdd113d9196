//! The public listener (GitLab -> kas): registry queries answered from the store, and
//! calls routed to agents.

use super::call::Call;
use super::deadline::deadline;
use super::engine::{CancelOnDrop, Command, EngineHandle};
use crate::clock;
use crate::frames;
use crate::store::Store;
use kas_core::keys::Keys;
use kas_core::{AgentId, ConnectionId, ProjectId, Time};
use kas_proto::frame::{Frame, RequestStart, frame::Kind};
use kas_proto::pods::{ListRequest, ListResponse};
use kas_proto::public_api::kas_api_server::KasApi;
use kas_proto::public_api::{
    ConnectedAgentsByIdRequest, ConnectedAgentsByIdResponse, ConnectedAgentsForProjectRequest,
    ConnectedAgentsForProjectResponse, GetPodsRequest, GetPodsResponse,
};
use kas_proto::registry::ConnectedAgentInfo;
use prost::Message;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

/// The Pods module's list method, as routed through tunnels.
pub const PODS_LIST: &str = "/kas.pods.Pods/List";

/// How long past its deadline a caller waits for an answer already under way.
const ANSWER_GRACE: Duration = Duration::from_secs(3);

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
    async fn connections(&self, key: String) -> Result<Vec<ConnectedAgentInfo>, Status> {
        let live = self
            .store
            .read_live(&key, clock::now())
            .await
            .map_err(|e| {
                tracing::warn!(error = %e, "registry read failed");
                Status::unavailable(format!("cannot read the agent registry: {e}"))
            })?;
        let mut agents: Vec<ConnectedAgentInfo> = live
            .into_iter()
            .filter_map(|(_, v)| ConnectedAgentInfo::decode(v.as_slice()).ok())
            .collect();
        agents.sort_by_key(|a| (a.agent_id, a.connection_id));
        Ok(agents)
    }

    /// Routes a unary call to the agent and returns its one response message.
    async fn call_agent(
        &self,
        agent: AgentId,
        connection: Option<ConnectionId>,
        method: &str,
        request: Vec<u8>,
        deadline: Time,
    ) -> Result<Vec<u8>, Status> {
        let id = self.engine.next_request_id();
        let (tx, mut rx) = mpsc::channel(16);
        let call = Call {
            agent,
            connection,
            deadline,
            start: RequestStart {
                request_id: 0,
                agent_id: agent.0,
                connection_id: connection.map(|c| c.0),
                method: method.into(),
                metadata: Default::default(),
                hops: 0,
            },
            requests: Arc::new(vec![frames::message(0, request), frames::close_send(0)]),
            responses: tx,
        };
        let mut cancel = CancelOnDrop::new(self.engine.clone(), id);
        self.engine.send(Command::Route(id, call));
        let give_up = tokio::time::Instant::now() + clock::until(deadline) + ANSWER_GRACE;
        let mut body = None;
        loop {
            let item = tokio::time::timeout(
                give_up.saturating_duration_since(tokio::time::Instant::now()),
                rx.recv(),
            )
            .await
            .map_err(|_| {
                Status::deadline_exceeded(format!("agent {agent} did not answer by the deadline"))
            })?;
            // Whatever ends the call from here on came from the engine, a tunnel or a
            // forward, which end it themselves.
            if matches!(
                &item,
                None | Some(Err(_))
                    | Some(Ok(Frame {
                        kind: Some(Kind::Trailer(_) | Kind::Error(_))
                    }))
            ) {
                cancel.disarm();
            }
            let frame = match item {
                None => return Err(Status::unavailable("the call ended without an answer")),
                Some(Err(status)) => return Err(status),
                Some(Ok(frame)) => frame,
            };
            match frame.kind {
                Some(Kind::Message(m)) if body.is_none() => body = Some(m.data),
                Some(Kind::Message(_)) => {
                    return Err(Status::internal(
                        "agent sent more than one response to a unary call",
                    ));
                }
                Some(Kind::Trailer(t)) if t.code == 0 => {
                    return body.ok_or_else(|| {
                        Status::internal("agent answered without a response message")
                    });
                }
                Some(Kind::Trailer(t)) => return Err(frames::status(t.code, &t.message)),
                Some(Kind::Error(e)) => return Err(frames::status(e.code, &e.message)),
                _ => {}
            }
        }
    }
}

#[tonic::async_trait]
impl KasApi for PublicService {
    async fn connected_agents_for_project(
        &self,
        req: Request<ConnectedAgentsForProjectRequest>,
    ) -> Result<Response<ConnectedAgentsForProjectResponse>, Status> {
        let project = ProjectId(req.into_inner().project_id);
        let agents = self
            .connections(self.keys.connections_by_project(project))
            .await?;
        Ok(Response::new(ConnectedAgentsForProjectResponse { agents }))
    }

    async fn connected_agents_by_id(
        &self,
        req: Request<ConnectedAgentsByIdRequest>,
    ) -> Result<Response<ConnectedAgentsByIdResponse>, Status> {
        let agent = AgentId(req.into_inner().agent_id);
        let agents = self
            .connections(self.keys.connections_by_agent(agent))
            .await?;
        Ok(Response::new(ConnectedAgentsByIdResponse { agents }))
    }

    async fn get_pods(
        &self,
        req: Request<GetPodsRequest>,
    ) -> Result<Response<GetPodsResponse>, Status> {
        let deadline = deadline(req.metadata(), self.default_timeout, self.max_timeout);
        let r = req.into_inner();
        if r.agent_id <= 0 {
            return Err(Status::invalid_argument("agent_id must be positive"));
        }
        #[cfg(madsim)]
        let r = {
            use crate::planted_bug::{Bug, planted};
            let mut r = r;
            if planted() == Bug::WrongAgent {
                r.agent_id = r.agent_id % 3 + 1;
            }
            r
        };
        let list = ListRequest {
            namespace: r.namespace,
        }
        .encode_to_vec();
        #[cfg(madsim)]
        let list_again = list.clone();
        let answer = self
            .call_agent(
                AgentId(r.agent_id),
                r.connection_id.map(ConnectionId),
                PODS_LIST,
                list,
                deadline,
            )
            .await?;
        #[cfg(madsim)]
        if crate::planted_bug::planted() == crate::planted_bug::Bug::DeliverTwice {
            let again = AgentId(r.agent_id);
            let _ = self
                .call_agent(again, None, PODS_LIST, list_again, deadline)
                .await;
        }
        let list = ListResponse::decode(answer.as_slice())
            .map_err(|e| Status::internal(format!("agent sent a malformed pod list: {e}")))?;
        Ok(Response::new(GetPodsResponse { pods: list.pods }))
    }
}
