//! The Redis store: an auto-reconnecting multiplexed connection for commands and a
//! separate connection for pub-sub, re-established (with every subscription) after a loss.
//! The Redis is one server, the master that Redis Sentinel names (followed through
//! failovers), or a Redis Cluster (scripts per slot, sharded pub-sub).

mod cluster;
mod sentinel;

use self::sentinel::Sentinel;
use super::pubsub::{self, Connection, Pushed, Transport};
use super::{PubSubCommand, PubSubEvent, StoreError};
use crate::config::RedisTls;
use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster::ClusterClientBuilder;
use ::redis::cluster_async::ClusterConnection;
use ::redis::{Client, Script, Value};
use futures::StreamExt;
use kas_core::Time;
use kas_core::tracker::{KeyExpiry, KeyWrite};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// Deletes the expired fields of every key in KEYS at ARGV[1] (Unix ms), atomically, and
/// returns how many went. A field's `ExpiringValue` starts with its `expires_at` (protobuf
/// field 1, a varint); a field without it counts as expired, like an undecodable one.
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
for k = 1, #KEYS do
  local all = redis.call('HGETALL', KEYS[k])
  local dead = {}
  for i = 1, #all, 2 do
    if expires_at(all[i + 1]) <= now then
      dead[#dead + 1] = all[i]
    end
  end
  for i = 1, #dead, 200 do
    gone = gone + redis.call('HDEL', KEYS[k], unpack(dead, i, math.min(i + 199, #dead)))
  end
end
return gone
";

/// Applies a tracker batch in one round trip and one command, atomically. ARGV[1] is the
/// publish command (`PUBLISH`, or `SPUBLISH` on a cluster); then for each key (`KEYS[k]`),
/// ARGV holds, in order: the fields to delete (count, then names), the fields
/// to set (count, then name/value pairs), the key's TTL in ms ([`expire_arg`]), the messages to
/// publish (count, then channel/payload pairs), and the messages to publish only if the
/// set created a field (same shape). Long lists go in chunks (Lua's `unpack` limit).
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
for k = 1, #KEYS do
  local key = KEYS[k]
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
end
return #KEYS
";

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
        client: Arc<Client>,
        conn: ConnectionManager,
    },
    Sentinel(Arc<Sentinel>),
    Cluster {
        settings: NodeSettings,
        nodes: Vec<String>,
        /// Made on first use (it connects at once), then kept: it follows the cluster.
        conn: Box<tokio::sync::OnceCell<ClusterConnection>>,
    },
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
    let text = crate::errors::chain(&e);
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
pub(super) struct NodeSettings {
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

    /// A cluster client's builder, from `nodes`.
    fn cluster(&self, nodes: &[String]) -> Result<ClusterClientBuilder, StoreError> {
        let infos = nodes
            .iter()
            .map(|n| self.info(n))
            .collect::<Result<Vec<_>, _>>()?;
        let mut builder = ClusterClientBuilder::new(infos)
            .connection_timeout(self.timeout)
            .response_timeout(self.timeout)
            .retries(3);
        if let Some(certs) = &self.tls {
            builder = builder.certs(certs.clone());
        }
        Ok(builder)
    }
}

/// A connection commands go over.
#[derive(Clone)]
enum Conn {
    Node(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ::redis::aio::ConnectionLike for Conn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a ::redis::Cmd,
    ) -> ::redis::RedisFuture<'a, Value> {
        match self {
            Conn::Node(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a ::redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> ::redis::RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Node(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Node(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

impl RedisStore {
    /// Connects lazily to the Redis of `topology`; commands and connection attempts time
    /// out after `timeout`.
    pub fn new(
        topology: &RedisTopology,
        auth: &RedisAuth,
        tls: &RedisTls,
        timeout: Duration,
    ) -> Result<Self, StoreError> {
        let settings = NodeSettings::new(auth, tls, timeout)?;
        let target = match topology {
            RedisTopology::Server(address) => Target::Server {
                client: Arc::new(settings.client(address)?),
                conn: settings.manager(address)?,
            },
            RedisTopology::Sentinel {
                master_name,
                addresses,
                password,
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
                Target::Sentinel(Arc::new(Sentinel::new(
                    master_name.clone(),
                    addresses.clone(),
                    sentinels,
                    settings,
                )))
            }
            RedisTopology::Cluster(nodes) => {
                settings.cluster(nodes)?.build().map_err(redis_error)?;
                Target::Cluster {
                    settings,
                    nodes: nodes.clone(),
                    conn: Box::default(),
                }
            }
        };
        Ok(RedisStore {
            target: Arc::new(target),
            timeout,
            collect_garbage: Arc::new(Script::new(COLLECT_GARBAGE)),
            write_batch: Arc::new(Script::new(WRITE_BATCH)),
        })
    }

    /// The connection for the next command.
    async fn conn(&self) -> Result<Conn, StoreError> {
        match &*self.target {
            Target::Server { conn, .. } => Ok(Conn::Node(conn.clone())),
            Target::Sentinel(s) => s.conn().await.map(Conn::Node),
            Target::Cluster {
                settings,
                nodes,
                conn,
            } => {
                let connect = async {
                    let client = settings.cluster(nodes)?.build().map_err(redis_error)?;
                    tokio::time::timeout(self.timeout, client.get_async_connection())
                        .await
                        .map_err(|_| {
                            StoreError(format!(
                                "connect: no cluster node of {nodes:?} answered within {:?}",
                                self.timeout
                            ))
                        })?
                        .map_err(redis_error)
                };
                Ok(Conn::Cluster(
                    conn.get_or_try_init(|| connect).await?.clone(),
                ))
            }
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
        matches!(&*self.target, Target::Cluster { .. })
    }

    /// `items` in the groups one script call may take: all together, or on a cluster one
    /// group per slot.
    fn groups<'a, T>(&self, items: &'a [T], key: impl Fn(&T) -> &str) -> Vec<Vec<&'a T>> {
        if self.cluster() {
            cluster::by_slot(items, key).into_values().collect()
        } else {
            vec![items.iter().collect()]
        }
    }

    /// Writes the batch with one `EVALSHA` per group (see [`WRITE_BATCH`]).
    pub(super) async fn execute(&self, writes: &[KeyWrite]) -> Result<(), StoreError> {
        if writes.is_empty() {
            return Ok(());
        }
        let conn = self.conn().await?;
        let publish = if self.cluster() {
            "SPUBLISH"
        } else {
            "PUBLISH"
        };
        let calls = self.groups(writes, |w| &w.key).into_iter().map(|group| {
            let mut conn = conn.clone();
            async move {
                let mut inv = self.write_batch.prepare_invoke();
                inv.arg(publish);
                for w in &group {
                    inv.key(&w.key);
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
                self.outcome(inv.invoke_async::<usize>(&mut conn).await)
            }
        });
        let mut keys = 0;
        for applied in futures::future::join_all(calls).await {
            keys += applied.map_err(|e| {
                StoreError(format!("batch write of {} keys: {}", writes.len(), e.0))
            })?;
        }
        if keys != writes.len() {
            return Err(StoreError(format!(
                "batch write applied {keys} of {} keys",
                writes.len()
            )));
        }
        Ok(())
    }

    pub(super) async fn read(&self, key: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let mut conn = self.conn().await?;
        let all = ::redis::cmd("HGETALL")
            .arg(key)
            .query_async(&mut conn)
            .await;
        self.outcome(all)
    }

    /// Deletes the expired fields of `keys` at `now`: one `EVALSHA` per 256 keys (of one
    /// slot, on a cluster), all sent at once like a batch's writes (a cluster's keys fall
    /// in as many groups as slots: one round trip after another would take seconds).
    pub(super) async fn gc(&self, keys: &[String], now: Time) -> Result<usize, StoreError> {
        let conn = self.conn().await?;
        let groups = self.groups(keys, String::as_str);
        let calls = groups.iter().flat_map(|g| g.chunks(256)).map(|chunk| {
            let mut conn = conn.clone();
            let mut inv = self.collect_garbage.prepare_invoke();
            for k in chunk {
                inv.key(*k);
            }
            inv.arg(now.as_millis());
            async move { self.outcome(inv.invoke_async::<usize>(&mut conn).await) }
        });
        let mut gone = 0;
        for n in futures::future::join_all(calls).await {
            gone += n?;
        }
        Ok(gone)
    }

    pub(super) async fn ping(&self) -> Result<(), StoreError> {
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
        match &*self.target {
            Target::Server { client, .. } => {
                let transport = RedisPubSub {
                    source: Source::Server(client.clone()),
                    timeout,
                };
                tokio::spawn(pubsub::run(transport, timeout, cmds, events));
            }
            Target::Sentinel(s) => {
                let transport = RedisPubSub {
                    source: Source::Sentinel(s.clone()),
                    timeout,
                };
                tokio::spawn(pubsub::run(transport, timeout, cmds, events));
            }
            Target::Cluster {
                settings, nodes, ..
            } => {
                let transport = cluster::ClusterPubSub(settings.clone(), nodes.clone());
                tokio::spawn(pubsub::run(transport, timeout, cmds, events));
            }
        }
    }
}

/// Where a subscriber connects.
enum Source {
    Server(Arc<Client>),
    /// The master the sentinels name at the time.
    Sentinel(Arc<Sentinel>),
}

/// Opens pub-sub connections to one Redis node.
struct RedisPubSub {
    source: Source,
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
        let client = match &self.source {
            Source::Server(client) => client.clone(),
            Source::Sentinel(s) => Arc::new(s.master_client().await?),
        };
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
