//! gRPC through WebSocket against kas processes on loopback: agentk dials `wss://` to an
//! agent listener with `websocket: true` (which still takes plain gRPC on the same port),
//! and through nginx (Debian's, started by the test) as an HTTP/1.1-only TLS-terminating
//! reverse proxy with WebSocket upgrade, surviving an nginx reload; and through tinyproxy
//! as the HTTP proxy HTTPS_PROXY names.

mod support;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use support::*;

const PODS: &str = "- {namespace: default, name: web-1, phase: Running, node_name: node-a}\n";

/// A kas whose agent listener serves TLS and takes WebSocket upgrades (and whose api
/// listener serves TLS too when `api_tls`), and the CA that issued its certificate.
async fn websocket_kas(s: &Secrets, api_tls: bool) -> (KasProc, Pki) {
    let pki = Pki::new(s.dir.path(), "one");
    let (cert, key) = pki.issue("kas");
    let lines = tls_lines(&cert, &key);
    let agent_lines = format!("{lines}    websocket: true\n");
    let extra = Extra {
        agent_listen: &agent_lines,
        api_listen: if api_tls { &lines } else { "" },
        ..Extra::default()
    };
    (
        KasProc::start_extra(s, "kas", None, 10_000, extra, None).await,
        pki,
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn agentk_over_wss_and_over_grpcs_share_one_agent_listener() {
    let s = Secrets::new();
    let (kas, pki) = websocket_kas(&s, true).await;
    let ca = pki.ca().display().to_string();
    let _ws = AgentkProc::start(
        &s,
        &format!("wss://{}", kas.agent),
        &agent_token(1),
        "agent1-ws",
        PODS,
        &["--ca-cert-file", &ca],
    );
    let _grpc = AgentkProc::start(
        &s,
        &format!("grpcs://{}", kas.agent),
        &agent_token(1),
        "agent1-grpc",
        PODS,
        &["--ca-cert-file", &ca],
    );
    let gl = GitLab::at(&s, &format!("grpcs://{}", kas.api), Some(&pki.ca()))
        .await
        .expect("connects");
    let listed = eventually(Duration::from_secs(10), "both replicas listed", || async {
        gl.connections(1).await.ok().filter(|c| c.len() == 2)
    })
    .await;
    // Each replica, pinned by its connection, answers through its own transport.
    for (connection, pod) in &listed {
        let pods = gl
            .pods(
                1,
                Some(kas_core::ConnectionId(*connection)),
                Duration::from_secs(5),
            )
            .await;
        assert_eq!(pods.expect(pod), ["web-1"], "{pod}");
    }
    let mut pods: Vec<&str> = listed.iter().map(|(_, p)| p.as_str()).collect();
    pods.sort();
    assert_eq!(pods, ["agent1-grpc", "agent1-ws"]);
}

/// nginx with its own prefix directory, configuration and pid file; stopped on drop.
struct Nginx {
    child: Child,
    dir: std::path::PathBuf,
    port: u16,
}

impl Nginx {
    /// An HTTP/1.1-only TLS listener (`cert`, `key`) passing WebSocket upgrades to
    /// `backend`; long-lived connections are cut 1 s into a reload.
    fn start(dir: &Path, cert: &Path, key: &Path, backend: std::net::SocketAddr) -> Nginx {
        ensure_package("nginx", "nginx");
        let dir = dir.join("nginx");
        std::fs::create_dir_all(dir.join("tmp")).unwrap();
        let port = kas_tools::local::redis_server::free_port().unwrap();
        let d = dir.display();
        let conf = format!(
            "user root root;\nworker_processes 1;\nworker_shutdown_timeout 1s;\nerror_log {d}/error.log info;\npid {d}/nginx.pid;\nevents {{ worker_connections 256; }}\nhttp {{\n  access_log off;\n  client_body_temp_path {d}/tmp;\n  proxy_temp_path {d}/tmp;\n  fastcgi_temp_path {d}/tmp;\n  uwsgi_temp_path {d}/tmp;\n  scgi_temp_path {d}/tmp;\n  map $http_upgrade $connection_upgrade {{ default upgrade; '' close; }}\n  server {{\n    listen 127.0.0.1:{port} ssl;\n    ssl_certificate {};\n    ssl_certificate_key {};\n    location / {{\n      proxy_pass http://{backend};\n      proxy_http_version 1.1;\n      proxy_set_header Upgrade $http_upgrade;\n      proxy_set_header Connection $connection_upgrade;\n      proxy_read_timeout 1h;\n      proxy_send_timeout 1h;\n    }}\n  }}\n}}\n",
            cert.display(),
            key.display()
        );
        std::fs::write(dir.join("nginx.conf"), conf).unwrap();
        let child = Command::new("nginx")
            .args(["-p", &d.to_string(), "-c", &format!("{d}/nginx.conf")])
            .args(["-g", "daemon off;"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nginx runs");
        let n = Nginx { child, dir, port };
        let end = std::time::Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                std::time::Instant::now() < end,
                "nginx did not listen:\n{}",
                n.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        n
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("error.log")).unwrap_or_default()
    }

    fn reload(&self) {
        let d = self.dir.display().to_string();
        let ok = Command::new("nginx")
            .args(["-p", &d, "-c", &format!("{d}/nginx.conf"), "-s", "reload"])
            .status()
            .expect("nginx -s reload runs");
        assert!(ok.success(), "nginx -s reload failed:\n{}", self.log());
    }
}

impl Drop for Nginx {
    /// SIGTERM: the master stops its workers too (SIGKILL would orphan them).
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn agentk_reaches_kas_through_nginx_over_wss_and_survives_a_reload() {
    let s = Secrets::new();
    let pki = Pki::new(s.dir.path(), "edge");
    let (cert, key) = pki.issue("nginx");
    // kas behind the proxy: plaintext, WebSocket on.
    let extra = Extra {
        agent_listen: "    websocket: true\n",
        ..Extra::default()
    };
    let kas = KasProc::start_extra(&s, "kas", None, 10_000, extra, None).await;
    let nginx = Nginx::start(s.dir.path(), &cert, &key, kas.agent);
    let ca = pki.ca().display().to_string();
    let agentk = AgentkProc::start(
        &s,
        &format!("wss://127.0.0.1:{}", nginx.port),
        &agent_token(1),
        "agent1-pod",
        PODS,
        &["--ca-cert-file", &ca, "--max-reconnect-delay", "2s"],
    );
    let gl = GitLab::new(&s, kas.api).await;
    let pods = gl.pods(1, None, Duration::from_secs(10)).await;
    assert_eq!(
        pods.map_err(|e| e.to_string()),
        Ok(vec!["web-1".to_string()]),
        "agentk:\n{}\nnginx:\n{}",
        agentk.log_text(),
        nginx.log()
    );
    nginx.reload();
    // The old worker cuts the WebSocket after 1 s; agentk reconnects within its backoff
    // (at most 2 s here), and calls wait for it within their deadline.
    eventually(Duration::from_secs(10), "agentk reconnected", || {
        let n = agentk.count("connected kas=");
        async move { (n >= 2).then_some(()) }
    })
    .await;
    let pods = gl.pods(1, None, Duration::from_secs(10)).await;
    assert_eq!(pods.expect("routed after the reload"), ["web-1"]);
}

/// tinyproxy (Debian's) as a corporate HTTP proxy, its log in its directory; stopped on
/// drop.
struct Tinyproxy {
    child: Child,
    dir: std::path::PathBuf,
    port: u16,
}

impl Tinyproxy {
    fn start(dir: &Path) -> Tinyproxy {
        ensure_package("tinyproxy", "tinyproxy");
        let dir = dir.join("tinyproxy");
        std::fs::create_dir_all(&dir).unwrap();
        let port = kas_tools::local::redis_server::free_port().unwrap();
        let d = dir.display();
        let conf = format!(
            "User root\nGroup root\nPort {port}\nListen 127.0.0.1\nTimeout 600\nLogFile \"{d}/tinyproxy.log\"\nLogLevel Connect\nPidFile \"{d}/tinyproxy.pid\"\nMaxClients 100\nAllow 127.0.0.1\n"
        );
        std::fs::write(dir.join("tinyproxy.conf"), conf).unwrap();
        let child = Command::new("tinyproxy")
            .args(["-d", "-c", &format!("{d}/tinyproxy.conf")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("tinyproxy runs");
        let p = Tinyproxy { child, dir, port };
        let end = std::time::Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(std::time::Instant::now() < end, "tinyproxy did not listen");
            std::thread::sleep(Duration::from_millis(50));
        }
        p
    }

    /// CONNECT requests it logged for `target`.
    fn connects(&self, target: &str) -> usize {
        std::fs::read_to_string(self.dir.join("tinyproxy.log"))
            .unwrap_or_default()
            .matches(&format!("CONNECT {target} "))
            .count()
    }
}

impl Drop for Tinyproxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// agentk honours HTTPS_PROXY (an HTTP CONNECT tunnel, with gRPC over TLS or a WebSocket
/// inside) and NO_PROXY.
#[tokio::test(flavor = "multi_thread")]
async fn agentk_reaches_kas_through_an_http_proxy_unless_no_proxy_says_otherwise() {
    let s = Secrets::new();
    let (kas, pki) = websocket_kas(&s, false).await;
    let proxy = Tinyproxy::start(s.dir.path());
    let ca = pki.ca().display().to_string();
    let proxy_url = format!("http://127.0.0.1:{}", proxy.port);
    let agentk = |pod: &str, scheme: &str, no_proxy: &str| {
        AgentkProc::start_env(
            &s,
            &format!("{scheme}://{}", kas.agent),
            &agent_token(1),
            pod,
            PODS,
            &["--ca-cert-file", &ca],
            &[("HTTPS_PROXY", proxy_url.as_str()), ("NO_PROXY", no_proxy)],
        )
    };
    let _grpcs = agentk("agent1-grpcs", "grpcs", "example.com");
    let _wss = agentk("agent1-wss", "wss", "");
    let _direct = agentk("agent1-direct", "grpcs", "localhost,127.0.0.1");
    let gl = GitLab::new(&s, kas.api).await;
    let listed = eventually(Duration::from_secs(10), "three replicas listed", || async {
        gl.connections(1).await.ok().filter(|c| c.len() == 3)
    })
    .await;
    for (connection, pod) in &listed {
        let pinned = Some(kas_core::ConnectionId(*connection));
        let pods = gl.pods(1, pinned, Duration::from_secs(5)).await;
        assert_eq!(pods.expect(pod), ["web-1"], "{pod}");
    }
    // Two went through the proxy (each its own CONNECT); NO_PROXY kept the third direct.
    let target = kas.agent.to_string();
    eventually(Duration::from_secs(5), "two CONNECTs logged", || {
        let n = proxy.connects(&target);
        async move { (n == 2).then_some(()) }
    })
    .await;
}
