//! `kasctl`: GitLab's side of the kas API, from a terminal.

use clap::{Parser, Subcommand};
use kas_auth::jwt::Secret;
use kas_client::api_client::ApiClient;
use kas_proto::registry::ConnectedAgentInfo;
use kas_server::kas::correlation::{self, CorrelationId};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use tonic::{Code, Status};

/// Calls kas's public API as GitLab does: lists connected agents and routes calls to them.
///
/// Every call is signed with a JWT made from GitLab's kas secret (`--secret-file`).
#[derive(Parser)]
#[command(version, about, long_about)]
struct Args {
    /// kas public API (`api.listen.address`): `grpcs://host:port` when it serves TLS,
    /// `grpc://host:port` or `host:port` when it does not.
    #[arg(
        long,
        value_name = "URL",
        env = "KASCTL_KAS",
        default_value = "127.0.0.1:8153"
    )]
    kas: String,
    /// PEM CA certificates kas's certificate must chain to, for a private CA (default: the
    /// system's roots).
    #[arg(long, value_name = "FILE", env = "KASCTL_CA_CERT_FILE")]
    ca_cert_file: Option<PathBuf>,
    /// GitLab's kas secret (base64), the file kas has as `api.listen.authentication_secret_file`.
    #[arg(long, value_name = "FILE", env = "KASCTL_SECRET_FILE")]
    secret_file: PathBuf,
    /// How long to wait, including for an agent that is not connected yet.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Connected agent replicas, of a project or of one agent: each one's pod, agentk
    /// version and architecture, its cluster's Kubernetes version, the kas it is connected
    /// to, and the listing kas's warnings (an agentk older than that kas supports, or newer).
    Agents {
        /// The agents of this project.
        #[arg(long, conflicts_with = "agent", required_unless_present = "agent")]
        project: Option<i64>,
        /// This agent's replicas.
        #[arg(long)]
        agent: Option<i64>,
    },
    /// Pods in the agent's cluster, through the agent's tunnel.
    Pods {
        /// The agent.
        #[arg(long)]
        agent: i64,
        /// One replica (a connection id from `kasctl agents`).
        #[arg(long)]
        connection: Option<i64>,
        /// Only this namespace's pods.
        #[arg(long, short = 'n', default_value = "")]
        namespace: String,
    },
    /// A pod's current log, through the agent's tunnel, written to standard output as it
    /// arrives.
    Logs {
        /// The agent.
        #[arg(long)]
        agent: i64,
        /// One replica (a connection id from `kasctl agents`).
        #[arg(long)]
        connection: Option<i64>,
        /// The pod's namespace.
        #[arg(long, short = 'n')]
        namespace: String,
        /// The pod.
        pod: String,
        /// The container (needed when the pod has several).
        #[arg(long, short = 'c', default_value = "")]
        container: String,
        /// Stop after about this many bytes (0: the agent's cap, 64 MiB by default).
        #[arg(long, value_name = "BYTES", default_value_t = 0)]
        limit_bytes: i64,
    },
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kasctl: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(&args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kasctl: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: &Args) -> Result<(), String> {
    let secret = Secret::load(&args.secret_file).map_err(|e| format!("--secret-file: {e}"))?;
    // One id for every call of this run, so that a failure, even one kas never answered,
    // can be found in the logs of every kas it reached.
    let correlation_id = CorrelationId::make();
    let client = ApiClient::connect_with_ca(
        &args.kas,
        args.ca_cert_file.as_deref(),
        &secret,
        args.timeout,
    )
    .await?
    .with_correlation_id(correlation_id.as_str());
    let explain = |s: Status| {
        // The id kas answered with (kasctl's own), said once, at the end.
        let id = s
            .metadata()
            .get(correlation::HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or(correlation_id.as_str())
            .to_owned();
        let said = format!(" (correlation id {id})");
        let s = match s.message().strip_suffix(&said) {
            Some(message) => Status::with_metadata(s.code(), message, s.metadata().clone()),
            None => s,
        };
        format!("{}{said}", explain(&args.kas, s))
    };
    match args.command {
        Cmd::Agents { project, agent } => {
            let agents = match (project, agent) {
                (Some(p), _) => client.agents_for_project(p).await,
                (None, Some(a)) => client.agents_by_id(a).await,
                (None, None) => return Err("give --project or --agent".into()),
            }
            .map_err(explain)?;
            print_agents(&agents, args.json);
        }
        Cmd::Pods {
            agent,
            connection,
            ref namespace,
        } => {
            let pods = client
                .pods(agent, connection, namespace)
                .await
                .map_err(explain)?;
            if args.json {
                let v: Vec<_> = pods
                    .iter()
                    .map(|p| serde_json::json!({"namespace": p.namespace, "name": p.name, "phase": p.phase, "node": p.node_name}))
                    .collect();
                println!("{}", serde_json::Value::Array(v));
            } else {
                let rows = pods
                    .iter()
                    .map(|p| {
                        vec![
                            p.namespace.clone(),
                            p.name.clone(),
                            p.phase.clone(),
                            p.node_name.clone(),
                        ]
                    })
                    .collect();
                table(&["NAMESPACE", "NAME", "PHASE", "NODE"], rows);
            }
        }
        Cmd::Logs {
            agent,
            connection,
            ref namespace,
            ref pod,
            ref container,
            limit_bytes,
        } => {
            let mut log = client
                .pod_logs(agent, connection, namespace, pod, container, limit_bytes)
                .await
                .map_err(explain)?;
            let mut out = std::io::stdout().lock();
            while let Some(chunk) = log.message().await.map_err(explain)? {
                out.write_all(&chunk.data)
                    .and_then(|()| out.flush())
                    .map_err(|e| format!("writing the log: {e}"))?;
            }
        }
    }
    Ok(())
}

/// What went wrong, in the user's terms.
fn explain(kas: &str, s: Status) -> String {
    match s.code() {
        Code::Unauthenticated => format!(
            "kas refused the token ({}): is --secret-file GitLab's kas secret?",
            s.message()
        ),
        Code::Unavailable if s.message().contains("not connected") => {
            format!("{} (no agent connected within the deadline)", s.message())
        }
        Code::Unavailable => format!("kas at {kas} is unavailable: {}", s.message()),
        // How a TLS listener answers a plaintext client: it closes the connection, which
        // hyper reports as a reset, a broken pipe or a cancelled request, as the race goes.
        _ if !kas.starts_with("grpcs://") && transport_failed(&s) => format!(
            "lost the connection to kas at {kas}: {} (if that kas listener serves TLS, use grpcs://)",
            std::error::Error::source(&s).map_or_else(String::new, kas_transport::errors::chain)
        ),
        Code::DeadlineExceeded | Code::Cancelled => {
            format!("no answer within --timeout: {}", s.message())
        }
        _ => format!("{:?}: {}", s.code(), s.message()),
    }
}

/// True when the call failed in the transport (the connection), not in kas.
fn transport_failed(s: &Status) -> bool {
    use std::error::Error;
    s.source()
        .is_some_and(|e| e.is::<tonic::transport::Error>())
}

/// The columns of `kasctl agents`, as its table heads them (`--json` keys: lower case).
const AGENT_COLUMNS: [&str; 9] = [
    "AGENT",
    "PROJECT",
    "CONNECTION",
    "POD",
    "VERSION",
    "ARCH",
    "KUBERNETES",
    "KAS",
    "WARNINGS",
];

fn print_agents(agents: &[ConnectedAgentInfo], json: bool) {
    let rows: Vec<Vec<String>> = agents
        .iter()
        .map(|a| {
            let meta = a.agent_meta.clone().unwrap_or_default();
            // Every kas the replica is connected to (one, from a kas that lists no more).
            let kas = if a.kas_addresses.is_empty() {
                a.kas_address.iter().collect::<Vec<_>>()
            } else {
                a.kas_addresses.iter().collect()
            };
            let kas = kas
                .iter()
                .map(|k| format!("{}:{}", k.ip, k.port))
                .collect::<Vec<_>>()
                .join(",");
            let kubernetes = meta
                .kubernetes_version
                .map(|k| k.git_version)
                .unwrap_or_default();
            vec![
                a.agent_id.to_string(),
                a.project_id.to_string(),
                a.connection_id.to_string(),
                format!("{}/{}", meta.pod_namespace, meta.pod_name),
                meta.version,
                meta.architecture,
                kubernetes,
                kas,
                a.warnings.join("; "),
            ]
        })
        .collect();
    if json {
        let v: Vec<serde_json::Value> = rows
            .iter()
            .zip(agents)
            .map(|(r, a)| {
                let mut o: serde_json::Map<String, serde_json::Value> = AGENT_COLUMNS
                    .iter()
                    .zip(r)
                    .map(|(h, c)| (h.to_lowercase(), serde_json::Value::String(c.clone())))
                    .collect();
                // A list, not the table's joined cell.
                o.insert("warnings".into(), serde_json::json!(a.warnings));
                serde_json::Value::Object(o)
            })
            .collect();
        println!("{}", serde_json::Value::Array(v));
    } else {
        table(&AGENT_COLUMNS, rows);
    }
}

fn table(head: &[&str], rows: Vec<Vec<String>>) {
    let mut widths: Vec<usize> = head.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let line = |cells: Vec<String>| {
        let s: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        println!("{}", s.join("  ").trim_end());
    };
    line(head.iter().map(|h| h.to_string()).collect());
    for r in rows {
        line(r);
    }
}
