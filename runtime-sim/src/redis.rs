//! The simulated Redis node: it speaks RESP ([`resp`]) and answers the commands the
//! production Redis store sends (`HGETALL`, `PING`, `SCRIPT LOAD`, `EVALSHA`, `EVAL`,
//! `SUBSCRIBE`), running the store's Lua scripts as Redis does ([`script`]) over hashes
//! with key expiry (passive on access, active every 100 ms), and fire-and-forget pub-sub (a
//! subscriber that is not connected misses messages; every publication is logged for the
//! checker). A restart of the node loses every key and script, as a Redis without
//! persistence does; a failover keeps what its replica had (see [`Replica`]). The data also
//! serves a Redis Cluster of [`SHARDS`] masters, one node each ([`RedisState::shard_nodes`]):
//! a node serves the keys of its slots ([`slots`]) and redirects the others (`MOVED`,
//! `ASK` while a range moves), a script fails at the first key its node does not serve,
//! keeping what it wrote before, and sharded pub-sub lives on the channel's shard. A
//! shard's master may fail over alone ([`RedisState::fail_shard`]). Latency is injected
//! per request through [`RedisKnobs`].

mod announced;
mod resp;
mod script;
pub mod slots;

use self::announced::Announcements;
pub use self::resp::Reply;
use self::script::Scripts;
use self::slots::SlotTable;
pub use self::slots::{SHARDS, node_address, shard_address};
use kas_core::tracker::KeyWrite;
use kas_server::buggify::{self, Point};
use kas_server::store::Keyspace;
use kas_server::store::slot::{SLOTS, slot};
use madsim::rand::{Rng, thread_rng};
use madsim::runtime::{Handle, NodeHandle};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::SocketAddr;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::{Endpoint, Receiver, Sender};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// A stall of the node (see [`RedisKnobs::stall`]).
#[derive(Debug, Default)]
enum Stall {
    #[default]
    None,
    /// Begins, lasting this long, at the next script call naming an agent's record.
    Armed(Duration),
    /// Under way until then.
    Until(Instant),
}

/// How long an armed stall waits for its request.
const STALL_ARMED: Duration = Duration::from_secs(5);

/// What the keys of agents' records hold (`P:agent:{agent:N}`).
const AGENT_KEY: &[u8] = b":agent:{agent:";

/// How a script call (the store's writes, its collections) starts, as RESP.
const SCRIPT: &[u8] = b"$7\r\nEVALSHA\r\n";

/// Faults injected into the server, shared with the fault injector.
#[derive(Debug, Default)]
pub struct RedisKnobs {
    latency_ms: AtomicU64,
    /// The last slow spell: since when, and when it ended (`None` while it lasts).
    slow: Mutex<Option<(Instant, Option<Instant>)>>,
    /// A stall: armed, or under way until its end.
    stall: Mutex<Stall>,
    /// Each cut of a client's path to Redis (packets dropped without a word): the client,
    /// since when, and until when (`None` while it lasts). madsim refuses a connection
    /// across a clogged link at once, where TCP would retry its SYN until the caller's
    /// timeout, so the simulation's dialler asks here.
    cut_off: Mutex<Vec<(IpAddr, Instant, Option<Instant>)>>,
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

