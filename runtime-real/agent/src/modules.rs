//! The methods an agent serves, registered in one place.

use bytes::Bytes;
use futures::stream::{self, BoxStream, Stream, StreamExt, TryStreamExt};
use kas_transport::traces::{Context, FutureExt as _};
use prost::Message;
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::sync::mpsc;
use tonic::Status;

/// The encoded response messages of one call, in order; an error ends the call with it.
pub type Answer = BoxStream<'static, Result<Bytes, Status>>;

/// The encoded request messages of one call as kas sends them; the end is the caller's
/// close-send.
pub type Requests = mpsc::Receiver<Bytes>;

type Handler = Arc<dyn Fn(Requests) -> Answer + Send + Sync>;

/// The methods this agent serves, by full gRPC method name.
#[derive(Clone, Default)]
pub struct Modules {
    handlers: BTreeMap<String, Handler>,
}

fn decode<Req: Message + Default>(bytes: &[u8]) -> Result<Req, Status> {
    Req::decode(bytes).map_err(|e| Status::invalid_argument(format!("malformed request: {e}")))
}

/// The one request message of a unary or server-streaming call.
async fn single<Req: Message + Default>(mut requests: Requests) -> Result<Req, Status> {
    let bytes = requests
        .recv()
        .await
        .ok_or_else(|| Status::invalid_argument("the call carried no request message"))?;
    decode(&bytes)
}

impl Modules {
    /// Registers a unary method.
    pub fn unary<Req, Resp, F, Fut>(&mut self, method: &str, f: F)
    where
        Req: Message + Default + 'static,
        Resp: Message + 'static,
        F: Fn(Req) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Resp, Status>> + Send + 'static,
    {
        let f = Arc::new(f);
        let handler: Handler = Arc::new(move |requests: Requests| {
            let f = f.clone();
            // `f` runs in the call's trace, current when the call starts.
            let trace = Context::current();
            stream::once(
                async move {
                    Ok(f(single::<Req>(requests).await?)
                        .await?
                        .encode_to_vec()
                        .into())
                }
                .with_context(trace),
            )
            .boxed()
        });
        self.handlers.insert(method.to_string(), handler);
    }

    /// Registers a server-streaming method: `f` starts the call and returns its stream of
    /// responses.
    pub fn server_streaming<Req, Resp, F, Fut, S>(&mut self, method: &str, f: F)
    where
        Req: Message + Default + 'static,
        Resp: Message + 'static,
        F: Fn(Req) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<S, Status>> + Send + 'static,
        S: Stream<Item = Result<Resp, Status>> + Send + 'static,
    {
        let f = Arc::new(f);
        let handler: Handler = Arc::new(move |requests: Requests| {
            let f = f.clone();
            let trace = Context::current();
            stream::once(async move { f(single::<Req>(requests).await?).await }.with_context(trace))
                .try_flatten()
                .map_ok(|m| m.encode_to_vec().into())
                .boxed()
        });
        self.handlers.insert(method.to_string(), handler);
    }

    /// Registers a two-way method: `f` gets the request messages as they come, encoded, and
    /// returns the encoded responses as it produces them.
    pub fn streaming<F>(&mut self, method: &str, f: F)
    where
        F: Fn(Requests) -> Answer + Send + Sync + 'static,
    {
        self.handlers.insert(method.to_string(), Arc::new(f));
    }

    /// The registered method names, sorted.
    pub fn methods(&self) -> Vec<String> {
        let mut m: Vec<String> = self.handlers.keys().cloned().collect();
        m.sort();
        m
    }

    /// Starts `method` on its request messages; an unknown method answers
    /// `Unimplemented`. (Public so that a module may hand a call on to another.)
    pub fn call(&self, method: &str, requests: Requests) -> Answer {
        match self.handlers.get(method) {
            Some(handler) => handler(requests),
            None => {
                let status = Status::unimplemented(format!("agent does not serve {method}"));
                stream::once(async move { Err(status) }).boxed()
            }
        }
    }
}
