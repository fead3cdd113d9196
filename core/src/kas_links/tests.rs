//! Which connections an agent dials, keeps, drains and closes.

use super::*;
use std::time::Duration;

fn links(want: usize) -> KasLinks {
    let backoff = Backoff {
        initial: Duration::from_millis(1000),
        max: Duration::from_secs(8),
        factor: 2,
    };
    KasLinks::new(LinksConfig { want, backoff }, 7)
}

fn outputs(l: &mut KasLinks) -> Vec<LinksOutput> {
    std::iter::from_fn(|| l.poll_output()).collect()
}

/// Fires the next timer; the time it fired at.
fn next(l: &mut KasLinks) -> Time {
    let at = l.poll_timeout().expect("a dial is due");
    l.handle_timeout(at);
    at
}

/// Two wanted, the first dial up at `kas-a` (of `live_kas` live kas), its outputs drained.
fn one_up(live_kas: u32) -> KasLinks {
    let mut l = links(2);
    l.handle_timeout(Time(0));
    outputs(&mut l);
    up(&mut l, Time(1), 0, "kas-a", live_kas);
    outputs(&mut l);
    l
}

fn ask(link: u64, stopping: bool) -> LinksInput {
    LinksInput::MoveAsked {
        link: Link(link),
        stopping,
    }
}

fn up(l: &mut KasLinks, now: Time, link: u64, kas: &str, live_kas: u32) {
    let kas = kas.to_string();
    let link = Link(link);
    l.handle_input(
        now,
        LinksInput::Up {
            link,
            kas,
            live_kas,
        },
    );
}

#[test]
fn dials_one_at_a_time_until_two_distinct_kas_and_closes_a_duplicate() {
    let mut l = links(2);
    l.handle_timeout(Time(0));
    assert_eq!(outputs(&mut l), [LinksOutput::Dial(Link(0))]);
    assert_eq!(l.poll_timeout(), None, "one dial at a time");
    up(&mut l, Time(10), 0, "kas-a", 3);
    assert_eq!(outputs(&mut l), [LinksOutput::Serve(Link(0))]);
    let second = next(&mut l);
    assert!(
        (Time(510)..=Time(1010)).contains(&second),
        "a short jittered pause before the next dial: {second:?}"
    );
    assert_eq!(outputs(&mut l), [LinksOutput::Dial(Link(1))]);
    // The load balancer sent it to the kas it holds already.
    up(&mut l, second, 1, "kas-a", 3);
    assert_eq!(outputs(&mut l), [LinksOutput::Close(Link(1))]);
    l.handle_input(second, LinksInput::Ended(Link(1)));
    let mut at = next(&mut l);
    assert_eq!(outputs(&mut l), [LinksOutput::Dial(Link(2))]);
    // Another duplicate waits as long again, jittered: the backoff does not grow.
    up(&mut l, at, 2, "kas-a", 3);
    assert_eq!(outputs(&mut l), [LinksOutput::Close(Link(2))]);
    let before = at;
    at = next(&mut l);
    assert!(
        (Duration::from_millis(500)..=Duration::from_millis(1000)).contains(&(at - before)),
        "{:?}",
        at - before
    );
    assert_eq!(outputs(&mut l), [LinksOutput::Dial(Link(3))]);
    up(&mut l, at, 3, "kas-b", 3);
    assert_eq!(outputs(&mut l), [LinksOutput::Serve(Link(3))]);
    assert_eq!(l.serving(), 2);
    assert_eq!(l.poll_timeout(), None, "enough: no more dials");
}

#[test]
fn holds_every_kas_when_fewer_are_live_than_wanted_and_dials_more_once_they_are() {
    let mut l = one_up(1);
    assert_eq!(l.poll_timeout(), None, "the only live kas is held");
    l.handle_input(Time(20_000), LinksInput::LiveKas(0));
    assert_eq!(l.poll_timeout(), None, "an unknown count changes nothing");
    // A keepalive counts a second kas (it started, or its records came back to Redis).
    l.handle_input(Time(30_000), LinksInput::LiveKas(2));
    assert_eq!(outputs(&mut l), [LinksOutput::Dial(Link(1))]);
    up(&mut l, Time(30_010), 1, "kas-b", 2);
    assert_eq!(outputs(&mut l), [LinksOutput::Serve(Link(1))]);
    assert_eq!(l.reachable_kas(), ["kas-a", "kas-b"]);
}

