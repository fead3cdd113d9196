//! Many agents on one kas: its resident memory per connected agent and per idle tunnel,
//! and Redis's work (`INFO commandstats`) per agent and per waiting call.

use crate::setup::token;
use kas_agent::{AgentClient, Modules};
use kas_client::api_client::ApiClient;
use kas_proto::registry::AgentMeta;
use kas_server::kas::observability;
use kas_tools::local::kas_process::KasProcess;
use kas_tools::local::redis_server::RedisServer;
use kas_transport::tls::{self, KasUrl};
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

/// Commands kas runs only inside its scripts (the batch write, the GC's deletes). Not
/// `HGETALL`: lookups and the read of the live kas send it, and the GC, which runs it in
/// its script, collects a key only a ttl after it is new or after a kas went.
pub const IN_SCRIPTS: [&str; 5] = ["hset", "hdel", "hget", "pexpire", "publish"];

/// Successful calls, and the CPU time spent, per command (`INFO commandstats`).
#[derive(Clone, Debug, Default)]
pub struct Commands {
    /// Successful calls.
    pub calls: BTreeMap<String, u64>,
    /// Microseconds of Redis's CPU: a script's (`evalsha`) include its commands', which
    /// are counted again under their own names.
    pub usec: BTreeMap<String, u64>,
}

impl Commands {
    /// Reads them now, summed over `nodes` (a cluster's, or one server).
    pub fn read(nodes: &[&RedisServer]) -> Commands {
        let mut out = Commands::default();
        let stats: Vec<String> = nodes
            .iter()
            .map(|n| n.cli(&["INFO", "commandstats"]))
            .collect();
        for line in stats.iter().flat_map(|s| s.lines()) {
            let Some((name, rest)) = line
                .strip_prefix("cmdstat_")
                .and_then(|l| l.split_once(':'))
            else {
                continue;
            };
            let field = |key: &str| -> u64 {
                rest.split(',')
                    .find_map(|kv| kv.strip_prefix(key))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0)
            };
            let calls = field("calls=") - field("failed_calls=");
            *out.calls.entry(name.to_string()).or_default() += calls;
            *out.usec.entry(name.to_string()).or_default() += field("usec=");
        }
        out
    }

    /// What ran between `earlier` and `self`.
    pub fn since(&self, earlier: &Commands) -> Commands {
        let minus = |now: &BTreeMap<String, u64>, then: &BTreeMap<String, u64>| {
            now.iter()
                .map(|(k, v)| (k.clone(), v - then.get(k).copied().unwrap_or(0)))
                .filter(|(_, v)| *v > 0)
                .collect()
        };
        Commands {
            calls: minus(&self.calls, &earlier.calls),
            usec: minus(&self.usec, &earlier.usec),
        }
    }

    /// Commands clients sent: all but those of `in_scripts`.
    pub fn sent(&self, in_scripts: &[&str]) -> u64 {
        self.calls
            .iter()
            .filter(|(k, _)| !in_scripts.contains(&k.as_str()))
            .map(|(_, v)| v)
            .sum()
    }

    /// Redis's CPU microseconds for the commands clients sent (those of `in_scripts` are
    /// in their scripts' time), but for `INFO`, which only the benchmark sends.
    pub fn sent_usec(&self, in_scripts: &[&str]) -> u64 {
        self.usec
            .iter()
            .filter(|(k, _)| !in_scripts.contains(&k.as_str()) && k.as_str() != "info")
            .map(|(_, v)| v)
            .sum()
    }

    /// Every command Redis ran, inside scripts too.
    pub fn all(&self) -> u64 {
        self.calls.values().sum()
    }
}

/// Agents connected to one kas, each on its own connection, holding `GetConfiguration`
/// open and, once [`Fleet::open_tunnels`] ran, one idle tunnel.
pub struct Fleet {
    agents: Vec<(AgentClient, kas_core::ConnectionId)>,
    tasks: Vec<JoinHandle<()>>,
}

/// The loopback addresses `n` agents connect from, `per_source` at most on each (127.0.0.1,
/// 127.0.0.2, ..., up to 254 of them): each has its own range of ephemeral ports.
pub fn sources(n: i64, per_source: i64) -> Vec<IpAddr> {
    let per = per_source.max(1);
    let k = (n.max(1) + per - 1) / per;
    (1..=u8::try_from(k).unwrap_or(u8::MAX).min(254))
        .map(|last| IpAddr::V4(Ipv4Addr::new(127, 0, 0, last)))
        .collect()
}

