//! The Compose fleet (`deploy/compose`) in real containers, built from this tree's debug
//! binaries (`scripts/image --debug --fleet`): three kas on networks of their own, Redis
//! with Sentinel, nginx in front of kas, three agentk replicas of two agents. While
//! GitLab's calls go through every kas to every agent, the fleet goes through chaos: every
//! kas restarted in turn (SIGTERM), a kas cut off from the other kas, a kas frozen longer
//! than its records live, the Redis master killed, the load balancer restarted. A table per
//! phase is printed: calls, failed by status, calls a kas refused that the next kas served
//! (GitLab's retry), and how long the fleet took to be whole again (every kas listing every
//! replica).
//!
//! Needs Docker with `docker-compose`; it fails (never skips) without them. It uses the
//! subnets 10.181.1-3.0/24 and the Compose project `kasfleettest`.

mod support;

use kas_auth::jwt::Secret;
use kas_client::api_client::ApiClient;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::eventually;
use tonic::Code;

const PROJECT: &str = "kasfleettest";
const KAS: [&str; 3] = ["kas0", "kas1", "kas2"];
/// Each kas's public API on loopback (given to Compose as `KAS0_API_PORT`...).
const API_PORTS: [u16; 3] = [28153, 28154, 28155];
/// Agent 1 has one replica, agent 2 two.
const AGENTS: [i64; 2] = [1, 2];
const REPLICAS: usize = 3;
/// How long the fleet may take to be whole again after a fault is healed: a record TTL
/// (the fleet's `redis_conn_info_ttl`, 20 s) plus agentk's reconnect backoff.
const WHOLE_WITHIN: Duration = Duration::from_secs(60);

/// The fleet, brought up by `deploy/compose/up`; taken down (containers, networks, files)
/// when dropped.
struct Fleet {
    root: PathBuf,
    dir: tempfile::TempDir,
}

impl Fleet {
    fn up() -> Fleet {
        for (tool, package) in [
            ("docker", "docker.io"),
            ("docker-compose", "docker-compose"),
        ] {
            let found = Command::new(tool).arg("version").output();
            assert!(
                found.is_ok_and(|o| o.status.success()),
                "{tool} is missing or its daemon is not running: install {package} and start dockerd"
            );
        }
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .canonicalize()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let fleet = Fleet { root, dir };
        // A fleet left by a test run that was killed.
        fleet.script("down");
        let up = fleet.script("up");
        let out = String::from_utf8_lossy(&up.stdout);
        println!("{out}");
        assert!(
            up.status.success(),
            "deploy/compose/up --debug failed:\n{out}\n{}",
            String::from_utf8_lossy(&up.stderr)
        );
        fleet
    }

    /// GitLab's kas secret, as `up` made it.
    fn secret(&self) -> Secret {
        let text = std::fs::read_to_string(self.dir.path().join("kas/gitlab.secret")).unwrap();
        Secret::from_base64(text.trim()).unwrap()
    }

    fn script(&self, name: &str) -> Output {
        let mut c = Command::new(self.root.join("deploy/compose").join(name));
        if name == "up" {
            c.arg("--debug");
        }
        self.environment(&mut c)
            .current_dir(&self.root)
            .output()
            .unwrap_or_else(|e| panic!("deploy/compose/{name}: {e}"))
    }

