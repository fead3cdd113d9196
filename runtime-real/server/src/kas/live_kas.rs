//! How many kas are live, as the registry says: told to each agent when it connects, so
//! that it knows how many distinct kas it can hold connections to.

use crate::store::Store;
use kas_transport::clock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// A count read at most this often: agents reconnecting together share one read.
const FRESH: Duration = Duration::from_secs(5);

/// The live kas count, cached.
pub struct LiveKas {
    store: Store,
    /// The kas instances key.
    key: String,
    /// When it was last read, and what it was.
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

    /// The count as last read, without waiting; when it is older than [`FRESH`], a read
    /// starts in the background. Keepalives carry it: a slow store must not hold them.
    pub fn latest(self: &Arc<Self>) -> i32 {
        let (at, n) = *self.cached.lock().expect("not poisoned");
        let fresh = at.is_some_and(|at| at.elapsed() < FRESH);
        if !fresh && !self.reading.load(Ordering::Acquire) {
            let this = self.clone();
            tokio::spawn(async move { this.count().await });
        }
        n
    }

    /// The count, at most [`FRESH`] old; 0 when it was never read (the store failing).
    pub async fn count(&self) -> i32 {
        let (at, n) = *self.cached.lock().expect("not poisoned");
        let fresh = at.is_some_and(|at| at.elapsed() < FRESH);
        if fresh || self.reading.swap(true, Ordering::AcqRel) {
            return n;
        }
        let _reading = Reading(&self.reading);
        match self.store.read_live(&self.key, clock::now()).await {
            Ok(live) => {
                let n = i32::try_from(live.len()).unwrap_or(i32::MAX);
                *self.cached.lock().expect("not poisoned") = (Some(Instant::now()), n);
                n
            }
            Err(e) => {
                tracing::debug!(error = %e, "cannot count the live kas");
                n
            }
        }
    }
}
