//! An HTTP exchange carried as the messages of one streaming call (`kas/http.proto`), as
//! kas's Kubernetes API listener and agentk's Kubernetes API module both speak it: heads
//! with their headers, bodies as they stream, trailers, and after a `101 Switching
//! Protocols` the raw bytes of the upgraded connection both ways.
//!
//! Each side sends its half through an [`Outgoing`] and reads the other's through an
//! [`Incoming`]; the functions here move bodies and upgraded bytes between those and
//! hyper, the same on both sides.

// Peer input passes through here: nothing may panic on it.
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)
)]
// Header maps are prost's (`map<string, Values>`): looked up and converted, never iterated
// into an output whose order matters (HTTP header order across names carries no meaning).
#![allow(clippy::disallowed_types)]

use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use http::{HeaderMap, HeaderName, HeaderValue, header};
use http_body::Body;
use http_body_util::BodyExt;
use kas_proto::frame::Values;
use kas_proto::http::{HttpRequest, HttpResponse, Trailers, http_request, http_response};
use prost::Message;
use std::collections::HashMap;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Body and upgraded bytes travel in messages of at most this many bytes: far below any
/// message size limit (agentk takes 4 MiB), and small enough that streams sharing a
/// connection interleave. (32 KiB pieces halved a long response's throughput.)
pub const CHUNK: usize = 256 * 1024;

/// Request headers a caller may not set: its credentials are for kas, and who the agent
/// acts as is kas's to say.
const CALLER_MAY_NOT_SET: [&str; 4] = [
    "authorization",
    "impersonate-user",
    "impersonate-group",
    "impersonate-uid",
];

/// Header prefixes a caller may not set: `Impersonate-Extra-*`, and the front-proxy
/// identity headers (`X-Remote-User`, `-Group`, `-Extra-*`), which kube-apiserver trusts
/// only from its front proxy but nothing legitimate sends through kas.
const CALLER_MAY_NOT_SET_PREFIXES: [&str; 2] = ["impersonate-extra-", "x-remote-"];

/// Whether a caller of the Kubernetes API may set the request header `name` (lowercase,
/// as `http` names headers). kas drops the others before a request leaves it, and agentk
/// again before it reaches the API server.
pub fn caller_may_set(name: &str) -> bool {
    !CALLER_MAY_NOT_SET.contains(&name)
        && !CALLER_MAY_NOT_SET_PREFIXES
            .iter()
            .any(|p| name.starts_with(p))
}

/// The error type of the bodies built here.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Headers about one connection rather than the exchange (RFC 9110 7.6.1), never relayed;
/// `Host` is the receiving side's to set. `Upgrade` is relayed: the receiving side puts
/// `Connection: upgrade` back beside it.
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
];

/// The headers to relay: all but hop-by-hop ones, `Host`, and those the `Connection`
/// header names.
pub fn to_values(headers: &HeaderMap) -> HashMap<String, Values> {
    let named: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|n| n.trim().to_ascii_lowercase())
        .filter(|n| n != "upgrade")
        .collect();
    let mut out: HashMap<String, Values> = HashMap::new();
    for (name, value) in headers {
        if HOP_BY_HOP.contains(name)
            || name == header::HOST
            || named.iter().any(|n| n == name.as_str())
        {
            continue;
        }
        let Ok(value) = value.to_str() else { continue };
        out.entry(name.as_str().to_string())
            .or_default()
            .values
            .push(value.to_string());
    }
    out
}

/// The most header values one relayed head or trailer section may carry, and their
/// most bytes (names and values): what a peer sends is checked against these before any
/// of it is used. (`HeaderMap` panics past 32,768 entries; hyper reads at most 100
/// request headers, nginx 32 KiB of them.)
pub const MAX_HEADERS: usize = 256;
/// See [`MAX_HEADERS`].
pub const MAX_HEADER_BYTES: usize = 64 * 1024;

