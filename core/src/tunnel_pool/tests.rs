use super::*;

fn config() -> PoolConfig {
    PoolConfig {
        min_idle: 2,
        max: 4,
        idle_timeout: Duration::from_secs(10),
        retry: Backoff {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(8),
            factor: 2,
        },
    }
}

fn pool() -> TunnelPool {
    TunnelPool::new(config(), Rng::new(7))
}

fn drain(p: &mut TunnelPool) -> Vec<PoolOutput> {
    std::iter::from_fn(|| p.poll_output()).collect()
}

fn opens(out: &[PoolOutput]) -> Vec<Slot> {
    out.iter()
        .filter_map(|o| match o {
            PoolOutput::Open(s) => Some(*s),
            PoolOutput::Close(_) => None,
        })
        .collect()
}

/// A pool with its first `min_idle` tunnels open and idle since `now`.
fn warm(now: u64) -> TunnelPool {
    let mut p = pool();
    p.handle_timeout(Time(now));
    for s in opens(&drain(&mut p)) {
        p.handle_input(Time(now), PoolInput::Opened(s));
    }
    assert!(drain(&mut p).is_empty());
    p
}

#[test]
fn opens_the_idle_minimum_at_start() {
    let mut p = pool();
    p.handle_timeout(Time(0));
    assert_eq!(
        drain(&mut p),
        vec![PoolOutput::Open(Slot(0)), PoolOutput::Open(Slot(1))]
    );
    assert_eq!(p.counts(), (2, 0, 0));
    assert_eq!(p.poll_timeout(), None);
}

#[test]
fn grows_when_claimed_up_to_the_maximum() {
    let mut p = warm(0);
    p.handle_input(Time(1), PoolInput::Claimed(Slot(0)));
    assert_eq!(drain(&mut p), vec![PoolOutput::Open(Slot(2))]);
    p.handle_input(Time(1), PoolInput::Opened(Slot(2)));
    p.handle_input(Time(2), PoolInput::Claimed(Slot(1)));
    assert_eq!(drain(&mut p), vec![PoolOutput::Open(Slot(3))]);
    p.handle_input(Time(2), PoolInput::Opened(Slot(3)));
    p.handle_input(Time(3), PoolInput::Claimed(Slot(2)));
    p.handle_input(Time(3), PoolInput::Claimed(Slot(3)));
    assert!(drain(&mut p).is_empty(), "max 4 reached");
    assert_eq!(p.counts(), (0, 0, 4));
    p.handle_input(Time(4), PoolInput::Released(Slot(0)));
    assert!(drain(&mut p).is_empty());
}

#[test]
fn closes_surplus_idle_tunnels_after_the_idle_timeout_longest_idle_first() {
    let mut p = warm(0);
    p.handle_input(Time(0), PoolInput::Claimed(Slot(0)));
    p.handle_input(Time(0), PoolInput::Claimed(Slot(1)));
    for s in opens(&drain(&mut p)) {
        p.handle_input(Time(0), PoolInput::Opened(s));
    }
    p.handle_input(Time(1_000), PoolInput::Released(Slot(1)));
    p.handle_input(Time(2_000), PoolInput::Released(Slot(0)));
    assert_eq!(p.counts(), (0, 4, 0));
    // Slots 2 and 3 idle since 0, slot 1 since 1 s, slot 0 since 2 s.
    assert_eq!(p.poll_timeout(), Some(Time(10_000)));
    p.handle_timeout(Time(10_000));
    assert_eq!(
        drain(&mut p),
        vec![PoolOutput::Close(Slot(2)), PoolOutput::Close(Slot(3))]
    );
    assert_eq!(p.poll_timeout(), None, "back at the idle minimum");
    p.handle_input(
        Time(10_001),
        PoolInput::Ended {
            slot: Slot(2),
            failed: false,
        },
    );
    p.handle_input(
        Time(10_001),
        PoolInput::Ended {
            slot: Slot(3),
            failed: false,
        },
    );
    assert!(drain(&mut p).is_empty());
    assert_eq!(p.counts(), (0, 2, 0));
}

