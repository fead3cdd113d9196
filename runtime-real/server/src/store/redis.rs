//! The Redis store: an auto-reconnecting multiplexed connection for commands and a
//! separate connection for pub-sub, re-established (with every subscription) after a loss.
//! The Redis is one server, the master that Redis Sentinel names (followed through
//! failovers), or a Redis Cluster (scripts per master, sharded pub-sub).

mod cluster;
mod dial;
mod sentinel;

use self::cluster::Cluster;
pub use self::dial::{Dial, NodeConn, NodeConnection, NodeSubscriber};
use self::sentinel::Sentinel;
use super::pubsub;
use super::{Backend, Fields, PubSubCommand, PubSubEvent, StoreError};
use crate::config::RedisTls;
use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::{Client, RedisResult, Script, Value};
use futures::future::BoxFuture;
use kas_core::Time;
use kas_core::tracker::{KeyExpiry, KeyWrite};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// Deletes the expired fields of the keys in ARGV[2..] at ARGV[1] (Unix ms), atomically,
/// and returns how many went. A field's `ExpiringValue` starts with its `expires_at`
/// (protobuf field 1, a varint); a field without it counts as expired, like an undecodable
/// one. (Keys go in ARGV, as in [`WRITE_BATCH`].)
const COLLECT_GARBAGE: &str = r"
local now = tonumber(ARGV[1])
local function expires_at(v)
  if string.byte(v, 1) ~= 8 then
    return 0
  end
  local n, mul = 0, 1
  for i = 2, 11 do
    local b = string.byte(v, i)
    if b == nil then
      return 0
    end
    n = n + (b % 128) * mul
    if b < 128 then
      return n
    end
    mul = mul * 128
  end
  return 0
