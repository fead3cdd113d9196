//! Redis Cluster: which master serves each key slot (writes and GC go out one script call
//! per master: a script may touch keys of many slots, as long as its node serves them),
//! and sharded pub-sub (`SSUBSCRIBE`, Redis 7): tunnel events are published with
//! `SPUBLISH` on the slot of the agent's keys, so a subscriber listens on the shard that
//! holds them.

use super::super::pubsub::{Connection, Pushed, Transport};
use super::{NodeSettings, redis_error};
use crate::store::StoreError;
use crate::store::slot::{SLOTS, slot};
use ::redis::cluster_async::ClusterConnection;
use ::redis::cluster_routing::{MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo};
use ::redis::{PushInfo, PushKind, Value};
use std::collections::{BTreeMap, VecDeque};
use tokio::sync::mpsc;

/// Which master serves each slot, as `CLUSTER SLOTS` answered at one time: the masters
/// are numbered in the order the answer names them.
#[derive(Debug)]
pub(super) struct SlotOwners(Vec<Option<u16>>);

impl SlotOwners {
    /// Reads a `CLUSTER SLOTS` answer: `[start, end, [host, port, ..], replicas..]` per range.
    pub(super) fn parse(answer: &Value) -> Result<SlotOwners, StoreError> {
        let bad = |what: &str| StoreError(format!("CLUSTER SLOTS answered {what}"));
        let Value::Array(ranges) = answer else {
            return Err(bad("no array"));
        };
        let mut owners = vec![None; usize::from(SLOTS)];
        let mut masters: Vec<(Vec<u8>, i64)> = Vec::new();
        for range in ranges {
            let Value::Array(range) = range else {
                return Err(bad("a range that is no array"));
            };
            let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(master))) =
                (range.first(), range.get(1), range.get(2))
            else {
                return Err(bad("a range without start, end and master"));
            };
            let (Some(Value::BulkString(host)), Some(Value::Int(port))) =
                (master.first(), master.get(1))
            else {
                return Err(bad("a master without host and port"));
            };
            let slots = usize::try_from(*start)
                .ok()
                .zip(usize::try_from(*end).ok())
                .filter(|(s, e)| s <= e && *e < owners.len())
                .ok_or_else(|| bad(&format!("the slots {start}-{end}")))?;
            let name = (host.clone(), *port);
            let index = match masters.iter().position(|m| *m == name) {
                Some(i) => i,
                None => {
                    masters.push(name);
                    masters.len() - 1
                }
            };
            let index = u16::try_from(index).map_err(|_| bad("more masters than slots"))?;
            owners[slots.0..=slots.1].fill(Some(index));
        }
        Ok(SlotOwners(owners))
    }

    /// `items` grouped by the master serving the slot of their key; a key of a slot no
    /// master serves yet is grouped with its slot alone.
    pub(super) fn group<'a, T>(
        &self,
        items: &[&'a T],
        key: impl Fn(&T) -> &str,
    ) -> Vec<Vec<&'a T>> {
        let mut groups: BTreeMap<u32, Vec<&'a T>> = BTreeMap::new();
        for item in items {
            let slot = slot(key(item));
            let group = match self.0[usize::from(slot)] {
                Some(master) => u32::from(master),
                None => u32::from(SLOTS) + u32::from(slot),
            };
            groups.entry(group).or_default().push(item);
        }
        groups.into_values().collect()
    }
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

    fn range(start: i64, end: i64, port: i64) -> Value {
        let node = |port| {
            Value::Array(vec![
                Value::BulkString(b"127.0.0.1".to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ])
        };
        Value::Array(vec![
            Value::Int(start),
            Value::Int(end),
            node(port),
            node(port + 100),
        ])
    }

    #[test]
    fn keys_are_grouped_by_the_master_serving_their_slot() {
        // "foo" is in slot 12182, "bar" in 5061, "baz" in 4813, "{foo}x" with "foo".
        let answer = Value::Array(vec![
            range(0, 4999, 7001),
            range(5000, 9999, 7002),
            range(10000, 12999, 7001),
        ]);
        let owners = SlotOwners::parse(&answer).unwrap();
        let keys = ["foo", "bar", "baz", "{foo}x", "unserved{n2}"];
        assert_eq!(slot("unserved{n2}"), 15924, "a slot no master serves");
        let refs: Vec<&&str> = keys.iter().collect();
        let groups = owners.group(&refs, |k| k);
        let names: Vec<Vec<&str>> = groups
            .iter()
            .map(|g| g.iter().map(|k| **k).collect())
            .collect();
        assert_eq!(
            names,
            [
                vec!["foo", "baz", "{foo}x"],
                vec!["bar"],
                vec!["unserved{n2}"]
            ]
        );
    }

    #[test]
    fn a_cluster_slots_answer_that_is_malformed_is_refused_by_name() {
        let cases = [
            (Value::Int(1), "no array"),
            (
                Value::Array(vec![Value::Int(1)]),
                "a range that is no array",
            ),
            (Value::Array(vec![range(5, 3, 7001)]), "the slots 5-3"),
            (
                Value::Array(vec![range(0, 16384, 7001)]),
                "the slots 0-16384",
            ),
            (
                Value::Array(vec![Value::Array(vec![Value::Int(0), Value::Int(1)])]),
                "a range without start, end and master",
            ),
        ];
        for (answer, named) in cases {
            let e = SlotOwners::parse(&answer).unwrap_err();
            assert!(e.0.contains(named), "{:?} names {named}", e.0);
        }
    }
}
