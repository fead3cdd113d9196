//! The ground truth: every call an agent replica served, as the agent saw it. Callers put
//! a unique marker in the call (the pod list's or the log's namespace, the two-way
//! exchange's path), so each delivery is matched to the call that caused it.

use kas_agent::{Modules, PODS_LIST, PODS_LOGS};
use kas_proto::pods::{ListRequest, ListResponse, LogChunk, LogsRequest, Pod};
use madsim::rand::{Rng, thread_rng};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;

/// The name of the one pod replica `replica` of `agent` serves: who answered a call.
pub fn pod_name(agent: i64, replica: usize) -> String {
    format!("agent{agent}-replica{replica}")
}

/// One call served by an agent replica.
#[derive(Clone, Debug)]
pub struct Delivery {
    /// The caller's marker.
    pub marker: String,
    /// The agent that served it.
    pub agent: i64,
    /// Its replica.
    pub replica: usize,
    /// When the agent received it.
    pub at: Instant,
}

/// A call an agent received and never answered, and when kas let go of it by closing
/// the tunnel.
#[derive(Clone, Debug)]
pub struct Hold {
    /// The caller's marker.
    pub marker: String,
    /// When the tunnel closed; `None` while it is open.
    pub until: Option<Instant>,
}

/// Where an agent replica could be reached from a moment on: the kas (by index) whose
/// connections it had up and counted, as its agent saw them.
#[derive(Clone, Debug)]
pub struct Homes {
    /// The agent.
    pub agent: i64,
    /// Its replica.
    pub replica: usize,
    /// The kas serving it; empty while it has none (and from its node's restart on).
    pub kas: Vec<usize>,
    /// From when.
    pub at: Instant,
}

/// A link an agent replica gave up because kas went silent on it.
#[derive(Clone, Copy, Debug)]
pub struct Silence {
    /// The agent.
    pub agent: i64,
    /// Its replica.
    pub replica: usize,
    /// The kas (by index).
    pub kas: usize,
    /// When.
    pub at: Instant,
}

#[derive(Debug, Default)]
struct Log {
    deliveries: Vec<Delivery>,
    holds: Vec<Hold>,
    homes: Vec<Homes>,
    silences: Vec<Silence>,
    /// What agents found wrong in kas's answers (the greedy agent's counts).
    violations: Vec<String>,
}

/// The log of deliveries, shared by every agent node (it survives their restarts).
#[derive(Clone, Debug, Default)]
pub struct Truth(Arc<Mutex<Log>>);

impl Truth {
    /// The Pods module of replica `replica` of `agent`: records each call; answers a list
    /// with one pod named `pod` after 0-300 ms (a Kubernetes API read takes time, and busy
    /// tunnels are where pinning and waiting go wrong), and a log with 1-3 chunks, each
    /// the pod's name, 0-100 ms apart.
    pub fn module(&self, agent: i64, replica: usize, pod: &str) -> Modules {
        let (log, pod) = (self.clone(), pod.to_string());
        let mut modules = Modules::default();
        let (logs_log, logs_pod) = (log.clone(), pod.clone());
        modules.server_streaming(PODS_LOGS, move |req: LogsRequest| {
            logs_log.record(Delivery {
                marker: req.namespace,
                agent,
                replica,
                at: Instant::now(),
            });
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            let chunk = LogChunk {
                data: logs_pod.clone().into_bytes(),
            };
            let chunks = thread_rng().gen_range(1..=3);
            tokio::spawn(async move {
                for _ in 0..chunks {
                    let gap = Duration::from_millis(thread_rng().gen_range(0..100));
                    tokio::time::sleep(gap).await;
                    if tx.send(Ok(chunk.clone())).await.is_err() {
                        return;
                    }
                }
            });
            async move { Ok(ReceiverStream::new(rx)) }
        });
        modules.unary(PODS_LIST, move |req: ListRequest| {
            log.record(Delivery {
                marker: req.namespace,
                agent,
                replica,
                at: Instant::now(),
            });
            let pod = Pod {
                namespace: "default".into(),
                name: pod.clone(),
                phase: "Running".into(),
                node_name: String::new(),
            };
            let took = Duration::from_millis(thread_rng().gen_range(0..300));
            async move {
                tokio::time::sleep(took).await;
                Ok(ListResponse { pods: vec![pod] })
            }
        });
        modules
    }

    /// Records a call an agent received.
    pub fn record(&self, delivery: Delivery) {
        self.lock().deliveries.push(delivery);
    }

    /// Records that an agent will not answer the call `marker`.
    pub fn hold(&self, marker: String) {
        self.lock().holds.push(Hold {
            marker,
            until: None,
        });
    }

    /// Records that kas closed the tunnel of the unanswered call `marker`.
    pub fn release(&self, marker: &str) {
        let now = Instant::now();
        let mut log = self.lock();
        if let Some(h) = log.holds.iter_mut().find(|h| h.marker == marker) {
            h.until = Some(now);
        }
    }

    /// Records where replica `replica` of `agent` is served from now on.
    pub fn homed(&self, agent: i64, replica: usize, kas: Vec<usize>) {
        let at = Instant::now();
        self.lock().homes.push(Homes {
            agent,
            replica,
            kas,
            at,
        });
    }

    /// Records that replica `replica` of `agent` gave its link to kas `kas` up as silent.
    pub fn silent(&self, agent: i64, replica: usize, kas: usize) {
        let at = Instant::now();
        self.lock().silences.push(Silence {
            agent,
            replica,
            kas,
            at,
        });
    }

    /// Every link given up as silent, in order.
    pub fn silences(&self) -> Vec<Silence> {
        self.lock().silences.clone()
    }

    /// Records what an agent found wrong in kas's answers.
    pub fn violation(&self, what: String) {
        self.lock().violations.push(what);
    }

    /// What agents found wrong, in order.
    pub fn violations(&self) -> Vec<String> {
        self.lock().violations.clone()
    }

    /// Every change of where a replica is served, in order.
    pub fn homes(&self) -> Vec<Homes> {
        self.lock().homes.clone()
    }

    /// The kas serving replica `replica` of `agent` now, as it last reported.
    pub fn serving(&self, agent: i64, replica: usize) -> Vec<usize> {
        let truth = self.lock();
        let latest = truth
            .homes
            .iter()
            .rev()
            .find(|h| h.agent == agent && h.replica == replica);
        latest.map(|h| h.kas.clone()).unwrap_or_default()
    }

    /// Every delivery so far, in order.
    pub fn deliveries(&self) -> Vec<Delivery> {
        self.lock().deliveries.clone()
    }

    /// Every hold so far, in order.
    pub fn holds(&self) -> Vec<Hold> {
        self.lock().holds.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Log> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}
