//! Wake-up latency: a call waits on kas B while its agent connects to kas A; measured from
//! the tunnel's registration (its event seen on Redis by a subscriber of our own) to the
//! call's arrival at the agent.

use crate::setup::{modules, token};
use crate::stats::Latencies;
use futures::StreamExt;
use kas_agent::AgentOptions;
use kas_client::api_client::ApiClient;
use kas_core::AgentId;
use kas_core::keys::Keys;
use kas_proto::registry::AgentMeta;
use kas_tools::local::kas_process::KasProcess;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What the samples measured.
pub struct Wakeups {
    pub latencies: Latencies,
    pub failed: usize,
}

/// Takes `samples` wake-ups with agents `first..first + samples` (each used once):
/// `gitlab` is connected to kas B, agents connect to kas `a`.
pub async fn measure(
    redis: &str,
    gitlab: &ApiClient,
    a: &KasProcess,
    first: i64,
    samples: usize,
) -> Result<Wakeups, String> {
    let client = redis::Client::open(format!("redis://{redis}")).map_err(|e| e.to_string())?;
    let (mut taken, mut failed) = (Vec::new(), 0);
    for agent in (first..).take(samples) {
        let mut events = client
            .get_async_pubsub()
            .await
            .map_err(|e| format!("redis pub-sub: {e}"))?;
        let channel = Keys::new("kas").tunnel_events(AgentId(agent));
        events
            .subscribe(&channel)
            .await
            .map_err(|e| format!("subscribe: {e}"))?;
        let registered =
            tokio::spawn(async move { events.on_message().next().await.map(|_| Instant::now()) });
        let call = {
            let api = gitlab.with_timeout(Duration::from_secs(10));
            tokio::spawn(async move { api.pods(agent, None, "").await })
        };
        // Let the call subscribe and find nothing.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let seen: Arc<Mutex<Option<Instant>>> = Arc::default();
        let mods = {
            let seen = seen.clone();
            modules(move || {
                seen.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert_with(Instant::now);
            })
        };
        let meta = AgentMeta {
            version: "bench".into(),
            pod_name: format!("wakeup-{agent}"),
            ..Default::default()
        };
        let mut options = AgentOptions::new(a.addresses.agent.to_string(), token(agent), meta);
        options.pool.min_idle = 1;
        // On kas A only: the wake-up measured is of a call waiting on kas B.
        options.kas_connections = 1;
        let (stop, shutdown) = tokio::sync::watch::channel(false);
        let running = tokio::spawn(kas_agent::run(options, mods.into(), shutdown));
        let answered = call.await.map_err(|e| e.to_string())?;
        let registered = tokio::time::timeout(Duration::from_secs(5), registered)
            .await
            .ok()
            .and_then(Result::ok)
            .flatten();
        let seen = *seen.lock().unwrap_or_else(|p| p.into_inner());
        match (answered, registered, seen) {
            (Ok(_), Some(r), Some(s)) => taken.push(s.saturating_duration_since(r)),
            _ => failed += 1,
        }
        let _ = stop.send(true);
        let _ = tokio::time::timeout(Duration::from_secs(5), running).await;
    }
    Ok(Wakeups {
        latencies: Latencies::new(taken),
        failed,
    })
}
