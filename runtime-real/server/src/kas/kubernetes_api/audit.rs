//! The audit log of the Kubernetes API listener (`agent.kubernetes_api.audit`): one JSON
//! line per request this kas received, written when the request is over (its response
//! ended, its caller went away, or kas refused it), by a thread of its own so that no
//! request waits on the disk.
//!
//! A record is never lost silently. A write that fails (a full disk, a file that cannot
//! be opened) is retried every second, nothing of it left in the file; while the log
//! cannot be written, or lags more than [`QUEUE_LIMIT`] behind, kas answers new
//! Kubernetes API requests 503 naming the key (counted in `kas_audit_refusals`), and takes
//! them again by itself once the writes go through. Records of requests already running
//! wait in memory meanwhile: their number is bounded by the listener's own limits.

mod sink;
mod verb;

use super::super::call::DeliveredTo;
use super::super::correlation::CorrelationId;
use super::super::metrics::Metrics;
use crate::config::Audit;
use kas_auth::user_tokens::{Caller, Credential, TokenKind};
use kas_core::KasId;
use kas_proto::http::Impersonation;
use serde::Serialize;
use sink::Sink;
use std::collections::VecDeque;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

/// The configuration key, named in refusals.
pub const KEY: &str = "agent.kubernetes_api.audit";

/// Bytes of records waiting to be written past which the log counts as failing (it cannot
/// keep up), so that a slow disk cannot grow kas's memory without bound.
const QUEUE_LIMIT: usize = 8 << 20;

/// How long a failed write waits before it is tried again.
const RETRY: Duration = Duration::from_secs(1);

/// Records written to the file in one write, at most.
const BATCH: usize = 256 << 10;

/// The longest path a record keeps; a longer one is cut, and says so.
const MAX_PATH: usize = 4096;

/// How long a stopping kas waits for its queued records to be written.
const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// The audit log; clones share it.
#[derive(Clone)]
pub struct AuditLog {
    shared: Arc<Shared>,
    /// Resolves when the writer thread ended.
    writer_ended: Arc<Mutex<Option<tokio::sync::oneshot::Receiver<()>>>>,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    metrics: Metrics,
}

#[derive(Default)]
struct State {
    /// Encoded lines, each ending with a newline.
    queue: VecDeque<String>,
    /// Their bytes.
    queued: usize,
    /// Why the log cannot take records, while it cannot.
    failing: Option<String>,
    /// Set when kas stops: the writer ends once the queue is empty.
    closed: bool,
    /// Set when the writer ended.
    gone: bool,
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    // Each update is a few statements that cannot panic: the state stays whole.
    state.lock().unwrap_or_else(|p| p.into_inner())
}

impl AuditLog {
    /// Opens the log `config` names (so that a path kas cannot write fails the start,
    /// naming the key) and starts its writer.
    pub fn open(config: &Audit, metrics: Metrics) -> Result<AuditLog, String> {
        let sink = Sink::open(config).map_err(|e| format!("{KEY}.path: {e}"))?;
        let shared = Arc::new(Shared {
            state: Mutex::default(),
            wake: Condvar::new(),
            metrics,
        });
        let (ended, writer_ended) = tokio::sync::oneshot::channel();
        {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("kas-audit".into())
                .spawn(move || {
                    shared.write_all(sink);
                    drop(ended);
                })
                .map_err(|e| format!("{KEY}: cannot start its writer: {e}"))?;
        }
        Ok(AuditLog {
            shared,
            writer_ended: Arc::new(Mutex::new(Some(writer_ended))),
        })
    }

    /// Why new requests are refused, while the log cannot take their records.
    pub fn failing(&self) -> Option<String> {
        lock(&self.shared.state).failing.clone()
    }

    /// Queues one record.
    fn record(&self, line: String) {
        let mut s = lock(&self.shared.state);
        if s.gone {
            drop(s);
            self.shared.metrics.audit_lost.inc();
            tracing::error!(record = %line.trim_end(), "kas stopped its audit log: a record not written");
            return;
        }
        s.queued += line.len();
        s.queue.push_back(line);
        if s.queued > QUEUE_LIMIT && s.failing.is_none() {
            let why = format!("{} MiB of records wait to be written", s.queued >> 20);
            self.shared.fail(&mut s, why);
        }
        drop(s);
        self.shared.wake.notify_one();
    }

    /// Writes what is queued and ends the writer, waiting for it at most [`CLOSE_WAIT`].
    pub async fn close(self) {
        lock(&self.shared.state).closed = true;
        self.shared.wake.notify_one();
        let ended = self
            .writer_ended
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let Some(ended) = ended else { return };
        if tokio::time::timeout(CLOSE_WAIT, ended).await.is_err() {
            let left = lock(&self.shared.state).queue.len();
            tracing::error!(
                records = left,
                "the audit log could not be written before kas stopped: records lost"
            );
        }
    }
}

