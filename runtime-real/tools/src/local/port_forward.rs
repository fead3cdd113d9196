//! Port-forward for the local Kubernetes API server: Kubernetes' `portforward.k8s.io`
//! protocol over SPDY/3.1, on a plain `Upgrade: SPDY/3.1` (kubectl before 1.31, or with
//! `KUBECTL_PORT_FORWARD_WEBSOCKETS=false`) or tunnelled in WebSocket binary messages
//! (`SPDY/3.1+portforward.k8s.io`, kubectl 1.31 and later). Every pod port echoes what it
//! is sent, so a test sees bytes go both ways.
//!
//! Only the SPDY kubectl uses: streams opened by the client, data, ping, reset and
//! go-away. Window updates are not needed: kubectl never waits for one.

use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress};
use futures::{SinkExt, StreamExt};
use std::collections::BTreeMap;
use std::io;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message as WsMessage;

/// The `Upgrade` token of a plain SPDY port-forward.
pub const SPDY: &str = "SPDY/3.1";
/// The stream protocol, in `X-Stream-Protocol-Version`.
pub const PROTOCOL: &str = "portforward.k8s.io";
/// The WebSocket subprotocol of SPDY tunnelled in WebSocket.
pub const WS_PROTOCOL: &str = "SPDY/3.1+portforward.k8s.io";

const SYN_STREAM: u16 = 1;
const SYN_REPLY: u16 = 2;
const RST_STREAM: u16 = 3;
const PING: u16 = 6;
const GOAWAY: u16 = 7;
const FLAG_FIN: u8 = 1;
/// The largest frame taken: kubectl's are at most 32 KiB of data.
const MAX_FRAME: usize = 1 << 20;
/// The largest header block, inflated: kubectl's are a few hundred bytes.
const MAX_HEADERS: usize = 64 << 10;
/// Bytes read from the SPDY side per WebSocket message.
const WS_CHUNK: usize = 32 << 10;

/// SPDY/3's header-compression dictionary (draft 3, 2.6.10.1): these words, each after its
/// length as four bytes big-endian, then [`DICTIONARY_TAIL`].
const DICTIONARY_WORDS: [&str; 65] = [
    "options",
    "head",
    "post",
    "put",
    "delete",
    "trace",
    "accept",
    "accept-charset",
    "accept-encoding",
    "accept-language",
    "accept-ranges",
    "age",
    "allow",
    "authorization",
    "cache-control",
    "connection",
    "content-base",
    "content-encoding",
    "content-language",
    "content-length",
    "content-location",
    "content-md5",
    "content-range",
    "content-type",
    "date",
    "etag",
    "expect",
    "expires",
    "from",
    "host",
    "if-match",
    "if-modified-since",
    "if-none-match",
    "if-range",
    "if-unmodified-since",
    "last-modified",
    "location",
    "max-forwards",
    "pragma",
    "proxy-authenticate",
    "proxy-authorization",
    "range",
    "referer",
    "retry-after",
    "server",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "user-agent",
    "vary",
    "via",
    "warning",
    "www-authenticate",
    "method",
    "get",
    "status",
    "200 OK",
    "version",
    "HTTP/1.1",
    "url",
    "public",
    "set-cookie",
    "keep-alive",
    "origin",
];
const DICTIONARY_TAIL: &str = concat!(
    "10010120120220520630030230330430530630740240540640740840941041141241341441541641",
    "7502504505203 Non-Authoritative Information204 No Content301 Moved Permanently40",
    "0 Bad Request401 Unauthorized403 Forbidden404 Not Found500 Internal Server Error",
    "501 Not Implemented503 Service UnavailableJan Feb Mar Apr May Jun Jul Aug Sept O",
    "ct Nov Dec 00:00:00 Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMTchunked,text/html,imag",
    "e/png,image/jpg,image/gif,application/xml,application/xhtml+xml,text/plain,text/",
    "javascript,publicprivatemax-age=gzip,deflate,sdchcharset=utf-8charset=iso-8859-1",
    ",utf-,*,enq=0.",
);

