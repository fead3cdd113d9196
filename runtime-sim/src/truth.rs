//! The ground truth: every call an agent replica served, as the agent saw it. Callers put
//! a unique marker in the call (the pod list's namespace), so each delivery is matched to
//! the call that caused it.

use kas_proto::pods::{ListRequest, ListResponse, Pod};
use kas_runtime::agent::{Modules, PODS_LIST};
use std::sync::{Arc, Mutex};
use tokio::time::Instant;

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

/// The log of deliveries, shared by every agent node (it survives their restarts).
#[derive(Clone, Debug, Default)]
pub struct Truth(Arc<Mutex<Vec<Delivery>>>);

impl Truth {
    /// The Pods module of replica `replica` of `agent`: records each call, answers with
    /// one pod named `pod`.
    pub fn module(&self, agent: i64, replica: usize, pod: &str) -> Modules {
        let (log, pod) = (self.clone(), pod.to_string());
        let mut modules = Modules::default();
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
            async move { Ok(ListResponse { pods: vec![pod] }) }
        });
        modules
    }

    /// Records a call an agent received.
    pub fn record(&self, delivery: Delivery) {
        self.lock().push(delivery);
    }

    /// Every delivery so far, in order.
    pub fn deliveries(&self) -> Vec<Delivery> {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Delivery>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}
