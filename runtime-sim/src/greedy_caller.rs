//! A greedy Kubernetes API caller: through one kas, it opens watches on one agent until kas
//! gives it no more, and holds them, while another caller's requests to that agent through
//! the same kas, one every 250 ms, must each be answered (inv 10: no caller can hold all
//! of an agent's tunnels; kas leaves a quarter of those the agent may open to others), and
//! it must have been given exactly its share.
//! Run in the steady runs without failing fault points, where every call is judged.

use crate::callers::{CROWDED, CROWDED_POOL, GREEDY_TOKEN};
use crate::kube_caller;
use crate::workload::{self, Call};
use http_body_util::BodyExt;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// What one caller may hold of the tunnels the agent may open: all but a quarter. kas
/// holds back its next request (it may not take the last free tunnel either).
pub const SHARE: usize = CROWDED_POOL - CROWDED_POOL / 4;

/// More than the per-agent request limit (32): the tunnels' share stops it first.
const MOST: usize = 40;

/// How long another caller's request may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// A held watch: its task reads the events until aborted.
struct Held(JoinHandle<()>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What came of a greedy caller's run.
pub struct Crowding {
    /// The other caller's requests.
    pub probes: Vec<Call>,
    /// Watches held meanwhile.
    pub held: usize,
    /// Watches asked for (kas counts each it routed).
    pub asked: usize,
}

/// Crowds [`CROWDED`] through kas `kas` until `until`.
pub async fn run(kas: usize, until: Instant) -> Crowding {
    let mut held = Vec::new();
    let mut asked = 0;
    while held.len() < MOST {
        asked += 1;
        match watch(kas).await {
            Some(h) => held.push(h),
            None => break,
        }
    }
    let mut calls = Vec::new();
    while Instant::now() < until {
        let marker = format!("probe-{}", calls.len());
        calls.push(probe(kas, marker).await);
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Crowding {
        probes: calls,
        held: held.len(),
        asked,
    }
}

/// Another caller's request to [`CROWDED`] (see `kube_caller::exchange`), as a call the
/// checks judge.
async fn probe(kas: usize, marker: String) -> Call {
    let (agent, timeout) = (CROWDED, PROBE_TIMEOUT);
    let started = Instant::now();
    let mut seen = kube_caller::Seen::default();
    let exchange = kube_caller::exchange(kas, agent, &marker, timeout, &mut seen);
    let result = workload::bounded(timeout, exchange).await;
    Call {
        marker,
        kas,
        agent,
        replica: None,
        started,
        timeout,
        took: started.elapsed(),
        result: result.map_err(|s| (s.code(), s.message().to_string())),
        echo_mismatch: seen.mismatch,
        two_way: true,
        http: Some(workload::Http {
            status: seen.status,
            received: seen.received,
        }),
    }
}

/// Opens one endless watch; `None` once kas holds it back for a second or refuses it.
async fn watch(kas: usize) -> Option<Held> {
    let path = format!(
        "/api/v1/namespaces/default/pods/{}{}?watch=1&timeout=1s",
        crate::api_server::NO_CORRELATION_ID,
        madsim::rand::random::<u64>()
    );
    let token = format!("pat:{CROWDED}:{GREEDY_TOKEN}");
    let (resp, task) = kube_caller::endless_watch(kas, &path, &token, None).await?;
    if !resp.status().is_success() {
        task.abort();
        return None;
    }
    let read = tokio::spawn(async move {
        let _conn = Held(task);
        let mut body = resp.into_body();
        while let Some(Ok(_)) = body.frame().await {}
    });
    Some(Held(read))
}