fn dictionary() -> Vec<u8> {
    let mut d = Vec::with_capacity(1423);
    for w in DICTIONARY_WORDS {
        d.extend_from_slice(&(w.len() as u32).to_be_bytes());
        d.extend_from_slice(w.as_bytes());
    }
    d.extend_from_slice(DICTIONARY_TAIL.as_bytes());
    d
}

fn invalid(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

/// What a client stream is for: the port's error messages, or its bytes.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Error,
    Data,
}

struct Stream {
    kind: Kind,
    request: String,
}

/// One SPDY connection's state: both directions' header compression (each a single zlib
/// stream for the whole connection) and the client's open streams.
struct Session<IO> {
    io: IO,
    dictionary: Vec<u8>,
    inflate: Decompress,
    deflate: Compress,
    streams: BTreeMap<u32, Stream>,
}

fn stream_id(bytes: &[u8]) -> io::Result<u32> {
    let b: [u8; 4] = bytes
        .get(..4)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| invalid("frame too short for its stream id"))?;
    Ok(u32::from_be_bytes(b) & 0x7fff_ffff)
}

/// A frame: its first four bytes (a control frame's version and type, or a data frame's
/// stream id), flags, a 24-bit length, the payload.
fn frame(first: [u8; 4], flags: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(8 + payload.len());
    f.extend_from_slice(&first);
    f.push(flags);
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
    f.extend_from_slice(payload);
    f
}

fn control(kind: u16, flags: u8, payload: &[u8]) -> Vec<u8> {
    let [hi, lo] = kind.to_be_bytes();
    frame([0x80, 3, hi, lo], flags, payload)
}

fn data(id: u32, flags: u8, payload: &[u8]) -> Vec<u8> {
    frame(id.to_be_bytes(), flags, payload)
}

