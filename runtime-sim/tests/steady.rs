//! A fault-free cluster routes calls from every kas to every agent.
#![cfg(madsim)]

use kas_runtime::api_client::ApiClient;
use kas_sim::cluster::{AgentSpec, Cluster, ClusterSpec, kas_addr, pod_name};
use std::time::Duration;

#[madsim::test]
async fn every_kas_routes_to_every_agent() {
    let spec = ClusterSpec {
        kas: 3,
        agents: vec![
            AgentSpec {
                agent: 1,
                replicas: vec![0],
            },
            AgentSpec {
                agent: 2,
                replicas: vec![1, 2],
            },
        ],
        pubsub_wakeups: true,
        ttl: Duration::from_secs(10),
    };
    let cluster = Cluster::build(&spec);
    let secret = cluster.gitlab_secret();
    let caller = cluster.caller();
    let answers = caller
        .spawn(async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            let mut answers = Vec::new();
            for i in 0..3 {
                let api = ApiClient::connect(
                    &kas_addr(i, 8153).to_string(),
                    &secret,
                    Duration::from_secs(5),
                )
                .await
                .expect("connect");
                for agent in [1, 2] {
                    let pods = api.pods(agent, None, "").await.expect("routed");
                    answers.push((i, agent, pods[0].name.clone()));
                }
            }
            answers
        })
        .await
        .unwrap();
    for (i, agent, pod) in answers {
        assert!(
            (0..2).any(|r| pod == pod_name(agent, r)),
            "kas{i} agent {agent}: answered by {pod}"
        );
    }
    let keys = cluster
        .redis
        .with_db(|db| db.keys(tokio::time::Instant::now()));
    assert!(keys.keys().any(|k| k.contains("agent:2")), "{keys:?}");
}
