//! Unary latency and throughput on three paths: direct (GitLab calling the agent's Pods
//! service itself), local route (kas holding the tunnel) and remote route (another kas,
//! which forwards).

use crate::setup::{logs, pods};
use crate::stats::{Latencies, cpu_of, cpu_time};
use kas_agent::pods::LogStream;
use kas_client::api_client::ApiClient;
use kas_proto::pods::pods_client::PodsClient;
use kas_proto::pods::pods_server::{Pods, PodsServer};
use kas_proto::pods::{ListRequest, ListResponse, LogsRequest};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

/// The agent's Pods module served as a gRPC service of its own: the direct baseline of the
/// unary and the streaming parts.
struct Direct;

#[tonic::async_trait]
impl Pods for Direct {
    async fn list(&self, _: Request<ListRequest>) -> Result<Response<ListResponse>, Status> {
        Ok(Response::new(pods()))
    }

    type LogsStream = LogStream;

    async fn logs(&self, req: Request<LogsRequest>) -> Result<Response<LogStream>, Status> {
        Ok(Response::new(logs(req.get_ref())))
    }
}

/// Serves [`Direct`] on a free loopback port; returns its address.
pub async fn serve_direct() -> Result<SocketAddr, String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| format!("bind: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(PodsServer::new(Direct))
            .serve_with_incoming(incoming),
    );
    Ok(addr)
}

/// One call on a path.
pub type CallFn =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> + Send + Sync>;

/// A client of [`Direct`] at `addr`.
pub async fn direct_client(addr: SocketAddr) -> Result<PodsClient<Channel>, String> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| format!("direct: {e}"))?;
    Ok(PodsClient::new(channel))
}

/// A path's call: direct to `client`.
pub fn direct(client: PodsClient<Channel>) -> CallFn {
    Arc::new(move || {
        let mut c = client.clone();
        Box::pin(async move {
            c.list(ListRequest::default())
                .await
                .map(|_| ())
                .map_err(|s| s.to_string())
        })
    })
}

/// A path's call: through kas's public API for `agent`.
pub fn routed(api: ApiClient, agent: i64) -> CallFn {
    spread(api, agent, 1)
}

/// A path's call: through kas's public API for agents `first..first + n`, in turn.
pub fn spread(api: ApiClient, first: i64, n: i64) -> CallFn {
    let next = Arc::new(std::sync::atomic::AtomicI64::new(0));
    Arc::new(move || {
        let agent = first + next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % n.max(1);
        let api = api.clone();
        Box::pin(async move {
            api.pods(agent, None, "")
                .await
                .map(|_| ())
                .map_err(|s| s.to_string())
        })
    })
}

/// One call made by each of `calls` in turn (several client connections, one path).
pub fn in_turn(calls: Vec<CallFn>) -> CallFn {
    if calls.len() == 1 {
        return calls[0].clone();
    }
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    Arc::new(move || {
        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        calls[i % calls.len()]()
    })
}

/// What one (path, concurrency) point measured.
#[derive(Clone, Debug)]
pub struct Point {
    pub latencies: Latencies,
    pub per_second: f64,
    pub errors: usize,
    /// The first error's message, if any.
    pub first_error: Option<String>,
    /// CPU time per call of the kas processes, and of this one (the client and the
    /// agents), over the measured window.
    pub cpu_per_call: Option<(Duration, Duration)>,
}

/// Runs `call` from `concurrency` workers for `warmup`, then measures for `length`, with
/// the CPU time of the kas processes `kas` and of this process.
pub async fn measure(
    call: CallFn,
    concurrency: usize,
    warmup: Duration,
    length: Duration,
    kas: &[u32],
) -> Point {
    run(call.clone(), concurrency, warmup).await;
    let cpu = || Some((cpu_of(kas)?, cpu_time(std::process::id())?));
    let (started, cpu_before) = (Instant::now(), cpu());
    let (latencies, errors, first_error) = run(call, concurrency, length).await;
    let elapsed = started.elapsed().as_secs_f64();
    let calls = u32::try_from(latencies.len()).unwrap_or(u32::MAX).max(1);
    let cpu_per_call = cpu_before
        .zip(cpu())
        .map(|((k0, b0), (k1, b1))| (k1.saturating_sub(k0) / calls, b1.saturating_sub(b0) / calls));
    Point {
        per_second: latencies.len() as f64 / elapsed,
        latencies: Latencies::new(latencies),
        errors,
        first_error,
        cpu_per_call,
    }
}

async fn run(
    call: CallFn,
    concurrency: usize,
    length: Duration,
) -> (Vec<Duration>, usize, Option<String>) {
    let end = Instant::now() + length;
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let call = call.clone();
            tokio::spawn(async move {
                let (mut took, mut errors, mut first) = (Vec::new(), 0, None);
                while Instant::now() < end {
                    let t = Instant::now();
                    match call().await {
                        Ok(()) => took.push(t.elapsed()),
                        Err(e) => {
                            errors += 1;
                            first.get_or_insert(e);
                        }
                    }
                }
                (took, errors, first)
            })
        })
        .collect();
    let (mut all, mut errors, mut first) = (Vec::new(), 0, None);
    for w in workers {
        if let Ok((t, e, f)) = w.await {
            all.extend(t);
            errors += e;
            first = first.or(f);
        }
    }
    (all, errors, first)
}
