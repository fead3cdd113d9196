//! GitLab's calls during a scenario: each call goes to a random kas for a random agent
//! (connected, absent or late) with a random deadline, some pinned to one replica's
//! connection, a quarter of them log streams (server-streaming) and an eighth two-way
//! exchanges (the Kubernetes API's streaming call, echoed by the agent's API server, half
//! of them HTTP requests to kas's Kubernetes API listener) rather than pod lists, and its
//! outcome is recorded.

use crate::cluster::kas_addr;
use crate::kube_caller;
use crate::planted_bug::{Bug, planted};
use futures::FutureExt;
use kas_auth::jwt::Secret;
use kas_client::api_client::ApiClient;
use madsim::rand::{Rng, thread_rng};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// One call and what came of it.
#[derive(Clone, Debug)]
pub struct Call {
    /// Its marker, unique in the run (the agent records it).
    pub marker: String,
    /// The kas called.
    pub kas: usize,
    /// The agent asked for.
    pub agent: i64,
    /// The replica whose connection the call named, if it named one.
    pub replica: Option<usize>,
    /// When it was issued.
    pub started: Instant,
    /// Its timeout.
    pub timeout: Duration,
    /// How long it took.
    pub took: Duration,
    /// The pod name that answered, or the error code and message.
    pub result: Result<String, (tonic::Code, String)>,
    /// For a two-way exchange that ended OK: what came back differed from what was sent.
    pub echo_mismatch: Option<String>,
    /// A two-way exchange: once delivered, it is bounded by its ends, not its deadline.
    pub two_way: bool,
    /// A request through kas's Kubernetes API listener rather than a gRPC call.
    pub http: Option<Http>,
}

#[cfg(test)]
impl Call {
    /// A call for the checks' tests: `marker` for `agent` through kas `kas` from `started`,
    /// for a second, answered by its replica 0 after 10 ms.
    pub fn sample(marker: &str, kas: usize, agent: i64, started: Instant) -> Call {
        Call {
            marker: marker.into(),
            kas,
            agent,
            replica: None,
            started,
            timeout: Duration::from_secs(1),
            took: Duration::from_millis(10),
            result: Ok(crate::truth::pod_name(agent, 0)),
            echo_mismatch: None,
            two_way: false,
            http: None,
        }
    }
}

/// What the caller of a Kubernetes API request saw of kas's response.
#[derive(Clone, Debug)]
pub struct Http {
    /// Its status, once its head came.
    pub status: Option<u16>,
    /// The bytes of its body (or upgraded connection) that came back.
    pub received: usize,
}

/// What a call asks for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    List,
    Logs,
    Exchange,
}

/// Issues one call through kas `kas` and records it.
pub async fn call(
    secret: &Secret,
    kas: usize,
    agent: i64,
    marker: String,
    timeout: Duration,
) -> Call {
    pinned(secret, kas, agent, None, marker, timeout).await
}

