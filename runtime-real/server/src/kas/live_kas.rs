//! How many kas are live, as the registry says: told to each agent when it connects, so
//! that it knows how many distinct kas it can hold connections to.

use crate::store::Store;
use kas_transport::clock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// A count read at most this often: agents reconnecting together share one read, and a
/// failing store is asked once a period, not at every keepalive of every connection.
const FRESH: Duration = Duration::from_secs(5);

/// The live kas count, cached.
pub struct LiveKas {
    store: Store,
    /// The kas instances key.
    key: String,
    /// When it was last read (or tried: the count stays), and what it was.
    cached: Mutex<(Option<Instant>, i32)>,
    /// A read is in flight: others take the cached count meanwhile.
    reading: AtomicBool,
}

/// Clears `reading` however the read ends (its caller may go away mid-read).
struct Reading<'a>(&'a AtomicBool);

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl LiveKas {
    /// Counts the live records of `key` (the kas instances hash) in `store`.
    pub fn new(store: Store, key: String) -> Self {
        LiveKas {
            store,
            key,
            cached: Mutex::new((None, 0)),
            reading: AtomicBool::new(false),
        }
    }

    /// The count as last read, without waiting; when it is [`FRESH`] old, a read starts
    /// in the background. Keepalives carry it: a slow store must not hold them.
    pub fn latest(self: &Arc<Self>) -> i32 {
        let (at, n) = *self.cached.lock().expect("not poisoned");
        if !fresh(at) && !self.reading.swap(true, Ordering::AcqRel) {
            let this = self.clone();
            tokio::spawn(async move { this.read(n).await });
        }
        n
    }

    /// The count, read again when the last read (or try) is [`FRESH`] old; 0 when it was
    /// never read (the store failing).
    pub async fn count(&self) -> i32 {
        let (at, n) = *self.cached.lock().expect("not poisoned");
        if fresh(at) || self.reading.swap(true, Ordering::AcqRel) {
            return n;
        }
        self.read(n).await
    }

    /// Reads the count, `reading` taken by the caller; `n` stays when the store fails.
    async fn read(&self, n: i32) -> i32 {
        let _reading = Reading(&self.reading);
        let n = match self.store.read_live(&self.key, clock::now()).await {
            Ok(live) => i32::try_from(live.len()).unwrap_or(i32::MAX),
            Err(e) => {
                tracing::debug!(error = %e, "cannot count the live kas");
                n
            }
        };
        *self.cached.lock().expect("not poisoned") = (Some(Instant::now()), n);
        n
    }
}

/// Whether a read (or try) at `at` is recent enough to go by.
fn fresh(at: Option<Instant>) -> bool {
    at.is_some_and(|at| at.elapsed() < FRESH)
}

#[cfg(all(test, not(madsim)))]
mod tests {
    use super::*;
    use crate::store::{Backend, Fields, PubSubCommand, PubSubEvent, StoreError};
    use futures::future::BoxFuture;
    use kas_core::Time;
    use kas_core::tracker::KeyWrite;
    use std::sync::atomic::AtomicUsize;
    use tokio::sync::mpsc;

    /// A store whose every read fails, counting them.
    #[derive(Clone, Default)]
    struct Failing(Arc<AtomicUsize>);

    impl Backend for Failing {
        fn execute<'a>(&'a self, _: &'a [KeyWrite]) -> BoxFuture<'a, Result<(), StoreError>> {
            Box::pin(async { Err(StoreError("down".into())) })
        }
        fn read<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Fields> {
            self.0.fetch_add(1, Ordering::Relaxed);
            Box::pin(async { Err(StoreError("down".into())) })
        }
        fn gc<'a>(&'a self, _: &'a [String], _: Time) -> BoxFuture<'a, Result<usize, StoreError>> {
            Box::pin(async { Err(StoreError("down".into())) })
        }
        fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
            Box::pin(async { Err(StoreError("down".into())) })
        }
        fn spawn_pubsub(
            &self,
            _: mpsc::UnboundedReceiver<PubSubCommand>,
            _: mpsc::Sender<PubSubEvent>,
        ) {
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_failing_store_is_asked_once_a_period_however_many_keepalives_ask() {
        let failing = Failing::default();
        let live = Arc::new(LiveKas::new(
            Store::new(failing.clone()),
            "kas:instances".into(),
        ));
        // 1,000 connections' keepalives every 100 ms for 12 s: three periods of FRESH.
        for _ in 0..120 {
            for _ in 0..1_000 {
                assert_eq!(live.latest(), 0, "never read: nothing to tell");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let reads = failing.0.load(Ordering::Relaxed);
        assert!((2..=3).contains(&reads), "{reads} reads in 12 s");
    }
}
