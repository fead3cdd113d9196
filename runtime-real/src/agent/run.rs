//! The agent's connection loop: connect to kas, keep the tunnel pool, reconnect with
//! jittered exponential backoff, and shut down gracefully.

use super::client::{AgentClient, TunnelHooks};
use super::modules::Modules;
use crate::clock;
use crate::tls::{self, KasUrl};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use kas_core::ConnectionId;
use kas_core::backoff::Backoff;
use kas_core::fixed_hash::Map;
use kas_core::rng::Rng;
use kas_core::tunnel_pool::{PoolConfig, PoolInput, PoolOutput, Slot, TunnelPool};
use kas_proto::registry::AgentMeta;

use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tonic::{Code, Status};

/// How long one attempt to connect to kas (TCP, TLS, WebSocket, HTTP/2) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How an agent connects and keeps its tunnels.
#[derive(Clone, Debug)]
pub struct AgentOptions {
    /// kas's agent listener: `host:port`, or a URL (`grpc://`, `grpcs://`, `ws://`,
    /// `wss://`; see [`KasUrl`]).
    pub kas: String,
    /// PEM CA certificates kas's certificate must chain to (the system's roots without).
    pub ca_cert_file: Option<std::path::PathBuf>,
    /// The HTTP proxy kas is reached through, if any.
    pub proxy: Option<crate::proxy::Proxy>,
    /// The agent token.
    pub token: String,
    /// What kas is told about this replica (version, pod namespace and name).
    pub meta: AgentMeta,
    /// The tunnel pool of each connection.
    pub pool: PoolConfig,
    /// Heartbeat period on each tunnel (below kas's `agent.heartbeat_timeout`).
    pub heartbeat: Duration,
    /// Delay between connection attempts.
    pub reconnect: Backoff,
    /// On shutdown, how long running calls may take to finish.
    pub shutdown_grace: Duration,
    /// Seed of the jitter.
    pub seed: u64,
}

impl AgentOptions {
    /// The defaults: 2 idle tunnels, at most 100, idle ones closed after 60 s; heartbeat
    /// every 10 s; reconnect after 1 s doubling to 60 s, tunnels retried after 1 s doubling
    /// to 30 s (both jittered); 10 s shutdown grace.
    pub fn new(kas: impl Into<String>, token: impl Into<String>, meta: AgentMeta) -> Self {
        AgentOptions {
            kas: kas.into(),
            ca_cert_file: None,
            proxy: None,
            token: token.into(),
            meta,
            pool: PoolConfig {
                min_idle: 2,
                max: 100,
                idle_timeout: Duration::from_secs(60),
                retry: Backoff {
                    initial: Duration::from_secs(1),
                    max: Duration::from_secs(30),
                    factor: 2,
                },
            },
            heartbeat: Duration::from_secs(10),
            reconnect: Backoff {
                initial: Duration::from_secs(1),
                max: Duration::from_secs(60),
                factor: 2,
            },
            shutdown_grace: Duration::from_secs(10),
            seed: 0,
        }
    }
}

/// How one connection attempt ended.
enum Served {
    /// It never came up.
    Failed(Status),
    /// It was up, then kas ended it.
    Ended(Status),
    /// `shutdown` fired and the tunnels are closed.
    Shutdown,
}

