//! The methods an agent serves, registered in one place.

use futures::future::BoxFuture;
use prost::Message;
use std::collections::HashMap;
use std::sync::Arc;
use tonic::Status;

type Handler = Arc<dyn Fn(Vec<u8>) -> BoxFuture<'static, Result<Vec<u8>, Status>> + Send + Sync>;

/// The methods this agent serves, by full gRPC method name.
#[derive(Clone, Default)]
pub struct Modules {
    handlers: HashMap<String, Handler>,
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
            Box::pin(async move {
                let req = Req::decode(bytes.as_slice())
                    .map_err(|e| Status::invalid_argument(format!("malformed request: {e}")))?;
                Ok(f(req).await?.encode_to_vec())
            })
        });
        self.handlers.insert(method.to_string(), handler);
    }

    /// The registered method names, sorted.
    pub fn methods(&self) -> Vec<String> {
        let mut m: Vec<String> = self.handlers.keys().cloned().collect();
        m.sort();
        m
    }

    pub(super) async fn call(&self, method: &str, request: Vec<u8>) -> Result<Vec<u8>, Status> {
        let handler = self
            .handlers
            .get(method)
            .ok_or_else(|| Status::unimplemented(format!("agent does not serve {method}")))?;
        handler(request).await
    }
}
