//! The Compose fleet (`deploy/compose`) in real containers, built from this tree's debug
//! binaries (`scripts/image --debug --fleet`): three kas on networks of their own, Redis
//! with Sentinel, nginx in front of kas, three agentk replicas of two agents. While
//! GitLab's calls go through every kas to every agent, and kubectl follows a log and watches
//! pods through every kas, the fleet is upgraded from the previous version
//! (`deploy/upgrade-from`: kas one at a time, then agentk) and goes through chaos: every kas restarted in turn
//! (SIGTERM), a kas cut off from the other kas, a kas cut off from Redis, a kas frozen longer
//! than its records live, the Redis master killed, the load balancer restarted. A table per
//! phase is printed: calls, failed by status, calls a kas refused that the next kas served
//! (GitLab's retry), kubectl streams cut or stalled, and how long the fleet took to be whole
//! again (every kas listing every replica). Each call's effect is counted at the agents'
//! clusters (the stand-in API servers count the requests they served): no call may have
//! reached a cluster twice, nor a call kas refused as not delivered.
//!
//! Needs Docker with `docker-compose` and kubectl; it fails (never skips) without them. It
//! uses the subnets 10.181.1-3.0/24 and the Compose project `kasfleettest`.

mod support;

use kas_auth::jwt::Secret;
use kas_client::api_client::ApiClient;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::eventually;
use tonic::Code;

const PROJECT: &str = "kasfleettest";
const KAS: [&str; 3] = ["kas0", "kas1", "kas2"];
/// Each kas's public API on loopback (given to Compose as `KAS0_API_PORT`...).
const API_PORTS: [u16; 3] = [28153, 28154, 28155];
/// Each kas's Kubernetes API on loopback (`KAS0_KUBE_PORT`...).
const KUBE_PORTS: [u16; 3] = [28163, 28164, 28165];
/// Agent 1 has one replica, agent 2 two; agent N's cluster is served by the stand-in API
/// server at `CLUSTERS[N - 1]`.
const AGENTS: [i64; 2] = [1, 2];
const CLUSTERS: [&str; 2] = ["10.181.3.21:8080", "10.181.3.22:8080"];
const REPLICAS: usize = 3;
/// How long the fleet may take to be whole again after a fault is healed: a record TTL
/// (the fleet's `redis_conn_info_ttl`, 20 s) plus agentk's reconnect backoff.
const WHOLE_WITHIN: Duration = Duration::from_secs(60);

/// The fleet, brought up by `deploy/compose/up`; taken down (containers, networks, files)
/// when dropped.
struct Fleet {
    root: PathBuf,
    dir: tempfile::TempDir,
    /// The image tags Compose runs kas and agentk from (`KAS_TAG`, `AGENTK_TAG`).
    tags: Mutex<[&'static str; 2]>,
}

/// The tag `scripts/image --from` gave the images of the version in `deploy/upgrade-from`
/// (scripts/test builds them), which the fleet starts on.
const UPGRADE_FROM: &str = "upgrade-from";

impl Fleet {
    fn up() -> Fleet {
        for (tool, package, version) in [
            ("docker", "docker.io", "version"),
            ("docker-compose", "docker-compose", "version"),
            ("kubectl", "kubernetes-client", "version --client"),
        ] {
            assert!(
                output_of(Command::new(tool).args(version.split(' '))).is_some(),
                "{tool} is missing or does not work (docker: is dockerd running?): install {package}"
            );
        }
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .canonicalize()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        for program in ["kas", "agentk"] {
            let image = format!("kas-router/{program}:{UPGRADE_FROM}");
            assert!(
                output_of(Command::new("docker").args(["image", "inspect", &image])).is_some(),
                "{image} is missing: build it with scripts/image --debug --from COMMIT --tag {UPGRADE_FROM}, COMMIT from deploy/upgrade-from (scripts/test does)"
            );
        }
        let fleet = Fleet {
            root,
            dir,
            tags: Mutex::new([UPGRADE_FROM; 2]),
        };
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
        let [kas, agentk] = *self.tags.lock().unwrap();
        c.env("FLEET_DIR", self.dir.path())
            .env("COMPOSE_PROJECT_NAME", PROJECT)
            .env("KAS_TAG", kas)
            .env("AGENTK_TAG", agentk);
        for i in 0..KAS.len() {
            c.env(format!("KAS{i}_API_PORT"), API_PORTS[i].to_string())
                .env(format!("KAS{i}_KUBE_PORT"), KUBE_PORTS[i].to_string());
        }
        c
    }

