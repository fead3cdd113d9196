use super::*;

const A: AgentId = AgentId(1);
const B: AgentId = AgentId(2);
const C1: ConnectionId = ConnectionId(11);
const C2: ConnectionId = ConnectionId(12);

fn registry() -> TunnelRegistry {
    TunnelRegistry::new(RegistryConfig {
        heartbeat_timeout: Duration::from_millis(100),
        tunnels_per_connection: 8,
    })
}

fn drain(r: &mut TunnelRegistry) -> Vec<RegistryOutput> {
    r.check_invariants().unwrap();
    std::iter::from_fn(|| r.poll_output()).collect()
}

fn open(r: &mut TunnelRegistry, now: u64, t: u64, agent: AgentId, c: ConnectionId) {
    open_at(r, now, t, (agent, c), 0);
}

/// Opens tunnel `t` of a connection whose replica says it opens at most `max`.
fn open_with_max(r: &mut TunnelRegistry, t: u64, agent: AgentId, c: ConnectionId, max: usize) {
    open_at(r, 0, t, (agent, c), max);
}

fn open_at(r: &mut TunnelRegistry, now: u64, t: u64, (agent, c): ConnKey, max: usize) {
    let opened = RegistryInput::TunnelOpened {
        tunnel: TunnelId(t),
        agent,
        connection: c,
        max_tunnels: max,
    };
    r.handle_input(Time(now), opened).unwrap();
}

fn request(r: &mut TunnelRegistry, now: u64, id: u64, agent: AgentId, c: Option<ConnectionId>) {
    held_request(r, now, id, agent, c, None);
}

fn held_request(
    r: &mut TunnelRegistry,
    now: u64,
    id: u64,
    agent: AgentId,
    c: Option<ConnectionId>,
    holder: Option<Holder>,
) {
    r.handle_input(
        Time(now),
        RegistryInput::Request {
            request: RequestId(id),
            agent,
            connection: c,
            deadline: Time(now + 50),
            since: Time(now),
            holder,
        },
    )
    .unwrap();
}

fn release(r: &mut TunnelRegistry, now: u64, id: u64) {
    r.handle_input(
        Time(now),
        RegistryInput::Release {
            request: RequestId(id),
        },
    )
    .unwrap();
}

/// The call matched, when a tunnel was matched to one call and nothing else happened.
fn matched_request(r: &mut TunnelRegistry) -> Option<u64> {
    match drain(r)[..] {
        [RegistryOutput::Matched { request, .. }] => Some(request.0),
        _ => None,
    }
}

fn matched(request: u64, tunnel: u64) -> RegistryOutput {
    RegistryOutput::Matched {
        request: RequestId(request),
        tunnel: TunnelId(tunnel),
    }
}

#[test]
fn idle_tunnel_is_claimed_at_once_and_presence_is_announced() {
    let mut r = registry();
    open(&mut r, 0, 1, A, C1);
    request(&mut r, 0, 7, A, None);
    assert_eq!(
        drain(&mut r),
        vec![
            RegistryOutput::AgentPresence {
                agent: A,
                present: true
            },
            matched(7, 1)
        ]
    );
}

#[test]
fn no_tunnel_of_agent_or_connection_is_refused_at_once() {
    let mut r = registry();
    open(&mut r, 0, 1, A, C1);
    drain(&mut r);
    request(&mut r, 0, 7, B, None);
    request(&mut r, 0, 8, A, Some(C2));
    assert_eq!(
        drain(&mut r),
        vec![
            RegistryOutput::NoTunnel {
                request: RequestId(7)
            },
            RegistryOutput::NoTunnel {
                request: RequestId(8)
            }
        ]
    );
}

#[test]
fn busy_agent_waiters_are_served_fifo_on_release() {
    let mut r = registry();
    open(&mut r, 0, 1, A, C1);
    request(&mut r, 0, 1, A, None);
    request(&mut r, 1, 2, A, None);
    request(&mut r, 2, 3, A, Some(C1));
    request(&mut r, 3, 4, A, None);
    drain(&mut r);
    assert_eq!(r.waiter_count(), 3);
    for (released, next) in [(1, 2), (2, 3), (3, 4)] {
        release(&mut r, 5, released);
        assert_eq!(drain(&mut r), vec![matched(next, 1)]);
    }
}

