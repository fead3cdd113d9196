//! Export of spans over OTLP/HTTP (protobuf), by OpenTelemetry's exporter, from a queue of
//! [`QUEUE`] spans and a thread of its own: a collector that is down or slow never slows
//! or fails a call. A span that finds the queue full, or is in a batch the collector did
//! not take, is dropped: counted ([`super::dropped`]) and logged at most once a minute.

// The exporter's header map (one entry), never iterated into an output.
#![allow(clippy::disallowed_types)]

use opentelemetry::Context;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{
    Sampler, SdkTracerProvider, Span, SpanData, SpanExporter, SpanProcessor,
};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Spans waiting for export, at most.
const QUEUE: usize = 4096;
/// Spans sent in one export, at most.
const BATCH: usize = 512;
/// How long a span waits for a fuller batch.
const LINGER: Duration = Duration::from_secs(1);
/// How long one export may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// Drops are logged at most this often.
const LOG_EVERY: Duration = Duration::from_secs(60);

/// Where spans go and which are kept.
#[derive(Clone, Debug)]
pub struct Export {
    /// The collector's OTLP/HTTP traces URL, e.g. `https://collector:4318/v1/traces`.
    pub endpoint: String,
    /// Sent as `Private-Token` (GitLab's observability endpoints), when set.
    pub token: Option<String>,
    /// PEM CA certificates trusted for an `https` endpoint (the system's without).
    pub ca_file: Option<PathBuf>,
    /// The share of new traces recorded (0 to 1); a caller's sampled flag is followed.
    pub sampling_ratio: f64,
}

/// The installed exporter; [`Installed::shutdown`] sends what is queued.
pub struct Installed {
    provider: SdkTracerProvider,
}

impl Installed {
    /// Sends the spans still queued (a few seconds at most) and stops exporting.
    pub fn shutdown(self) {
        let _ = self.provider.shutdown_with_timeout(Duration::from_secs(5));
    }
}

/// Installs the exporter for service `service` (`kas`, `agentk`) as the process's tracer
/// provider.
pub fn install(service: &'static str, export: Export) -> Result<Installed, String> {
    let uri: http::Uri = export
        .endpoint
        .parse()
        .map_err(|e| format!("{:?} is not a URL: {e}", export.endpoint))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err(format!(
            "{:?} is not an http:// or https:// URL",
            export.endpoint
        ));
    }
    if !(0.0..=1.0).contains(&export.sampling_ratio) {
        return Err(format!(
            "the sampling ratio {} is not between 0 and 1",
            export.sampling_ratio
        ));
    }
    let resource = Resource::builder().with_service_name(service).build();
    let client = http_client(&export)?;
    let mut exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(client)
        .with_endpoint(export.endpoint.clone())
        .with_timeout(EXPORT_TIMEOUT)
        .with_headers(
            export
                .token
                .iter()
                .map(|t| ("Private-Token".to_string(), t.clone()))
                .collect::<HashMap<_, _>>(),
        )
        .build()
        .map_err(|e| format!("the OTLP exporter: {e}"))?;
    exporter.set_resource(&resource);
    let queue = Queue::start(exporter)?;
    let ratio = export.sampling_ratio;
    let provider = SdkTracerProvider::builder()
        .with_span_processor(queue)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            ratio,
        ))))
        .with_resource(resource)
        .build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    super::ON.store(true, std::sync::atomic::Ordering::Relaxed);
    Ok(Installed { provider })
}

/// A blocking HTTP client (the export runs on its own thread) trusting the configured CA.
fn http_client(export: &Export) -> Result<reqwest::blocking::Client, String> {
    let tls = crate::tls::client_config(export.ca_file.as_deref(), &[b"http/1.1"])?;
    // Built on a thread of its own: reqwest's blocking client may not be made or dropped
    // inside an async runtime, which the caller may be in.
    std::thread::spawn(move || {
        reqwest::blocking::Client::builder()
            .tls_backend_preconfigured((*tls).clone())
            .timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|e| format!("the OTLP HTTP client: {e}"))
    })
    .join()
    .map_err(|_| "the OTLP HTTP client could not be built".to_string())?
}

