//! How far a kas is in stopping: one signal in named phases, which each part watches for
//! the phase that concerns it (see [`super::Kas::stop`]).

use tokio::sync::watch;

/// The phases of a stop, in order; a kas only moves forward through them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    /// Serving.
    Running,
    /// Not ready; no new calls or agent streams; agents asked to move; running calls finish.
    Closing,
    /// Calls are done and agents gone, or the grace is over: what is left is cut off.
    Leaving,
    /// The records are deleted: the agent listener stops.
    Closed,
    /// The observability listener, the last, stops.
    Stopped,
}

/// The sending end, held by the kas.
pub struct Stopping(watch::Sender<Phase>);

impl Stopping {
    /// A kas that is running, and the view its parts watch.
    pub fn new() -> (Stopping, Stop) {
        let (tx, rx) = watch::channel(Phase::Running);
        (Stopping(tx), Stop(rx))
    }

    /// Moves on to `phase`.
    pub fn enter(&self, phase: Phase) {
        self.0.send_if_modified(|p| {
            let later = phase > *p;
            if later {
                *p = phase;
            }
            later
        });
    }
}

/// A part's view of the stop. A kas dropped without stopping counts as stopped.
#[derive(Clone)]
pub struct Stop(watch::Receiver<Phase>);

impl Stop {
    /// Whether the stop has reached `phase`.
    pub fn reached(&self, phase: Phase) -> bool {
        *self.0.borrow() >= phase || self.0.has_changed().is_err()
    }

    /// Resolves once the stop reaches `phase`.
    pub async fn until(&mut self, phase: Phase) {
        let _ = self.0.wait_for(|p| *p >= phase).await;
    }

    /// A future of its own that resolves once the stop reaches `phase`: a server's
    /// shutdown signal.
    pub fn reaches(&self, phase: Phase) -> impl Future<Output = ()> + Send + 'static {
        let mut stop = self.clone();
        async move { stop.until(phase).await }
    }
}

#[cfg(all(test, not(madsim)))]
mod tests {
    use super::*;

    #[tokio::test]
    async fn parts_see_the_phases_they_wait_for_and_never_go_back() {
        let (stopping, stop) = Stopping::new();
        assert!(stop.reached(Phase::Running) && !stop.reached(Phase::Closing));
        let mut waiting = stop.clone();
        let leaving = tokio::spawn(async move { waiting.until(Phase::Leaving).await });
        stopping.enter(Phase::Closing);
        tokio::task::yield_now().await;
        assert!(!leaving.is_finished(), "Closing is not Leaving");
        stopping.enter(Phase::Leaving);
        leaving.await.unwrap();
        stopping.enter(Phase::Closing);
        assert!(stop.reached(Phase::Leaving), "a stop never goes back");
        drop(stopping);
        assert!(
            stop.reached(Phase::Stopped),
            "a dropped kas counts as stopped"
        );
        stop.clone().until(Phase::Stopped).await;
    }
}
