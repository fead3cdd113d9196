//! The node's own bookkeeping: where a call is, and what may end it.

use super::*;
use crate::backoff::Backoff;
use crate::router::RouterConfig;
use crate::tracker::TrackerConfig;
use crate::tunnel_registry::RegistryConfig;

const AGENT: AgentId = AgentId(7);
const CONN: ConnectionId = ConnectionId(70);
const TUNNEL: TunnelId = TunnelId(1);
const GRACE: Duration = Duration::from_secs(2);

fn node() -> KasNode<&'static str> {
    let defaults = NodeConfig::new(KasId("10.0.0.1:8155".into()), Keys::new("kas"));
    let backoff = Backoff {
        initial: Duration::from_millis(100),
        max: Duration::from_secs(1),
        factor: 2,
    };
    let config = NodeConfig {
        seed: 1,
        tracker: TrackerConfig {
            liveness: Duration::from_secs(300),
            backoff,
            max_keys_per_batch: 16,
            ..defaults.tracker.clone()
        },
        router: RouterConfig {
            poll_backoff: backoff,
            grace: GRACE,
            linger: Duration::ZERO,
            ..defaults.router
        },
        registry: RegistryConfig {
            heartbeat_timeout: Duration::from_secs(3600),
            ..defaults.registry
        },
        ..defaults
    };
    KasNode::new(Time(0), config)
}

/// A node with one replica of `AGENT` and one idle tunnel of it; its outputs so far drained.
fn with_tunnel() -> KasNode<&'static str> {
    let mut n = node();
    let info = ConnectedAgentInfo {
        agent_id: AGENT.0,
        project_id: 1,
        connection_id: CONN.0,
        ..Default::default()
    };
    n.handle_input(Time(0), NodeInput::AgentConnected(Box::new(info)))
        .unwrap();
    let opened = NodeInput::TunnelOpened {
        tunnel: TUNNEL,
        agent: AGENT,
        connection: CONN,
    };
    n.handle_input(Time(0), opened).unwrap();
    outputs(&mut n);
    n
}