/// An error naming the limit when `values` carry more than [`MAX_HEADERS`] values or
/// [`MAX_HEADER_BYTES`] bytes.
pub fn check_size(values: &HashMap<String, Values>) -> Result<(), String> {
    let mut count: usize = 0;
    let mut bytes: usize = 0;
    for (name, vs) in values {
        count = count.saturating_add(vs.values.len());
        for v in &vs.values {
            bytes = bytes.saturating_add(name.len()).saturating_add(v.len());
        }
    }
    if count > MAX_HEADERS {
        return Err(format!(
            "{count} header values; at most {MAX_HEADERS} are relayed"
        ));
    }
    if bytes > MAX_HEADER_BYTES {
        return Err(format!(
            "{bytes} bytes of headers; at most {MAX_HEADER_BYTES} are relayed"
        ));
    }
    Ok(())
}

/// Adds relayed headers to `into`; `Connection: upgrade` too when they ask for an upgrade.
/// A name or value HTTP does not allow, or more than [`check_size`] allows, is an error
/// naming it.
pub fn add_values(values: &HashMap<String, Values>, into: &mut HeaderMap) -> Result<(), String> {
    check_size(values)?;
    for (name, vs) in values {
        let name = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("header name {name:?} is not valid HTTP"))?;
        if HOP_BY_HOP.contains(&name) || name == header::HOST {
            continue;
        }
        for v in &vs.values {
            let value = HeaderValue::from_str(v)
                .map_err(|_| format!("the value of header {name} is not valid HTTP"))?;
            into.append(name.clone(), value);
        }
    }
    if into.contains_key(header::UPGRADE) {
        into.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
    Ok(())
}

/// True when the headers ask to switch protocols.
pub fn wants_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .any(|v| {
                v.split(',')
                    .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
            })
}

/// One piece of a body or an upgraded stream: what [`HttpRequest`] and [`HttpResponse`]
/// share past their heads.
pub enum Piece {
    /// Body bytes.
    Data(Bytes),
    /// The body ended with these trailers.
    Trailers(HashMap<String, Values>),
    /// Bytes of the upgraded connection.
    Upgrade(Bytes),
}

/// A message type of one direction: requests towards the agent, responses back.
pub trait Half: Message + Default + Sized {
    /// The message carrying `piece`.
    fn piece(piece: Piece) -> Self;
    /// The piece this message carries; `None` for a head.
    fn into_piece(self) -> Option<Piece>;
}

/// [`Half`] for a message type and its generated `oneof` module: the two directions'
/// messages have the same shape past their heads.
macro_rules! half {
    ($message:ident, $oneof:ident) => {
        impl Half for $message {
            fn piece(piece: Piece) -> Self {
                use $oneof::Kind;
                let kind = match piece {
                    Piece::Data(d) => Kind::Data(d),
                    Piece::Trailers(headers) => Kind::Trailers(Trailers { headers }),
                    Piece::Upgrade(d) => Kind::Upgrade(d),
                };
                $message { kind: Some(kind) }
            }

            fn into_piece(self) -> Option<Piece> {
                use $oneof::Kind;
                match self.kind? {
                    Kind::Head(_) => None,
                    Kind::Data(d) => Some(Piece::Data(d)),
                    Kind::Trailers(t) => Some(Piece::Trailers(t.headers)),
                    Kind::Upgrade(d) => Some(Piece::Upgrade(d)),
                }
            }
        }
    };
}
half!(HttpRequest, http_request);
half!(HttpResponse, http_response);

/// Where one side sends its encoded messages.
pub trait Outgoing: Send {
    /// Sends one; false once the other side is gone.
    fn send(&mut self, message: Bytes) -> impl Future<Output = bool> + Send;

    /// Says that no more will come, when that is not the end of the whole call (the
    /// caller's half-close of an upgraded connection).
    fn close(&mut self) -> impl Future<Output = ()> + Send {
        async {}
    }
}

/// Which end of an upgraded connection one side holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpgradedEnd {
    /// The caller's (kas): its end of writing is a half-close, passed on; the call ends
    /// when the other side ends it.
    Caller,
    /// The API server's (agentk): its end ends the call.
    Server,
}

