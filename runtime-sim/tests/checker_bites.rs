//! The checker bites: with a routing bug planted in simulated I/O (test-only switch), a run
//! reports the invariant the bug breaks.
#![cfg(madsim)]

use kas_sim::planted_bug::{Bug, plant};
use kas_sim::scenario::{self, Scenario};

async fn violations_with(bug: Bug) -> Vec<String> {
    plant(bug);
    let report = scenario::run(Scenario::Steady).await;
    plant(Bug::None);
    report.violations
}

#[madsim::test]
async fn delivery_to_the_wrong_agent_is_reported_as_inv_1() {
    let v = violations_with(Bug::WrongAgent).await;
    assert!(v.iter().any(|v| v.starts_with("inv 1:")), "{v:?}");
}

#[madsim::test]
async fn a_second_delivery_of_a_call_is_reported_as_inv_3() {
    let v = violations_with(Bug::DeliverTwice).await;
    assert!(v.iter().any(|v| v.starts_with("inv 3:")), "{v:?}");
}

#[madsim::test]
async fn a_dropped_wake_up_is_reported_as_inv_7() {
    let v = violations_with(Bug::DropWakeup).await;
    assert!(
        v.iter()
            .any(|v| v.starts_with("inv 7: kas") && v.contains("waiting for agent")),
        "{v:?}"
    );
}