/// Issues one call through kas `kas`, for the connection of `pin` (replica, connection id)
/// if set, and records it.
pub async fn pinned(
    secret: &Secret,
    kas: usize,
    agent: i64,
    pin: Option<(usize, i64)>,
    marker: String,
    timeout: Duration,
) -> Call {
    let started = Instant::now();
    let bug = planted();
    // The planted bugs' calls: as if kas had routed to the wrong agent or delivered twice.
    let routed_to = if bug == Bug::WrongAgent {
        agent % 3 + 1
    } else {
        agent
    };
    let kind = match thread_rng().gen_range(0..8) {
        0 | 1 => Kind::Logs,
        2 => Kind::Exchange,
        _ => Kind::List,
    };
    let mut seen = kube_caller::Seen::default();
    let mut http = false;
    let result = match ApiClient::connect(&kas_addr(kas, 8153).to_string(), secret, timeout).await {
        Err(e) => Err((tonic::Code::Unavailable, e)),
        Ok(api) => {
            let connection = pin.map(|p| p.1);
            let answer = match kind {
                Kind::Logs => logs(&api, routed_to, connection, &marker).await,
                Kind::Exchange => {
                    // Half through kas's Kubernetes API listener (which names no replica),
                    // half as GitLab's own calls.
                    http = connection.is_none() && thread_rng().gen_bool(0.5);
                    let two_way = if http {
                        kube_caller::exchange(kas, routed_to, &marker, timeout, &mut seen).boxed()
                    } else {
                        let mismatch = &mut seen.mismatch;
                        exchange(&api, routed_to, connection, &marker, mismatch).boxed()
                    };
                    bounded(timeout, two_way).await
                }
                Kind::List => {
                    let pods = api.pods(routed_to, connection, &marker).await;
                    pods.map(|p| p.first().map(|p| p.name.clone()).unwrap_or_default())
                }
            };
            if bug == Bug::DeliverTwice && answer.is_ok() {
                let _ = api.pods(routed_to, None, &marker).await;
            }
            answer.map_err(|s| (s.code(), s.message().to_string()))
        }
    };
    Call {
        marker,
        kas,
        agent,
        replica: pin.map(|p| p.0),
        started,
        timeout,
        took: started.elapsed(),
        result,
        two_way: kind == Kind::Exchange,
        http: http.then_some(Http {
            status: seen.status,
            received: seen.received,
        }),
        echo_mismatch: seen.mismatch,
    }
}

/// A two-way call with timeout `timeout`, cut off past the bound the checker holds it to
/// (inv 2 reports it then): a hung exchange must not hang the run.
pub async fn bounded<T>(
    timeout: Duration,
    two_way: impl Future<Output = Result<T, tonic::Status>>,
) -> Result<T, tonic::Status> {
    let limit = timeout + crate::bounds::STREAM_BOUND + Duration::from_secs(10);
    tokio::time::timeout(limit, two_way)
        .await
        .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded("the exchange hung")))
}

/// A two-way exchange: the head, then 1-4 body pieces sent 0-50 ms apart while the echo
/// is read. The pod that answered; `mismatch` says how the echo differed from what was
/// sent when the call ended OK.
async fn exchange(
    api: &ApiClient,
    agent: i64,
    connection: Option<i64>,
    marker: &str,
    mismatch: &mut Option<String>,
) -> Result<String, tonic::Status> {
    use kas_proto::http::{HttpRequest, RequestHead, http_request, http_response};
    // As GitLab sends its own; the API server must see it (inv 14, see `api_server`).
    let api = api.with_correlation_id(crate::api_server::correlation_id(marker));
    let pieces: Vec<Vec<u8>> = (0..thread_rng().gen_range(1..=4))
        .map(|i| format!("{marker}/{i};").into_bytes())
        .collect();
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let head = HttpRequest {
        kind: Some(http_request::Kind::Head(RequestHead {
            method: "POST".into(),
            path: format!("/{marker}"),
            ..Default::default()
        })),
    };
    let _ = tx.try_send(head);
    let sent: Vec<u8> = pieces.concat();
    tokio::spawn(async move {
        for p in pieces {
            let gap = Duration::from_millis(thread_rng().gen_range(0..50));
            tokio::time::sleep(gap).await;
            let piece = HttpRequest {
                kind: Some(http_request::Kind::Data(p.into())),
            };
            if tx.send(piece).await.is_err() {
                return;
            }
        }
    });
    let mut stream = api
        .kubernetes_request(
            agent,
            connection,
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )
        .await?;
    let mut pod = None;
    let mut echoed = Vec::new();
    while let Some(m) = stream.message().await? {
        match m.kind {
            Some(http_response::Kind::Head(h)) if pod.is_none() => {
                pod = h
                    .headers
                    .get("x-pod")
                    .and_then(|v| v.values.first().cloned());
            }
            Some(http_response::Kind::Data(d)) => echoed.extend_from_slice(&d),
            other => *mismatch = Some(format!("unexpected response message {other:?}")),
        }
    }
    if echoed != sent {
        *mismatch = Some(format!(
            "echoed {:?}, sent {:?}",
            String::from_utf8_lossy(&echoed),
            String::from_utf8_lossy(&sent)
        ));
    }
    pod.ok_or_else(|| tonic::Status::internal("the exchange ended without a response head"))
}

