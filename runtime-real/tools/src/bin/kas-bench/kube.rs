//! Part 5: the Kubernetes API through kas, against a local API server (kas-local's): `GET
//! /api/v1/pods` latency and a long stream's throughput through the local and the remote
//! route, each as a ratio to the API server dialled directly, and kas memory per open
//! watch on both kas of the remote route (a pair of its own).

use crate::setup::{self, KasOptions, USER_TOKEN, World};
use crate::stats::{Latencies, ms};
use crate::unary::CallFn;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use kas_agent::kubernetes_api::Upstream;
use kas_agent::pods::FixturePodLog;
use kas_tools::local::kas_process::KasProcess;
use kas_tools::local::kube_server::KubeServer;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

/// What the part measures with.
pub struct Sizes {
    /// How long each latency point runs (after a third of it as warm-up).
    pub point: Duration,
    /// Bytes of the long stream.
    pub stream_bytes: u64,
    /// Timed reads of it per path (the median counts).
    pub stream_reads: usize,
    /// Watches held open at once.
    pub watches: usize,
}

/// One path to the API server: its base URL and the bearer it presents.
#[derive(Clone)]
pub struct Path {
    name: &'static str,
    base: String,
    bearer: Option<String>,
}

fn client(http2: bool) -> HttpClient {
    Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(http2)
        .build_http()
}

impl Path {
    fn request(&self, path_and_query: &str) -> http::Request<Empty<Bytes>> {
        let mut r = http::Request::get(format!("{}{path_and_query}", self.base));
        if let Some(b) = &self.bearer {
            r = r.header(http::header::AUTHORIZATION, format!("Bearer {b}"));
        }
        r.body(Empty::new()).expect("a valid request")
    }

    /// Sends a `GET`; its response's body, or what the refusal said.
    async fn open(
        &self,
        client: &HttpClient,
        path_and_query: &str,
    ) -> Result<hyper::body::Incoming, String> {
        let resp = client
            .request(self.request(path_and_query))
            .await
            .map_err(|e| format!("{} {path_and_query}: {e}", self.name))?;
        let status = resp.status();
        let body = resp.into_body();
        if !status.is_success() {
            let why = body
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let why = String::from_utf8_lossy(&why);
            return Err(format!(
                "{} {path_and_query}: HTTP {status}: {why}",
                self.name
            ));
        }
        Ok(body)
    }

    /// One whole `GET`, body read; its byte count.
    async fn get(&self, client: &HttpClient, path_and_query: &str) -> Result<u64, String> {
        let mut body = self.open(client, path_and_query).await?;
        let mut n = 0u64;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| format!("{}: the body broke: {e}", self.name))?;
            n += frame.data_ref().map_or(0, |d| d.len() as u64);
        }
        Ok(n)
    }
}

/// Runs the part: latency and the long stream on a fresh pair of kas with the Kubernetes
/// API listener, then memory per watch on another pair (the first's RSS keeps the long
/// stream's freed pages, which would hide what the watches take).
pub async fn part(world: &mut World, options: KasOptions, sizes: &Sizes) -> Result<Value, String> {
    let options = KasOptions {
        kubernetes_api: true,
        ..options
    };
    let server = api_server().await?;
    // One caller token holds every watch: kas lets one caller hold three quarters of
    // what the agent's pool may open.
    let max_tunnels = sizes.watches * 4 / 3 + 64;
    let mut results = json!({});
    let routes = Routes::start(world, options, &server, max_tunnels).await?;
    results["get_pods"] = latency(&routes.paths, sizes.point).await?;
    results["stream"] = throughput(&routes.paths, sizes).await?;
    routes.stop().await;
    let routes = Routes::start(world, options, &server, max_tunnels).await?;
    let (serving, routing) = (&routes.kas[0], &routes.kas[1]);
    results["watch_memory"] =
        watch_memory(&routes.paths[2], serving, routing, sizes.watches).await?;
    routes.stop().await;
    Ok(results)
}

/// A pair of kas, agent 1 on the first with the API server behind it, and the three paths:
/// direct, the local route (the first kas), the remote route (the second).
struct Routes {
    kas: [KasProcess; 2],
    paths: [Path; 3],
    agent: crate::RunningAgent,
}

