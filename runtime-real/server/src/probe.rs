//! `kas --probe`: asks a running kas's observability listener whether it is alive or
//! ready, for container health checks in images that have no shell or HTTP client.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::time::Duration;

/// The most of an answer read: the status line and a short reason are all a probe needs.
const MAX_ANSWER: u64 = 4096;

/// Which endpoint a probe asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Probe {
    /// `/liveness`: the process serves.
    Liveness,
    /// `/readiness`: it takes calls (the store answers, it is not stopping).
    Readiness,
}

impl Probe {
    fn path(self) -> &'static str {
        match self {
            Probe::Liveness => "/liveness",
            Probe::Readiness => "/readiness",
        }
    }
}

/// GETs `probe`'s path from the observability listener at `listen` (an unspecified
/// address is asked on loopback), within `timeout` for each step. `Ok` with the body when
/// it answers 200; otherwise what went wrong, naming the address.
pub fn ask(listen: SocketAddr, probe: Probe, timeout: Duration) -> Result<String, String> {
    let address = match listen.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::new(Ipv4Addr::LOCALHOST.into(), listen.port())
        }
        IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::new(Ipv6Addr::LOCALHOST.into(), listen.port())
        }
        _ => listen,
    };
    let url = format!("http://{address}{}", probe.path());
    let fail = |what: &str, e: std::io::Error| format!("{url}: {what}: {e}");
    let mut stream =
        TcpStream::connect_timeout(&address, timeout).map_err(|e| fail("cannot connect", e))?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| fail("socket", e))?;
    stream
        .set_write_timeout(Some(timeout))
        .map_err(|e| fail("socket", e))?;
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n",
        probe.path()
    );
    stream
        .write_all(request.as_bytes())
        .map_err(|e| fail("cannot send", e))?;
    let mut answer = Vec::new();
    stream
        .take(MAX_ANSWER)
        .read_to_end(&mut answer)
        .map_err(|e| fail("no answer", e))?;
    let answer = String::from_utf8_lossy(&answer);
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let status = head.lines().next().unwrap_or("");
    match status.split(' ').nth(1) {
        Some("200") => Ok(body.trim().to_string()),
        Some(_) => Err(format!("{url}: {status}: {}", body.trim())),
        None => Err(format!("{url}: not an HTTP answer: {status:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn serve_once(answer: &'static str) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf);
            s.write_all(answer.as_bytes()).unwrap();
        });
        address
    }

    #[test]
    fn a_200_is_healthy_and_anything_else_says_why_not() {
        let t = Duration::from_secs(5);
        let ok = serve_once("HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nok\n");
        assert_eq!(ask(ok, Probe::Liveness, t), Ok("ok".to_string()));
        let stopping = serve_once("HTTP/1.1 503 Service Unavailable\r\n\r\nstopping\n");
        let err = ask(stopping, Probe::Readiness, t).unwrap_err();
        assert!(
            err.contains("/readiness") && err.contains("503") && err.contains("stopping"),
            "{err}"
        );
        let garbage = serve_once("SSH-2.0-OpenSSH\r\n");
        assert!(
            ask(garbage, Probe::Liveness, t)
                .unwrap_err()
                .contains("not an HTTP answer")
        );
    }

    #[test]
    fn nothing_listening_names_the_address() {
        let address = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let err = ask(address, Probe::Liveness, Duration::from_secs(5)).unwrap_err();
        assert!(
            err.contains(&address.to_string()) && err.contains("cannot connect"),
            "{err}"
        );
    }
}
