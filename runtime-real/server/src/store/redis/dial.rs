//! How the Redis store reaches one Redis node: the seam between the store's own code
//! (batching, grouping, scripts, retries, Sentinel's resolution, a Cluster's slots and
//! redirections) and the bytes. In production a [`NodeSettings`] dials TCP (and TLS) with
//! redis-rs; the simulation brings a [`Dial`] over its network to its Redis nodes, which
//! answer the same commands.

use super::super::StoreError;
use super::super::pubsub::{Connection, Pushed};
use super::{NodeSettings, err, redis_error};
use ::redis::aio::{ConnectionLike, ConnectionManager, MultiplexedConnection};
use ::redis::{Cmd, ErrorKind, Pipeline, PushInfo, PushKind, RedisFuture, Value};
use futures::StreamExt;
use futures::future::BoxFuture;
use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// One node's command connection: made lazily, re-established after a loss, each command
/// bounded by the store's timeout.
pub trait NodeConnection: Send + Sync {
    /// Sends `cmd` and reads its answer (a Redis error reply is an `Err`).
    fn query<'a>(&'a self, cmd: &'a Cmd) -> RedisFuture<'a, Value>;

    /// Sends `ASKING` and `cmd` back to back on one connection, and reads `cmd`'s answer:
    /// a Cluster node serves a key of a slot it is importing only so.
    fn query_asking<'a>(&'a self, cmd: &'a Cmd) -> RedisFuture<'a, Value>;
}

/// One node's subscriber connection (see [`Connection`], whose methods these are).
pub trait NodeSubscriber: Send {
    /// Asks for these channels.
    fn subscribe(&mut self, channels: Vec<String>) -> BoxFuture<'_, Result<(), StoreError>>;
    /// Drops a channel.
    fn unsubscribe(&mut self, channel: String) -> BoxFuture<'_, Result<(), StoreError>>;
    /// Sends a `PING`.
    fn ping(&mut self) -> BoxFuture<'_, Result<(), StoreError>>;
    /// The next thing the node pushed; cancel-safe.
    fn next(&mut self) -> BoxFuture<'_, Result<Pushed, StoreError>>;
}

impl Connection for Box<dyn NodeSubscriber> {
    async fn subscribe(&mut self, channels: Vec<String>) -> Result<(), StoreError> {
        (**self).subscribe(channels).await
    }

    async fn unsubscribe(&mut self, channel: String) -> Result<(), StoreError> {
        (**self).unsubscribe(channel).await
    }

    async fn ping(&mut self) -> Result<(), StoreError> {
        (**self).ping().await
    }

    async fn next(&mut self) -> Result<Pushed, StoreError> {
        (**self).next().await
    }
}

/// How the store reaches Redis nodes.
pub trait Dial: Send + Sync + 'static {
    /// A command connection to the node at `address`, connecting lazily.
    fn connect(&self, address: &str) -> Result<NodeConn, StoreError>;

    /// A subscriber connection to the node at `address`: for `SUBSCRIBE`, or with
    /// `sharded` for a Cluster's `SSUBSCRIBE` (a channel lives on its slot's master).
    fn subscriber(
        &self,
        address: String,
        sharded: bool,
    ) -> BoxFuture<'static, Result<Box<dyn NodeSubscriber>, StoreError>>;
}

/// A shared command connection, usable wherever redis-rs wants a connection (scripts,
/// typed queries).
#[derive(Clone)]
pub struct NodeConn(pub Arc<dyn NodeConnection>);

impl ConnectionLike for NodeConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        self.0.query(cmd)
    }

    /// The store sends no pipelines (a batch is one script call).
    fn req_packed_commands<'a>(
        &'a mut self,
        _: &'a Pipeline,
        _: usize,
        _: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async { Err((ErrorKind::Client, "the Redis store sends no pipelines").into()) })
    }

    fn get_db(&self) -> i64 {
        0
    }
}

impl NodeConnection for ConnectionManager {
    fn query<'a>(&'a self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let mut conn = self.clone();
        Box::pin(async move { conn.req_packed_command(cmd).await })
    }

    fn query_asking<'a>(&'a self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let mut conn = self.clone();
        Box::pin(async move {
            let mut pipe = ::redis::pipe();
            pipe.cmd("ASKING").add_command(cmd.clone());
            let mut answers = conn.req_packed_commands(&pipe, 1, 1).await?;
            answers
                .pop()
                .ok_or_else(|| (ErrorKind::Client, "no answer after ASKING").into())
                .and_then(Value::extract_error)
        })
    }
}

impl Dial for NodeSettings {
    fn connect(&self, address: &str) -> Result<NodeConn, StoreError> {
        Ok(NodeConn(Arc::new(self.manager(address)?)))
    }

    fn subscriber(
        &self,
        address: String,
        sharded: bool,
    ) -> BoxFuture<'static, Result<Box<dyn NodeSubscriber>, StoreError>> {
        let settings = self.clone();
        Box::pin(async move {
            if sharded {
                let node = ShardSubscriber::connect(&settings, &address).await?;
                return Ok(Box::new(node) as Box<dyn NodeSubscriber>);
            }
            let (sink, stream) = settings
                .client(&address)?
                .get_async_pubsub()
                .await
                .map_err(redis_error)?
                .split();
            Ok(Box::new(RedisSubscriber {
                sink,
                stream,
                answered: VecDeque::new(),
                timeout: settings.timeout,
            }) as Box<dyn NodeSubscriber>)
        })
    }
}

