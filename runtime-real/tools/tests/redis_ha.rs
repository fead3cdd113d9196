//! Three kas on a replicated Redis started by the test on loopback: Redis Sentinel (a
//! master, a replica, three sentinels) and Redis Cluster (three masters, three replicas).
//! They route, wake a waiting call through pub-sub (sharded on the cluster), and survive
//! the master being SIGKILLed: after the failover every record is back within one refresh
//! period and a call waiting through it is delivered.

mod support;

use kas_tools::local::redis_server::free_port;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use support::*;

/// Record TTL: kas refreshes every half of it (10 s), more than the tracker's longest retry
/// delay after failed writes (5 s), so a failover costs no record more than one period.
const TTL_MS: u64 = 20_000;
const REFRESH: Duration = Duration::from_millis(TTL_MS / 2);

/// A redis-server (or sentinel) process of the test's; SIGKILLed on drop.
struct Node {
    child: Option<Child>,
    port: u16,
}

impl Node {
    /// Starts `redis-server` with `args` on a free port and waits for its `PING`.
    fn start(dir: &Path, name: &str, args: &[&str]) -> Node {
        let port = free_port().expect("a free port");
        let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
        // A directory of its own: a replica's full sync writes `dump.rdb` there, and a node
        // started where one lies loads it (a cluster node then claims its keys' slots).
        let home = dir.join(name);
        std::fs::create_dir_all(&home).unwrap();
        let child = Command::new("redis-server")
            .args(args)
            .arg("--dir")
            .arg(&home)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .stdout(log)
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("redis-server runs (scripts/test installs it)");
        let n = Node {
            child: Some(child),
            port,
        };
        wait(
            Duration::from_secs(10),
            &format!("{name} to answer PING"),
            || n.cli(&["PING"]).trim() == "PONG",
        );
        n
    }

    fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn cli(&self, args: &[&str]) -> String {
        kas_tools::local::redis_server::cli(self.port, args)
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls `ready` every 50 ms until it holds, for at most `within`.
fn wait(within: Duration, what: &str, mut ready: impl FnMut() -> bool) {
    let end = Instant::now() + within;
    while !ready() {
        assert!(
            Instant::now() < end,
            "timed out after {within:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Three kas on the Redis that `topology` (the `redis:` lines) names.
async fn three_kas(secrets: &Secrets, topology: &str) -> Vec<KasProc> {
    let mut kas = Vec::new();
    for i in 0..3 {
        let extra = Extra {
            redis_topology: Some(topology),
            ..Extra::default()
        };
        let name = format!("kas{i}");
        kas.push(KasProc::start_extra(secrets, &name, None, TTL_MS, extra, None).await);
    }
    kas
}

/// Waits until every kas routes to every agent in `agents` (agent, pod).
async fn every_kas_routes(secrets: &Secrets, kas: &[KasProc], agents: &[(i64, &str)]) {
    for k in kas {
        let gl = GitLab::new(secrets, k.api).await;
        for (agent, pod) in agents {
            let gl = &gl;
            eventually(
                Duration::from_secs(15),
                "a route to the agent",
                || async move {
                    let pods = gl.pods(*agent, None, Duration::from_secs(2)).await.ok()?;
                    (pods == [*pod]).then_some(())
                },
            )
            .await;
        }
    }
}

/// A call through `kas` for `agent` (not connected yet), left waiting: it must still wait
/// 700 ms later.
async fn waiting_call(
    secrets: &Secrets,
    kas: &KasProc,
    agent: i64,
) -> tokio::task::JoinHandle<Result<Vec<String>, tonic::Status>> {
    let gl = GitLab::new(secrets, kas.api).await;
    let call = tokio::spawn(async move { gl.pods(agent, None, Duration::from_secs(40)).await });
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        !call.is_finished(),
        "the call for agent {agent} waits for it"
    );
    call
}

/// Whether `redis` (a redis-cli runner) holds every record of three kas and `agents`.
fn records_present(cli: impl Fn(&[&str]) -> String, agents: &[i64]) -> bool {
    let instances = cli(&["HLEN", "kas:kas_instances"]).trim() == "3";
    instances
        && agents.iter().all(|a| {
            // Its connection and its tunnels.
            let key = format!("kas:agent:{{agent:{a}}}");
            cli(&["HLEN", &key]).trim() == "2"
        })
}

/// Whether a `PUBSUB NUMSUB` or `SHARDNUMSUB` answer for one channel counts one subscriber.
fn one_subscriber(answer: &str) -> bool {
    answer.lines().nth(1).map(str::trim) == Some("1")
}

struct SentinelSetup {
    master: Node,
    replica: Node,
    sentinels: Vec<Node>,
}

const MASTER_NAME: &str = "kasmaster";

impl SentinelSetup {
    fn start(dir: &Path) -> SentinelSetup {
        let plain = ["--save", "", "--appendonly", "no"];
        let master = Node::start(dir, "master", &plain);
        let replicaof = master.address().replace(':', " ");
        let mut args = plain.to_vec();
        args.extend(["--replicaof", &replicaof]);
        let replica = Node::start(dir, "replica", &args);
        let sentinels = (0..3)
            .map(|i| {
                // A sentinel rewrites its configuration file: one each.
                let conf = dir.join(format!("sentinel{i}.conf"));
                std::fs::write(
                    &conf,
                    format!(
                        "sentinel monitor {MASTER_NAME} 127.0.0.1 {} 2\nsentinel down-after-milliseconds {MASTER_NAME} 1000\nsentinel failover-timeout {MASTER_NAME} 10000\n",
                        master.port
                    ),
                )
                .unwrap();
                let conf = conf.display().to_string();
                Node::start(dir, &format!("sentinel{i}"), &[&conf, "--sentinel"])
            })
            .collect();
        let s = SentinelSetup {
            master,
            replica,
            sentinels,
        };
        wait(
            Duration::from_secs(30),
            "the replica in sync and the sentinels to know each other",
            || {
                s.replica
                    .cli(&["INFO", "replication"])
                    .contains("master_link_status:up")
                    && s.sentinels.iter().all(|n| {
                        let known = n.cli(&["SENTINEL", "SENTINELS", MASTER_NAME]);
                        let replicas = n.cli(&["SENTINEL", "REPLICAS", MASTER_NAME]);
                        known.matches("127.0.0.1").count() == 2 && replicas.contains("127.0.0.1")
                    })
            },
        );
        s
    }

    /// The master's address as the first sentinel names it.
    fn named_master(&self) -> String {
        let out = self.sentinels[0].cli(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME]);
        out.split_whitespace().collect::<Vec<_>>().join(":")
    }
}

/// A replicated Redis whose master the test can kill.
trait Replicated {
    /// The `redis:` lines that name it.
    fn topology(&self) -> String;
    /// Whether kas's subscription to `channel` is where the publishes go.
    fn subscribed(&self, channel: &str) -> bool;
    /// SIGKILLs the master (of `channel`'s shard).
    fn kill_master(&mut self, channel: &str);
    /// Whether a replica has taken over.
    fn promoted(&self) -> bool;
    /// `redis-cli` against the (new) master.
    fn cli(&self, args: &[&str]) -> String;
}

/// Three kas on `redis`: they route to agents on the others, a waiting call is woken by
/// pub-sub, and after the master is SIGKILLed while a call waits and its agent connects,
/// the call is delivered, every record is back within one refresh period and every kas
/// routes to every agent. Returns the kas.
async fn route_wake_and_fail_over(secrets: &Secrets, redis: &mut impl Replicated) -> Vec<KasProc> {
    let kas = three_kas(secrets, &redis.topology()).await;
    let _a1 = TestAgent::connect(kas[0].agent, 1, "agent1-pod", 1).await;
    let _a2 = TestAgent::connect(kas[1].agent, 2, "agent2-pod", 1).await;
    every_kas_routes(secrets, &kas, &[(1, "agent1-pod"), (2, "agent2-pod")]).await;

    // Woken through pub-sub: kas does not poll while pub-sub is up.
    let call = waiting_call(secrets, &kas[2], 3).await;
    wait(Duration::from_secs(5), "kas2's subscription", || {
        redis.subscribed("kas:tunnel_events:{agent:3}")
    });
    let _a3 = TestAgent::connect(kas[0].agent, 3, "agent3-pod", 1).await;
    let pods = call.await.unwrap().expect("the waiting call completes");
    assert_eq!(pods, ["agent3-pod"]);

    // The master dies while a call waits for agent 4, which connects before the failover.
    let call = waiting_call(secrets, &kas[2], 4).await;
    redis.kill_master("kas:tunnel_events:{agent:4}");
    let _a4 = TestAgent::connect(kas[1].agent, 4, "agent4-pod", 1).await;
    wait(Duration::from_secs(30), "a replica to take over", || {
        redis.promoted()
    });
    let promoted = Instant::now();
    eventually(
        REFRESH + Duration::from_secs(1),
        "every record on the new master within one refresh period",
        || async { records_present(|a| redis.cli(a), &[1, 2, 3, 4]).then_some(()) },
    )
    .await;
    println!("records back {:?} after the promotion", promoted.elapsed());
    let pods = call
        .await
        .unwrap()
        .expect("the call waiting through the failover completes");
    assert_eq!(pods, ["agent4-pod"]);
    let all = [
        (1, "agent1-pod"),
        (2, "agent2-pod"),
        (3, "agent3-pod"),
        (4, "agent4-pod"),
    ];
    every_kas_routes(secrets, &kas, &all).await;
    kas
}

impl Replicated for SentinelSetup {
    fn topology(&self) -> String {
        let sentinels: Vec<String> = self.sentinels.iter().map(Node::address).collect();
        format!(
            "  sentinel:\n    master_name: {MASTER_NAME}\n    addresses: [{}]\n",
            sentinels.join(", ")
        )
    }

    fn subscribed(&self, channel: &str) -> bool {
        one_subscriber(&self.master.cli(&["PUBSUB", "NUMSUB", channel]))
    }

    fn kill_master(&mut self, _: &str) {
        self.master.kill();
    }

    fn promoted(&self) -> bool {
        self.named_master() == self.replica.address()
    }

    fn cli(&self, args: &[&str]) -> String {
        self.replica.cli(args)
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn three_kas_on_a_sentinel_master_route_wake_and_survive_its_failover() {
    let secrets = Secrets::new();
    let mut ha = SentinelSetup::start(&secrets.path(""));
    let kas = route_wake_and_fail_over(&secrets, &mut ha).await;
    for k in &kas {
        let followed = k.log_text().lines().any(|l| {
            l.contains("the sentinels name this master") && l.contains(&ha.replica.address())
        });
        assert!(
            followed,
            "kas {} names the promoted master in its log",
            k.id()
        );
    }
}

struct ClusterSetup {
    nodes: Vec<Node>,
    /// A node not killed.
    alive: usize,
    /// The master killed, and the channel whose shard it served.
    victim: Option<(usize, String)>,
}

impl ClusterSetup {
    fn start(dir: &Path) -> ClusterSetup {
        let nodes: Vec<Node> = (0..6)
            .map(|i| {
                let conf = dir.join(format!("nodes{i}.conf")).display().to_string();
                let args = [
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    &conf,
                    "--cluster-node-timeout",
                    "1000",
                    // A replica of an idle master may take over however long ago they spoke.
                    "--cluster-replica-validity-factor",
                    "0",
                ];
                Node::start(dir, &format!("node{i}"), &args)
            })
            .collect();
        let addresses: Vec<String> = nodes.iter().map(Node::address).collect();
        let created = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli runs");
        assert!(
            created.status.success(),
            "redis-cli --cluster create: {}",
            String::from_utf8_lossy(&created.stdout)
        );
        let c = ClusterSetup {
            nodes,
            alive: 0,
            victim: None,
        };
        wait(
            Duration::from_secs(30),
            "the cluster to be ok on every node",
            || {
                c.nodes
                    .iter()
                    .all(|n| n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok"))
            },
        );
        c
    }

    /// The node serving `key`'s slot as master, as node `at` sees it.
    fn master_of(&self, at: usize, key: &str) -> Option<usize> {
        let slot: u16 = self.nodes[at]
            .cli(&["CLUSTER", "KEYSLOT", key])
            .trim()
            .parse()
            .ok()?;
        let table = self.nodes[at].cli(&["CLUSTER", "NODES"]);
        let line = table.lines().find(|l| {
            l.contains("master")
                && l.split_whitespace().skip(8).any(|range| {
                    let (a, b) = range.split_once('-').unwrap_or((range, range));
                    a.parse::<u16>().is_ok_and(|a| a <= slot)
                        && b.parse::<u16>().is_ok_and(|b| slot <= b)
                })
        })?;
        let address = line.split_whitespace().nth(1)?;
        let port = address.split(['@', ':']).nth(1)?;
        self.nodes.iter().position(|n| n.port.to_string() == port)
    }

    /// Moves `key`'s slot, with its keys, from its master to another master (as
    /// `redis-cli --cluster reshard` does); returns that master.
    fn move_slot(&self, key: &str) -> usize {
        let from = self.master_of(0, key).expect("a master serves the slot");
        let to = (0..self.nodes.len())
            .find(|&n| n != from && self.nodes[n].cli(&["ROLE"]).starts_with("master"))
            .expect("another master");
        let slot = self.nodes[0].cli(&["CLUSTER", "KEYSLOT", key]);
        let slot = slot.trim();
        let id = |n: usize| self.nodes[n].cli(&["CLUSTER", "MYID"]).trim().to_string();
        let (from_id, to_id) = (id(from), id(to));
        self.nodes[to].cli(&["CLUSTER", "SETSLOT", slot, "IMPORTING", &from_id]);
        self.nodes[from].cli(&["CLUSTER", "SETSLOT", slot, "MIGRATING", &to_id]);
        let port = self.nodes[to].port.to_string();
        let keys = self.nodes[from].cli(&["CLUSTER", "GETKEYSINSLOT", slot, "1000"]);
        for k in keys.lines().filter(|k| !k.is_empty()) {
            let moved = self.nodes[from].cli(&["MIGRATE", "127.0.0.1", &port, k, "0", "5000"]);
            assert_eq!(moved.trim(), "OK", "MIGRATE {k}");
        }
        for n in [to, from] {
            self.nodes[n].cli(&["CLUSTER", "SETSLOT", slot, "NODE", &to_id]);
        }
        wait(
            Duration::from_secs(10),
            "every node to see the slot moved",
            || (0..self.nodes.len()).all(|n| self.master_of(n, key) == Some(to)),
        );
        to
    }
}

impl Replicated for ClusterSetup {
    fn topology(&self) -> String {
        let nodes: Vec<String> = self.nodes.iter().map(Node::address).collect();
        format!("  cluster:\n    addresses: [{}]\n", nodes.join(", "))
    }

    fn subscribed(&self, channel: &str) -> bool {
        self.master_of(self.alive, channel).is_some_and(|shard| {
            one_subscriber(&self.nodes[shard].cli(&["PUBSUB", "SHARDNUMSUB", channel]))
        })
    }

    fn kill_master(&mut self, channel: &str) {
        let victim = self
            .master_of(self.alive, channel)
            .expect("a master serves the slot");
        self.nodes[victim].kill();
        self.victim = Some((victim, channel.to_string()));
        self.alive = (victim + 1) % self.nodes.len();
    }

    fn promoted(&self) -> bool {
        let (victim, channel) = self.victim.clone().expect("a master was killed");
        self.nodes[self.alive]
            .cli(&["CLUSTER", "INFO"])
            .contains("cluster_state:ok")
            && self
                .master_of(self.alive, &channel)
                .is_some_and(|m| m != victim)
    }

    /// `redis-cli -c` (following redirections) on a node still alive.
    fn cli(&self, args: &[&str]) -> String {
        let mut with_c = vec!["-c"];
        with_c.extend(args);
        self.nodes[self.alive].cli(&with_c)
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn three_kas_on_a_redis_cluster_route_wake_by_sharded_pubsub_and_survive_a_failover() {
    let secrets = Secrets::new();
    let mut c = ClusterSetup::start(&secrets.path(""));
    route_wake_and_fail_over(&secrets, &mut c).await;
}

/// A batch and a GC over keys of many slots: one script call per master each, by the slot
/// map the store keeps. After a slot moves to another master, the next batch and GC still
/// succeed (the calls that reach a key their node no longer serves are made again by a
/// fresh map).
#[tokio::test(flavor = "multi_thread")]
async fn batches_and_gcs_over_keys_of_many_slots_of_a_cluster_follow_a_moved_slot() {
    use kas_core::tracker::KeyWrite;
    use kas_server::store::{RedisStore, RedisTopology, Store};
    let secrets = Secrets::new();
    let c = ClusterSetup::start(&secrets.path(""));
    let nodes = c.nodes.iter().map(Node::address).collect();
    let (auth, tls) = (Default::default(), Default::default());
    let topology = RedisTopology::Cluster(nodes);
    let store =
        Store::new(RedisStore::new(&topology, &auth, &tls, Duration::from_secs(2)).unwrap());
    let now = kas_core::Time(1_700_000_000_000);
    // 50 agents' keys: slots on every shard.
    let keys: Vec<String> = (0..50)
        .map(|a| format!("kas:agent:{{agent:{a}}}"))
        .collect();
    let writes: Vec<KeyWrite> = keys
        .iter()
        .enumerate()
        .map(|(a, key)| {
            let event = (
                format!("kas:tunnel_events:{{agent:{a}}}"),
                b"event".to_vec(),
            );
            gc_fixture(key, now, vec![event])
        })
        .collect();
    store
        .execute(&writes)
        .await
        .expect("one batch over many slots");
    assert_eq!(store.gc(&keys, now).await.expect("GC over many slots"), 100);
    support::only_live_left(&store, &keys).await;

    // The scripts are loaded now: a batch is one `EVALSHA` per master.
    for n in &c.nodes {
        n.cli(&["CONFIG", "RESETSTAT"]);
    }
    store.execute(&writes).await.expect("the batch again");
    let evalsha: u64 = c
        .nodes
        .iter()
        .map(|n| {
            let stats = n.cli(&["INFO", "commandstats"]);
            let line = stats.lines().find(|l| l.starts_with("cmdstat_evalsha:"));
            let calls = line.and_then(|l| l.split(['=', ',']).nth(1));
            calls.map_or(0, |c| c.parse::<u64>().unwrap())
        })
        .sum();
    assert_eq!(evalsha, 3, "one EVALSHA per master for 50 keys");

    let to = c.move_slot(&keys[7]);
    assert_eq!(c.nodes[to].cli(&["EXISTS", &keys[7]]).trim(), "1");
    store
        .execute(&writes)
        .await
        .expect("a batch after a slot moved");
    assert_eq!(
        store.gc(&keys, now).await.expect("a GC after a slot moved"),
        100
    );
    support::only_live_left(&store, &keys).await;
}
