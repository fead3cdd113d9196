use super::*;

const A: AgentId = AgentId(1);

fn kas(n: u32) -> KasId {
    KasId(format!("kas{n}:8155"))
}

fn router() -> Router {
    router_lingering(Duration::ZERO)
}

/// A router that keeps an agent's subscription `linger` after its last call.
fn router_lingering(linger: Duration) -> Router {
    Router::new(config(linger), kas(0), 7)
}

fn config(linger: Duration) -> RouterConfig {
    RouterConfig {
        poll_backoff: Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_millis(400),
            factor: 2,
        },
        failure_memory: Duration::from_secs(10),
        local_patience: Duration::from_millis(500),
        grace: Duration::from_millis(50),
        linger,
        steps: false,
    }
}

/// A lingering router with pub-sub up, whose one call (id 1, at 0) found `found`, then
/// finished at 10.
fn router_that_found(found: Vec<KasId>) -> Router {
    let mut r = router_lingering(Duration::from_millis(1000));
    r.handle_input(Time(0), RouterInput::PubSubUp);
    start(&mut r, 0, 1, 500);
    r.handle_input(Time(0), RouterInput::Subscribed { agent: A });
    assert_eq!(
        drain(&mut r),
        vec![RouterOutput::Subscribe(A), RouterOutput::Lookup(A)]
    );
    answer_lookup(&mut r, 1, found);
    drain(&mut r);
    finish(&mut r, 10, 1);
    assert_eq!(drain(&mut r), vec![], "no unsubscribe while lingering");
    r
}

fn event(r: &mut Router, now: u64, n: u32, connected: bool) {
    r.handle_input(
        Time(now),
        RouterInput::TunnelEvent {
            agent: A,
            kas: kas(n),
            connected,
        },
    );
}

/// Agent A's tunnels on this kas appear or go.
fn local(r: &mut Router, now: u64, present: bool) {
    r.handle_input(Time(now), RouterInput::LocalPresence { agent: A, present });
}

fn drain(r: &mut Router) -> Vec<RouterOutput> {
    std::iter::from_fn(|| r.poll_output()).collect()
}

fn start(r: &mut Router, now: u64, id: u64, deadline: u64) {
    r.handle_input(
        Time(now),
        RouterInput::Start {
            request: RequestId(id),
            agent: A,
            connection: None,
            deadline: Time(deadline),
        },
    );
}

fn answer_lookup(r: &mut Router, now: u64, kas: Vec<KasId>) {
    r.handle_input(Time(now), RouterInput::LookupDone { agent: A, kas });
}

fn finish(r: &mut Router, now: u64, id: u64) {
    r.handle_input(
        Time(now),
        RouterInput::Finished {
            request: RequestId(id),
        },
    );
}

fn attempt(id: u64, target: Target) -> RouterOutput {
    RouterOutput::Attempt {
        request: RequestId(id),
        target,
    }
}

#[test]
fn local_tunnel_is_used_without_touching_redis() {
    let mut r = router();
    local(&mut r, 0, true);
    start(&mut r, 0, 1, 1000);
    assert_eq!(drain(&mut r), vec![attempt(1, Target::Local)]);
    finish(&mut r, 1, 1);
    assert_eq!(drain(&mut r), vec![]);
    assert_eq!((r.request_count(), r.subscription_count()), (0, 0));
}

#[test]
fn subscribes_before_lookup_and_never_targets_itself() {
    let mut r = router();
    start(&mut r, 0, 1, 1000);
    assert_eq!(drain(&mut r), vec![RouterOutput::Subscribe(A)]);
    r.handle_input(Time(1), RouterInput::Subscribed { agent: A });
    assert_eq!(drain(&mut r), vec![RouterOutput::Lookup(A)]);
    answer_lookup(&mut r, 2, vec![kas(0), kas(2)]);
    assert_eq!(drain(&mut r), vec![attempt(1, Target::Kas(kas(2)))]);
    finish(&mut r, 3, 1);
    assert_eq!(drain(&mut r), vec![RouterOutput::Unsubscribe(A)]);
}