    /// kubectl's configuration, with a context per agent and kas (`agent1-kas0`...).
    fn kubeconfig(&self) -> PathBuf {
        self.dir.path().join("kubeconfig")
    }

    /// How many times agent `n`'s cluster served `request` (`METHOD path`).
    async fn served(&self, n: i64, request: &str) -> u64 {
        let url = format!("http://{}/kas-local/requests", CLUSTERS[n as usize - 1]);
        let _ = rustls::crypto::ring::default_provider().install_default();
        let counts: BTreeMap<String, u64> = reqwest::get(&url)
            .await
            .and_then(|r| r.error_for_status())
            .unwrap_or_else(|e| panic!("{url}: {e}"))
            .json()
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        counts.get(request).copied().unwrap_or(0)
    }

    /// Runs `docker-compose ARGS` on the fleet and returns its standard output.
    fn compose(&self, args: &[&str]) -> String {
        let mut c = Command::new("docker-compose");
        c.arg("-f")
            .arg(self.root.join("deploy/compose/compose.yaml"))
            .args(args);
        run(self.environment(&mut c))
    }

    /// Runs `docker ARGS` and returns its standard output.
    fn docker(&self, args: &[&str]) -> String {
        run(Command::new("docker").args(args))
    }

    /// What `service`'s program says its version is.
    fn version(&self, service: &str, program: &str) -> String {
        let binary = format!("/usr/local/bin/{program}");
        self.docker(&["exec", &self.container(service), &binary, "--version"])
    }

