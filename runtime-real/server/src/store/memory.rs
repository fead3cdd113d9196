//! The in-memory store of a kas that runs alone.

use super::{Backend, CompareAndDelete, Fields, PubSubCommand, PubSubEvent, StoreError};
use futures::future::BoxFuture;
use kas_core::Time;
use kas_core::tracker::KeyWrite;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;

/// One hash and its key's expiry.
#[derive(Clone, Debug, Default)]
struct Hash {
    fields: BTreeMap<String, Vec<u8>>,
    expires: Option<Instant>,
}

impl Hash {
    fn live(&self, now: Instant) -> bool {
        self.expires.is_none_or(|at| at > now)
    }
}

/// Hashes under key expiry, kept as Redis keeps them: the data of the in-memory store and
/// of the simulated Redis node. Expired keys vanish when touched and at each `sweep`.
#[derive(Clone, Debug, Default)]
pub struct Keyspace {
    hashes: BTreeMap<String, Hash>,
}

impl Keyspace {
    /// Drops `key` if it has expired.
    fn expire(&mut self, key: &str, now: Instant) {
        if self.hashes.get(key).is_some_and(|h| !h.live(now)) {
            self.hashes.remove(key);
        }
    }

    /// Applies each write as one transaction (`HDEL; HSET; PEXPIRE` as its `expire` says;
    /// `PUBLISH`, then the announcements if `HSET` created a field) at `now`; returns the
    /// messages to publish, in order.
    pub fn execute(&mut self, writes: &[KeyWrite], now: Instant) -> Vec<(String, Vec<u8>)> {
        let mut publish = Vec::new();
        for w in writes {
            self.hdel(&w.key, &w.delete, now);
            let created = self.hset(&w.key, &w.set, now) > 0;
            if let Some(ttl) = w.expire.ttl(created) {
                self.pexpire(&w.key, ttl, now);
            }
            publish.extend(w.publish.iter().cloned());
            if created {
                publish.extend(w.announce.iter().cloned());
            }
        }
        publish
    }

    /// `HDEL key fields..`: how many went. A hash left empty goes, as in Redis.
    pub fn hdel(&mut self, key: &str, fields: &[String], now: Instant) -> usize {
        self.expire(key, now);
        let Some(h) = self.hashes.get_mut(key) else {
            return 0;
        };
        let n = fields
            .iter()
            .filter(|f| h.fields.remove(*f).is_some())
            .count();
        if h.fields.is_empty() {
            self.hashes.remove(key);
        }
        n
    }

    /// `HSET key field value..`: how many fields it created.
    pub fn hset(&mut self, key: &str, pairs: &[(String, Vec<u8>)], now: Instant) -> usize {
        if pairs.is_empty() {
            return 0;
        }
        self.expire(key, now);
        let h = self.hashes.entry(key.to_string()).or_default();
        pairs
            .iter()
            .filter(|(f, v)| h.fields.insert(f.clone(), v.clone()).is_none())
            .count()
    }

    /// `PEXPIRE key ttl`: whether the key exists.
    pub fn pexpire(&mut self, key: &str, ttl: std::time::Duration, now: Instant) -> bool {
        self.expire(key, now);
        self.hashes
            .get_mut(key)
            .map(|h| h.expires = Some(now + ttl))
            .is_some()
    }

