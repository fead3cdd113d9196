//! The one pub-sub reconnect loop, shared by the Redis and the simulated store (they
//! differ only in [`Transport`]): keeps a subscriber connection up, restores every wanted
//! subscription after a loss, relays confirmations and messages, checks the connection
//! with `PING` every [`KEEPALIVE`], and reports `Up` and `Down` (messages in between are
//! lost). Every failed attempt — to connect or to subscribe — is followed by a jittered,
//! growing delay, so that kas replicas that lost Redis together do not return together.

use super::{PubSubCommand, PubSubEvent, StoreError};
use kas_core::backoff::Backoff;
use kas_core::rng::Rng;
use std::collections::BTreeSet;
use std::future::Future;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// How often an idle pub-sub connection is checked with `PING`.
const KEEPALIVE: Duration = Duration::from_secs(1);

/// Delays between attempts to (re)establish the connection.
const RECONNECT: Backoff = Backoff {
    initial: Duration::from_millis(50),
    max: Duration::from_secs(2),
    factor: 2,
};

/// What a subscriber connection's server pushes.
pub enum Pushed {
    /// A subscription is active.
    Subscribed(String),
    /// A message on a subscribed channel.
    Message(String, Vec<u8>),
    /// The answer to a `PING`.
    Pong,
}

/// How to open subscriber connections.
pub trait Transport: Send + Sync + 'static {
    /// One open connection.
    type Conn: Connection;
    /// Opens one (the loop bounds it with the store's timeout).
    fn connect(&self) -> impl Future<Output = Result<Self::Conn, StoreError>> + Send;
}

