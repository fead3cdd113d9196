//! hyper's executor and timer for kas's HTTP listeners and clients: tokio's in production,
//! madsim's in the simulation, where tokio's would panic (no tokio runtime runs there) or
//! read the real clock.

#[cfg(not(madsim))]
pub use hyper_util::rt::{TokioExecutor as Executor, TokioTimer as Timer};

#[cfg(madsim)]
pub use sim::{Executor, Timer};

#[cfg(madsim)]
mod sim {
    use std::future::Future;
    use std::pin::Pin;
    use std::task::{Context, Poll};
    use std::time::{Duration, Instant};

    /// Spawns hyper's tasks (HTTP/2 streams, connections) on madsim's runtime.
    #[derive(Clone, Copy, Debug, Default)]
    pub struct Executor;

    impl Executor {
        /// The executor.
        pub fn new() -> Self {
            Executor
        }
    }

    impl<F> hyper::rt::Executor<F> for Executor
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        fn execute(&self, fut: F) {
            tokio::spawn(fut);
        }
    }

    /// hyper's timeouts and keepalive pings on madsim's clock.
    #[derive(Clone, Copy, Debug, Default)]
    pub struct Timer;

    impl Timer {
        /// The timer.
        pub fn new() -> Self {
            Timer
        }
    }

    impl hyper::rt::Timer for Timer {
        fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
            Box::pin(Sleep(Box::pin(tokio::time::sleep(duration))))
        }

        fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
            Box::pin(Sleep(Box::pin(tokio::time::sleep_until(deadline))))
        }
    }

    struct Sleep(Pin<Box<tokio::time::Sleep>>);

    impl Future for Sleep {
        type Output = ();

        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            self.0.as_mut().poll(cx)
        }
    }

    impl hyper::rt::Sleep for Sleep {}
}
