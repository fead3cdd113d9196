//! How the production Redis store reaches the simulated Redis node: each command's bytes,
//! as redis-rs packed them, go over `madsim::net` on a connection of their own, and the
//! node's RESP answer comes back to redis-rs's parser. Subscriber connections speak RESP
//! too (`SUBSCRIBE`, or a cluster's `SSUBSCRIBE`), under the store's own pub-sub loop. The faults of a client's side (a failed or
//! slow command, pub-sub messages broken off, duplicated, late or reordered) are injected
//! here.

use crate::planted_bug::{Bug, planted};
use crate::redis::RedisKnobs;
use futures::future::BoxFuture;
use kas_server::buggify::{self, Point};
use kas_server::store::pubsub::Pushed;
use kas_server::store::{Dial, NodeConn, NodeConnection, NodeSubscriber, StoreError};
use redis::{Cmd, RedisError, RedisFuture, Value};
use std::collections::{BTreeSet, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{Endpoint, Receiver, Sender};
use tokio::time::Instant;

/// Dials the simulated Redis node; each command times out after `timeout`.
#[derive(Clone, Debug)]
pub struct SimDial {
    /// `redis.timeout`.
    pub timeout: Duration,
    /// The client's address and the faults on its path to Redis.
    pub path: Path,
}

/// One client's path to the simulated Redis nodes.
#[derive(Clone, Debug)]
pub struct Path {
    /// The client's address.
    pub client: IpAddr,
    /// Whether the path is cut off now.
    pub knobs: Arc<RedisKnobs>,
}

/// How often a connection attempt across a cut-off path is tried again (TCP retries its
/// SYN after 1 s, then 2, 4...; the caller's timeout ends it first in the simulation).
const SYN_RETRY: Duration = Duration::from_millis(250);

fn err(e: impl std::fmt::Display) -> StoreError {
    StoreError(format!("simulated redis: {e}"))
}

/// A lost connection, as redis-rs reports one.
fn broken(what: &str) -> RedisError {
    std::io::Error::new(std::io::ErrorKind::ConnectionReset, what.to_string()).into()
}

fn address(address: &str) -> Result<SocketAddr, StoreError> {
    address
        .parse()
        .map_err(|e| err(format!("address {address:?}: {e}")))
}

/// Opens a connection to the server; across a cut-off path it hangs until the path heals
/// (or the caller gives up), as a real connection attempt into a black hole does.
async fn connect(server: SocketAddr, path: &Path) -> std::io::Result<(Sender, Receiver)> {
    let endpoint = Endpoint::bind("0.0.0.0:0").await?;
    loop {
        match endpoint.connect1(server).await {
            Err(e)
                if e.kind() == std::io::ErrorKind::ConnectionRefused
                    && path.knobs.is_cut_off(path.client) =>
            {
                tokio::time::sleep(SYN_RETRY).await;
            }
            connected => return connected,
        }
    }
}

/// The next answer or push, parsed as redis-rs parses what a server writes.
async fn receive(rx: &mut Receiver) -> Result<Value, RedisError> {
    let payload = rx.recv().await?;
    let bytes = payload
        .downcast::<Vec<u8>>()
        .map_err(|_| broken("unexpected payload"))?;
    redis::parse_redis_value(&bytes)
}

impl Dial for SimDial {
    fn connect(&self, address: &str) -> Result<NodeConn, StoreError> {
        let server = self::address(address)?;
        Ok(NodeConn(Arc::new(SimConnection {
            server,
            timeout: self.timeout,
            path: self.path.clone(),
        })))
    }

    fn subscriber(
        &self,
        address: String,
        sharded: bool,
    ) -> BoxFuture<'static, Result<Box<dyn NodeSubscriber>, StoreError>> {
        let path = self.path.clone();
        Box::pin(async move {
            let (tx, rx) = connect(self::address(&address)?, &path)
                .await
                .map_err(err)?;
            Ok(Box::new(SimSubscriber {
                tx,
                rx,
                sharded,
                leaving: BTreeSet::new(),
                queued: VecDeque::new(),
                behind: None,
                late: None,
            }) as Box<dyn NodeSubscriber>)
        })
    }
}