/// The bench's API server (kas-local's), serving the bench's pods.
pub async fn api_server() -> Result<KubeServer, String> {
    let pods: Vec<FixturePodLog> = setup::pods()
        .pods
        .into_iter()
        .map(|pod| FixturePodLog {
            pod,
            log: Arc::from(&b""[..]),
        })
        .collect();
    KubeServer::start(&pods)
        .await
        .map_err(|e| format!("the local API server: {e}"))
}

/// `server`, as an agent's Kubernetes API module reaches it.
pub fn upstream(server: &KubeServer) -> Result<Upstream, String> {
    let url = server.url().parse().map_err(|e| format!("{e}"))?;
    Upstream::new(kube::Config::new(url))
}

/// The path to agent 1's API server through `kas`'s Kubernetes API listener.
pub fn route(name: &'static str, kas: &KasProcess) -> Path {
    let addr = kas
        .addresses
        .kubernetes_api
        .expect("a Kubernetes API listener");
    Path {
        name,
        base: format!("http://{addr}"),
        bearer: Some(format!("pat:1:{USER_TOKEN}")),
    }
}

/// A call that `GET`s `path_and_query` on `path` (HTTP/1.1, connections kept) and reads
/// the body whole.
pub fn getter(path: Path, path_and_query: &'static str) -> CallFn {
    let client = client(false);
    Arc::new(move || {
        let (client, path) = (client.clone(), path.clone());
        Box::pin(async move { path.get(&client, path_and_query).await.map(|_| ()) })
    })
}

impl Routes {
    async fn start(
        world: &mut World,
        options: KasOptions,
        server: &KubeServer,
        max_tunnels: usize,
    ) -> Result<Routes, String> {
        let (a, b) = (world.kas(options).await?, world.kas(options).await?);
        let modules = kas_agent::Modules::default().with_kubernetes_api(upstream(server)?);
        let agent = crate::agent_with(world, &a, 1, false, Arc::new(modules), max_tunnels).await?;
        let paths = [
            Path {
                name: "direct",
                base: server.url(),
                bearer: None,
            },
            route("local route", &a),
            route("remote route", &b),
        ];
        Ok(Routes {
            kas: [a, b],
            paths,
            agent,
        })
    }

    /// Stops the agent (the kas go when dropped).
    async fn stop(self) {
        let (stop, task) = self.agent;
        let _ = stop.send(true);
        let _ = tokio::time::timeout(Duration::from_secs(15), task).await;
    }
}

/// `GET /api/v1/pods` at concurrency 1 and 16 on each path.
async fn latency(paths: &[Path], point: Duration) -> Result<Value, String> {
    println!("\n## Kubernetes API: GET /api/v1/pods (10 pods as JSON, HTTP/1.1)\n");
    println!(
        "| path | concurrency | p50 ms | p99 ms | requests/s | p50 / direct | requests/s / direct |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for concurrency in [1usize, 16] {
        let mut base = None;
        for path in paths {
            let client = client(false);
            let run = |until: Instant| {
                let (client, path) = (client.clone(), path.clone());
                async move {
                    let workers = (0..concurrency).map(|_| {
                        let (client, path) = (client.clone(), path.clone());
                        tokio::spawn(async move {
                            let mut seen = Vec::new();
                            while Instant::now() < until {
                                let t = Instant::now();
                                path.get(&client, "/api/v1/pods").await?;
                                seen.push(t.elapsed());
                            }
                            Ok::<_, String>(seen)
                        })
                    });
                    let mut all = Vec::new();
                    for w in futures::future::join_all(workers).await {
                        all.extend(w.map_err(|e| e.to_string())??);
                    }
                    Ok::<_, String>(all)
                }
            };
            run(Instant::now() + point / 3).await?;
            let started = Instant::now();
            let samples = run(started + point).await?;
            let per_second = samples.len() as f64 / started.elapsed().as_secs_f64();
            let latencies = Latencies::new(samples);
            let p50 = latencies.quantile(0.5);
            let (b50, bps) = *base.get_or_insert((p50, per_second));
            let ratio = p50.as_secs_f64() / b50.as_secs_f64().max(1e-9);
            println!(
                "| {} | {concurrency} | {:.3} | {:.3} | {per_second:.0} | {ratio:.2} | {:.0}% |",
                path.name,
                ms(p50),
                ms(latencies.quantile(0.99)),
                per_second / bps * 100.0
            );
            rows.push(json!({
                "path": path.name, "concurrency": concurrency, "p50_ms": ms(p50),
                "p99_ms": ms(latencies.quantile(0.99)), "requests_per_s": per_second,
                "p50_ratio_to_direct": ratio, "throughput_ratio_to_direct": per_second / bps,
            }));
        }
    }
    Ok(Value::Array(rows))
}

