//! The registry store: where kas replicas publish who is connected where.
//!
//! One [`Backend`] trait, two implementations here: Redis (shared by many kas) and
//! in-memory (one kas alone, used when the configuration has no `redis` section); the
//! simulation brings a third and hands it to `Kas::start`. Each applies the tracker's
//! batches atomically (per key `HDEL; HSET; PEXPIRE; PUBLISH`, then the announcements if
//! the `HSET` created a field; on Redis one `EVALSHA` per batch), reads hashes, collects
//! expired fields without ever deleting a field that was refreshed meanwhile, and carries
//! pub-sub on a connection of its own that reports when it is up and down.

mod memory;
pub mod pubsub;
mod redis;
pub mod slot;

pub use self::memory::{Keyspace, MemoryStore};
pub use self::redis::{
    Dial, NodeConn, NodeConnection, NodeSubscriber, RedisAuth, RedisStore, RedisTopology,
};

use futures::future::BoxFuture;
use kas_core::Time;
use kas_core::tracker::KeyWrite;
use std::sync::Arc;
use tokio::sync::mpsc;

/// A failed store operation.
#[derive(Clone, Debug, thiserror::Error)]
#[error("registry store: {0}")]
pub struct StoreError(pub String);

/// What a registry store does.
pub trait Backend: Send + Sync {
    /// Applies the writes atomically, in one round trip.
    fn execute<'a>(&'a self, writes: &'a [KeyWrite]) -> BoxFuture<'a, Result<(), StoreError>>;

    /// Every field of a hash with its stored bytes.
    fn read<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Fields>;

    /// Deletes the fields of `keys` that are expired (or undecodable) at `now`, never one
    /// refreshed meanwhile. Returns how many went.
    fn gc<'a>(&'a self, keys: &'a [String], now: Time) -> BoxFuture<'a, Result<usize, StoreError>>;

    /// Checks the store answers.
    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>>;

    /// Starts the pub-sub connection, driven by `cmds`, reporting to `events`.
    fn spawn_pubsub(
        &self,
        cmds: mpsc::UnboundedReceiver<PubSubCommand>,
        events: mpsc::Sender<PubSubEvent>,
    );
}

/// A hash's fields with their stored bytes, or why they could not be read.
pub type Fields = Result<Vec<(String, Vec<u8>)>, StoreError>;

/// A store that deletes a field only if it still holds a given value: its GC goes key by
/// key ([`gc_key_by_key`]) where Redis runs one script per master.
pub trait CompareAndDelete: Backend {
    /// Deletes each of `garbage`'s fields of `key` that still holds the value given;
    /// returns how many went.
    fn delete_unchanged<'a>(
        &'a self,
        key: &'a str,
        garbage: &'a [(String, Vec<u8>)],
    ) -> BoxFuture<'a, Result<usize, StoreError>>;
}

/// [`Backend::gc`] for a [`CompareAndDelete`] store: each key read, judged, and its
/// garbage deleted only where unchanged.
pub async fn gc_key_by_key<B: CompareAndDelete + ?Sized>(
    store: &B,
    keys: &[String],
    now: Time,
) -> Result<usize, StoreError> {
    let mut n = 0;
    for key in keys {
        let fields = store.read(key).await?;
        let dead = kas_core::expiring::garbage_fields(
            fields.iter().map(|(f, v)| (f.as_str(), v.as_slice())),
            now,
        );
        let garbage: Vec<(String, Vec<u8>)> = fields
            .into_iter()
            .filter(|(f, _)| dead.contains(f))
            .collect();
        if !garbage.is_empty() {
            n += store.delete_unchanged(key, &garbage).await?;
        }
    }
    Ok(n)
}

/// The store kas runs on.
#[derive(Clone)]
pub struct Store(Arc<dyn Backend>);

impl Store {
    /// A store over `backend`.
    pub fn new(backend: impl Backend + 'static) -> Store {
        Store(Arc::new(backend))
    }

    /// Applies the writes atomically, in one round trip.
    pub async fn execute(&self, writes: &[KeyWrite]) -> Result<(), StoreError> {
        self.0.execute(writes).await
    }

    /// Every field of a hash with its stored bytes.
    pub async fn read(&self, key: &str) -> Fields {
        self.0.read(key).await
    }

    /// The live fields of a hash at `now`: (field, payload without the expiry wrapper).
    pub async fn read_live(&self, key: &str, now: Time) -> Fields {
        let fields = self.read(key).await?;
        let refs = fields.iter().map(|(f, v)| (f.as_str(), v.as_slice()));
        Ok(kas_core::expiring::live_fields(refs, now))
    }

    /// The live fields of `key`, and the ids of the kas whose liveness record in
    /// `instances` is live: what a reader needs to skip the records of a kas that died
    /// without deleting them. Both reads go out together (one round trip on Redis).
    pub async fn read_live_with_kas(
        &self,
        key: &str,
        instances: &str,
        now: Time,
    ) -> Result<(Vec<(String, Vec<u8>)>, std::collections::BTreeSet<String>), StoreError> {
        let (fields, kas) = tokio::join!(self.read_live(key, now), self.read_live(instances, now));
        Ok((fields?, kas?.into_iter().map(|(id, _)| id).collect()))
    }

    /// Deletes the fields of `keys` that are expired (or undecodable) at `now`. Returns how
    /// many went. On Redis one script call per 256 keys (of one master, on a cluster)
    /// decides and deletes atomically; elsewhere key by key ([`gc_key_by_key`]).
    pub async fn gc(&self, keys: &[String], now: Time) -> Result<usize, StoreError> {
        self.0.gc(keys, now).await
    }

    /// Checks the store answers.
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.0.ping().await
    }

    /// Starts the pub-sub connection: subscribe through the handle, receive events.
    pub fn pubsub(&self) -> (PubSub, mpsc::Receiver<PubSubEvent>) {
        let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
        let (ev_tx, ev_rx) = mpsc::channel(1024);
        self.0.spawn_pubsub(cmd_rx, ev_tx);
        (PubSub(cmd_tx), ev_rx)
    }
}

/// A request to the pub-sub connection.
#[derive(Debug)]
pub enum PubSubCommand {
    /// Start receiving a channel; answered by [`PubSubEvent::Subscribed`].
    Subscribe(String),
    /// Stop receiving a channel.
    Unsubscribe(String),
}

pub use kas_core::node::PubSubEvent;

/// The handle of a pub-sub connection. Dropping it ends the connection.
#[derive(Clone, Debug)]
pub struct PubSub(mpsc::UnboundedSender<PubSubCommand>);

impl PubSub {
    /// Subscribes to `channel`.
    pub fn subscribe(&self, channel: String) {
        let _ = self.0.send(PubSubCommand::Subscribe(channel));
    }

    /// Unsubscribes from `channel`.
    pub fn unsubscribe(&self, channel: String) {
        let _ = self.0.send(PubSubCommand::Unsubscribe(channel));
    }
}