fn outputs(n: &mut KasNode<&'static str>) -> Vec<NodeOutput<&'static str>> {
    std::iter::from_fn(|| n.poll_output()).collect()
}

fn wanted(deadline: u64) -> Wanted {
    Wanted {
        agent: AGENT,
        connection: None,
        deadline: Time(deadline),
        holder: None,
    }
}

fn route(n: &mut KasNode<&'static str>, request: u64, deadline: u64) {
    let input = NodeInput::Route {
        request: RequestId(request),
        wanted: wanted(deadline),
        call: "call",
    };
    n.handle_input(Time(0), input).unwrap();
}

/// The routed call's subscription is confirmed, then the lookup finds `AGENT` at `kas`.
fn found_at(n: &mut KasNode<&'static str>, kas: &KasId) {
    let channel = Keys::new("kas").tunnel_events(AGENT);
    n.handle_input(Time(1), NodeInput::PubSub(PubSubEvent::Up))
        .unwrap();
    let sub = NodeInput::PubSub(PubSubEvent::Subscribed(channel));
    n.handle_input(Time(1), sub).unwrap();
    let found = NodeInput::LookupDone {
        agent: AGENT,
        kas: Some(vec![kas.clone()]),
    };
    n.handle_input(Time(2), found).unwrap();
}

fn ended(outs: &[NodeOutput<&'static str>]) -> Vec<(RequestId, Outcome, Option<CallError>)> {
    outs.iter()
        .filter_map(|o| match o {
            NodeOutput::Ended {
                request,
                outcome,
                error,
                ..
            } => Some((*request, *outcome, error.clone())),
            _ => None,
        })
        .collect()
}

fn delivered(outs: &[NodeOutput<&'static str>]) -> Vec<(RequestId, TunnelId)> {
    outs.iter()
        .filter_map(|o| match o {
            NodeOutput::Deliver {
                request, tunnel, ..
            } => Some((*request, *tunnel)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_call_in_a_tunnel_outlives_its_caller_and_ends_once_as_delivered() {
    let mut n = with_tunnel();
    route(&mut n, 1, 10_000);
    let outs = outputs(&mut n);
    assert_eq!(delivered(&outs), [(RequestId(1), TUNNEL)]);
    // The caller goes away: the tunnel still drains the agent's answer.
    n.handle_input(Time(5), NodeInput::Cancel(RequestId(1)))
        .unwrap();
    assert!(
        ended(&outputs(&mut n)).is_empty(),
        "cancelled while delivered"
    );
    // Nor is the tunnel free for another call until then.
    route(&mut n, 2, 10_000);
    assert!(
        delivered(&outputs(&mut n)).is_empty(),
        "a busy tunnel took a call"
    );
    n.handle_input(Time(6), NodeInput::CallDone(RequestId(1)))
        .unwrap();
    let outs = outputs(&mut n);
    assert_eq!(ended(&outs), [(RequestId(1), Outcome::Delivered, None)]);
    assert_eq!(
        delivered(&outs),
        [(RequestId(2), TUNNEL)],
        "freed, then reused"
    );
    // A late duplicate end changes nothing.
    n.handle_input(Time(7), NodeInput::CallDone(RequestId(1)))
        .unwrap();
    assert!(ended(&outputs(&mut n)).is_empty());
}

#[test]
fn a_refused_forward_goes_back_to_the_router_and_a_delivered_one_never_does() {
    let mut n = node();
    let other = KasId("10.0.0.2:8155".into());
    route(&mut n, 1, 10_000);
    found_at(&mut n, &other);
    let forwards = |outs: &[NodeOutput<&'static str>]| {
        outs.iter()
            .filter(|o| matches!(o, NodeOutput::Forward { kas, .. } if *kas == other))
            .count()
    };
    assert_eq!(forwards(&outputs(&mut n)), 1);
    // Refused before delivery: no end, the router looks again.
    n.handle_input(Time(3), NodeInput::Bounced(RequestId(1)))
        .unwrap();
    assert!(ended(&outputs(&mut n)).is_empty());
    // Delivered through the other kas: ends once, one hop, and a late refusal is ignored.
    let found = NodeInput::LookupDone {
        agent: AGENT,
        kas: Some(vec![other.clone()]),
    };
    n.handle_timeout(Time(3_000));
    n.handle_input(Time(3_000), found).unwrap();
    assert_eq!(
        forwards(&outputs(&mut n)),
        1,
        "tried again after the refusal"
    );
    n.handle_input(Time(3_001), NodeInput::CallDone(RequestId(1)))
        .unwrap();
    let outs = outputs(&mut n);
    let hops: Vec<u32> = outs
        .iter()
        .filter_map(|o| match o {
            NodeOutput::Ended { hops, .. } => Some(*hops),
            _ => None,
        })
        .collect();
    assert_eq!(ended(&outs), [(RequestId(1), Outcome::Delivered, None)]);
    assert_eq!(hops, [1]);
    n.handle_input(Time(3_002), NodeInput::Bounced(RequestId(1)))
        .unwrap();
    assert!(
        outputs(&mut n).is_empty(),
        "a refusal after the end re-routed the call"
    );
}

/// Settled: a call that waited for a busy agent's tunnel until its deadline ends there,
/// not delivered, with that reason, whichever API it came on (the model test, which used
/// to retry it as refused, drives this same node).
#[test]
fn waiting_for_a_busy_tunnel_past_the_deadline_ends_the_call_as_busy() {
    let mut n = with_tunnel();
    route(&mut n, 1, 10_000);
    outputs(&mut n);
    route(&mut n, 2, 500);
    let serve = NodeInput::Serve {
        request: RequestId(3),
        wanted: wanted(500),
        call: "forwarded",
    };
    n.handle_input(Time(0), serve).unwrap();
    assert!(outputs(&mut n).is_empty(), "both wait for the busy tunnel");
    n.handle_timeout(Time(500));
    let outs = outputs(&mut n);
    let busy = CallError::TunnelsBusy { agent: AGENT };
    assert!(busy.is_deadline());
    let busy = Some(busy);
    assert_eq!(
        ended(&outs),
        [
            (RequestId(2), Outcome::DeadlineExceeded, busy.clone()),
            (RequestId(3), Outcome::DeadlineExceeded, busy.clone()),
        ]
    );
    assert_eq!(n.stats().calls, 1);
}

/// A call whose patience with this kas's busy tunnel ran out, and that the other kas the
/// lookup named refused (the agent's other replica was cut off there), ends at its deadline
/// as busy, not as "not connected": the agent is connected here (swarm seed 4568: a
/// saturated one-tunnel agent was reported absent by the kas it was connected to).
#[test]
fn a_call_that_gave_up_on_a_busy_tunnel_here_ends_busy_not_absent() {
    let other = KasId("10.0.0.2:8155".into());
    let mut n = with_tunnel();
    route(&mut n, 1, 10_000);
    route(&mut n, 2, 3_000);
    let channel = Keys::new("kas").tunnel_events(AGENT);
    for input in [
        NodeInput::PubSub(PubSubEvent::Up),
        NodeInput::PubSub(PubSubEvent::Subscribed(channel)),
    ] {
        n.handle_input(Time(1), input).unwrap();
    }
    let mut ends = Vec::new();
    let mut now = Time(1);
    loop {
        for out in outputs(&mut n) {
            let input = match out {
                NodeOutput::Lookup { .. } => NodeInput::LookupDone {
                    agent: AGENT,
                    kas: Some(vec![other.clone()]),
                },
                NodeOutput::Forward { request, .. } => NodeInput::Bounced(request),
                NodeOutput::Ended { .. } => {
                    ends.extend(ended(std::slice::from_ref(&out)));
                    continue;
                }
                _ => continue,
            };
            n.handle_input(now, input).unwrap();
        }
        match n.poll_timeout().filter(|at| *at <= Time(3_000)) {
            Some(at) => {
                now = at;
                n.handle_timeout(at);
            }
            None => break,
        }
    }
    assert_eq!(
        ends,
        [(
            RequestId(2),
            Outcome::DeadlineExceeded,
            Some(CallError::TunnelsBusy { agent: AGENT })
        )]
    );
}

#[test]
fn a_deadline_while_in_a_tunnel_answers_the_caller_and_keeps_the_tunnel_claimed() {
    let mut n = with_tunnel();
    route(&mut n, 1, 1_000);
    outputs(&mut n);
    n.handle_timeout(Time(1_000) + GRACE);
    let outs = outputs(&mut n);
    assert!(matches!(
        ended(&outs).as_slice(),
        [(_, Outcome::DeadlineExceeded, Some(CallError::Route(_)))]
    ));
    assert_eq!(
        n.parts().0.claimed_count(),
        1,
        "released before the tunnel ended it"
    );
    n.handle_input(Time(2_500), NodeInput::CallDone(RequestId(1)))
        .unwrap();
    assert!(ended(&outputs(&mut n)).is_empty(), "ended twice");
    assert_eq!(n.parts().0.claimed_count(), 0);
}

#[test]
fn a_delivered_streaming_call_outlives_its_deadline_and_is_never_offered_again() {
    // Local: the tunnel began sending it.
    let mut n = with_tunnel();
    route(&mut n, 1, 1_000);
    outputs(&mut n);
    n.handle_input(Time(10), NodeInput::Delivered(RequestId(1)))
        .unwrap();
    n.handle_timeout(Time(1_000) + GRACE + Duration::from_secs(3600));
    assert!(
        ended(&outputs(&mut n)).is_empty(),
        "a delivered streaming call was failed at its deadline"
    );
    n.handle_input(Time(4_000_000), NodeInput::CallDone(RequestId(1)))
        .unwrap();
    assert_eq!(
        ended(&outputs(&mut n)),
        [(RequestId(1), Outcome::Delivered, None)]
    );

    // Remote: the serving kas said so; a refusal after that is the driver's bug, ignored.
    let mut n = node();
    route(&mut n, 2, 1_000);
    found_at(&mut n, &KasId("10.0.0.2:8155".into()));
    outputs(&mut n);
    n.handle_input(Time(3), NodeInput::Delivered(RequestId(2)))
        .unwrap();
    n.handle_input(Time(4), NodeInput::Bounced(RequestId(2)))
        .unwrap();
    let outs = outputs(&mut n);
    assert!(
        outs.iter()
            .any(|o| matches!(o, NodeOutput::Inconsistent(_))),
        "{outs:?}"
    );
    assert!(
        !outs.iter().any(|o| matches!(
            o,
            NodeOutput::Forward { .. } | NodeOutput::Deliver { .. } | NodeOutput::Ended { .. }
        )),
        "{outs:?}"
    );
    n.handle_timeout(Time(1_000) + GRACE);
    assert!(ended(&outputs(&mut n)).is_empty());
    // Its caller going away is the forward's to see: it ends the call.
    n.handle_input(Time(5_000), NodeInput::Cancel(RequestId(2)))
        .unwrap();
    assert!(
        ended(&outputs(&mut n)).is_empty(),
        "ended under its forward"
    );
    n.handle_input(Time(5_001), NodeInput::CallDone(RequestId(2)))
        .unwrap();
    assert_eq!(
        ended(&outputs(&mut n)),
        [(RequestId(2), Outcome::Delivered, None)]
    );
    // Reported for a call no tunnel or forward holds: a driver mistake.
    route(&mut n, 3, 1_000);
    let early = n.handle_input(Time(5_002), NodeInput::Delivered(RequestId(3)));
    assert!(
        matches!(early, Err(NodeError::DriverMistake(_))),
        "{early:?}"
    );
}

#[test]
fn a_tunnel_that_cannot_take_its_call_is_closed_and_the_call_offered_again() {
    let mut n = with_tunnel();
    route(&mut n, 1, 10_000);
    outputs(&mut n);
    let failed = NodeInput::DeliveryFailed {
        request: RequestId(1),
        tunnel: TUNNEL,
    };
    n.handle_input(Time(1), failed).unwrap();
    let outs = outputs(&mut n);
    assert!(
        outs.iter()
            .any(|o| matches!(o, NodeOutput::CloseTunnel(TUNNEL)))
    );
    assert!(
        ended(&outs).is_empty(),
        "the call is routed again, not ended"
    );
    assert_eq!(n.stats().tunnels, 0);
    // The tunnel task then reports its end, once; a second report is a driver mistake.
    n.handle_input(Time(2), NodeInput::TunnelClosed(TUNNEL))
        .unwrap();
    let again = n.handle_input(Time(3), NodeInput::TunnelClosed(TUNNEL));
    assert!(
        matches!(again, Err(NodeError::DriverMistake(_))),
        "{again:?}"
    );
}

#[test]
fn a_tunnel_on_a_connection_not_open_here_is_refused_and_changes_nothing() {
    let mut n = node();
    let opened = NodeInput::TunnelOpened {
        tunnel: TUNNEL,
        agent: AGENT,
        connection: CONN,
    };
    let result = n.handle_input(Time(0), opened);
    assert_eq!(
        result,
        Err(NodeError::ConnectionNotOpen {
            agent: AGENT,
            connection: CONN
        })
    );
    assert_eq!(n.stats(), NodeStats::default());
}

#[test]
fn a_connection_ending_closes_its_tunnels_and_fails_waiting_forwarded_calls_over() {
    let mut n = with_tunnel();
    let gone = NodeInput::AgentDisconnected {
        agent: AGENT,
        project: ProjectId(1),
        connection: CONN,
    };
    n.handle_input(Time(1), gone).unwrap();
    let outs = outputs(&mut n);
    assert!(
        outs.iter()
            .any(|o| matches!(o, NodeOutput::CloseTunnel(TUNNEL)))
    );
    n.handle_input(Time(2), NodeInput::TunnelClosed(TUNNEL))
        .unwrap();
    // A forwarded call for the agent is refused at once: the other kas may look elsewhere.
    let serve = NodeInput::Serve {
        request: RequestId(9),
        wanted: wanted(10_000),
        call: "forwarded",
    };
    n.handle_input(Time(3), serve).unwrap();
    let outs = outputs(&mut n);
    assert!(matches!(
        ended(&outs).as_slice(),
        [(_, Outcome::Refused, Some(CallError::NoFreeTunnel { .. }))]
    ));
}

#[test]
fn a_replica_with_two_streams_here_keeps_its_tunnels_until_the_last_one_ends() {
    let mut n = with_tunnel();
    // The replica reconnected here before its old stream ended (a move onto the same kas).
    let again = ConnectedAgentInfo {
        agent_id: AGENT.0,
        project_id: 1,
        connection_id: CONN.0,
        ..Default::default()
    };
    n.handle_input(Time(1), NodeInput::AgentConnected(Box::new(again)))
        .unwrap();
    let gone = || NodeInput::AgentDisconnected {
        agent: AGENT,
        project: ProjectId(1),
        connection: CONN,
    };
    n.handle_input(Time(2), gone()).unwrap();
    let outs = outputs(&mut n);
    assert!(
        !outs
            .iter()
            .any(|o| matches!(o, NodeOutput::CloseTunnel(_) | NodeOutput::Write(_))),
        "the old stream's end took the new one's tunnels or records: {outs:?}"
    );
    route(&mut n, 1, 10_000);
    assert_eq!(delivered(&outputs(&mut n)), [(RequestId(1), TUNNEL)]);
    n.handle_input(Time(3), gone()).unwrap();
    let outs = outputs(&mut n);
    assert!(
        outs.iter()
            .any(|o| matches!(o, NodeOutput::CloseTunnel(TUNNEL)))
    );
    assert_eq!(n.stats().connections, 0);
}

/// What a draining kas's tracker writes: (key, deleted fields, published event).
fn absence(outs: &[NodeOutput<&'static str>]) -> Vec<(String, Vec<String>, bool)> {
    outs.iter()
        .filter_map(|o| match o {
            NodeOutput::Write(batch) => Some(batch),
            _ => None,
        })
        .flat_map(|b| &b.writes)
        .filter(|w| w.key.contains(":agent:") && !w.publish.is_empty())
        .map(|w| {
            let last = w.publish.last().expect("an event with the write");
            let connected = TunnelEvent::decode(last.1.as_slice()).unwrap().connected;
            (w.key.clone(), w.delete.clone(), connected)
        })
        .collect()
}

#[test]
fn a_draining_kas_gives_no_new_call_to_its_tunnels_and_announces_it_has_none() {
    let mut n = with_tunnel();
    route(&mut n, 1, 10_000);
    assert_eq!(delivered(&outputs(&mut n)), [(RequestId(1), TUNNEL)]);
    // Waiting for the busy tunnel: one call from GitLab, one forwarded by another kas.
    route(&mut n, 2, 10_000);
    let serve = |request| NodeInput::Serve {
        request: RequestId(request),
        wanted: wanted(10_000),
        call: "forwarded",
    };
    n.handle_input(Time(0), serve(3)).unwrap();
    outputs(&mut n);
    n.handle_input(Time(1), NodeInput::Drain).unwrap();
    let outs = outputs(&mut n);
    // The forwarded one is refused (its kas looks elsewhere); the local one goes back to
    // the router, which looks the agent up instead of waiting here.
    assert!(matches!(
        ended(&outs).as_slice(),
        [(
            RequestId(3),
            Outcome::Refused,
            Some(CallError::NoFreeTunnel { .. })
        )]
    ));
    assert!(
        outs.iter()
            .any(|o| matches!(o, NodeOutput::Subscribe(_) | NodeOutput::Lookup { .. })),
        "the waiting call did not go back to the router: {outs:?}"
    );
    // The tunnel record is deleted, with a "gone" event, once the batches in flight are
    // done.
    let mut writes = absence(&outs);
    for batch in 0..3 {
        n.handle_input(Time(2), NodeInput::BatchDone { batch, ok: true })
            .unwrap();
        writes.extend(absence(&outputs(&mut n)));
    }
    assert_eq!(
        writes,
        [(
            "kas:agent:{agent:7}".to_string(),
            vec!["10.0.0.1:8155".to_string()],
            false
        )]
    );
    // The running call goes on and ends delivered; its tunnel takes nothing new.
    n.handle_input(Time(3), NodeInput::CallDone(RequestId(1)))
        .unwrap();
    let outs = outputs(&mut n);
    assert_eq!(ended(&outs), [(RequestId(1), Outcome::Delivered, None)]);
    assert!(delivered(&outs).is_empty(), "the freed tunnel took a call");
    n.handle_input(Time(4), serve(4)).unwrap();
    let outs = outputs(&mut n);
    assert!(delivered(&outs).is_empty());
    assert!(matches!(
        ended(&outs).as_slice(),
        [(RequestId(4), Outcome::Refused, Some(_))]
    ));
    // A tunnel opened now is not announced.
    let opened = NodeInput::TunnelOpened {
        tunnel: TunnelId(2),
        agent: AGENT,
        connection: CONN,
    };
    n.handle_input(Time(5), opened).unwrap();
    assert!(absence(&outputs(&mut n)).iter().all(|(_, _, c)| !c));
}

#[test]
fn a_call_refused_as_busy_elsewhere_ends_busy_not_unconnected() {
    let mut n = node();
    let other = KasId("10.0.0.2:8155".into());
    route(&mut n, 1, 2_000);
    found_at(&mut n, &other);
    let _ = outputs(&mut n);
    n.handle_input(Time(3), NodeInput::BouncedBusy(RequestId(1)))
        .unwrap();
    assert!(ended(&outputs(&mut n)).is_empty(), "refused: routed again");
    let mut ends = Vec::new();
    for t in (0..=10_000).step_by(100) {
        n.handle_timeout(Time(t));
        ends.extend(ended(&outputs(&mut n)));
    }
    assert!(
        matches!(
            ends.as_slice(),
            [(
                RequestId(1),
                Outcome::DeadlineExceeded,
                Some(CallError::TunnelsBusy { agent: AGENT })
            )]
        ),
        "{ends:?}"
    );
}