impl Fleet {
    /// Connects agents `1..=n` to `kas`, 256 at a time, from the addresses of `sources` in
    /// turn; over TLS trusting `tls_ca` when given.
    pub async fn connect(
        kas: &KasProcess,
        n: i64,
        sources: &[IpAddr],
        tls_ca: Option<&Path>,
    ) -> Result<Fleet, String> {
        let gate = Arc::new(Semaphore::new(256));
        let scheme = if tls_ca.is_some() { "grpcs" } else { "grpc" };
        let url = KasUrl::parse(&format!("{scheme}://{}", kas.addresses.agent))?;
        let ca = tls_ca.map(Path::to_path_buf);
        let joins: Vec<_> = (1..=n)
            .map(|agent| {
                let (gate, url, ca) = (gate.clone(), url.clone(), ca.clone());
                let source = sources[(agent as usize - 1) % sources.len()];
                tokio::spawn(async move {
                    let _permit = gate.acquire_owned().await;
                    let timeout = Duration::from_secs(20);
                    let channel = tls::connect_from(&url, ca.as_deref(), source, timeout)
                        .await
                        .map_err(|e| format!("agent {agent} from {source}: {e}"))?;
                    let client = AgentClient::new(channel, token(agent));
                    let meta = AgentMeta {
                        version: "bench".into(),
                        pod_name: format!("idle-{agent}"),
                        ..Default::default()
                    };
                    let (connection, _, mut stream) = client
                        .connect(meta, None)
                        .await
                        .map_err(|s| format!("agent {agent}: {s}"))?;
                    let hold =
                        tokio::spawn(
                            async move { while let Ok(Some(_)) = stream.message().await {} },
                        );
                    Ok::<_, String>((client, connection, hold))
                })
            })
            .collect();
        let mut fleet = Fleet {
            agents: Vec::new(),
            tasks: Vec::new(),
        };
        for j in joins {
            let (client, connection, hold) = j.await.map_err(|e| e.to_string())??;
            fleet.agents.push((client, connection));
            fleet.tasks.push(hold);
        }
        Ok(fleet)
    }

    /// Opens one tunnel per agent (heartbeat every 20 s), serving `modules`.
    pub fn open_tunnels(&mut self, modules: Arc<Modules>) {
        for (client, connection) in &self.agents {
            let (client, connection, modules) = (client.clone(), *connection, modules.clone());
            self.tasks.push(tokio::spawn(async move {
                client
                    .serve_tunnel(connection, modules, Duration::from_secs(20), None)
                    .await;
            }));
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The value of an unlabelled gauge in `kas`'s metrics.
pub async fn gauge(kas: &KasProcess, name: &str) -> Option<f64> {
    observability::gauge(&kas.metrics().await?, name)
}

/// Waits (up to `within`) until `kas` reports `name` = `value`.
pub async fn await_gauge(
    kas: &KasProcess,
    name: &str,
    value: f64,
    within: Duration,
) -> Result<(), String> {
    let end = tokio::time::Instant::now() + within;
    loop {
        let now = gauge(kas, name).await;
        if now == Some(value) {
            return Ok(());
        }
        if tokio::time::Instant::now() > end {
            return Err(format!("{name} is {now:?}, not {value}, after {within:?}"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Redis commands while `calls` calls for agents that never connect wait on `kas` for
/// `window` (counted from 3 s after they started, once each has looked up).
pub async fn waiting_calls(
    redis: &RedisServer,
    gitlab: &ApiClient,
    kas: &KasProcess,
    calls: i64,
    window: Duration,
) -> Result<Commands, String> {
    let api = gitlab.with_timeout(window + Duration::from_secs(10));
    let running: Vec<_> = (0..calls)
        .map(|i| {
            let api = api.clone();
            tokio::spawn(async move { api.pods(5_000_000 + i, None, "").await })
        })
        .collect();
    let waiting = u32::try_from(calls).map_err(|e| e.to_string())?;
    await_gauge(
        kas,
        "kas_routing_calls",
        f64::from(waiting),
        Duration::from_secs(10),
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = Commands::read(&[redis]);
    tokio::time::sleep(window).await;
    let during = Commands::read(&[redis]).since(&before);
    for r in running {
        r.abort();
    }
    await_gauge(kas, "kas_routing_calls", 0.0, Duration::from_secs(10)).await?;
    Ok(during)
}