#[test]
fn refused_attempts_move_on_and_failed_kas_go_last_next_time() {
    let mut r = router();
    start(&mut r, 0, 1, 1000);
    r.handle_input(Time(0), RouterInput::Subscribed { agent: A });
    drain(&mut r);
    answer_lookup(&mut r, 0, vec![kas(1), kas(2)]);
    let RouterOutput::Attempt { target: first, .. } = drain(&mut r).remove(0) else {
        panic!("expected an attempt");
    };
    r.handle_input(
        Time(1),
        RouterInput::AttemptRefused {
            request: RequestId(1),
        },
    );
    let second = drain(&mut r);
    assert_eq!(second.len(), 1);
    assert_ne!(second[0], attempt(1, first.clone()));
    finish(&mut r, 1, 1);
    drain(&mut r);
    // Every later call tries the failed kas last.
    for id in 2..20 {
        start(&mut r, 2, id, 1000);
        r.handle_input(Time(2), RouterInput::Subscribed { agent: A });
        drain(&mut r);
        answer_lookup(&mut r, 2, vec![kas(1), kas(2)]);
        let out = drain(&mut r);
        assert!(!out.contains(&attempt(id, first.clone())), "{out:?}");
        finish(&mut r, 2, id);
        drain(&mut r);
    }
}

/// Starts call `id` (pinned to `connection` when set) at `now` and answers its lookup with
/// kas 1 and 2: the first target it tries.
fn first_target(r: &mut Router, now: u64, id: u64, connection: Option<ConnectionId>) -> Target {
    r.handle_input(
        Time(now),
        RouterInput::Start {
            request: RequestId(id),
            agent: A,
            connection,
            deadline: Time(now + 100_000),
        },
    );
    r.handle_input(Time(now), RouterInput::Subscribed { agent: A });
    drain(r);
    answer_lookup(r, now, vec![kas(1), kas(2)]);
    match drain(r).remove(0) {
        RouterOutput::Attempt { target, .. } => target,
        other => panic!("expected an attempt, got {other:?}"),
    }
}

/// Targets first tried by 40 calls at `now` (each finished at once).
fn first_targets(
    r: &mut Router,
    now: u64,
    from: u64,
    connection: Option<ConnectionId>,
) -> Vec<Target> {
    (from..from + 40)
        .map(|id| {
            let t = first_target(r, now, id, connection);
            finish(r, now, id);
            drain(r);
            t
        })
        .collect()
}

#[test]
fn a_refusal_is_remembered_for_what_it_was_about_and_expires_by_itself() {
    let mut r = router();
    // A call pinned to replica 7 is refused by the first kas it tries.
    let pinned = Some(ConnectionId(7));
    let refused_by = first_target(&mut r, 0, 1, pinned);
    r.handle_input(
        Time(1),
        RouterInput::AttemptRefused {
            request: RequestId(1),
        },
    );
    drain(&mut r);
    finish(&mut r, 1, 1);
    drain(&mut r);
    // Unpinned calls of the agent still spread over both kas...
    let unpinned = first_targets(&mut r, 2, 100, None);
    assert!(unpinned.contains(&refused_by), "{unpinned:?}");
    assert!(unpinned.iter().any(|t| *t != refused_by), "{unpinned:?}");
    // ...while calls pinned to that replica try the refusing kas last,
    let again = first_targets(&mut r, 2, 200, pinned);
    assert!(!again.contains(&refused_by), "{again:?}");
    // ...calls pinned to another replica do not,
    let other = first_targets(&mut r, 2, 300, Some(ConnectionId(9)));
    assert!(other.contains(&refused_by), "{other:?}");
    // ...and once the memory (10 s) has passed, with no timer run in between, neither do
    // calls pinned to it.
    let later = first_targets(&mut r, 10_001, 400, pinned);
    assert!(later.contains(&refused_by), "{later:?}");
}

#[test]
fn waiting_call_wakes_on_tunnel_event_and_goes_straight_there() {
    let mut r = router();
    start(&mut r, 0, 1, 1000);
    r.handle_input(Time(0), RouterInput::Subscribed { agent: A });
    answer_lookup(&mut r, 0, vec![]);
    assert_eq!(
        drain(&mut r),
        vec![RouterOutput::Subscribe(A), RouterOutput::Lookup(A)]
    );
    r.handle_input(
        Time(5),
        RouterInput::TunnelEvent {
            agent: A,
            kas: kas(3),
            connected: true,
        },
    );
    assert_eq!(drain(&mut r), vec![attempt(1, Target::Kas(kas(3)))]);
}

