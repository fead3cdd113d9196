//! How the Redis store reaches one Redis node: the seam between the store's own code
//! (batching, grouping, scripts, retries, Sentinel's resolution) and the bytes. In
//! production a [`NodeSettings`] dials TCP (and TLS) with redis-rs; the simulation brings a
//! [`Dial`] over its network to its Redis node, which answers the same commands.

use super::super::pubsub::{self, Connection, Pushed, Transport};
use super::super::{PubSubCommand, PubSubEvent, StoreError};
use super::{NodeSettings, err, redis_error};
use ::redis::aio::{ConnectionLike, ConnectionManager};
use ::redis::{Cmd, ErrorKind, Pipeline, RedisFuture, Value};
use futures::StreamExt;
use futures::future::BoxFuture;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// One node's command connection: made lazily, re-established after a loss, each command
/// bounded by the store's timeout.
pub trait NodeConnection: Send + Sync {
    /// Sends `cmd` and reads its answer (a Redis error reply is an `Err`).
    fn query<'a>(&'a self, cmd: &'a Cmd) -> RedisFuture<'a, Value>;
}

/// Where the master is at each attempt: a fixed address, or the one the sentinels name.
pub type MasterAddress =
    Arc<dyn Fn() -> BoxFuture<'static, Result<String, StoreError>> + Send + Sync>;

/// How the store reaches Redis nodes.
pub trait Dial: Send + Sync + 'static {
    /// A command connection to the node at `address`, connecting lazily.
    fn connect(&self, address: &str) -> Result<NodeConn, StoreError>;

    /// Runs the pub-sub loop ([`pubsub::run`]) on subscriber connections to the node that
    /// `master` names at each attempt, until `cmds` or `events` is dropped.
    fn run_pubsub(
        &self,
        master: MasterAddress,
        timeout: Duration,
        cmds: mpsc::UnboundedReceiver<PubSubCommand>,
        events: mpsc::Sender<PubSubEvent>,
    ) -> BoxFuture<'static, ()>;
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
}

impl Dial for NodeSettings {
    fn connect(&self, address: &str) -> Result<NodeConn, StoreError> {
        Ok(NodeConn(Arc::new(self.manager(address)?)))
    }

    fn run_pubsub(
        &self,
        master: MasterAddress,
        timeout: Duration,
        cmds: mpsc::UnboundedReceiver<PubSubCommand>,
        events: mpsc::Sender<PubSubEvent>,
    ) -> BoxFuture<'static, ()> {
        let transport = RedisPubSub {
            settings: self.clone(),
            master,
            timeout,
        };
        Box::pin(pubsub::run(transport, timeout, cmds, events))
    }
}

/// Opens redis-rs pub-sub connections to the master.
struct RedisPubSub {
    settings: NodeSettings,
    master: MasterAddress,
    timeout: Duration,
}

/// A Redis subscriber connection. Redis confirms a subscription, and answers a `PING`,
/// within the call that asks; the answers wait here to be read as pushed.
struct RedisSubscriber {
    sink: ::redis::aio::PubSubSink,
    stream: ::redis::aio::PubSubStream,
    answered: VecDeque<Pushed>,
    timeout: Duration,
}

impl Transport for RedisPubSub {
    type Conn = RedisSubscriber;

    async fn connect(&self) -> Result<RedisSubscriber, StoreError> {
        let client = self.settings.client(&(self.master)().await?)?;
        let (sink, stream) = client
            .get_async_pubsub()
            .await
            .map_err(redis_error)?
            .split();
        Ok(RedisSubscriber {
            sink,
            stream,
            answered: VecDeque::new(),
            timeout: self.timeout,
        })
    }
}

impl Connection for RedisSubscriber {
    async fn subscribe(&mut self, channels: Vec<String>) -> Result<(), StoreError> {
        let asked = tokio::time::timeout(self.timeout, self.sink.subscribe(&channels)).await;
        asked.map_err(err)?.map_err(redis_error)?;
        self.answered
            .extend(channels.into_iter().map(Pushed::Subscribed));
        Ok(())
    }

    async fn unsubscribe(&mut self, channel: String) -> Result<(), StoreError> {
        let asked = tokio::time::timeout(self.timeout, self.sink.unsubscribe(&channel)).await;
        asked.map_err(err)?.map_err(redis_error)
    }

    async fn ping(&mut self) -> Result<(), StoreError> {
        let pong = tokio::time::timeout(self.timeout, self.sink.ping::<Value>()).await;
        pong.map_err(err)?.map_err(redis_error)?;
        self.answered.push_back(Pushed::Pong);
        Ok(())
    }

    async fn next(&mut self) -> Result<Pushed, StoreError> {
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
    }
}
