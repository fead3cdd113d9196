//! `kas-local`: a working kas deployment on this machine, in one command.

use clap::Parser;
use kas_tools::local::{LocalDeployment, redis_server};
use std::path::PathBuf;
use std::process::ExitCode;

/// Starts a local kas deployment and keeps it running until Ctrl-C or SIGTERM.
///
/// When `redis-server` is on PATH: Redis on a free loopback port, three kas sharing it, and
/// agents on different kas (agent 2 with two replicas) serving fixture pods. Without it (or
/// with `--in-memory`): one kas on its in-memory registry with the same agents. It prints
/// what runs where and `kasctl` commands to try. Stopping takes everything down: agents,
/// then kas (each deletes its Redis records), then Redis, and reports the keys left (0).
#[derive(Parser)]
#[command(version, about, long_about)]
struct Args {
    /// Keep configs, secrets, fixture pods and the log here (created if missing, kept at
    /// exit). Default: a temporary directory, removed at exit.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// One kas on the in-memory registry even when redis-server is installed.
    #[arg(long)]
    in_memory: bool,
    /// Everything over TLS: a throwaway CA and a certificate for 127.0.0.1 are made in DIR,
    /// every listener serves it, agents and kas dial grpcs:// trusting that CA, and the
    /// printed commands pass --ca-cert-file.
    #[arg(long)]
    tls: bool,
    /// Log filter for the log file `DIR/kas-local.log` (RUST_LOG syntax).
    #[arg(long, value_name = "FILTER", default_value = "info")]
    log: String,
    /// Export the traces of every kas and agent here to this OTLP/HTTP collector URL
    /// (e.g. `http://127.0.0.1:4318/v1/traces`): one exporter for the whole process, each
    /// span naming its component (`kas`, `agentk`) as its instrumentation scope.
    #[arg(long, value_name = "URL")]
    otlp_endpoint: Option<String>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let (dir, temporary) = match &args.dir {
        Some(d) => (d.clone(), false),
        None => (
            std::env::temp_dir().join(format!("kas-local-{}", std::process::id())),
            true,
        ),
    };
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("kas-local: cannot create {}: {e}", dir.display());
        return ExitCode::from(2);
    }
    let code = run(&args, &dir);
    if temporary {
        let _ = std::fs::remove_dir_all(&dir);
    }
    code
}

fn run(args: &Args, dir: &std::path::Path) -> ExitCode {
    let log_path = dir.join("kas-local.log");
    let log = match std::fs::File::create(&log_path) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("kas-local: {}: {e}", log_path.display());
            return ExitCode::from(2);
        }
    };
    if let Err(e) = kas_transport::logging::init(&args.log, std::sync::Mutex::new(log), false) {
        eprintln!("kas-local: {e}");
        return ExitCode::from(2);
    }
    let traces = match &args.otlp_endpoint {
        Some(endpoint) => {
            let export = kas_transport::traces::Export {
                endpoint: endpoint.clone(),
                token: None,
                ca_file: None,
                sampling_ratio: 1.0,
            };
            match kas_transport::traces::install("kas-local", export) {
                Ok(t) => Some(t),
                Err(e) => {
                    eprintln!("kas-local: --otlp-endpoint: {e}");
                    return ExitCode::from(2);
                }
            }
        }
        None => None,
    };
    let code = run_deployment(args, dir, &log_path);
    if let Some(t) = traces {
        t.shutdown();
    }
    code
}

fn run_deployment(args: &Args, dir: &std::path::Path, log_path: &std::path::Path) -> ExitCode {
    let with_redis = !args.in_memory && redis_server::installed();
    let kasctl = std::env::current_exe()
        .map(|p| p.with_file_name("kasctl").display().to_string())
        .unwrap_or_else(|_| "kasctl".into());
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kas-local: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let deployment = match LocalDeployment::start(dir, with_redis, args.tls).await {
            Ok(d) => d,
            Err(e) => {
                eprintln!("kas-local: {e} (log: {})", log_path.display());
                return ExitCode::FAILURE;
            }
        };
        print!("{}", deployment.describe(&kasctl));
        println!("Log: {}", log_path.display());
        println!("\nCtrl-C stops everything.");
        kas_transport::signals::terminate_or_interrupt().await;
        println!("\nstopping: agents, then kas (deleting their records), then Redis...");
        let stopped = deployment.stop().await;
        match stopped.redis_keys_left {
            Some(keys) if keys.is_empty() => println!("stopped; Redis keys left: 0"),
            Some(keys) => println!("stopped; Redis keys left: {} {keys:?}", keys.len()),
            None => println!("stopped"),
        }
        ExitCode::SUCCESS
    })
}
