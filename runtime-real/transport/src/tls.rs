//! TLS for kas's listeners and for the clients of kas (rustls with ring; TLS 1.2 and 1.3
//! only). A listener's certificate and key are re-read when their files change, since
//! cert-manager rewrites a mounted Secret in place: new connections get the new pair, open
//! ones (agents' tunnels) are left alone.

pub use crate::kas_url::KasUrl;
use crate::proxy::Proxy;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{ServerConfig, version};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

/// How often a listener's certificate files are checked for a change.
pub const CERT_POLL: Duration = Duration::from_secs(5);

/// ALPN for gRPC listeners (HTTP/2 only).
pub const ALPN_GRPC: &[&[u8]] = &[b"h2"];
/// ALPN for an agent listener that also takes WebSocket upgrades.
pub const ALPN_GRPC_OR_HTTP1: &[&[u8]] = &[b"h2", b"http/1.1"];
/// ALPN for the observability listener (HTTP/1.1 only).
pub const ALPN_HTTP1: &[&[u8]] = &[b"http/1.1"];

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The certificates in PEM file `path`, or why there are none.
pub fn read_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    certificates(&pem, path)
}

fn certificates(pem: &[u8], path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: not a PEM certificate: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no PEM certificate in it", path.display()));
    }
    Ok(certs)
}

/// A listener's certificate and key, served from memory and re-read from their files by
/// [`watch`].
#[derive(Debug)]
pub struct ServerCert {
    cert_file: PathBuf,
    key_file: PathBuf,
    current: RwLock<Arc<CertifiedKey>>,
    /// The files' bytes as last read, to tell a change.
    read: Mutex<(Vec<u8>, Vec<u8>)>,
}

impl ServerCert {
    /// Reads `cert_file` (PEM chain, leaf first) and `key_file` (PEM private key).
    pub fn load(cert_file: &Path, key_file: &Path) -> Result<Arc<ServerCert>, String> {
        let (cert, key) = read_pair(cert_file, key_file)?;
        let current = certified_key(&cert, &key, cert_file, key_file)?;
        Ok(Arc::new(ServerCert {
            cert_file: cert_file.to_path_buf(),
            key_file: key_file.to_path_buf(),
            current: RwLock::new(Arc::new(current)),
            read: Mutex::new((cert, key)),
        }))
    }

    /// Re-reads the files: `Ok(true)` when a changed pair is now served. A pair that does
    /// not load (a half-written file, a key that does not match) leaves the old one served.
    pub fn reload(&self) -> Result<bool, String> {
        let (cert, key) = read_pair(&self.cert_file, &self.key_file)?;
        let mut read = self.read.lock().unwrap_or_else(|p| p.into_inner());
        if read.0 == cert && read.1 == key {
            return Ok(false);
        }
        let fresh = certified_key(&cert, &key, &self.cert_file, &self.key_file)?;
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(fresh);
        *read = (cert, key);
        Ok(true)
    }
}

impl ResolvesServerCert for ServerCert {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        )
    }
}

fn read_pair(cert_file: &Path, key_file: &Path) -> Result<(Vec<u8>, Vec<u8>), String> {
    let read = |p: &Path| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()));
    Ok((read(cert_file)?, read(key_file)?))
}

fn certified_key(
    cert: &[u8],
    key: &[u8],
    cert_file: &Path,
    key_file: &Path,
) -> Result<CertifiedKey, String> {
    let chain = certificates(cert, cert_file)?;
    let key = PrivateKeyDer::from_pem_slice(key)
        .map_err(|e| format!("{}: not a PEM private key: {e}", key_file.display()))?;
    CertifiedKey::from_der(chain, key, &provider())
        .map_err(|e| format!("{} and {}: {e}", cert_file.display(), key_file.display()))
}

/// Re-reads `cert`'s files every [`CERT_POLL`] until the listener drops it; `what` names
/// the listener in logs.
pub async fn watch(cert: Weak<ServerCert>, what: &'static str) {
    loop {
        tokio::time::sleep(CERT_POLL).await;
        let Some(cert) = cert.upgrade() else { return };
        match cert.reload() {
            Ok(true) => tracing::info!(listener = what, "certificate reloaded"),
            Ok(false) => {}
            Err(e) => tracing::error!(
                listener = what,
                error = %e,
                "cannot reload the certificate; the previous one is still served"
            ),
        }
    }
}

