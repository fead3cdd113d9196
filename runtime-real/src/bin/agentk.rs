//! `agentk`: the in-cluster agent. Dials kas, keeps reverse tunnels open and serves calls.

use clap::Parser;
use kas_core::backoff::Backoff;
use kas_core::rng::Rng;
use kas_proto::pods::Pod;
use kas_proto::registry::AgentMeta;
use kas_runtime::agent::{AgentClient, Modules};
use serde::Deserialize;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

/// GitLab agent for Kubernetes (agentk): connects to kas, keeps reverse tunnels open for
/// GitLab's calls, and serves them with its modules (Pods).
///
/// This version keeps a fixed number of tunnels per connection and reconnects with
/// jittered exponential backoff; pods come from a fixture file.
#[derive(Parser)]
#[command(version, about, long_about)]
struct Args {
    /// kas agent listener (`agent.listen.address`).
    #[arg(
        long,
        value_name = "HOST:PORT",
        env = "AGENTK_KAS",
        default_value = "127.0.0.1:8150"
    )]
    kas: String,
    /// File holding the agent token.
    #[arg(long, value_name = "FILE", env = "AGENTK_TOKEN_FILE")]
    token_file: PathBuf,
    /// Serve the Pods module from this YAML list of pods (namespace, name, phase, node_name).
    #[arg(long, value_name = "FILE")]
    pods_fixture: Option<PathBuf>,
    /// Tunnels kept open per connection.
    #[arg(long, default_value_t = 2)]
    tunnels: usize,
    /// This replica's namespace (Kubernetes downward API).
    #[arg(long, env = "POD_NAMESPACE", default_value = "")]
    pod_namespace: String,
    /// This replica's pod name (Kubernetes downward API).
    #[arg(long, env = "POD_NAME", default_value = "")]
    pod_name: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FixturePod {
    namespace: String,
    name: String,
    #[serde(default)]
    phase: String,
    #[serde(default)]
    node_name: String,
}

fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::from_default_env()
                .add_directive(tracing::Level::INFO.into()),
        )
        .init();
    let token = match std::fs::read_to_string(&args.token_file) {
        Ok(t) if !t.trim().is_empty() => t.trim().to_string(),
        Ok(_) => {
            return fail(format!(
                "--token-file {} is empty",
                args.token_file.display()
            ));
        }
        Err(e) => return fail(format!("--token-file {}: {e}", args.token_file.display())),
    };
    let mut modules = Modules::default();
    if let Some(path) = &args.pods_fixture {
        let pods: Vec<FixturePod> = match std::fs::read_to_string(path)
            .map_err(|e| e.to_string())
            .and_then(|t| serde_yaml::from_str(&t).map_err(|e| e.to_string()))
        {
            Ok(p) => p,
            Err(e) => return fail(format!("--pods-fixture {}: {e}", path.display())),
        };
        modules = modules.with_fixture_pods(
            pods.into_iter()
                .map(|p| Pod {
                    namespace: p.namespace,
                    name: p.name,
                    phase: p.phase,
                    node_name: p.node_name,
                })
                .collect(),
        );
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => return fail(format!("cannot start the async runtime: {e}")),
    };
    runtime.block_on(async {
        tokio::select! {
            () = run(&args, token, Arc::new(modules)) => ExitCode::FAILURE,
            _ = tokio::signal::ctrl_c() => ExitCode::SUCCESS,
        }
    })
}

fn fail(msg: String) -> ExitCode {
    eprintln!("agentk: {msg}");
    ExitCode::from(2)
}

/// Connects, serves, and reconnects with backoff, forever.
async fn run(args: &Args, token: String, modules: Arc<Modules>) {
    let backoff = Backoff {
        initial: Duration::from_millis(500),
        max: Duration::from_secs(30),
        factor: 2,
    };
    let mut rng = Rng::new(rand::random());
    let mut failures = 0;
    loop {
        match serve(args, &token, modules.clone()).await {
            Ok(()) => failures = 0,
            Err(e) => tracing::warn!(kas = %args.kas, error = %e, "connection to kas failed"),
        }
        let delay = backoff.delay(failures, &mut rng);
        failures = failures.saturating_add(1);
        tracing::info!(?delay, "reconnecting");
        tokio::time::sleep(delay).await;
    }
}

/// One connection: `GetConfiguration` plus tunnels, until kas ends it.
async fn serve(args: &Args, token: &str, modules: Arc<Modules>) -> Result<(), String> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", args.kas))
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| format!("cannot reach kas: {e}"))?;
    let client = AgentClient::new(channel, token);
    let meta = AgentMeta {
        version: env!("CARGO_PKG_VERSION").into(),
        commit: String::new(),
        pod_namespace: args.pod_namespace.clone(),
        pod_name: args.pod_name.clone(),
    };
    let (connection, _, mut config) = client
        .connect(meta)
        .await
        .map_err(|s| s.message().to_string())?;
    tracing::info!(kas = %args.kas, %connection, "connected");
    let mut tunnels = tokio::task::JoinSet::new();
    for _ in 0..args.tunnels {
        let (client, modules) = (client.clone(), modules.clone());
        tunnels.spawn(async move {
            loop {
                let status = client
                    .serve_tunnel(connection, modules.clone(), Duration::from_secs(10))
                    .await;
                tracing::debug!(reason = %status.message(), "tunnel ended");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
    }
    let end = loop {
        match config.message().await {
            Ok(Some(_)) => {}
            Ok(None) => break Ok(()),
            Err(s) => break Err(s.message().to_string()),
        }
    };
    tunnels.abort_all();
    end
}