/// A finished call takes its deadline, grace and poll timers with it: the engine is not
/// woken at the deadlines of calls long gone, and the timers follow the calls in flight.
#[test]
fn a_finished_call_leaves_no_timer_behind() {
    let mut r = router();
    local(&mut r, 0, true);
    for id in 1..=100 {
        start(&mut r, 0, id, 30_000);
        finish(&mut r, 1, id);
    }
    assert_eq!(r.poll_timeout(), None, "served locally, then finished");
    local(&mut r, 1, false);
    start(&mut r, 2, 101, 30_000);
    r.handle_input(Time(2), RouterInput::Subscribed { agent: A });
    answer_lookup(&mut r, 2, vec![]);
    drain(&mut r);
    assert_eq!(polls_until(&mut r, 1_000).len(), 4, "waiting, it polls");
    finish(&mut r, 1_000, 101);
    assert_eq!(r.poll_timeout(), None, "finished while waiting for a poll");
}

#[test]
fn waiting_call_polls_with_backoff_when_no_event_comes() {
    let mut r = router();
    start(&mut r, 0, 1, 10_000);
    r.handle_input(Time(0), RouterInput::Subscribed { agent: A });
    answer_lookup(&mut r, 0, vec![]);
    drain(&mut r);
    let polls = polls_until(&mut r, 10_000);
    let gaps: Vec<u64> = polls.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(polls[0] >= 50 && polls[0] <= 100, "first poll {polls:?}");
    assert!(
        gaps.iter().all(|g| (100..=400).contains(g)),
        "gaps {gaps:?}"
    );
}

/// Runs `r`'s timers until `until`, answering lookups with no kas; returns when lookups
/// (polls) were issued.
fn polls_until(r: &mut Router, until: u64) -> Vec<u64> {
    let mut polls = Vec::new();
    while let Some(now) = r.poll_timeout().filter(|t| t.0 < until) {
        r.handle_timeout(now);
        if drain(r) == vec![RouterOutput::Lookup(A)] {
            polls.push(now.0);
            answer_lookup(r, now.0, vec![]);
        }
    }
    polls
}

#[test]
fn with_pubsub_up_a_waiting_call_does_not_poll_until_pubsub_goes_down() {
    let mut r = router();
    r.handle_input(Time(0), RouterInput::PubSubUp);
    start(&mut r, 0, 1, 10_000);
    r.handle_input(Time(0), RouterInput::Subscribed { agent: A });
    assert_eq!(
        drain(&mut r),
        vec![RouterOutput::Subscribe(A), RouterOutput::Lookup(A)]
    );
    answer_lookup(&mut r, 0, vec![]);
    assert_eq!(polls_until(&mut r, 5_000), Vec::<u64>::new());
    r.handle_input(Time(5_000), RouterInput::PubSubDown);
    let polls = polls_until(&mut r, 6_000);
    assert!(!polls.is_empty() && polls[0] <= 5_100, "{polls:?}");
    // Up again: one lookup for everyone once the subscription is confirmed, then quiet.
    r.handle_input(Time(6_000), RouterInput::PubSubUp);
    assert_eq!(
        drain(&mut r),
        vec![],
        "looked up before the subscription was renewed"
    );
    r.handle_input(Time(6_000), RouterInput::Subscribed { agent: A });
    assert_eq!(drain(&mut r), vec![RouterOutput::Lookup(A)]);
    answer_lookup(&mut r, 6_000, vec![]);
    assert_eq!(polls_until(&mut r, 9_999), Vec::<u64>::new());
    r.handle_input(
        Time(9_000),
        RouterInput::TunnelEvent {
            agent: A,
            kas: kas(2),
            connected: true,
        },
    );
    assert_eq!(drain(&mut r), vec![attempt(1, Target::Kas(kas(2)))]);
}