/// A command connection to the node.
struct SimConnection {
    server: SocketAddr,
    timeout: Duration,
    path: Path,
}

impl NodeConnection for SimConnection {
    fn query<'a>(&'a self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        self.exchange(cmd, false)
    }

    fn query_asking<'a>(&'a self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        self.exchange(cmd, true)
    }
}

impl SimConnection {
    /// Sends `cmd` (after `ASKING`, when `asking`) on a connection of its own.
    fn exchange<'a>(&'a self, cmd: &'a Cmd, asking: bool) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            if buggify::fires(Point::RedisFailure) {
                return Err(broken("failed (buggify)"));
            }
            let exchange = async {
                buggify::pause(Point::RedisLatency).await;
                let (tx, mut rx) = connect(self.server, &self.path).await?;
                if asking {
                    tx.send(Box::new(redis::cmd("ASKING").get_packed_command()))
                        .await?;
                    receive(&mut rx).await?.extract_error()?;
                }
                tx.send(Box::new(cmd.get_packed_command())).await?;
                let reply = receive(&mut rx).await?;
                // Applied, and answered late: whoever waits on it acts on a past store.
                buggify::pause(Point::RedisLatency).await;
                reply.extract_error()
            };
            tokio::time::timeout(self.timeout, exchange)
                .await
                .map_err(|_| -> RedisError {
                    std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out").into()
                })?
        })
    }
}

/// A subscriber connection to a simulated Redis node.
struct SimSubscriber {
    tx: Sender,
    rx: Receiver,
    /// `SSUBSCRIBE` rather than `SUBSCRIBE`.
    sharded: bool,
    /// Channels this side dropped: any other unsubscribed means the slot moved away.
    leaving: BTreeSet<String>,
    /// Messages to hand over before reading more: a duplicate, a message held back.
    queued: VecDeque<(String, Vec<u8>)>,
    /// A message held back until the one after it (or the instant given) has arrived.
    behind: Option<(Instant, String, Vec<u8>)>,
    /// A message held back until the instant given; nothing after it is read before.
    late: Option<(Instant, String, Vec<u8>)>,
}

impl SimSubscriber {
    async fn send(&mut self, cmd: &Cmd) -> Result<(), StoreError> {
        self.tx
            .send(Box::new(cmd.get_packed_command()))
            .await
            .map_err(err)
    }

    /// Hands a message over, keeping a copy to deliver again when duplication fires.
    fn deliver(&mut self, channel: String, payload: Vec<u8>) -> Pushed {
        if buggify::fires(Point::PubSubDuplicate) {
            self.queued.push_back((channel.clone(), payload.clone()));
        }
        Pushed::Message(channel, payload)
    }

    /// The next reply from the server; a message held back is handed over instead if
    /// nothing arrives before its instant.
    async fn reply(&mut self) -> Result<Result<Value, Pushed>, StoreError> {
        let Some((at, ..)) = &self.behind else {
            return Ok(Ok(receive(&mut self.rx).await.map_err(err)?));
        };
        let at = *at;
        tokio::select! {
            reply = receive(&mut self.rx) => Ok(Ok(reply.map_err(err)?)),
            () = tokio::time::sleep_until(at) => {
                let (_, channel, payload) = self.behind.take().expect("held above");
                Ok(Err(self.deliver(channel, payload)))
            }
        }
    }
}

