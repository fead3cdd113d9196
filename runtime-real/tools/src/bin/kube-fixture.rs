//! `kube-fixture`: the small Kubernetes API server of kas-local on an address of your
//! choice, for agentk in containers (the Compose fleet) to proxy kubectl to.

use clap::Parser;
use kas_tools::local::kube_server::KubeServer;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

/// Serves the pods of a fixture file as a Kubernetes API server (plain HTTP/1.1): discovery,
/// get, list and watch pods, create and delete, logs (with follow: a line every 300 ms),
/// exec and port-forward that echo. `GET /kas-local/requests` counts the requests served
/// by method and path (test data, not Kubernetes). Not a cluster: a stand-in for tests and
/// demonstrations.
#[derive(Parser)]
#[command(version, about, long_about)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// The pods: a YAML list of `namespace`, `name`, and optionally `phase`, `node_name`,
    /// `log` (agentk's --pods-fixture format).
    #[arg(long, value_name = "FILE")]
    pods: PathBuf,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let pods = match kas_agent::pods::read_fixture(&args.pods) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("kube-fixture: --pods {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kube-fixture: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let server = match KubeServer::start_on(args.listen, &pods).await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("kube-fixture: cannot listen on {}: {e}", args.listen);
                return ExitCode::FAILURE;
            }
        };
        eprintln!(
            "kube-fixture: serving {} pods on {}",
            pods.len(),
            server.url()
        );
        tokio::select! {
            r = server.serve() => {
                eprintln!("kube-fixture: the server stopped: {r:?}");
                ExitCode::FAILURE
            }
            () = kas_transport::signals::terminate_or_interrupt() => ExitCode::SUCCESS,
        }
    })
}
