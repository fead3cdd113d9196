//! A run's traces (tracing is on in half the runs, so that the code behind
//! `kas_transport::traces::on` runs too): every span kas and agentk start, recorded as it
//! starts (a span of a killed kas never ends), and invariant 16 on them: a call's span on
//! the agent is in the trace of the span the kas that took the call from GitLab started
//! for it, across the forward between kas and down the tunnel.

use madsim::rand::{Rng, thread_rng};
use opentelemetry::trace::TraceId;
use opentelemetry::{Context, Key};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Span, SpanData, SpanProcessor};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The spans a kas starts for a call it takes from GitLab (the public API, the Kubernetes
/// API listener).
const ENTRIES: [&str; 2] = ["kas.call", "kubernetes_api.request"];

/// The span agentk starts for a call a tunnel brought.
const AGENT: &str = "agentk.call";

/// A span as it started.
#[derive(Clone, Debug)]
pub struct Started {
    /// Its name (`kas.call`, `agentk.call`, ...).
    pub name: String,
    /// Its trace.
    pub trace: TraceId,
    /// Its `kas.correlation_id` attribute: the call it is part of.
    pub correlation_id: Option<String>,
}

/// The processor that records every span's start.
#[derive(Clone, Debug, Default)]
pub struct Recorder(Arc<Mutex<Vec<Started>>>);

impl Recorder {
    /// In half the runs, a recorder of every span, installed as kas and agentk install an
    /// OTLP exporter when an endpoint is set; none in the others.
    pub fn in_half_the_runs() -> Option<Recorder> {
        let traced = thread_rng().gen_bool(0.5);
        tracing::info!(traced, "this run's traces");
        traced.then(|| {
            let recorder = Recorder::default();
            kas_transport::traces::install_processor(recorder.clone());
            recorder
        })
    }

    /// Violations of invariant 16 by the spans started so far.
    pub fn check(&self) -> Vec<String> {
        let spans = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let agents = spans.iter().filter(|s| s.name == AGENT).count();
        tracing::info!(spans = spans.len(), agents, "this run's traces, checked");
        check(&spans)
    }
}

impl SpanProcessor for Recorder {
    fn on_start(&self, span: &mut Span, _cx: &Context) {
        let Some(data) = span.exported_data() else {
            return;
        };
        let key = Key::from_static_str("kas.correlation_id");
        let correlation_id = data
            .attributes
            .iter()
            .find(|kv| kv.key == key)
            .map(|kv| kv.value.as_str().into_owned());
        let started = Started {
            name: data.name.into_owned(),
            trace: data.span_context.trace_id(),
            correlation_id,
        };
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(started);
    }

    fn on_end(&self, _span: SpanData) {}

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

/// Violations of invariant 16 by `spans`: each agent's span of a call is in the trace of
/// kas's entry span of that call (by correlation id).
fn check(spans: &[Started]) -> Vec<String> {
    let mut entries: BTreeMap<&str, Vec<TraceId>> = BTreeMap::new();
    for s in spans.iter().filter(|s| ENTRIES.contains(&s.name.as_str())) {
        if let Some(id) = &s.correlation_id {
            entries.entry(id).or_default().push(s.trace);
        }
    }
    let mut violations = Vec::new();
    for s in spans.iter().filter(|s| s.name == AGENT) {
        let Some(id) = &s.correlation_id else {
            violations.push(format!(
                "inv 16: an agent's call span (trace {}) names no correlation id",
                s.trace
            ));
            continue;
        };
        match entries.get(id.as_str()) {
            Some(traces) if traces.contains(&s.trace) => {}
            Some(traces) => violations.push(format!(
                "inv 16: the agent's span of call {id} is in trace {}, not in the trace kas began for it ({traces:?})",
                s.trace
            )),
            None => violations.push(format!(
                "inv 16: the agent's span of call {id} (trace {}) has no span of a kas that took the call",
                s.trace
            )),
        }
    }
    violations
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(name: &str, trace: u128, id: &str) -> Started {
        Started {
            name: name.into(),
            trace: TraceId::from(trace),
            correlation_id: Some(id.into()),
        }
    }

    #[test]
    fn an_agent_span_outside_its_calls_trace_is_reported() {
        let whole = [
            span("kas.call", 1, "a"),
            span("kas.forward", 1, "a"),
            span("kas.serve", 1, "a"),
            span("agentk.call", 1, "a"),
            span("kubernetes_api.request", 2, "b"),
            span("agentk.call", 2, "b"),
        ];
        assert!(check(&whole).is_empty());
        let broken = [span("kas.call", 1, "a"), span("agentk.call", 3, "a")];
        assert_eq!(check(&broken).len(), 1);
        let orphan = [span("agentk.call", 3, "c")];
        assert_eq!(check(&orphan).len(), 1);
    }
}