/// Resolves once `shutdown` turns true (or its sender is gone).
async fn stopping(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

/// Connects, serves, and reconnects with backoff until `shutdown` turns true; then lets
/// running calls finish (within `shutdown_grace`) and closes everything.
pub async fn run(
    options: AgentOptions,
    modules: Arc<Modules>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut rng = Rng::new(options.seed);
    let mut failures = 0u32;
    loop {
        match serve(&options, &modules, &mut shutdown, &mut rng).await {
            Served::Shutdown => return,
            Served::Ended(status) => {
                failures = 0;
                tracing::warn!(kas = %options.kas, reason = %status.message(), "kas ended the connection");
            }
            Served::Failed(status) => {
                tracing::warn!(kas = %options.kas, error = %explain(&options.kas, &status), "cannot connect");
            }
        }
        let delay = options.reconnect.delay(failures, &mut rng);
        failures = failures.saturating_add(1);
        tracing::info!(?delay, attempt = failures, "reconnecting after a backoff");
        tokio::select! {
            biased;
            () = tokio::time::sleep(delay) => {}
            () = stopping(&mut shutdown) => return,
        }
    }
}

/// A connection failure in the operator's terms.
fn explain(kas: &str, status: &Status) -> String {
    match status.code() {
        Code::Unauthenticated | Code::PermissionDenied => format!(
            "kas refused the agent token ({}): check --token-file / AGENTK_TOKEN_FILE",
            status.message()
        ),
        _ => format!("kas at {kas}: {}", status.message()),
    }
}

/// One connection: `GetConfiguration`, then the tunnel pool until kas ends the connection
/// or shutdown has drained the pool.
async fn serve(
    options: &AgentOptions,
    modules: &Arc<Modules>,
    shutdown: &mut watch::Receiver<bool>,
    rng: &mut Rng,
) -> Served {
    let connect = async {
        let url = KasUrl::parse(&options.kas).map_err(Status::invalid_argument)?;
        let ca = options.ca_cert_file.as_deref();
        let channel = tls::connect(&url, ca, options.proxy.as_ref(), CONNECT_TIMEOUT)
            .await
            .map_err(Status::unavailable)?;
        let client = AgentClient::new(channel, options.token.clone());
        let (connection, _, config) = client.connect(options.meta.clone()).await?;
        Ok::<_, Status>((client, connection, config))
    };
    let (client, connection, mut config) = tokio::select! {
        biased;
        r = connect => match r {
            Ok(c) => c,
            Err(s) => return Served::Failed(s),
        },
        () = stopping(shutdown) => return Served::Shutdown,
    };
    tracing::info!(kas = %options.kas, %connection, "connected");
    let mut pool = Pool {
        machine: TunnelPool::new(options.pool, Rng::new(rng.next_u64())),
        client,
        connection,
        modules: modules.clone(),
        heartbeat: options.heartbeat,
        tunnels: FuturesUnordered::new(),
        closers: Map::default(),
        reports: mpsc::unbounded_channel(),
    };
    pool.machine.handle_timeout(clock::now());
    let mut drain_until: Option<tokio::time::Instant> = None;
    loop {
        pool.act();
        if pool.machine.drained() {
            return Served::Shutdown;
        }
        let wake = pool.machine.poll_timeout();
        tokio::select! {
            biased;
            msg = config.message() => match msg {
                Ok(Some(_)) => {}
                Ok(None) => return Served::Ended(Status::unavailable("kas closed the connection")),
                Err(s) => return Served::Ended(s),
            },
            Some(input) = pool.reports.1.recv() => pool.machine.handle_input(clock::now(), input),
            Some(joined) = pool.tunnels.next() => {
                if let Ok((slot, status)) = joined {
                    pool.ended(slot, status);
                }
            }
            () = tokio::time::sleep(wake.map_or(Duration::ZERO, clock::until)), if wake.is_some() => {
                pool.machine.handle_timeout(clock::now());
            }
            () = stopping(shutdown), if drain_until.is_none() => {
                let (opening, idle, busy) = pool.machine.counts();
                tracing::info!(idle, busy, opening, "shutting down: closing idle tunnels, letting calls finish");
                drain_until = Some(tokio::time::Instant::now() + options.shutdown_grace);
                pool.machine.handle_input(clock::now(), PoolInput::Drain);
            }
            () = tokio::time::sleep_until(drain_until.unwrap_or_else(tokio::time::Instant::now)), if drain_until.is_some() => {
                tracing::warn!(grace = ?options.shutdown_grace, "calls still running after the shutdown grace: closing their tunnels");
                return Served::Shutdown;
            }
        }
    }
}

/// The tunnel pool machine and the tasks it drives.
struct Pool {
    machine: TunnelPool,
    client: AgentClient,
    connection: ConnectionId,
    modules: Arc<Modules>,
    heartbeat: Duration,
    /// Tunnel tasks (madsim has no `JoinSet`); aborted when the pool is dropped.
    tunnels: FuturesUnordered<JoinHandle<(Slot, Status)>>,
    closers: Map<Slot, oneshot::Sender<()>>,
    reports: (
        mpsc::UnboundedSender<PoolInput>,
        mpsc::UnboundedReceiver<PoolInput>,
    ),
}

impl Pool {
    /// Carries out the machine's orders.
    fn act(&mut self) {
        while let Some(out) = self.machine.poll_output() {
            match out {
                PoolOutput::Open(slot) => {
                    let (close_tx, close) = oneshot::channel();
                    self.closers.insert(slot, close_tx);
                    let hooks = TunnelHooks {
                        slot,
                        reports: self.reports.0.clone(),
                        close,
                    };
                    let (client, modules) = (self.client.clone(), self.modules.clone());
                    let (connection, heartbeat) = (self.connection, self.heartbeat);
                    self.tunnels.push(tokio::spawn(async move {
                        let status = client
                            .serve_tunnel(connection, modules, heartbeat, Some(hooks))
                            .await;
                        (slot, status)
                    }));
                }
                PoolOutput::Close(slot) => {
                    if let Some(close) = self.closers.remove(&slot) {
                        let _ = close.send(());
                    }
                }
            }
        }
    }

    /// A tunnel task finished: its reports first, then its end.
    fn ended(&mut self, slot: Slot, status: Status) {
        while let Ok(input) = self.reports.1.try_recv() {
            self.machine.handle_input(clock::now(), input);
        }
        self.closers.remove(&slot);
        let failed = status.code() != Code::Ok;
        if failed {
            tracing::debug!(?slot, reason = %status.message(), "tunnel ended");
        }
        self.machine
            .handle_input(clock::now(), PoolInput::Ended { slot, failed });
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        for task in self.tunnels.iter() {
            task.abort();
        }
    }
}