/// A call whose patience here ran out looks elsewhere and may come back: it waits again
/// in the place of its first ask, so calls arriving meanwhile (an agent saturated by
/// short calls) do not push it back for ever (swarm seed 4568: a probe's call starved
/// through kas0's one busy tunnel until its deadline).
#[test]
fn a_call_that_asks_again_keeps_the_place_of_its_first_ask() {
    let mut r = registry();
    open(&mut r, 0, 1, A, C1);
    request(&mut r, 0, 1, A, None);
    request(&mut r, 1, 2, A, None);
    release(&mut r, 2, 2);
    request(&mut r, 3, 3, A, None);
    let again = RegistryInput::Request {
        request: RequestId(2),
        agent: A,
        connection: None,
        deadline: Time(60),
        since: Time(1),
        holder: None,
    };
    r.handle_input(Time(4), again).unwrap();
    drain(&mut r);
    release(&mut r, 5, 1);
    assert_eq!(
        drain(&mut r),
        vec![matched(2, 1)],
        "first asked at 1, before 3"
    );
    release(&mut r, 6, 2);
    assert_eq!(drain(&mut r), vec![matched(3, 1)]);
}

#[test]
fn connection_waiter_takes_only_its_connection() {
    let mut r = registry();
    open(&mut r, 0, 1, A, C1);
    open(&mut r, 0, 2, A, C2);
    request(&mut r, 0, 1, A, Some(C1));
    request(&mut r, 0, 2, A, Some(C1));
    drain(&mut r);
    request(&mut r, 0, 3, A, None);
    assert_eq!(
        drain(&mut r),
        vec![matched(3, 2)],
        "any-connection call takes C2"
    );
    release(&mut r, 1, 3);
    assert_eq!(
        drain(&mut r),
        vec![],
        "C2 goes idle: request 2 wants C1 only"
    );
    release(&mut r, 1, 1);
    assert_eq!(drain(&mut r), vec![matched(2, 1)]);
}

#[test]
fn waiters_expire_at_their_deadline() {
    let mut r = registry();
    open(&mut r, 0, 1, A, C1);
    request(&mut r, 0, 1, A, None);
    request(&mut r, 0, 2, A, None);
    drain(&mut r);
    assert_eq!(r.poll_timeout(), Some(Time(50)));
    r.handle_timeout(Time(49));
    assert_eq!(drain(&mut r), vec![]);
    r.handle_timeout(Time(50));
    assert_eq!(
        drain(&mut r),
        vec![RegistryOutput::WaitExpired {
            request: RequestId(2)
        }]
    );
    assert_eq!(r.waiter_count(), 0);
}

#[test]
fn silent_tunnels_close_and_active_ones_stay() {
    let mut r = registry();
    open(&mut r, 0, 1, A, C1);
    open(&mut r, 0, 2, A, C1);
    request(&mut r, 0, 9, A, None);
    drain(&mut r);
    r.handle_input(
        Time(80),
        RegistryInput::TunnelActivity {
            tunnel: TunnelId(1),
        },
    )
    .unwrap();
    r.handle_timeout(Time(100));
    let out = drain(&mut r);
    // Tunnel 2 was claimed by request 9 (LIFO among idle tunnels) and went silent.
    assert_eq!(
        out,
        vec![RegistryOutput::CloseTunnel {
            tunnel: TunnelId(2),
            request: Some(RequestId(9))
        }]
    );
    r.handle_timeout(Time(180));
    assert_eq!(
        drain(&mut r),
        vec![
            RegistryOutput::AgentPresence {
                agent: A,
                present: false
            },
            RegistryOutput::CloseTunnel {
                tunnel: TunnelId(1),
                request: None
            }
        ]
    );
    assert_eq!(r.tunnel_count(), 0);
}

