//! A private `redis-server` child process on a free loopback port, keeping nothing on disk.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A free TCP port on 127.0.0.1 (bound, then released).
pub fn free_port() -> std::io::Result<u16> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
}

/// Runs `redis-cli` against the server on 127.0.0.1:`port` and returns its standard output
/// (empty when it cannot run).
pub fn cli(port: u16, args: &[&str]) -> String {
    Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).into_owned())
        .unwrap_or_default()
}

/// True when `redis-server` can be run.
pub fn installed() -> bool {
    Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A running (or stopped) `redis-server` of ours. Killed on drop.
pub struct RedisServer {
    child: Option<Child>,
    /// Its port on 127.0.0.1.
    pub port: u16,
    /// Arguments besides the port and persistence's, `PORT` standing for the port.
    args: Vec<String>,
}

impl RedisServer {
    /// Starts one on a free port; a port taken between the check and the bind is replaced
    /// by another, up to five times. It runs in its own process group, so a Ctrl-C in the
    /// terminal does not stop it before the kas that use it have deleted their records.
    pub fn start() -> Result<RedisServer, String> {
        Self::start_with(&[])
    }

    /// Starts one with more arguments (`PORT` in them stands for its port), as
    /// [`RedisServer::start`] does. With `--cluster-enabled`, its port is one whose
    /// cluster bus port (10,000 above it) exists.
    pub fn start_with(args: &[&str]) -> Result<RedisServer, String> {
        let bus = args.contains(&"--cluster-enabled");
        let mut last = String::new();
        for _ in 0..5 {
            let port = free_port().map_err(|e| format!("no free loopback port: {e}"))?;
            if bus && port > u16::MAX - 10_000 {
                last = format!("port {port} has no cluster bus port");
                continue;
            }
            let mut r = RedisServer {
                child: None,
                port,
                args: args.iter().map(|a| a.to_string()).collect(),
            };
            match r.launch() {
                Ok(()) => return Ok(r),
                Err(e) => last = e,
            }
        }
        Err(format!(
            "redis-server did not start on five free ports: {last}"
        ))
    }

    /// Starts the (stopped) server again, empty, on its port.
    pub fn launch(&mut self) -> Result<(), String> {
        let mut child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .args(
                self.args
                    .iter()
                    .map(|a| a.replace("PORT", &self.port.to_string())),
            )
            .stdout(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|e| format!("cannot run redis-server (is it installed?): {e}"))?;
        let end = Instant::now() + Duration::from_secs(10);
        while self.cli(&["PING"]).trim() != "PONG" {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!(
                    "redis-server on port {} exited: {status}",
                    self.port
                ));
            }
            if Instant::now() > end {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "redis-server on port {} did not answer PING",
                    self.port
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.child = Some(child);
        Ok(())
    }

    /// Kills the server (SIGKILL) and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// `127.0.0.1:PORT`.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Runs `redis-cli` against this server and returns its standard output (empty when
    /// it cannot run).
    pub fn cli(&self, args: &[&str]) -> String {
        cli(self.port, args)
    }

    /// Every key, sorted.
    pub fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self
            .cli(&["--scan"])
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect();
        keys.sort();
        keys
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}
