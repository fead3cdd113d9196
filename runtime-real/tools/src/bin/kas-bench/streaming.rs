//! Streaming throughput: a pod log of a fixed size, read whole on the three paths.

use kas_client::api_client::ApiClient;
use kas_proto::pods::LogsRequest;
use kas_proto::pods::pods_client::PodsClient;
use std::time::{Duration, Instant};
use tonic::transport::Channel;

/// Where a log is read from.
pub enum Path {
    /// The agent's Pods service itself.
    Direct(PodsClient<Channel>),
    /// kas's public API, for the agent.
    Routed(ApiClient, i64),
}

/// What one path measured: the time of each read, fastest first.
pub struct Reads(pub Vec<Duration>);

impl Reads {
    /// The median read's throughput in MB/s (10^6 bytes) for `bytes` per read.
    pub fn median_mb_per_s(&self, bytes: i64) -> f64 {
        let median = self.0.get(self.0.len() / 2).copied().unwrap_or_default();
        bytes as f64 / 1e6 / median.as_secs_f64().max(1e-9)
    }
}

impl Path {
    /// Reads `bytes` of log once; returns how many arrived.
    async fn read(&self, bytes: i64) -> Result<i64, String> {
        let mut stream = match self {
            Path::Direct(client) => {
                let req = LogsRequest {
                    namespace: "bench".into(),
                    pod: "web-00".into(),
                    container: String::new(),
                    limit_bytes: bytes,
                };
                client.clone().logs(req).await.map(|r| r.into_inner())
            }
            Path::Routed(api, agent) => {
                api.pod_logs(*agent, None, "bench", "web-00", "", bytes)
                    .await
            }
        }
        .map_err(|e| e.to_string())?;
        let mut got = 0i64;
        while let Some(c) = stream.message().await.map_err(|e| e.to_string())? {
            got += c.data.len() as i64;
        }
        Ok(got)
    }

    /// One warm-up read, then `reads` timed reads of `bytes` each.
    pub async fn measure(&self, bytes: i64, reads: usize) -> Result<Reads, String> {
        self.read(bytes).await?;
        let mut took = Vec::with_capacity(reads);
        for _ in 0..reads {
            let t = Instant::now();
            let got = self.read(bytes).await?;
            if got != bytes {
                return Err(format!("read {got} bytes of log, expected {bytes}"));
            }
            took.push(t.elapsed());
        }
        took.sort();
        Ok(Reads(took))
    }
}