    /// The node answers nothing for `lasting` from the next script call that touches an
    /// agent's record (a refresh, most often), then everything at once (a fork under memory
    /// pressure, a slow script); a slow spell for [`Self::slow_between`]. Gives up when
    /// no such request comes within [`STALL_ARMED`].
    pub async fn stall(&self, lasting: Duration) {
        let armed = Instant::now();
        *self.stall.lock().unwrap_or_else(|p| p.into_inner()) = Stall::Armed(lasting);
        *self.slow.lock().unwrap_or_else(|p| p.into_inner()) = Some((armed, None));
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let stall = self.stall.lock().unwrap_or_else(|p| p.into_inner());
            match *stall {
                Stall::Until(end) if Instant::now() >= end => break,
                Stall::Armed(_) if armed.elapsed() >= STALL_ARMED => break,
                _ => {}
            }
        }
        *self.stall.lock().unwrap_or_else(|p| p.into_inner()) = Stall::None;
        *self.slow.lock().unwrap_or_else(|p| p.into_inner()) = Some((armed, Some(Instant::now())));
    }

    /// Waits out a stall; `request` starts an armed one if it is a script call naming an
    /// agent's record.
    async fn stalled(&self, request: &[u8]) {
        let until = {
            let mut stall = self.stall.lock().unwrap_or_else(|p| p.into_inner());
            match *stall {
                Stall::Armed(lasting)
                    if request.windows(SCRIPT.len()).any(|w| w == SCRIPT)
                        && request.windows(AGENT_KEY.len()).any(|w| w == AGENT_KEY) =>
                {
                    let end = Instant::now() + lasting;
                    *stall = Stall::Until(end);
                    Some(end)
                }
                Stall::Until(end) => Some(end),
                _ => None,
            }
        };
        if let Some(until) = until {
            tokio::time::sleep_until(until).await;
        }
    }

    /// Packets between `client` and Redis are dropped (`true`) or flow again (`false`).
    pub fn cut_off(&self, client: IpAddr, cut: bool) {
        let now = Instant::now();
        let mut spells = self.cut_off.lock().unwrap_or_else(|p| p.into_inner());
        if cut {
            spells.push((client, now, None));
        } else {
            for (c, _, until) in spells.iter_mut() {
                if *c == client && until.is_none() {
                    *until = Some(now);
                }
            }
        }
    }

    /// Whether packets between `client` and Redis are dropped.
    pub fn is_cut_off(&self, client: IpAddr) -> bool {
        self.cut_between(client, Instant::now(), Instant::now())
    }

    /// Whether `client`'s path to Redis was cut off at some moment between `from` and
    /// `to`.
    pub fn cut_between(&self, client: IpAddr, from: Instant, to: Instant) -> bool {
        let spells = self.cut_off.lock().unwrap_or_else(|p| p.into_inner());
        spells
            .iter()
            .any(|&(c, since, until)| c == client && since <= to && until.is_none_or(|u| u >= from))
    }
}

/// The most writes a failover loses: the replica applies each write this long after the
/// master did. Sentinel may promote a replica that was cut off from its master for a
/// while (up to ten times `down-after-milliseconds`), so seconds of writes can go.
pub const MAX_REPLICATION_LAG: Duration = Duration::from_secs(8);

/// The answer to a request that needs a shard whose master is down.
fn shard_down(shard: u16) -> Reply {
    Reply::Error(format!("CLUSTERDOWN shard {shard}'s master is down"))
}

/// The replica that Sentinel promotes in a failover. Replication is asynchronous, so the
/// promoted node lacks the master's last writes, acknowledged ones included: deletions
/// come back and writes vanish.
#[derive(Debug, Default)]
struct Replica {
    keyspace: Keyspace,
    /// The master's writes not yet applied here, with when the master applied them.
    backlog: VecDeque<(Instant, Effect)>,
}

/// A write the replica repeats: a script's effects, command by command, as Redis 7
/// replicates them.
#[derive(Debug)]
enum Effect {
    Hdel(String, Vec<String>),
    Hset(String, Vec<(String, Vec<u8>)>),
    Pexpire(String, Duration),
}

