//! The audit log of the Kubernetes API listener (`agent.kubernetes_api.audit`): one JSON
//! line per request this kas received, written when the request is over (its response
//! ended, its caller went away, or kas refused it), by a task of its own whose writes run
//! on tokio's blocking pool, so that no request waits on the disk (and the simulation,
//! where a blocking task is an ordinary one, runs the same writer).
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
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

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
    /// The writer, until [`AuditLog::close`] waits for it.
    writer: Arc<Mutex<Option<JoinHandle<()>>>>,
}

struct Shared {
    state: Mutex<State>,
    /// Wakes the writer: a record was queued, or the log closed.
    wake: Notify,
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
    /// Requests whose records are not queued yet: once closed, the writer waits for them.
    open: usize,
    /// Set when kas stops: the writer ends once no request is open and the queue is empty.
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
    /// naming the key) and starts its writer, on the runtime it is called on.
    pub fn open(config: &Audit, metrics: Metrics) -> Result<AuditLog, String> {
        let sink = Sink::open(config).map_err(|e| format!("{KEY}.path: {e}"))?;
        let shared = Arc::new(Shared {
            state: Mutex::default(),
            wake: Notify::new(),
            metrics,
        });
        let writer = tokio::spawn(shared.clone().write_all(sink));
        Ok(AuditLog {
            shared,
            writer: Arc::new(Mutex::new(Some(writer))),
        })
    }

    /// Why new requests are refused, while the log cannot take their records.
    pub fn failing(&self) -> Option<String> {
        lock(&self.shared.state).failing.clone()
    }

    /// Queues the record of a request that ended (`None`: it could not be encoded).
    fn record(&self, line: Option<String>) {
        let mut s = lock(&self.shared.state);
        s.open -= 1;
        let Some(line) = line else {
            drop(s);
            self.shared.wake.notify_one();
            return;
        };
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

    /// Writes what is queued, and the records of requests still open once they end, and
    /// ends the writer, waiting for it at most [`CLOSE_WAIT`]. Called once the listener has
    /// stopped and kas has cut off its calls, so that every request is ending.
    pub async fn close(self) {
        lock(&self.shared.state).closed = true;
        self.shared.wake.notify_one();
        let writer = self.writer.lock().unwrap_or_else(|p| p.into_inner()).take();
        let Some(writer) = writer else { return };
        if tokio::time::timeout(CLOSE_WAIT, writer).await.is_err() {
            let s = lock(&self.shared.state);
            tracing::error!(
                records = s.queue.len(),
                requests_open = s.open,
                "the audit log could not be written before kas stopped: records lost"
            );
        }
    }
}

impl Shared {
    /// The writer: batches of queued lines to the sink until closed and empty.
    async fn write_all(self: Arc<Self>, mut sink: Sink) {
        while let Some(batch) = self.next_batch().await {
            // madsim warns of a blocking task, which stops its whole world while it runs,
            // and runs it as an ordinary one: a short write to a local file is what we want.
            #[cfg_attr(madsim, allow(deprecated))]
            let write = tokio::task::spawn_blocking(move || {
                let written = sink.write(batch.as_bytes());
                (sink, batch.len(), written)
            });
            let (back, batch, written) = match write.await {
                Ok(done) => done,
                Err(e) => {
                    let mut s = lock(&self.state);
                    s.gone = true;
                    self.fail(&mut s, format!("its writer failed: {e}"));
                    return;
                }
            };
            sink = back;
            match self.written(batch, written, &sink) {
                Then::Next => {}
                Then::Retry => tokio::time::sleep(RETRY).await,
                Then::Stop => return,
            }
        }
    }

    /// Takes the lines a write of `batch` bytes wrote off the queue; what the writer does
    /// next.
    fn written(
        &self,
        batch: usize,
        written: Result<(), (usize, std::io::Error)>,
        sink: &Sink,
    ) -> Then {
        let mut s = lock(&self.state);
        // The lines written, whole, leave the queue; a failed one stays for the retry.
        let mut left = match &written {
            Ok(()) => batch,
            Err((done, _)) => *done,
        };
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
                Then::Next
            }
            Err((_, e)) => {
                self.metrics.audit_write_errors.inc();
                if s.closed {
                    // Stopping: the records still queued are reported by `close`.
                    s.gone = true;
                    return Then::Stop;
                }
                self.fail(&mut s, format!("writing {}: {e}", sink.name()));
                Then::Retry
            }
        }
    }

    /// The queued lines to write next, up to [`BATCH`] bytes (one line at least), once
    /// there are any; `None` once the log is closed, no request is open and none queued.
    async fn next_batch(&self) -> Option<String> {
        loop {
            {
                let mut s = lock(&self.state);
                if let Some(first) = s.queue.front() {
                    let mut batch = first.clone();
                    for line in s.queue.iter().skip(1) {
                        if batch.len() + line.len() > BATCH {
                            break;
                        }
                        batch.push_str(line);
                    }
                    return Some(batch);
                }
                if s.closed && s.open == 0 {
                    s.gone = true;
                    return None;
                }
            }
            // A wake-up that came before this wait is kept for it (`Notify`'s permit).
            self.wake.notified().await;
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

/// What the writer does after a write.
enum Then {
    /// Writes what is queued next.
    Next,
    /// Tries again after [`RETRY`].
    Retry,
    /// Ends: the log is closed.
    Stop,
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
        lock(&self.shared.state).open += 1;
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
        let encoded = serde_json::to_string(&line)
            .map(|s| s + "\n")
            .map_err(|e| tracing::error!(error = %e, "an audit record could not be encoded"));
        log.record(encoded.ok());
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