impl NodeSubscriber for SimSubscriber {
    fn subscribe(&mut self, channels: Vec<String>) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let command = if self.sharded {
                "SSUBSCRIBE"
            } else {
                "SUBSCRIBE"
            };
            for ch in channels {
                buggify::pause(Point::SubscribeLate).await;
                self.leaving.remove(&ch);
                self.send(redis::cmd(command).arg(ch)).await?;
            }
            Ok(())
        })
    }

    fn unsubscribe(&mut self, channel: String) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let command = if self.sharded {
                "SUNSUBSCRIBE"
            } else {
                "UNSUBSCRIBE"
            };
            self.leaving.insert(channel.clone());
            self.send(redis::cmd(command).arg(channel)).await
        })
    }

    fn ping(&mut self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move { self.send(&redis::cmd("PING")).await })
    }

    /// Cancel-safe, as the relay's `select!` needs: state changes only after the last
    /// await of each path.
    fn next(&mut self) -> BoxFuture<'_, Result<Pushed, StoreError>> {
        Box::pin(async move {
            loop {
                if let Some((channel, payload)) = self.queued.pop_front() {
                    return Ok(Pushed::Message(channel, payload));
                }
                if let Some((at, ..)) = &self.late {
                    tokio::time::sleep_until(*at).await;
                    let (_, channel, payload) = self.late.take().expect("held above");
                    return Ok(self.deliver(channel, payload));
                }
                let reply = match self.reply().await? {
                    Ok(reply) => reply,
                    Err(held) => return Ok(held),
                };
                return Ok(match push(reply.extract_error().map_err(err)?)? {
                    Push::Subscribed(ch) => Pushed::Subscribed(ch),
                    Push::Pong => Pushed::Pong,
                    Push::Unsubscribed(ch) if self.leaving.remove(&ch) => continue,
                    Push::Unsubscribed(ch) => {
                        return Err(err(format!("the node unsubscribed {ch}: its slot moved")));
                    }
                    Push::Message(..) if planted() == Bug::DropWakeup => continue,
                    Push::Message(..) if buggify::fires(Point::PubSubBreak) => {
                        return Err(err("connection broken (buggify)"));
                    }
                    Push::Message(channel, payload) => {
                        if let Some(d) = buggify::delay(Point::PubSubDelay) {
                            self.late = Some((Instant::now() + d, channel, payload));
                            continue;
                        }
                        if self.behind.is_none() && buggify::fires(Point::PubSubReorder) {
                            let until = Instant::now() + Duration::from_millis(500);
                            self.behind = Some((until, channel, payload));
                            continue;
                        }
                        let out = self.deliver(channel, payload);
                        if let Some((_, channel, payload)) = self.behind.take() {
                            self.queued.push_back((channel, payload));
                        }
                        out
                    }
                });
            }
        })
    }
}

/// What a subscriber connection is pushed.
enum Push {
    Subscribed(String),
    Unsubscribed(String),
    Message(String, Vec<u8>),
    Pong,
}