impl Replica {
    /// Applies the writes the master applied before `until`, at the master's times.
    fn catch_up(&mut self, until: Instant) {
        while self.backlog.front().is_some_and(|(at, _)| *at < until) {
            let (at, effect) = self.backlog.pop_front().expect("a front entry");
            match effect {
                Effect::Hdel(key, fields) => {
                    self.keyspace.hdel(&key, &fields, at);
                }
                Effect::Hset(key, pairs) => {
                    self.keyspace.hset(&key, &pairs, at);
                }
                Effect::Pexpire(key, ttl) => {
                    self.keyspace.pexpire(&key, ttl, at);
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
    /// On a cluster, which shard serves each slot.
    slots: SlotTable,
    /// Tunnel records owed an announcement (invariant 15); kept across restarts.
    announcements: Announcements,
}

#[derive(Debug)]
struct Subscriber {
    channels: BTreeSet<String>,
    queue: mpsc::UnboundedSender<Reply>,
    /// The shard whose node it is connected to, if it subscribed with `SSUBSCRIBE`.
    shard: Option<u16>,
}

/// Where a command arrives on a cluster: the shard's node, and whether it follows `ASKING`.
#[derive(Clone, Copy, Debug)]
struct At {
    shard: u16,
    asking: bool,
}

/// Which node a connection reached.
#[derive(Clone, Copy, Debug)]
enum Role {
    /// One of [`NODES`]: the single server or Sentinel's master, or its replica.
    Node(usize),
    /// A cluster shard's node ([`slots::node_address`]): its master, or its replica.
    Shard(u16, u8),
}

/// The UTF-8 text of an argument (keys, fields and channels are text here).
fn text(arg: &[u8]) -> String {
    String::from_utf8_lossy(arg).into_owned()
}

fn wrong_arity(name: &str) -> Reply {
    Reply::Error(format!(
        "ERR wrong number of arguments for '{}' command",
        name.to_lowercase()
    ))
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

    /// Invariant 15's violations: tunnel records made live and never announced.
    pub fn unannounced(&self) -> Vec<String> {
        self.announcements.violations().to_vec()
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
            .filter(|s| self.slots.owner(name) == *s)
    }

    /// The shard serving `key` (or a channel named like it).
    pub fn shard(&self, key: &str) -> u16 {
        self.slots.owner(key)
    }

    /// A command on the data, sent by a client or by a script's `redis.call`.
    fn data(&mut self, args: &[Vec<u8>], now: Instant) -> Reply {
        let name = text(&args[0]).to_uppercase();
        let Some(key) = args.get(1).map(|k| text(k)) else {
            return wrong_arity(&name);
        };
        if !name.ends_with("PUBLISH")
            && let Some(down) = self.down_for(&key)
        {
            return shard_down(down);
        }
        let rest = &args[2..];
        let keyspace = &mut self.keyspace;
        self.announcements.judge(now, |key, field| {
            let fields = keyspace.read(key, now);
            fields.into_iter().find(|(f, _)| f == field).map(|(_, v)| v)
        });
        match name.as_str() {
            "HGETALL" if rest.is_empty() => Reply::Array(
                self.keyspace
                    .read(&key, now)
                    .into_iter()
                    .flat_map(|(f, v)| [Reply::bulk(f), Reply::Bulk(v)])
                    .collect(),
            ),
            "HDEL" if !rest.is_empty() => {
                let fields: Vec<String> = rest.iter().map(|f| text(f)).collect();
                let n = self.keyspace.hdel(&key, &fields, now);
                self.replica
                    .backlog
                    .push_back((now, Effect::Hdel(key, fields)));
                Reply::Int(n as i64)
            }
            "HSET" if !rest.is_empty() && rest.len().is_multiple_of(2) => {
                let pairs: Vec<(String, Vec<u8>)> = rest
                    .chunks(2)
                    .map(|p| (text(&p[0]), p[1].clone()))
                    .collect();
                let keyspace = &mut self.keyspace;
                self.announcements
                    .written(&key, &pairs, || keyspace.read(&key, now), now);
                let n = self.keyspace.hset(&key, &pairs, now);
                self.replica
                    .backlog
                    .push_back((now, Effect::Hset(key, pairs)));
                Reply::Int(n as i64)
            }
            "PEXPIRE" if rest.len() == 1 => {
                let Ok(ms) = text(&rest[0]).parse::<i64>() else {
                    return Reply::Error("ERR value is not an integer or out of range".into());
                };
                // A time not in the future expires the key at once, as in Redis.
                let ttl = Duration::from_millis(u64::try_from(ms).unwrap_or(0));
                let set = self.keyspace.pexpire(&key, ttl, now);
                self.replica
                    .backlog
                    .push_back((now, Effect::Pexpire(key, ttl)));
                Reply::Int(i64::from(set))
            }
            "PUBLISH" | "SPUBLISH" if rest.len() == 1 => {
                self.published.push((now, key.clone()));
                self.announcements.published(&key);
                Reply::Int(self.publish(&key, rest[0].clone(), name == "SPUBLISH"))
            }
            "HGETALL" | "HDEL" | "HSET" | "PEXPIRE" | "PUBLISH" | "SPUBLISH" => wrong_arity(&name),
            _ => Reply::Error(format!("ERR unknown command '{}'", name.to_lowercase())),
        }
    }

    /// `SUBSCRIBE channel` (or on a shard's node `SSUBSCRIBE`) on the connection that is
    /// (or becomes) `subscriber`.
    fn subscribe(
        &mut self,
        subscriber: &mut Option<u64>,
        queue: &mpsc::UnboundedSender<Reply>,
        channel: String,
        shard: Option<u16>,
    ) -> Reply {
        if let Some(down) = self.down_for(&channel) {
            return shard_down(down);
        }
        if let Some(shard) = shard
            && let Err(refusal) = self.slots.check_channel(shard, &channel, false)
        {
            return refusal.reply();
        }
        let id = *subscriber.get_or_insert_with(|| {
            self.next_subscriber += 1;
            self.next_subscriber
        });
        let s = self.subscribers.entry(id).or_insert_with(|| Subscriber {
            channels: BTreeSet::new(),
            queue: queue.clone(),
            shard,
        });
        s.channels.insert(channel.clone());
        let count = s.channels.len() as i64;
        let kind = if shard.is_some() {
            "ssubscribe"
        } else {
            "subscribe"
        };
        Reply::Array(vec![
            Reply::bulk(kind),
            Reply::bulk(channel),
            Reply::Int(count),
        ])
    }

    /// `UNSUBSCRIBE channel` (`SUNSUBSCRIBE` when `sharded`).
    fn unsubscribe(&mut self, subscriber: Option<u64>, channel: String, sharded: bool) -> Reply {
        let s = subscriber.and_then(|id| self.subscribers.get_mut(&id));
        let count = s.map_or(0, |s| {
            s.channels.remove(&channel);
            s.channels.len() as i64
        });
        let kind = if sharded {
            "sunsubscribe"
        } else {
            "unsubscribe"
        };
        Reply::Array(vec![
            Reply::bulk(kind),
            Reply::bulk(channel),
            Reply::Int(count),
        ])
    }

    /// Pushes `payload` to the subscribers of `channel` (the sharded ones for `SPUBLISH`);
    /// how many there were.
    fn publish(&mut self, channel: &str, payload: Vec<u8>, sharded: bool) -> i64 {
        let mut n = 0;
        let kind = if sharded { "smessage" } else { "message" };
        for s in self.subscribers.values() {
            if s.channels.contains(channel) && s.shard.is_some() == sharded {
                n += 1;
                let _ = s.queue.send(Reply::Array(vec![
                    Reply::bulk(kind),
                    Reply::bulk(channel),
                    Reply::Bulk(payload.clone()),
                ]));
            }
        }
        n
    }
}

/// The addresses of the simulated Redis nodes: the master, and the replica Sentinel may
/// promote.
pub const NODES: [SocketAddr; 2] = [
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)), 6379),
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 4)), 6379),
];

