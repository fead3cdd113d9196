//! Part 8: what traces cost a routed call. The remote route's unary calls (GitLab -> kas B
//! -> kas A -> the agent) on a fresh pair of kas for each of: traces off; every span
//! exported to a live OTLP/HTTP receiver (this process: it takes each export, answers 200
//! and counts them, without decoding); exported to a receiver that is down (a closed
//! port). One run, so the three compare as ratios. The agents run in this process, which
//! exports nothing: the cost measured is kas's.

use super::setup::{KasOptions, World};
use super::stats::ms;
use super::{gitlab, pair, stop, unary, warm_agent};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// What the bench's receiver took.
#[derive(Default)]
struct Taken {
    exports: AtomicU64,
    bytes: AtomicU64,
}

/// A receiver on loopback that takes every export.
async fn receiver(taken: Arc<Taken>) -> Result<SocketAddr, String> {
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: axum::body::Bytes| {
            let taken = taken.clone();
            async move {
                taken.exports.fetch_add(1, Ordering::Relaxed);
                taken.bytes.fetch_add(body.len() as u64, Ordering::Relaxed);
                (
                    [("content-type", "application/x-protobuf")],
                    Vec::<u8>::new(),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| format!("the OTLP receiver: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(addr)
}

/// A loopback port nothing listens on.
fn closed_port() -> Result<SocketAddr, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    l.local_addr().map_err(|e| e.to_string())
}

/// `kas_traces_dropped_total` of a kas's metrics text.
fn dropped(metrics: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("kas_traces_dropped_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// The part: each mode at `concurrency` calls in flight, for `point` after a third of it.
pub async fn part(
    world: &mut World,
    base: KasOptions,
    concurrency: usize,
    point: Duration,
) -> Result<Value, String> {
    let taken = Arc::new(Taken::default());
    let live = receiver(taken.clone()).await?;
    let down = closed_port()?;
    println!("\n## Traces: the remote route's unary calls, {concurrency} in flight\n");
    println!(
        "| traces | p50 ms | p99 ms | calls/s | p50 / off | calls/s / off | kas CPU µs per call | exports received | spans dropped | errors |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    let mut off: Option<unary::Point> = None;
    for (mode, receiver) in [
        ("off", None),
        ("on, live receiver", Some(live)),
        ("on, receiver down", Some(down)),
    ] {
        let options = KasOptions {
            tracing: receiver,
            ..base
        };
        let (a, b) = pair(world, options).await?;
        let agents = vec![warm_agent(world, &a, 1, false).await?];
        let gitlab_b = gitlab(world, &b, false).await?;
        let before = taken.exports.load(Ordering::Relaxed);
        let pids: Vec<u32> = [&a, &b].into_iter().filter_map(|k| k.pid()).collect();
        let call = unary::routed(gitlab_b, 1);
        let p = unary::measure(call, concurrency, point / 3, point, &pids).await;
        // Spans still queued go out within a second.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let mut lost = 0;
        for k in [&a, &b] {
            lost += dropped(&k.metrics().await.unwrap_or_default());
        }
        let exports = taken.exports.load(Ordering::Relaxed) - before;
        let o = off.get_or_insert_with(|| p.clone());
        let p50 = p.latencies.quantile(0.5);
        let ratio = p50.as_secs_f64() / o.latencies.quantile(0.5).as_secs_f64().max(1e-9);
        let tput = p.per_second / o.per_second.max(1e-9);
        let kas_cpu = p.cpu_per_call.map(|(k, _)| k.as_secs_f64() * 1e6);
        println!(
            "| {mode} | {:.3} | {:.3} | {:.0} | {ratio:.2} | {:.0}% | {} | {exports} | {lost} | {} |",
            ms(p50),
            ms(p.latencies.quantile(0.99)),
            p.per_second,
            tput * 100.0,
            kas_cpu.map_or("?".into(), |c| format!("{c:.1}")),
            p.errors
        );
        rows.push(json!({
            "traces": mode, "concurrency": concurrency,
            "p50_ms": ms(p50), "p99_ms": ms(p.latencies.quantile(0.99)),
            "calls_per_s": p.per_second, "p50_ratio_to_off": ratio, "throughput_ratio_to_off": tput,
            "kas_cpu_us_per_call": kas_cpu, "exports_received": exports, "spans_dropped": lost,
            "calls": p.latencies.len(), "errors": p.errors, "first_error": p.first_error,
        }));
        stop(agents).await;
    }
    Ok(json!({
        "receiver_bytes": taken.bytes.load(Ordering::Relaxed),
        "points": rows,
    }))
}