impl Shared {
    /// The writer: batches of queued lines to the sink until closed and empty.
    fn write_all(&self, mut sink: Sink) {
        loop {
            let batch = {
                let mut s = lock(&self.state);
                while s.queue.is_empty() && !s.closed {
                    s = self.wake.wait(s).unwrap_or_else(|p| p.into_inner());
                }
                if s.queue.is_empty() {
                    s.gone = true;
                    return;
                }
                let mut batch = String::new();
                for line in &s.queue {
                    if !batch.is_empty() && batch.len() + line.len() > BATCH {
                        break;
                    }
                    batch.push_str(line);
                }
                batch
            };
            let written = sink.write(batch.as_bytes());
            let mut s = lock(&self.state);
            // The lines written, whole, leave the queue; a failed one stays for the retry.
            let done = match &written {
                Ok(()) => batch.len(),
                Err((done, _)) => *done,
            };
            let mut left = done;
            while let Some(line) = s.queue.front().filter(|l| l.len() <= left) {
                left -= line.len();
                s.queued -= line.len();
                s.queue.pop_front();
            }
            match written {
                Ok(()) => {
                    if s.failing.is_some() && s.queued <= QUEUE_LIMIT / 2 {
                        s.failing = None;
                        self.metrics.audit_unwritable.set(0);
                        tracing::info!(
                            "the audit log is written again: Kubernetes API requests are taken again"
                        );
                    }
                }
                Err((_, e)) => {
                    self.metrics.audit_write_errors.inc();
                    if s.closed {
                        // Stopping: the records still queued are reported by `close`.
                        s.gone = true;
                        return;
                    }
                    self.fail(&mut s, format!("writing {}: {e}", sink.name()));
                    drop(s);
                    std::thread::sleep(RETRY);
                }
            }
        }
    }

    /// Marks the log failing for `why`, logged once per failure.
    fn fail(&self, s: &mut State, why: String) {
        if s.failing.is_none() {
            self.metrics.audit_unwritable.set(1);
            tracing::error!(error = %why, "the audit log cannot be written: Kubernetes API requests are refused until it can (agent.kubernetes_api.audit)");
        }
        s.failing = Some(why);
    }
}

/// The audit record of one request, filled in as the request goes and written when
/// dropped, whichever way the request ended; nothing when the log is off.
#[derive(Default)]
pub struct Entry(Option<Box<Record>>);

struct Record {
    log: AuditLog,
    started: tokio::time::Instant,
    line: Line,
    request_bytes: Arc<AtomicU64>,
    delivered_to: DeliveredTo,
}

/// One line of the log.
#[derive(Serialize)]
struct Line {
    /// When kas received the request (RFC 3339, UTC).
    time: String,
    correlation_id: String,
    /// The request's trace (its caller's `traceparent`, or kas's own when traces are
    /// exported); `null` without either.
    trace_id: Option<String>,
    caller_address: Option<IpAddr>,
    caller: Option<CallerLine>,
    agent_id: Option<i64>,
    /// The agent replica whose tunnel took the request.
    agent_connection_id: Option<i64>,
    routing_kas: String,
    serving_kas: Option<String>,
    method: String,
    path: String,
    verb: &'static str,
    /// Whom the agent acted as in the cluster; `null`: as itself.
    impersonated: Option<Impersonated>,
    /// The response's HTTP status; `null` when the caller went away before it.
    status: Option<u16>,
    /// The request's body or upgraded bytes relayed towards the agent, and the response's
    /// towards the caller, framing of each piece included (a few bytes).
    request_bytes: u64,
    response_bytes: u64,
    duration_ms: u64,
    /// Why kas refused the request or could not get it answered.
    refusal: Option<String>,
    /// Why a response that had begun broke off.
    error: Option<String>,
}

#[derive(Serialize)]
struct CallerLine {
    /// `pat` (a user's token) or `ci` (a CI job's).
    kind: &'static str,
    username: String,
    job_id: Option<i64>,
    project_id: Option<i64>,
}

#[derive(Serialize)]
struct Impersonated {
    user: String,
    groups: Vec<String>,
}

