//! Every named scenario, over the seeds `MADSIM_TEST_SEED` / `MADSIM_TEST_NUM` select.
//! A failure prints the seed; `MADSIM_TEST_SEED=N MADSIM_TEST_NUM=1` replays it.
#![cfg(madsim)]

use kas_sim::scenario::{self, Scenario};

async fn passes(s: Scenario) {
    madsim::runtime::init_logger();
    let report = scenario::run(s).await;
    println!("{}: {:?} faults={}", s.name(), report.stats, report.faults);
    for e in &report.odd_errors {
        println!("  {e}");
    }
    assert!(
        report.violations.is_empty(),
        "{}: {} violations:\n{}",
        s.name(),
        report.violations.len(),
        report.violations.join("\n")
    );
}

#[madsim::test]
async fn steady() {
    passes(Scenario::Steady).await;
}

#[madsim::test]
async fn kas_crash() {
    passes(Scenario::KasCrash).await;
}

#[madsim::test]
async fn partition() {
    passes(Scenario::Partition).await;
}

#[madsim::test]
async fn redis_restart() {
    passes(Scenario::RedisRestart).await;
}

#[madsim::test]
async fn reconnect_storm() {
    passes(Scenario::ReconnectStorm).await;
}

#[madsim::test]
async fn agent_churn() {
    passes(Scenario::AgentChurn).await;
}

#[madsim::test]
async fn swarm() {
    passes(Scenario::Swarm).await;
}