/// A log call (server-streaming): the pod that sent every chunk, or the chunks joined
/// with `+` when they came from several (which the checker reports).
async fn logs(
    api: &ApiClient,
    agent: i64,
    connection: Option<i64>,
    marker: &str,
) -> Result<String, tonic::Status> {
    let mut stream = api
        .pod_logs(agent, connection, marker, "sim", "", 0)
        .await?;
    let mut pods: Vec<String> = Vec::new();
    while let Some(chunk) = stream.message().await? {
        let pod = String::from_utf8_lossy(&chunk.data).into_owned();
        if !pods.contains(&pod) {
            pods.push(pod);
        }
    }
    if pods.is_empty() {
        return Err(tonic::Status::internal(
            "the log stream ended without a chunk",
        ));
    }
    Ok(pods.join("+"))
}

/// The connections of `agent` that kas `kas` lists: (replica, connection id).
pub async fn connections(secret: &Secret, kas: usize, agent: i64) -> Vec<(usize, i64)> {
    let Ok(api) = ApiClient::connect(
        &kas_addr(kas, 8153).to_string(),
        secret,
        Duration::from_secs(2),
    )
    .await
    else {
        return Vec::new();
    };
    let agents = api.agents_by_id(agent).await.unwrap_or_default();
    agents
        .into_iter()
        .filter_map(|a| {
            let pod = a.agent_meta.unwrap_or_default().pod_name;
            let replica = pod.rsplit_once("-replica")?.1.parse().ok()?;
            Some((replica, a.connection_id))
        })
        .collect()
}

/// The pod names of `agent`'s replicas that kas `kas` lists, sorted.
pub async fn listed(secret: &Secret, kas: usize, agent: i64) -> Result<Vec<String>, String> {
    let homes = homes(secret, kas, agent).await?;
    Ok(homes.into_iter().map(|(pod, _)| pod).collect())
}

/// The replicas of `agent` that kas `kas` lists: each pod with the kas (private
/// addresses) it is connected to, sorted; an error if kas warns of any (see
/// `kas_server`'s `agent_version`).
pub async fn homes(
    secret: &Secret,
    kas: usize,
    agent: i64,
) -> Result<Vec<(String, Vec<String>)>, String> {
    let api = ApiClient::connect(
        &kas_addr(kas, 8153).to_string(),
        secret,
        Duration::from_secs(5),
    )
    .await?;
    let agents = api.agents_by_id(agent).await.map_err(|s| s.to_string())?;
    // Every agentk here is of kas's own build: a warning is a wrong listing.
    if let Some(a) = agents.iter().find(|a| !a.warnings.is_empty()) {
        return Err(format!(
            "kas{kas} warns of replica {}: {:?}",
            a.connection_id, a.warnings
        ));
    }
    let mut homes: Vec<(String, Vec<String>)> = agents
        .into_iter()
        .map(|a| {
            let kas = a
                .kas_addresses
                .iter()
                .map(|k| format!("{}:{}", k.ip, k.port))
                .collect();
            (a.agent_meta.unwrap_or_default().pod_name, kas)
        })
        .collect();
    homes.sort();
    Ok(homes)
}

