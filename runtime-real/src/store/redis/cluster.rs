//! Redis Cluster: key slots (writes and GC go out one script call per slot, as a script
//! may only touch one slot), and sharded pub-sub (`SSUBSCRIBE`, Redis 7): tunnel events
//! are published with `SPUBLISH` on the slot of the agent's keys, so a subscriber listens
//! on the shard that holds them.

use super::super::pubsub::{Connection, Pushed, Transport};
use super::{NodeSettings, redis_error};
use crate::store::StoreError;
use ::redis::cluster_async::ClusterConnection;
use ::redis::cluster_routing::{MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo};
use ::redis::{PushInfo, PushKind, Value};
use std::collections::{BTreeMap, VecDeque};
use tokio::sync::mpsc;

/// How many hash slots a Redis Cluster has.
const SLOTS: u16 = 16384;

/// The hash slot of `key`: CRC16 (XMODEM) of its hash tag (the text inside the first
/// non-empty `{...}`), or of the whole key without one, modulo 16384.
pub(super) fn slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let tagged = bytes.iter().position(|b| *b == b'{').and_then(|open| {
        let close = bytes[open + 1..].iter().position(|b| *b == b'}')?;
        (close > 0).then(|| &bytes[open + 1..open + 1 + close])
    });
    crc16(tagged.unwrap_or(bytes)) % SLOTS
}

fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for byte in data {
        crc ^= u16::from(*byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// `items` grouped by the slot of their key, in slot order.
pub(super) fn by_slot<T>(items: &[T], key: impl Fn(&T) -> &str) -> BTreeMap<u16, Vec<&T>> {
    let mut groups: BTreeMap<u16, Vec<&T>> = BTreeMap::new();
    for item in items {
        groups.entry(slot(key(item))).or_default().push(item);
    }
    groups
}

/// Opens sharded subscriber connections: a cluster connection of their own each (RESP3,
/// pushes delivered to a channel), so that a subscription follows its slot's master.
pub(super) struct ClusterPubSub(pub(super) NodeSettings, pub(super) Vec<String>);

/// A sharded subscriber. Any node's connection dropping (a master died, a failover) breaks
/// it as a whole: the loop then opens a new one and reports `Down` and `Up`, and kas looks
/// up what it may have missed.
pub(super) struct ClusterSubscriber {
    conn: ClusterConnection,
    pushes: mpsc::UnboundedReceiver<PushInfo>,
    answered: VecDeque<Pushed>,
}

impl Transport for ClusterPubSub {
    type Conn = ClusterSubscriber;

    async fn connect(&self) -> Result<ClusterSubscriber, StoreError> {
        let (tx, pushes) = mpsc::unbounded_channel();
        let builder = self.0.cluster(&self.1)?;
        let client = builder
            .use_protocol(::redis::ProtocolVersion::RESP3)
            .push_sender(tx)
            .build()
            .map_err(redis_error)?;
        let conn = client.get_async_connection().await.map_err(redis_error)?;
        Ok(ClusterSubscriber {
            conn,
            pushes,
            answered: VecDeque::new(),
        })
    }
}

impl Connection for ClusterSubscriber {
    async fn subscribe(&mut self, channels: Vec<String>) -> Result<(), StoreError> {
        // One at a time: channels on different slots live on different shards.
        for channel in channels {
            self.conn.ssubscribe(&channel).await.map_err(redis_error)?;
            self.answered.push_back(Pushed::Subscribed(channel));
        }
        Ok(())
    }

    async fn unsubscribe(&mut self, channel: String) -> Result<(), StoreError> {
        self.conn.sunsubscribe(&channel).await.map_err(redis_error)
    }

    async fn ping(&mut self) -> Result<(), StoreError> {
        // Every master: a dead shard must break the subscriber, not only a random node.
        let every_master = RoutingInfo::MultiNode((
            MultipleNodeRoutingInfo::AllMasters,
            Some(ResponsePolicy::AllSucceeded),
        ));
        self.conn
            .route_command(::redis::cmd("PING"), every_master)
            .await
            .map_err(redis_error)?;
        self.answered.push_back(Pushed::Pong);
        Ok(())
    }

    async fn next(&mut self) -> Result<Pushed, StoreError> {
        loop {
            if let Some(answer) = self.answered.pop_front() {
                return Ok(answer);
            }
            let push = self
                .pushes
                .recv()
                .await
                .ok_or_else(|| StoreError("cluster pub-sub connection closed".into()))?;
            match push.kind {
                PushKind::Disconnection => {
                    return Err(StoreError("a cluster node's connection dropped".into()));
                }
                PushKind::SMessage | PushKind::Message => {
                    if let [Value::BulkString(channel), Value::BulkString(payload)] =
                        push.data.as_slice()
                    {
                        return Ok(Pushed::Message(
                            String::from_utf8_lossy(channel).into_owned(),
                            payload.clone(),
                        ));
                    }
                }
                // Confirmations were queued when asked for.
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_redis_cluster_hashing() {
        // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("{user1000}.following"), slot("user1000"));
        assert_eq!(slot("foo{}{bar}"), slot("foo{}{bar}"));
        assert_ne!(
            slot("foo{}{bar}"),
            slot("bar"),
            "an empty tag hashes the whole key"
        );
        assert_eq!(slot("foo{{bar}}zap"), slot("{bar"));
    }
}