#[test]
fn failed_opens_back_off_one_probe_at_a_time() {
    let mut p = pool();
    p.handle_timeout(Time(0));
    assert_eq!(opens(&drain(&mut p)).len(), 2);
    p.handle_input(
        Time(1),
        PoolInput::Ended {
            slot: Slot(0),
            failed: true,
        },
    );
    assert!(drain(&mut p).is_empty(), "no reopen before the backoff");
    assert_eq!(p.poll_timeout(), None, "slot 1 is still being opened");
    p.handle_input(
        Time(2),
        PoolInput::Ended {
            slot: Slot(1),
            failed: true,
        },
    );
    assert!(drain(&mut p).is_empty());
    let delay = p.poll_timeout().expect("a retry is scheduled").0 - 2;
    assert!(
        (1_000..=2_000).contains(&delay),
        "second failure: {delay} ms, not in [1 s, 2 s]"
    );
    // The retry opens one probe only, although two tunnels are missing.
    let at = p.poll_timeout().unwrap();
    p.handle_timeout(at);
    let probe = opens(&drain(&mut p));
    assert_eq!(probe.len(), 1);
    p.handle_input(at, PoolInput::Opened(probe[0]));
    assert_eq!(
        opens(&drain(&mut p)).len(),
        1,
        "success: the rest open at once"
    );
    assert_eq!(p.poll_timeout(), None);
}

#[test]
fn open_tunnels_ending_together_reopen_after_the_first_step_not_a_grown_backoff() {
    let mut p = pool();
    p.handle_timeout(Time(0));
    let slots = opens(&drain(&mut p));
    for s in &slots {
        p.handle_input(Time(0), PoolInput::Opened(*s));
        p.handle_input(Time(0), PoolInput::Claimed(*s));
    }
    let more = opens(&drain(&mut p));
    assert_eq!(more.len(), 2, "two busy: two more idle ones open");
    for s in &more {
        p.handle_input(Time(0), PoolInput::Opened(*s));
    }
    // kas stalls past every heartbeat and closes all four at once.
    for s in slots.iter().chain(&more) {
        p.handle_input(
            Time(5_000),
            PoolInput::Ended {
                slot: *s,
                failed: true,
            },
        );
    }
    assert!(drain(&mut p).is_empty(), "no reopen before the delay");
    let at = p.poll_timeout().expect("a reopen is scheduled");
    assert!(
        (5_500..=6_000).contains(&at.0),
        "reopened at {} ms: the first step is 0.5-1 s, not four failures' growth",
        at.0
    );
    p.handle_timeout(at);
    assert_eq!(opens(&drain(&mut p)).len(), 2, "the idle minimum, at once");
}

#[test]
fn repeated_failures_never_open_faster_than_the_backoff() {
    let mut p = pool();
    let mut now = Time(0);
    let mut attempts = 0;
    while now < Time(60_000) {
        p.handle_timeout(now);
        for s in opens(&drain(&mut p)) {
            attempts += 1;
            p.handle_input(
                now,
                PoolInput::Ended {
                    slot: s,
                    failed: true,
                },
            );
        }
        now = p.poll_timeout().expect("always retrying");
    }
    // 1 + 2 + 4 + 8 + 8 ... seconds, halved at worst by jitter: at most about 16 attempts
    // in a minute, where a busy loop would make thousands.
    assert!(attempts <= 16, "{attempts} attempts in 60 s");
    assert!(attempts >= 7, "{attempts} attempts in 60 s");
}

#[test]
fn drain_closes_idle_now_and_busy_when_released() {
    let mut p = warm(0);
    p.handle_input(Time(1), PoolInput::Claimed(Slot(0)));
    let grown = opens(&drain(&mut p));
    p.handle_input(Time(2), PoolInput::Drain);
    assert_eq!(drain(&mut p), vec![PoolOutput::Close(Slot(1))]);
    // The tunnel still opening is closed once open; nothing new is opened.
    p.handle_input(Time(3), PoolInput::Opened(grown[0]));
    assert_eq!(drain(&mut p), vec![PoolOutput::Close(grown[0])]);
    p.handle_input(Time(4), PoolInput::Released(Slot(0)));
    assert_eq!(drain(&mut p), vec![PoolOutput::Close(Slot(0))]);
    assert!(!p.drained());
    for s in [Slot(0), Slot(1), grown[0]] {
        p.handle_input(
            Time(5),
            PoolInput::Ended {
                slot: s,
                failed: false,
            },
        );
    }
    assert!(p.drained());
    assert!(drain(&mut p).is_empty());
    assert_eq!(p.poll_timeout(), None);
}

#[test]
fn reports_for_unknown_slots_are_ignored() {
    let mut p = warm(0);
    p.handle_input(Time(1), PoolInput::Claimed(Slot(99)));
    p.handle_input(
        Time(1),
        PoolInput::Ended {
            slot: Slot(99),
            failed: true,
        },
    );
    assert!(drain(&mut p).is_empty());
    assert_eq!(p.counts(), (0, 2, 0));
    assert_eq!(p.poll_timeout(), None);
}
