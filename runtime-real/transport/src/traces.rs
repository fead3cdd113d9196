//! OpenTelemetry traces of calls: W3C trace context (`traceparent`, `tracestate`) read from
//! a call's caller and carried on every hop (the call's metadata between kas and down the
//! tunnel, the request's headers to the Kubernetes API server), and each hop's spans made
//! with the OpenTelemetry API. Exported over OTLP/HTTP when [`install`]ed (kas's
//! `observability.tracing`, agentk's `--otlp-endpoint`); without, every span is
//! OpenTelemetry's no-op, which records nothing and passes the caller's context on.

// prost's metadata maps: looked up by key, never iterated into an output.
#![allow(clippy::disallowed_types)]

#[cfg(not(madsim))]
mod export;

#[cfg(not(madsim))]
pub use export::{Export, Installed, install};

use kas_proto::frame::Values;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::Tracer;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

pub use opentelemetry::context::FutureExt;
pub use opentelemetry::trace::{Span, SpanKind, Status, TraceContextExt};
pub use opentelemetry::{Context, KeyValue};

/// Spans this process lost: the export queue full, or the collector not taking them.
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// Spans this process lost since it started (0 when not exporting).
pub fn dropped() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// True once an exporter is installed: until then no span is made at all.
static ON: AtomicBool = AtomicBool::new(false);

/// True when spans are exported.
pub fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Hands every span of this process to `processor` (the simulation's record of a run's
/// traces, which its checker reads), as [`install`] hands them to an exporter.
#[cfg(madsim)]
pub fn install_processor(processor: impl opentelemetry_sdk::trace::SpanProcessor + 'static) {
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_span_processor(processor)
        .build();
    opentelemetry::global::set_tracer_provider(provider);
    ON.store(true, Ordering::Relaxed);
}

/// A span `name` of component `scope` (`kas`, `agentk`), child of `parent`'s span (a new
/// trace without one), in a context of its own: it ends when the last clone of that
/// context is dropped, or at its `span().end()`. Without an exporter, `parent` itself:
/// nothing is made, and the caller's trace context passes on as it came.
pub fn child(
    scope: &'static str,
    name: &'static str,
    kind: SpanKind,
    parent: &Context,
    attributes: impl FnOnce() -> Vec<KeyValue>,
) -> Context {
    if !on() {
        return parent.clone();
    }
    let tracer = opentelemetry::global::tracer(scope);
    let span = tracer
        .span_builder(name)
        .with_kind(kind)
        .with_attributes(attributes())
        .start_with_context(&tracer, parent);
    parent.with_span(span)
}

/// The trace context a call's metadata carries (none: an empty context, a new trace).
pub fn from_metadata(metadata: &HashMap<String, Values>) -> Context {
    TraceContextPropagator::new().extract(&Metadata(metadata))
}

/// Puts `cx`'s trace context in a call's metadata, replacing any there.
pub fn into_metadata(cx: &Context, metadata: &mut HashMap<String, Values>) {
    TraceContextPropagator::new().inject_context(cx, &mut MetadataMut(metadata));
}

/// The trace context of an HTTP request's headers.
pub fn from_headers(headers: &http::HeaderMap) -> Context {
    TraceContextPropagator::new().extract(&Headers(headers))
}

/// Puts `cx`'s trace context in HTTP headers, replacing any there.
pub fn into_headers(cx: &Context, headers: &mut http::HeaderMap) {
    TraceContextPropagator::new().inject_context(cx, &mut HeadersMut(headers));
}

/// The trace id of `cx`'s span, when it has a valid one (32 hex digits).
pub fn trace_id(cx: &Context) -> Option<String> {
    let span = cx.span();
    let sc = span.span_context();
    sc.is_valid().then(|| sc.trace_id().to_string())
}

/// Ends its context's span when dropped (other clones of the context notwithstanding).
pub struct Ending(pub Context);

impl Drop for Ending {
    fn drop(&mut self) {
        self.0.span().end();
    }
}

struct Metadata<'a>(&'a HashMap<String, Values>);

impl Extractor for Metadata<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key)?.values.first().map(String::as_str)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(String::as_str).collect()
    }
}

struct MetadataMut<'a>(&'a mut HashMap<String, Values>);

impl Injector for MetadataMut<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(
            key.to_string(),
            Values {
                values: vec![value],
            },
        );
    }
}

struct Headers<'a>(&'a http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key)?.to_str().ok()
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

struct HeadersMut<'a>(&'a mut http::HeaderMap);

impl Injector for HeadersMut<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(key.as_bytes()),
            http::HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};

    fn remote(trace: u128, span: u64) -> Context {
        Context::new().with_remote_span_context(SpanContext::new(
            TraceId::from(trace),
            SpanId::from(span),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        ))
    }

    #[test]
    fn a_context_survives_metadata_and_headers() {
        let cx = remote(0x0af7651916cd43dd8448eb211c80319c, 0xb7ad6b7169203331);
        let mut metadata = HashMap::new();
        into_metadata(&cx, &mut metadata);
        assert_eq!(
            metadata["traceparent"].values,
            ["00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"]
        );
        let back = from_metadata(&metadata);
        assert_eq!(
            trace_id(&back).as_deref(),
            Some("0af7651916cd43dd8448eb211c80319c")
        );
        let mut headers = http::HeaderMap::new();
        into_headers(&back, &mut headers);
        assert_eq!(
            trace_id(&from_headers(&headers)).as_deref(),
            Some("0af7651916cd43dd8448eb211c80319c")
        );
    }

    #[test]
    fn a_malformed_traceparent_is_no_context() {
        for bad in [
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "zz-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c",
            "",
        ] {
            let mut headers = http::HeaderMap::new();
            headers.insert("traceparent", bad.parse().expect("a header value"));
            assert_eq!(trace_id(&from_headers(&headers)), None, "{bad}");
        }
    }
}
