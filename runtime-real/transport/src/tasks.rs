//! Tasks a component starts and owns: it learns when each ends (and whether it panicked),
//! and dropping the set aborts those still running, so nothing outlives its owner.
//! (madsim's tokio has no `JoinSet`.)

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use std::future::Future;
use tokio::task::{AbortHandle, JoinError, JoinHandle};

/// A set of running tasks, each ending with a `T`; see the module documentation.
pub struct Tasks<T = ()>(FuturesUnordered<JoinHandle<T>>);

impl<T> Default for Tasks<T> {
    fn default() -> Self {
        Tasks(FuturesUnordered::new())
    }
}

impl<T: Send + 'static> Tasks<T> {
    /// Starts `task`; the handle aborts it alone.
    pub fn spawn(&mut self, task: impl Future<Output = T> + Send + 'static) -> AbortHandle {
        let handle = tokio::spawn(task);
        let abort = handle.abort_handle();
        self.0.push(handle);
        abort
    }

    /// True when none runs.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The next task to end; `None` at once when none runs.
    pub async fn next(&mut self) -> Option<Result<T, JoinError>> {
        self.0.next().await
    }
}

impl<T> Drop for Tasks<T> {
    fn drop(&mut self) {
        for task in self.0.iter() {
            task.abort();
        }
    }
}