/// One subscriber connection. An error from any method means it is broken.
pub trait Connection: Send {
    /// Asks for these channels; each confirmation arrives as [`Pushed::Subscribed`].
    fn subscribe(
        &mut self,
        channels: Vec<String>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// Drops a channel.
    fn unsubscribe(
        &mut self,
        channel: String,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// Sends a `PING`; its answer arrives as [`Pushed::Pong`].
    fn ping(&mut self) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// The next thing the server pushed. Cancel-safe: the relay selects on it beside
    /// commands and keepalives, and a message lost to a cancellation is a lost wake-up.
    fn next(&mut self) -> impl Future<Output = Result<Pushed, StoreError>> + Send;
}

/// Runs the loop until the handle (`cmds`) or the event receiver is dropped.
pub async fn run<T: Transport>(
    transport: T,
    timeout: Duration,
    mut cmds: mpsc::UnboundedReceiver<PubSubCommand>,
    events: mpsc::Sender<PubSubEvent>,
) {
    // Ordered, so that a reconnection subscribes in the same order in every run (the
    // simulation's determinism check found a `HashSet` here).
    let mut channels: BTreeSet<String> = BTreeSet::new();
    let mut rng = Rng::new(rand::random());
    let mut failures = 0;
    loop {
        if failures > 0 {
            let delay = RECONNECT.delay(failures - 1, &mut rng);
            if !wait_while_down(delay, &mut cmds, &mut channels).await {
                return;
            }
        }
        let conn = tokio::time::timeout(timeout, transport.connect()).await;
        let Ok(Ok(mut conn)) = conn else {
            failures += 1;
            continue;
        };
        let all: Vec<String> = channels.iter().cloned().collect();
        if !all.is_empty() && conn.subscribe(all).await.is_err() {
            failures += 1;
            continue;
        }
        if events.send(PubSubEvent::Up).await.is_err() {
            return;
        }
        match serve(&mut conn, timeout, &mut cmds, &events, &mut channels).await {
            Served::Broken => {}
            Served::Gone => return,
        }
        if events.send(PubSubEvent::Down).await.is_err() {
            return;
        }
        // A connection that broke is re-established after a pause, and the delays grow
        // again from the shortest: it was up.
        failures = 1;
    }
}

enum Served {
    /// The connection broke.
    Broken,
    /// The handle or the event receiver is gone.
    Gone,
}

/// Relays one live connection until it breaks.
async fn serve<C: Connection>(
    conn: &mut C,
    timeout: Duration,
    cmds: &mut mpsc::UnboundedReceiver<PubSubCommand>,
    events: &mpsc::Sender<PubSubEvent>,
    channels: &mut BTreeSet<String>,
) -> Served {
    let mut keepalive = tokio::time::interval(KEEPALIVE);
    keepalive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // When the unanswered PING was sent.
    let mut ping_sent: Option<Instant> = None;
    loop {
        let event = tokio::select! {
            biased;
            cmd = cmds.recv() => {
                let sent = match cmd {
                    None => return Served::Gone,
                    Some(PubSubCommand::Subscribe(ch)) => {
                        channels.insert(ch.clone());
                        conn.subscribe(vec![ch]).await
                    }
                    Some(PubSubCommand::Unsubscribe(ch)) => {
                        channels.remove(&ch);
                        conn.unsubscribe(ch).await
                    }
                };
                if sent.is_err() {
                    return Served::Broken;
                }
                continue;
            }
            _ = keepalive.tick() => {
                match ping_sent {
                    Some(at) if at.elapsed() >= timeout => return Served::Broken,
                    Some(_) => {}
                    None => {
                        ping_sent = Some(Instant::now());
                        if conn.ping().await.is_err() {
                            return Served::Broken;
                        }
                    }
                }
                continue;
            }
            pushed = conn.next() => match pushed {
                Err(_) => return Served::Broken,
                Ok(Pushed::Pong) => {
                    ping_sent = None;
                    continue;
                }
                Ok(Pushed::Subscribed(ch)) => PubSubEvent::Subscribed(ch),
                Ok(Pushed::Message(channel, payload)) => PubSubEvent::Message { channel, payload },
            },
        };
        if events.send(event).await.is_err() {
            return Served::Gone;
        }
    }
}

/// While the connection is down: waits `delay`, keeping `channels` (the wanted
/// subscriptions) up to date with the commands that arrive. `false`: the handle is gone.
async fn wait_while_down(
    delay: Duration,
    cmds: &mut mpsc::UnboundedReceiver<PubSubCommand>,
    channels: &mut BTreeSet<String>,
) -> bool {
    let sleep = tokio::time::sleep(delay);
    tokio::pin!(sleep);
    loop {
        tokio::select! {
            biased;
            () = &mut sleep => return true,
            cmd = cmds.recv() => match cmd {
                None => return false,
                Some(PubSubCommand::Subscribe(ch)) => {
                    channels.insert(ch);
                }
                Some(PubSubCommand::Unsubscribe(ch)) => {
                    channels.remove(&ch);
                }
            },
        }
    }
}

#[cfg(all(test, not(madsim)))]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// Refuses every connection (or, with `accept`, accepts it and fails its subscribe),
    /// recording when each attempt came.
    #[derive(Clone, Default)]
    struct Failing {
        attempts: Arc<Mutex<Vec<Instant>>>,
        accept: bool,
    }

    struct Broken;

    impl Transport for Failing {
        type Conn = Broken;

        async fn connect(&self) -> Result<Broken, StoreError> {
            self.attempts.lock().unwrap().push(Instant::now());
            if self.accept {
                Ok(Broken)
            } else {
                Err(StoreError("refused".into()))
            }
        }
    }

    impl Connection for Broken {
        async fn subscribe(&mut self, _: Vec<String>) -> Result<(), StoreError> {
            Err(StoreError("subscribe failed".into()))
        }
        async fn unsubscribe(&mut self, _: String) -> Result<(), StoreError> {
            Ok(())
        }
        async fn ping(&mut self) -> Result<(), StoreError> {
            Ok(())
        }
        async fn next(&mut self) -> Result<Pushed, StoreError> {
            std::future::pending().await
        }
    }

    /// The gaps between the first `n` attempts of a loop over `transport`.
    async fn gaps(transport: Failing, subscribed: bool, n: usize) -> Vec<Duration> {
        let (cmd_tx, cmds) = mpsc::unbounded_channel();
        if subscribed {
            cmd_tx.send(PubSubCommand::Subscribe("ch".into())).unwrap();
        }
        let (events, _rx) = mpsc::channel(8);
        let attempts = transport.attempts.clone();
        let task = tokio::spawn(run(transport, Duration::from_secs(1), cmds, events));
        while attempts.lock().unwrap().len() < n {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        task.abort();
        let at = attempts.lock().unwrap().clone();
        at.windows(2).map(|w| w[1] - w[0]).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn every_failed_attempt_is_followed_by_a_growing_jittered_delay() {
        let refused = gaps(Failing::default(), false, 8).await;
        // Attempt k waits for a delay drawn from [d/2, d], d = 50 ms * 2^k capped at 2 s.
        for (k, gap) in refused.iter().enumerate() {
            let full = (50u64 << k).min(2_000);
            let ms = gap.as_millis() as u64;
            assert!(ms + 10 >= full / 2 && ms <= full + 10, "gap {k}: {gap:?}");
        }
        // A connection whose SUBSCRIBE fails is retried after a delay too (it used to
        // reconnect at once, in a tight loop).
        let accepted = Failing {
            accept: true,
            ..Failing::default()
        };
        let failed_subscribes = gaps(accepted, true, 5).await;
        assert!(
            failed_subscribes
                .iter()
                .all(|g| *g >= Duration::from_millis(25)),
            "{failed_subscribes:?}"
        );
    }
}