/// Where one side reads the other's encoded messages.
pub trait Incoming: Send {
    /// The next one; `None` at the other side's clean end, an error when it failed.
    fn recv(&mut self) -> impl Future<Output = Result<Option<Bytes>, String>> + Send;
}

/// `message` encoded, to be sent.
pub fn encode(message: impl Message) -> Bytes {
    message.encode_to_vec().into()
}

/// Decodes the next message of `incoming` as an `H`.
pub async fn next<H: Half>(incoming: &mut impl Incoming) -> Result<Option<H>, String> {
    match incoming.recv().await? {
        Some(bytes) => H::decode(bytes)
            .map(Some)
            .map_err(|e| format!("malformed HTTP message: {e}")),
        None => Ok(None),
    }
}

/// Sends `body` as data and trailer messages; `Err` when the body broke (the other side
/// must not take it for complete), `Ok(false)` when the other side went away.
pub async fn send_body<H: Half, B>(body: B, out: &mut impl Outgoing) -> Result<bool, String>
where
    B: Body<Data = Bytes> + Send + Unpin,
    B::Error: std::fmt::Display,
{
    let mut body = body;
    let mut trailers = None;
    let mut ended = false;
    while !ended {
        // Waits for one frame, then takes what else is ready at once, up to a message:
        // fewer, fuller messages for a fast body, no waiting for a slow one.
        let mut pieces: Vec<Bytes> = Vec::new();
        let mut len = 0;
        while len < CHUNK && trailers.is_none() {
            let next = if pieces.is_empty() {
                body.frame().await
            } else {
                match body.frame().now_or_never() {
                    Some(next) => next,
                    None => break,
                }
            };
            match next {
                None => {
                    ended = true;
                    break;
                }
                Some(frame) => match frame
                    .map_err(|e| format!("the body broke: {e}"))?
                    .into_data()
                {
                    Ok(bytes) => {
                        len += bytes.len();
                        pieces.push(bytes);
                    }
                    Err(frame) => trailers = frame.into_trailers().ok(),
                },
            }
        }
        // One piece that fits goes as it is; several are joined (and a long one cut).
        let mut data = match pieces.as_slice() {
            [] => Bytes::new(),
            [one] => one.clone(),
            _ => pieces.concat().into(),
        };
        while !data.is_empty() {
            let chunk = data.split_to(data.len().min(CHUNK));
            if !out.send(encode(H::piece(Piece::Data(chunk)))).await {
                return Ok(false);
            }
        }
        if let Some(t) = trailers.take()
            && !out
                .send(encode(H::piece(Piece::Trailers(to_values(&t)))))
                .await
        {
            return Ok(false);
        }
    }
    Ok(true)
}

/// A body read from `incoming`'s data and trailer messages, ending at its end; a failure
/// or a message that has no place in a body breaks it.
pub fn recv_body<H: Half + 'static, I: Incoming + 'static>(
    incoming: I,
) -> http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError> {
    let frames = futures::stream::unfold(Some(incoming), |state| async move {
        let mut incoming = state?;
        let frame = match next::<H>(&mut incoming).await {
            Ok(None) => return None,
            Ok(Some(m)) => match m.into_piece() {
                Some(Piece::Data(d)) => Ok(http_body::Frame::data(d)),
                Some(Piece::Trailers(t)) => {
                    let mut map = HeaderMap::new();
                    match add_values(&t, &mut map) {
                        Ok(()) => Ok(http_body::Frame::trailers(map)),
                        Err(e) => Err(e),
                    }
                }
                Some(Piece::Upgrade(_)) | None => {
                    Err("an HTTP message out of place in a body".into())
                }
            },
            Err(e) => Err(e),
        };
        let more = frame.is_ok().then_some(incoming);
        Some((frame.map_err(BoxError::from), more))
    });
    BodyExt::boxed_unsync(http_body_util::StreamBody::new(frames.boxed()))
}