/// Reads a push: `[kind, channel or text, count or payload]`, or the `+PONG` of a
/// connection that has not subscribed yet.
fn push(value: Value) -> Result<Push, StoreError> {
    if matches!(&value, Value::SimpleString(s) if s == "PONG") {
        return Ok(Push::Pong);
    }
    let text = |v: &Value| match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        _ => None,
    };
    if let Value::Array(items) = &value
        && let Some(kind) = items.first().and_then(text)
    {
        match (kind.as_str(), items.get(1).and_then(text), items.get(2)) {
            ("subscribe" | "ssubscribe", Some(ch), Some(_)) => return Ok(Push::Subscribed(ch)),
            ("unsubscribe" | "sunsubscribe", Some(ch), Some(_)) => {
                return Ok(Push::Unsubscribed(ch));
            }
            ("pong", Some(_), None) => return Ok(Push::Pong),
            ("message" | "smessage", Some(ch), Some(Value::BulkString(payload))) => {
                return Ok(Push::Message(ch, payload.clone()));
            }
            _ => {}
        }
    }
    Err(err(format!("unexpected push {value:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redis::{RedisState, SHARDS, shard_address};
    use kas_core::tracker::{KeyExpiry, KeyWrite};
    use kas_server::store::{PubSubCommand, PubSubEvent, RedisStore, RedisTopology, Store};
    use tokio::sync::mpsc;

    fn write(key: &str, value: &str, publish: Vec<(String, Vec<u8>)>) -> KeyWrite {
        KeyWrite {
            key: key.to_string(),
            delete: Vec::new(),
            set: vec![("f".to_string(), value.as_bytes().to_vec())],
            expire: KeyExpiry::Keep,
            publish,
            announce: Vec::new(),
        }
    }

    async fn next_event(events: &mut mpsc::Receiver<PubSubEvent>) -> PubSubEvent {
        tokio::time::timeout(Duration::from_secs(10), events.recv())
            .await
            .expect("a pub-sub event within 10 s")
            .expect("the loop runs")
    }

    /// The production store's cluster client against the simulated cluster: batches over
    /// many slots, reads and sharded pub-sub keep working while a slot's keys go over to
    /// another shard (`ASK`) and after it moved (`MOVED`); its sharded subscriber breaks
    /// when its channel's slot moves away and comes back on the new owner.
    #[madsim::test]
    async fn the_production_store_follows_a_simulated_cluster_through_a_slot_move() {
        let state = RedisState::default();
        state.shard_nodes();
        let client = madsim::runtime::Handle::current()
            .create_node()
            .name("client")
            .ip("10.0.9.1".parse().unwrap())
            .build();
        client
            .spawn(async move {
                let seeds = (0..SHARDS).map(|s| shard_address(s).to_string()).collect();
                let dial = Arc::new(SimDial {
                    timeout: Duration::from_secs(1),
                    path: Path {
                        client: "10.0.9.1".parse().unwrap(),
                        knobs: state.knobs.clone(),
                    },
                });
                let redis = RedisStore::over(
                    &RedisTopology::Cluster(seeds),
                    dial.clone(),
                    dial,
                    Duration::from_secs(1),
                )
                .expect("a cluster store");
                let store = Store::new(redis.clone());
                // 20 keys of one slot (the one that moves), 40 of others.
                let keys: Vec<String> = (0..20)
                    .map(|i| format!("k{i}:{{moving}}"))
                    .chain((0..40).map(|i| format!("other{i}")))
                    .collect();
                let channel = "events:{moving}".to_string();
                let (cmds, rx) = mpsc::unbounded_channel();
                let (tx, mut events) = mpsc::channel(16);
                kas_server::store::Backend::spawn_pubsub(&redis, rx, tx);
                cmds.send(PubSubCommand::Subscribe(channel.clone())).unwrap();
                assert!(matches!(next_event(&mut events).await, PubSubEvent::Up));
                assert!(matches!(next_event(&mut events).await, PubSubEvent::Subscribed(c) if c == channel));

                let batch = |value: &str| -> Vec<KeyWrite> {
                    keys.iter()
                        .map(|k| write(k, value, Vec::new()))
                        .chain([write(
                            "k0:{moving}",
                            value,
                            vec![(channel.clone(), value.as_bytes().to_vec())],
                        )])
                        .collect()
                };
                store.execute(&batch("a")).await.expect("a batch over every shard");
                assert!(matches!(next_event(&mut events).await, PubSubEvent::Message { payload, .. } if payload == b"a"));

                let mover = state.clone();
                let to = (state.with_db(|db| db.shard("k0:{moving}")) + 1) % SHARDS;
                let moving = tokio::spawn(async move {
                    mover
                        .move_slots("k0:{moving}", 0, to, Duration::from_secs(4))
                        .await
                });
                // Half the slot's keys are over: some answered at the source, some after
                // `ASK` at the target.
                tokio::time::sleep(Duration::from_millis(2_500)).await;
                store.execute(&batch("b")).await.expect("a batch while the slot moves");
                for k in &keys {
                    let fields = store.read(k).await.expect("a read while the slot moves");
                    assert_eq!(fields, [("f".to_string(), b"b".to_vec())], "{k}");
                }
                moving.await.unwrap();
                // The slot's subscribers at the source are unsubscribed: the subscriber
                // breaks and comes back on the new owner.
                assert!(matches!(next_event(&mut events).await, PubSubEvent::Message { payload, .. } if payload == b"b"));
                assert!(matches!(next_event(&mut events).await, PubSubEvent::Down));
                assert!(matches!(next_event(&mut events).await, PubSubEvent::Up));
                assert!(matches!(next_event(&mut events).await, PubSubEvent::Subscribed(c) if c == channel));
                store.execute(&batch("c")).await.expect("a batch after the slot moved");
                assert!(matches!(next_event(&mut events).await, PubSubEvent::Message { payload, .. } if payload == b"c"));
                for k in &keys {
                    let fields = store.read(k).await.expect("a read after the slot moved");
                    assert_eq!(fields, [("f".to_string(), b"c".to_vec())], "{k}");
                }
                store.ping().await.expect("every master answers");
                drop(cmds);
            })
            .await
            .unwrap();
    }
}
