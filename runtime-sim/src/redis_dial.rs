//! How the production Redis store reaches the simulated Redis node: each command's bytes,
//! as redis-rs packed them, go over `madsim::net` on a connection of their own, and the
//! node's RESP answer comes back to redis-rs's parser. Subscriber connections speak RESP
//! too, through the store's own pub-sub loop. The faults of a client's side (a failed or
//! slow command, pub-sub messages broken off, duplicated, late or reordered) are injected
//! here.

use crate::planted_bug::{Bug, planted};
use futures::future::BoxFuture;
use kas_server::buggify::{self, Point};
use kas_server::store::pubsub::{self, Connection, Pushed, Transport};
use kas_server::store::{
    Dial, MasterAddress, NodeConn, NodeConnection, PubSubCommand, PubSubEvent, StoreError,
};
use redis::{Cmd, RedisError, RedisFuture, Value};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{Endpoint, Receiver, Sender};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Dials the simulated Redis node; each command times out after `timeout`.
#[derive(Clone, Debug)]
pub struct SimDial {
    /// `redis.timeout`.
    pub timeout: Duration,
}

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

/// Opens a connection to the server.
async fn connect(server: SocketAddr) -> std::io::Result<(Sender, Receiver)> {
    let endpoint = Endpoint::bind("0.0.0.0:0").await?;
    endpoint.connect1(server).await
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
        })))
    }

    fn run_pubsub(
        &self,
        master: MasterAddress,
        timeout: Duration,
        cmds: mpsc::UnboundedReceiver<PubSubCommand>,
        events: mpsc::Sender<PubSubEvent>,
    ) -> BoxFuture<'static, ()> {
        Box::pin(pubsub::run(SimPubSub { master }, timeout, cmds, events))
    }
}

/// A command connection to the node.
struct SimConnection {
    server: SocketAddr,
    timeout: Duration,
}

impl NodeConnection for SimConnection {
    fn query<'a>(&'a self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            if buggify::fires(Point::RedisFailure) {
                return Err(broken("failed (buggify)"));
            }
            let exchange = async {
                buggify::pause(Point::RedisLatency).await;
                let (tx, mut rx) = connect(self.server).await?;
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

/// Opens subscriber connections to the node the store names.
struct SimPubSub {
    master: MasterAddress,
}

/// A subscriber connection to the simulated Redis node.
struct SimSubscriber {
    tx: Sender,
    rx: Receiver,
    /// Messages to hand over before reading more: a duplicate, a message held back.
    queued: VecDeque<(String, Vec<u8>)>,
    /// A message held back until the one after it (or the instant given) has arrived.
    behind: Option<(Instant, String, Vec<u8>)>,
    /// A message held back until the instant given; nothing after it is read before.
    late: Option<(Instant, String, Vec<u8>)>,
}

impl Transport for SimPubSub {
    type Conn = SimSubscriber;

    async fn connect(&self) -> Result<SimSubscriber, StoreError> {
        let server = address(&(self.master)().await?)?;
        let (tx, rx) = connect(server).await.map_err(err)?;
        Ok(SimSubscriber {
            tx,
            rx,
            queued: VecDeque::new(),
            behind: None,
            late: None,
        })
    }
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

impl Connection for SimSubscriber {
    async fn subscribe(&mut self, channels: Vec<String>) -> Result<(), StoreError> {
        for ch in channels {
            buggify::pause(Point::SubscribeLate).await;
            self.send(redis::cmd("SUBSCRIBE").arg(ch)).await?;
        }
        Ok(())
    }

    async fn unsubscribe(&mut self, channel: String) -> Result<(), StoreError> {
        self.send(redis::cmd("UNSUBSCRIBE").arg(channel)).await
    }

    async fn ping(&mut self) -> Result<(), StoreError> {
        self.send(&redis::cmd("PING")).await
    }

    /// Cancel-safe, as the relay's `select!` needs: state changes only after the last
    /// await of each path.
    async fn next(&mut self) -> Result<Pushed, StoreError> {
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
                Push::Unsubscribed => continue,
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
    }
}

/// What a subscriber connection is pushed.
enum Push {
    Subscribed(String),
    Unsubscribed,
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
            ("subscribe", Some(ch), Some(_)) => return Ok(Push::Subscribed(ch)),
            ("unsubscribe", Some(_), Some(_)) => return Ok(Push::Unsubscribed),
            ("pong", Some(_), None) => return Ok(Push::Pong),
            ("message", Some(ch), Some(Value::BulkString(payload))) => {
                return Ok(Push::Message(ch, payload.clone()));
            }
            _ => {}
        }
    }
    Err(err(format!("unexpected push {value:?}")))
}
