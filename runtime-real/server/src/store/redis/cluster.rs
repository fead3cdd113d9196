//! Redis Cluster, reached node by node through the store's [`Dial`] (the simulation's
//! network, or TCP): which master serves each key slot (`CLUSTER SLOTS`, asked again after
//! a redirection or a failed script call), `MOVED` and `ASK` followed, writes and GC sent
//! one script call per master (a script may touch keys of many slots, as long as its node
//! serves them), and sharded pub-sub (`SSUBSCRIBE`, Redis 7): tunnel events are published
//! with `SPUBLISH` on the slot of the agent's keys, so a subscriber listens on the shard
//! that holds them.

use super::super::pubsub::{Connection, Pushed, Transport};
use super::Conn;
use super::dial::{Dial, NodeConn, NodeSubscriber};
use crate::store::StoreError;
use crate::store::slot::{SLOTS, slot};
use ::redis::{ErrorKind, RedisError, RedisResult, ServerErrorKind, Value};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};

/// How many redirections one request follows: a `MOVED` to the new owner, then an `ASK`
/// while that slot is still being moved.
const REDIRECTIONS: usize = 2;

/// Which master serves each slot, as `CLUSTER SLOTS` answered at one time.
#[derive(Debug)]
pub(super) struct SlotMap {
    /// Per slot, its master's index in `masters`.
    owners: Vec<Option<u16>>,
    /// The masters' `host:port`, in the order the answer names them.
    masters: Vec<String>,
}

impl SlotMap {
    /// Reads a `CLUSTER SLOTS` answer from the node at `asked`: `[start, end, [host, port,
    /// ..], replicas..]` per range; an empty host is the node's own.
    pub(super) fn parse(answer: &Value, asked: &str) -> Result<SlotMap, StoreError> {
        let bad = |what: &str| StoreError(format!("CLUSTER SLOTS answered {what}"));
        let Value::Array(ranges) = answer else {
            return Err(bad("no array"));
        };
        let mut owners = vec![None; usize::from(SLOTS)];
        let mut masters: Vec<String> = Vec::new();
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
            let host = match String::from_utf8_lossy(host) {
                h if h.is_empty() => asked.rsplit_once(':').map_or(asked, |(h, _)| h).into(),
                h => h.into_owned(),
            };
            let name = format!("{host}:{port}");
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
        if masters.is_empty() {
            return Err(bad("no master"));
        }
        Ok(SlotMap { owners, masters })
    }

    /// The master serving `key`'s slot (or a channel's named like it).
    fn master_of(&self, key: &str) -> Result<usize, StoreError> {
        let slot = slot(key);
        self.owners[usize::from(slot)]
            .map(usize::from)
            .ok_or_else(|| StoreError(format!("no cluster master serves slot {slot} of {key}")))
    }

    /// `items` grouped by the master serving the slot of their key (its address), a key of a
    /// slot no master serves alone in its group (no address).
    pub(super) fn group<'a, T>(
        &self,
        items: &[&'a T],
        key: impl Fn(&T) -> &str,
    ) -> Vec<(Option<&str>, Vec<&'a T>)> {
        let mut groups: BTreeMap<u32, (Option<&str>, Vec<&'a T>)> = BTreeMap::new();
        for item in items {
            let slot = slot(key(item));
            let (group, master) = match self.owners[usize::from(slot)] {
                Some(m) => (u32::from(m), Some(self.masters[usize::from(m)].as_str())),
                None => (u32::from(SLOTS) + u32::from(slot), None),
            };
            groups
                .entry(group)
                .or_insert((master, Vec::new()))
                .1
                .push(item);
        }
        groups.into_values().collect()
    }
}

/// A Redis Cluster: its seed nodes, the slot map last asked, a command connection per node.
pub(super) struct Cluster {
    seeds: Vec<String>,
    dial: Arc<dyn Dial>,
    map: Mutex<Option<Arc<SlotMap>>>,
    /// The masters of the last map (kept when it is forgotten): asked first next time.
    known: Mutex<Vec<String>>,
    conns: Mutex<BTreeMap<String, NodeConn>>,
}

impl Cluster {
    pub(super) fn new(seeds: Vec<String>, dial: Arc<dyn Dial>) -> Self {
        Cluster {
            seeds,
            dial,
            map: Mutex::default(),
            known: Mutex::default(),
            conns: Mutex::default(),
        }
    }