#[test]
fn losing_the_last_tunnel_refuses_its_waiters() {
    let mut r = registry();
    open(&mut r, 0, 1, A, C1);
    request(&mut r, 0, 1, A, None);
    request(&mut r, 0, 2, A, None);
    drain(&mut r);
    r.handle_input(
        Time(1),
        RegistryInput::TunnelClosed {
            tunnel: TunnelId(1),
        },
    )
    .unwrap();
    assert_eq!(
        drain(&mut r),
        vec![
            RegistryOutput::AgentPresence {
                agent: A,
                present: false
            },
            RegistryOutput::NoTunnel {
                request: RequestId(2)
            }
        ]
    );
    assert_eq!(r.claimed_count(), 0);
}

#[test]
fn driver_mistakes_are_errors_not_panics() {
    let mut r = registry();
    open(&mut r, 0, 1, A, C1);
    let dup = RegistryInput::TunnelOpened {
        tunnel: TunnelId(1),
        agent: A,
        connection: C1,
        max_tunnels: 0,
    };
    assert_eq!(
        r.handle_input(Time(0), dup),
        Err(RegistryError::DuplicateTunnel(TunnelId(1)))
    );
    let unknown = RegistryInput::TunnelClosed {
        tunnel: TunnelId(5),
    };
    assert_eq!(
        r.handle_input(Time(0), unknown),
        Err(RegistryError::UnknownTunnel(TunnelId(5)))
    );
    request(&mut r, 0, 3, A, None);
    let again = RegistryInput::Request {
        request: RequestId(3),
        agent: A,
        connection: None,
        deadline: Time(9),
        since: Time(0),
        holder: None,
    };
    assert_eq!(
        r.handle_input(Time(0), again),
        Err(RegistryError::DuplicateRequest(RequestId(3)))
    );
    r.check_invariants().unwrap();
}

#[test]
fn holds_a_hundred_thousand_tunnels() {
    let mut r = registry();
    for t in 0..100_000u64 {
        open(
            &mut r,
            0,
            t,
            AgentId((t % 10_000) as i64),
            ConnectionId(t as i64 % 3),
        );
    }
    for id in 0..100_000u64 {
        request(&mut r, 1, id, AgentId((id % 10_000) as i64), None);
    }
    let matches = std::iter::from_fn(|| r.poll_output())
        .filter(|o| matches!(o, RegistryOutput::Matched { .. }))
        .count();
    assert_eq!(matches, 100_000);
    for id in 0..100_000u64 {
        release(&mut r, 2, id);
    }
    assert_eq!((r.claimed_count(), r.tunnel_count()), (0, 100_000));
    r.check_invariants().unwrap();
}

#[test]
fn a_holder_keeps_a_quarter_of_the_tunnels_and_the_last_free_one_for_others() {
    let (alice, bob, carol) = (Some(Holder(1)), Some(Holder(2)), Some(Holder(3)));
    let mut r = registry();
    for t in 1..=8 {
        open(&mut r, 0, t, A, C1);
    }
    drain(&mut r);
    // Alice takes six of eight (all but a quarter); her seventh call waits.
    for id in 1..=7 {
        held_request(&mut r, 0, id, A, None, alice);
    }
    let out = drain(&mut r);
    assert_eq!(out.len(), 6, "{out:?}");
    assert_eq!(r.waiter_count(), 1);
    // Bob takes one; with one idle left, he holds some, so he waits for it...
    held_request(&mut r, 0, 20, A, None, bob);
    held_request(&mut r, 0, 21, A, None, bob);
    assert_eq!(drain(&mut r).len(), 1);
    // ...which goes to Carol, who holds none, or to GitLab, whose calls are not counted.
    held_request(&mut r, 0, 30, A, None, carol);
    assert_eq!(matched_request(&mut r), Some(30));
    request(&mut r, 0, 40, A, None);
    assert_eq!(drain(&mut r), []);
    // Alice ends a call: the last free tunnel goes to GitLab's call, not to Alice's or
    // Bob's waiters (both hold some).
    release(&mut r, 1, 1);
    assert_eq!(matched_request(&mut r), Some(40));
    release(&mut r, 1, 40);
    assert_eq!(drain(&mut r), []);
    // With two free, the oldest waiter that may take one does: Alice's, under her share.
    release(&mut r, 1, 30);
    assert_eq!(matched_request(&mut r), Some(7));
    // Bob's last call ends: holding none now, his waiter takes the tunnel back.
    release(&mut r, 1, 20);
    assert_eq!(matched_request(&mut r), Some(21));
    // Waiters over their share expire at their deadline as any busy call does.
    held_request(&mut r, 2, 8, A, None, alice);
    r.handle_timeout(Time(60));
    let expired: Vec<_> = drain(&mut r);
    assert!(
        expired.contains(&RegistryOutput::WaitExpired {
            request: RequestId(8)
        }),
        "{expired:?}"
    );
}