/// A server configuration serving `cert`, TLS 1.2 and 1.3, ALPN `alpn`.
pub fn server_config(cert: Arc<ServerCert>, alpn: &[&[u8]]) -> Result<ServerConfig, String> {
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&version::TLS13, &version::TLS12])
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_cert_resolver(cert);
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// A channel to kas at `url`, connected within `timeout`: through `proxy` (an HTTP
/// `CONNECT` tunnel) when given, over TLS for `grpcs://` and `wss://` (verified against
/// `ca_file`, or the system's roots), inside a WebSocket for `ws://` and `wss://`. Errors
/// are in the operator's terms ([`explain_connect_error`]).
pub async fn connect(
    url: &KasUrl,
    ca_file: Option<&Path>,
    proxy: Option<&Proxy>,
    timeout: Duration,
) -> Result<tonic::transport::Channel, String> {
    connect_via(url, ca_file, proxy, None, timeout).await
}

/// [`connect`] from `source`, an address of this host: kas-bench spreads its many agents
/// over loopback addresses, each with its own range of ephemeral ports.
#[cfg(not(madsim))]
pub async fn connect_from(
    url: &KasUrl,
    ca_file: Option<&Path>,
    source: std::net::IpAddr,
    timeout: Duration,
) -> Result<tonic::transport::Channel, String> {
    connect_via(url, ca_file, None, Some(source), timeout).await
}

/// A channel to kas at `url`, through `proxy` and from `source` when given.
async fn connect_via(
    url: &KasUrl,
    ca_file: Option<&Path>,
    proxy: Option<&Proxy>,
    source: Option<std::net::IpAddr>,
    timeout: Duration,
) -> Result<tonic::transport::Channel, String> {
    let endpoint = plain_endpoint(url)?;
    let connected = if !url.tls && !url.websocket && proxy.is_none() {
        let endpoint = endpoint.connect_timeout(timeout);
        #[cfg(not(madsim))]
        let endpoint = endpoint.local_address(source);
        endpoint.connect().await
    } else {
        let dialer = Dialer::new(url, ca_file, proxy, timeout)?;
        dialer.from(source).connect(endpoint).await
    };
    connected.map_err(|e| explain_connect_error(url, &e))
}

/// A channel to kas at `url` (`grpc://` or `grpcs://`) that connects on first use, each
/// attempt within `timeout`; over TLS verified against `ca_file` or the system's roots.
pub fn connect_lazy(
    url: &KasUrl,
    ca_file: Option<&Path>,
    timeout: Duration,
) -> Result<tonic::transport::Channel, String> {
    let endpoint = plain_endpoint(url)?;
    if !url.tls && !url.websocket {
        return Ok(endpoint.connect_timeout(timeout).connect_lazy());
    }
    Ok(Dialer::new(url, ca_file, None, timeout)?.connect_lazy(endpoint))
}

/// `http://host:port`: HTTP/2 in the clear over whatever [`Dialer`] gives.
fn plain_endpoint(url: &KasUrl) -> Result<tonic::transport::Endpoint, String> {
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{}", url.authority))
        .map_err(|e| format!("{url}: {e}"))?;
    #[cfg(not(madsim))] // madsim's channels have no frames
    let endpoint = endpoint
        .max_frame_size(crate::MAX_FRAME_SIZE)
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true);
    Ok(endpoint)
}

/// A client pings kas after this long without hearing from it, idle or not, and drops the
/// connection if the ping is not answered within [`KEEPALIVE_TIMEOUT`]: kas's own pings
/// find a link that drops what the client sends, these one that drops what kas sends
/// (which kas, still hearing the client, cannot tell from a live one).
#[cfg(not(madsim))]
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);

/// See [`KEEPALIVE_INTERVAL`].
#[cfg(not(madsim))]
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

/// How a client reaches kas when plain TCP is not enough: TCP (through the proxy's tunnel,
/// if any), TLS (ALPN `h2`, or `http/1.1` under a WebSocket), then the WebSocket upgrade.
#[cfg(not(madsim))]
#[derive(Clone)]
struct Dialer {
    url: KasUrl,
    tls: Option<Arc<rustls::ClientConfig>>,
    proxy: Option<Proxy>,
    /// The local address to connect from (without a proxy); the system's choice if none.
    source: Option<std::net::IpAddr>,
    timeout: Duration,
}

