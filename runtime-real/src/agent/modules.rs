//! The methods an agent serves, registered in one place.

use futures::stream::{self, BoxStream, Stream, StreamExt, TryStreamExt};
use prost::Message;
use std::collections::BTreeMap;
use std::sync::Arc;
use tonic::Status;

/// The encoded response messages of one call, in order; an error ends the call with it.
pub type Answer = BoxStream<'static, Result<Vec<u8>, Status>>;

type Handler = Arc<dyn Fn(Vec<u8>) -> Answer + Send + Sync>;

/// The methods this agent serves, by full gRPC method name.
#[derive(Clone, Default)]
pub struct Modules {
    handlers: BTreeMap<String, Handler>,
}

fn decode<Req: Message + Default>(bytes: &[u8]) -> Result<Req, Status> {
    Req::decode(bytes).map_err(|e| Status::invalid_argument(format!("malformed request: {e}")))
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
        let handler: Handler = Arc::new(move |bytes: Vec<u8>| {
            let f = f.clone();
            stream::once(async move { Ok(f(decode::<Req>(&bytes)?).await?.encode_to_vec()) })
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
        let handler: Handler = Arc::new(move |bytes: Vec<u8>| {
            let f = f.clone();
            stream::once(async move { f(decode::<Req>(&bytes)?).await })
                .try_flatten()
                .map_ok(|m| m.encode_to_vec())
                .boxed()
        });
        self.handlers.insert(method.to_string(), handler);
    }

    /// The registered method names, sorted.
    pub fn methods(&self) -> Vec<String> {
        let mut m: Vec<String> = self.handlers.keys().cloned().collect();
        m.sort();
        m
    }

    /// Starts `method` on `request`; an unknown method answers `Unimplemented`.
    pub(super) fn call(&self, method: &str, request: Vec<u8>) -> Answer {
        match self.handlers.get(method) {
            Some(handler) => handler(request),
            None => {
                let status = Status::unimplemented(format!("agent does not serve {method}"));
                stream::once(async move { Err(status) }).boxed()
            }
        }
    }
}
