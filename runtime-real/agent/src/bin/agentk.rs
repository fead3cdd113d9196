//! `agentk`: the in-cluster agent. Dials kas, keeps reverse tunnels open and serves calls.

use clap::Parser;
use kas_agent::kubernetes_api::Upstream;
use kas_agent::{AgentOptions, Modules, PodSource};
use kas_transport::tls::KasUrl;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

/// GitLab agent for Kubernetes (agentk): connects to kas, keeps a pool of reverse tunnels
/// open for GitLab's calls, and serves them with its modules (Pods, Kubernetes API).
///
/// The pool keeps `--min-idle-tunnels` idle, opens more as calls claim them (up to
/// `--max-tunnels`) and closes those idle for `--idle-tunnel-timeout`. Lost connections
/// are retried with jittered exponential backoff, so a kas restart does not cause a
/// reconnect storm. SIGTERM or Ctrl-C: idle tunnels close, running calls finish (within
/// `--shutdown-grace`), then agentk exits.
///
/// agentk holds connections to `--kas-connections` distinct kas at once (every kas when
/// fewer are live), all through the one `--kas` address (a load balancer in front of kas):
/// it dials again until it reaches enough distinct ones, closing duplicates. When a kas
/// stops or asks a connection to move (`agent.listen.max_connection_age`), agentk first
/// connects elsewhere, then lets the old connection's calls finish and closes it, so the
/// agent stays reachable throughout.
///
/// Pods come from the Kubernetes API (the in-cluster service account, or the current
/// kubeconfig context), or from `--pods-fixture FILE` on machines without a cluster.
/// The Kubernetes API module (kubectl through kas) proxies to the same API server, as this
/// agent or as the GitLab user kas names; it is off when there is no cluster.
///
/// With `--otlp-endpoint`, each call's spans (the call, and the Kubernetes API server
/// request, which gets the trace's `traceparent`) are exported over OTLP/HTTP, children of
/// kas's spans; a collector that is down never slows a call (spans are dropped, counted).
///
/// kas is reached through the HTTP proxy HTTPS_PROXY names (an HTTP CONNECT tunnel)
/// unless NO_PROXY lists its host; `wss://` suits proxies and CDNs that pass only
/// HTTP/1.1 and WebSocket.
#[derive(Parser)]
#[command(version, about, long_about)]
struct Args {
    /// kas agent listener (`agent.listen.address`): `grpcs://host:port` when it serves TLS,
    /// `grpc://host:port` or `host:port` when it does not.
    #[arg(
        long,
        value_name = "URL",
        env = "AGENTK_KAS",
        default_value = "127.0.0.1:8150"
    )]
    kas: String,
    /// PEM CA certificates kas's certificate must chain to, for a private CA (default: the
    /// system's roots).
    #[arg(long, value_name = "FILE", env = "AGENTK_CA_CERT_FILE")]
    ca_cert_file: Option<PathBuf>,
    /// File holding the agent token.
    #[arg(long, value_name = "FILE", env = "AGENTK_TOKEN_FILE")]
    token_file: PathBuf,
    /// Serve the Pods module from this YAML list of pods (namespace, name, phase,
    /// node_name) instead of the Kubernetes API.
    #[arg(long, value_name = "FILE", env = "AGENTK_PODS_FIXTURE")]
    pods_fixture: Option<PathBuf>,
    /// Distinct kas to hold connections to at once (each with its own tunnel pool).
    #[arg(long, value_name = "N", default_value_t = 2)]
    kas_connections: usize,
    /// Tunnels kept idle per connection, ready for calls.
    #[arg(long, value_name = "N", default_value_t = 2)]
    min_idle_tunnels: usize,
    /// Most tunnels open at once per connection (kas's `agent.max_tunnels_per_connection`
    /// caps it too). kas lets one Kubernetes API caller hold at most three quarters of what
    /// an agent may open on it and keeps at least one for the others: with 1, kubectl's
    /// requests never get a tunnel there (GitLab's own calls do).
    #[arg(long, value_name = "N", default_value_t = 100)]
    max_tunnels: usize,
    /// Close a tunnel idle this long, when more than the minimum are idle.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = humantime::parse_duration)]
    idle_tunnel_timeout: Duration,
    /// Heartbeat period on each tunnel; keep it well below kas's `agent.heartbeat_timeout`.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    heartbeat: Duration,
    /// Longest delay between reconnection attempts (the first is about 1 s, doubling).
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = humantime::parse_duration)]
    max_reconnect_delay: Duration,
    /// On shutdown, how long running calls may take to finish.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    shutdown_grace: Duration,
    /// This replica's namespace (Kubernetes downward API).
    #[arg(long, env = "POD_NAMESPACE", default_value = "")]
    pod_namespace: String,
    /// This replica's pod name (Kubernetes downward API).
    #[arg(long, env = "POD_NAME", default_value = "")]
    pod_name: String,
    /// Export traces to this OTLP/HTTP collector URL (e.g.
    /// `https://collector:4318/v1/traces`), as kas's `observability.tracing.otlp_endpoint`.
    #[arg(long, value_name = "URL", env = "AGENTK_OTLP_ENDPOINT")]
    otlp_endpoint: Option<String>,
    /// File holding the token sent as `Private-Token` with each export.
    #[arg(
        long,
        value_name = "FILE",
        env = "AGENTK_OTLP_TOKEN_FILE",
        requires = "otlp_endpoint"
    )]
    otlp_token_file: Option<PathBuf>,
    /// PEM CA certificates trusted for an `https` collector (default: the system's roots).
    #[arg(
        long,
        value_name = "FILE",
        env = "AGENTK_OTLP_CA_CERT_FILE",
        requires = "otlp_endpoint"
    )]
    otlp_ca_cert_file: Option<PathBuf>,
    /// The share of new traces recorded, 0 to 1 (kas's sampled flag is followed).
    #[arg(long, value_name = "RATIO", default_value_t = 1.0)]
    trace_sampling_ratio: f64,
    /// Log filter, e.g. `info`, `kas_agent=debug` (RUST_LOG syntax).
    #[arg(
        long,
        value_name = "FILTER",
        env = "AGENTK_LOG",
        default_value = "info"
    )]
    log: String,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(e) = kas_transport::logging::init_stderr(&args.log) {
        return fail(e);
    }
    let mut options = match options(&args) {
        Ok(o) => o,
        Err(e) => return fail(e),
    };
    let traces = match traces(&args) {
        Ok(t) => t,
        Err(e) => return fail(e),
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => return fail(format!("cannot start the async runtime: {e}")),
    };
    let code = runtime.block_on(async {
        let source = match &args.pods_fixture {
            Some(path) => PodSource::fixture_file(path).map_err(|e| format!("--pods-fixture {e}")),
            None => PodSource::kube_default().await.map_err(|e| {
                format!("{e}; on a machine without a cluster, use --pods-fixture FILE")
            }),
        };
        let source = match source {
            Ok(s) => s,
            Err(e) => return fail(e),
        };
        let mut modules = Modules::default().with_pods(source);
        // The Kubernetes API module needs a cluster; a fixture-only agent has none.
        match Upstream::infer().await {
            Ok(upstream) => {
                // Listed by kas; an API server that does not say is no reason to stay away.
                match kas_agent::meta::cluster_version(&upstream).await {
                    Ok(v) => options.meta.kubernetes_version = Some(v),
                    Err(e) => {
                        tracing::warn!(error = %e, "connecting without the cluster's version")
                    }
                }
                modules = modules.with_kubernetes_api(upstream);
            }
            Err(e) if args.pods_fixture.is_some() => {
                tracing::info!(reason = %e, "not serving the Kubernetes API module");
            }
            Err(e) => return fail(e),
        }
        let modules = Arc::new(modules);
        let (stop, shutdown) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            kas_transport::signals::terminate_or_interrupt().await;
            let _ = stop.send(true);
        });
        kas_agent::run(options, modules, shutdown).await;
        tracing::info!("agentk stopped");
        ExitCode::SUCCESS
    });
    if let Some(t) = traces {
        t.shutdown();
    }
    code
}