#[test]
fn with_pubsub_up_a_failed_lookup_or_a_refusal_still_polls() {
    let mut r = router();
    r.handle_input(Time(0), RouterInput::PubSubUp);
    start(&mut r, 0, 1, 10_000);
    r.handle_input(Time(0), RouterInput::Subscribed { agent: A });
    drain(&mut r);
    r.handle_input(Time(0), RouterInput::LookupFailed { agent: A });
    assert!(r.poll_timeout().unwrap() < Time(200), "store failing: poll");
    let mut r = router();
    r.handle_input(Time(0), RouterInput::PubSubUp);
    start(&mut r, 0, 1, 10_000);
    r.handle_input(Time(0), RouterInput::Subscribed { agent: A });
    drain(&mut r);
    answer_lookup(&mut r, 0, vec![kas(3)]);
    assert_eq!(drain(&mut r), vec![attempt(1, Target::Kas(kas(3)))]);
    r.handle_input(
        Time(1),
        RouterInput::AttemptRefused {
            request: RequestId(1),
        },
    );
    assert!(r.poll_timeout().unwrap() < Time(200), "kas3 refused: poll");
}

#[test]
fn deadline_fails_with_not_connected_and_releases_everything() {
    let mut r = router();
    start(&mut r, 0, 1, 300);
    r.handle_input(Time(0), RouterInput::Subscribed { agent: A });
    answer_lookup(&mut r, 0, vec![]);
    drain(&mut r);
    while r.request_count() > 0 {
        let t = r.poll_timeout().unwrap();
        r.handle_timeout(t);
        for o in drain(&mut r) {
            match o {
                RouterOutput::Lookup(_) => answer_lookup(&mut r, t.0, vec![]),
                RouterOutput::Fail { request, error } => {
                    assert_eq!((request, t), (RequestId(1), Time(300)));
                    assert_eq!(error.to_string(), "agent 1 is not connected");
                }
                RouterOutput::Unsubscribe(_) => {}
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    assert_eq!(r.subscription_count(), 0);
}

#[test]
fn attempt_running_past_deadline_is_failed_after_grace() {
    let mut r = router();
    local(&mut r, 0, true);
    start(&mut r, 0, 1, 100);
    drain(&mut r);
    r.handle_timeout(Time(100));
    assert_eq!(drain(&mut r), vec![], "attempt still has its grace");
    r.handle_timeout(Time(150));
    assert_eq!(
        drain(&mut r),
        vec![RouterOutput::Fail {
            request: RequestId(1),
            error: RouteError::DeadlineExceeded { agent: A }
        }]
    );
}

#[test]
fn refused_local_attempt_falls_back_to_discovery() {
    let mut r = router();
    local(&mut r, 0, true);
    start(&mut r, 0, 1, 1000);
    drain(&mut r);
    r.handle_input(
        Time(1),
        RouterInput::AttemptRefused {
            request: RequestId(1),
        },
    );
    assert_eq!(drain(&mut r), vec![RouterOutput::Subscribe(A)]);
}

#[test]
fn one_lookup_serves_all_calls_for_an_agent() {
    let mut r = router();
    for id in 1..=50 {
        start(&mut r, 0, id, 1000);
    }
    r.handle_input(Time(0), RouterInput::Subscribed { agent: A });
    let out = drain(&mut r);
    assert_eq!(
        out,
        vec![RouterOutput::Subscribe(A), RouterOutput::Lookup(A)]
    );
}

#[test]
fn calls_soon_after_take_what_the_lingering_subscription_tells() {
    let mut r = router_that_found(vec![kas(0), kas(2)]);
    assert_eq!(r.subscription_count(), 1);
    start(&mut r, 20, 2, 500);
    assert_eq!(
        drain(&mut r),
        vec![attempt(2, Target::Kas(kas(2)))],
        "no lookup"
    );
    finish(&mut r, 30, 2);
    // Events keep it current while nobody calls; a disconnect makes the next call look
    // the agent up (it may have come out of order).
    event(&mut r, 40, 3, true);
    event(&mut r, 41, 2, false);
    start(&mut r, 50, 3, 500);
    assert_eq!(drain(&mut r), vec![RouterOutput::Lookup(A)]);
    answer_lookup(&mut r, 51, vec![kas(3)]);
    assert_eq!(drain(&mut r), vec![attempt(3, Target::Kas(kas(3)))]);
    finish(&mut r, 60, 3);
    // `linger` after the last call the subscription goes, and with it what it told.
    r.handle_timeout(Time(1059));
    assert_eq!(drain(&mut r), vec![]);
    r.handle_timeout(Time(1060));
    assert_eq!(drain(&mut r), vec![RouterOutput::Unsubscribe(A)]);
    assert_eq!(r.subscription_count(), 0);
    start(&mut r, 1100, 4, 1500);
    assert_eq!(drain(&mut r), vec![RouterOutput::Subscribe(A)]);
}

#[test]
fn a_disconnect_delivered_after_a_later_connect_does_not_hide_the_kas() {
    // kas 2 lost its tunnels and got them back; the events arrive the other way round.
    let mut r = router_that_found(vec![kas(2)]);
    event(&mut r, 10, 2, true);
    event(&mut r, 11, 2, false);
    start(&mut r, 20, 2, 2000);
    assert_eq!(
        drain(&mut r),
        vec![RouterOutput::Lookup(A)],
        "not 'nowhere'"
    );
    answer_lookup(&mut r, 21, vec![kas(2)]);
    assert_eq!(drain(&mut r), vec![attempt(2, Target::Kas(kas(2)))]);
}

#[test]
fn a_call_during_the_linger_keeps_the_subscription() {
    let mut r = router_that_found(vec![kas(2)]);
    start(&mut r, 900, 2, 5000);
    drain(&mut r);
    r.handle_timeout(Time(1010)); // the first linger's end passes with a call running
    assert_eq!(drain(&mut r), vec![]);
    finish(&mut r, 1500, 2);
    r.handle_timeout(Time(2499));
    assert_eq!(drain(&mut r), vec![]);
    r.handle_timeout(Time(2500));
    assert_eq!(drain(&mut r), vec![RouterOutput::Unsubscribe(A)]);
}

#[test]
fn a_known_agent_that_is_nowhere_waits_for_an_event_without_lookups() {
    let mut r = router_that_found(vec![]);
    start(&mut r, 20, 2, 2000);
    assert_eq!(drain(&mut r), vec![]);
    r.handle_timeout(Time(799));
    assert_eq!(drain(&mut r), vec![], "no poll before the deadline");
    event(&mut r, 799, 2, true);
    assert_eq!(drain(&mut r), vec![attempt(2, Target::Kas(kas(2)))]);
}

#[test]
fn a_refusal_drops_what_the_subscription_told() {
    let mut r = router_that_found(vec![kas(2)]);
    start(&mut r, 20, 2, 5000);
    assert_eq!(drain(&mut r), vec![attempt(2, Target::Kas(kas(2)))]);
    r.handle_input(
        Time(21),
        RouterInput::AttemptRefused {
            request: RequestId(2),
        },
    );
    assert_eq!(drain(&mut r), vec![], "polls after a refusal");
    let poll = r.poll_timeout().unwrap();
    r.handle_timeout(poll);
    assert_eq!(drain(&mut r), vec![RouterOutput::Lookup(A)]);
    answer_lookup(&mut r, poll.0 + 1, vec![kas(3)]);
    assert_eq!(drain(&mut r), vec![attempt(2, Target::Kas(kas(3)))]);
    finish(&mut r, poll.0 + 2, 2);
    start(&mut r, poll.0 + 3, 3, 5000);
    assert_eq!(
        drain(&mut r),
        vec![attempt(3, Target::Kas(kas(3)))],
        "the new lookup is kept"
    );
}

#[test]
fn a_pubsub_loss_drops_what_every_subscription_told() {
    let mut r = router_that_found(vec![kas(2)]);
    r.handle_input(Time(20), RouterInput::PubSubDown);
    r.handle_input(Time(30), RouterInput::PubSubUp);
    start(&mut r, 40, 2, 5000);
    // Neither the old knowledge nor a lookup before the renewed subscription is
    // confirmed: a record announced in between would be missed (a lingering subscription
    // made agents unreachable after a Redis restart in the simulation this way).
    assert_eq!(drain(&mut r), vec![]);
    r.handle_input(Time(41), RouterInput::Subscribed { agent: A });
    assert_eq!(drain(&mut r), vec![RouterOutput::Lookup(A)]);
}

/// A router with pub-sub up whose call 1 (deadline `deadline`) found no kas and waits;
/// pub-sub then goes down at 1,000, and the call's poll is sent but not answered.
fn router_polling_while_down(deadline: u64) -> Router {
    let mut r = router_lingering(Duration::from_millis(10_000));
    r.handle_input(Time(0), RouterInput::PubSubUp);
    start(&mut r, 0, 1, deadline);
    r.handle_input(Time(0), RouterInput::Subscribed { agent: A });
    drain(&mut r);
    answer_lookup(&mut r, 0, vec![]);
    r.handle_input(Time(1_000), RouterInput::PubSubDown);
    let poll = r.poll_timeout().expect("a poll while down");
    r.handle_timeout(poll);
    assert_eq!(drain(&mut r), vec![RouterOutput::Lookup(A)]);
    r
}

#[test]
fn a_poll_answered_after_the_subscription_was_renewed_is_followed_by_a_lookup() {
    // The poll read the store before kas2's record was announced; its answer comes after
    // the renewed subscription, which missed the announcement.
    let mut r = router_polling_while_down(10_000);
    r.handle_input(Time(1_200), RouterInput::PubSubUp);
    start(&mut r, 1_250, 2, 10_000);
    r.handle_input(Time(1_260), RouterInput::Subscribed { agent: A });
    assert_eq!(drain(&mut r), vec![], "one lookup in flight at a time");
    answer_lookup(&mut r, 1_300, vec![]);
    assert_eq!(drain(&mut r), vec![RouterOutput::Lookup(A)]);
    answer_lookup(&mut r, 1_310, vec![kas(2)]);
    assert_eq!(
        drain(&mut r),
        vec![
            attempt(1, Target::Kas(kas(2))),
            attempt(2, Target::Kas(kas(2)))
        ]
    );
}

#[test]
fn a_poll_answered_after_the_subscription_was_renewed_is_not_kept() {
    // Swarm seed 846: its empty answer, kept, left later calls waiting for nothing.
    let mut r = router_polling_while_down(1_500);
    r.handle_input(Time(1_200), RouterInput::PubSubUp);
    r.handle_input(Time(1_210), RouterInput::Subscribed { agent: A });
    r.handle_timeout(Time(1_500));
    drain(&mut r);
    answer_lookup(&mut r, 1_600, vec![]);
    start(&mut r, 1_700, 2, 5_000);
    assert_eq!(drain(&mut r), vec![RouterOutput::Lookup(A)]);
}

#[test]
fn a_lookup_raced_by_an_event_answers_its_calls_but_is_not_kept() {
    let mut r = router_lingering(Duration::from_millis(1000));
    r.handle_input(Time(0), RouterInput::PubSubUp);
    start(&mut r, 0, 1, 500);
    r.handle_input(Time(0), RouterInput::Subscribed { agent: A });
    drain(&mut r);
    // kas3 registers after the lookup read Redis, before its answer came back.
    event(&mut r, 1, 3, true);
    answer_lookup(&mut r, 2, vec![kas(2)]);
    let outputs = drain(&mut r);
    assert_eq!(outputs.len(), 1, "{outputs:?}");
    finish(&mut r, 10, 1);
    start(&mut r, 20, 2, 500);
    assert_eq!(drain(&mut r), vec![RouterOutput::Lookup(A)]);
}

#[test]
fn a_call_that_joins_a_lookup_raced_by_an_event_looks_up_again() {
    // `redis-restart` seed 152 (the probe after a failover): the lookup read the store
    // while agent A's one tunnel was busy; kas3 announced it idle again before the answer,
    // waking the call then waiting; a call that came after the event took the empty answer
    // and waited, quietly, for an announcement that had already gone by.
    let mut r = router();
    r.handle_input(Time(0), RouterInput::PubSubUp);
    start(&mut r, 0, 1, 5_000);
    r.handle_input(Time(0), RouterInput::Subscribed { agent: A });
    assert_eq!(
        drain(&mut r),
        vec![RouterOutput::Subscribe(A), RouterOutput::Lookup(A)]
    );
    event(&mut r, 150, 3, true);
    start(&mut r, 230, 2, 5_000);
    assert_eq!(drain(&mut r), vec![], "one lookup in flight at a time");
    answer_lookup(&mut r, 370, vec![]);
    assert_eq!(
        drain(&mut r),
        vec![attempt(1, Target::Kas(kas(3))), RouterOutput::Lookup(A)]
    );
    answer_lookup(&mut r, 380, vec![kas(3)]);
    assert_eq!(drain(&mut r), vec![attempt(2, Target::Kas(kas(3)))]);
}

#[test]
fn without_pubsub_nothing_is_kept() {
    let mut r = router_lingering(Duration::from_millis(1000));
    start(&mut r, 0, 1, 500);
    r.handle_input(Time(0), RouterInput::Subscribed { agent: A });
    drain(&mut r);
    answer_lookup(&mut r, 1, vec![kas(2)]);
    drain(&mut r);
    finish(&mut r, 10, 1);
    start(&mut r, 20, 2, 500);
    assert_eq!(drain(&mut r), vec![RouterOutput::Lookup(A)]);
}

#[test]
fn a_call_waits_for_local_busy_tunnels_only_the_patience_while_another_kas_holds_the_agent() {
    let mut r = router();
    local(&mut r, 0, true);
    start(&mut r, 0, 1, 5000);
    assert_eq!(drain(&mut r), vec![attempt(1, Target::Local)]);
    assert_eq!(
        r.local_wait_until(Time(0), RequestId(1)),
        Some(Time(500)),
        "before a lookup tells where else the agent is, the call waits here the patience"
    );
    // The local tunnels stay busy: the call looks for another kas, which refuses.
    r.handle_input(
        Time(10),
        RouterInput::AttemptRefused {
            request: RequestId(1),
        },
    );
    assert_eq!(drain(&mut r), vec![RouterOutput::Subscribe(A)]);
    r.handle_input(Time(10), RouterInput::Subscribed { agent: A });
    assert_eq!(drain(&mut r), vec![RouterOutput::Lookup(A)]);
    answer_lookup(&mut r, 20, vec![kas(0), kas(1)]);
    assert_eq!(
        drain(&mut r),
        vec![attempt(1, Target::Kas(kas(1)))],
        "this kas's tunnels stayed busy past the patience lately: the other kas first"
    );
    r.handle_input(
        Time(30),
        RouterInput::AttemptRefused {
            request: RequestId(1),
        },
    );
    assert_eq!(drain(&mut r), vec![attempt(1, Target::Local)]);
    assert_eq!(
        r.local_wait_until(Time(30), RequestId(1)),
        Some(Time(530)),
        "kas1 holds the agent (it may have a tunnel free soon): wait here only the patience"
    );
    // Once a lookup says this kas alone holds the agent, a call waits here to its deadline.
    // (Past the memory of kas1's refusal.)
    finish(&mut r, 40, 1);
    start(&mut r, 20_000, 2, 25_000);
    drain(&mut r);
    r.handle_input(
        Time(20_010),
        RouterInput::AttemptRefused {
            request: RequestId(2),
        },
    );
    drain(&mut r);
    answer_lookup(&mut r, 20_020, vec![kas(0)]);
    assert_eq!(drain(&mut r), vec![attempt(2, Target::Local)]);
    assert_eq!(
        r.local_wait_until(Time(20_020), RequestId(2)),
        Some(Time(25_000))
    );
}

#[test]
fn a_refusal_remembered_no_longer_hurries_a_call_once_no_other_kas_holds_the_agent() {
    let mut r = router();
    r.handle_input(Time(0), RouterInput::PubSubUp);
    local(&mut r, 0, true);
    start(&mut r, 0, 1, 5000);
    assert_eq!(drain(&mut r), vec![attempt(1, Target::Local)]);
    let refuse = |r: &mut Router, now: u64| {
        let request = RequestId(1);
        r.handle_input(Time(now), RouterInput::AttemptRefused { request });
    };
    refuse(&mut r, 500);
    assert_eq!(drain(&mut r), vec![RouterOutput::Subscribe(A)]);
    r.handle_input(Time(500), RouterInput::Subscribed { agent: A });
    assert_eq!(drain(&mut r), vec![RouterOutput::Lookup(A)]);
    answer_lookup(&mut r, 510, vec![kas(0), kas(1)]);
    assert_eq!(drain(&mut r), vec![attempt(1, Target::Kas(kas(1)))]);
    // kas1's tunnels are busy too; where the agent is is not known after a refusal.
    refuse(&mut r, 520);
    assert_eq!(drain(&mut r), vec![attempt(1, Target::Local)]);
    assert_eq!(
        r.local_wait_until(Time(520), RequestId(1)),
        Some(Time(1020)),
        "kas1 refused lately and may have a tunnel free soon: only the patience here"
    );
    refuse(&mut r, 1020);
    drain(&mut r);
    // The call's next poll looks the agent up: kas1 has lost its tunnel meanwhile.
    r.handle_timeout(Time(1500));
    assert_eq!(drain(&mut r), vec![RouterOutput::Lookup(A)]);
    answer_lookup(&mut r, 1510, vec![kas(0)]);
    assert_eq!(drain(&mut r), vec![attempt(1, Target::Local)]);
    assert_eq!(
        r.local_wait_until(Time(1510), RequestId(1)),
        Some(Time(5000)),
        "no other kas holds the agent: kas1's refusal is no reason to look again"
    );
}

fn step(id: u64, step: RouteStep) -> RouterOutput {
    RouterOutput::Step {
        request: RequestId(id),
        step,
    }
}

/// Asked for, a call's steps tell where its time goes: the lookup, why it waits, what
/// woke it, each attempt counted. (Off, the other tests see none.)
#[test]
fn a_calls_steps_say_why_it_waits_and_count_its_attempts() {
    let config = RouterConfig {
        steps: true,
        ..config(Duration::ZERO)
    };
    let mut r = Router::new(config, kas(0), 7);
    r.handle_input(Time(0), RouterInput::PubSubUp);
    start(&mut r, 0, 1, 1000);
    assert_eq!(
        drain(&mut r),
        vec![step(1, RouteStep::LookingUp), RouterOutput::Subscribe(A)]
    );
    r.handle_input(Time(1), RouterInput::Subscribed { agent: A });
    assert_eq!(drain(&mut r), vec![RouterOutput::Lookup(A)]);
    answer_lookup(&mut r, 2, vec![kas(0)]);
    let found = RouteStep::Found {
        kas: Some(0),
        remembered: false,
    };
    assert_eq!(
        drain(&mut r),
        vec![
            step(1, found),
            step(1, RouteStep::Waiting(WaitReason::NoTunnel))
        ]
    );
    event(&mut r, 3, 1, true);
    let first = RouteStep::Attempt {
        target: Target::Kas(kas(1)),
        attempt: 1,
    };
    assert_eq!(
        drain(&mut r),
        vec![
            step(1, RouteStep::Woken),
            step(1, first),
            attempt(1, Target::Kas(kas(1)))
        ]
    );
    r.handle_input(
        Time(4),
        RouterInput::AttemptRefused {
            request: RequestId(1),
        },
    );
    assert_eq!(
        drain(&mut r),
        vec![step(1, RouteStep::Waiting(WaitReason::Refused))]
    );
    event(&mut r, 5, 2, true);
    let second = RouteStep::Attempt {
        target: Target::Kas(kas(2)),
        attempt: 2,
    };
    assert_eq!(
        drain(&mut r),
        vec![
            step(1, RouteStep::Woken),
            step(1, second),
            attempt(1, Target::Kas(kas(2)))
        ]
    );
    r.handle_input(Time(6), RouterInput::PubSubDown);
    r.handle_input(
        Time(7),
        RouterInput::AttemptRefused {
            request: RequestId(1),
        },
    );
    assert_eq!(
        drain(&mut r),
        vec![step(1, RouteStep::Waiting(WaitReason::PubSubDown))]
    );
}
