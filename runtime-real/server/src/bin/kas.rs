//! `kas`: the GitLab Kubernetes Agent Server request router.

use clap::Parser;
use kas_server::config::Config;
use kas_server::kas::Kas;
use kas_server::probe::{self, Probe};
use std::path::PathBuf;
use std::process::ExitCode;

/// GitLab Kubernetes Agent Server (kas): holds agentk's reverse tunnels and routes
/// GitLab's calls to them, through whichever kas replica holds a tunnel of the agent.
///
/// Four listeners, each configured in the file: `agent.listen` (agentk connects here),
/// `api.listen` (GitLab, JWT signed with GitLab's secret), `private_api.listen` (other kas
/// replicas, JWT signed with the kas-only secret) and `observability.listen` (`/metrics`,
/// `/liveness`, `/readiness`). With a `redis` section, replicas share who is connected
/// where through Redis; without one, kas runs alone on an in-memory registry.
///
/// SIGTERM or Ctrl-C shuts down gracefully: not ready, no new calls, running calls finish
/// within `shutdown_grace`, agents are told to reconnect elsewhere, and this kas's Redis
/// records are deleted.
#[derive(Parser)]
#[command(version, about, long_about)]
struct Args {
    /// Configuration file (YAML, laid out like GitLab's kas configuration; see
    /// deploy/kas-config.example.yaml).
    #[arg(long, value_name = "FILE", env = "KAS_CONFIG")]
    config: PathBuf,
    /// Address other kas replicas reach this one on (overrides
    /// `private_api.advertise_address`); in Kubernetes, `$(POD_IP):8155`, or with its
    /// scheme, `grpcs://$(POD_IP):8155`.
    #[arg(
        long,
        value_name = "[SCHEME://]IP:PORT",
        env = "OWN_PRIVATE_API_ADDRESS"
    )]
    advertise_address: Option<kas_server::config::PrivateAddress>,
    /// Check the configuration file, print the problems found, and exit.
    #[arg(long)]
    check: bool,
    /// Ask the running kas this configuration describes whether it is alive or ready (its
    /// observability listener's `/liveness` or `/readiness`), print the answer, and exit
    /// 0 when it is, 1 when not: a container health check with no shell or HTTP client.
    #[arg(long, value_name = "WHAT", conflicts_with = "check")]
    probe: Option<Probe>,
    /// Log filter, e.g. `info`, `kas_server=debug` (RUST_LOG syntax).
    #[arg(long, value_name = "FILTER", env = "KAS_LOG", default_value = "info")]
    log: String,
}

/// How long a probe waits to connect, and then for each read or write.
const PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(e) = kas_transport::logging::init_stderr(&args.log) {
        eprintln!("kas: {e}");
        return ExitCode::from(2);
    }
    let config = match Config::load(&args.config, args.advertise_address) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kas: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(probe) = args.probe {
        return match probe::ask(config.observability.listen.address, probe, PROBE_TIMEOUT) {
            Ok(body) => {
                println!("kas: {body}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("kas: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if args.check {
        println!("kas: {} is valid", args.config.display());
        return ExitCode::SUCCESS;
    }
    let traces = match config.observability.tracing.as_ref().map(|t| {
        t.export()
            .and_then(|e| kas_transport::traces::install("kas", e))
    }) {
        None => None,
        Some(Ok(installed)) => Some(installed),
        Some(Err(e)) => {
            eprintln!("kas: observability.tracing: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kas: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(async {
        let kas = match Kas::start_configured(config).await {
            Ok(k) => k,
            Err(e) => {
                eprintln!("kas: {e}");
                return ExitCode::FAILURE;
            }
        };
        kas_transport::signals::terminate_or_interrupt().await;
        kas.stop().await;
        ExitCode::SUCCESS
    });
    if let Some(traces) = traces {
        traces.shutdown();
    }
    code
}
