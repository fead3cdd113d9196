//! Deadlines at saturation: calls for an agent no kas holds, with a short timeout, made
//! while the remote route runs at concurrency 64. How late kas fails them past its
//! deadline shows whether its engine lets timers starve under load (it serves due timers
//! before anything else).

use crate::stats::{Latencies, ms};
use crate::unary::{self, CallFn};
use kas_client::api_client::ApiClient;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// The probes' timeout; kas's deadline is a tenth earlier.
const TIMEOUT: Duration = Duration::from_millis(200);
/// An agent id no kas holds.
const ABSENT: i64 = 999_999_999;
/// Probes in flight at once.
const PROBES: usize = 8;

/// Probes idle, then at saturation; prints a table, returns the results.
pub async fn part(load: CallFn, api: ApiClient, length: Duration) -> Value {
    println!("\n## Deadlines at saturation (calls for an absent agent, {TIMEOUT:?} timeout)\n");
    println!("| load | probes | wrong outcomes | late p50 ms | late p99 ms | late max ms |");
    println!("|---|---|---|---|---|---|");
    let idle = probe(api.clone(), length).await;
    let (saturated, point) = tokio::join!(
        probe(api, length),
        unary::measure(load, 64, Duration::ZERO, length, &[])
    );
    let mut rows = Vec::new();
    for (name, (late, wrong)) in [
        ("idle", idle),
        ("remote route at concurrency 64", saturated),
    ] {
        let (p50, p99, max) = (late.quantile(0.5), late.quantile(0.99), late.quantile(1.0));
        println!(
            "| {name} | {} | {wrong} | {:.2} | {:.2} | {:.2} |",
            late.len(),
            ms(p50),
            ms(p99),
            ms(max)
        );
        rows.push(
            json!({"load": name, "probes": late.len(), "wrong_outcomes": wrong,
            "late_p50_ms": ms(p50), "late_p99_ms": ms(p99), "late_max_ms": ms(max)}),
        );
    }
    println!(
        "\n(the load meanwhile: {:.0} calls/s, {} errors)",
        point.per_second, point.errors
    );
    Value::Array(rows)
}

/// Probes for `length`: how long past kas's deadline each failed, and how many ended
/// other than "not connected".
async fn probe(api: ApiClient, length: Duration) -> (Latencies, usize) {
    let api = api.with_timeout(TIMEOUT);
    let deadline = TIMEOUT - TIMEOUT / 10;
    let end = Instant::now() + length;
    let workers: Vec<_> = (0..PROBES)
        .map(|_| {
            let api = api.clone();
            tokio::spawn(async move {
                let (mut late, mut wrong) = (Vec::new(), 0);
                while Instant::now() < end {
                    let t = Instant::now();
                    match api.pods(ABSENT, None, "").await {
                        Err(s) if s.message().contains("is not connected") => {
                            late.push(t.elapsed().saturating_sub(deadline));
                        }
                        _ => wrong += 1,
                    }
                }
                (late, wrong)
            })
        })
        .collect();
    let (mut all, mut wrong) = (Vec::new(), 0);
    for w in workers {
        if let Ok((l, n)) = w.await {
            all.extend(l);
            wrong += n;
        }
    }
    (Latencies::new(all), wrong)
}
