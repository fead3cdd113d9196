//! The simulated Redis client: the store's operations sent over `madsim::net` to the
//! simulated Redis node (`redis.rs`), which applies them as Redis would (each key's
//! transaction atomically, fields under key expiry, fire-and-forget pub-sub). Each kas of
//! the simulation is started on it (`Kas::start`'s store).

use crate::planted_bug::{Bug, planted};
use futures::future::BoxFuture;
use kas_core::Time;
use kas_core::tracker::KeyWrite;
use kas_server::buggify::{self, Point};
use kas_server::store::pubsub::{self, Connection, Pushed, Transport};
use kas_server::store::{
    Backend, CompareAndDelete, Fields, PubSubCommand, PubSubEvent, StoreError, gc_key_by_key,
};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::{Endpoint, Receiver, Sender};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// A request to the simulated Redis.
#[derive(Clone, Debug)]
pub enum SimRequest {
    /// The batch write (see the Redis store's script). Answer: `Done`.
    Execute(Vec<KeyWrite>),
    /// `HGETALL`. Answer: `Hash`.
    Read(String),
    /// The GC's compare-and-delete script. Answer: `Deleted`.
    DeleteUnchanged(String, Vec<(String, Vec<u8>)>),
    /// `PING`. Answer: `Done`.
    Ping,
    /// `SUBSCRIBE` (turns the connection into a subscriber). Answer: `Subscribed`.
    Subscribe(String),
    /// `UNSUBSCRIBE`. No answer.
    Unsubscribe(String),
}

/// An answer, or a pushed pub-sub message.
#[derive(Clone, Debug)]
pub enum SimReply {
    /// Done.
    Done,
    /// A hash's fields.
    Hash(Vec<(String, Vec<u8>)>),
    /// Fields deleted.
    Deleted(usize),
    /// The subscription is active.
    Subscribed(String),
    /// A published message on a subscribed channel.
    Message(String, Vec<u8>),
    /// The request failed (a cluster shard is down); a subscriber's connection then closes.
    Failed(String),
}

/// The client of the simulated Redis node at `server`.
#[derive(Clone, Debug)]
pub struct SimStore {
    server: SocketAddr,
    timeout: Duration,
}

fn err(e: impl std::fmt::Display) -> StoreError {
    StoreError(format!("simulated redis: {e}"))
}

/// Opens a connection to the server.
async fn connect(server: SocketAddr) -> std::io::Result<(Sender, Receiver)> {
    let endpoint = Endpoint::bind("0.0.0.0:0").await?;
    endpoint.connect1(server).await
}

async fn receive(rx: &mut Receiver) -> Result<SimReply, StoreError> {
    let payload = rx.recv().await.map_err(err)?;
    payload
        .downcast::<SimReply>()
        .map(|r| *r)
        .map_err(|_| err("unexpected payload"))
}

impl SimStore {
    /// A client of `address` (`ip:port` of the simulated Redis node); each operation times
    /// out after `timeout`.
    pub fn new(address: &str, timeout: Duration) -> Result<Self, StoreError> {
        let server = address
            .parse()
            .map_err(|e| err(format!("address {address:?}: {e}")))?;
        Ok(SimStore { server, timeout })
    }

    async fn call(&self, request: SimRequest) -> Result<SimReply, StoreError> {
        if buggify::fires(Point::RedisFailure) {
            return Err(err("failed (buggify)"));
        }
        let exchange = async {
            buggify::pause(Point::RedisLatency).await;
            let (tx, mut rx) = connect(self.server).await.map_err(err)?;
            tx.send(Box::new(request)).await.map_err(err)?;
            let reply = receive(&mut rx).await?;
            // Applied, and answered late: whoever waits on it acts on a past store.
            buggify::pause(Point::RedisLatency).await;
            match reply {
                SimReply::Failed(why) => Err(err(why)),
                reply => Ok(reply),
            }
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| err("timed out"))?
    }

