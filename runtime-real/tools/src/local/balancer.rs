//! A TCP load balancer, what a Kubernetes Service or nginx's stream proxy does in front of
//! kas's agent listeners: agents given its one address reach every kas. Each connection
//! goes to the next backend in turn; a backend marked not ready (as a Service drops a pod
//! whose readiness probe fails: a kas that is stopping) is skipped, and so is one that
//! refuses the connection (a kas that is restarting), as nginx's `proxy_next_upstream`
//! does.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

/// How long one backend may take to accept before the next is tried.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A running balancer; dropping it closes it and every connection through it.
pub struct Balancer {
    /// Where it listens.
    pub address: SocketAddr,
    /// Whether each backend is ready (all are at start).
    ready: Arc<[AtomicBool]>,
    task: JoinHandle<()>,
}

impl Balancer {
    /// Listens on a free loopback port and spreads connections over `backends`.
    pub async fn start(backends: Vec<SocketAddr>) -> std::io::Result<Balancer> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let address = listener.local_addr()?;
        let ready: Arc<[AtomicBool]> = backends.iter().map(|_| AtomicBool::new(true)).collect();
        let backends: Arc<[SocketAddr]> = backends.into();
        let next = Arc::new(AtomicUsize::new(0));
        let readiness = ready.clone();
        let task = tokio::spawn(async move {
            // Aborting the accept loop drops this set, which aborts every relay.
            let mut relays = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((client, _)) = accepted else { continue };
                        let first = next.fetch_add(1, Ordering::Relaxed);
                        relays.spawn(relay(client, backends.clone(), readiness.clone(), first));
                    }
                    Some(_) = relays.join_next() => {}
                }
            }
        });
        Ok(Balancer {
            address,
            ready,
            task,
        })
    }

    /// Marks backend `i` (in the order given to [`Balancer::start`]) ready or not.
    pub fn set_ready(&self, i: usize, ready: bool) {
        self.ready[i].store(ready, Ordering::Relaxed);
    }
}

impl Drop for Balancer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Connects `client` to the first ready backend from `first` on that accepts, and copies
/// bytes both ways until either side closes; closes `client` when none accepts.
async fn relay(
    mut client: TcpStream,
    backends: Arc<[SocketAddr]>,
    ready: Arc<[AtomicBool]>,
    first: usize,
) {
    let _ = client.set_nodelay(true);
    for i in 0..backends.len() {
        let at = (first + i) % backends.len();
        if !ready[at].load(Ordering::Relaxed) {
            continue;
        }
        let backend = backends[at];
        let connect = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(backend));
        if let Ok(Ok(mut upstream)) = connect.await {
            let _ = upstream.set_nodelay(true);
            let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
            return;
        }
    }
}