#[test]
fn the_share_is_all_but_a_quarter_and_at_least_one() {
    let shares: Vec<usize> = [1, 2, 3, 4, 8, 100].into_iter().map(share).collect();
    assert_eq!(shares, [0, 1, 2, 3, 6, 75]);
    // An agent with a single tunnel here keeps it for GitLab's calls: a holder waits.
    let mut r = registry();
    open_with_max(&mut r, 1, A, C1, 1);
    drain(&mut r);
    held_request(&mut r, 0, 1, A, Some(C1), Some(Holder(1)));
    assert_eq!(drain(&mut r), []);
    request(&mut r, 0, 2, A, None);
    assert_eq!(matched_request(&mut r), Some(2));
}

#[test]
fn the_share_divides_what_the_replicas_pools_may_open_not_kas_limit() {
    // kas allows 8 a connection; the replica's pool stops at 2, so one caller may hold one
    // of them, not both (seed 406 of `kas-crash-ha`: a watch held a one-tunnel agent's
    // only tunnel and GitLab's calls waited out their deadlines).
    let mut r = registry();
    open_with_max(&mut r, 1, A, C1, 2);
    open_with_max(&mut r, 2, A, C1, 2);
    drain(&mut r);
    held_request(&mut r, 0, 1, A, None, Some(Holder(1)));
    assert_eq!(matched_request(&mut r), Some(1));
    held_request(&mut r, 0, 2, A, None, Some(Holder(1)));
    assert_eq!(drain(&mut r), []);
    // A second replica's connection adds its own maximum: now 2 + 8 = 10, a share of 8.
    open(&mut r, 0, 3, A, C2);
    assert_eq!(matched_request(&mut r), Some(2));
    // When that connection's last tunnel goes, the share is back to 1 of 2.
    release(&mut r, 1, 2);
    let closed = RegistryInput::TunnelClosed {
        tunnel: TunnelId(3),
    };
    r.handle_input(Time(1), closed).unwrap();
    drain(&mut r);
    held_request(&mut r, 1, 3, A, None, Some(Holder(1)));
    assert_eq!(drain(&mut r), []);
    // An agent that claims more than kas allows gets kas's limit.
    open_with_max(&mut r, 4, B, C1, 1_000);
    for id in 10..=15 {
        held_request(&mut r, 1, id, B, None, Some(Holder(1)));
        open_with_max(&mut r, 100 + id, B, C1, 1_000);
    }
    assert_eq!(r.claimed_count(), 1 + 6);
    held_request(&mut r, 1, 16, B, None, Some(Holder(1)));
    assert_eq!(r.claimed_count(), 1 + 6);
}

#[test]
fn a_holder_is_not_held_back_while_the_agent_can_open_more_tunnels() {
    // agentk keeps two tunnels idle and opens one as each is taken: the share counts what
    // the connection may open (100 here), not the few open now.
    let mut r = TunnelRegistry::new(RegistryConfig {
        heartbeat_timeout: Duration::from_secs(3600),
        tunnels_per_connection: 100,
    });
    open(&mut r, 0, 1, A, C1);
    open(&mut r, 0, 2, A, C1);
    drain(&mut r);
    for id in 1..=20 {
        held_request(&mut r, 0, id, A, None, Some(Holder(1)));
        assert_eq!(matched_request(&mut r), Some(id), "call {id}");
        open(&mut r, 0, 100 + id, A, C1);
    }
}