#[cfg(not(madsim))]
impl Dialer {
    fn new(
        url: &KasUrl,
        ca_file: Option<&Path>,
        proxy: Option<&Proxy>,
        timeout: Duration,
    ) -> Result<Dialer, String> {
        let alpn = if url.websocket { ALPN_HTTP1 } else { ALPN_GRPC };
        Ok(Dialer {
            url: url.clone(),
            tls: url.tls.then(|| client_config(ca_file, alpn)).transpose()?,
            proxy: proxy.cloned(),
            source: None,
            timeout,
        })
    }

    /// Connects from `source` when given.
    fn from(self, source: Option<std::net::IpAddr>) -> Dialer {
        Dialer { source, ..self }
    }

    /// A TCP connection to kas, from [`Dialer::source`] when set.
    async fn tcp(&self) -> std::io::Result<tokio::net::TcpStream> {
        let Some(source) = self.source else {
            return tokio::net::TcpStream::connect(&self.url.authority).await;
        };
        let mut last = None;
        for to in tokio::net::lookup_host(&self.url.authority).await? {
            let socket = match to {
                std::net::SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
                std::net::SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
            };
            socket.bind(std::net::SocketAddr::new(source, 0))?;
            match socket.connect(to).await {
                Ok(tcp) => return Ok(tcp),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, "no address to connect to")
        }))
    }

    async fn dial(&self) -> std::io::Result<Box<dyn crate::ws::Io>> {
        let url = &self.url;
        let tcp = match &self.proxy {
            Some(p) => p.connect(&url.authority).await?,
            None => {
                let tcp = self.tcp().await?;
                let _ = tcp.set_nodelay(true);
                tcp
            }
        };
        let stream: Box<dyn crate::ws::Io> = match &self.tls {
            None => Box::new(tcp),
            Some(config) => {
                let name = rustls::pki_types::ServerName::try_from(url.host.clone())
                    .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
                let connector = tokio_rustls::TlsConnector::from(config.clone());
                Box::new(connector.connect(name, tcp).await?)
            }
        };
        if !url.websocket {
            return Ok(stream);
        }
        Ok(Box::new(crate::ws::upgrade(url, stream).await?))
    }

    /// The connector tonic calls for each connection attempt.
    fn connector(
        self,
    ) -> impl tower::Service<
        tonic::transport::Uri,
        Response = hyper_util::rt::TokioIo<Box<dyn crate::ws::Io>>,
        Error = std::io::Error,
        Future = impl Send,
    > + Clone
    + Send {
        tower::service_fn(move |_: tonic::transport::Uri| {
            let dialer = self.clone();
            async move {
                tokio::time::timeout(dialer.timeout, dialer.dial())
                    .await
                    .map_err(|_| {
                        std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out")
                    })?
                    .map(hyper_util::rt::TokioIo::new)
            }
        })
    }

    async fn connect(
        self,
        endpoint: tonic::transport::Endpoint,
    ) -> Result<tonic::transport::Channel, tonic::transport::Error> {
        endpoint.connect_with_connector(self.connector()).await
    }

    fn connect_lazy(self, endpoint: tonic::transport::Endpoint) -> tonic::transport::Channel {
        endpoint.connect_with_connector_lazy(self.connector())
    }
}

/// In the simulation every connection is plain TCP: TLS, WebSockets and proxies are
/// refused at configuration, and here (no dialer can be made).
#[cfg(madsim)]
enum Dialer {}

#[cfg(madsim)]
impl Dialer {
    fn new(
        url: &KasUrl,
        _: Option<&Path>,
        _: Option<&Proxy>,
        _: Duration,
    ) -> Result<Dialer, String> {
        Err(format!(
            "{url}: TLS, WebSockets and proxies are not simulated"
        ))
    }

    async fn connect(
        self,
        _: tonic::transport::Endpoint,
    ) -> Result<tonic::transport::Channel, tonic::transport::Error> {
        match self {}
    }

    fn connect_lazy(self, _: tonic::transport::Endpoint) -> tonic::transport::Channel {
        match self {}
    }

    fn from(self, _: Option<std::net::IpAddr>) -> Dialer {
        match self {}
    }
}

