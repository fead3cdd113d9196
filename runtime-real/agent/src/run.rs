//! The agent's connections: several at once, to distinct kas (see
//! [`kas_core::kas_links`]), each a `GetConfiguration` stream with its own tunnel pool;
//! redialled with jittered exponential backoff; moved when kas asks; drained on shutdown.

use super::client::{self, AgentClient, TunnelHooks};
use super::modules::Modules;
use futures::FutureExt;
use kas_core::ConnectionId;
use kas_core::backoff::Backoff;
use kas_core::fixed_hash::Map;
use kas_core::kas_links::{KasLinks, Link, LinksConfig, LinksInput, LinksOutput};
use kas_core::rng::Rng;
use kas_core::tunnel_pool::{PoolConfig, PoolInput, PoolOutput, Slot, TunnelPool};
use kas_proto::registry::AgentMeta;
use kas_transport::clock;
use kas_transport::tasks::Tasks;
use kas_transport::tls::{self, KasUrl};

use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tonic::{Code, Status};

/// How long one attempt to connect to kas (TCP, TLS, WebSocket, HTTP/2) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How an agent connects and keeps its tunnels.
#[derive(Clone, Debug)]
pub struct AgentOptions {
    /// kas's agent listener: `host:port`, or a URL (`grpc://`, `grpcs://`, `ws://`,
    /// `wss://`; see [`KasUrl`]). Usually one load balancer in front of every kas; with
    /// several, each dial draws one at random.
    pub kas: Vec<String>,
    /// Distinct kas to hold connections to at once (fewer when fewer are live).
    pub kas_connections: usize,
    /// PEM CA certificates kas's certificate must chain to (the system's roots without).
    pub ca_cert_file: Option<std::path::PathBuf>,
    /// The HTTP proxy kas is reached through, if any.
    pub proxy: Option<kas_transport::proxy::Proxy>,
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
    /// The defaults: connections to 2 kas; 2 idle tunnels each, at most 100, idle ones
    /// closed after 60 s; heartbeat every 10 s; reconnect after 1 s doubling to 60 s,
    /// tunnels retried after 1 s doubling to 30 s (both jittered); 10 s shutdown grace.
    pub fn new(kas: impl Into<String>, token: impl Into<String>, meta: AgentMeta) -> Self {
        AgentOptions {
            kas: vec![kas.into()],
            kas_connections: 2,
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

/// What a connection tells the agent.
enum Event {
    /// It is up at this kas, which counted this many live kas.
    Up { kas: String, live_kas: u32 },
    /// Its kas counted this many live kas since.
    LiveKas(u32),
    /// Its kas asked it to move (`true`: kas is stopping).
    MoveAsked(bool),
    /// It reached a kas that is stopping, which declined it.
    Declined,
    /// It is given up: kas, at this address, went silent on it.
    Silent(String),
}

/// What the agent tells a connection.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Order {
    /// Up, not yet told to serve: no tunnel opened.
    Wait,
    Serve,
    /// Open no more tunnels, let running calls finish (within `shutdown_grace`), close.
    Drain,
    /// Close now.
    Close,
}

/// Resolves once `shutdown` turns true (or its sender is gone).
async fn stopping(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

/// Holds connections to several kas until `shutdown` turns true; then lets running calls
/// finish (within `shutdown_grace`) and closes everything.
pub async fn run(options: AgentOptions, modules: Arc<Modules>, shutdown: watch::Receiver<bool>) {
    let reports = Reports {
        serving: watch::channel(Vec::new()).0,
        silent: mpsc::unbounded_channel().0,
    };
    run_reporting(options, modules, shutdown, reports).await;
}

/// What [`run_reporting`] tells of a replica's links as they change.
pub struct Reports {
    /// Kept set to the ids of the kas whose connections are up, counted or moving
    /// ([`KasLinks::reachable_kas`]): where this replica can be reached.
    pub serving: watch::Sender<Vec<String>>,
    /// The address dialled, each time a link is given up because kas went silent on it.
    pub silent: mpsc::UnboundedSender<String>,
}

/// [`run`], telling `reports` what happens to the links.
pub async fn run_reporting(
    options: AgentOptions,
    modules: Arc<Modules>,
    mut shutdown: watch::Receiver<bool>,
    reports: Reports,
) {
    let mut rng = Rng::new(options.seed);
    // Positive: kas refuses negative ids, and 0 asks kas to draw one.
    let replica = ConnectionId((rng.next_u64() >> 1) as i64 | 1);
    // Binds the id to this replica on each kas (kas/replicas.rs): never sent elsewhere.
    // Drawn from a stream of its own, so that the draws after it do not move.
    let mut proof_rng = Rng::new(!options.seed);
    let proof: Arc<[u8]> = [proof_rng.next_u64(), proof_rng.next_u64()]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect();
    let config = LinksConfig {
        want: options.kas_connections,
        backoff: options.reconnect,
    };
    let mut links = KasLinks::new(config, rng.next_u64());
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let mut orders: Map<Link, watch::Sender<Order>> = Map::default();
    let mut tasks: Tasks<Link> = Tasks::default();
    // The address each connection dialled, and that of the last one to end: the next
    // dial draws among the addresses of neither (a kas held already would be a duplicate;
    // one that died, or whose path half died, is likely to fail again; behind one load
    // balancer there is nothing to choose).
    let mut dialled: Map<Link, usize> = Map::default();
    let mut last_ended: Option<usize> = None;
    let mut stop_asked = false;
    links.handle_timeout(clock::now());
    loop {
        while let Some(out) = links.poll_output() {
            let (link, order) = match out {
                LinksOutput::Dial(link) => {
                    let (order_tx, order) = watch::channel(Order::Wait);
                    orders.insert(link, order_tx);
                    let avoid: Vec<usize> = dialled.values().copied().chain(last_ended).collect();
                    let at = draw_address(&mut rng, options.kas.len(), &avoid);
                    dialled.insert(link, at);
                    let kas = options.kas[at].clone();
                    let connection = Connection {
                        options: options.clone(),
                        kas,
                        modules: modules.clone(),
                        replica,
                        proof: proof.clone(),
                        link,
                        order,
                        events: events_tx.clone(),
                        seed: rng.next_u64(),
                    };
                    let task = std::panic::AssertUnwindSafe(connection.serve()).catch_unwind();
                    tasks.spawn(task.map(move |_| link));
                    continue;
                }
                LinksOutput::Serve(link) => (link, Order::Serve),
                LinksOutput::Drain(link) => (link, Order::Drain),
                LinksOutput::Close(link) => (link, Order::Close),
            };
            if let Some(o) = orders.get(&link) {
                let _ = o.send(order);
            }
        }
        reports.serving.send_if_modified(|kas| {
            let now = links.reachable_kas();
            let changed = *kas != now;
            *kas = now;
            changed
        });
        if links.done() {
            return;
        }
        let wake = links.poll_timeout();
        tokio::select! {
            biased;
            Some((link, event)) = events.recv() => {
                let input = match event {
                    Event::Up { kas, live_kas } => LinksInput::Up { link, kas, live_kas },
                    Event::LiveKas(n) => LinksInput::LiveKas(n),
                    Event::MoveAsked(stopping) => LinksInput::MoveAsked { link, stopping },
                    Event::Declined => LinksInput::Declined(link),
                    Event::Silent(kas) => {
                        let _ = reports.silent.send(kas);
                        continue;
                    }
                };
                links.handle_input(clock::now(), input);
            }
            Some(ended) = tasks.next() => {
                let Ok(link) = ended else {
                    tracing::error!("a connection task was lost");
                    continue;
                };
                orders.remove(&link);
                last_ended = dialled.remove(&link);
                links.handle_input(clock::now(), LinksInput::Ended(link));
            }
            () = tokio::time::sleep(wake.map_or(Duration::ZERO, clock::until)), if wake.is_some() => {
                links.handle_timeout(clock::now());
            }
            () = stopping(&mut shutdown), if !stop_asked => {
                stop_asked = true;
                links.handle_input(clock::now(), LinksInput::Stop);
            }
        }
    }
}

/// One of `n` addresses at random, not one of `avoid` unless every one is.
fn draw_address(rng: &mut Rng, n: usize, avoid: &[usize]) -> usize {
    let others: Vec<usize> = (0..n).filter(|a| !avoid.contains(a)).collect();
    if others.is_empty() {
        return rng.below(n as u64) as usize;
    }
    others[rng.below(others.len() as u64) as usize]
}

/// The pool for a connection to a kas that keeps at most `max_tunnels` open on it (0:
/// it did not say): a pool larger than that would keep dialling tunnels kas refuses, and
/// under load the refusals cost a quarter of the calls' throughput (kas-bench, 1,024 in
/// flight).
fn pool_for(config: PoolConfig, max_tunnels: u32) -> PoolConfig {
    let Ok(kas_max) = usize::try_from(max_tunnels) else {
        return config;
    };
    if kas_max == 0 || kas_max >= config.max {
        return config;
    }
    PoolConfig {
        max: kas_max,
        min_idle: config.min_idle.min(kas_max),
        ..config
    }
}

/// kas refused the connection because it is stopping (its agent API says so).
fn declined(status: &Status) -> bool {
    status.code() == Code::Unavailable && status.message().contains("is shutting down")
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

/// One connection: `GetConfiguration`, then its tunnel pool, until kas ends it or the
/// agent drains or closes it.
struct Connection {
    options: AgentOptions,
    /// The address dialled.
    kas: String,
    modules: Arc<Modules>,
    replica: ConnectionId,
    /// The replica's proof.
    proof: Arc<[u8]>,
    link: Link,
    order: watch::Receiver<Order>,
    events: mpsc::UnboundedSender<(Link, Event)>,
    seed: u64,
}

impl Connection {
    async fn serve(mut self) {
        let options = &self.options;
        let connect = async {
            let url = KasUrl::parse(&self.kas).map_err(Status::invalid_argument)?;
            let ca = options.ca_cert_file.as_deref();
            let channel = tls::connect(&url, ca, options.proxy.as_ref(), CONNECT_TIMEOUT)
                .await
                .map_err(Status::unavailable)?;
            let client =
                AgentClient::new(channel, options.token.clone()).with_proof(self.proof.to_vec());
            // kas shares out what the pool may open among Kubernetes API callers.
            let meta = AgentMeta {
                max_tunnels: u32::try_from(options.pool.max).unwrap_or(u32::MAX),
                ..options.meta.clone()
            };
            // Bounded too: a link dead one way may carry the request and never the answer.
            let first = client.connect(meta, Some(self.replica));
            let (connection, first, config) = tokio::time::timeout(CONNECT_TIMEOUT, first)
                .await
                .map_err(|_| {
                Status::unavailable(format!(
                    "no configuration from kas within {CONNECT_TIMEOUT:?}"
                ))
            })??;
            Ok::<_, Status>((client, connection, first, config))
        };
        let ordered = self.order.clone();
        let (client, connection, first, mut config) = tokio::select! {
            biased;
            r = connect => match r {
                Ok(c) => c,
                Err(status) if declined(&status) => {
                    tracing::info!(kas = %self.kas, "reached a kas that is shutting down; dialling again");
                    let _ = self.events.send((self.link, Event::Declined));
                    return;
                }
                Err(status) => {
                    tracing::warn!(
                        kas = %self.kas,
                        error = %explain(&self.kas, &status),
                        "cannot connect; reconnecting after a backoff"
                    );
                    return;
                }
            },
            () = ordered_away(ordered) => return,
        };
        tracing::info!(kas = %self.kas, kas_id = %first.kas_id, %connection, "connected");
        let max_tunnels = first.max_tunnels;
        let up = Event::Up {
            kas: first.kas_id,
            live_kas: u32::try_from(first.live_kas).unwrap_or(0),
        };
        let _ = self.events.send((self.link, up));
        // Tunnels only once the agent keeps it: a duplicate is closed before any call can
        // be sent down one of its tunnels (closing one with a call in it would cut it).
        match self.order.wait_for(|o| *o != Order::Wait).await {
            Ok(o) if *o == Order::Serve => {}
            _ => return,
        }
        let mut pool = Pool {
            machine: TunnelPool::new(pool_for(options.pool, max_tunnels), Rng::new(self.seed)),
            client,
            connection,
            modules: self.modules.clone(),
            heartbeat: options.heartbeat,
            tunnels: Tasks::default(),
            closers: Map::default(),
            reports: mpsc::unbounded_channel(),
        };
        pool.machine.handle_timeout(clock::now());
        let mut drain_until: Option<tokio::time::Instant> = None;
        // kas sends something at least every `keepalive_millis` (when it says so): three of
        // those in silence mean the link drops what kas sends, tunnels open or not.
        let silence = match first.keepalive_millis {
            0 => None,
            ms => Some(Duration::from_millis(u64::from(ms)) * client::UNANSWERED_HEARTBEATS),
        };
        let mut heard = tokio::time::Instant::now();
        loop {
            pool.act();
            if pool.machine.drained() {
                return;
            }
            let wake = pool.machine.poll_timeout();
            tokio::select! {
                biased;
                msg = config.message() => match msg {
                    Ok(Some(m)) => {
                        heard = tokio::time::Instant::now();
                        if m.drain {
                            tracing::info!(kas = %self.kas, "kas asked this connection to move: connecting elsewhere first");
                            let _ = self.events.send((self.link, Event::MoveAsked(m.stopping)));
                        } else if let Ok(n @ 1..) = u32::try_from(m.live_kas) {
                            let _ = self.events.send((self.link, Event::LiveKas(n)));
                        }
                    }
                    Ok(None) => {
                        tracing::warn!(kas = %self.kas, "kas closed the connection");
                        return;
                    }
                    Err(s) => {
                        tracing::warn!(kas = %self.kas, reason = %s.message(), "kas ended the connection");
                        return;
                    }
                },
                Some(input) = pool.reports.1.recv() => pool.machine.handle_input(clock::now(), input),
                Some(joined) = pool.tunnels.next() => {
                    let Ok((slot, status)) = joined else { continue };
                    if client::kas_silent(&status) {
                        // Every tunnel of the connection is on the same dead link.
                        tracing::warn!(kas = %self.kas, reason = %status.message(), "dropping the connection; dialling again");
                        let _ = self.events.send((self.link, Event::Silent(self.kas.clone())));
                        return;
                    }
                    pool.ended(slot, status);
                }
                () = tokio::time::sleep(wake.map_or(Duration::ZERO, clock::until)), if wake.is_some() => {
                    pool.machine.handle_timeout(clock::now());
                }
                changed = self.order.changed(), if drain_until.is_none() => {
                    let order = *self.order.borrow();
                    if changed.is_err() || order == Order::Close {
                        return;
                    }
                    if order == Order::Drain {
                        let (opening, idle, busy) = pool.machine.counts();
                        tracing::info!(kas = %self.kas, idle, busy, opening, "draining: closing idle tunnels, letting calls finish");
                        drain_until = Some(tokio::time::Instant::now() + options.shutdown_grace);
                        pool.machine.handle_input(clock::now(), PoolInput::Drain);
                    }
                }
                () = tokio::time::sleep_until(heard + silence.unwrap_or_default()), if silence.is_some() => {
                    let silence = silence.unwrap_or_default();
                    tracing::warn!(kas = %self.kas, ?silence, "the link to kas is dead: kas sent nothing on the connection; dialling again");
                    let _ = self.events.send((self.link, Event::Silent(self.kas.clone())));
                    return;
                }
                () = tokio::time::sleep_until(drain_until.unwrap_or_else(tokio::time::Instant::now)), if drain_until.is_some() => {
                    tracing::warn!(grace = ?options.shutdown_grace, "calls still running after the shutdown grace: closing their tunnels");
                    return;
                }
            }
        }
    }
}

/// Resolves once the agent orders the connection to drain or close (or is gone): before
/// it is up, both mean giving up.
async fn ordered_away(mut order: watch::Receiver<Order>) {
    let _ = order
        .wait_for(|o| matches!(o, Order::Drain | Order::Close))
        .await;
}

/// The tunnel pool machine and the tasks it drives.
struct Pool {
    machine: TunnelPool,
    client: AgentClient,
    connection: ConnectionId,
    modules: Arc<Modules>,
    heartbeat: Duration,
    /// Tunnel tasks (madsim has no `JoinSet`); aborted when the pool is dropped.
    tunnels: Tasks<(Slot, Status)>,
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
                    self.tunnels.spawn(async move {
                        let status = client
                            .serve_tunnel(connection, modules, heartbeat, Some(hooks))
                            .await;
                        (slot, status)
                    });
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dial_draws_among_the_addresses_neither_held_nor_ended_last() {
        let mut rng = Rng::new(7);
        let drawn = |rng: &mut Rng, n, avoid: &[usize]| {
            let mut seen = std::collections::BTreeSet::new();
            for _ in 0..200 {
                seen.insert(draw_address(rng, n, avoid));
            }
            seen.into_iter().collect::<Vec<_>>()
        };
        assert_eq!(drawn(&mut rng, 3, &[]), [0, 1, 2]);
        assert_eq!(drawn(&mut rng, 3, &[1]), [0, 2]);
        assert_eq!(drawn(&mut rng, 3, &[2, 0]), [1]);
        assert_eq!(
            drawn(&mut rng, 2, &[0, 1]),
            [0, 1],
            "every one avoided: any"
        );
        assert_eq!(drawn(&mut rng, 1, &[0]), [0], "nothing else to choose");
    }

    #[test]
    fn the_pool_stops_at_the_tunnels_kas_keeps() {
        let ours = AgentOptions::new("k:1", "", AgentMeta::default()).pool;
        assert_eq!(ours.max, 100);
        assert_eq!(pool_for(ours, 0), ours, "kas did not say");
        assert_eq!(
            pool_for(ours, 200),
            ours,
            "kas keeps more than the pool asks"
        );
        let capped = pool_for(ours, 40);
        assert_eq!((capped.max, capped.min_idle), (40, ours.min_idle));
        let tiny = pool_for(ours, 1);
        assert_eq!((tiny.max, tiny.min_idle), (1, 1));
    }
}
