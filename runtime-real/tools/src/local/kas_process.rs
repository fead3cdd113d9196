//! A kas binary run as a child process: started on a config file, its bound addresses read
//! from its "kas started" log line, its memory read from `/proc`.

use kas_server::kas::Addresses;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running kas process; killed when dropped.
pub struct KasProcess {
    child: Option<Child>,
    /// Where it listens.
    pub addresses: Addresses,
    /// Its log file (standard error).
    pub log: PathBuf,
}

impl KasProcess {
    /// Runs `exe --config CONFIG --log FILTER` with its standard error in `log`, and waits
    /// (up to 20 s) for its "kas started" line.
    pub async fn spawn(
        exe: &Path,
        config: &Path,
        filter: &str,
        log: &Path,
    ) -> Result<KasProcess, String> {
        Self::spawn_under(&[], exe, config, filter, log).await
    }

    /// As [`Self::spawn`], run by `launcher` (a command and its arguments, e.g. valgrind's),
    /// which is given up to ten times as long to start it.
    pub async fn spawn_under(
        launcher: &[String],
        exe: &Path,
        config: &Path,
        filter: &str,
        log: &Path,
    ) -> Result<KasProcess, String> {
        let file = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
        let mut command = match launcher.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        let child = command
            .arg("--config")
            .arg(config)
            .args(["--log", filter])
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .map_err(|e| match launcher.first() {
                Some(l) => format!("cannot run {l} (is it installed?): {e}"),
                None => format!("cannot run {}: {e}", exe.display()),
            })?;
        let mut p = KasProcess {
            child: Some(child),
            addresses: Addresses {
                agent: unspecified(),
                api: unspecified(),
                private_api: unspecified(),
                observability: unspecified(),
                kubernetes_api: None,
            },
            log: log.to_path_buf(),
        };
        let within = Duration::from_secs(if launcher.is_empty() { 20 } else { 200 });
        let end = Instant::now() + within;
        loop {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            if let Some(line) = text.lines().find(|l| l.contains("kas started")) {
                let field = |key: &str| -> Result<SocketAddr, String> {
                    line.split_whitespace()
                        .find_map(|w| w.strip_prefix(&format!("{key}=")))
                        .and_then(|v| v.parse().ok())
                        .ok_or_else(|| format!("no {key}= in {line:?}"))
                };
                p.addresses = Addresses {
                    agent: field("agent")?,
                    api: field("api")?,
                    private_api: field("private_api")?,
                    observability: field("observability")?,
                    kubernetes_api: field("kubernetes_api").ok(),
                };
                return Ok(p);
            }
            if let Some(child) = p.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                return Err(format!("kas exited ({status}) at start:\n{text}"));
            }
            if Instant::now() > end {
                return Err(format!("kas did not start within {within:?}:\n{text}"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Its process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Its resident memory (`VmRSS`), in bytes.
    pub fn resident_bytes(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()?)).ok()?;
        let kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))?
            .trim()
            .strip_suffix("kB")?
            .trim()
            .parse()
            .ok()?;
        Some(kb * 1024)
    }

    /// Its metrics (OpenMetrics text), or `None` when it does not answer.
    pub async fn metrics(&self) -> Option<String> {
        http_get(self.addresses.observability, "/metrics")
            .await
            .map(|(_, body)| body)
    }

    /// SIGKILL: no goodbye, nothing deleted.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then waits for the exit status.
    pub fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        let mut c = self.child.take()?;
        let _ = Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status();
        c.wait().ok()
    }
}

impl Drop for KasProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

fn unspecified() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 0))
}

/// A minimal HTTP/1.0 GET: (status, body), or `None` when nothing answers.
pub async fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: kas\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).await.ok()?;
    let code = out.split_whitespace().nth(1)?.parse().ok()?;
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((code, body))
}