/// A client configuration trusting the PEM CA certificates in `ca_file` (the system's
/// roots without one), offering ALPN `alpn`.
#[cfg(not(madsim))]
pub fn client_config(
    ca_file: Option<&Path>,
    alpn: &[&[u8]],
) -> Result<Arc<rustls::ClientConfig>, String> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(f) => {
            for cert in read_certificates(f)? {
                roots
                    .add(cert)
                    .map_err(|e| format!("{}: {e}", f.display()))?;
            }
        }
        None => {
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(cert);
            }
        }
    }
    let mut config = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&version::TLS13, &version::TLS12])
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// A failed connection to kas at `url` in the operator's terms: a certificate that does
/// not verify is named as such, with rustls's reason.
pub fn explain_connect_error(url: &KasUrl, e: &dyn std::error::Error) -> String {
    let chain = crate::errors::chain(e);
    match chain.split_once("invalid peer certificate: ") {
        Some((_, reason)) => format!(
            "the certificate of kas at {} does not verify: {reason} (a private CA is trusted with --ca-cert-file)",
            url.authority
        ),
        None if url.tls && chain.contains("InvalidContentType") => format!(
            "kas at {} did not answer with TLS: {chain} (for a plaintext listener use grpc://)",
            url.authority
        ),
        None => format!("cannot reach kas at {}: {chain}", url.authority),
    }
}

#[cfg(all(test, not(madsim)))]
mod tests {
    use super::*;
    use crate::local_ca::LocalCa;

    fn pair(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let (cert, key) = LocalCa::new(name).unwrap().issue().unwrap();
        let (c, k) = (
            dir.join(format!("{name}.crt")),
            dir.join(format!("{name}.key")),
        );
        std::fs::write(&c, cert).unwrap();
        std::fs::write(&k, key).unwrap();
        (c, k)
    }

    fn served(cert: &ServerCert) -> Vec<u8> {
        cert.current.read().unwrap().cert[0].to_vec()
    }

    /// kas-bench's agents connect from the loopback address they are given, over plain TCP
    /// and over TLS (the listener here speaks neither: only who dialled matters).
    #[tokio::test]
    async fn connections_from_a_source_address_come_from_it() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((tcp, from)) = listener.accept().await {
                let _ = seen_tx.send(from.ip());
                held.push(tcp);
            }
        });
        let source: std::net::IpAddr = "127.0.0.2".parse().unwrap();
        for scheme in ["grpc", "grpcs"] {
            let url = KasUrl::parse(&format!("{scheme}://127.0.0.1:{port}")).unwrap();
            let dial = connect_from(&url, None, source, Duration::from_millis(300));
            let _ = tokio::time::timeout(Duration::from_secs(2), dial).await;
            let from = tokio::time::timeout(Duration::from_secs(2), seen.recv()).await;
            assert_eq!(from, Ok(Some(source)), "{scheme}");
        }
    }

    #[test]
    fn kas_urls_name_what_is_wrong() {
        let plain = KasUrl::parse("127.0.0.1:8150").unwrap();
        assert_eq!((plain.tls, plain.host.as_str()), (false, "127.0.0.1"));
        assert_eq!(plain.to_string(), "grpc://127.0.0.1:8150");
        let tls = KasUrl::parse("grpcs://kas.example.com:443").unwrap();
        assert_eq!((tls.tls, tls.host.as_str()), (true, "kas.example.com"));
        assert_eq!(KasUrl::parse("grpcs://[::1]:8150").unwrap().host, "::1");
        let ws = KasUrl::parse("wss://kas.example.com:443").unwrap();
        assert_eq!((ws.tls, ws.websocket), (true, true));
        assert_eq!(ws.to_string(), "wss://kas.example.com:443");
        for (bad, says) in [
            ("https://kas:443", "unknown scheme https://"),
            ("grpc://kas", "with a port"),
            ("grpc://kas:1/x", "no path"),
        ] {
            let err = KasUrl::parse(bad).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn a_changed_pair_is_served_and_a_broken_one_keeps_the_old() {
        let dir = std::env::temp_dir().join(format!("kas-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (c, k) = pair(&dir, "one.example");
        let cert = ServerCert::load(&c, &k).unwrap();
        let first = served(&cert);
        assert_eq!(cert.reload(), Ok(false), "unchanged files");
        let (c2, k2) = pair(&dir, "two.example");
        std::fs::copy(&c2, &c).unwrap();
        // The certificate changed but not the key yet: refused, naming both files.
        let err = cert.reload().unwrap_err();
        assert!(
            err.contains("one.example.crt") && err.contains("one.example.key"),
            "{err}"
        );
        assert_eq!(served(&cert), first);
        std::fs::copy(&k2, &k).unwrap();
        assert_eq!(cert.reload(), Ok(true));
        assert_ne!(served(&cert), first);
        std::fs::write(&c, "not pem").unwrap();
        let err = cert.reload().unwrap_err();
        assert!(err.contains("no PEM certificate"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