end
local gone = 0
for k = 2, #ARGV do
  local key = ARGV[k]
  local all = redis.call('HGETALL', key)
  local dead = {}
  for i = 1, #all, 2 do
    if expires_at(all[i + 1]) <= now then
      dead[#dead + 1] = all[i]
    end
  end
  for i = 1, #dead, 200 do
    gone = gone + redis.call('HDEL', key, unpack(dead, i, math.min(i + 199, #dead)))
  end
end
return gone
";

/// Applies a tracker batch (on a cluster, the part of it that one master serves) in one
/// round trip and one command, atomically. ARGV[1] is the
/// publish command (`PUBLISH`, or `SPUBLISH` on a cluster); then for each key, ARGV holds,
/// in order: the key, the fields to delete (count, then names), the fields to set (count,
/// then name/value pairs), the key's TTL in ms ([`expire_arg`]), the messages to publish
/// (count, then channel/payload pairs), and the messages to publish only if the set created
/// a field (same shape). Long lists go in chunks (Lua's `unpack` limit). Returns how many
/// keys it wrote.
///
/// The keys go in ARGV, and KEYS holds the first alone, which routes the call: a cluster
/// refuses declared keys of different slots, while a script may touch any key its node
/// serves (with the `allow-cross-slot-keys` flag, [`CROSS_SLOT`]), so one call per master
/// writes all of its keys. A key its node does not serve (a slot moved) fails the script
/// before anything of that key is written: each key is still written whole or not at all.
const WRITE_BATCH: &str = r"
local publish = ARGV[1]
local a = 2
local function take()
  a = a + 1
  return ARGV[a - 1]
end
local function chunked(cmd, key, n, width)
  local total = 0
  while n > 0 do
    local m = math.min(n, 200)
    local last = a + m * width - 1
    total = total + redis.call(cmd, key, unpack(ARGV, a, last))
    a = last + 1
    n = n - m
  end
  return total
end
local keys = 0
while a <= #ARGV do
  local key = take()
  chunked('HDEL', key, tonumber(take()), 1)
  local created = chunked('HSET', key, tonumber(take()), 2)
  local ttl = tonumber(take())
  if ttl > 0 or (ttl < 0 and created > 0) then
    redis.call('PEXPIRE', key, math.abs(ttl))
  end
  for i = 1, tonumber(take()) do
    local channel, payload = take(), take()
    redis.call(publish, channel, payload)
  end
  for i = 1, tonumber(take()) do
    local channel, payload = take(), take()
    if created > 0 then
      redis.call(publish, channel, payload)
    end
  end
  keys = keys + 1
end
return keys
";

/// What a script run on a cluster starts with: a shebang that lets it touch keys of any
/// slot its node serves (Redis 7).
const CROSS_SLOT: &str = "#!lua flags=allow-cross-slot-keys\n";

/// Where the Redis that kas shares is (`redis.server`, `redis.sentinel` or `redis.cluster`).
#[derive(Clone, Debug)]
pub enum RedisTopology {
    /// One server: `host:port`, or a `redis://` URL.
    Server(String),
    /// The master that these sentinels name.
    Sentinel {
        /// `redis.sentinel.master_name`.
        master_name: String,
        /// The sentinels' `host:port`.
        addresses: Vec<String>,
        /// Their password (`redis.sentinel.sentinel_password_file`).
        password: Option<String>,
    },
    /// A Redis Cluster, found from these nodes.
    Cluster(Vec<String>),
}

/// The Redis shared by the kas replicas.
#[derive(Clone)]
pub struct RedisStore {
    target: Arc<Target>,
    timeout: Duration,
    collect_garbage: Arc<Script>,
    write_batch: Arc<Script>,
}

/// What commands go to.
enum Target {
    Server {
        address: String,
        conn: NodeConn,
        dial: Arc<dyn Dial>,
    },
    Sentinel(Arc<Sentinel>),
    Cluster(Arc<Cluster>),
}

/// [`WRITE_BATCH`]'s TTL argument: milliseconds, negative when only a `set` that created
/// a field sets it, 0 for none.
fn expire_arg(expire: KeyExpiry) -> i64 {
    let ms = |t: Duration| i64::try_from(t.as_millis()).unwrap_or(i64::MAX);
    match expire {
        KeyExpiry::Keep => 0,
        KeyExpiry::IfCreated(t) => -ms(t),
        KeyExpiry::Renew(t) => ms(t),
    }
}

fn err(e: impl std::fmt::Display) -> StoreError {
    StoreError(e.to_string())
}

/// A Redis error naming what failed: authenticating, TLS, or connecting.
fn redis_error(e: ::redis::RedisError) -> StoreError {
    let text = kas_transport::errors::chain(&e);
    let lower = text.to_lowercase();
    let what = if e.kind() == ::redis::ErrorKind::AuthenticationFailed
        || lower.contains("wrongpass")
        || lower.contains("noauth")
    {
        "authentication failed (redis.username, redis.password_file): "
    } else if ["certificate", "invalidcontenttype", "tls", "handshake"]
        .iter()
        .any(|w| lower.contains(w))
    {
        "TLS failed (redis.tls): "
    } else if e.is_connection_refusal() || e.is_io_error() || e.is_timeout() {
        "connect: "
    } else {
        ""
    };
    StoreError(format!("{what}{text}"))
}

/// Who kas is to Redis: `redis.username` and the password in `redis.password_file`.
#[derive(Clone, Debug, Default)]
pub struct RedisAuth {
    /// The ACL user (Redis's `default` without one).
    pub username: Option<String>,
    /// Its password.
    pub password: Option<String>,
}

/// How kas connects to one Redis node: auth, TLS, timeouts.
#[derive(Clone)]
struct NodeSettings {
    auth: RedisAuth,
    /// Read once: `None` without TLS.
    tls: Option<::redis::TlsCertificates>,
    timeout: Duration,
}

impl NodeSettings {
    fn new(auth: &RedisAuth, tls: &RedisTls, timeout: Duration) -> Result<Self, StoreError> {
        let certs = if tls.enabled {
            let read = |f: &std::path::Path| {
                std::fs::read(f).map_err(|e| StoreError(format!("{}: {e}", f.display())))
            };
            let client_tls = match (&tls.certificate_file, &tls.key_file) {
                (Some(c), Some(k)) => Some(::redis::ClientTlsConfig {
                    client_cert: read(c)?,
                    client_key: read(k)?,
                }),
                _ => None,
            };
            let root_cert = tls.ca_certificate_file.as_deref().map(read).transpose()?;
            Some(::redis::TlsCertificates {
                client_tls,
                root_cert,
            })
        } else {
            None
        };
        Ok(NodeSettings {
            auth: auth.clone(),
            tls: certs,
            timeout,
        })
    }

    /// The connection info of `address` (`host:port`, or a URL of the scheme TLS asks for).
    fn info(&self, address: &str) -> Result<::redis::ConnectionInfo, StoreError> {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        let url = match address.split_once("://") {
            None => format!("{scheme}://{address}"),
            Some((given, _)) if given == scheme => address.to_string(),
            Some(_) => {
                return Err(StoreError(format!(
                    "redis address {address}: use host:port, or {scheme}:// as redis.tls.enabled says"
                )));
            }
        };
        let info = ::redis::IntoConnectionInfo::into_connection_info(url.as_str()).map_err(err)?;
        let mut settings = info.redis_settings().clone();
        if let Some(u) = &self.auth.username {
            settings = settings.set_username(u);
        }
        if let Some(p) = &self.auth.password {
            settings = settings.set_password(p);
        }
        Ok(info.set_redis_settings(settings))
    }

    fn client(&self, address: &str) -> Result<Client, StoreError> {
        let info = self.info(address)?;
        match &self.tls {
            Some(certs) => Client::build_with_tls(info, certs.clone()).map_err(err),
            None => Client::open(info).map_err(err),
        }
    }

    /// An auto-reconnecting connection to `address`, made lazily.
    fn manager(&self, address: &str) -> Result<ConnectionManager, StoreError> {
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_secs(2));
        ConnectionManager::new_lazy_with_config(self.client(address)?, config).map_err(redis_error)
    }
}

/// A connection commands go over: a node's, or a Cluster node's after an `ASK` (each
/// command preceded by `ASKING`).
#[derive(Clone)]
enum Conn {
    Node(NodeConn),
    Asking(NodeConn),
}

impl ::redis::aio::ConnectionLike for Conn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a ::redis::Cmd,
    ) -> ::redis::RedisFuture<'a, Value> {
        match self {
            Conn::Node(c) => c.req_packed_command(cmd),
            Conn::Asking(c) => c.0.query_asking(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a ::redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> ::redis::RedisFuture<'a, Vec<Value>> {
        let (Conn::Node(c) | Conn::Asking(c)) = self;
        c.req_packed_commands(pipeline, offset, count)
    }

    fn get_db(&self) -> i64 {
        0
    }
}

impl RedisStore {
    /// Connects lazily to the Redis of `topology` over TCP (TLS as `tls` says); commands
    /// and connection attempts time out after `timeout`.
    pub fn new(
        topology: &RedisTopology,
        auth: &RedisAuth,
        tls: &RedisTls,
        timeout: Duration,
    ) -> Result<Self, StoreError> {
        let settings = NodeSettings::new(auth, tls, timeout)?;
        match topology {
            RedisTopology::Server(_) => Self::over(
                topology,
                Arc::new(settings.clone()),
                Arc::new(settings),
                timeout,
            ),
            RedisTopology::Sentinel {
                addresses,
                password,
                ..
            } => {
                // The sentinels have their own password (and no ACL user); TLS as the nodes.
                let sentinels = NodeSettings {
                    auth: RedisAuth {
                        username: None,
                        password: password.clone(),
                    },
                    ..settings.clone()
                };
                for a in addresses {
                    sentinels.info(a)?;
                }
                Self::over(topology, Arc::new(settings), Arc::new(sentinels), timeout)
            }
            RedisTopology::Cluster(nodes) => {
                for n in nodes {
                    settings.info(n)?;
                }
                let dial = Arc::new(settings);
                Self::over(topology, dial.clone(), dial, timeout)
            }
        }
    }

    /// The store of a single server, Sentinel's master or a Cluster, reaching the nodes
    /// through `nodes` and the sentinels through `sentinels` (the simulation's network, or
    /// TCP).
    pub fn over(
        topology: &RedisTopology,
        nodes: Arc<dyn Dial>,
        sentinels: Arc<dyn Dial>,
        timeout: Duration,
    ) -> Result<Self, StoreError> {
        let target = match topology {
            RedisTopology::Server(address) => Target::Server {
                address: address.clone(),
                conn: nodes.connect(address)?,
                dial: nodes,
            },
            RedisTopology::Sentinel {
                master_name,
                addresses,
                ..
            } => Target::Sentinel(Arc::new(Sentinel::new(
                master_name.clone(),
                addresses.clone(),
                sentinels,
                nodes,
                timeout,
            ))),
            RedisTopology::Cluster(seeds) => {
                Target::Cluster(Arc::new(Cluster::new(seeds.clone(), nodes)))
            }
        };
        Ok(Self::with_target(target, timeout))
    }

    fn with_target(target: Target, timeout: Duration) -> Self {
        let shebang = match target {
            Target::Cluster(_) => CROSS_SLOT,
            _ => "",
        };
        let script = |code| Arc::new(Script::new(&format!("{shebang}{code}")));
        RedisStore {
            target: Arc::new(target),
            timeout,
            collect_garbage: script(COLLECT_GARBAGE),
            write_batch: script(WRITE_BATCH),
        }
    }

    /// The connection for the next command on a single server or Sentinel's master.
    async fn conn(&self) -> Result<Conn, StoreError> {
        match &*self.target {
            Target::Server { conn, .. } => Ok(Conn::Node(conn.clone())),
            Target::Sentinel(s) => s.conn().await.map(Conn::Node),
            Target::Cluster(_) => Err(StoreError(
                "a cluster's commands go to the master of their key".into(),
            )),
        }
    }

    /// The outcome of a command: a failure may send Sentinel's master to be resolved again.
    fn outcome<T>(&self, r: ::redis::RedisResult<T>) -> Result<T, StoreError> {
        r.map_err(|e| {
            if let Target::Sentinel(s) = &*self.target {
                s.failed(&e);
            }
            redis_error(e)
        })
    }

    fn cluster(&self) -> bool {
        matches!(&*self.target, Target::Cluster(_))
    }

    /// Runs `call` on `items` in the groups one script call may take, at most `max` items
    /// a call, all at once, and sums what the calls return. On a cluster, a group per
    /// master by the slot map; the items of calls that failed are then made again one by
    /// one, each at its key's master by a fresh map, following a redirection: a slot may
    /// have moved (the script fails at a key its node does not serve, before writing it),
    /// and the scripts are safe to run again.
    async fn run_grouped<'a, T, F>(
        &self,
        items: &'a [T],
        key: impl Fn(&T) -> &str + Copy,
        max: usize,
        call: impl Fn(Conn, &[&'a T]) -> F,
    ) -> Result<usize, StoreError>
    where
        F: Future<Output = RedisResult<usize>>,
    {
        let all: Vec<&T> = items.iter().collect();
        let call = &call;
        let Target::Cluster(cluster) = &*self.target else {
            let conn = self.conn().await?;
            let calls = all.chunks(max).map(|c| call(conn.clone(), c));
            let mut total = 0;
            for outcome in futures::future::join_all(calls).await {
                total += self.outcome(outcome)?;
            }
            return Ok(total);
        };
        let map = cluster.map().await?;
        let groups = map.group(&all, key);
        let chunks: Vec<(Option<&str>, &[&T])> = groups
            .iter()
            .flat_map(|(master, g)| g.chunks(max).map(|c| (*master, c)))
            .collect();
        let calls = chunks.iter().map(|(master, chunk)| async move {
            let Some(master) = master else {
                return Err(StoreError("a slot no cluster master serves".into()));
            };
            let outcome = call(Conn::Node(cluster.node(master)?), chunk).await;
            outcome.map_err(redis_error)
        });
        let mut total = 0;
        let mut failed = Vec::new();
        for ((_, chunk), outcome) in chunks.iter().zip(futures::future::join_all(calls).await) {
            match outcome {
                Ok(n) => total += n,
                Err(_) => failed.extend_from_slice(chunk),
            }
        }
        if failed.is_empty() {
            return Ok(total);
        }
        cluster.forget();
        let again = failed.iter().map(|item| async {
            let one = std::slice::from_ref(item);
            cluster.at_owner(key(item), |conn| call(conn, one)).await
        });
        for outcome in futures::future::join_all(again).await {
            total += outcome?;
        }
        Ok(total)
    }

    /// Writes the batch with one `EVALSHA` per group (see [`WRITE_BATCH`]).
    pub(super) async fn execute(&self, writes: &[KeyWrite]) -> Result<(), StoreError> {
        if writes.is_empty() {
            return Ok(());
        }
        let publish = if self.cluster() {
            "SPUBLISH"
        } else {
            "PUBLISH"
        };
        let write = |mut conn: Conn, group: &[&KeyWrite]| {
            let mut inv = self.write_batch.prepare_invoke();
            inv.key(&group[0].key).arg(publish);
            for w in group {
                inv.arg(&w.key);
                inv.arg(w.delete.len()).arg(&w.delete);
                inv.arg(w.set.len());
                for (f, v) in &w.set {
                    inv.arg(f).arg(v);
                }
                inv.arg(expire_arg(w.expire));
                for messages in [&w.publish, &w.announce] {
                    inv.arg(messages.len());
                    for (channel, payload) in messages {
                        inv.arg(channel).arg(payload);
                    }
                }
            }
            async move { inv.invoke_async::<usize>(&mut conn).await }
        };
        let keys = self
            .run_grouped(writes, |w| &w.key, usize::MAX, write)
            .await
            .map_err(|e| StoreError(format!("batch write of {} keys: {}", writes.len(), e.0)))?;
        if keys != writes.len() {
            return Err(StoreError(format!(
                "batch write applied {keys} of {} keys",
                writes.len()
            )));
        }
        Ok(())
    }

    pub(super) async fn read(&self, key: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let hgetall = |mut conn: Conn| async move {
            ::redis::cmd("HGETALL")
                .arg(key)
                .query_async(&mut conn)
                .await
        };
        match &*self.target {
            Target::Cluster(cluster) => cluster.at_owner(key, hgetall).await,
            _ => self.outcome(hgetall(self.conn().await?).await),
        }
    }

    /// Deletes the expired fields of `keys` at `now`: one `EVALSHA` per 256 keys (of one
    /// master, on a cluster), all sent at once like a batch's writes.
    pub(super) async fn gc(&self, keys: &[String], now: Time) -> Result<usize, StoreError> {
        let collect = |mut conn: Conn, chunk: &[&String]| {
            let mut inv = self.collect_garbage.prepare_invoke();
            inv.key(chunk[0].as_str()).arg(now.as_millis());
            for k in chunk {
                inv.arg(k.as_str());
            }
            async move { inv.invoke_async::<usize>(&mut conn).await }
        };
        self.run_grouped(keys, String::as_str, 256, collect).await
    }

    pub(super) async fn ping(&self) -> Result<(), StoreError> {
        if let Target::Cluster(cluster) = &*self.target {
            return cluster.ping().await;
        }
        let mut conn = self.conn().await?;
        let pong = ::redis::cmd("PING").query_async::<()>(&mut conn).await;
        self.outcome(pong)
    }

    pub(super) fn spawn_pubsub(
        &self,
        cmds: mpsc::UnboundedReceiver<PubSubCommand>,
        events: mpsc::Sender<PubSubEvent>,
    ) {
        let timeout = self.timeout;
        let transport = match &*self.target {
            Target::Server { address, dial, .. } => MasterPubSub {
                dial: dial.clone(),
                master: Master::At(address.clone()),
            },
            Target::Sentinel(s) => MasterPubSub {
                dial: s.nodes(),
                master: Master::Named(s.clone()),
            },
            Target::Cluster(cluster) => {
                let transport = cluster::ShardedPubSub(cluster.clone());
                tokio::spawn(pubsub::run(transport, timeout, cmds, events));
                return;
            }
        };
        tokio::spawn(pubsub::run(transport, timeout, cmds, events));
    }
}

/// Where the master is at each attempt.
enum Master {
    /// The one server's address.
    At(String),
    /// The one the sentinels name.
    Named(Arc<Sentinel>),
}

/// Opens subscriber connections to the master.
struct MasterPubSub {
    dial: Arc<dyn Dial>,
    master: Master,
}

impl pubsub::Transport for MasterPubSub {
    type Conn = Box<dyn NodeSubscriber>;

    async fn connect(&self) -> Result<Box<dyn NodeSubscriber>, StoreError> {
        let address = match &self.master {
            Master::At(address) => address.clone(),
            Master::Named(sentinel) => sentinel.master_address().await?,
        };
        self.dial.subscriber(address, false).await
    }
}

impl Backend for RedisStore {
    fn execute<'a>(&'a self, writes: &'a [KeyWrite]) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(RedisStore::execute(self, writes))
    }

    fn read<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Fields> {
        Box::pin(RedisStore::read(self, key))
    }

    fn gc<'a>(&'a self, keys: &'a [String], now: Time) -> BoxFuture<'a, Result<usize, StoreError>> {
        Box::pin(RedisStore::gc(self, keys, now))
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(RedisStore::ping(self))
    }

    fn spawn_pubsub(
        &self,
        cmds: mpsc::UnboundedReceiver<PubSubCommand>,
        events: mpsc::Sender<PubSubEvent>,
    ) {
        RedisStore::spawn_pubsub(self, cmds, events);
    }
}