    /// What the fleet's scripts and Compose file read from the environment.
    fn environment<'a>(&self, c: &'a mut Command) -> &'a mut Command {
        c.env("FLEET_DIR", self.dir.path())
            .env("COMPOSE_PROJECT_NAME", PROJECT);
        for (i, port) in API_PORTS.iter().enumerate() {
            c.env(format!("KAS{i}_API_PORT"), port.to_string());
        }
        c
    }

    /// Runs `docker-compose ARGS` on the fleet and returns its standard output.
    fn compose(&self, args: &[&str]) -> String {
        let mut c = Command::new("docker-compose");
        c.arg("-f")
            .arg(self.root.join("deploy/compose/compose.yaml"))
            .args(args);
        run(self.environment(&mut c))
    }

    /// Runs `docker ARGS`.
    fn docker(&self, args: &[&str]) {
        run(Command::new("docker").args(args));
    }

    /// The container of `service`.
    fn container(&self, service: &str) -> String {
        self.compose(&["ps", "-q", service])
    }

    /// kas `i`'s public API, as published on loopback.
    fn api(&self, i: usize) -> String {
        format!("grpcs://127.0.0.1:{}", API_PORTS[i])
    }

    fn ca(&self) -> PathBuf {
        self.dir.path().join("pki/ca.crt")
    }

    async fn client(&self, i: usize) -> Result<ApiClient, String> {
        ApiClient::connect_with_ca(&self.api(i), Some(&self.ca()), &self.secret(), CALL_TIMEOUT)
            .await
    }

    /// Whether every kas lists every agent replica.
    async fn whole(&self) -> bool {
        for i in 0..KAS.len() {
            let Ok(client) = self.client(i).await else {
                return false;
            };
            match client.agents_for_project(100).await {
                Ok(agents) if agents.len() == REPLICAS => {}
                _ => return false,
            }
        }
        true
    }

    /// Waits until the fleet is whole again and returns how long that took.
    async fn await_whole(&self, what: &str) -> Duration {
        let start = Instant::now();
        eventually(
            WHOLE_WITHIN,
            &format!("every kas to list all {REPLICAS} replicas {what}"),
            || async { self.whole().await.then_some(()) },
        )
        .await;
        start.elapsed()
    }

    /// Waits until `service`'s health check passes (kas: `kas --probe readiness`).
    async fn await_healthy(&self, service: &str) {
        let id = self.container(service);
        eventually(
            Duration::from_secs(60),
            &format!("{service} to be healthy"),
            || async {
                let out = Command::new("docker")
                    .args(["inspect", "-f", "{{.State.Health.Status}}", &id])
                    .output()
                    .ok()?;
                (String::from_utf8_lossy(&out.stdout).trim() == "healthy").then_some(())
            },
        )
        .await;
    }
}

