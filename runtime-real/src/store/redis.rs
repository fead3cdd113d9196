//! The Redis store: an auto-reconnecting multiplexed connection for commands and a
//! separate connection for pub-sub, re-established (with every subscription) after a loss.

use super::pubsub::{self, Connection, Pushed, Transport};
use super::{PubSubCommand, PubSubEvent, StoreError};
use crate::config::RedisTls;
use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::{Client, Script, Value};
use futures::StreamExt;
use kas_core::Time;
use kas_core::tracker::KeyWrite;
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

/// Applies a tracker batch in one round trip and one command, atomically. For each key
/// (`KEYS[k]`), ARGV holds, in order: the fields to delete (count, then names), the fields
/// to set (count, then name/value pairs), the key's TTL in ms (0: none), the messages to
/// publish (count, then channel/payload pairs), and the messages to publish only if the
/// set created a field (same shape). Long lists go in chunks (Lua's `unpack` limit).
const WRITE_BATCH: &str = r"
local a = 1
local function take()
  a = a + 1
  return ARGV[a - 1]
end
local function chunked(cmd, key, n, width)
  local total = 0
  while n > 0 do
    local m = math.min(n, 200)
    local args = {}
    for i = 1, m * width do
      args[i] = take()
    end
    total = total + redis.call(cmd, key, unpack(args))
    n = n - m
  end
  return total
end
for k = 1, #KEYS do
  local key = KEYS[k]
  chunked('HDEL', key, tonumber(take()), 1)
  local created = chunked('HSET', key, tonumber(take()), 2)
  local ttl = tonumber(take())
  if ttl > 0 then
    redis.call('PEXPIRE', key, ttl)
  end
  for i = 1, tonumber(take()) do
    local channel, payload = take(), take()
    redis.call('PUBLISH', channel, payload)
  end
  for i = 1, tonumber(take()) do
    local channel, payload = take(), take()
    if created > 0 then
      redis.call('PUBLISH', channel, payload)
    end
  end
end
return #KEYS
";

/// A Redis server shared by the kas replicas.
#[derive(Clone)]
pub struct RedisStore {
    /// Shared: with TLS settings a client is a few hundred bytes.
    client: Arc<Client>,
    conn: ConnectionManager,
    timeout: Duration,
    collect_garbage: Arc<Script>,
    write_batch: Arc<Script>,
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

impl RedisStore {
    /// Connects lazily to `address` (`host:port`, or a `redis://` URL); commands and
    /// connection attempts time out after `timeout`.
    pub fn new(
        address: &str,
        auth: &RedisAuth,
        tls: &RedisTls,
        timeout: Duration,
    ) -> Result<Self, StoreError> {
        let scheme = if tls.enabled { "rediss" } else { "redis" };
        let url = match address.split_once("://") {
            None => format!("{scheme}://{address}"),
            Some(("redis", _)) if !tls.enabled => address.to_string(),
            Some(("rediss", _)) if tls.enabled => address.to_string(),
            Some(_) => {
                return Err(StoreError(format!(
                    "redis.server.address {address}: use host:port, or {scheme}:// as redis.tls.enabled says"
                )));
            }
        };
        let mut info =
            ::redis::IntoConnectionInfo::into_connection_info(url.as_str()).map_err(err)?;
        let mut settings = info.redis_settings().clone();
        if let Some(u) = &auth.username {
            settings = settings.set_username(u);
        }
        if let Some(p) = &auth.password {
            settings = settings.set_password(p);
        }
        info = info.set_redis_settings(settings);
        let client = if tls.enabled {
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
            let certs = ::redis::TlsCertificates {
                client_tls,
                root_cert,
            };
            Client::build_with_tls(info, certs).map_err(err)?
        } else {
            Client::open(info).map_err(err)?
        };
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_secs(2));
        let conn =
            ConnectionManager::new_lazy_with_config(client.clone(), config).map_err(redis_error)?;
        Ok(RedisStore {
            client: Arc::new(client),
            conn,
            timeout,
            collect_garbage: Arc::new(Script::new(COLLECT_GARBAGE)),
            write_batch: Arc::new(Script::new(WRITE_BATCH)),
        })
    }

    /// Writes the batch with one `EVALSHA` (see [`WRITE_BATCH`]).
    pub(super) async fn execute(&self, writes: &[KeyWrite]) -> Result<(), StoreError> {
        if writes.is_empty() {
            return Ok(());
        }
        let mut inv = self.write_batch.prepare_invoke();
        for w in writes {
            inv.key(&w.key);
            inv.arg(w.delete.len()).arg(&w.delete);
            inv.arg(w.set.len());
            for (f, v) in &w.set {
                inv.arg(f).arg(v);
            }
            let ttl = w
                .expire
                .map_or(0, |t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX));
            inv.arg(ttl);
            for messages in [&w.publish, &w.announce] {
                inv.arg(messages.len());
                for (channel, payload) in messages {
                    inv.arg(channel).arg(payload);
                }
            }
        }
        let mut conn = self.conn.clone();
        let keys: usize = inv.invoke_async(&mut conn).await.map_err(|e| {
            let e = redis_error(e);
            StoreError(format!("batch write of {} keys: {}", writes.len(), e.0))
        })?;
        if keys != writes.len() {
            return Err(StoreError(format!(
                "batch write applied {keys} of {} keys",
                writes.len()
            )));
        }
        Ok(())
    }

    pub(super) async fn read(&self, key: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let mut conn = self.conn.clone();
        ::redis::cmd("HGETALL")
            .arg(key)
            .query_async(&mut conn)
            .await
            .map_err(redis_error)
    }

    /// Deletes the expired fields of `keys` at `now` with one `EVALSHA`.
    pub(super) async fn gc(&self, keys: &[String], now: Time) -> Result<usize, StoreError> {
        let mut conn = self.conn.clone();
        let mut inv = self.collect_garbage.prepare_invoke();
        for k in keys {
            inv.key(k);
        }
        inv.arg(now.as_millis());
        inv.invoke_async(&mut conn).await.map_err(redis_error)
    }

    pub(super) async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        ::redis::cmd("PING")
            .query_async::<()>(&mut conn)
            .await
            .map_err(redis_error)
    }

    pub(super) fn spawn_pubsub(
        &self,
        cmds: mpsc::UnboundedReceiver<PubSubCommand>,
        events: mpsc::Sender<PubSubEvent>,
    ) {
        let transport = RedisPubSub {
            client: self.client.clone(),
            timeout: self.timeout,
        };
        tokio::spawn(pubsub::run(transport, self.timeout, cmds, events));
    }
}

/// Opens pub-sub connections to Redis.
struct RedisPubSub {
    client: Arc<Client>,
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
        let (sink, stream) = self
            .client
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
