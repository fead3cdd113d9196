//! agentk through a corporate HTTP proxy: `HTTPS_PROXY` (or `https_proxy`) names it,
//! `NO_PROXY` (or `no_proxy`) the hosts reached directly, as curl and Go read them; the
//! connection to kas is an HTTP `CONNECT` tunnel through it, with TLS and WebSocket inside.

use std::io;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The longest proxy answer head read.
const MAX_HEAD: usize = 8 << 10;

/// An HTTP proxy: `host:port`, and its `Proxy-Authorization` when the URL has a user.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Proxy {
    authority: String,
    authorization: Option<String>,
}

impl Proxy {
    /// The proxy for `host` from the environment: none when `HTTPS_PROXY` is unset or
    /// empty, or `NO_PROXY` covers `host`.
    pub fn from_env(host: &str) -> Result<Option<Proxy>, String> {
        let var = |names: [&str; 2]| {
            names
                .iter()
                .find_map(|n| std::env::var(n).ok().filter(|v| !v.is_empty()))
        };
        let Some(url) = var(["HTTPS_PROXY", "https_proxy"]) else {
            return Ok(None);
        };
        if var(["NO_PROXY", "no_proxy"]).is_some_and(|list| bypassed(&list, host)) {
            return Ok(None);
        }
        Proxy::parse(&url).map(Some)
    }

    /// `http://[user:password@]host:port` (the scheme may be left out).
    pub fn parse(url: &str) -> Result<Proxy, String> {
        let rest = match url.split_once("://") {
            None => url,
            Some(("http", rest)) => rest,
            Some((scheme, _)) => {
                return Err(format!(
                    "HTTPS_PROXY {url}: {scheme}:// proxies are not supported, only http://"
                ));
            }
        };
        let rest = rest.trim_end_matches('/');
        let (user, authority) = match rest.rsplit_once('@') {
            Some((user, authority)) => (Some(user), authority),
            None => (None, rest),
        };
        if !authority.contains(':') || authority.contains('/') {
            return Err(format!("HTTPS_PROXY {url}: expected http://host:port"));
        }
        let authorization = user.map(|u| {
            use base64::Engine;
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(u)
            )
        });
        Ok(Proxy {
            authority: authority.to_string(),
            authorization,
        })
    }

    /// A TCP stream to `target` (`host:port`) through the proxy.
    pub async fn connect(&self, target: &str) -> io::Result<TcpStream> {
        let mut s = TcpStream::connect(&self.authority)
            .await
            .map_err(|e| io::Error::new(e.kind(), format!("proxy {}: {e}", self.authority)))?;
        let _ = s.set_nodelay(true);
        let mut head = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n");
        if let Some(a) = &self.authorization {
            head += &format!("Proxy-Authorization: {a}\r\n");
        }
        head += "\r\n";
        s.write_all(head.as_bytes()).await?;
        // Byte by byte up to the blank line: what follows it is kas's.
        let mut answer = Vec::new();
        while !answer.ends_with(b"\r\n\r\n") {
            if answer.len() >= MAX_HEAD {
                return Err(self.refused("an answer head over 8 KiB"));
            }
            let mut b = [0u8; 1];
            if s.read(&mut b).await? == 0 {
                return Err(self.refused("the connection closed"));
            }
            answer.push(b[0]);
        }
        let text = String::from_utf8_lossy(&answer);
        let status = text.lines().next().unwrap_or_default();
        match status.split_whitespace().nth(1) {
            Some(code) if code.starts_with('2') => Ok(s),
            _ => Err(self.refused(&format!("{status:?} to CONNECT {target}"))),
        }
    }

    fn refused(&self, why: &str) -> io::Error {
        io::Error::new(
            io::ErrorKind::ConnectionRefused,
            format!("proxy {} (HTTPS_PROXY): {why}", self.authority),
        )
    }
}

/// Whether `NO_PROXY`'s `list` covers `host`: `*`, the host itself, or a domain it is in
/// (`example.com` and `.example.com` both cover `kas.example.com`); ports are ignored.
fn bypassed(list: &str, host: &str) -> bool {
    let host = host.to_ascii_lowercase();
    list.split(',').map(str::trim).any(|entry| {
        let entry = entry.to_ascii_lowercase();
        let name = match entry.rsplit_once(':') {
            Some((name, port)) if port.chars().all(|c| c.is_ascii_digit()) => name,
            _ => entry.as_str(),
        };
        let domain = name.trim_start_matches('.');
        name == "*"
            || (!domain.is_empty() && (host == domain || host.ends_with(&format!(".{domain}"))))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_proxy_lists_cover_hosts_domains_and_everything() {
        assert!(bypassed("localhost, .example.com", "kas.example.com"));
        assert!(bypassed("example.com", "kas.example.com"));
        assert!(bypassed("example.com", "EXAMPLE.com"));
        assert!(bypassed("10.0.0.1:8150", "10.0.0.1"));
        assert!(bypassed("*", "anything"));
        assert!(!bypassed("example.com", "badexample.com"));
        assert!(!bypassed("", "kas"));
    }

    #[test]
    fn proxy_urls_are_parsed_and_refused_by_name() {
        let p = Proxy::parse("http://user:secret@proxy.corp:3128/").unwrap();
        assert_eq!(p.authority, "proxy.corp:3128");
        assert_eq!(p.authorization.as_deref(), Some("Basic dXNlcjpzZWNyZXQ="));
        assert_eq!(Proxy::parse("proxy:8080").unwrap().authority, "proxy:8080");
        let err = Proxy::parse("socks5://proxy:1080").unwrap_err();
        assert!(err.contains("only http://"), "{err}");
        assert!(Proxy::parse("http://proxy").is_err());
    }
}