    /// The slot map: the one known, or asked of the nodes: the masters of the last map
    /// and the configured nodes at once, the first answer taken (a master that died
    /// without a reset would otherwise hold every refresh for a Redis timeout).
    pub(super) async fn map(&self) -> Result<Arc<SlotMap>, StoreError> {
        if let Some(map) = self.map.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            return Ok(map);
        }
        let mut asked = self.known.lock().unwrap_or_else(|p| p.into_inner()).clone();
        asked.extend(
            self.seeds
                .iter()
                .filter(|s| !asked.contains(s))
                .cloned()
                .collect::<Vec<_>>(),
        );
        let mut answers: FuturesUnordered<_> = asked
            .iter()
            .map(|address| async move {
                let answer = match self.node(address) {
                    Ok(mut node) => ::redis::cmd("CLUSTER")
                        .arg("SLOTS")
                        .query_async::<Value>(&mut node)
                        .await
                        .map_err(super::redis_error),
                    Err(e) => Err(e),
                };
                answer
                    .and_then(|a| SlotMap::parse(&a, address))
                    .map_err(|e| format!("{address}: {}", e.0))
            })
            .collect();
        let mut problems = Vec::new();
        while let Some(answer) = answers.next().await {
            match answer {
                Ok(map) => {
                    let map = Arc::new(map);
                    *self.known.lock().unwrap_or_else(|p| p.into_inner()) = map.masters.clone();
                    // Connections to nodes that no longer serve a slot go.
                    self.conns
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .retain(|a, _| map.masters.contains(a) || self.seeds.contains(a));
                    *self.map.lock().unwrap_or_else(|p| p.into_inner()) = Some(map.clone());
                    return Ok(map);
                }
                Err(problem) => problems.push(problem),
            }
        }
        Err(StoreError(format!(
            "no cluster node answered CLUSTER SLOTS: {}",
            problems.join("; ")
        )))
    }

    /// Forgets the slot map: a slot moved, or a master changed.
    pub(super) fn forget(&self) {
        *self.map.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// The command connection to the node at `address`.
    pub(super) fn node(&self, address: &str) -> Result<NodeConn, StoreError> {
        let mut conns = self.conns.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(conn) = conns.get(address) {
            return Ok(conn.clone());
        }
        let conn = self.dial.connect(address)?;
        conns.insert(address.to_string(), conn.clone());
        Ok(conn)
    }

    /// Runs `call` on the master serving `key`, following a `MOVED` (the map is forgotten)
    /// or an `ASK` (the call is made again after `ASKING`) at most [`REDIRECTIONS`] times.
    pub(super) async fn at_owner<T, F>(
        &self,
        key: &str,
        call: impl Fn(Conn) -> F,
    ) -> Result<T, StoreError>
    where
        F: Future<Output = RedisResult<T>>,
    {
        let map = self.map().await?;
        let mut conn = Conn::Node(self.node(&map.masters[map.master_of(key)?])?);
        for _ in 0..REDIRECTIONS {
            let answer = call(conn).await;
            let Some((ask, address)) = answer.as_ref().err().and_then(redirection) else {
                return answer.map_err(super::redis_error);
            };
            if !ask {
                self.forget();
            }
            let node = self.node(&address)?;
            conn = if ask {
                Conn::Asking(node)
            } else {
                Conn::Node(node)
            };
        }
        call(conn).await.map_err(super::redis_error)
    }

    /// `PING` to every master: a dead shard fails it.
    pub(super) async fn ping(&self) -> Result<(), StoreError> {
        let map = self.map().await?;
        let pings = map.masters.iter().map(|m| async move {
            let mut conn = self.node(m)?;
            let pong = ::redis::cmd("PING").query_async::<()>(&mut conn).await;
            pong.map_err(|e| StoreError(format!("{m}: {}", super::redis_error(e).0)))
        });
        futures::future::try_join_all(pings).await.map(drop)
    }
}

/// Where a `MOVED` (false) or an `ASK` (true) sends the request.
fn redirection(e: &RedisError) -> Option<(bool, String)> {
    let ask = e.kind() == ErrorKind::Server(ServerErrorKind::Ask);
    e.redirect_node()
        .map(|(address, _)| (ask, address.to_string()))
}

/// Opens sharded subscribers: one connection per master, by a slot map asked afresh (the
/// last subscriber may have broken because a slot moved).
pub(super) struct ShardedPubSub(pub(super) Arc<Cluster>);

/// A sharded subscriber: each channel on the master serving its slot. Any master's
/// connection breaking, or a slot moving away (its node unsubscribes the channel), breaks
/// it as a whole: the loop then opens a new one and reports `Down` and `Up`, and kas looks
/// up what it may have missed.
pub(super) struct ShardedSubscriber {
    map: Arc<SlotMap>,
    /// Per master of `map`, in its order.
    nodes: Vec<Box<dyn NodeSubscriber>>,
    /// The masters' answers still due to the last `PING` (one `Pong` is reported for all).
    pongs_due: usize,
}

impl Transport for ShardedPubSub {
    type Conn = ShardedSubscriber;

    async fn connect(&self) -> Result<ShardedSubscriber, StoreError> {
        self.0.forget();
        let map = self.0.map().await?;
        let mut nodes = Vec::with_capacity(map.masters.len());
        for master in &map.masters {
            nodes.push(self.0.dial.subscriber(master.clone(), true).await?);
        }
        Ok(ShardedSubscriber {
            map,
            nodes,
            pongs_due: 0,
        })
    }
}

impl Connection for ShardedSubscriber {
    async fn subscribe(&mut self, channels: Vec<String>) -> Result<(), StoreError> {
        for channel in channels {
            let master = self.map.master_of(&channel)?;
            self.nodes[master].subscribe(vec![channel]).await?;
        }
        Ok(())
    }

