//! The master that Redis Sentinel names, followed through failovers: kas asks the
//! sentinels for the master's address, connects to it, and asks again when a command fails
//! as it does when the master died or was demoted (connection errors, `READONLY`).

use super::dial::{Dial, NodeConn};
use super::redis_error;
use crate::store::StoreError;
use ::redis::RedisError;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How soon after one resolution a failing command may ask the sentinels again: a master
/// that is down stays down for seconds before the sentinels agree on a new one, and every
/// command in that time fails.
const RESOLVE_EVERY: Duration = Duration::from_millis(250);

/// The master behind `redis.sentinel`.
pub(super) struct Sentinel {
    master_name: String,
    sentinels: Vec<String>,
    /// How to reach the sentinels (their own password, `sentinel_password_file`).
    sentinel_dial: Arc<dyn Dial>,
    /// How to reach the master.
    node_dial: Arc<dyn Dial>,
    /// How long a sentinel may take to answer.
    timeout: Duration,
    current: Mutex<Option<Current>>,
    /// One resolution at a time.
    resolving: tokio::sync::Mutex<()>,
}

struct Current {
    address: String,
    conn: NodeConn,
    resolved_at: Instant,
    /// A command failed as if this were no longer the master.
    suspect: bool,
}

impl Sentinel {
    pub(super) fn new(
        master_name: String,
        sentinels: Vec<String>,
        sentinel_dial: Arc<dyn Dial>,
        node_dial: Arc<dyn Dial>,
        timeout: Duration,
    ) -> Self {
        Sentinel {
            master_name,
            sentinels,
            sentinel_dial,
            node_dial,
            timeout,
            current: Mutex::new(None),
            resolving: tokio::sync::Mutex::new(()),
        }
    }

    /// The connection to the master, resolved first when there is none yet or the one in
    /// use is suspect.
    pub(super) async fn conn(&self) -> Result<NodeConn, StoreError> {
        if let Some(conn) = self.usable() {
            return Ok(conn);
        }
        let _one = self.resolving.lock().await;
        if let Some(conn) = self.usable() {
            return Ok(conn);
        }
        let address = self.master_address().await;
        let mut current = self.current.lock().expect("sentinel state");
        let address = match address {
            Ok(a) => a,
            // The sentinels are unreachable: keep using what there is, if anything.
            Err(e) => {
                return match current.as_mut() {
                    Some(c) => {
                        c.resolved_at = Instant::now();
                        Ok(c.conn.clone())
                    }
                    None => Err(e),
                };
            }
        };
        match current.as_mut() {
            Some(c) if c.address == address => {
                c.resolved_at = Instant::now();
                c.suspect = false;
                Ok(c.conn.clone())
            }
            _ => {
                let conn = self.node_dial.connect(&address)?;
                tracing::info!(master = %address, name = %self.master_name, "redis: the sentinels name this master");
                *current = Some(Current {
                    address,
                    conn: conn.clone(),
                    resolved_at: Instant::now(),
                    suspect: false,
                });
                Ok(conn)
            }
        }
    }

    /// The connection in use, unless it is suspect and may be resolved again.
    fn usable(&self) -> Option<NodeConn> {
        let current = self.current.lock().expect("sentinel state");
        let c = current.as_ref()?;
        (!c.suspect || c.resolved_at.elapsed() < RESOLVE_EVERY).then(|| c.conn.clone())
    }

    /// Notes a failed command: one that a dead or demoted master fails makes the next
    /// command ask the sentinels again.
    pub(super) fn failed(&self, e: &RedisError) {
        if master_may_have_moved(e)
            && let Some(c) = self.current.lock().expect("sentinel state").as_mut()
        {
            c.suspect = true;
        }
    }

    /// How the master is reached.
    pub(super) fn nodes(&self) -> Arc<dyn Dial> {
        self.node_dial.clone()
    }

    /// Asks each sentinel in turn for the master's `host:port`.
    pub(super) async fn master_address(&self) -> Result<String, StoreError> {
        let mut problems = Vec::new();
        for sentinel in &self.sentinels {
            match self.ask(sentinel).await {
                Ok(Some(address)) => return Ok(address),
                Ok(None) => problems.push(format!(
                    "{sentinel} does not know master {:?}",
                    self.master_name
                )),
                Err(e) => problems.push(format!("{sentinel}: {}", e.0)),
            }
        }
        Err(StoreError(format!(
            "redis.sentinel: no sentinel named the master: {}",
            problems.join("; ")
        )))
    }

    async fn ask(&self, sentinel: &str) -> Result<Option<String>, StoreError> {
        let mut conn = self.sentinel_dial.connect(sentinel)?;
        let timeout = self.timeout;
        let asked = async {
            let master: Option<(String, u16)> = ::redis::cmd("SENTINEL")
                .arg("GET-MASTER-ADDR-BY-NAME")
                .arg(&self.master_name)
                .query_async(&mut conn)
                .await
                .map_err(redis_error)?;
            Ok(master.map(|(host, port)| format!("{host}:{port}")))
        };
        tokio::time::timeout(timeout, asked)
            .await
            .map_err(|_| StoreError(format!("no answer within {timeout:?}")))?
    }
}

/// Whether a command failed as it does when its node is no longer the master: the node is
/// gone, or it answers as a replica (`READONLY`: a demoted master that came back, which
/// would refuse every write for as long as kas kept writing to it).
fn master_may_have_moved(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_refusal()
        || e.is_connection_dropped()
        || e.is_timeout()
        || e.kind() == ::redis::ErrorKind::Server(::redis::ServerErrorKind::ReadOnly)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error a command gets from the bytes a server answers.
    fn answered(reply: &[u8]) -> RedisError {
        let value = ::redis::parse_redis_value(reply).expect("a RESP answer");
        value.extract_error().expect_err("an error answer")
    }

    #[test]
    fn a_replica_refusing_writes_sends_kas_back_to_the_sentinels() {
        // The simulation found kas writing to a demoted master for good: the error reads
        // "ReadOnly: ...", and the check looked for "READONLY" in it.
        let readonly = answered(b"-READONLY You can't write against a read only replica.\r\n");
        assert!(master_may_have_moved(&readonly), "{readonly}");
        let refused: RedisError =
            std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused").into();
        assert!(master_may_have_moved(&refused));
        let script = answered(b"-ERR Error running script\r\n");
        assert!(!master_may_have_moved(&script), "{script}");
    }
}
