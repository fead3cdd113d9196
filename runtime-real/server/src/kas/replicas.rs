//! Which replica holds each open connection id on this kas. A connection id names one
//! agentk replica, and calls pinned to it go down its tunnels; anyone holding the agent's
//! token could otherwise propose a live replica's id and receive some of its calls, and
//! its metadata would replace the replica's in listings (once: 11 of 20 pinned calls). So
//! the first stream of an id binds it to that replica's proof and metadata until the last
//! stream of the id ends: a second stream (the replica reconnecting before its old stream
//! ended) must carry both unchanged, and a tunnel must carry the proof.

use super::limits::locked;
use kas_core::fixed_hash::Map;
use kas_core::{AgentId, ConnectionId};
use kas_proto::registry::AgentMeta;
use std::sync::{Arc, Mutex};
use tonic::Status;

/// The longest proof accepted: agentk sends 16 bytes.
pub const MAX_PROOF: usize = 64;

/// What binds an open connection id.
struct Binding {
    proof: Vec<u8>,
    meta: AgentMeta,
    streams: usize,
}

type Key = (AgentId, ConnectionId);

/// The open connection ids of this kas, shared by the agent API's handlers.
#[derive(Clone, Default)]
pub struct Replicas {
    open: Arc<Mutex<Map<Key, Binding>>>,
}

/// One `GetConfiguration` stream's hold on its connection id, given back when dropped.
pub struct Claim {
    open: Arc<Mutex<Map<Key, Binding>>>,
    key: Key,
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut open = locked(&self.open);
        if let Some(b) = open.get_mut(&self.key) {
            b.streams -= 1;
            if b.streams == 0 {
                open.remove(&self.key);
            }
        }
    }
}

fn shadowing(agent: AgentId, connection: ConnectionId, what: &str) -> Status {
    tracing::warn!(%agent, %connection, "refused a stream shadowing an open replica: {what}");
    Status::failed_precondition(format!(
        "connection_id {connection} of agent {agent} is open on this kas for a replica with \
         another {what}: each replica proposes an id of its own"
    ))
}

fn check_len(proof: &[u8]) -> Result<(), Status> {
    if proof.len() > MAX_PROOF {
        return Err(Status::invalid_argument(format!(
            "replica_proof is {} bytes long; at most {MAX_PROOF} are accepted",
            proof.len()
        )));
    }
    Ok(())
}

impl Replicas {
    /// Binds `connection` of `agent` to `proof` and `meta`, or joins the streams already
    /// holding it with the same ones; refused when it is bound to another replica.
    pub fn claim(
        &self,
        agent: AgentId,
        connection: ConnectionId,
        proof: &[u8],
        meta: &AgentMeta,
    ) -> Result<Claim, Status> {
        check_len(proof)?;
        let key = (agent, connection);
        let mut open = locked(&self.open);
        let binding = open.entry(key).or_insert_with(|| Binding {
            proof: proof.to_vec(),
            meta: meta.clone(),
            streams: 0,
        });
        if binding.proof != proof {
            return Err(shadowing(agent, connection, "replica_proof"));
        }
        if binding.meta != *meta {
            return Err(shadowing(agent, connection, "agent_meta"));
        }
        binding.streams += 1;
        Ok(Claim {
            open: self.open.clone(),
            key,
        })
    }

    /// Refuses a tunnel for `connection` of `agent` whose proof is not the one the id is
    /// bound to. An id not open here passes: the engine refuses tunnels of closed ids.
    pub fn check_tunnel(
        &self,
        agent: AgentId,
        connection: ConnectionId,
        proof: &[u8],
    ) -> Result<(), Status> {
        check_len(proof)?;
        let open = locked(&self.open);
        match open.get(&(agent, connection)) {
            Some(b) if b.proof != proof => Err(shadowing(agent, connection, "replica_proof")),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(pod: &str) -> AgentMeta {
        AgentMeta {
            pod_name: pod.into(),
            ..AgentMeta::default()
        }
    }

    #[test]
    fn an_open_id_takes_only_its_own_replica_until_its_last_stream_ends() {
        let r = Replicas::default();
        let (a, c) = (AgentId(1), ConnectionId(7));
        let first = r.claim(a, c, b"p", &meta("real")).unwrap();
        let again = r.claim(a, c, b"p", &meta("real")).unwrap();
        for (proof, pod) in [(&b"q"[..], "real"), (b"", "real"), (b"p", "impostor")] {
            let e = r.claim(a, c, proof, &meta(pod)).err().unwrap();
            assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{}", e.message());
        }
        assert!(r.check_tunnel(a, c, b"p").is_ok());
        assert!(r.check_tunnel(a, c, b"q").is_err());
        assert!(
            r.check_tunnel(AgentId(2), c, b"q").is_ok(),
            "another agent's id"
        );
        drop(first);
        assert!(
            r.claim(a, c, b"q", &meta("other")).is_err(),
            "one stream still holds it"
        );
        drop(again);
        assert!(
            r.claim(a, c, b"q", &meta("other")).is_ok(),
            "free once every stream ended"
        );
        let long = [0; MAX_PROOF + 1];
        let e = r.check_tunnel(a, c, &long).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
    }
}
