//! The simulated Redis client (madsim only): the store's operations sent over `madsim::net`
//! to the simulated Redis node of `kas-sim`, which applies them as Redis would (each key's
//! transaction atomically, fields under key expiry, fire-and-forget pub-sub).

use super::{PubSubCommand, PubSubEvent, StoreError};
use crate::planted_bug::{Bug, planted};
use kas_core::tracker::KeyWrite;
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::{Endpoint, Receiver, Sender};
use tokio::sync::mpsc;

/// A request to the simulated Redis.
#[derive(Clone, Debug)]
pub enum SimRequest {
    /// The batch write (see the Redis store's script). Answer: `Done`.
    Execute(Vec<KeyWrite>),
    /// `HGETALL`. Answer: `Hash`.
    Read(String),
    /// The GC's compare-and-delete script. Answer: `Deleted`.
    DeleteUnchanged(String, Vec<(String, Vec<u8>)>),
    /// `PING`. Answer: `Done`.
    Ping,
    /// `SUBSCRIBE` (turns the connection into a subscriber). Answer: `Subscribed`.
    Subscribe(String),
    /// `UNSUBSCRIBE`. No answer.
    Unsubscribe(String),
}

/// An answer, or a pushed pub-sub message.
#[derive(Clone, Debug)]
pub enum SimReply {
    /// Done.
    Done,
    /// A hash's fields.
    Hash(Vec<(String, Vec<u8>)>),
    /// Fields deleted.
    Deleted(usize),
    /// The subscription is active.
    Subscribed(String),
    /// A published message on a subscribed channel.
    Message(String, Vec<u8>),
}

/// The client of the simulated Redis node at `server`.
#[derive(Clone, Debug)]
pub struct SimStore {
    server: SocketAddr,
    timeout: Duration,
}

fn err(e: impl std::fmt::Display) -> StoreError {
    StoreError(format!("simulated redis: {e}"))
}

/// Opens a connection to the server.
async fn connect(server: SocketAddr) -> std::io::Result<(Sender, Receiver)> {
    let endpoint = Endpoint::bind("0.0.0.0:0").await?;
    endpoint.connect1(server).await
}

async fn receive(rx: &mut Receiver) -> Result<SimReply, StoreError> {
    let payload = rx.recv().await.map_err(err)?;
    payload
        .downcast::<SimReply>()
        .map(|r| *r)
        .map_err(|_| err("unexpected payload"))
}

impl SimStore {
    /// A client of `address` (`ip:port` of the simulated Redis node); each operation times
    /// out after `timeout`.
    pub fn new(address: &str, timeout: Duration) -> Result<Self, StoreError> {
        let server = address
            .parse()
            .map_err(|e| err(format!("address {address:?}: {e}")))?;
        Ok(SimStore { server, timeout })
    }

    async fn call(&self, request: SimRequest) -> Result<SimReply, StoreError> {
        let exchange = async {
            let (tx, mut rx) = connect(self.server).await.map_err(err)?;
            tx.send(Box::new(request)).await.map_err(err)?;
            receive(&mut rx).await
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| err("timed out"))?
    }

    pub(super) async fn execute(&self, writes: &[KeyWrite]) -> Result<(), StoreError> {
        match self.call(SimRequest::Execute(writes.to_vec())).await? {
            SimReply::Done => Ok(()),
            other => Err(err(format!("unexpected answer {other:?}"))),
        }
    }

    pub(super) async fn read(&self, key: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        match self.call(SimRequest::Read(key.into())).await? {
            SimReply::Hash(fields) => Ok(fields),
            other => Err(err(format!("unexpected answer {other:?}"))),
        }
    }

    pub(super) async fn delete_unchanged(
        &self,
        key: &str,
        fields: &[(String, Vec<u8>)],
    ) -> Result<usize, StoreError> {
        let request = SimRequest::DeleteUnchanged(key.into(), fields.to_vec());
        match self.call(request).await? {
            SimReply::Deleted(n) => Ok(n),
            other => Err(err(format!("unexpected answer {other:?}"))),
        }
    }

    pub(super) async fn ping(&self) -> Result<(), StoreError> {
        self.call(SimRequest::Ping).await.map(|_| ())
    }

    pub(super) fn spawn_pubsub(
        &self,
        cmds: mpsc::UnboundedReceiver<PubSubCommand>,
        events: mpsc::Sender<PubSubEvent>,
    ) {
        tokio::spawn(run_pubsub(self.server, self.timeout, cmds, events));
    }
}

/// Keeps one subscriber connection up, as the Redis driver does: reconnects with backoff,
/// restores every subscription, reports `Up` and `Down` (messages in between are lost),
/// and checks the connection with `PING` every [`super::KEEPALIVE`].
async fn run_pubsub(
    server: SocketAddr,
    timeout: Duration,
    mut cmds: mpsc::UnboundedReceiver<PubSubCommand>,
    events: mpsc::Sender<PubSubEvent>,
) {
    let mut channels: BTreeSet<String> = BTreeSet::new();
    let mut delay = Duration::from_millis(50);
    loop {
        let Ok((tx, mut rx)) = connect(server).await else {
            if !super::wait_while_down(delay, &mut cmds, &mut channels).await {
                return;
            }
            delay = (delay * 2).min(Duration::from_secs(2));
            continue;
        };
        delay = Duration::from_millis(50);
        let mut ok = true;
        for ch in &channels {
            ok &= tx
                .send(Box::new(SimRequest::Subscribe(ch.clone())))
                .await
                .is_ok();
        }
        if ok && events.send(PubSubEvent::Up).await.is_err() {
            return;
        }
        let mut keepalive = tokio::time::interval(super::KEEPALIVE);
        // When the unanswered PING was sent.
        let mut ping_sent: Option<tokio::time::Instant> = None;
        while ok {
            tokio::select! {
                biased;
                cmd = cmds.recv() => match cmd {
                    None => return,
                    Some(PubSubCommand::Subscribe(ch)) => {
                        channels.insert(ch.clone());
                        ok = tx.send(Box::new(SimRequest::Subscribe(ch))).await.is_ok();
                    }
                    Some(PubSubCommand::Unsubscribe(ch)) => {
                        channels.remove(&ch);
                        ok = tx.send(Box::new(SimRequest::Unsubscribe(ch))).await.is_ok();
                    }
                },
                _ = keepalive.tick() => match ping_sent {
                    Some(at) => ok = at.elapsed() < timeout,
                    None => {
                        ping_sent = Some(tokio::time::Instant::now());
                        ok = tx.send(Box::new(SimRequest::Ping)).await.is_ok();
                    }
                },
                reply = receive(&mut rx) => {
                    let event = match reply {
                        Ok(SimReply::Subscribed(ch)) => PubSubEvent::Subscribed(ch),
                        Ok(SimReply::Message(..)) if planted() == Bug::DropWakeup => continue,
                        Ok(SimReply::Message(channel, payload)) => PubSubEvent::Message { channel, payload },
                        Ok(_) => {
                            ping_sent = None;
                            continue;
                        }
                        Err(_) => break,
                    };
                    if events.send(event).await.is_err() {
                        return;
                    }
                }
            }
        }
        if events.send(PubSubEvent::Down).await.is_err() {
            return;
        }
        // Lost: pause before reconnecting.
        tokio::time::sleep(delay).await;
    }
}