    async fn execute(&self, writes: &[KeyWrite]) -> Result<(), StoreError> {
        if writes.len() > 1 && buggify::fires(Point::RedisPartialBatch) {
            let first = writes[..writes.len() / 2].to_vec();
            self.call(SimRequest::Execute(first)).await?;
            return Err(err("batch failed after its first keys (buggify)"));
        }
        match self.call(SimRequest::Execute(writes.to_vec())).await? {
            SimReply::Done => Ok(()),
            other => Err(err(format!("unexpected answer {other:?}"))),
        }
    }

    async fn read(&self, key: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        match self.call(SimRequest::Read(key.into())).await? {
            SimReply::Hash(fields) => Ok(fields),
            other => Err(err(format!("unexpected answer {other:?}"))),
        }
    }

    async fn delete_unchanged(
        &self,
        key: &str,
        fields: &[(String, Vec<u8>)],
    ) -> Result<usize, StoreError> {
        let request = SimRequest::DeleteUnchanged(key.into(), fields.to_vec());
        match self.call(request).await? {
            SimReply::Deleted(n) => Ok(n),
            other => Err(err(format!("unexpected answer {other:?}"))),
        }
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.call(SimRequest::Ping).await.map(|_| ())
    }

    fn spawn_pubsub(
        &self,
        cmds: mpsc::UnboundedReceiver<PubSubCommand>,
        events: mpsc::Sender<PubSubEvent>,
    ) {
        let transport = SimPubSub {
            server: self.server,
        };
        tokio::spawn(pubsub::run(transport, self.timeout, cmds, events));
    }
}

impl Backend for SimStore {
    fn execute<'a>(&'a self, writes: &'a [KeyWrite]) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(SimStore::execute(self, writes))
    }

    fn read<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Fields> {
        Box::pin(SimStore::read(self, key))
    }

    fn gc<'a>(&'a self, keys: &'a [String], now: Time) -> BoxFuture<'a, Result<usize, StoreError>> {
        Box::pin(gc_key_by_key(self, keys, now))
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(SimStore::ping(self))
    }

    fn spawn_pubsub(
        &self,
        cmds: mpsc::UnboundedReceiver<PubSubCommand>,
        events: mpsc::Sender<PubSubEvent>,
    ) {
        SimStore::spawn_pubsub(self, cmds, events);
    }
}

impl CompareAndDelete for SimStore {
    fn delete_unchanged<'a>(
        &'a self,
        key: &'a str,
        garbage: &'a [(String, Vec<u8>)],
    ) -> BoxFuture<'a, Result<usize, StoreError>> {
        Box::pin(SimStore::delete_unchanged(self, key, garbage))
    }
}

/// Opens subscriber connections to the simulated Redis node.
struct SimPubSub {
    server: SocketAddr,
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
        let (tx, rx) = connect(self.server).await.map_err(err)?;
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
    async fn send(&mut self, request: SimRequest) -> Result<(), StoreError> {
        self.tx.send(Box::new(request)).await.map_err(err)
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
    async fn reply(&mut self) -> Result<Result<SimReply, Pushed>, StoreError> {
        let Some((at, ..)) = &self.behind else {
            return Ok(Ok(receive(&mut self.rx).await?));
        };
        let at = *at;
        tokio::select! {
            reply = receive(&mut self.rx) => Ok(Ok(reply?)),
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
            self.send(SimRequest::Subscribe(ch)).await?;
        }
        Ok(())
    }

    async fn unsubscribe(&mut self, channel: String) -> Result<(), StoreError> {
        self.send(SimRequest::Unsubscribe(channel)).await
    }

    async fn ping(&mut self) -> Result<(), StoreError> {
        self.send(SimRequest::Ping).await
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
            return Ok(match reply {
                SimReply::Subscribed(ch) => Pushed::Subscribed(ch),
                SimReply::Message(..) if planted() == Bug::DropWakeup => continue,
                SimReply::Message(..) if buggify::fires(Point::PubSubBreak) => {
                    return Err(err("connection broken (buggify)"));
                }
                SimReply::Message(channel, payload) => {
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
                SimReply::Done => Pushed::Pong,
                SimReply::Failed(why) => return Err(err(why)),
                other => return Err(err(format!("unexpected push {other:?}"))),
            });
        }
    }
}
