//! What the second outside probe broke in kas's listeners, each reproduced with raw sockets
//! against a kas process on loopback: a WebSocket ping flood and unfinished WebSocket
//! messages before authentication, slow and idle connections on the Kubernetes API
//! listener, and idle sockets taking a TLS listener's handshake slots.

mod support;

use std::net::SocketAddr;
use std::time::Duration;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{Instant, timeout};

/// The HTTP/2 connection preface.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// A kas whose plaintext agent listener takes WebSocket upgrades, with `listen` lines.
async fn websocket_kas(s: &Secrets, listen: &str) -> KasProc {
    let lines = format!("    websocket: true\n{listen}");
    let extra = Extra {
        agent_listen: &lines,
        ..Extra::default()
    };
    KasProc::start_extra(s, "kas", None, 10_000, extra, None).await
}

/// A client's WebSocket frame (masked, as clients must): `opcode`, `fin`, `payload`.
fn ws_frame(opcode: u8, fin: bool, payload: &[u8]) -> Vec<u8> {
    let mask = [0x11, 0x22, 0x33, 0x44];
    let mut f = vec![if fin { 0x80 } else { 0 } | opcode];
    match payload.len() {
        n if n < 126 => f.push(0x80 | n as u8),
        n if n <= 0xffff => {
            f.push(0x80 | 126);
            f.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            f.push(0x80 | 127);
            f.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    f.extend_from_slice(&mask);
    f.extend(payload.iter().zip(mask.iter().cycle()).map(|(b, m)| b ^ m));
    f
}

/// Reads up to the end of an HTTP response head, each byte within `wait`; the head.
async fn read_head(c: &mut TcpStream, wait: Duration) -> String {
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = timeout(wait, c.read(&mut b))
            .await
            .expect("a response head in time")
            .expect("reads");
        assert_eq!(n, 1, "the connection ended in the head: {head:?}");
        head.push(b[0]);
    }
    String::from_utf8_lossy(&head).into_owned()
}

/// A WebSocket upgraded at `addr` (no authentication: kas cannot ask for any before the
/// gRPC inside), its HTTP/2 preface sent as one message.
async fn upgraded(addr: SocketAddr) -> TcpStream {
    let mut c = TcpStream::connect(addr).await.expect("connects");
    let request = format!(
        "GET / HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    );
    c.write_all(request.as_bytes()).await.unwrap();
    let head = read_head(&mut c, Duration::from_secs(5)).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    c.write_all(&ws_frame(2, true, PREFACE)).await.unwrap();
    c
}

/// How long until kas closes `c` (a read sees its end), writing `trickle` every 250 ms
/// meanwhile when set; `None` if it is still open after `within`.
async fn closed_within(mut c: TcpStream, within: Duration, trickle: Vec<u8>) -> Option<Duration> {
    let start = Instant::now();
    let mut b = [0u8; 4096];
    while start.elapsed() < within {
        if !trickle.is_empty() && c.write_all(&trickle).await.is_err() {
            return Some(start.elapsed());
        }
        let read = timeout(Duration::from_millis(250), c.read(&mut b)).await;
        if let Ok(Ok(0) | Err(_)) = read {
            return Some(start.elapsed());
        }
    }
    None
}

/// Item 1: a client that upgrades, sends the HTTP/2 preface, then floods pings and never
/// reads stops being read from once its pongs cannot be sent; kas's memory stays flat.
#[tokio::test(flavor = "multi_thread")]
async fn a_websocket_ping_flood_stops_being_read_and_kas_memory_stays_flat() {
    let s = Secrets::new();
    let kas = websocket_kas(&s, "").await;
    let before = kas.rss();
    let mut c = upgraded(kas.agent).await;
    let pings: Vec<u8> = (0..512)
        .flat_map(|_| ws_frame(9, true, &[7; 125]))
        .collect();
    let (limit, mut sent) = (256usize << 20, 0usize);
    while sent < limit {
        match timeout(Duration::from_secs(2), c.write_all(&pings)).await {
            Ok(Ok(())) => sent += pings.len(),
            _ => break,
        }
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let grown = kas.rss().saturating_sub(before);
    eprintln!(
        "ping flood: {} MiB sent before kas stopped reading; kas RSS {} -> +{} MiB",
        sent >> 20,
        before >> 20,
        grown >> 20
    );
    assert!(sent < 64 << 20, "kas read {} MiB of pings", sent >> 20);
    assert!(grown < 32 << 20, "kas grew {} MiB", grown >> 20);
    let live = timeout(Duration::from_secs(5), kas.metrics()).await;
    assert!(live.is_ok_and(|m| m.contains("kas_")), "kas still serves");
}

/// Item 7: a WebSocket message that never finishes holds at most a message's cap (a longer
/// one ends its connection at once), and one trickled without end is cut off within
/// `handshake_timeout`.
#[tokio::test(flavor = "multi_thread")]
async fn unfinished_websocket_messages_are_capped_and_timed_out() {
    let s = Secrets::new();
    let kas = websocket_kas(&s, "    handshake_timeout: 2s\n").await;
    let before = kas.rss();
    let piece = vec![0u8; 64 << 10];
    let mut begun = Vec::new();
    for _ in 0..60 {
        let mut c = upgraded(kas.agent).await;
        // 1 MiB begun in sixteen fragments, never finished (the cap is ~272 KiB).
        let _ = c.write_all(&ws_frame(2, false, &piece)).await;
        for _ in 0..15 {
            let frame = ws_frame(0, false, &piece);
            if timeout(Duration::from_secs(1), c.write_all(&frame))
                .await
                .is_err()
            {
                break;
            }
        }
        begun.push(c);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let held = kas.rss().saturating_sub(before);
    eprintln!(
        "60 unfinished 1 MiB messages: kas RSS {} MiB -> +{} MiB",
        before >> 20,
        held >> 20
    );
    assert!(held < 24 << 20, "kas holds {} MiB for them", held >> 20);
    for c in begun {
        let closed = closed_within(c, Duration::from_secs(3), Vec::new()).await;
        assert!(
            closed.is_some(),
            "a message over the cap ends its connection"
        );
    }
    // Small pieces trickled forever: cut off within handshake_timeout (2 s) of starting.
    let mut trickles = Vec::new();
    for _ in 0..20 {
        let mut c = upgraded(kas.agent).await;
        c.write_all(&ws_frame(2, false, &[1; 1024])).await.unwrap();
        trickles.push(tokio::spawn(closed_within(
            c,
            Duration::from_secs(8),
            ws_frame(0, false, &[2; 16]),
        )));
    }
    for t in trickles {
        let after = t.await.unwrap().expect("closed within 8 s");
        assert!(after < Duration::from_secs(5), "closed after {after:?}");
    }
}

/// Item 2: the Kubernetes API listener closes a connection that sends nothing, part of a
/// request head (at once, trickled, or an HTTP/2 preface alone), or stays idle after an
/// answer; a connection whose request is open for longer is not closed; kas's descriptors
/// come back to where they were.
#[tokio::test(flavor = "multi_thread")]
async fn the_kubernetes_api_listener_closes_slow_and_idle_connections_but_not_busy_ones() {
    let s = Secrets::new();
    let listen =
        "      handshake_timeout: 2s\n      request_head_timeout: 3s\n      idle_timeout: 4s\n";
    let token = "slow-user-token-00001";
    let kas = KasProc::with_kubernetes_api(&s, &[token], listen, "").await;
    let addr = kas.kubernetes_api.expect("a Kubernetes API listener");
    let fds_before = kas.open_fds();
    let connect = || TcpStream::connect(addr);
    let within = Duration::from_secs(8);
    let mut cases = Vec::new();
    for (what, sent, trickle) in [
        ("silent", &b""[..], &b""[..]),
        ("one byte", b"G", b""),
        ("half a request line", b"GET /api/v1/po", b""),
        ("a header trickled", b"GET / HTTP/1.1\r\nX-Slow: ", b"a"),
        ("an HTTP/2 preface alone", PREFACE, b""),
    ] {
        let mut c = connect().await.unwrap();
        c.write_all(sent).await.unwrap();
        cases.push((
            what,
            tokio::spawn(closed_within(c, within, trickle.to_vec())),
        ));
    }
    // Idle after an answer (401: no token) on a kept-alive connection.
    let mut idle = connect().await.unwrap();
    idle.write_all(b"GET /api/v1/pods HTTP/1.1\r\nHost: kas\r\n\r\n")
        .await
        .unwrap();
    let head = read_head(&mut idle, Duration::from_secs(5)).await;
    assert!(head.starts_with("HTTP/1.1 401"), "{head}");
    let idle = tokio::spawn(closed_within(idle, within, Vec::new()));
    // 200 more half-sent heads, to count descriptors.
    let mut more = Vec::new();
    for _ in 0..200 {
        let mut c = connect().await.unwrap();
        c.write_all(b"GET /").await.unwrap();
        more.push(c);
    }
    // Busy: a request waiting 6 s for an agent that is not connected.
    let busy = tokio::spawn(async move {
        let mut c = TcpStream::connect(addr).await.unwrap();
        let request = format!(
            "GET /api/v1/pods?timeout=6s HTTP/1.1\r\nHost: kas\r\nAuthorization: Bearer pat:1:{token}\r\n\r\n"
        );
        c.write_all(request.as_bytes()).await.unwrap();
        let start = Instant::now();
        let head = read_head(&mut c, Duration::from_secs(10)).await;
        (start.elapsed(), head)
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let fds_open = kas.open_fds();
    for (what, case) in cases {
        let after = case.await.unwrap();
        eprintln!("{what}: closed after {after:?}");
        assert!(
            after.is_some_and(|a| a < Duration::from_secs(5)),
            "{what}: {after:?}"
        );
    }
    let after = idle.await.unwrap().expect("an idle connection is closed");
    eprintln!("idle after an answer: closed after {after:?}");
    assert!(
        after > Duration::from_secs(3) && after < Duration::from_secs(6),
        "{after:?}"
    );
    let (waited, head) = busy.await.unwrap();
    assert!(
        waited >= Duration::from_secs(5) && head.starts_with("HTTP/1.1 50"),
        "the busy connection got its answer after {waited:?}: {head}"
    );
    drop(more);
    let fds_after = eventually(Duration::from_secs(10), "descriptors back", || async {
        let n = kas.open_fds();
        (n <= fds_before + 2).then_some(n)
    })
    .await;
    eprintln!(
        "kas descriptors: {fds_before} before, {fds_open} with 206 slow connections, {fds_after} after"
    );
    assert!(fds_open >= fds_before + 200, "the connections were open");
}

/// Item 5: 2,000 idle sockets from one address do not take the TLS listener's handshakes
/// from other clients: beyond `max_handshakes_per_address` they are closed at once, and
/// the rest after `first_byte_timeout`.
#[tokio::test(flavor = "multi_thread")]
async fn idle_sockets_from_one_address_leave_handshakes_to_others() {
    let s = Secrets::new();
    let pki = Pki::new(s.dir.path(), "one");
    let (cert, key) = pki.issue("kas");
    let lines = tls_lines(&cert, &key);
    let extra = Extra {
        api_listen: &lines,
        ..Extra::default()
    };
    let kas = KasProc::start_extra(&s, "kas", None, 10_000, extra, None).await;
    let mut idle = Vec::new();
    for _ in 0..2000 {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        match socket.connect(kas.api).await {
            Ok(c) => idle.push(c),
            Err(e) => panic!("idle socket {}: {e}", idle.len()),
        }
    }
    let url = format!("grpcs://{}", kas.api);
    for i in 0..20 {
        let call = async {
            let gl = GitLab::at(&s, &url, Some(&pki.ca())).await?;
            gl.connections(1).await.map_err(|e| e.to_string())
        };
        let done = timeout(Duration::from_secs(3), call).await;
        assert!(
            matches!(done, Ok(Ok(_))),
            "TLS client {i} from 127.0.0.1 while 2,000 idle sockets are open: {done:?}"
        );
    }
    let metrics = kas.await_metric("kas_handshake_errors_total").await;
    let refused = kas_server::kas::observability::gauge(
        &metrics,
        "kas_handshake_errors_total{listener=\"api\"}",
    );
    eprintln!("handshake errors counted on the api listener: {refused:?}");
    assert!(refused.is_some_and(|n| n >= 1900.0), "{refused:?}");
}

/// An agent's modules whose API server switches every request to a stream that stays
/// silent, as an `exec` session nobody types into.
fn silent_exec() -> kas_agent::Modules {
    use kas_proto::http::{HttpResponse, ResponseHead, http_response};
    use prost::Message;
    let mut modules = kas_agent::Modules::default();
    modules.streaming(kas_proto::http::KUBERNETES_API_METHOD, |_| {
        let head = HttpResponse {
            kind: Some(http_response::Kind::Head(ResponseHead {
                status: 101,
                headers: [(
                    "upgrade".to_string(),
                    kas_proto::frame::Values {
                        values: vec!["SPDY/3.1".into()],
                    },
                )]
                .into(),
            })),
        };
        let head = futures::stream::once(async move { Ok(head.encode_to_vec().into()) });
        futures::StreamExt::boxed(futures::StreamExt::chain(head, futures::stream::pending()))
    });
    modules
}

/// Sends a `kubectl exec` upgrade as `token` whose routing may wait `wait`, and reads the
/// answer's head.
async fn exec_as(addr: SocketAddr, token: &str, wait: &str) -> (String, TcpStream) {
    let mut c = TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "POST /api/v1/namespaces/default/pods/web-1/exec?command=sh&timeout={wait} HTTP/1.1\r\nHost: kas\r\nAuthorization: Bearer pat:1:{token}\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n\r\n"
    );
    c.write_all(request.as_bytes()).await.unwrap();
    let head = read_head(&mut c, Duration::from_secs(10)).await;
    (head, c)
}

/// Item 3: one user cannot take every tunnel of an agent. A token holds at most
/// `max_requests_per_token_per_agent` requests to one agent on a kas (then 429 naming the
/// key) while another user still gets through, and silent upgraded sessions end after
/// `streaming_idle_timeout`, giving their places and tunnels back.
#[tokio::test(flavor = "multi_thread")]
async fn one_user_cannot_hold_every_tunnel_of_an_agent() {
    let s = Secrets::new();
    let (alice, bob) = ("alice-user-token-0001", "bob-user-token-000001");
    let lines = "    max_requests_per_token_per_agent: 2\n    streaming_idle_timeout: 2s\n";
    let kas = KasProc::with_kubernetes_api(&s, &[alice, bob], "", lines).await;
    let _agent = TestAgent::connect_with(kas.agent, 1, "exec", 8, silent_exec()).await;
    let addr = kas.kubernetes_api.expect("a Kubernetes API listener");
    let exec = |token: &'static str| exec_as(addr, token, "10s");
    let first = eventually(Duration::from_secs(20), "the agent to switch", || async {
        let (head, c) = exec(alice).await;
        head.starts_with("HTTP/1.1 101").then_some(c)
    })
    .await;
    let (head, second) = exec(alice).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    let (head, mut refused) = exec(alice).await;
    assert!(head.starts_with("HTTP/1.1 429"), "{head}");
    let mut body = vec![0u8; 4096];
    let n = refused.read(&mut body).await.unwrap();
    let body = String::from_utf8_lossy(&body[..n]);
    assert!(
        body.contains("agent.kubernetes_api.max_requests_per_token_per_agent"),
        "{body}"
    );
    let (head, other) = exec(bob).await;
    assert!(
        head.starts_with("HTTP/1.1 101"),
        "another user gets through: {head}"
    );
    // Silent sessions end after streaming_idle_timeout (2 s), and their places come back.
    for c in [first, second, other] {
        let closed = closed_within(c, Duration::from_secs(6), Vec::new()).await;
        assert!(
            closed.is_some_and(|d| d < Duration::from_secs(5)),
            "{closed:?}"
        );
    }
    let (head, _again) = exec(alice).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
}

/// Item 3, fair sharing: through either of two kas, one user takes at most three quarters
/// of the tunnels an agent may open (6 of 8; their share is counted where the tunnels are, so the kas
/// in between passes the caller's digest on), and the last free tunnel is kept for a
/// caller that holds none: Alice's seventh session waits and is refused 504, Bob gets one
/// but not a second, Carol the last.
#[tokio::test(flavor = "multi_thread")]
async fn one_user_leaves_a_quarter_of_an_agents_tunnels_to_others_through_every_kas() {
    let redis = Redis::start().expect("redis-server starts (scripts/test installs it)");
    let s = Secrets::new();
    let (alice, bob, carol) = (
        "alice-user-token-0001",
        "bob-user-token-000001",
        "carol-user-token-0001",
    );
    // The share is of what the agent may open here: 8 tunnels per connection.
    let lines = "    max_requests_per_token_per_agent: 100\n  max_tunnels_per_connection: 8\n";
    let users = [alice, bob, carol];
    let mut kas = Vec::new();
    for name in ["kas0", "kas1"] {
        kas.push(KasProc::with_kubernetes_api_on(&s, name, Some(&redis), &users, "", lines).await);
    }
    let _agent = TestAgent::connect_with(kas[0].agent, 1, "exec", 8, silent_exec()).await;
    let [near, far] = [0, 1].map(|k| kas[k].kubernetes_api.expect("a Kubernetes API listener"));
    let mut open = vec![
        eventually(
            Duration::from_secs(20),
            "kas1 to reach the agent",
            || async {
                let (head, c) = exec_as(far, alice, "5s").await;
                head.starts_with("HTTP/1.1 101").then_some(c)
            },
        )
        .await,
    ];
    for i in 1..6 {
        let (head, c) = exec_as([near, far][i % 2], alice, "5s").await;
        assert!(
            head.starts_with("HTTP/1.1 101"),
            "Alice's session {i}: {head}"
        );
        open.push(c);
    }
    for (via, name) in [(near, "kas0"), (far, "kas1")] {
        let (head, _) = exec_as(via, alice, "1s").await;
        assert!(
            head.starts_with("HTTP/1.1 504"),
            "Alice's seventh session through {name} waits for her own to end: {head}"
        );
    }
    let (head, _bob) = exec_as(far, bob, "5s").await;
    assert!(head.starts_with("HTTP/1.1 101"), "Bob's first: {head}");
    let (head, _) = exec_as(near, bob, "1s").await;
    assert!(
        head.starts_with("HTTP/1.1 504"),
        "Bob, holding one, does not take the last free tunnel: {head}"
    );
    let (head, _carol) = exec_as(far, carol, "5s").await;
    assert!(
        head.starts_with("HTTP/1.1 101"),
        "Carol gets the last: {head}"
    );
    drop(open);
}

/// Item 6: another holder of the agent's token proposing a live replica's connection id is
/// refused on each kas where the replica is open, for streams and tunnels alike, whatever
/// metadata it claims; every call pinned to the replica reaches it, and the listing keeps
/// the replica's own metadata. The replica itself may add a stream (a reconnect).
#[tokio::test(flavor = "multi_thread")]
async fn an_agent_token_cannot_shadow_one_of_its_replicas() {
    use kas_agent::AgentClient;
    use kas_core::ConnectionId;
    let redis = Redis::start().expect("redis-server starts (scripts/test installs it)");
    let s = Secrets::new();
    let kas = [
        KasProc::start(&s, "kas0", Some(&redis), 10_000, "").await,
        KasProc::start(&s, "kas1", Some(&redis), 10_000, "").await,
    ];
    let id = ConnectionId(4242);
    let replica = Some((id, &b"the replica's proof"[..]));
    let modules = || pod_modules("real", Duration::ZERO);
    let mut real = Vec::new();
    for k in &kas {
        let a = TestAgent::connect_as(k.agent, 1, "real", 2, modules(), replica).await;
        real.push(a.expect("the replica connects"));
    }
    let gl = GitLab::new(&s, kas[0].api).await;
    let listed = || async { gl.replicas(1).await.ok() };
    eventually(
        Duration::from_secs(10),
        "the replica listed on both",
        || async {
            listed()
                .await
                .filter(|r| *r == [(id.0, "real".to_string(), 2)])
        },
    )
    .await;
    let impostors: [(&[u8], &str); 3] = [
        (b"a guess", "impostor"),
        (b"a guess", "real"),
        (b"", "impostor"),
    ];
    for k in &kas {
        for (proof, pod) in impostors {
            let r = TestAgent::connect_as(k.agent, 1, pod, 2, modules(), Some((id, proof))).await;
            let e = r.err().expect("the impostor's stream is refused");
            assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
            assert!(e.message().contains("connection_id 4242"), "{e}");
        }
        let client = AgentClient::new(channel(k.agent).await, agent_token(1))
            .with_proof(b"a guess".to_vec());
        let tunnel = client
            .serve_tunnel(id, modules().into(), Duration::from_secs(1), None)
            .await;
        assert_eq!(tunnel.code(), tonic::Code::FailedPrecondition, "{tunnel}");
    }
    // A reconnect of the replica itself is taken, and leaves nothing behind when it ends.
    let again = TestAgent::connect_as(kas[0].agent, 1, "real", 1, modules(), replica).await;
    let again = again.expect("the replica's second stream is taken");
    // The drop resets its tunnel; a call kas0 handed it before the reset arrived would
    // fail as a disconnect, which is right, so wait for kas0 to see it come and go.
    use kas_server::kas::observability::gauge;
    let kas0 = &kas[0];
    let tunnels = |n: f64| async move {
        let what = format!("kas0 holds {n} tunnels");
        eventually(Duration::from_secs(5), &what, || async {
            (gauge(&kas0.metrics().await, "kas_tunnels") == Some(n)).then_some(())
        })
        .await
    };
    tunnels(3.0).await;
    drop(again);
    tunnels(2.0).await;
    for k in &kas {
        let gl = GitLab::new(&s, k.api).await;
        for _ in 0..20 {
            let pods = gl.pods(1, Some(id), Duration::from_secs(5)).await;
            assert_eq!(pods.expect("a pinned call"), ["real"]);
        }
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        listed().await.expect("a listing"),
        [(id.0, "real".to_string(), 2)]
    );
}