#[test]
fn a_connection_asked_to_move_serves_until_its_replacement_is_up_or_patience_ends() {
    let mut l = one_up(3);
    let at = next(&mut l);
    outputs(&mut l);
    up(&mut l, at, 1, "kas-b", 3);
    outputs(&mut l);
    assert_eq!(l.reachable_kas(), ["kas-a", "kas-b"]);
    // kas-a asks to move: it serves on, uncounted, while its replacement is dialled.
    l.handle_input(Time(5_000), ask(0, true));
    assert!(outputs(&mut l).is_empty(), "make before break");
    assert_eq!(l.serving(), 1);
    assert_eq!(l.reachable_kas(), ["kas-a", "kas-b"]);
    let at = next(&mut l);
    assert_eq!(outputs(&mut l), [LinksOutput::Dial(Link(2))]);
    // A dial refused (kas-a refuses while stopping) changes nothing.
    l.handle_input(at, LinksInput::Ended(Link(2)));
    assert!(outputs(&mut l).is_empty());
    let at = next(&mut l);
    assert_eq!(outputs(&mut l), [LinksOutput::Dial(Link(3))]);
    up(&mut l, at, 3, "kas-c", 3);
    assert_eq!(
        outputs(&mut l),
        [LinksOutput::Serve(Link(3)), LinksOutput::Drain(Link(0))]
    );
    l.handle_input(at, LinksInput::Ended(Link(0)));
    assert_eq!(l.reachable_kas(), ["kas-b", "kas-c"]);
    assert_eq!(l.poll_timeout(), None);
    // kas-b asks to move for age, then stops, and no replacement comes up: kas-c serves,
    // so kas-b is left once the patience since its stop is over, whatever the dials.
    l.handle_input(Time(15_000), ask(1, false));
    let asked = Time(20_000);
    l.handle_input(asked, ask(1, true));
    let mut drained = None;
    while drained.is_none() {
        let at = next(&mut l);
        for o in outputs(&mut l) {
            match o {
                LinksOutput::Dial(link) => l.handle_input(at, LinksInput::Ended(link)),
                LinksOutput::Drain(Link(1)) => drained = Some(at),
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    assert_eq!(drained, Some(asked + MOVE_PATIENCE));
    assert_eq!(l.reachable_kas(), ["kas-c"]);
}

#[test]
fn an_old_connection_serves_on_until_replaced_however_long_the_dials_take() {
    let mut l = one_up(3);
    let at = next(&mut l);
    outputs(&mut l);
    up(&mut l, at, 1, "kas-b", 3);
    outputs(&mut l);
    l.handle_input(Time(5_000), ask(0, false));
    // Its kas is healthy: no patience runs out, however many dials fail.
    for _ in 0..6 {
        let at = next(&mut l);
        let dials = outputs(&mut l);
        let [LinksOutput::Dial(link)] = dials[..] else {
            panic!("a dial, not {dials:?}");
        };
        l.handle_input(at, LinksInput::Ended(link));
    }
    assert_eq!(l.reachable_kas(), ["kas-a", "kas-b"]);
    let at = next(&mut l);
    let [LinksOutput::Dial(link)] = outputs(&mut l)[..] else {
        panic!("a dial");
    };
    up(&mut l, at, link.0, "kas-c", 3);
    assert_eq!(
        outputs(&mut l),
        [LinksOutput::Serve(link), LinksOutput::Drain(Link(0))]
    );
}

#[test]
fn an_old_connection_moves_onto_the_same_kas_when_it_is_the_only_one() {
    let mut l = one_up(1);
    outputs(&mut l);
    l.handle_input(Time(7_200_000), ask(0, false));
    // Make before break: not counted, but it serves on until its replacement is up.
    assert_eq!(l.serving(), 0);
    assert_eq!(l.reachable_kas(), ["kas-a"]);
    next(&mut l);
    assert_eq!(outputs(&mut l), [LinksOutput::Dial(Link(1))]);
    up(&mut l, Time(7_201_000), 1, "kas-a", 1);
    assert_eq!(
        outputs(&mut l),
        [LinksOutput::Serve(Link(1)), LinksOutput::Drain(Link(0))]
    );
}

#[test]
fn a_lost_connection_is_replaced_and_stop_drains_all_and_dials_no_more() {
    let mut l = one_up(3);
    let at = next(&mut l);
    outputs(&mut l);
    up(&mut l, at, 1, "kas-b", 3);
    assert_eq!(outputs(&mut l), [LinksOutput::Serve(Link(1))]);
    // kas-b was killed.
    l.handle_input(Time(9_000), LinksInput::Ended(Link(1)));
    assert!(l.poll_timeout().is_some_and(|t| t > Time(9_000)));
    next(&mut l);
    assert_eq!(outputs(&mut l), [LinksOutput::Dial(Link(2))]);
    outputs(&mut l);
    l.handle_input(Time(10_000), LinksInput::Stop);
    assert_eq!(
        outputs(&mut l),
        [LinksOutput::Drain(Link(0)), LinksOutput::Close(Link(2))]
    );
    // The dial lands after all: closed, not counted.
    up(&mut l, Time(10_001), 2, "kas-c", 3);
    assert!(outputs(&mut l).is_empty(), "already closing");
    assert_eq!(l.poll_timeout(), None);
    assert!(!l.done());
    l.handle_input(Time(10_002), LinksInput::Ended(Link(0)));
    l.handle_input(Time(10_003), LinksInput::Ended(Link(2)));
    assert!(l.done());
}

#[test]
fn duplicates_are_redrawn_at_the_first_step_and_failures_back_off_further() {
    let mut l = one_up(3);
    let mut link = 1;
    let mut now = next(&mut l);
    for _ in 0..6 {
        outputs(&mut l);
        up(&mut l, now, link, "kas-a", 3);
        link += 1;
        let at = next(&mut l);
        assert!(at - now <= Duration::from_secs(1), "{:?}", at - now);
        now = at;
    }
    // Dials that fail grow to the backoff's cap (8 s here).
    let mut longest = Duration::ZERO;
    for _ in 0..6 {
        outputs(&mut l);
        l.handle_input(now, LinksInput::Ended(Link(link)));
        link += 1;
        let at = next(&mut l);
        longest = longest.max(at - now);
        now = at;
    }
    assert!(longest >= Duration::from_secs(4), "{longest:?}");
}

#[test]
fn a_dial_a_stopping_kas_declined_is_redrawn_soon_not_backed_off() {
    let mut l = one_up(3);
    let mut now = next(&mut l);
    for link in 1..=6 {
        outputs(&mut l);
        l.handle_input(now, LinksInput::Declined(Link(link)));
        assert_eq!(l.poll_timeout(), None, "one dial at a time: its end is due");
        l.handle_input(now, LinksInput::Ended(Link(link)));
        let at = next(&mut l);
        assert!(at - now <= Duration::from_secs(1), "{:?}", at - now);
        now = at;
    }
}