    async fn unsubscribe(&mut self, channel: String) -> Result<(), StoreError> {
        let master = self.map.master_of(&channel)?;
        self.nodes[master].unsubscribe(channel).await
    }

    async fn ping(&mut self) -> Result<(), StoreError> {
        // Every master: a dead shard must break the subscriber, not only a random node.
        for node in &mut self.nodes {
            node.ping().await?;
            self.pongs_due += 1;
        }
        Ok(())
    }

    async fn next(&mut self) -> Result<Pushed, StoreError> {
        loop {
            let nexts = self
                .nodes
                .iter_mut()
                .map(|n| NodeSubscriber::next(&mut **n));
            let (pushed, ..) = futures::future::select_all(nexts).await;
            match pushed? {
                Pushed::Pong => {
                    self.pongs_due = self.pongs_due.saturating_sub(1);
                    if self.pongs_due == 0 {
                        return Ok(Pushed::Pong);
                    }
                }
                other => return Ok(other),
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
        let map = SlotMap::parse(&answer, "10.0.0.9:7000").unwrap();
        assert_eq!(map.masters, ["127.0.0.1:7001", "127.0.0.1:7002"]);
        let keys = ["foo", "bar", "baz", "{foo}x", "unserved{n2}"];
        assert_eq!(slot("unserved{n2}"), 15924, "a slot no master serves");
        let refs: Vec<&&str> = keys.iter().collect();
        let groups = map.group(&refs, |k| k);
        let names: Vec<(Option<&str>, Vec<&str>)> = groups
            .iter()
            .map(|(m, g)| (*m, g.iter().map(|k| **k).collect()))
            .collect();
        assert_eq!(
            names,
            [
                (Some("127.0.0.1:7001"), vec!["foo", "baz", "{foo}x"]),
                (Some("127.0.0.1:7002"), vec!["bar"]),
                (None, vec!["unserved{n2}"])
            ]
        );
    }

    #[test]
    fn a_cluster_slots_answer_that_is_malformed_is_refused_by_name() {
        let cases = [
            (Value::Int(1), "no array"),
            (Value::Array(vec![]), "no master"),
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
            let e = SlotMap::parse(&answer, "127.0.0.1:7001").unwrap_err();
            assert!(e.0.contains(named), "{:?} names {named}", e.0);
        }
    }

    #[test]
    fn a_master_named_without_host_is_on_the_host_asked() {
        let unnamed = Value::Array(vec![
            Value::Int(0),
            Value::Int(16383),
            Value::Array(vec![Value::BulkString(Vec::new()), Value::Int(7005)]),
        ]);
        let map = SlotMap::parse(&Value::Array(vec![unnamed]), "10.1.2.3:7001").unwrap();
        assert_eq!(map.masters, ["10.1.2.3:7005"]);
    }
    /// A node that answers `CLUSTER SLOTS` with one master serving every slot, or, when
    /// `dead`, never answers (a host gone without a reset) until a 1 s timeout.
    struct Node {
        dead: bool,
    }

    impl super::super::dial::NodeConnection for Node {
        fn query<'a>(&'a self, _: &'a ::redis::Cmd) -> ::redis::RedisFuture<'a, Value> {
            Box::pin(async move {
                if self.dead {
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                    return Err(
                        std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out").into(),
                    );
                }
                Ok(Value::Array(vec![range(0, 16383, 7001)]))
            })
        }

        fn query_asking<'a>(&'a self, cmd: &'a ::redis::Cmd) -> ::redis::RedisFuture<'a, Value> {
            self.query(cmd)
        }
    }

    /// Nodes at addresses starting with "dead" never answer.
    struct Nodes;

    impl Dial for Nodes {
        fn connect(&self, address: &str) -> Result<NodeConn, StoreError> {
            let dead = address.starts_with("dead");
            Ok(NodeConn(Arc::new(Node { dead })))
        }

        fn subscriber(
            &self,
            _: String,
            _: bool,
        ) -> futures::future::BoxFuture<'static, Result<Box<dyn NodeSubscriber>, StoreError>>
        {
            Box::pin(async { Err(StoreError("no subscribers here".into())) })
        }
    }

    #[cfg(not(madsim))]
    #[tokio::test(start_paused = true)]
    async fn the_slot_map_is_asked_of_every_node_at_once_so_dead_masters_do_not_hold_it() {
        let seeds = vec![
            "dead1:7000".to_string(),
            "dead2:7000".into(),
            "alive:7000".into(),
        ];
        let cluster = Cluster::new(seeds, Arc::new(Nodes));
        let started = tokio::time::Instant::now();
        let map = cluster.map().await.expect("the live node answers");
        assert_eq!(map.masters, ["127.0.0.1:7001"]);
        assert!(
            started.elapsed() < std::time::Duration::from_millis(100),
            "waited {:?}",
            started.elapsed()
        );
        let dead = Cluster::new(
            vec!["dead1:7000".to_string(), "dead2:7000".into()],
            Arc::new(Nodes),
        );
        let err = dead.map().await.expect_err("no node answers");
        assert!(
            err.0.contains("dead1:7000") && err.0.contains("dead2:7000"),
            "{err}"
        );
    }
}