/// Relays an upgraded connection (this side's `end` of it) and the other side's upgrade
/// messages both ways. The other side's end shuts the connection's writing half; the
/// connection's end is passed on as a half-close by the caller's end, and ends the relay
/// at the server's. At the caller's end the relay ends with the other side's.
///
/// With `idle` set, a stream on which nothing passes either way for that long is ended
/// (the kubelet's `streaming-connection-idle-timeout`): a silent session does not hold
/// its tunnel forever.
pub async fn relay_upgraded<In: Half, Out: Half>(
    io: hyper::upgrade::Upgraded,
    end: UpgradedEnd,
    idle: Option<std::time::Duration>,
    incoming: &mut impl Incoming,
    out: &mut impl Outgoing,
) -> Result<(), String> {
    let (mut reader, mut writer) = tokio::io::split(hyper_util::rt::TokioIo::new(io));
    let mut buf = vec![0u8; CHUNK];
    let mut incoming_open = true;
    let mut reading = true;
    let idle_for = idle.unwrap_or_default();
    let quiet = tokio::time::sleep(idle_for);
    tokio::pin!(quiet);
    loop {
        if idle.is_some() {
            quiet.as_mut().reset(tokio::time::Instant::now() + idle_for);
        }
        tokio::select! {
            () = &mut quiet, if idle.is_some() => {
                return Err(format!("nothing passed for {idle_for:?}: the session is ended as idle"));
            }
            n = reader.read(&mut buf), if reading => {
                let n = n.map_err(|e| format!("the upgraded connection broke: {e}"))?;
                if n == 0 {
                    match end {
                        UpgradedEnd::Server => return Ok(()),
                        UpgradedEnd::Caller => {
                            reading = false;
                            out.close().await;
                            continue;
                        }
                    }
                }
                let read = buf.get(..n).unwrap_or_default();
                let piece = Piece::Upgrade(Bytes::copy_from_slice(read));
                if !out.send(encode(Out::piece(piece))).await {
                    return Ok(());
                }
            }
            m = next::<In>(incoming), if incoming_open => match m?.map(Half::into_piece) {
                Some(Some(Piece::Upgrade(bytes))) => {
                    // Flushed: a writer that buffers (TLS may; the simulation's TCP does)
                    // would otherwise hold an interactive session's bytes.
                    let written = writer.write_all(&bytes).await;
                    written
                        .and(writer.flush().await)
                        .map_err(|e| format!("the upgraded connection broke: {e}"))?;
                }
                Some(_) => return Err("an HTTP message out of place in an upgraded stream".into()),
                None => {
                    incoming_open = false;
                    let _ = writer.shutdown().await;
                    if end == UpgradedEnd::Caller {
                        return Ok(());
                    }
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caller_may_not_set_credentials_or_identity() {
        for name in [
            "authorization",
            "impersonate-user",
            "impersonate-group",
            "impersonate-uid",
            "impersonate-extra-scopes",
            "x-remote-user",
            "x-remote-extra-team",
        ] {
            assert!(!caller_may_set(name), "{name}");
        }
        for name in ["accept", "content-type", "x-request-id", "impersonated"] {
            assert!(caller_may_set(name), "{name}");
        }
    }

    /// A head of `count` values of `len` bytes each under distinct names.
    fn head(count: usize, len: usize) -> HashMap<String, Values> {
        (0..count)
            .map(|i| {
                let values = vec!["v".repeat(len)];
                (format!("x-h{i}"), Values { values })
            })
            .collect()
    }

    #[test]
    fn a_head_over_the_caps_is_an_error_naming_them_not_a_panic() {
        let mut map = HeaderMap::new();
        // 30,000 values once overflowed `HeaderMap::append`.
        let err = add_values(&head(30_000, 1), &mut map).unwrap_err();
        assert!(err.contains("at most 256 are relayed"), "{err}");
        assert!(map.is_empty());
        let err = add_values(&head(20, 4096), &mut map).unwrap_err();
        assert!(err.contains("bytes of headers; at most 65536"), "{err}");
        add_values(&head(MAX_HEADERS, 100), &mut map).unwrap();
        assert_eq!(map.len(), MAX_HEADERS);
    }
}