/// What the export thread is sent.
enum Order {
    Span(Box<SpanData>),
    /// Export everything before this, then answer.
    Flush(SyncSender<()>),
}

/// The span processor: a bounded queue in front of the export thread.
#[derive(Debug)]
struct Queue {
    orders: SyncSender<Order>,
    drops: Arc<Drops>,
}

/// Counts lost spans and logs them, rate-limited.
#[derive(Debug, Default)]
struct Drops {
    since_log: AtomicU64,
    last_log: Mutex<Option<Instant>>,
}

impl Drops {
    fn lost(&self, n: u64, why: &str) {
        super::DROPPED.fetch_add(n, Ordering::Relaxed);
        let total = self.since_log.fetch_add(n, Ordering::Relaxed) + n;
        let mut last = self.last_log.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_none_or(|at| at.elapsed() >= LOG_EVERY) {
            *last = Some(Instant::now());
            self.since_log.store(0, Ordering::Relaxed);
            tracing::warn!(
                spans = total,
                reason = why,
                "trace spans dropped (kas_traces_dropped_total counts them); calls are not affected"
            );
        }
    }
}

impl Queue {
    fn start(exporter: opentelemetry_otlp::SpanExporter) -> Result<Queue, String> {
        let (orders, rx) = sync_channel(QUEUE);
        let drops = Arc::new(Drops::default());
        let thread_drops = drops.clone();
        std::thread::Builder::new()
            .name("otlp-export".into())
            .spawn(move || export_all(exporter, rx, &thread_drops))
            .map_err(|e| format!("cannot start the OTLP export thread: {e}"))?;
        Ok(Queue { orders, drops })
    }
}

/// The export thread: batches of spans to the exporter until the queue's sender is gone.
fn export_all(exporter: opentelemetry_otlp::SpanExporter, rx: Receiver<Order>, drops: &Drops) {
    let mut batch = Vec::with_capacity(BATCH);
    let mut flushes = Vec::new();
    loop {
        let first = match rx.recv() {
            Ok(order) => order,
            Err(_) => return,
        };
        let until = Instant::now() + LINGER;
        let mut next = Some(first);
        while let Some(order) = next.take() {
            match order {
                Order::Span(span) => batch.push(*span),
                Order::Flush(done) => {
                    flushes.push(done);
                    break;
                }
            }
            if batch.len() >= BATCH {
                break;
            }
            match rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
                Ok(order) => next = Some(order),
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        if !batch.is_empty() {
            let n = batch.len() as u64;
            let spans = std::mem::replace(&mut batch, Vec::with_capacity(BATCH));
            if let Err(e) = futures::executor::block_on(exporter.export(spans)) {
                drops.lost(n, &format!("the collector did not take them: {e}"));
            }
        }
        for done in flushes.drain(..) {
            let _ = done.send(());
        }
    }
}

impl SpanProcessor for Queue {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        match self.orders.try_send(Order::Span(Box::new(span))) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => self.drops.lost(1, "the export queue is full"),
            Err(TrySendError::Disconnected(_)) => self.drops.lost(1, "the exporter stopped"),
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        let (done, wait) = sync_channel(1);
        self.orders
            .send(Order::Flush(done))
            .map_err(|_| OTelSdkError::AlreadyShutdown)?;
        wait.recv_timeout(EXPORT_TIMEOUT + LINGER)
            .map_err(|_| OTelSdkError::Timeout(EXPORT_TIMEOUT + LINGER))
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        let (done, wait) = sync_channel(1);
        self.orders
            .try_send(Order::Flush(done))
            .map_err(|_| OTelSdkError::InternalFailure("the export queue is full".into()))?;
        wait.recv_timeout(timeout)
            .map_err(|_| OTelSdkError::Timeout(timeout))
    }
}
