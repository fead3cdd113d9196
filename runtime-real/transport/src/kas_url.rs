//! Where clients find kas: its address with the transport the scheme names.

/// A kas address as its clients take it: `grpcs://host:port` (TLS), `grpc://host:port` or
/// a bare `host:port` (plaintext), `wss://host:port` or `ws://host:port` (gRPC inside a
/// WebSocket, with or without TLS, for proxies that pass only HTTP/1.1).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KasUrl {
    /// TLS or not.
    pub tls: bool,
    /// gRPC inside a WebSocket.
    pub websocket: bool,
    /// `host:port`.
    pub authority: String,
    /// The host, as its certificate must name it.
    pub host: String,
}

impl KasUrl {
    /// Parses `s`, naming what is wrong with it.
    pub fn parse(s: &str) -> Result<KasUrl, String> {
        let (tls, websocket, rest) = match s.split_once("://") {
            None => (false, false, s),
            Some(("grpc", rest)) => (false, false, rest),
            Some(("grpcs", rest)) => (true, false, rest),
            Some(("ws", rest)) => (false, true, rest),
            Some(("wss", rest)) => (true, true, rest),
            Some((scheme, _)) => {
                return Err(format!(
                    "{s}: unknown scheme {scheme}://, expected grpc://, grpcs://, ws:// or wss://"
                ));
            }
        };
        let uri: tonic::transport::Uri = format!("http://{rest}")
            .parse()
            .map_err(|e| format!("{s}: not host:port: {e}"))?;
        let (Some(host), Some(_), "/") = (uri.host(), uri.port_u16(), uri.path()) else {
            return Err(format!("{s}: expected host:port (with a port, no path)"));
        };
        Ok(KasUrl {
            tls,
            websocket,
            authority: rest.to_string(),
            host: host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string(),
        })
    }
}

impl std::fmt::Display for KasUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scheme = match (self.websocket, self.tls) {
            (false, false) => "grpc",
            (false, true) => "grpcs",
            (true, false) => "ws",
            (true, true) => "wss",
        };
        write!(f, "{scheme}://{}", self.authority)
    }
}