    /// Replaces `service`'s container by one of the image now tagged for it (Compose stops
    /// the old one with SIGTERM first).
    fn upgrade(&self, service: &str) {
        self.compose(&["up", "-d", "--no-deps", service]);
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

    /// Whether every kas lists `n` agent replicas.
    async fn listed_everywhere(&self, n: usize) -> bool {
        for i in 0..KAS.len() {
            let Ok(client) = self.client(i).await else {
                return false;
            };
            match client.agents_for_project(100).await {
                Ok(agents) if agents.len() == n => {}
                _ => return false,
            }
        }
        true
    }

    /// Waits until every kas lists `n` agent replicas and returns how long that took.
    async fn await_listed(&self, n: usize, what: &str) -> Duration {
        let start = Instant::now();
        eventually(
            WHOLE_WITHIN,
            &format!("every kas to list {n} replicas {what}"),
            || async { self.listed_everywhere(n).await.then_some(()) },
        )
        .await;
        start.elapsed()
    }

    /// Waits until the fleet is whole again (every kas lists every replica) and returns
    /// how long that took.
    async fn await_whole(&self, what: &str) -> Duration {
        self.await_listed(REPLICAS, what).await
    }

    /// Cuts kas `kas` off `network` for 10 s, then connects it again at `address`.
    async fn cut_off(&self, kas: usize, kind: FaultKind, network: &str, address: &str) -> Fault {
        let network = format!("{PROJECT}_{network}");
        let container = self.container(KAS[kas]);
        let from = Instant::now();
        self.docker(&["network", "disconnect", &network, &container]);
        tokio::time::sleep(Duration::from_secs(10)).await;
        self.docker(&["network", "connect", "--ip", address, &network, &container]);
        Fault {
            kas,
            kind,
            from,
            to: Instant::now(),
        }
    }

    /// Waits until `service`'s health check passes (kas: `kas --probe readiness`).
    async fn await_healthy(&self, service: &str) {
        let id = self.container(service);
        eventually(
            Duration::from_secs(60),
            &format!("{service} to be healthy"),
            || async {
                let status = ["inspect", "-f", "{{.State.Health.Status}}", &id];
                (output_of(Command::new("docker").args(status))? == "healthy").then_some(())
            },
        )
        .await;
    }
}

/// Runs `c` and returns its standard output, trimmed, when it succeeds.
fn output_of(c: &mut Command) -> Option<String> {
    let out = c.output().ok()?;
    let stdout = String::from_utf8_lossy(&out.stdout).trim().to_string();
    out.status.success().then_some(stdout)
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

/// The phase now (what calls and stream events are counted under).
type Phase = Arc<Mutex<String>>;

fn phase_now(phase: &Phase) -> String {
    phase.lock().unwrap().clone()
}

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

/// Calls to one agent, as its cluster should have counted them.
#[derive(Default, Clone, Copy)]
struct Effects {
    /// Answered: reached the cluster exactly once.
    ok: u64,
    /// Failed with a status that does not say "not delivered": at most once.
    unknown: u64,
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
    /// Cut off from Redis.
    CutFromRedis,
    /// The load balancer restarted: every agent's tunnels through it cut at once.
    LbRestarted,
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
            && started <= f.from + kas_server::kas::SILENT_WITHIN
            && matches!(f.kind, FaultKind::Paused | FaultKind::CutFromKas);
        // A call cut after it was handed to an agent's tunnel (or to another kas) may
        // have reached the agent: kas says Unknown, not Unavailable, so that it is not
        // sent again.
        let cut_mid_call = status.starts_with("Unknown")
            && status.contains("during the call")
            && in_flight
            && started <= f.to;
        match f.kind {
            FaultKind::Paused if f.kas == kas && in_flight && started <= f.to => {
                Some("GitLab called the frozen kas itself")
            }
            _ if handed_to_silent_peer => {
                Some("handed to a kas gone silent, within kas's bound (3 s)")
            }
            _ if cut_mid_call => {
                Some("cut mid-call by the fault: delivered or not, kas cannot know")
            }
            _ => None,
        }
    })
}

/// GitLab: through every kas to every agent, one `pods` call after another; a call a kas
/// refuses as not delivered (Unavailable) is offered to the next kas, as GitLab's client
/// behind a load balancer would. Results are kept under the phase the call started in.
struct Callers {
    phase: Phase,
    tallies: Arc<Mutex<BTreeMap<String, Tally>>>,
    effects: Arc<Mutex<BTreeMap<i64, Effects>>>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Callers {
    fn start(fleet: &Fleet, phase: &Phase) -> Callers {
        let tallies = Arc::new(Mutex::new(BTreeMap::new()));
        let effects = Arc::new(Mutex::new(BTreeMap::<i64, Effects>::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let apis: Arc<[String]> = (0..KAS.len()).map(|i| fleet.api(i)).collect();
        let mut tasks = Vec::new();
        for first in 0..KAS.len() {
            for agent in AGENTS {
                let (phase, tallies, effects, stop, apis) = (
                    phase.clone(),
                    tallies.clone(),
                    effects.clone(),
                    stop.clone(),
                    apis.clone(),
                );
                let (ca, secret) = (fleet.ca(), fleet.secret());
                tasks.push(tokio::spawn(async move {
                    let mut clients: Vec<Option<ApiClient>> = vec![None; apis.len()];
                    while !stop.load(Ordering::Relaxed) {
                        let started_in = phase_now(&phase);
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
                            let mut e = effects.lock().unwrap();
                            let e = e.entry(agent).or_default();
                            match &outcome {
                                Ok(()) => e.ok += 1,
                                Err(s) if s == "Unavailable" || s == "kas not reachable" => {}
                                Err(_) => e.unknown += 1,
                            }
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
            phase: phase.clone(),
            tallies,
            effects,
            stop,
            tasks,
        }
    }

    fn enter(&self, phase: &str) {
        *self.phase.lock().unwrap() = phase.to_string();
    }

    /// Lets every call in flight finish, then returns what happened.
    async fn finish(mut self) -> (BTreeMap<String, Tally>, BTreeMap<i64, Effects>) {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks.drain(..) {
            task.await.expect("a caller panicked");
        }
        let tallies = std::mem::take(&mut *self.tallies.lock().unwrap());
        let effects = std::mem::take(&mut *self.effects.lock().unwrap());
        (tallies, effects)
    }
}

impl Drop for Callers {
    fn drop(&mut self) {
        self.tasks.iter().for_each(|t| t.abort());
    }
}

/// What a stream's event says when it ended with no error: a silent truncation.
const SILENT_END: &str = "ended without an error";

/// A `kubectl logs -f` line arrives every 300 ms; a gap this long is a stall.
const STALL: Duration = Duration::from_secs(3);

/// kubectl through every kas: `logs -f` of agent 1's web-1 and `get pods --watch` of agent
/// 2's, each started again when it ends. Records, by phase, each stream cut (kubectl
/// ended) and each log stalled.
struct Streams {
    events: Arc<Mutex<Vec<(String, String)>>>,
    stop: Arc<AtomicBool>,
    children: Vec<Arc<Mutex<Option<Child>>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Streams {
    fn start(fleet: &Fleet, phase: &Phase) -> Streams {
        let mut streams = Streams {
            events: Arc::default(),
            stop: Arc::default(),
            children: Vec::new(),
            threads: Vec::new(),
        };
        for i in 0..KAS.len() {
            let logs = format!("--context=agent1-kas{i} logs -f web-1");
            let watch = format!("--context=agent2-kas{i} -n shop get pods --watch");
            for (args, follows) in [(logs, true), (watch, false)] {
                let child: Arc<Mutex<Option<Child>>> = Arc::default();
                let (events, stop, phase) =
                    (streams.events.clone(), streams.stop.clone(), phase.clone());
                let kubeconfig = fleet.kubeconfig();
                let slot = child.clone();
                streams.threads.push(std::thread::spawn(move || {
                    let name = format!("kubectl {args}");
                    let event = |at: &str, what: String| {
                        events
                            .lock()
                            .unwrap()
                            .push((at.to_string(), format!("{name}: {what}")));
                    };
                    while !stop.load(Ordering::Relaxed) {
                        let mut c = Command::new("kubectl")
                            .env("KUBECONFIG", &kubeconfig)
                            .args(args.split(' '))
                            .stdin(Stdio::null())
                            .stdout(Stdio::piped())
                            .stderr(Stdio::piped())
                            .spawn()
                            .expect("kubectl runs");
                        let (out, mut err) = (c.stdout.take().unwrap(), c.stderr.take().unwrap());
                        *slot.lock().unwrap() = Some(c);
                        if stop.load(Ordering::Relaxed) {
                            // `finish` may have looked before the child was in its slot.
                            slot.lock().unwrap().as_mut().map(Child::kill);
                        }
                        let (mut last, mut lines) = (Instant::now(), 0);
                        let mut last_phase = phase_now(&phase);
                        let mut last_line = String::new();
                        for line in BufReader::new(out).lines() {
                            let Ok(line) = line else { break };
                            let gap = last.elapsed();
                            if follows && lines > 0 && gap > STALL {
                                event(&last_phase, format!("stalled {:.1} s", gap.as_secs_f64()));
                            }
                            (last, lines, last_phase) =
                                (Instant::now(), lines + 1, phase_now(&phase));
                            last_line = line;
                        }
                        let mut stderr = String::new();
                        let _ = err.read_to_string(&mut stderr);
                        let status = slot.lock().unwrap().take().map(|mut c| c.wait());
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        // kubectl reports a broken log on stderr (exit 1), a broken watch
                        // as a Failure row on stdout (exit 0). The fixture ends neither, so
                        // an end without either is a body cut short without an error.
                        let failed = !status.is_some_and(|s| s.is_ok_and(|s| s.success()));
                        let why = if failed {
                            stderr
                                .lines()
                                .last()
                                .unwrap_or("failed, with nothing on stderr")
                        } else if last_line.contains("Failure") {
                            &last_line
                        } else {
                            SILENT_END
                        };
                        event(
                            &phase_now(&phase),
                            format!("cut after {lines} lines: {why}"),
                        );
                        std::thread::sleep(Duration::from_secs(1));
                    }
                }));
                streams.children.push(child);
            }
        }
        streams
    }

    /// Tells every stream to stop and ends the kubectl each runs.
    fn stop_all(&self) {
        self.stop.store(true, Ordering::Relaxed);
        for child in &self.children {
            if let Some(c) = child.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
                let _ = c.kill();
            }
        }
    }

    /// Stops every stream and returns its events: (phase, what).
    fn finish(mut self) -> Vec<(String, String)> {
        self.stop_all();
        for t in self.threads.drain(..) {
            t.join().expect("a stream's thread panicked");
        }
        std::mem::take(&mut *self.events.lock().unwrap())
    }
}

impl Drop for Streams {
    fn drop(&mut self) {
        self.stop_all();
    }
}

/// Phases in which no stream may be cut or stall: no fault is on a path a stream takes
/// (GitLab -> kas -> kas -> agent -> cluster), nor on a kas that must stop.
const QUIET: [&str; 4] = [
    "steady",
    "kas0 cut off from redis",
    "redis master killed",
    "after",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_serves_every_call_through_restarts_partitions_freezes_and_failovers() {
    let fleet = Fleet::up();
    // What deploy/*.yaml name (deploy_manifests.rs checks they do).
    for program in ["kas", "agentk"] {
        let image = format!("kas-router/{program}:{}", env!("CARGO_PKG_VERSION"));
        fleet.docker(&["image", "inspect", &image]);
    }
    fleet.await_whole("after up").await;
    // Redis serves TLS only: a plaintext client is refused, a TLS one answered.
    let master = fleet.container("redis-master");
    let ping = |tls: &[&str]| {
        let cli = ["exec", &master, "redis-cli", "-p", "6379"];
        output_of(Command::new("docker").args(cli.iter().chain(tls).chain(&["ping"])))
    };
    let pong = Some("PONG".to_string());
    assert_eq!(ping(&["--tls", "--cacert", "/etc/redis/ca.crt"]), pong);
    assert_ne!(ping(&[]), pong, "Redis answered a plaintext client");
    let phase: Phase = Arc::new(Mutex::new(String::from("steady")));
    let callers = Callers::start(&fleet, &phase);
    let streams = Streams::start(&fleet, &phase);
    let mut whole = BTreeMap::new();
    let mut faults = Vec::new();
    tokio::time::sleep(Duration::from_secs(5)).await;

    // The fleet runs the previous version: kas upgraded one at a time, then agentk.
    callers.enter("upgrade");
    let before = [
        fleet.version("kas0", "kas"),
        fleet.version("agent1", "agentk"),
    ];
    fleet.tags.lock().unwrap()[0] = "latest";
    for (i, kas) in KAS.iter().enumerate() {
        fleet.upgrade(kas);
        fleet.await_healthy(kas).await;
        fleet
            .await_whole(&format!("after kas{i} was upgraded"))
            .await;
    }
    fleet.tags.lock().unwrap()[1] = "latest";
    // Agent 1 has one replica: its new one starts before the old one stops, as a Kubernetes
    // Deployment's rolling update does (maxSurge), or its calls would wait out the old
    // one's drain (up to agentk's --shutdown-grace while streams run). Agent 2's replicas
    // are replaced one at a time.
    let old = fleet.container("agent1");
    fleet.compose(&[
        "up",
        "-d",
        "--no-deps",
        "--no-recreate",
        "--scale",
        "agent1=2",
        "agent1",
    ]);
    fleet
        .await_listed(REPLICAS + 1, "with agent1's new replica beside the old")
        .await;
    fleet.docker(&["stop", "-t", "15", &old]);
    fleet.docker(&["rm", &old]);
    fleet.await_whole("after agent1 was upgraded").await;
    for agent in ["agent2a", "agent2b"] {
        fleet.upgrade(agent);
        fleet
            .await_whole(&format!("after {agent} was upgraded"))
            .await;
    }
    let after = [
        fleet.version("kas0", "kas"),
        fleet.version("agent1", "agentk"),
    ];
    println!("upgraded from {before:?} to {after:?}");
    assert!(
        before
            .iter()
            .all(|v| v.ends_with(&format!("-at-{UPGRADE_FROM}")))
            && after.iter().all(|v| v.ends_with(env!("CARGO_PKG_VERSION"))),
        "not upgraded from {UPGRADE_FROM}: {before:?} -> {after:?}"
    );

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

    // kas1 cut off from the other kas (not from Redis or agents), then healed; then kas0
    // cut off from Redis (not from the other kas or agents), then healed.
    for (phase, kas, kind, network, address) in [
        (
            "kas1 cut off from kas",
            1,
            FaultKind::CutFromKas,
            "kas-private",
            "10.181.1.11",
        ),
        (
            "kas0 cut off from redis",
            0,
            FaultKind::CutFromRedis,
            "kas-redis",
            "10.181.2.30",
        ),
    ] {
        callers.enter(phase);
        faults.push(fleet.cut_off(kas, kind, network, address).await);
        whole.insert(
            phase.to_string(),
            fleet.await_whole(&format!("after {phase}, healed")).await,
        );
    }

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
    let from = Instant::now();
    fleet.compose(&["restart", "-t", "5", "lb"]);
    faults.push(Fault {
        kas: usize::MAX, // every kas's agents alike
        kind: FaultKind::LbRestarted,
        from,
        to: Instant::now(),
    });
    whole.insert(
        "lb restarted".into(),
        fleet.await_whole("after the load balancer restarted").await,
    );
    callers.enter("after");
    tokio::time::sleep(Duration::from_secs(5)).await;

    // Everything stops before the assertions, which must not panic with a lock held.
    let events = streams.finish();
    let (tallies, effects) = callers.finish().await;
    println!(
        "| phase | calls | failed: the router's | failed: excused | refused, then served by the next kas | kubectl streams cut or stalled | whole again after |"
    );
    println!("|---|---|---|---|---|---|---|");
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
        let cut = events.iter().filter(|(p, _)| p == phase).count();
        println!(
            "| {phase} | {} | {mine:?} | {excused:?} | {} | {cut} | {after} |",
            t.calls, t.retried
        );
        if !mine.is_empty() {
            unexcused.push(format!("{phase}: {mine:?}"));
        }
        assert!(t.calls > 0, "no call finished in phase {phase}");
    }
    for (phase, what) in &events {
        println!("stream, {phase}: {what}");
    }
    // At most once, counted where the calls take effect: each pods call is one list of
    // the agent's cluster.
    for agent in AGENTS {
        let e = effects.get(&agent).copied().unwrap_or_default();
        let served = fleet.served(agent, "GET /api/v1/pods").await;
        println!(
            "agent {agent}: {} calls answered, {} failed without a not-delivered status, {served} lists served by its cluster",
            e.ok, e.unknown
        );
        assert!(
            e.ok <= served && served <= e.ok + e.unknown,
            "agent {agent}'s cluster served {served} lists for {} answered calls and {} of unknown fate: a call reached it twice, or a call kas refused as not delivered reached it",
            e.ok,
            e.unknown
        );
    }
    assert!(
        unexcused.is_empty(),
        "calls failed that no fault excuses: {unexcused:?}"
    );
    let silent: Vec<_> = events
        .iter()
        .filter(|(_, e)| e.ends_with(SILENT_END))
        .collect();
    assert!(
        silent.is_empty(),
        "kubectl streams ended as if whole, with no error: {silent:?}"
    );
    let quiet: Vec<_> = events
        .iter()
        .filter(|(p, _)| QUIET.contains(&p.as_str()))
        .collect();
    assert!(
        quiet.is_empty(),
        "kubectl streams cut or stalled where no fault was: {quiet:?}"
    );
}
