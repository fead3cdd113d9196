//! Prometheus metrics of one kas.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::Arc;

use kas_core::node::NodeStats;
pub use kas_core::node::Outcome;

/// The metric label of an outcome (also a span event's `kas.outcome`).
pub fn label(outcome: Outcome) -> &'static str {
    match outcome {
        Outcome::Delivered => "delivered",
        Outcome::NotConnected => "not_connected",
        Outcome::DeadlineExceeded => "deadline_exceeded",
        Outcome::Cancelled => "cancelled",
        Outcome::Refused => "refused",
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RoutedLabels {
    outcome: &'static str,
    hops: u32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LimitLabels {
    limit: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ListenerLabels {
    listener: &'static str,
}

/// The metrics, cheap to clone.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    /// Agent replicas connected to this kas (by their `GetConfiguration` streams).
    connections: Gauge,
    /// Open tunnels on this kas.
    tunnels: Gauge,
    /// Calls this kas is routing or serving.
    calls: Gauge,
    /// Calls the router is placing: looking up, waiting for a tunnel event or attempting.
    routing: Gauge,
    /// Calls waiting for a tunnel of a busy agent on this kas.
    tunnel_waiters: Gauge,
    /// Pub-sub channels subscribed (one per agent with waiting calls).
    subscriptions: Gauge,
    /// Seconds from a call's arrival until a tunnel (local) or the holding kas (remote)
    /// took it.
    pub routing_latency: Histogram,
    /// The open-file limit in force (raised to the hard limit at start).
    pub open_files_limit: Gauge,
    /// Seconds the engine fired each timer (deadline, poll, refresh) after it was due.
    pub timer_lag: Histogram,
    /// Inputs the kas node refused as a driver bug (each also logged at error level).
    pub driver_mistakes: Counter,
    /// Failed writes of the Kubernetes API audit log (each retried).
    pub audit_write_errors: Counter,
    /// 1 while the audit log cannot be written and Kubernetes API requests are refused.
    pub audit_unwritable: Gauge,
    /// Kubernetes API requests refused because the audit log could not be written.
    pub audit_refusals: Counter,
    /// Audit records that arrived after kas stopped its audit log (each logged).
    pub audit_lost: Counter,
    routed: Family<RoutedLabels, Counter>,
    served: Family<OutcomeLabels, Counter>,
    store_errors: Family<OpLabels, Counter>,
    limit_refusals: Family<LimitLabels, Counter>,
    accept_errors: Family<ListenerLabels, Counter>,
    handshake_errors: Family<ListenerLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("kas");
        let connections = Gauge::default();
        let tunnels = Gauge::default();
        let calls = Gauge::default();
        let routing = Gauge::default();
        let tunnel_waiters = Gauge::default();
        let subscriptions = Gauge::default();
        let routing_latency = Histogram::new(exponential_buckets(0.0001, 2.0, 20));
        let routed = Family::<RoutedLabels, Counter>::default();
        let served = Family::<OutcomeLabels, Counter>::default();
        let store_errors = Family::<OpLabels, Counter>::default();
        let open_files_limit = Gauge::default();
        let limit_refusals = Family::<LimitLabels, Counter>::default();
        let accept_errors = Family::<ListenerLabels, Counter>::default();
        let handshake_errors = Family::<ListenerLabels, Counter>::default();
        let driver_mistakes = Counter::default();
        let audit_write_errors = Counter::default();
        let audit_unwritable = Gauge::default();
        let audit_refusals = Counter::default();
        let audit_lost = Counter::default();
        registry.register_collector(Box::new(DroppedSpans));
        registry.register(
            "audit_write_errors",
            "Failed writes of the Kubernetes API audit log (agent.kubernetes_api.audit), each retried",
            audit_write_errors.clone(),
        );
        registry.register(
            "audit_unwritable",
            "1 while the audit log cannot be written (or lags) and Kubernetes API requests are refused",
            audit_unwritable.clone(),
        );
        registry.register(
            "audit_refusals",
            "Kubernetes API requests refused with 503 because the audit log could not be written",
            audit_refusals.clone(),
        );
        registry.register(
            "audit_lost",
            "Audit records that arrived after kas stopped its audit log, each logged at error level",
            audit_lost.clone(),
        );
        let timer_lag = Histogram::new(exponential_buckets(0.0001, 2.0, 20));
        registry.register(
            "engine_timer_lag_seconds",
            "How late the routing engine fired its timers (deadlines, polls, refreshes)",
            timer_lag.clone(),
        );
        registry.register(
            "driver_mistakes",
            "Inputs the routing core refused as a bug in its driver, or its machines disagreed on (should stay 0)",
            driver_mistakes.clone(),
        );
        registry.register(
            "open_files_limit",
            "The open-file limit (RLIMIT_NOFILE) kas runs with",
            open_files_limit.clone(),
        );
        registry.register(
            "limit_refusals",
            "Requests refused by a configured limit, by the limit's configuration key",
            limit_refusals.clone(),
        );
        registry.register(
            "accept_errors",
            "Failed accepts (e.g. the open-file limit reached), by listener",
            accept_errors.clone(),
        );
        registry.register(
            "handshake_errors",
            "Connections closed before their TLS or WebSocket handshake completed \
             (plaintext to a TLS listener, an untrusted certificate, a timeout), by listener",
            handshake_errors.clone(),
        );
        registry.register(
            "connected_agents",
            "Agent replicas connected to this kas (by their GetConfiguration streams)",
            connections.clone(),
        );
        registry.register("tunnels", "Open agent tunnels on this kas", tunnels.clone());
        registry.register("calls", "Calls being routed or served", calls.clone());
        registry.register(
            "routing_calls",
            "Calls being placed by the router (looking up, waiting or attempting)",
            routing.clone(),
        );
        registry.register(
            "tunnel_waiters",
            "Calls waiting for a tunnel of a busy agent on this kas",
            tunnel_waiters.clone(),
        );
        registry.register(
            "pubsub_subscriptions",
            "Tunnel-event channels subscribed (agents with waiting calls)",
            subscriptions.clone(),
        );
        registry.register(
            "routing_latency_seconds",
            "From a call's arrival until a local tunnel or the holding kas took it",
            routing_latency.clone(),
        );
        registry.register(
            "routed_requests",
            "Calls from GitLab by outcome and kas hops (0 local, 1 through another kas)",
            routed.clone(),
        );
        registry.register(
            "served_forwarded_requests",
            "Calls from other kas served from this kas's tunnels, by outcome",
            served.clone(),
        );
        registry.register(
            "redis_errors",
            "Failed registry store operations by operation",
            store_errors.clone(),
        );
        Metrics {
            registry: Arc::new(registry),
            connections,
            tunnels,
            calls,
            routing,
            tunnel_waiters,
            subscriptions,
            routing_latency,
            open_files_limit,
            driver_mistakes,
            audit_write_errors,
            audit_unwritable,
            audit_refusals,
            audit_lost,
            timer_lag,
            routed,
            served,
            store_errors,
            limit_refusals,
            accept_errors,
            handshake_errors,
        }
    }
}

impl Metrics {
    /// Sets the gauges that count what the kas node holds.
    pub fn node(&self, stats: NodeStats) {
        let set = |gauge: &Gauge, n: usize| gauge.set(i64::try_from(n).unwrap_or(i64::MAX));
        set(&self.calls, stats.calls);
        set(&self.routing, stats.routing);
        set(&self.tunnel_waiters, stats.tunnel_waiters);
        set(&self.subscriptions, stats.subscriptions);
        set(&self.connections, stats.connections);
        set(&self.tunnels, stats.tunnels);
    }

    /// Counts a routed call's end.
    pub fn routed(&self, outcome: Outcome, hops: u32) {
        self.routed
            .get_or_create(&RoutedLabels {
                outcome: label(outcome),
                hops,
            })
            .inc();
    }

    /// Counts a forwarded call's end at the serving kas.
    pub fn served(&self, outcome: Outcome) {
        self.served
            .get_or_create(&OutcomeLabels {
                outcome: label(outcome),
            })
            .inc();
    }

    /// Counts a failed store operation.
    pub fn store_error(&self, op: &'static str) {
        self.store_errors.get_or_create(&OpLabels { op }).inc();
    }

    /// Counts a refusal by the limit configured at `limit` (its key).
    pub fn limit_refused(&self, limit: &'static str) {
        self.limit_refusals
            .get_or_create(&LimitLabels { limit })
            .inc();
    }

    /// Counts a failed accept on `listener`.
    pub fn accept_error(&self, listener: &'static str) {
        self.accept_errors
            .get_or_create(&ListenerLabels { listener })
            .inc();
    }

    /// Counts a failed TLS or WebSocket handshake on `listener`.
    pub fn handshake_error(&self, listener: &'static str) {
        self.handshake_errors
            .get_or_create(&ListenerLabels { listener })
            .inc();
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// `kas_traces_dropped_total`: trace spans this process lost (kept by the exporter, which
/// is the process's, not one kas's).
#[derive(Debug)]
struct DroppedSpans;

impl prometheus_client::collector::Collector for DroppedSpans {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        let counter = prometheus_client::metrics::counter::ConstCounter::new(
            kas_transport::traces::dropped(),
        );
        let metric = encoder.encode_descriptor(
            "traces_dropped",
            "Trace spans lost: the export queue full, or the collector not taking them (calls are not affected)",
            None,
            counter.metric_type(),
        )?;
        counter.encode(metric)
    }
}
