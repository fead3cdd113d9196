//! kas against a redis-server started by the test with TLS only (`tls-port`, a throwaway
//! CA) and ACLs (the `default` user off, a `kas` user with a password): kas registers,
//! routes and cleans up; a wrong password or no TLS is named in kas's log and kas reports
//! not ready.

mod support;

use kas_tools::local::kas_process::http_get;
use kas_tools::local::redis_server::free_port;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use support::*;

/// A TLS-only redis-server with user `kas` (password `PASSWORD`); killed on drop.
struct TlsRedis {
    child: Child,
    port: u16,
    ca: String,
}

const PASSWORD: &str = "kas-redis-password";

impl TlsRedis {
    fn start(dir: &Path, pki: &Pki) -> TlsRedis {
        let (cert, key) = pki.issue("redis");
        let port = free_port().expect("a free port");
        let ca = pki.ca().display().to_string();
        let child = Command::new("redis-server")
            .args(["--port", "0", "--bind", "127.0.0.1"])
            .args(["--tls-port", &port.to_string()])
            .args(["--tls-cert-file", &cert.display().to_string()])
            .args(["--tls-key-file", &key.display().to_string()])
            .args(["--tls-ca-cert-file", &ca, "--tls-auth-clients", "no"])
            .args(["--save", "", "--appendonly", "no"])
            .args(["--user", "default", "off"])
            .args([
                "--user",
                "kas",
                "on",
                &format!(">{PASSWORD}"),
                "~*",
                "&*",
                "+@all",
            ])
            .stdout(std::fs::File::create(dir.join("redis.log")).unwrap())
            .spawn()
            .expect("redis-server runs (scripts/test installs it)");
        let r = TlsRedis { child, port, ca };
        let end = std::time::Instant::now() + Duration::from_secs(10);
        while r.cli(&["PING"]).trim() != "PONG" {
            assert!(
                std::time::Instant::now() < end,
                "redis-server with TLS did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        r
    }

    fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["--tls", "--cacert", &self.ca, "-p", &self.port.to_string()])
            .args(["--user", "kas", "--pass", PASSWORD, "--no-auth-warning"])
            .args(args)
            .stderr(Stdio::null())
            .output()
            .expect("redis-cli runs");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.cli(&["--scan"]).lines().map(str::to_string).collect();
        keys.sort();
        keys
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A kas on `redis` with `redis_lines` under `redis:`.
async fn kas_on(s: &Secrets, name: &str, redis: &TlsRedis, redis_lines: &str) -> KasProc {
    let address = format!("127.0.0.1:{}", redis.port);
    let extra = Extra {
        redis: redis_lines,
        redis_at: Some(&address),
        ..Extra::default()
    };
    KasProc::start_extra(s, name, None, 10_000, extra, None).await
}

#[tokio::test(flavor = "multi_thread")]
async fn kas_registers_routes_and_cleans_up_on_a_tls_redis_with_an_acl_user() {
    let s = Secrets::new();
    let pki = Pki::new(s.dir.path(), "redis");
    let redis = TlsRedis::start(s.dir.path(), &pki);
    std::fs::write(s.path("redis.password"), format!("{PASSWORD}\n")).unwrap();
    let lines = format!(
        "  username: kas\n  password_file: {}\n  tls:\n    enabled: true\n    ca_certificate_file: {}\n",
        s.path("redis.password").display(),
        pki.ca().display()
    );
    let mut holder = kas_on(&s, "kas0", &redis, &lines).await;
    let router = kas_on(&s, "kas1", &redis, &lines).await;
    let _agent = TestAgent::connect(holder.agent, 1, "agent1-pod", 1).await;
    // kas1 finds the agent through the records kas0 wrote over TLS.
    let gl = GitLab::new(&s, router.api).await;
    let pods = gl.pods(1, None, Duration::from_secs(10)).await;
    assert_eq!(pods.expect("routed"), ["agent1-pod"]);
    let keys = redis.keys();
    assert!(keys.iter().any(|k| k.contains("agent")), "{keys:?}");
    assert!(holder.terminate().success());
    eventually(
        Duration::from_secs(10),
        "kas0's records deleted",
        || async {
            let left: Vec<String> = redis
                .keys()
                .into_iter()
                .filter(|k| k.contains("agent"))
                .collect();
            left.is_empty().then_some(())
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_password_or_plaintext_is_named_and_kas_is_not_ready() {
    let s = Secrets::new();
    let pki = Pki::new(s.dir.path(), "redis");
    let redis = TlsRedis::start(s.dir.path(), &pki);
    std::fs::write(s.path("wrong.password"), "not-the-password\n").unwrap();
    let ca = pki.ca().display().to_string();
    let wrong = format!(
        "  username: kas\n  password_file: {}\n  tls:\n    enabled: true\n    ca_certificate_file: {ca}\n",
        s.path("wrong.password").display(),
    );
    let plaintext = "  username: kas\n";
    for (name, lines, says) in [
        (
            "wrongpass",
            wrong.as_str(),
            "authentication failed (redis.username, redis.password_file)",
        ),
        ("plaintext", plaintext, "keys: connect: "),
    ] {
        let kas = kas_on(&s, name, &redis, lines).await;
        eventually(Duration::from_secs(10), "kas not ready", || async {
            let (code, body) = http_get(kas.observability, "/readiness").await?;
            (code == 503 && body.contains("registry store unreachable")).then_some(())
        })
        .await;
        eventually(Duration::from_secs(10), says, || async {
            kas.log_text().contains(says).then_some(())
        })
        .await;
    }
}