/// A Redis subscriber connection. Redis confirms a subscription, and answers a `PING`,
/// within the call that asks; the answers wait here to be read as pushed.
struct RedisSubscriber {
    sink: ::redis::aio::PubSubSink,
    stream: ::redis::aio::PubSubStream,
    answered: VecDeque<Pushed>,
    timeout: Duration,
}

impl NodeSubscriber for RedisSubscriber {
    fn subscribe(&mut self, channels: Vec<String>) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let asked = tokio::time::timeout(self.timeout, self.sink.subscribe(&channels)).await;
            asked.map_err(err)?.map_err(redis_error)?;
            self.answered
                .extend(channels.into_iter().map(Pushed::Subscribed));
            Ok(())
        })
    }

    fn unsubscribe(&mut self, channel: String) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let asked = tokio::time::timeout(self.timeout, self.sink.unsubscribe(&channel)).await;
            asked.map_err(err)?.map_err(redis_error)
        })
    }

    fn ping(&mut self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let pong = tokio::time::timeout(self.timeout, self.sink.ping::<Value>()).await;
            pong.map_err(err)?.map_err(redis_error)?;
            self.answered.push_back(Pushed::Pong);
            Ok(())
        })
    }

    fn next(&mut self) -> BoxFuture<'_, Result<Pushed, StoreError>> {
        Box::pin(async move {
            if let Some(answer) = self.answered.pop_front() {
                return Ok(answer);
            }
            let msg = self
                .stream
                .next()
                .await
                .ok_or_else(|| StoreError("pub-sub connection closed".into()))?;
            Ok(Pushed::Message(
                msg.get_channel_name().to_string(),
                msg.get_payload_bytes().to_vec(),
            ))
        })
    }
}

/// A sharded subscriber on one Cluster node: a RESP3 connection whose pushes (the
/// confirmations and messages) arrive on a channel. A node refuses a channel whose slot it
/// does not serve (`MOVED`).
struct ShardSubscriber {
    conn: MultiplexedConnection,
    pushes: mpsc::UnboundedReceiver<PushInfo>,
    /// Channels this side dropped: their `sunsubscribe` is expected. Any other means the
    /// slot moved away from this node, and the subscriber is broken.
    leaving: BTreeSet<String>,
    answered: VecDeque<Pushed>,
}

impl ShardSubscriber {
    async fn connect(settings: &NodeSettings, address: &str) -> Result<Self, StoreError> {
        let info = settings.info(address)?;
        let resp3 = info
            .redis_settings()
            .clone()
            .set_protocol(::redis::ProtocolVersion::RESP3);
        let info = info.set_redis_settings(resp3);
        let client = match &settings.tls {
            Some(certs) => ::redis::Client::build_with_tls(info, certs.clone()).map_err(err)?,
            None => ::redis::Client::open(info).map_err(err)?,
        };
        let (tx, pushes) = mpsc::unbounded_channel();
        let config = ::redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(settings.timeout))
            .set_response_timeout(Some(settings.timeout))
            .set_push_sender(tx);
        let conn = client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(redis_error)?;
        Ok(ShardSubscriber {
            conn,
            pushes,
            leaving: BTreeSet::new(),
            answered: VecDeque::new(),
        })
    }

    /// Sends `cmd` and reads its answer: for a command about one channel, the
    /// confirmation (which redis-rs also hands to the push channel) or the refusal
    /// (`MOVED`).
    async fn send(&mut self, cmd: &Cmd) -> Result<(), StoreError> {
        self.conn
            .send_packed_command(cmd)
            .await
            .map_err(redis_error)?;
        Ok(())
    }
}

impl NodeSubscriber for ShardSubscriber {
    fn subscribe(&mut self, channels: Vec<String>) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            for channel in channels {
                self.leaving.remove(&channel);
                self.send(::redis::cmd("SSUBSCRIBE").arg(&channel)).await?;
            }
            Ok(())
        })
    }

    fn unsubscribe(&mut self, channel: String) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            self.leaving.insert(channel.clone());
            self.send(::redis::cmd("SUNSUBSCRIBE").arg(&channel)).await
        })
    }

    fn ping(&mut self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            self.send(&::redis::cmd("PING")).await?;
            self.answered.push_back(Pushed::Pong);
            Ok(())
        })
    }

    fn next(&mut self) -> BoxFuture<'_, Result<Pushed, StoreError>> {
        Box::pin(async move {
            loop {
                if let Some(answer) = self.answered.pop_front() {
                    return Ok(answer);
                }
                let push = self
                    .pushes
                    .recv()
                    .await
                    .ok_or_else(|| StoreError("sharded pub-sub connection closed".into()))?;
                let channel = match push.data.first() {
                    Some(Value::BulkString(c)) => String::from_utf8_lossy(c).into_owned(),
                    _ => String::new(),
                };
                match push.kind {
                    PushKind::Disconnection => {
                        return Err(StoreError("a cluster node's connection dropped".into()));
                    }
                    PushKind::SSubscribe => return Ok(Pushed::Subscribed(channel)),
                    PushKind::SUnsubscribe if self.leaving.remove(&channel) => {}
                    PushKind::SUnsubscribe => {
                        return Err(StoreError(format!(
                            "the slot of channel {channel} moved to another node"
                        )));
                    }
                    PushKind::SMessage => {
                        if let Some(Value::BulkString(payload)) = push.data.get(1) {
                            return Ok(Pushed::Message(channel, payload.clone()));
                        }
                    }
                    _ => {}
                }
            }
        })
    }
}
