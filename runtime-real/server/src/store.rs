//! The registry store: where kas replicas publish who is connected where.
//!
//! Two implementations behind one enum: Redis (shared by many kas) and in-memory (one kas
//! alone, used when the configuration has no `redis` section). Both apply the tracker's
//! batches atomically (per key `HDEL; HSET; PEXPIRE; PUBLISH`, then the announcements if
//! the `HSET` created a field; on Redis one `EVALSHA` per batch), read hashes, collect
//! expired fields without ever deleting a field that was refreshed meanwhile, and carry
//! pub-sub on a connection of its own that reports when it is up and down.

mod memory;
mod pubsub;
mod redis;
#[cfg(madsim)]
pub mod sim;
pub mod slot;

pub use self::memory::{Keyspace, MemoryStore};
pub use self::redis::{RedisAuth, RedisStore, RedisTopology};
#[cfg(madsim)]
pub use self::sim::SimStore;

use kas_core::Time;
use kas_core::tracker::KeyWrite;
use tokio::sync::mpsc;

/// A failed store operation.
#[derive(Clone, Debug, thiserror::Error)]
#[error("registry store: {0}")]
pub struct StoreError(pub String);

/// The configured store.
#[derive(Clone)]
pub enum Store {
    /// Redis, shared by all kas replicas.
    Redis(RedisStore),
    /// This process only.
    Memory(MemoryStore),
    /// The simulated Redis node (madsim only).
    #[cfg(madsim)]
    Sim(SimStore),
}

impl Store {
    /// Applies the writes atomically, in one round trip.
    pub async fn execute(&self, writes: &[KeyWrite]) -> Result<(), StoreError> {
        match self {
            Store::Redis(s) => s.execute(writes).await,
            Store::Memory(s) => {
                s.execute(writes);
                Ok(())
            }
            #[cfg(madsim)]
            Store::Sim(s) => s.execute(writes).await,
        }
    }

    /// Every field of a hash with its stored bytes.
    pub async fn read(&self, key: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        match self {
            Store::Redis(s) => s.read(key).await,
            Store::Memory(s) => Ok(s.read(key)),
            #[cfg(madsim)]
            Store::Sim(s) => s.read(key).await,
        }
    }

    /// The live fields of a hash at `now`: (field, payload without the expiry wrapper).
    pub async fn read_live(
        &self,
        key: &str,
        now: Time,
    ) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
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
    /// decides and deletes atomically; elsewhere each key is read, then each garbage field
    /// deleted only if it still holds the value that was judged garbage.
    pub async fn gc(&self, keys: &[String], now: Time) -> Result<usize, StoreError> {
        let mut n = 0;
        if let Store::Redis(s) = self {
            n = s.gc(keys, now).await?;
        } else {
            for key in keys {
                n += self.gc_by_compare_and_delete(key, now).await?;
            }
        }
        Ok(n)
    }

    /// GC of one key: read, judge, then delete each garbage field only if it still holds
    /// the value judged (Redis, which `gc` batches instead, would run its script).
    async fn gc_by_compare_and_delete(&self, key: &str, now: Time) -> Result<usize, StoreError> {
        let fields = self.read(key).await?;
        let garbage: Vec<(String, Vec<u8>)> = {
            let dead = kas_core::expiring::garbage_fields(
                fields.iter().map(|(f, v)| (f.as_str(), v.as_slice())),
                now,
            );
            fields
                .into_iter()
                .filter(|(f, _)| dead.contains(f))
                .collect()
        };
        match self {
            _ if garbage.is_empty() => Ok(0),
            Store::Redis(s) => s.gc(&[key.to_string()], now).await,
            Store::Memory(s) => Ok(s.delete_unchanged(key, &garbage)),
            #[cfg(madsim)]
            Store::Sim(s) => s.delete_unchanged(key, &garbage).await,
        }
    }

    /// Checks the store answers.
    pub async fn ping(&self) -> Result<(), StoreError> {
        match self {
            Store::Redis(s) => s.ping().await,
            Store::Memory(_) => Ok(()),
            #[cfg(madsim)]
            Store::Sim(s) => s.ping().await,
        }
    }

    /// Starts the pub-sub connection: subscribe through the handle, receive events.
    pub fn pubsub(&self) -> (PubSub, mpsc::Receiver<PubSubEvent>) {
        let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
        let (ev_tx, ev_rx) = mpsc::channel(1024);
        match self {
            Store::Redis(s) => s.spawn_pubsub(cmd_rx, ev_tx),
            Store::Memory(s) => s.spawn_pubsub(cmd_rx, ev_tx),
            #[cfg(madsim)]
            Store::Sim(s) => s.spawn_pubsub(cmd_rx, ev_tx),
        }
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