/// Makes the calls `targets` (kas, agent, marker) at once, each at a random moment within
/// `spread`, each with `timeout`, and returns them in the order given once all have ended.
pub async fn at_once(
    secret: &Secret,
    targets: Vec<(usize, i64, String)>,
    spread: Duration,
    timeout: Duration,
) -> Vec<Call> {
    let tasks: Vec<_> = targets
        .into_iter()
        .map(|(k, agent, marker)| {
            let secret = secret.clone();
            let after = spread.mul_f64(thread_rng().r#gen::<f64>());
            tokio::spawn(async move {
                tokio::time::sleep(after).await;
                call(&secret, k, agent, marker, timeout).await
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("a call's task"));
    }
    out
}

/// Floods `agent` with short calls (0.5-3 s deadlines), one every `every` on average
/// whether or not the others have ended, through kas drawn from `kas`, until `stop` is
/// set; returns every call. Faster than an agent's tunnels serve, so that a patient
/// call must wait its turn among a stream of fresh ones.
pub async fn flood(
    secret: Secret,
    kas: usize,
    agent: i64,
    every: Duration,
    prefix: String,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> Vec<Call> {
    let mut tasks = Vec::new();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let (k, timeout, pause) = {
            let mut rng = thread_rng();
            (
                rng.gen_range(0..kas),
                Duration::from_millis(rng.gen_range(500..3_000)),
                every.mul_f64(rng.gen_range(0.0..2.0)),
            )
        };
        let (secret, marker) = (secret.clone(), format!("{prefix}-{}", tasks.len()));
        tasks.push(tokio::spawn(async move {
            call(&secret, k, agent, marker, timeout).await
        }));
        tokio::time::sleep(pause).await;
    }
    let mut all = Vec::new();
    for t in tasks {
        all.push(t.await.expect("a flooding call's task"));
    }
    all
}

/// Calls at random intervals (mean `every`) until `until`, each concurrently, for agents
/// drawn from `agents`; returns every call once all have finished. An eighth of the calls
/// start a burst: 1-3 more for the same agent through the same kas, 0-50 ms apart (a page
/// or kubectl sending several requests at once), so that calls join one another's
/// lookups and meet the tunnels the others keep busy.
pub async fn run(
    secret: Secret,
    kas: usize,
    agents: Vec<i64>,
    every: Duration,
    until: Instant,
    prefix: &'static str,
) -> Vec<Call> {
    let calls = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    let mut n = 0u64;
    // The calls left in a burst, and its kas and agent.
    let mut burst = (0u32, 0usize, 0i64);
    while Instant::now() < until {
        let (k, agent, timeout, pause) = {
            let mut rng = thread_rng();
            let (k, agent) = if burst.0 > 0 {
                burst.0 -= 1;
                (burst.1, burst.2)
            } else {
                let (k, agent) = (
                    rng.gen_range(0..kas),
                    agents[rng.gen_range(0..agents.len())],
                );
                if rng.gen_bool(0.125) {
                    burst = (rng.gen_range(1..=3), k, agent);
                }
                (k, agent)
            };
            let pause_ms = if burst.0 > 0 {
                rng.gen_range(0..50)
            } else {
                rng.gen_range(0..2 * every.as_millis() as u64 + 1)
            };
            (
                k,
                agent,
                Duration::from_millis(rng.gen_range(500..5_000)),
                Duration::from_millis(pause_ms),
            )
        };
        n += 1;
        let pin_one = thread_rng().gen_bool(0.25);
        let pick = thread_rng().r#gen::<usize>();
        let (secret, calls) = (secret.clone(), calls.clone());
        let marker = format!("{prefix}-{n}");
        tasks.push(tokio::spawn(async move {
            // A quarter of the calls name one of the connections the kas lists.
            let pin = if pin_one {
                let listed = connections(&secret, k, agent).await;
                (!listed.is_empty()).then(|| listed[pick % listed.len()])
            } else {
                None
            };
            let c = pinned(&secret, k, agent, pin, marker, timeout).await;
            calls.lock().unwrap_or_else(|p| p.into_inner()).push(c);
        }));
        tokio::time::sleep(pause).await;
    }
    for t in tasks {
        let _ = t.await;
    }
    let mut all = calls.lock().unwrap_or_else(|p| p.into_inner()).clone();
    all.sort_by(|a, b| a.marker.cmp(&b.marker));
    all
}
