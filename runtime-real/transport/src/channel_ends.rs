//! Channel ends that may be gone, for the select loops that move a two-way call's frames:
//! a way that is closed or done is `None`, and its branch then never fires.

use tokio::sync::mpsc;

/// Room for one item in `tx`; `None` once it is closed, or gone.
pub async fn reserve<T>(tx: &Option<mpsc::Sender<T>>) -> Option<mpsc::Permit<'_, T>> {
    match tx {
        Some(tx) => tx.reserve().await.ok(),
        None => None,
    }
}

/// The next item of `rx`; `None` at its end; never without a receiver.
pub async fn recv<T>(rx: &mut Option<mpsc::Receiver<T>>) -> Option<T> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}