impl AuditLog {
    /// The record of a request kas `kas` received now.
    pub fn entry(
        &self,
        kas: &KasId,
        id: &CorrelationId,
        peer: Option<IpAddr>,
        method: &http::Method,
        uri: &http::Uri,
    ) -> Entry {
        let full = uri.path_and_query().map_or("/", |p| p.as_str());
        let mut entry = Entry(Some(Box::new(Record {
            log: self.clone(),
            started: tokio::time::Instant::now(),
            line: Line {
                time: humantime::format_rfc3339_millis(SystemTime::now()).to_string(),
                correlation_id: id.as_str().to_string(),
                trace_id: None,
                caller_address: peer,
                caller: None,
                agent_id: None,
                agent_connection_id: None,
                routing_kas: kas.0.clone(),
                serving_kas: None,
                method: method.as_str().to_string(),
                path: String::new(),
                verb: "",
                impersonated: None,
                status: None,
                request_bytes: 0,
                response_bytes: 0,
                duration_ms: 0,
                refusal: None,
                error: None,
            },
            request_bytes: Arc::default(),
            delivered_to: DeliveredTo::default(),
        })));
        entry.path(full);
        entry
    }
}

impl Entry {
    fn line(&mut self) -> Option<&mut Line> {
        self.0.as_mut().map(|r| &mut r.line)
    }

    /// The request's path as the API server sees it (its verb read from it).
    pub fn path(&mut self, path: &str) {
        if let Some(line) = self.line() {
            line.verb = verb::of(&line.method, path);
            line.path = cut(path);
        }
    }

    /// The request's trace id.
    pub fn traced(&mut self, trace_id: Option<String>) {
        if let Some(line) = self.line() {
            line.trace_id = trace_id;
        }
    }

    /// Whose token it is (the caller's name comes with [`Entry::granted`]).
    pub fn presented(&mut self, credential: &Credential) {
        if let Some(line) = self.line() {
            line.agent_id = Some(credential.agent.0);
            line.caller = Some(CallerLine {
                kind: match credential.kind {
                    TokenKind::Pat => "pat",
                    TokenKind::Ci => "ci",
                },
                username: String::new(),
                job_id: None,
                project_id: None,
            });
        }
    }

    /// Who the token's owner is and whom the agent acts as.
    pub fn granted(&mut self, caller: &Caller, impersonation: Option<&Impersonation>) {
        if let Some(line) = self.line() {
            if let Some(c) = &mut line.caller {
                c.username = caller.username.clone();
                c.job_id = caller.job_id;
                c.project_id = caller.project_id;
            }
            line.impersonated = impersonation.map(|i| Impersonated {
                user: i.user.clone(),
                groups: i.groups.clone(),
            });
        }
    }

    /// Where the call will say it was delivered (kept only when the log is on).
    pub fn delivered_to(&mut self) -> DeliveredTo {
        match &mut self.0 {
            Some(r) => {
                r.delivered_to = DeliveredTo::watched();
                r.delivered_to.clone()
            }
            None => DeliveredTo::default(),
        }
    }

    /// What counts the bytes relayed towards the agent, when the log is on.
    pub fn request_counter(&self) -> Option<Arc<AtomicU64>> {
        self.0.as_ref().map(|r| r.request_bytes.clone())
    }

    /// The response's status.
    pub fn answered(&mut self, status: u16) {
        if let Some(line) = self.line() {
            line.status = Some(status);
        }
    }

    /// Counts `n` bytes relayed towards the caller.
    pub fn responded(&mut self, n: usize) {
        if let Some(line) = self.line() {
            line.response_bytes += n as u64;
        }
    }

    /// Kas refused the request, or could not get it answered, with `status`.
    pub fn refused(&mut self, status: u16, why: &str) {
        if let Some(line) = self.line() {
            line.status = Some(status);
            line.refusal = Some(why.to_string());
        }
    }

    /// The response broke off.
    pub fn broke(&mut self, why: &str) {
        if let Some(line) = self.line() {
            line.error.get_or_insert_with(|| why.to_string());
        }
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        let Some(r) = self.0.take() else { return };
        let Record {
            log,
            started,
            mut line,
            request_bytes,
            delivered_to,
        } = *r;
        line.duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        line.request_bytes = request_bytes.load(Ordering::Relaxed);
        if let Some(d) = delivered_to.get() {
            line.serving_kas = Some(d.kas.as_ref().map_or(&line.routing_kas, |k| &k.0).clone());
            line.agent_connection_id = d.connection.map(|c| c.0);
        }
        match serde_json::to_string(&line) {
            Ok(mut s) => {
                s.push('\n');
                log.record(s);
            }
            Err(e) => tracing::error!(error = %e, "an audit record could not be encoded"),
        }
    }
}

/// `path`, cut to [`MAX_PATH`] bytes at a character boundary.
fn cut(path: &str) -> String {
    if path.len() <= MAX_PATH {
        return path.to_string();
    }
    let mut end = MAX_PATH;
    while !path.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...(cut)", path.get(..end).unwrap_or_default())
}

#[cfg(test)]
mod tests;
