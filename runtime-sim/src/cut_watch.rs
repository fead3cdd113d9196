//! A Kubernetes API watch under way over a link between kas and an agent replica that
//! goes half-open (`scenario`'s `half_open`): once the link's bound has passed, kas must
//! have ended the watch, or the watch must be flowing (served elsewhere); a watch that is
//! neither hangs its caller until the caller gives up (inv 2).

use crate::api_server::correlation_id;
use crate::callers::USER_TOKEN;
use crate::workload::{Call, Http};
use http_body_util::BodyExt;
use madsim::runtime::NodeHandle;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// How long a judged watch may go without an event while it flows: the API server's
/// longest gap between events of an endless watch (3 s), and a second.
pub const FLOWING: Duration = Duration::from_secs(4);

/// What came of the watch's body.
#[derive(Default)]
struct Progress {
    /// When its last event came.
    last_event: Option<Instant>,
    /// When it ended, and how.
    ended: Option<(Instant, Result<(), String>)>,
}

/// A watch through kas `kas`, judged when the replica the link leads to serves it.
pub struct CutWatch {
    marker: String,
    kas: usize,
    agent: i64,
    started: Instant,
    /// Its response's status and pod, once its head came.
    head: Option<(u16, Option<String>)>,
    /// Served by the replica the link leads to.
    judged: bool,
    progress: Arc<Mutex<Progress>>,
    reader: JoinHandle<()>,
}

/// Opens an endless watch of `agent` (events 1-3 s apart) through kas `kas` from `caller`,
/// judged if its head comes from replica `replica` within 3 s.
pub async fn open(
    caller: &NodeHandle,
    kas: usize,
    agent: i64,
    replica: usize,
    marker: String,
) -> CutWatch {
    let started = Instant::now();
    let progress = Arc::new(Mutex::new(Progress::default()));
    let (head_tx, head) = tokio::sync::oneshot::channel();
    let read = progress.clone();
    let id = correlation_id(&marker);
    let path = format!("/api/v1/namespaces/default/pods/{marker}?watch=1&timeout=3000ms");
    let reader = caller.spawn(async move {
        let token = format!("pat:{agent}:{USER_TOKEN}");
        let watch = crate::kube_caller::endless_watch(kas, &path, &token, Some(&id)).await;
        // The connection's task ends with the watch's body.
        let Some((resp, _connection)) = watch else {
            return;
        };
        let pod = resp.headers().get("x-pod").and_then(|v| v.to_str().ok());
        let _ = head_tx.send((resp.status().as_u16(), pod.map(str::to_owned)));
        let mut body = resp.into_body();
        let ended = loop {
            match body.frame().await {
                Some(Ok(_)) => lock(&read).last_event = Some(Instant::now()),
                Some(Err(e)) => break Err(e.to_string()),
                None => break Ok(()),
            }
        };
        lock(&read).ended = Some((Instant::now(), ended));
    });
    let head = tokio::time::timeout(Duration::from_secs(3), head)
        .await
        .ok()
        .and_then(Result::ok);
    let pod = crate::truth::pod_name(agent, replica);
    let judged = matches!(&head, Some((200, Some(p))) if *p == pod);
    CutWatch {
        marker,
        kas,
        agent,
        started,
        head,
        judged,
        progress,
        reader,
    }
}

fn lock(p: &Mutex<Progress>) -> std::sync::MutexGuard<'_, Progress> {
    p.lock().unwrap_or_else(|p| p.into_inner())
}

impl CutWatch {
    /// Served by the replica the link leads to: judged.
    pub fn judged(&self) -> bool {
        self.judged
    }

    /// Judges the watch, if it is, once the link it was served over went half-open at
    /// `cut` and `bound` passed (waiting until [`FLOWING`] after that), and closes it: its
    /// call, and the violation if it neither ended nor flowed.
    pub async fn judge(self, cut: Instant, bound: Duration) -> (Call, Option<String>) {
        if self.judged {
            tokio::time::sleep_until(cut + bound + FLOWING).await;
        }
        self.reader.abort();
        let p = lock(&self.progress);
        let flowing = p.last_event.is_some_and(|t| t > cut + bound);
        let violation = (self.judged && p.ended.is_none() && !flowing).then(|| {
            format!(
                "inv 2: {}, a watch of agent {} through kas{} served by {}, was neither ended nor flowing {:?} after the link went half-open (bound {bound:?}; its last event {:?} before the cut)",
                self.marker,
                self.agent,
                self.kas,
                self.head.as_ref().and_then(|h| h.1.as_deref()).unwrap_or_default(),
                Instant::now() - cut,
                p.last_event.map(|t| cut.saturating_duration_since(t)),
            )
        });
        let result = match (&self.head, &p.ended) {
            (None, _) => Err((tonic::Code::Unknown, "no response head within 3 s".into())),
            (Some((_, _)), Some((_, Err(e)))) => Err((tonic::Code::Unknown, e.clone())),
            (Some((200, Some(pod))), _) => Ok(pod.clone()),
            (Some((status, _)), _) => Err((tonic::Code::Unknown, format!("HTTP {status}"))),
        };
        let call = Call {
            marker: self.marker.clone(),
            kas: self.kas,
            agent: self.agent,
            replica: None,
            started: self.started,
            timeout: Instant::now() - self.started,
            took: p.ended.as_ref().map_or(Instant::now(), |e| e.0) - self.started,
            result,
            echo_mismatch: None,
            two_way: true,
            http: Some(Http {
                status: self.head.as_ref().map(|h| h.0),
                received: 0,
            }),
        };
        (call, violation)
    }
}
