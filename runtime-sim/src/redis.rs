//! The simulated Redis node: hashes with key expiry (passive on access, active every
//! 100 ms), each batch write applied atomically (with its conditional announcements), the
//! GC's compare-and-delete, and fire-and-forget pub-sub (a subscriber that is not
//! connected misses messages; every publication is logged for the checker). A restart
//! of the node loses every key, as a Redis without persistence does; a failover keeps
//! what its replica had (see [`Replica`]). The node also stands for a Redis Cluster of
//! [`SHARDS`] masters, one of which may fail over alone ([`RedisState::fail_shard`]).
//! Latency is injected per request through [`RedisKnobs`].

use crate::sim_store::{SimReply, SimRequest};
use kas_core::tracker::KeyWrite;
use kas_server::store::Keyspace;
use kas_server::store::slot::{SLOTS, slot};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::{Endpoint, Receiver, Sender};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Faults injected into the server, shared with the fault injector.
#[derive(Debug, Default)]
pub struct RedisKnobs {
    latency_ms: AtomicU64,
    /// The last slow spell: since when, and when it ended (`None` while it lasts).
    slow: Mutex<Option<(Instant, Option<Instant>)>>,
}

impl RedisKnobs {
    /// Every request waits this long before it is applied.
    pub fn set_latency(&self, latency: Duration) {
        self.latency_ms.store(
            u64::try_from(latency.as_millis()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        let now = Instant::now();
        let mut slow = self.slow.lock().unwrap_or_else(|p| p.into_inner());
        *slow = match *slow {
            Some((since, None)) if latency.is_zero() => Some((since, Some(now))),
            Some((since, None)) => Some((since, None)),
            _ if latency.is_zero() => *slow,
            _ => Some((now, None)),
        };
    }

    /// Whether requests were slowed at some moment between `from` and `to` (faults come
    /// one at a time, so the last slow spell is the only one that can overlap).
    pub fn slow_between(&self, from: Instant, to: Instant) -> bool {
        let slow = self.slow.lock().unwrap_or_else(|p| p.into_inner());
        slow.is_some_and(|(since, until)| since <= to && until.is_none_or(|u| u >= from))
    }

    fn latency(&self) -> Duration {
        Duration::from_millis(self.latency_ms.load(Ordering::Relaxed))
    }
}

/// The most writes a failover loses: the replica applies each write this long after the
/// master did. Sentinel may promote a replica that was cut off from its master for a
/// while (up to ten times `down-after-milliseconds`), so seconds of writes can go.
pub const MAX_REPLICATION_LAG: Duration = Duration::from_secs(8);

/// The masters of the cluster the node stands for; they split the slots in even ranges,
/// as `redis-cli --cluster create` does.
pub const SHARDS: u16 = 3;

/// The shard serving `key`, or a channel named like it.
pub fn shard(key: &str) -> u16 {
    slot(key) / SLOTS.div_ceil(SHARDS)
}

/// The answer to a request that needs a shard whose master is down.
fn shard_down(shard: u16) -> SimReply {
    SimReply::Failed(format!("shard {shard}'s master is down"))
}

/// The replica that Sentinel promotes in a failover. Replication is asynchronous, so the
/// promoted node lacks the master's last writes, acknowledged ones included: deletions
/// come back and writes vanish.
#[derive(Debug, Default)]
struct Replica {
    keyspace: Keyspace,
    /// The master's writes not yet applied here, with when the master applied them.
    backlog: VecDeque<(Instant, Write)>,
}

/// A write the replica repeats.
#[derive(Debug)]
enum Write {
    Execute(Vec<KeyWrite>),
    DeleteUnchanged(String, Vec<(String, Vec<u8>)>),
}

impl Replica {
    /// Applies the writes the master applied before `until`, at the master's times.
    fn catch_up(&mut self, until: Instant) {
        while self.backlog.front().is_some_and(|(at, _)| *at < until) {
            let (at, write) = self.backlog.pop_front().expect("a front entry");
            match write {
                Write::Execute(writes) => {
                    self.keyspace.execute(&writes, at);
                }
                Write::DeleteUnchanged(key, fields) => {
                    self.keyspace.delete_unchanged(&key, &fields, at);
                }
            }
        }
    }
}

/// The data of the server; readable from outside for the invariant checker.
#[derive(Debug, Default)]
pub struct Db {
    keyspace: Keyspace,
    subscribers: BTreeMap<u64, Subscriber>,
    next_subscriber: u64,
    published: Vec<(Instant, String)>,
    replica: Replica,
    /// What the node starts with next: a promoted replica's keys, or none (a restart).
    next_start: Option<Keyspace>,
    /// A shard whose master died, with the keys its replica takes over with.
    down: Option<(u16, Keyspace)>,
    /// When the data last changed behind the clients' backs (a failover's lost writes,
    /// records lost without a word).
    disturbed: Option<Instant>,
}

#[derive(Debug)]
struct Subscriber {
    channels: BTreeSet<String>,
    queue: mpsc::UnboundedSender<SimReply>,
}

impl Db {
    /// Live keys with their fields' names and stored bytes, as `--scan` and `HGETALL` would
    /// show them.
    pub fn entries(&self, now: Instant) -> BTreeMap<String, Vec<(String, Vec<u8>)>> {
        self.keyspace.entries(now)
    }

    /// Whether the data changed behind the clients' backs at `since` or later.
    pub fn disturbed_since(&self, since: Instant) -> bool {
        self.disturbed.is_some_and(|at| at >= since)
    }

    /// When the first message on `channel` was published (since the last restart).
    pub fn first_publication(&self, channel: &str) -> Option<Instant> {
        self.published
            .iter()
            .find(|(_, c)| c == channel)
            .map(|(at, _)| *at)
    }

    /// The shard whose master is down, if `name` is on it.
    fn down_for(&self, name: &str) -> Option<u16> {
        self.down
            .as_ref()
            .map(|(s, _)| *s)
            .filter(|s| shard(name) == *s)
    }

    fn apply(&mut self, request: SimRequest, now: Instant) -> Option<SimReply> {
        Some(match request {
            SimRequest::Execute(writes) => {
                // A batch goes out as one script call per master: the live masters' calls
                // succeed, the dead one's fails.
                let (writes, refused): (Vec<KeyWrite>, Vec<KeyWrite>) = writes
                    .into_iter()
                    .partition(|w| self.down_for(&w.key).is_none());
                for (channel, payload) in self.keyspace.execute(&writes, now) {
                    self.published.push((now, channel.clone()));
                    self.publish(&channel, payload);
                }
                self.replica
                    .backlog
                    .push_back((now, Write::Execute(writes)));
                match self.down.as_ref().filter(|_| !refused.is_empty()) {
                    Some((down, _)) => shard_down(*down),
                    None => SimReply::Done,
                }
            }
            SimRequest::Read(key) => match self.down_for(&key) {
                Some(down) => shard_down(down),
                None => SimReply::Hash(self.keyspace.read(&key, now)),
            },
            SimRequest::DeleteUnchanged(key, fields) => {
                if let Some(down) = self.down_for(&key) {
                    return Some(shard_down(down));
                }
                let deleted = self.keyspace.delete_unchanged(&key, &fields, now);
                let write = Write::DeleteUnchanged(key, fields);
                self.replica.backlog.push_back((now, write));
                SimReply::Deleted(deleted)
            }
            // `PING` goes to every master.
            SimRequest::Ping => match &self.down {
                Some((down, _)) => shard_down(*down),
                None => SimReply::Done,
            },
            // Handled by the connection, which owns the subscriber.
            SimRequest::Subscribe(_) | SimRequest::Unsubscribe(_) => return None,
        })
    }

    /// `SUBSCRIBE` on the connection that is (or becomes) `subscriber`.
    fn subscribe(
        &mut self,
        subscriber: &mut Option<u64>,
        queue: &mpsc::UnboundedSender<SimReply>,
        channel: String,
    ) -> SimReply {
        if let Some(down) = self.down_for(&channel) {
            return shard_down(down);
        }
        let id = *subscriber.get_or_insert_with(|| {
            self.next_subscriber += 1;
            self.next_subscriber
        });
        self.subscribers
            .entry(id)
            .or_insert_with(|| Subscriber {
                channels: BTreeSet::new(),
                queue: queue.clone(),
            })
            .channels
            .insert(channel.clone());
        SimReply::Subscribed(channel)
    }

    fn publish(&mut self, channel: &str, payload: Vec<u8>) {
        for s in self.subscribers.values() {
            if s.channels.contains(channel) {
                let _ = s
                    .queue
                    .send(SimReply::Message(channel.to_string(), payload.clone()));
            }
        }
    }
}

/// A handle on the node's data that survives restarts (each restart empties it).
#[derive(Clone, Debug, Default)]
pub struct RedisState {
    db: Arc<Mutex<Db>>,
    /// The injected faults.
    pub knobs: Arc<RedisKnobs>,
}

impl RedisState {
    /// Reads the data.
    pub fn with_db<T>(&self, f: impl FnOnce(&Db) -> T) -> T {
        f(&self.lock())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Db> {
        self.db.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes the node's next start a failover (call it with the node down): it starts
    /// with its replica's keys, which lack the writes of the last `lost` (at most
    /// [`MAX_REPLICATION_LAG`]).
    pub fn fail_over(&self, lost: Duration) {
        let now = Instant::now();
        let mut db = self.lock();
        db.replica.catch_up(now.checked_sub(lost).unwrap_or(now));
        db.next_start = Some(std::mem::take(&mut db.replica.keyspace));
        db.disturbed = Some(now);
    }

    /// Kills the master of `shard`, whose replica lacks the writes of the last `lost` (at
    /// most [`MAX_REPLICATION_LAG`]), until [`Self::promote`]. Meanwhile the requests that
    /// need the shard fail and the others succeed; subscribers listening on it are cut
    /// off, the others fail their next `PING`.
    pub fn fail_shard(&self, shard: u16, lost: Duration) {
        let now = Instant::now();
        let mut db = self.lock();
        db.replica.catch_up(now.checked_sub(lost).unwrap_or(now));
        db.down = Some((shard, db.replica.keyspace.clone()));
        db.disturbed = Some(now);
        for s in db.subscribers.values() {
            if s.channels.iter().any(|c| self::shard(c) == shard) {
                let _ = s.queue.send(shard_down(shard));
            }
        }
    }

    /// Deletes the fields that `pick(key, field)` picks, on the master and its replica
    /// alike (as an eviction does), telling no one.
    pub fn lose(&self, pick: impl Fn(&str, &str) -> bool) {
        let now = Instant::now();
        let mut db = self.lock();
        let db = &mut *db;
        db.disturbed = Some(now);
        for keyspace in [&mut db.keyspace, &mut db.replica.keyspace] {
            let writes: Vec<KeyWrite> = keyspace
                .entries(now)
                .into_iter()
                .filter_map(|(key, fields)| {
                    let delete: Vec<String> = fields
                        .into_iter()
                        .map(|(f, _)| f)
                        .filter(|f| pick(&key, f))
                        .collect();
                    (!delete.is_empty()).then(|| KeyWrite {
                        key,
                        delete,
                        set: Vec::new(),
                        expire: kas_core::tracker::KeyExpiry::Keep,
                        publish: Vec::new(),
                        announce: Vec::new(),
                    })
                })
                .collect();
            keyspace.execute(&writes, now);
        }
    }

    /// The down shard's replica becomes its master: the shard's keys are what it held.
    pub fn promote(&self) {
        let mut db = self.lock();
        let Some((shard, promoted)) = db.down.take() else {
            return;
        };
        db.disturbed = Some(Instant::now());
        db.keyspace
            .restore(&promoted, |key| self::shard(key) == shard);
        // The new masters' replicas start in step with them.
        db.replica = Replica {
            keyspace: db.keyspace.clone(),
            backlog: VecDeque::new(),
        };
    }

    /// Runs the server on `addr` (the node's init): starts empty, or with the promoted
    /// replica's keys after [`Self::fail_over`], then serves forever.
    pub async fn serve(self, addr: SocketAddr) {
        {
            let mut db = self.lock();
            let keyspace = db.next_start.take().unwrap_or_default();
            *db = Db::default();
            db.replica.keyspace = keyspace.clone();
            db.keyspace = keyspace;
            db.disturbed = Some(Instant::now());
        }
        let endpoint = Endpoint::bind(addr)
            .await
            .expect("redis node binds its address");
        let sweeper = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let now = Instant::now();
                let mut db = sweeper.lock();
                db.keyspace.sweep(now);
                db.replica
                    .catch_up(now.checked_sub(MAX_REPLICATION_LAG).unwrap_or(now));
            }
        });
        while let Ok((tx, rx, _)) = endpoint.accept1().await {
            tokio::spawn(self.clone().connection(tx, rx));
        }
    }

    /// Serves one connection: requests in order; once subscribed, also pushes messages. A
    /// failed request closes it.
    async fn connection(self, tx: Sender, mut rx: Receiver) {
        let (queue, mut pushed) = mpsc::unbounded_channel();
        let mut subscriber: Option<u64> = None;
        loop {
            tokio::select! {
                biased;
                request = rx.recv() => {
                    let Ok(payload) = request else { break };
                    let Ok(request) = payload.downcast::<SimRequest>() else { break };
                    let latency = self.knobs.latency();
                    if !latency.is_zero() {
                        tokio::time::sleep(latency).await;
                    }
                    let reply = match *request {
                        SimRequest::Subscribe(ch) => {
                            Some(self.lock().subscribe(&mut subscriber, &queue, ch))
                        }
                        SimRequest::Unsubscribe(ch) => {
                            if let Some(id) = subscriber
                                && let Some(s) = self.lock().subscribers.get_mut(&id)
                            {
                                s.channels.remove(&ch);
                            }
                            None
                        }
                        other => self.lock().apply(other, Instant::now()),
                    };
                    if let Some(reply) = reply
                        && !send(&tx, reply).await
                    {
                        break;
                    }
                }
                Some(message) = pushed.recv() => {
                    if !send(&tx, message).await {
                        break;
                    }
                }
            }
        }
        if let Some(id) = subscriber {
            self.lock().subscribers.remove(&id);
        }
    }
}

/// Sends `reply`; whether the connection stays open.
async fn send(tx: &Sender, reply: SimReply) -> bool {
    let failed = matches!(reply, SimReply::Failed(_));
    tx.send(Box::new(reply)).await.is_ok() && !failed
}
