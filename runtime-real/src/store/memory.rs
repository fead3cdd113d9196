//! The in-memory store of a kas that runs alone.

use super::{PubSubCommand, PubSubEvent};
use kas_core::tracker::KeyWrite;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;

#[derive(Default)]
struct Hash {
    fields: HashMap<String, Vec<u8>>,
    expires: Option<Instant>,
}

/// Hashes with key expiry and a pub-sub bus, in this process.
#[derive(Clone)]
pub struct MemoryStore {
    hashes: Arc<Mutex<HashMap<String, Hash>>>,
    bus: broadcast::Sender<(String, Vec<u8>)>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore {
            hashes: Arc::default(),
            bus: broadcast::channel(4096).0,
        }
    }
}

impl MemoryStore {
    pub(super) fn execute(&self, writes: &[KeyWrite]) {
        let now = Instant::now();
        let mut hashes = self.lock();
        for w in writes {
            let h = hashes.entry(w.key.clone()).or_default();
            if h.expires.is_some_and(|at| at <= now) {
                *h = Hash::default();
            }
            for f in &w.delete {
                h.fields.remove(f);
            }
            for (f, v) in &w.set {
                h.fields.insert(f.clone(), v.clone());
            }
            if let Some(ttl) = w.expire {
                h.expires = Some(now + ttl);
            }
            if h.fields.is_empty() {
                hashes.remove(&w.key);
            }
            for (channel, payload) in &w.publish {
                // No receiver is not an error: pub-sub is fire-and-forget.
                let _ = self.bus.send((channel.clone(), payload.clone()));
            }
        }
    }

    pub(super) fn read(&self, key: &str) -> Vec<(String, Vec<u8>)> {
        let now = Instant::now();
        self.lock()
            .get(key)
            .filter(|h| h.expires.is_none_or(|at| at > now))
            .map(|h| {
                h.fields
                    .iter()
                    .map(|(f, v)| (f.clone(), v.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    pub(super) fn delete_unchanged(&self, key: &str, fields: &[(String, Vec<u8>)]) -> usize {
        let mut hashes = self.lock();
        let Some(h) = hashes.get_mut(key) else {
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
            hashes.remove(key);
        }
        n
    }

    pub(super) fn spawn_pubsub(
        &self,
        mut cmds: mpsc::UnboundedReceiver<PubSubCommand>,
        events: mpsc::Sender<PubSubEvent>,
    ) {
        let mut bus = self.bus.subscribe();
        tokio::spawn(async move {
            let mut channels = HashSet::new();
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
                            Err(broadcast::error::RecvError::Lagged(_)) => PubSubEvent::Reconnected,
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

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Hash>> {
        self.hashes.lock().unwrap_or_else(|p| p.into_inner())
    }
}