/// Runs `c`, which must succeed, and returns its standard output, trimmed.
fn run(c: &mut Command) -> String {
    let out = c.output().unwrap_or_else(|e| panic!("{c:?}: {e}"));
    assert!(
        out.status.success(),
        "{c:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

impl Drop for Fleet {
    fn drop(&mut self) {
        let down = self.script("down");
        if !down.status.success() {
            eprintln!(
                "deploy/compose/down: {}",
                String::from_utf8_lossy(&down.stderr)
            );
        }
    }
}

/// Each call's deadline.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// What happened to the calls started in one phase.
#[derive(Default)]
struct Tally {
    calls: usize,
    /// Failed after every kas was tried: when each started, the kas that answered last,
    /// and the status.
    failed: Vec<(Instant, usize, String)>,
    /// A kas refused (Unavailable: not delivered) and the next kas served it.
    retried: usize,
}

/// A fault put on one kas from `from` to `to`.
struct Fault {
    kas: usize,
    kind: FaultKind,
    from: Instant,
    to: Instant,
}

#[derive(PartialEq)]
enum FaultKind {
    /// Frozen: GitLab's calls to it go unanswered (no routing can help a caller that
    /// called the frozen kas itself).
    Paused,
    /// Cut off from the other kas.
    CutFromKas,
}

/// Whose fault a failed call is: `None` when it is the router's (no fault excuses it).
fn excuse(faults: &[Fault], started: Instant, kas: usize, status: &str) -> Option<&'static str> {
    faults.iter().find_map(|f| {
        let in_flight = started + CALL_TIMEOUT >= f.from;
        // A frozen kas and a kas cut off from the others are silent peers: a call handed
        // to one before kas finds it silent may be lost, and kas cannot know whether it was
        // delivered, so it says DeadlineExceeded.
        let handed_to_silent_peer = status.starts_with("DeadlineExceeded")
            && in_flight
            && started <= f.from + kas_server::kas::SILENT_WITHIN;
        match f.kind {
            FaultKind::Paused if f.kas == kas && in_flight && started <= f.to => {
                Some("GitLab called the frozen kas itself")
            }
            _ if handed_to_silent_peer => {
                Some("handed to a kas gone silent, within kas's bound (3 s)")
            }
            _ => None,
        }
    })
}

/// GitLab: through every kas to every agent, one `pods` call after another; a call a kas
/// refuses as not delivered (Unavailable) is offered to the next kas, as GitLab's client
/// behind a load balancer would. Results are kept under the phase the call started in.
struct Callers {
    phase: Arc<Mutex<String>>,
    tallies: Arc<Mutex<BTreeMap<String, Tally>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Callers {
    fn start(fleet: &Fleet) -> Callers {
        let phase = Arc::new(Mutex::new(String::from("steady")));
        let tallies = Arc::new(Mutex::new(BTreeMap::new()));
        let apis: Arc<[String]> = (0..KAS.len()).map(|i| fleet.api(i)).collect();
        let mut tasks = Vec::new();
        for first in 0..KAS.len() {
            for agent in AGENTS {
                let (phase, tallies, apis) = (phase.clone(), tallies.clone(), apis.clone());
                let (ca, secret) = (fleet.ca(), fleet.secret());
                tasks.push(tokio::spawn(async move {
                    let mut clients: Vec<Option<ApiClient>> = vec![None; apis.len()];
                    loop {
                        let started_in = phase.lock().unwrap().clone();
                        let started = Instant::now();
                        let mut outcome = Err(String::new());
                        let mut refused = 0;
                        let mut last = first;
                        for k in (0..apis.len()).map(|j| (first + j) % apis.len()) {
                            last = k;
                            if clients[k].is_none() {
                                clients[k] = ApiClient::connect_with_ca(
                                    &apis[k],
                                    Some(&ca),
                                    &secret,
                                    CALL_TIMEOUT,
                                )
                                .await
                                .ok();
                            }
                            let Some(client) = &clients[k] else {
                                refused += 1; // not reached: nothing was sent
                                outcome = Err("kas not reachable".into());
                                continue;
                            };
                            match client.pods(agent, None, "").await {
                                Ok(pods) if !pods.is_empty() => {
                                    outcome = Ok(());
                                    break;
                                }
                                Ok(_) => outcome = Err("no pods".into()),
                                Err(s) if s.code() == Code::Unavailable => {
                                    refused += 1;
                                    outcome = Err(format!("{:?}", s.code()));
                                    continue;
                                }
                                Err(s) => outcome = Err(format!("{:?}: {}", s.code(), s.message())),
                            }
                            break;
                        }
                        {
                            let mut t = tallies.lock().unwrap();
                            let tally: &mut Tally = t.entry(started_in).or_default();
                            tally.calls += 1;
                            match outcome {
                                Ok(()) if refused > 0 => tally.retried += 1,
                                Ok(()) => {}
                                Err(e) => tally.failed.push((started, last, e)),
                            }
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }));
            }
        }
        Callers {
            phase,
            tallies,
            tasks,
        }
    }

    fn enter(&self, phase: &str) {
        *self.phase.lock().unwrap() = phase.to_string();
    }
}

impl Drop for Callers {
    fn drop(&mut self) {
        self.tasks.iter().for_each(|t| t.abort());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_serves_every_call_through_restarts_partitions_freezes_and_failovers() {
    let fleet = Fleet::up();
    // What deploy/*.yaml name (deploy_manifests.rs checks they do).
    for program in ["kas", "agentk"] {
        let image = format!("kas-router/{program}:{}", env!("CARGO_PKG_VERSION"));
        fleet.docker(&["image", "inspect", &image]);
    }
    fleet.await_whole("after up").await;
    let callers = Callers::start(&fleet);
    let mut whole = BTreeMap::new();
    let mut faults = Vec::new();
    tokio::time::sleep(Duration::from_secs(5)).await;

    // Every kas in turn: SIGTERM (graceful), started again, healthy, whole.
    for (i, kas) in KAS.iter().enumerate() {
        callers.enter(&format!("restart {kas}"));
        fleet.compose(&["stop", "-t", "20", kas]);
        fleet.compose(&["start", kas]);
        fleet.await_healthy(kas).await;
        whole.insert(
            format!("restart {kas}"),
            fleet.await_whole(&format!("after kas{i} restarted")).await,
        );
    }

    // kas1 cut off from the other kas (not from Redis or agents), then healed.
    callers.enter("kas1 cut off from kas");
    let private = format!("{PROJECT}_kas-private");
    let kas1 = fleet.container("kas1");
    let from = Instant::now();
    fleet.docker(&["network", "disconnect", &private, &kas1]);
    tokio::time::sleep(Duration::from_secs(10)).await;
    fleet.docker(&["network", "connect", "--ip", "10.181.1.11", &private, &kas1]);
    faults.push(Fault {
        kas: 1,
        kind: FaultKind::CutFromKas,
        from,
        to: Instant::now(),
    });
    whole.insert(
        "kas1 cut off from kas".into(),
        fleet
            .await_whole("after kas1's private network came back")
            .await,
    );

    // kas2 frozen for longer than its records live (20 s), then thawed.
    callers.enter("kas2 paused 25 s");
    let kas2 = fleet.container("kas2");
    let from = Instant::now();
    fleet.docker(&["pause", &kas2]);
    tokio::time::sleep(Duration::from_secs(25)).await;
    fleet.docker(&["unpause", &kas2]);
    faults.push(Fault {
        kas: 2,
        kind: FaultKind::Paused,
        from,
        to: Instant::now(),
    });
    whole.insert(
        "kas2 paused 25 s".into(),
        fleet.await_whole("after kas2 was unpaused").await,
    );

    // The Redis master killed: Sentinel promotes the replica; the old master comes back as
    // a replica.
    callers.enter("redis master killed");
    fleet.compose(&["kill", "redis-master"]);
    tokio::time::sleep(Duration::from_secs(10)).await;
    fleet.compose(&["start", "redis-master"]);
    whole.insert(
        "redis master killed".into(),
        fleet.await_whole("after the Redis failover").await,
    );

    // The load balancer restarted: agents dial again within their backoff.
    callers.enter("lb restarted");
    fleet.compose(&["restart", "-t", "5", "lb"]);
    whole.insert(
        "lb restarted".into(),
        fleet.await_whole("after the load balancer restarted").await,
    );
    callers.enter("after");
    tokio::time::sleep(Duration::from_secs(3)).await;

    // The callers stop first: the assertions below must not panic with their lock held.
    let tallies = std::mem::take(&mut *callers.tallies.lock().unwrap());
    drop(callers);
    println!(
        "| phase | calls | failed: the router's | failed: excused | refused, then served by the next kas | whole again after |"
    );
    println!("|---|---|---|---|---|---|");
    let mut unexcused = Vec::new();
    for (phase, t) in tallies.iter() {
        let mut mine: BTreeMap<&str, usize> = BTreeMap::new();
        let mut excused: BTreeMap<String, usize> = BTreeMap::new();
        for (started, kas, status) in &t.failed {
            match excuse(&faults, *started, *kas, status) {
                Some(why) => *excused.entry(format!("{status} ({why})")).or_default() += 1,
                None => *mine.entry(status).or_default() += 1,
            }
        }
        let after = whole
            .get(phase)
            .map_or("-".to_string(), |d| format!("{:.1}s", d.as_secs_f64()));
        println!(
            "| {phase} | {} | {mine:?} | {excused:?} | {} | {after} |",
            t.calls, t.retried
        );
        if !mine.is_empty() {
            unexcused.push(format!("{phase}: {mine:?}"));
        }
        assert!(t.calls > 0, "no call finished in phase {phase}");
    }
    assert!(
        unexcused.is_empty(),
        "calls failed that no fault excuses: {unexcused:?}"
    );
}