/// Reads an inflated header block's fields in order.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize) -> io::Result<&'a [u8]> {
        if self.0.len() < n {
            return Err(invalid("header block cut short"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }

    fn number(&mut self) -> io::Result<u32> {
        Ok(u32::from_be_bytes(
            self.take(4)?.try_into().expect("four bytes"),
        ))
    }

    fn word(&mut self) -> io::Result<String> {
        let n = self.number()? as usize;
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }
}

/// Name/value pairs of an inflated header block.
fn parse_headers(block: &[u8]) -> io::Result<BTreeMap<String, String>> {
    let mut fields = Fields(block);
    let mut headers = BTreeMap::new();
    for _ in 0..fields.number()? {
        let name = fields.word()?;
        headers.insert(name, fields.word()?);
    }
    Ok(headers)
}

impl<IO: AsyncRead + AsyncWrite + Unpin> Session<IO> {
    fn inflate(&mut self, block: &[u8]) -> io::Result<Vec<u8>> {
        let mut out = Vec::with_capacity(4 * block.len() + 64);
        let mut used = 0;
        loop {
            let before = self.inflate.total_in();
            match self
                .inflate
                .decompress_vec(&block[used..], &mut out, FlushDecompress::Sync)
            {
                Ok(_) => {}
                Err(e) if e.needs_dictionary().is_some() => {
                    self.inflate
                        .set_dictionary(&self.dictionary)
                        .map_err(|e| invalid(format!("header dictionary: {e}")))?;
                }
                Err(e) => return Err(invalid(format!("header block: {e}"))),
            }
            used += (self.inflate.total_in() - before) as usize;
            if used == block.len() && out.len() < out.capacity() {
                return Ok(out);
            }
            if out.len() >= MAX_HEADERS {
                return Err(invalid("header block inflates past 64 KiB"));
            }
            out.reserve(out.capacity());
        }
    }

    /// An empty header block, compressed on the connection's stream.
    fn no_headers(&mut self) -> io::Result<Vec<u8>> {
        let mut out = Vec::with_capacity(64);
        self.deflate
            .compress_vec(&0u32.to_be_bytes(), &mut out, FlushCompress::Sync)
            .map_err(|e| invalid(format!("compressing headers: {e}")))?;
        Ok(out)
    }

    async fn syn_stream(&mut self, payload: &[u8]) -> io::Result<()> {
        let id = stream_id(payload)?;
        let block = payload
            .get(10..)
            .ok_or_else(|| invalid("SYN_STREAM too short"))?;
        let headers = parse_headers(&self.inflate(block)?)?;
        let kind = match headers.get("streamtype").map(String::as_str) {
            Some("error") => Kind::Error,
            Some("data") => Kind::Data,
            other => return Err(invalid(format!("stream type {other:?}"))),
        };
        let request = headers.get("requestid").cloned().unwrap_or_default();
        self.streams.insert(id, Stream { kind, request });
        let mut reply = id.to_be_bytes().to_vec();
        reply.extend(self.no_headers()?);
        self.io.write_all(&control(SYN_REPLY, 0, &reply)).await
    }

    /// Echoes a data stream's bytes; when the client ends it, ends it and its error stream.
    async fn on_data(&mut self, id: u32, flags: u8, payload: &[u8]) -> io::Result<()> {
        let Some(stream) = self.streams.get(&id) else {
            return Ok(()); // reset or never opened: dropped, as SPDY says
        };
        if stream.kind == Kind::Error {
            return Ok(()); // the client half-closes its error stream at once
        }
        if !payload.is_empty() {
            self.io.write_all(&data(id, 0, payload)).await?;
        }
        if flags & FLAG_FIN != 0 {
            let request = stream.request.clone();
            let ends: Vec<u32> = self
                .streams
                .iter()
                .filter(|(_, s)| s.request == request)
                .map(|(id, _)| *id)
                .collect();
            for end in ends {
                self.streams.remove(&end);
                self.io.write_all(&data(end, FLAG_FIN, &[])).await?;
            }
        }
        Ok(())
    }

    /// Answers a control frame; false at the client's go-away.
    async fn on_control(&mut self, head: [u8; 8], flags: u8, payload: &[u8]) -> io::Result<bool> {
        let version = u16::from_be_bytes([head[0] & 0x7f, head[1]]);
        if version != 3 {
            return Err(invalid(format!("SPDY version {version}")));
        }
        match u16::from_be_bytes([head[2], head[3]]) {
            SYN_STREAM => self.syn_stream(payload).await?,
            RST_STREAM => {
                self.streams.remove(&stream_id(payload)?);
            }
            PING => self.io.write_all(&control(PING, flags, payload)).await?,
            GOAWAY => return Ok(false),
            _ => {} // settings, window updates, headers: nothing here needs them
        }
        Ok(true)
    }

    async fn run(mut self) -> io::Result<()> {
        loop {
            let mut head = [0u8; 8];
            match self.io.read_exact(&mut head).await {
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                r => r?,
            };
            let flags = head[4];
            let len = u32::from_be_bytes([0, head[5], head[6], head[7]]) as usize;
            if len > MAX_FRAME {
                return Err(invalid(format!("a {len}-byte frame")));
            }
            let mut payload = vec![0; len];
            self.io.read_exact(&mut payload).await?;
            if head[0] & 0x80 == 0 {
                self.on_data(stream_id(&head)?, flags, &payload).await?;
            } else if !self.on_control(head, flags, &payload).await? {
                return Ok(());
            }
            self.io.flush().await?;
        }
    }
}

/// Serves port-forward on a SPDY connection until the client ends it.
pub async fn serve(io: impl AsyncRead + AsyncWrite + Unpin) -> io::Result<()> {
    Session {
        io,
        dictionary: dictionary(),
        inflate: Decompress::new(true),
        deflate: Compress::new(Compression::default(), true),
        streams: BTreeMap::new(),
    }
    .run()
    .await
}

/// Serves port-forward on SPDY tunnelled in a WebSocket's binary messages.
pub async fn serve_websocket<S>(ws: WebSocketStream<S>) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (mine, theirs) = tokio::io::duplex(2 * WS_CHUNK);
    let (mut from_spdy, mut to_spdy) = tokio::io::split(mine);
    let (mut ws_out, mut ws_in) = ws.split();
    let inbound = async move {
        while let Some(m) = ws_in.next().await {
            match m.map_err(io::Error::other)? {
                WsMessage::Binary(b) => to_spdy.write_all(&b).await?,
                WsMessage::Close(_) => break,
                _ => {}
            }
        }
        to_spdy.shutdown().await
    };
    let outbound = async move {
        let mut buf = vec![0; WS_CHUNK];
        loop {
            let n = from_spdy.read(&mut buf).await?;
            if n == 0 {
                return ws_out.close().await.map_err(io::Error::other);
            }
            ws_out
                .send(WsMessage::binary(buf[..n].to_vec()))
                .await
                .map_err(io::Error::other)?;
        }
    };
    let (spdy, _, _) = tokio::join!(serve(theirs), inbound, outbound);
    spdy
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dictionary_is_spdy3s() {
        let d = dictionary();
        assert_eq!(d.len(), 1423);
        // zlib names a preset dictionary by its Adler-32; Go's and Chromium's SPDY/3 one is this.
        let (mut a, mut b) = (1u32, 0u32);
        for &x in &d {
            a = (a + u32::from(x)) % 65_521;
            b = (b + a) % 65_521;
        }
        assert_eq!((b << 16) | a, 0xe3c6_a7c2);
    }

    /// A client's header block: compressed on its own stream, with the dictionary.
    fn client_headers(deflate: &mut Compress, pairs: &[(&str, &str)]) -> Vec<u8> {
        let mut block = (pairs.len() as u32).to_be_bytes().to_vec();
        for (n, v) in pairs {
            for w in [n, v] {
                block.extend_from_slice(&(w.len() as u32).to_be_bytes());
                block.extend_from_slice(w.as_bytes());
            }
        }
        let mut out = Vec::with_capacity(block.len() + 64);
        deflate
            .compress_vec(&block, &mut out, FlushCompress::Sync)
            .unwrap();
        out
    }

    fn syn_stream(deflate: &mut Compress, id: u32, kind: &str) -> Vec<u8> {
        let mut p = id.to_be_bytes().to_vec();
        p.extend_from_slice(&[0; 6]);
        let headers = [("streamtype", kind), ("port", "8080"), ("requestid", "0")];
        p.extend(client_headers(deflate, &headers));
        control(SYN_STREAM, 0, &p)
    }

    async fn frame(io: &mut (impl AsyncRead + Unpin)) -> (Vec<u8>, Vec<u8>) {
        let mut head = vec![0; 8];
        io.read_exact(&mut head).await.unwrap();
        let len = u32::from_be_bytes([0, head[5], head[6], head[7]]) as usize;
        let mut payload = vec![0; len];
        io.read_exact(&mut payload).await.unwrap();
        (head, payload)
    }

    #[tokio::test]
    async fn streams_are_answered_echoed_and_ended_together() {
        let (mut client, server) = tokio::io::duplex(1 << 16);
        let served = tokio::spawn(serve(server));
        let mut deflate = Compress::new(Compression::default(), true);
        deflate.set_dictionary(&dictionary()).unwrap();
        let mut inflate = Decompress::new(true);
        for (id, kind) in [(1, "error"), (3, "data")] {
            client
                .write_all(&syn_stream(&mut deflate, id, kind))
                .await
                .unwrap();
            let (head, payload) = frame(&mut client).await;
            assert_eq!(head[..4], [0x80, 3, 0, SYN_REPLY as u8]);
            assert_eq!(stream_id(&payload).unwrap(), id);
            let mut block = Vec::with_capacity(64);
            inflate
                .decompress_vec(&payload[4..], &mut block, FlushDecompress::Sync)
                .unwrap();
            assert_eq!(block, 0u32.to_be_bytes(), "an empty header block");
        }
        client
            .write_all(&control(PING, 0, &[0, 0, 0, 1]))
            .await
            .unwrap();
        assert_eq!(frame(&mut client).await.1, [0, 0, 0, 1]);
        client.write_all(&data(3, 0, b"both ways")).await.unwrap();
        let (head, payload) = frame(&mut client).await;
        assert_eq!(
            (stream_id(&head).unwrap(), &payload[..]),
            (3, &b"both ways"[..])
        );
        client.write_all(&data(3, FLAG_FIN, &[])).await.unwrap();
        let mut ended = Vec::new();
        for _ in 0..2 {
            let (head, payload) = frame(&mut client).await;
            assert!(payload.is_empty() && head[4] == FLAG_FIN);
            ended.push(stream_id(&head).unwrap());
        }
        ended.sort();
        assert_eq!(ended, [1, 3]);
        drop(client);
        served.await.unwrap().unwrap();
    }
}