/// Where the sentinels answer, and the name they know the master by.
pub const SENTINEL: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 5)), 26379);
/// `redis.sentinel.master_name`.
pub const MASTER_NAME: &str = "kas";

/// A handle on the data that survives restarts (each restart of the master empties it),
/// and on which node is the master and which one the sentinels name.
#[derive(Clone, Debug, Default)]
pub struct RedisState {
    db: Arc<Mutex<Db>>,
    scripts: Arc<Mutex<Scripts>>,
    /// Which of [`NODES`] is the master; the other answers as a replica (`READONLY`).
    master: Arc<AtomicUsize>,
    /// Which of [`NODES`] the sentinels name: the master, or for a while after a failover
    /// the one before it.
    named: Arc<AtomicUsize>,
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

    /// Answers one command that is not about pub-sub, arriving at a cluster's node `at`
    /// or (`None`) at the single server.
    fn command(&self, args: &[Vec<u8>], now: Instant, at: Option<At>) -> Reply {
        let name = text(&args[0]).to_uppercase();
        let mut scripts = self.scripts.lock().unwrap_or_else(|p| p.into_inner());
        let mut db = self.lock();
        // Whether the node serves `key`, or the redirection it answers.
        let served = |db: &Db, command: &[u8], key: &[u8]| match at {
            Some(at) if text(command).to_lowercase().ends_with("publish") => {
                db.slots.check_channel(at.shard, &text(key), at.asking)
            }
            Some(at) => db.slots.check(at.shard, &text(key), at.asking),
            None => Ok(()),
        };
        let (sha, args) = match (name.as_str(), args.len()) {
            // `PING` goes to every master.
            ("PING", 1) => {
                return match &db.down {
                    Some((down, _)) if at.is_none_or(|at| at.shard == *down) => shard_down(*down),
                    _ => Reply::Status("PONG"),
                };
            }
            ("CLUSTER", 2) if text(&args[1]).eq_ignore_ascii_case("slots") && at.is_some() => {
                return db.slots.slots_reply();
            }
            ("SCRIPT", 3) if text(&args[1]).eq_ignore_ascii_case("load") => {
                return Reply::bulk(scripts.load(&args[2]));
            }
            ("EVALSHA", 3..) => (args[1].clone(), &args[2..]),
            ("EVAL", 3..) => (scripts.load(&args[1]).into_bytes(), &args[2..]),
            ("PING" | "SCRIPT" | "EVALSHA" | "EVAL", _) => return wrong_arity(&name),
            (_, 2..) => {
                if let Err(refusal) = served(&db, &args[0], &args[1]) {
                    return refusal.reply();
                }
                return db.data(args, now);
            }
            _ => return db.data(args, now),
        };
        let Some(numkeys) = text(&args[0])
            .parse::<usize>()
            .ok()
            .filter(|n| *n < args.len())
        else {
            return Reply::Error("ERR Number of keys can't be greater than number of args".into());
        };
        let (keys, argv) = args[1..].split_at(numkeys);
        if let Some(Err(refusal)) = keys.first().map(|k| served(&db, b"", k)) {
            return refusal.reply();
        }
        // Now and then a script fails as a Redis Cluster's does when a slot moved: at the
        // first command on a key past the first few, before anything of that key is written.
        let mut keys_left =
            buggify::fires(Point::RedisPartialBatch).then(|| thread_rng().gen_range(1..=3usize));
        let mut touched: Vec<Vec<u8>> = Vec::new();
        let ran = scripts.run(&sha, keys, argv, &mut |call| {
            if let Some(key) = call.get(1)
                && served(&db, &call[0], key).is_err()
            {
                return Reply::Error(
                    "ERR Script attempted to access a non local key in a cluster node".into(),
                );
            }
            if let Some(left) = keys_left.as_mut()
                && let Some(key) = call.get(1)
                && !text(&call[0]).to_lowercase().ends_with("publish")
                && !touched.contains(key)
            {
                if *left == 0 {
                    return Reply::Error(
                        "ERR Script attempted to access a non local key in a cluster node (buggify)"
                            .into(),
                    );
                }
                *left -= 1;
                touched.push(key.clone());
            }
            db.data(&call, now)
        });
        ran.unwrap_or_else(|| Reply::Error("NOSCRIPT No matching script. Please use EVAL.".into()))
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
        db.announcements.forget();
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
        db.announcements.forget();
        for s in db.subscribers.values() {
            if s.channels.iter().any(|c| db.slots.owner(c) == shard) {
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
        db.announcements.forget();
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

    /// The down shard's replica becomes its master, at its own address: the shard's keys
    /// are what it held.
    pub fn promote(&self) {
        let mut db = self.lock();
        let Some((shard, promoted)) = db.down.take() else {
            return;
        };
        db.slots.swap_sides(shard);
        db.disturbed = Some(Instant::now());
        db.announcements.forget();
        let db = &mut *db;
        let slots = &db.slots;
        db.keyspace
            .restore(&promoted, |key| slots.owner(key) == shard);
        // The new masters' replicas start in step with them.
        db.replica = Replica {
            keyspace: db.keyspace.clone(),
            backlog: VecDeque::new(),
        };
    }

    /// Which of [`NODES`] is the master now.
    pub fn master(&self) -> usize {
        self.master.load(Ordering::Relaxed)
    }

    /// Makes the other node the master (call it with both down, after [`Self::fail_over`]):
    /// it starts with the replica's keys. The sentinels name it only from [`Self::name`].
    pub fn promote_other(&self) -> usize {
        let other = 1 - self.master();
        self.master.store(other, Ordering::Relaxed);
        other
    }

    /// The sentinels name the master from now on.
    pub fn name(&self) {
        self.named.store(self.master(), Ordering::Relaxed);
    }

    /// Runs the sentinels' node: `SENTINEL GET-MASTER-ADDR-BY-NAME` answered with the
    /// node they name.
    pub async fn serve_sentinel(self) {
        let endpoint = Endpoint::bind(SENTINEL)
            .await
            .expect("the sentinels bind their address");
        while let Ok((tx, mut rx, _)) = endpoint.accept1().await {
            let state = self.clone();
            tokio::spawn(async move {
                while let Ok(payload) = rx.recv().await {
                    let Ok(bytes) = payload.downcast::<Vec<u8>>() else {
                        break;
                    };
                    let reply = match resp::command(&bytes) {
                        Ok(args) => state.sentinel(&args),
                        Err(e) => Reply::Error(e),
                    };
                    if tx.send(Box::new(reply.encode())).await.is_err() {
                        break;
                    }
                }
            });
        }
    }

    fn sentinel(&self, args: &[Vec<u8>]) -> Reply {
        let [cmd, sub, name] = args else {
            return Reply::Error("ERR unknown command".into());
        };
        if !cmd.eq_ignore_ascii_case(b"sentinel")
            || !sub.eq_ignore_ascii_case(b"get-master-addr-by-name")
        {
            return Reply::Error("ERR unknown command".into());
        }
        if name.as_slice() != MASTER_NAME.as_bytes() {
            return Reply::Nil;
        }
        let node = NODES[self.named.load(Ordering::Relaxed)];
        Reply::Array(vec![
            Reply::bulk(node.ip().to_string()),
            Reply::bulk(node.port().to_string()),
        ])
    }

    /// Empties the data, or starts it with the promoted replica's keys after
    /// [`Self::fail_over`]: a restart of the master (or, with every shard's node down, of
    /// the whole cluster).
    pub fn start_afresh(&self) {
        let mut db = self.lock();
        let keyspace = db.next_start.take().unwrap_or_default();
        let mut announcements = std::mem::take(&mut db.announcements);
        announcements.forget();
        *db = Db::default();
        db.announcements = announcements;
        *self.scripts.lock().unwrap_or_else(|p| p.into_inner()) = Scripts::default();
        db.replica.keyspace = keyspace.clone();
        db.keyspace = keyspace;
        db.disturbed = Some(Instant::now());
    }

    /// Expires keys every 100 ms, and lets the replica catch up, while the node lives.
    fn spawn_sweeper(&self) {
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
    }

    /// Runs node `index` of [`NODES`] (the node's init). The master starts empty, or with
    /// the promoted replica's keys after [`Self::fail_over`]; the other answers every
    /// command as a replica that takes no writes. Serves forever.
    pub async fn serve(self, index: usize) {
        if self.master() == index {
            self.start_afresh();
        }
        let endpoint = Endpoint::bind(NODES[index])
            .await
            .expect("redis node binds its address");
        if self.master() == index {
            self.spawn_sweeper();
        }
        while let Ok((tx, rx, _)) = endpoint.accept1().await {
            tokio::spawn(self.clone().connection(Role::Node(index), tx, rx));
        }
    }

    /// Creates the two nodes of each shard (its first master, then its replica): the
    /// masters in shard order, then the replicas ([`Self::shard_node`]). They start at once.
    pub fn shard_nodes(&self) -> Vec<NodeHandle> {
        (0..2)
            .flat_map(|side| (0..SHARDS).map(move |shard| (shard, side)))
            .map(|(shard, side)| {
                let state = self.clone();
                Handle::current()
                    .create_node()
                    .name(format!("redis-shard{shard}-{side}"))
                    .ip(node_address(shard, side).ip())
                    .init(move || state.clone().serve_shard(shard, side))
                    .build()
            })
            .collect()
    }

    /// The index in [`Self::shard_nodes`] of shard `shard`'s master now.
    pub fn shard_node(&self, shard: u16) -> usize {
        let side = self.lock().slots.side(shard);
        usize::from(side) * usize::from(SHARDS) + usize::from(shard)
    }

    /// Runs node `side` of shard `shard` (the node's init) over the shared data: it
    /// serves as the master or the replica, whichever it is at each command. The first
    /// node of shard 0 also expires keys. Serves forever.
    async fn serve_shard(self, shard: u16, side: u8) {
        let endpoint = Endpoint::bind(node_address(shard, side))
            .await
            .expect("a cluster node binds its address");
        if (shard, side) == (0, 0) {
            self.spawn_sweeper();
        }
        while let Ok((tx, rx, _)) = endpoint.accept1().await {
            tokio::spawn(self.clone().connection(Role::Shard(shard, side), tx, rx));
        }
    }

    /// Moves the slots of `key`'s range (`width` slots from its slot) to another shard,
    /// over `lasting`: the keys go over in four steps, then the target owns the range.
    pub async fn move_slots(&self, key: &str, width: u16, to: u16, lasting: Duration) {
        let first = slot(key);
        let last = first.saturating_add(width).min(SLOTS - 1);
        {
            let mut db = self.lock();
            // One owner for the whole range: it ends where the first slot's range ends.
            let from = db.slots.owner(key);
            let last = (first..=last)
                .take_while(|s| db.slots.owner_of_slot(*s) == from)
                .last()
                .unwrap_or(first);
            let to = if to == from { (to + 1) % SHARDS } else { to };
            db.slots.start_move(first..=last, to);
        }
        for step in 1..=4 {
            tokio::time::sleep(lasting / 4).await;
            self.lock().slots.advance(step * 250);
        }
        let mut db = self.lock();
        let Some((range, from)) = db.slots.finish_move() else {
            return;
        };
        // The source's sharded subscribers of the range are unsubscribed, as Redis does.
        for s in db.subscribers.values_mut() {
            if s.shard != Some(from) {
                continue;
            }
            let gone: Vec<String> = s
                .channels
                .iter()
                .filter(|c| range.contains(&slot(c)))
                .cloned()
                .collect();
            for channel in gone {
                s.channels.remove(&channel);
                let _ = s.queue.send(Reply::Array(vec![
                    Reply::bulk("sunsubscribe"),
                    Reply::bulk(channel),
                    Reply::Int(s.channels.len() as i64),
                ]));
            }
        }
    }

    /// Serves one connection: commands in order, each answered; once subscribed, also
    /// pushes messages. An error answer closes a subscriber's connection.
    async fn connection(self, role: Role, tx: Sender, mut rx: Receiver) {
        let (queue, mut pushed) = mpsc::unbounded_channel();
        let mut subscriber: Option<u64> = None;
        // The last command was `ASKING`.
        let mut asking = false;
        loop {
            let reply = tokio::select! {
                biased;
                request = rx.recv() => {
                    let Ok(payload) = request else { break };
                    let Ok(bytes) = payload.downcast::<Vec<u8>>() else { break };
                    let latency = self.knobs.latency();
                    if !latency.is_zero() {
                        tokio::time::sleep(latency).await;
                    }
                    self.knobs.stalled(&bytes).await;
                    let at = match role {
                        Role::Shard(shard, side) => {
                            let master = self.lock().slots.side(shard) == side;
                            let shard = if master { shard } else { slots::REPLICA };
                            Some(At { shard, asking: std::mem::take(&mut asking) })
                        }
                        Role::Node(_) => None,
                    };
                    match (resp::command(&bytes), role) {
                        (Ok(args), _) if args.is_empty() => Reply::Error("ERR empty command".into()),
                        // A replica takes no writes, and no subscriber here: its
                        // subscribers would hear the master's messages only late.
                        (Ok(_), Role::Node(index)) if self.master() != index => Reply::Error(
                            "READONLY You can't write against a read only replica.".into(),
                        ),
                        (Ok(args), Role::Shard(..)) if args.len() == 1 && text(&args[0]).eq_ignore_ascii_case("asking") => {
                            asking = true;
                            Reply::Status("OK")
                        }
                        (Ok(args), _) => self.answer(&args, at, &mut subscriber, &queue),
                        (Err(e), _) => Reply::Error(e),
                    }
                }
                Some(message) = pushed.recv() => message,
            };
            let failed = matches!(reply, Reply::Error(_));
            if tx.send(Box::new(reply.encode())).await.is_err() || (failed && subscriber.is_some())
            {
                break;
            }
        }
        if let Some(id) = subscriber {
            self.lock().subscribers.remove(&id);
        }
    }

    /// The answer to one command on a connection that may be a subscriber's.
    fn answer(
        &self,
        args: &[Vec<u8>],
        at: Option<At>,
        subscriber: &mut Option<u64>,
        queue: &mpsc::UnboundedSender<Reply>,
    ) -> Reply {
        let name = text(&args[0]).to_uppercase();
        let shard = at.map(|at| at.shard);
        match (name.as_str(), args.len(), shard) {
            ("SUBSCRIBE", 2, None) | ("SSUBSCRIBE", 2, Some(_)) => {
                self.lock()
                    .subscribe(subscriber, queue, text(&args[1]), shard)
            }
            ("UNSUBSCRIBE", 2, None) | ("SUNSUBSCRIBE", 2, Some(_)) => {
                self.lock()
                    .unsubscribe(*subscriber, text(&args[1]), shard.is_some())
            }
            ("SUBSCRIBE" | "UNSUBSCRIBE" | "SSUBSCRIBE" | "SUNSUBSCRIBE", 2, _) => Reply::Error(
                format!("ERR '{}' is not served on this node", name.to_lowercase()),
            ),
            ("SUBSCRIBE" | "UNSUBSCRIBE" | "SSUBSCRIBE" | "SUNSUBSCRIBE", ..) => wrong_arity(&name),
            // A subscriber's `PING` is answered in pub-sub's form.
            ("PING", 1, _) if subscriber.is_some() => {
                match self.command(args, Instant::now(), at) {
                    Reply::Status(_) => Reply::Array(vec![Reply::bulk("pong"), Reply::bulk("")]),
                    other => other,
                }
            }
            _ if subscriber.is_some() => Reply::Error(format!(
                "ERR Can't execute '{}': only (P|S)SUBSCRIBE / (P|S)UNSUBSCRIBE / PING / QUIT / RESET are allowed in this context",
                name.to_lowercase()
            )),
            _ => self.command(args, Instant::now(), at),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sends `cmd` as a client packs it and reads the answer as one parses it.
    fn send(node: &RedisState, cmd: &redis::Cmd) -> Reply {
        let args = resp::command(&cmd.get_packed_command()).expect("a packed command parses");
        node.command(&args, Instant::now(), None)
    }

    #[madsim::test]
    async fn a_script_runs_by_its_sha_once_loaded_and_stops_at_an_error_keeping_its_writes() {
        let node = RedisState::default();
        let code = "redis.call('HSET', KEYS[1], 'f', ARGV[1]) \
                    redis.call('NOSUCH', KEYS[1]) \
                    redis.call('HSET', KEYS[1], 'g', ARGV[1])";
        let script = redis::Script::new(code);
        let mut evalsha = redis::cmd("EVALSHA");
        evalsha.arg(script.get_hash()).arg(1).arg("k").arg("v");
        let unknown = send(&node, &evalsha);
        assert!(
            matches!(&unknown, Reply::Error(e) if e.starts_with("NOSCRIPT")),
            "{unknown:?}"
        );

        let mut load = redis::cmd("SCRIPT");
        load.arg("LOAD").arg(code);
        assert_eq!(send(&node, &load), Reply::bulk(script.get_hash()));
        let failed = send(&node, &evalsha);
        assert!(
            matches!(&failed, Reply::Error(e) if e.contains("unknown command 'nosuch'")),
            "{failed:?}"
        );
        let fields = node.with_db(|db| db.entries(Instant::now()));
        assert_eq!(fields["k"], vec![("f".to_string(), b"v".to_vec())]);
    }

    #[madsim::test]
    async fn a_script_answers_with_its_return_value_and_sees_replies_as_redis_hands_them() {
        let node = RedisState::default();
        let mut eval = redis::cmd("EVAL");
        eval.arg(
            "local created = redis.call('HSET', KEYS[1], 'a', '1', 'b', '2') \
             local all = redis.call('HGETALL', KEYS[1]) \
             return {created, #all, all[2], redis.call('PEXPIRE', 'missing', 5)}",
        )
        .arg(1)
        .arg("k");
        let answer = send(&node, &eval);
        let expected = [
            Reply::Int(2),
            Reply::Int(4),
            Reply::bulk("1"),
            Reply::Int(0),
        ];
        assert_eq!(answer, Reply::Array(expected.to_vec()));
    }

    #[test]
    fn a_command_is_an_array_of_bulk_strings_and_nothing_after_it() {
        let packed = redis::cmd("HGETALL").arg("k\r\n").get_packed_command();
        let args = resp::command(&packed).unwrap();
        assert_eq!(args, vec![b"HGETALL".to_vec(), b"k\r\n".to_vec()]);
        let mut trailing = packed.clone();
        trailing.extend_from_slice(b"+OK\r\n");
        assert!(resp::command(&trailing).is_err());
        assert!(resp::command(&packed[..packed.len() - 3]).is_err());
        assert!(resp::command(b"+PING\r\n").is_err());
    }
}