/// The long stream read whole on each path.
async fn throughput(paths: &[Path], sizes: &Sizes) -> Result<Value, String> {
    let n = sizes.stream_bytes;
    println!(
        "\n## Kubernetes API: a {} MiB response body streamed (median of {} reads)\n",
        n >> 20,
        sizes.stream_reads
    );
    println!("| path | MB/s | MB/s / direct |");
    println!("|---|---|---|");
    let mut rows = Vec::new();
    let mut direct = None;
    for path in paths {
        let client = client(false);
        let mut rates = Vec::new();
        for read in 0..=sizes.stream_reads.max(1) {
            let t = Instant::now();
            let got = path
                .get(&client, &format!("/kas-local/bytes?n={n}"))
                .await?;
            if got != n {
                return Err(format!("{}: read {got} of {n} bytes", path.name));
            }
            if read > 0 {
                rates.push(n as f64 / 1e6 / t.elapsed().as_secs_f64());
            }
        }
        rates.sort_by(f64::total_cmp);
        let rate = rates[rates.len() / 2];
        let ratio = rate / *direct.get_or_insert(rate);
        println!("| {} | {rate:.0} | {:.0}% |", path.name, ratio * 100.0);
        rows.push(
            json!({"path": path.name, "bytes": n, "mb_per_s": rate, "ratio_to_direct": ratio}),
        );
    }
    Ok(Value::Array(rows))
}

/// Resident memory of both kas before and with `watches` watches open through `remote`
/// (HTTP/2, 100 per connection), each idle after its first event.
async fn watch_memory(
    remote: &Path,
    serving: &KasProcess,
    routing: &KasProcess,
    watches: usize,
) -> Result<Value, String> {
    let rss = |k: &KasProcess| k.resident_bytes().unwrap_or(0);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = (rss(serving), rss(routing));
    let mut open = Vec::new();
    for chunk in 0..watches.div_ceil(100) {
        let client = client(true);
        for _ in 0..100.min(watches - chunk * 100) {
            let mut body = remote.open(&client, "/api/v1/pods?watch=true").await?;
            // Its first event: the watch is through.
            match body.frame().await {
                Some(Ok(_)) => open.push(body),
                other => return Err(format!("watch ended at once: {other:?}")),
            }
        }
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let with = (rss(serving), rss(routing));
    let per = |after: u64, before: u64| after.saturating_sub(before) / watches.max(1) as u64;
    let (serving_per, routing_per) = (per(with.0, before.0), per(with.1, before.1));
    println!(
        "\n## Kubernetes API: kas memory per open watch ({watches} idle watches, remote route, HTTP/2)\n"
    );
    println!("| kas | RSS before MiB | RSS with watches MiB | KiB per watch |");
    println!("|---|---|---|---|");
    for (name, b, w, p) in [
        ("serving (holds the tunnels)", before.0, with.0, serving_per),
        ("routing (forwards)", before.1, with.1, routing_per),
    ] {
        println!(
            "| {name} | {:.1} | {:.1} | {:.1} |",
            b as f64 / 1048576.0,
            w as f64 / 1048576.0,
            p as f64 / 1024.0
        );
    }
    drop(open);
    Ok(json!({
        "watches": watches,
        "serving_bytes_per_watch": serving_per,
        "routing_bytes_per_watch": routing_per,
    }))
}