/// The trace exporter the `--otlp-*` flags ask for.
fn traces(args: &Args) -> Result<Option<kas_transport::traces::Installed>, String> {
    let Some(endpoint) = &args.otlp_endpoint else {
        return Ok(None);
    };
    let token = match &args.otlp_token_file {
        Some(f) => Some(
            std::fs::read_to_string(f)
                .map_err(|e| format!("--otlp-token-file {}: {e}", f.display()))?
                .trim()
                .to_string(),
        ),
        None => None,
    };
    let export = kas_transport::traces::Export {
        endpoint: endpoint.clone(),
        token,
        ca_file: args.otlp_ca_cert_file.clone(),
        sampling_ratio: args.trace_sampling_ratio,
    };
    kas_transport::traces::install("agentk", export)
        .map(Some)
        .map_err(|e| format!("--otlp-endpoint: {e}"))
}

/// The options from the flags, checked.
fn options(args: &Args) -> Result<AgentOptions, String> {
    let token = match std::fs::read_to_string(&args.token_file) {
        Ok(t) if !t.trim().is_empty() => t.trim().to_string(),
        Ok(_) => {
            return Err(format!(
                "--token-file {} is empty",
                args.token_file.display()
            ));
        }
        Err(e) => return Err(format!("--token-file {}: {e}", args.token_file.display())),
    };
    if args.max_tunnels == 0 || args.min_idle_tunnels > args.max_tunnels {
        return Err(format!(
            "--min-idle-tunnels ({}) must be at most --max-tunnels ({}), which must be at least 1",
            args.min_idle_tunnels, args.max_tunnels
        ));
    }
    if args.kas_connections == 0 {
        return Err("--kas-connections must be at least 1".into());
    }
    if args.heartbeat.is_zero() {
        return Err("--heartbeat must be more than 0".into());
    }
    let meta = kas_agent::meta::own(&args.pod_namespace, &args.pod_name);
    let url = KasUrl::parse(&args.kas).map_err(|e| format!("--kas {e}"))?;
    if let Some(f) = &args.ca_cert_file {
        kas_transport::tls::read_certificates(f).map_err(|e| format!("--ca-cert-file {e}"))?;
        if !url.tls {
            return Err(format!(
                "--ca-cert-file applies to TLS only, but --kas {} is plaintext (grpcs:// for TLS)",
                args.kas
            ));
        }
    }
    let mut o = AgentOptions::new(&args.kas, token, meta);
    o.ca_cert_file = args.ca_cert_file.clone();
    o.kas_connections = args.kas_connections;
    o.proxy = kas_transport::proxy::Proxy::from_env(&url.host)?;
    o.pool.min_idle = args.min_idle_tunnels;
    o.pool.max = args.max_tunnels;
    o.pool.idle_timeout = args.idle_tunnel_timeout;
    o.heartbeat = args.heartbeat;
    o.reconnect.max = args.max_reconnect_delay.max(o.reconnect.initial);
    o.shutdown_grace = args.shutdown_grace;
    o.seed = rand::random();
    Ok(o)
}

fn fail(msg: String) -> ExitCode {
    eprintln!("agentk: {msg}");
    ExitCode::from(2)
}