    /// `HGETALL key`.
    pub fn read(&mut self, key: &str, now: Instant) -> Vec<(String, Vec<u8>)> {
        self.expire(key, now);
        self.hashes
            .get(key)
            .map(|h| {
                h.fields
                    .iter()
                    .map(|(f, v)| (f.clone(), v.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Deletes each field only while it still holds the given value; returns how many went.
    pub fn delete_unchanged(
        &mut self,
        key: &str,
        fields: &[(String, Vec<u8>)],
        now: Instant,
    ) -> usize {
        self.expire(key, now);
        let Some(h) = self.hashes.get_mut(key) else {
            return 0;
        };
        let mut n = 0;
        for (f, v) in fields {
            if h.fields.get(f) == Some(v) {
                h.fields.remove(f);
                n += 1;
            }
        }
        if h.fields.is_empty() {
            self.hashes.remove(key);
        }
        n
    }

    /// Drops every expired key (Redis's active expiry).
    pub fn sweep(&mut self, now: Instant) {
        self.hashes.retain(|_, h| h.live(now));
    }

    /// Makes the keys that `which` picks hold what they hold in `from` (or nothing): a
    /// promoted replica taking over one shard of a cluster (the simulation's Redis).
    pub fn restore(&mut self, from: &Keyspace, which: impl Fn(&str) -> bool) {
        self.hashes.retain(|key, _| !which(key));
        let restored = from.hashes.iter().filter(|(key, _)| which(key));
        self.hashes
            .extend(restored.map(|(key, hash)| (key.clone(), hash.clone())));
    }

    /// Live keys with their fields' names and stored bytes.
    pub fn entries(&self, now: Instant) -> BTreeMap<String, Vec<(String, Vec<u8>)>> {
        self.hashes
            .iter()
            .filter(|(_, h)| h.live(now))
            .map(|(k, h)| {
                let fields = h.fields.iter().map(|(f, v)| (f.clone(), v.clone()));
                (k.clone(), fields.collect())
            })
            .collect()
    }
}

/// Hashes with key expiry and a pub-sub bus, in this process.
#[derive(Clone)]
pub struct MemoryStore {
    keyspace: Arc<Mutex<Keyspace>>,
    bus: broadcast::Sender<(String, Vec<u8>)>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore {
            keyspace: Arc::default(),
            bus: broadcast::channel(4096).0,
        }
    }
}

impl MemoryStore {
    pub(super) fn execute(&self, writes: &[KeyWrite]) {
        let published = self.lock().execute(writes, Instant::now());
        for message in published {
            // No receiver is not an error: pub-sub is fire-and-forget.
            let _ = self.bus.send(message);
        }
    }

    pub(super) fn read(&self, key: &str) -> Vec<(String, Vec<u8>)> {
        self.lock().read(key, Instant::now())
    }

    pub(super) fn delete_unchanged(&self, key: &str, fields: &[(String, Vec<u8>)]) -> usize {
        self.lock().delete_unchanged(key, fields, Instant::now())
    }

    pub(super) fn spawn_pubsub(
        &self,
        mut cmds: mpsc::UnboundedReceiver<PubSubCommand>,
        events: mpsc::Sender<PubSubEvent>,
    ) {
        let mut bus = self.bus.subscribe();
        tokio::spawn(async move {
            let mut channels = BTreeSet::new();
            if events.send(PubSubEvent::Up).await.is_err() {
                return;
            }
            loop {
                tokio::select! {
                    biased;
                    cmd = cmds.recv() => match cmd {
                        None => return,
                        Some(PubSubCommand::Subscribe(ch)) => {
                            channels.insert(ch.clone());
                            if events.send(PubSubEvent::Subscribed(ch)).await.is_err() {
                                return;
                            }
                        }
                        Some(PubSubCommand::Unsubscribe(ch)) => {
                            channels.remove(&ch);
                        }
                    },
                    msg = bus.recv() => {
                        let event = match msg {
                            Ok((channel, payload)) if channels.contains(&channel) => {
                                PubSubEvent::Message { channel, payload }
                            }
                            Ok(_) => continue,
                            // Messages were missed: as after a reconnection.
                            Err(broadcast::error::RecvError::Lagged(_)) => PubSubEvent::Up,
                            Err(broadcast::error::RecvError::Closed) => return,
                        };
                        if events.send(event).await.is_err() {
                            return;
                        }
                    }
                }
            }
        });
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Keyspace> {
        self.keyspace.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Backend for MemoryStore {
    fn execute<'a>(&'a self, writes: &'a [KeyWrite]) -> BoxFuture<'a, Result<(), StoreError>> {
        MemoryStore::execute(self, writes);
        Box::pin(async { Ok(()) })
    }

    fn read<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Fields> {
        let fields = MemoryStore::read(self, key);
        Box::pin(async { Ok(fields) })
    }

    fn gc<'a>(&'a self, keys: &'a [String], now: Time) -> BoxFuture<'a, Result<usize, StoreError>> {
        Box::pin(super::gc_key_by_key(self, keys, now))
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async { Ok(()) })
    }

    fn spawn_pubsub(
        &self,
        cmds: mpsc::UnboundedReceiver<PubSubCommand>,
        events: mpsc::Sender<PubSubEvent>,
    ) {
        MemoryStore::spawn_pubsub(self, cmds, events);
    }
}

impl CompareAndDelete for MemoryStore {
    fn delete_unchanged<'a>(
        &'a self,
        key: &'a str,
        garbage: &'a [(String, Vec<u8>)],
    ) -> BoxFuture<'a, Result<usize, StoreError>> {
        let n = MemoryStore::delete_unchanged(self, key, garbage);
        Box::pin(async move { Ok(n) })
    }
}
