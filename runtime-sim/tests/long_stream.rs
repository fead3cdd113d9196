//! A two-way Kubernetes API exchange through a remote kas lasts for as long as its caller
//! keeps it: an hour of simulated time, a body piece a minute echoed as it goes, past
//! every timer of kas's own (routing deadline, tunnel heartbeats, record refreshes).
#![cfg(madsim)]

use kas_client::api_client::ApiClient;
use kas_proto::http::{HttpRequest, RequestHead, http_request, http_response};
use kas_sim::cluster::{AgentSpec, Cluster, ClusterSpec, kas_addr};
use std::time::Duration;
use tokio::time::Instant;

const HOUR: Duration = Duration::from_secs(3600);
const EVERY: Duration = Duration::from_secs(60);

#[madsim::test]
async fn a_two_way_exchange_through_a_remote_kas_lasts_an_hour() {
    let cluster = Cluster::build(&ClusterSpec {
        kas: 2,
        agents: vec![AgentSpec {
            agent: 1,
            replicas: vec![0],
        }],
        pubsub_wakeups: true,
        ttl: Duration::from_secs(4),
        grace: Duration::from_secs(2),
        ha: false,
        max_connection_age: None,
    });
    let secret = cluster.gitlab_secret();
    let outcome = cluster
        .caller()
        .spawn(async move {
            // Agent 1 is on kas0; the call goes in at kas1, which forwards it.
            tokio::time::sleep(Duration::from_secs(3)).await;
            let api = ApiClient::connect(
                &kas_addr(1, 8153).to_string(),
                &secret,
                Duration::from_secs(10),
            )
            .await
            .expect("kas1's API");
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            let head = HttpRequest {
                kind: Some(http_request::Kind::Head(RequestHead {
                    method: "POST".into(),
                    path: "/an-hour".into(),
                    ..Default::default()
                })),
            };
            tx.send(head).await.unwrap();
            let mut answer = api
                .kubernetes_request(1, None, tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
                .expect("the exchange starts");
            let start = Instant::now();
            let mut pieces = 0;
            while start.elapsed() < HOUR {
                let piece = format!("minute {pieces};");
                let data = http_request::Kind::Data(piece.clone().into_bytes().into());
                tx.send(HttpRequest { kind: Some(data) }).await.unwrap();
                // Its echo, after the response head the first time.
                let echoed = loop {
                    let m = tokio::time::timeout(Duration::from_secs(10), answer.message())
                        .await
                        .map_err(|_| format!("no echo of piece {pieces} within 10 s"))?
                        .map_err(|s| {
                            format!("the exchange failed after {:?}: {s}", start.elapsed())
                        })?
                        .ok_or_else(|| format!("the exchange ended after {:?}", start.elapsed()))?;
                    if let Some(http_response::Kind::Data(d)) = m.kind {
                        break d;
                    }
                };
                if echoed != piece.as_bytes() {
                    return Err(format!("piece {pieces} echoed as {echoed:?}"));
                }
                pieces += 1;
                tokio::time::sleep(EVERY).await;
            }
            drop(tx);
            // The caller's close-send ends it, cleanly.
            match tokio::time::timeout(Duration::from_secs(10), answer.message()).await {
                Ok(Ok(None)) => Ok(pieces),
                other => Err(format!("after an hour the exchange ended with {other:?}")),
            }
        })
        .await
        .expect("the caller's task");
    let pieces = outcome.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(pieces, 60, "a piece a minute for an hour");
}
