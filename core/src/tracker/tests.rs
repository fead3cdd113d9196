use super::*;

const TTL: Duration = Duration::from_millis(300);
/// A renewed key's lifetime: the ttl and 2.5 refresh periods.
const KEY_TTL: Duration = Duration::from_millis(900);
/// A project's connection records: the ttl and 2 refresh periods.
const LISTING_TTL: Duration = Duration::from_millis(780);
/// A renewed project key's lifetime: its records' and 2.5 of their 3-period intervals.
const LISTING_KEY_TTL: Duration = Duration::from_millis(780 + 1800);
const PROJECT: &str = "kas:conn_by_project:{project:100}";

fn config() -> TrackerConfig {
    TrackerConfig {
        ttl: TTL,
        refresh: Duration::from_millis(240),
        gc: Duration::from_millis(600),
        // As long as the ttl: no heartbeats of its own (see the liveness test).
        liveness: TTL,
        backoff: Backoff {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(80),
            factor: 2,
        },
        max_keys_per_batch: 100,
    }
}

fn tracker() -> Tracker {
    let info = KasInstanceInfo {
        version: "v1".into(),
        ..Default::default()
    };
    Tracker::new(
        Time(0),
        config(),
        Keys::new("kas"),
        KasId("k1:1".into()),
        &info,
        1,
    )
}

fn next_batch(t: &mut Tracker) -> Batch {
    loop {
        match t.poll_output() {
            Some(TrackerOutput::Write(b)) => return b,
            Some(_) => {}
            None => panic!("no batch"),
        }
    }
}

fn ack(t: &mut Tracker, now: u64, b: &Batch, ok: bool) {
    t.handle_input(Time(now), TrackerInput::BatchResult { batch: b.id, ok });
}

fn info(agent: i64, conn: i64) -> ConnectedAgentInfo {
    ConnectedAgentInfo {
        agent_id: agent,
        project_id: 100,
        connection_id: conn,
        ..Default::default()
    }
}

fn keys_of(b: &Batch) -> Vec<&str> {
    b.writes.iter().map(|w| w.key.as_str()).collect()
}

#[test]
fn registers_the_instance_at_start_with_ttl() {
    let mut t = tracker();
    let b = next_batch(&mut t);
    assert_eq!(keys_of(&b), vec!["kas:kas_instances"]);
    let w = &b.writes[0];
    assert_eq!(w.expire, KeyExpiry::Renew(KEY_TTL));
    let (expires_at, payload) = expiring::decode(&w.set[0].1).unwrap();
    assert_eq!(expires_at, Time(300));
    assert_eq!(
        KasInstanceInfo::decode(payload.as_slice()).unwrap().version,
        "v1"
    );
}

#[test]
fn connection_writes_both_indexes_and_changes_wait_for_the_batch_in_flight() {
    let mut t = tracker();
    let first = next_batch(&mut t);
    t.handle_input(Time(1), TrackerInput::AgentConnected(Box::new(info(7, 70))));
    assert!(t.poll_output().is_none(), "one batch in flight at a time");
    ack(&mut t, 2, &first, true);
    let b = next_batch(&mut t);
    assert_eq!(
        keys_of(&b),
        vec!["kas:agent:{agent:7}", "kas:conn_by_project:{project:100}"]
    );
    assert_eq!(
        b.writes[0].set[0].0, "70@k1:1",
        "one record per replica and kas"
    );
    ack(&mut t, 3, &b, true);
    t.handle_input(
        Time(4),
        TrackerInput::AgentDisconnected {
            agent: AgentId(7),
            project: ProjectId(100),
            connection: ConnectionId(70),
        },
    );
    let b = next_batch(&mut t);
    assert!(
        b.writes
            .iter()
            .all(|w| w.delete == vec!["70@k1:1".to_string()] && w.set.is_empty())
    );
    assert!(b.writes.iter().all(|w| w.expire == KeyExpiry::Keep));
    ack(&mut t, 5, &b, true);
    assert_eq!(t.desired().len(), 1, "only the instance record remains");
}

/// The key of agent 3, whose tunnels [`presence_batch`] records.
const AGENT_3: &str = "kas:agent:{agent:3}";

/// A tracker whose instance record is written, and the batch (at 1, not yet answered) that
/// records whether this kas holds tunnels of agent 3.
fn presence_batch(present: bool) -> (Tracker, Batch) {
    let mut t = tracker();
    let first = next_batch(&mut t);
    ack(&mut t, 0, &first, true);
    t.handle_input(
        Time(1),
        TrackerInput::TunnelPresence {
            agent: AgentId(3),
            present,
        },
    );
    let b = next_batch(&mut t);
    (t, b)
}

#[test]
fn tunnel_presence_publishes_with_its_write() {
    let (_, b) = presence_batch(true);
    let w = &b.writes[0];
    assert_eq!(w.key, AGENT_3);
    assert_eq!(w.set[0].0, "k1:1");
    assert_eq!(w.publish.len(), 1);
    let event = TunnelEvent::decode(w.publish[0].1.as_slice()).unwrap();
    assert_eq!(
        (event.agent_id, event.kas_id.as_str(), event.connected),
        (3, "k1:1", true)
    );
}

#[test]
fn refresh_announces_a_tunnel_record_only_if_it_was_missing() {
    let (mut t, b) = presence_batch(true);
    assert!(
        b.writes[0].announce.is_empty(),
        "the explicit event says it"
    );
    ack(&mut t, 2, &b, true);
    t.handle_timeout(Time(240));
    let refresh = next_batch(&mut t);
    let w = refresh.writes.iter().find(|w| w.key == AGENT_3).unwrap();
    assert!(w.publish.is_empty());
    assert_eq!(w.announce.len(), 1);
    let event = TunnelEvent::decode(w.announce[0].1.as_slice()).unwrap();
    assert!(event.connected);
    ack(&mut t, 241, &refresh, true);
    t.handle_input(
        Time(242),
        TrackerInput::TunnelPresence {
            agent: AgentId(3),
            present: false,
        },
    );
    let gone = next_batch(&mut t);
    assert!(gone.writes[0].announce.is_empty());
}

#[test]
fn a_tunnel_record_rewritten_after_it_expired_is_announced_whatever_the_key_holds() {
    // The key outlives its fields: one whose writes failed past their expiry may still
    // hold them, so a `set` would create nothing, yet readers have seen the record gone.
    let (mut t, b) = presence_batch(true);
    ack(&mut t, 2, &b, true);
    t.handle_timeout(Time(240));
    let mut now = 240;
    loop {
        let b = next_batch(&mut t);
        let w = b.writes.iter().find(|w| w.key == AGENT_3).unwrap();
        let (explicit, conditional) = (w.publish.len(), w.announce.len());
        if now < 301 {
            assert_eq!((explicit, conditional), (0, 1), "at {now}: fields live");
        } else {
            assert_eq!((explicit, conditional), (1, 0), "at {now}: fields expired");
            let event = TunnelEvent::decode(w.publish[0].1.as_slice()).unwrap();
            assert!(event.connected);
            break;
        }
        ack(&mut t, now, &b, false);
        now = t.poll_timeout().unwrap().0;
        t.handle_timeout(Time(now));
    }
}

#[test]
fn a_refresh_answered_after_its_fields_expired_announces_them_again() {
    // Sent while the fields lived (their announcement conditional), answered after they
    // expired: it may have landed after, reviving them without creating them.
    for (answered, announced) in [(300, false), (301, true)] {
        let (mut t, b) = presence_batch(true);
        ack(&mut t, 2, &b, true);
        t.handle_timeout(Time(240));
        let refresh = next_batch(&mut t);
        let w = refresh.writes.iter().find(|w| w.key == AGENT_3).unwrap();
        assert_eq!((w.publish.len(), w.announce.len()), (0, 1));
        ack(&mut t, answered, &refresh, true);
        let again = std::iter::from_fn(|| t.poll_output()).find_map(|o| match o {
            TrackerOutput::Write(b) => b.writes.into_iter().find(|w| w.key == AGENT_3),
            _ => None,
        });
        assert_eq!(again.is_some(), announced, "answered at {answered}");
        if let Some(w) = again {
            let event = TunnelEvent::decode(w.publish[0].1.as_slice()).unwrap();
            assert_eq!((event.agent_id, event.connected), (3, true));
        }
    }
}

#[test]
fn failed_batch_is_retried_after_backoff_with_its_deletes_and_events() {
    let (mut t, b) = presence_batch(false);
    ack(&mut t, 2, &b, false);
    assert!(t.poll_output().is_none());
    let retry = t.poll_timeout().unwrap();
    assert!(
        retry >= Time(7) && retry <= Time(12),
        "backoff 10ms jittered: {retry:?}"
    );
    t.handle_timeout(retry);
    let again = next_batch(&mut t);
    assert_eq!(again.writes, b.writes, "same deletes and publish again");
}

#[test]
fn liveness_is_a_short_lived_instance_record_rewritten_every_third_of_it() {
    let mut t = short_liveness();
    let first = next_batch(&mut t);
    assert_eq!(
        first.writes[0].expire,
        KeyExpiry::Renew(Duration::from_millis(90 + 600))
    );
    t.handle_input(Time(1), TrackerInput::AgentConnected(Box::new(info(7, 70))));
    ack(&mut t, 1, &first, true);
    let b = next_batch(&mut t);
    ack(&mut t, 2, &b, true);
    for w in &b.writes {
        let ttl = if w.key == PROJECT {
            LISTING_KEY_TTL
        } else {
            KEY_TTL
        };
        assert_eq!(
            w.expire,
            KeyExpiry::Renew(ttl),
            "{}: agent records keep the ttl",
            w.key
        );
    }
    assert_eq!(t.poll_timeout(), Some(Time(30)));
    for at in [30, 60, 90] {
        t.handle_timeout(Time(at));
        let beat = next_batch(&mut t);
        assert_eq!(keys_of(&beat), vec!["kas:kas_instances"], "at {at}");
        assert_eq!(
            expiring::decode(&beat.writes[0].set[0].1).unwrap().0,
            Time(at + 90)
        );
        ack(&mut t, at, &beat, true);
    }
}

/// A tracker whose liveness is 90 ms (a heartbeat every 30).
fn short_liveness() -> Tracker {
    Tracker::new(
        Time(0),
        TrackerConfig {
            liveness: Duration::from_millis(90),
            ..config()
        },
        Keys::new("kas"),
        KasId("k1:1".into()),
        &KasInstanceInfo::default(),
        1,
    )
}

/// A batch of agent 7's records sent at 2 and not answered, and the instance record's
/// heartbeat at 30 sent alone beside it: (tracker, that batch, the heartbeat's).
fn beat_beside_a_slow_batch() -> (Tracker, Batch, Batch) {
    let mut t = short_liveness();
    let first = next_batch(&mut t);
    ack(&mut t, 1, &first, true);
    t.handle_input(Time(2), TrackerInput::AgentConnected(Box::new(info(7, 70))));
    let slow = next_batch(&mut t);
    assert!(!keys_of(&slow).contains(&"kas:kas_instances"));
    t.handle_timeout(Time(30));
    let beat = next_batch(&mut t);
    assert_eq!(keys_of(&beat), vec!["kas:kas_instances"]);
    (t, slow, beat)
}

/// The instance record does not wait behind a slow batch: it goes alone beside it, and
/// the next batch leaves it out while that write is out (`partition` seed 1706: a batch
/// slowed 1.5 s let a 2 s liveness lapse).
#[test]
fn the_liveness_goes_alone_beside_a_slow_batch() {
    let (mut t, slow, beat) = beat_beside_a_slow_batch();
    // Due again while that write is out: the next batch leaves it out.
    t.handle_input(
        Time(31),
        TrackerInput::AgentConnected(Box::new(info(8, 80))),
    );
    t.handle_timeout(Time(60));
    ack(&mut t, 61, &slow, true);
    let next = next_batch(&mut t);
    assert!(!keys_of(&next).is_empty());
    assert!(!keys_of(&next).contains(&"kas:kas_instances"), "{next:?}");
    // Its answer frees the record, which goes alone again beside the batch out.
    ack(&mut t, 62, &beat, true);
    let again = next_batch(&mut t);
    assert_eq!(keys_of(&again), vec!["kas:kas_instances"]);
    assert_eq!(
        expiring::decode(&again.writes[0].set[0].1).unwrap().0,
        Time(62 + 90)
    );
}

/// A failed write of the record alone is retried beside the slow batch, and its retry's
/// time does not stay due (a timer in the past once spun a simulated kas forever).
#[test]
fn a_failed_liveness_write_beside_a_slow_batch_is_retried_once_due() {
    let (mut t, _slow, beat) = beat_beside_a_slow_batch();
    ack(&mut t, 31, &beat, false);
    let retry = t.poll_timeout().expect("a retry");
    assert!(retry > Time(31) && retry < Time(60), "{retry:?}");
    t.handle_timeout(retry);
    let again = next_batch(&mut t);
    assert_eq!(keys_of(&again), vec!["kas:kas_instances"]);
    assert!(
        t.poll_timeout().is_some_and(|at| at > retry),
        "a timer in the past"
    );
}

#[test]
fn refresh_rewrites_what_routing_reads_and_a_project_s_connections_every_third_period() {
    let mut t = tracker();
    let first = next_batch(&mut t);
    t.handle_input(Time(1), TrackerInput::AgentConnected(Box::new(info(7, 70))));
    ack(&mut t, 1, &first, true);
    let b = next_batch(&mut t);
    let project = b.writes.iter().find(|w| w.key == PROJECT).expect("written");
    assert_eq!(
        expiring::decode(&project.set[0].1).unwrap().0,
        Time(1) + LISTING_TTL
    );
    ack(&mut t, 2, &b, true);
    assert_eq!(t.poll_timeout(), Some(Time(240)));
    let routing = ["kas:agent:{agent:7}", "kas:kas_instances"];
    for at in [240, 480, 720, 960, 1200, 1440] {
        t.handle_timeout(Time(at));
        let refresh = next_batch(&mut t);
        let mut keys = routing.to_vec();
        if at % 720 == 0 {
            keys.insert(1, PROJECT);
        }
        assert_eq!(keys_of(&refresh), keys, "at {at}");
        for w in &refresh.writes {
            let ttl = if w.key == PROJECT { LISTING_TTL } else { TTL };
            assert_eq!(expiring::decode(&w.set[0].1).unwrap().0, Time(at) + ttl);
        }
        ack(&mut t, at, &refresh, true);
    }
    // A change is written at once, and counts as the project's rewrite.
    t.handle_input(
        Time(1500),
        TrackerInput::AgentConnected(Box::new(info(8, 80))),
    );
    let b = next_batch(&mut t);
    assert_eq!(keys_of(&b), ["kas:agent:{agent:8}", PROJECT]);
    ack(&mut t, 1500, &b, true);
    t.handle_timeout(Time(1680));
    assert!(!keys_of(&next_batch(&mut t)).contains(&PROJECT));
}

#[test]
fn a_project_key_is_renewed_every_third_write_of_its_records() {
    let mut t = tracker();
    let first = next_batch(&mut t);
    ack(&mut t, 0, &first, true);
    t.handle_input(Time(0), TrackerInput::AgentConnected(Box::new(info(7, 70))));
    let mut expiries = Vec::new();
    for at in (0..=2880).step_by(240) {
        if at > 0 {
            t.handle_timeout(Time(at));
        }
        let b = next_batch(&mut t);
        if let Some(w) = b.writes.iter().find(|w| w.key == PROJECT) {
            expiries.push((at, w.expire));
        }
        ack(&mut t, at, &b, true);
    }
    // Renewed at 0 until 2580: it covers the records written until 1800.
    let renew = KeyExpiry::Renew(LISTING_KEY_TTL);
    let keep = KeyExpiry::IfCreated(LISTING_KEY_TTL);
    assert_eq!(
        expiries,
        [
            (0, renew),
            (720, keep),
            (1440, keep),
            (2160, renew),
            (2880, keep)
        ]
    );
}

/// Whether every write of `b` renews its key (else, each renews only if it created a
/// field). A project's key, renewed on its own schedule, is not counted.
fn renews(b: &Batch) -> bool {
    let routing = || b.writes.iter().filter(|w| w.key != PROJECT);
    if routing().all(|w| w.expire == KeyExpiry::Renew(KEY_TTL)) {
        return true;
    }
    assert!(
        routing().all(|w| w.expire == KeyExpiry::IfCreated(KEY_TTL)),
        "{b:?}"
    );
    false
}

#[test]
fn a_refresh_renews_a_key_only_every_third_period() {
    // A key renewed at t lives until t + 900: it covers the fields written until t + 600,
    // two refreshes (240 ms) and a half later.
    let mut t = tracker();
    let first = next_batch(&mut t);
    ack(&mut t, 0, &first, true);
    t.handle_input(
        Time(10),
        TrackerInput::AgentConnected(Box::new(info(7, 70))),
    );
    let b = next_batch(&mut t);
    assert!(renews(&b), "new keys");
    ack(&mut t, 10, &b, true);
    for at in [240, 480] {
        t.handle_timeout(Time(at));
        let b = next_batch(&mut t);
        assert!(!renews(&b), "at {at}: keys live until 900 and 910");
        ack(&mut t, at, &b, true);
    }
    t.handle_timeout(Time(720));
    let b = next_batch(&mut t);
    assert!(renews(&b), "fields until 1020");
    ack(&mut t, 720, &b, false);
    let retry = t.poll_timeout().unwrap();
    assert!(retry < Time(840));
    t.handle_timeout(retry);
    let b = next_batch(&mut t);
    assert!(renews(&b), "a failed renewal counts for nothing");
    ack(&mut t, retry.0, &b, true);
    for at in [960, 1200] {
        t.handle_timeout(Time(at));
        let b = next_batch(&mut t);
        assert!(!renews(&b), "at {at}: keys live until {}", retry.0 + 900);
        ack(&mut t, at, &b, true);
    }
    t.handle_timeout(Time(1440));
    let b = next_batch(&mut t);
    assert!(renews(&b), "fields until 1740");
    ack(&mut t, 1440, &b, true);
    t.handle_input(Time(1450), TrackerInput::RewriteAll);
    assert!(
        renews(&next_batch(&mut t)),
        "Redis may have lost the keys' lifetimes"
    );
}

#[test]
fn rewrite_all_restores_lost_data_at_once() {
    let mut t = tracker();
    let first = next_batch(&mut t);
    ack(&mut t, 0, &first, true);
    t.handle_input(Time(5), TrackerInput::RewriteAll);
    assert_eq!(keys_of(&next_batch(&mut t)), vec!["kas:kas_instances"]);
}

#[test]
fn a_rewrite_all_writes_at_once_whatever_the_backoff_of_failed_batches() {
    let mut t = tracker();
    let mut b = next_batch(&mut t);
    // Failed again and again while the store was away: the backoff is at its longest.
    for now in 0..6 {
        ack(&mut t, now, &b, false);
        t.handle_timeout(t.poll_timeout().unwrap());
        b = next_batch(&mut t);
    }
    ack(&mut t, 400, &b, false);
    assert!(
        t.retry_at.unwrap() >= Time(440),
        "80 ms, jittered down to half"
    );
    t.handle_input(Time(401), TrackerInput::RewriteAll);
    assert_eq!(keys_of(&next_batch(&mut t)), vec!["kas:kas_instances"]);
}

#[test]
fn after_a_rewrite_all_a_tunnel_record_is_announced_whatever_the_key_holds() {
    // A failover's replica may hold an older, expired value of a field this kas wrote
    // since: the `set` revives it without creating it, and readers have seen it gone.
    let (mut t, b) = presence_batch(true);
    ack(&mut t, 2, &b, true);
    t.handle_input(Time(100), TrackerInput::RewriteAll);
    let again = next_batch(&mut t);
    let w = again.writes.iter().find(|w| w.key == AGENT_3).unwrap();
    assert_eq!((w.publish.len(), w.announce.len()), (1, 0));
    let event = TunnelEvent::decode(w.publish[0].1.as_slice()).unwrap();
    assert!(event.connected);
    ack(&mut t, 101, &again, true);
    t.handle_timeout(Time(240));
    let refresh = next_batch(&mut t);
    let w = refresh.writes.iter().find(|w| w.key == AGENT_3).unwrap();
    assert_eq!(
        (w.publish.len(), w.announce.len()),
        (0, 1),
        "announced once, then only if missing"
    );
}

#[test]
fn a_batch_in_flight_at_a_rewrite_all_does_not_cancel_its_announcements() {
    // `redis-restart` seed 714: a refresh sent while Redis failed over committed on the
    // promoted replica just after the rewrite; its success, recorded as the last write,
    // made the rewrite's writes announce only created fields, and the replica held them.
    let (mut t, b) = presence_batch(true);
    ack(&mut t, 2, &b, true);
    t.handle_timeout(Time(240));
    let refresh = next_batch(&mut t);
    t.handle_input(Time(241), TrackerInput::RewriteAll);
    ack(&mut t, 242, &refresh, true);
    let again = next_batch(&mut t);
    let w = again.writes.iter().find(|w| w.key == AGENT_3).unwrap();
    assert_eq!((w.publish.len(), w.announce.len()), (1, 0));
    assert!(matches!(w.expire, KeyExpiry::Renew(_)), "{:?}", w.expire);
}

/// A tracker whose tunnel record of agent 3 was written and, at 10, deleted.
fn tunnel_record_deleted() -> Tracker {
    let (mut t, b) = presence_batch(true);
    ack(&mut t, 2, &b, true);
    let absent = TrackerInput::TunnelPresence {
        agent: AgentId(3),
        present: false,
    };
    t.handle_input(Time(10), absent);
    let gone = next_batch(&mut t);
    assert_eq!(gone.writes[0].delete, vec!["k1:1".to_string()]);
    ack(&mut t, 11, &gone, true);
    t
}

#[test]
fn a_rewrite_all_deletes_again_what_a_failover_may_have_revived() {
    // Swarm seed 701: the promoted replica lacked the deletion of a tunnel record, which
    // the kas no longer tracked; it stayed, routable, after the kas stopped gracefully.
    let mut t = tunnel_record_deleted();
    t.handle_input(Time(100), TrackerInput::RewriteAll);
    let again = next_batch(&mut t);
    let w = again.writes.iter().find(|w| w.key == AGENT_3).unwrap();
    assert_eq!(w.delete, vec!["k1:1".to_string()]);
    assert_eq!(w.expire, KeyExpiry::Keep);
}

#[test]
fn a_rewrite_all_leaves_deletions_whose_values_expired_and_fields_set_since() {
    let mut t = tunnel_record_deleted();
    // Written by 2 at the latest, so expired by 302 wherever a replica revived it.
    t.handle_input(Time(310), TrackerInput::RewriteAll);
    let again = next_batch(&mut t);
    assert_eq!(keys_of(&again), vec!["kas:kas_instances"]);
    ack(&mut t, 311, &again, true);

    let mut t = tunnel_record_deleted();
    let present = TrackerInput::TunnelPresence {
        agent: AgentId(3),
        present: true,
    };
    t.handle_input(Time(20), present);
    let back = next_batch(&mut t);
    ack(&mut t, 21, &back, true);
    t.handle_input(Time(100), TrackerInput::RewriteAll);
    let again = next_batch(&mut t);
    let w = again.writes.iter().find(|w| w.key == AGENT_3).unwrap();
    assert!(w.delete.is_empty(), "{:?}", w.delete);
    assert_eq!(w.set.len(), 1);
}

#[test]
fn after_a_rewrite_all_every_key_is_collected_once_its_longest_lived_records_expired() {
    // A failover's replica may hold fields this kas deleted since: nobody deletes them
    // again, and the key this kas keeps alive would keep them.
    let all = [
        "kas:agent:{agent:7}",
        "kas:conn_by_project:{project:100}",
        "kas:kas_instances",
    ];
    let live = [("k1:1", 1)];
    let mut t = tracker();
    let first = next_batch(&mut t);
    ack(&mut t, 0, &first, true);
    t.handle_input(Time(1), TrackerInput::AgentConnected(Box::new(info(7, 70))));
    assert_eq!(gc_at(&mut t, 600, &live), [all[0], all[2]], "new keys");
    assert_eq!(gc_at(&mut t, 1200, &live), [PROJECT], "a new project key");
    t.handle_input(Time(1300), TrackerInput::RewriteAll);
    assert_eq!(gc_at(&mut t, 1800, &live), Vec::<String>::new());
    assert_eq!(gc_at(&mut t, 2400, &live), all, "1300 + 780 passed");
    assert_eq!(gc_at(&mut t, 3000, &live), Vec::<String>::new());
}

/// Runs the GC period at `now`: answers its read of the live kas with `live` and returns
/// the keys it then collects.
fn gc_at(t: &mut Tracker, now: u64, live: &[(&str, u64)]) -> Vec<String> {
    t.handle_timeout(Time(now));
    let outs: Vec<_> = std::iter::from_fn(|| t.poll_output()).collect();
    assert!(
        outs.contains(&TrackerOutput::ReadKas {
            key: "kas:kas_instances".into()
        }),
        "{outs:?}"
    );
    let live = live.iter().map(|(id, i)| (id.to_string(), *i)).collect();
    t.handle_input(Time(now), TrackerInput::LiveKas(Some(live)));
    std::iter::from_fn(|| t.poll_output())
        .find_map(|o| match o {
            TrackerOutput::Gc { keys } => Some(keys),
            _ => None,
        })
        .unwrap_or_default()
}

#[test]
fn gc_collects_a_key_once_a_ttl_after_it_is_first_written_not_every_period() {
    let mut t = tracker();
    let first = next_batch(&mut t);
    ack(&mut t, 0, &first, true);
    t.handle_input(
        Time(400),
        TrackerInput::AgentConnected(Box::new(info(7, 70))),
    );
    let live = [("k1:1", 1), ("k2:1", 2)];
    assert_eq!(gc_at(&mut t, 600, &live), ["kas:kas_instances"]);
    assert_eq!(
        gc_at(&mut t, 1200, &live),
        ["kas:agent:{agent:7}", "kas:conn_by_project:{project:100}"],
        "written at 400, collected after 700 (the project's after 1180)"
    );
    for now in [1800, 2400, 3000] {
        assert_eq!(gc_at(&mut t, now, &live), Vec::<String>::new());
    }
}

#[test]
fn a_key_is_collected_a_ttl_after_it_is_first_written_even_if_its_fields_went_meanwhile() {
    let mut t = tracker();
    let first = next_batch(&mut t);
    ack(&mut t, 0, &first, true);
    t.handle_input(
        Time(400),
        TrackerInput::AgentConnected(Box::new(info(7, 70))),
    );
    let connected = next_batch(&mut t);
    ack(&mut t, 400, &connected, true);
    t.handle_input(
        Time(450),
        TrackerInput::AgentDisconnected {
            agent: AgentId(7),
            project: ProjectId(100),
            connection: ConnectionId(70),
        },
    );
    let gone = next_batch(&mut t);
    ack(&mut t, 450, &gone, true);
    let live = [("k1:1", 1)];
    assert_eq!(gc_at(&mut t, 600, &live), ["kas:kas_instances"]);
    assert_eq!(
        gc_at(&mut t, 1200, &live),
        ["kas:agent:{agent:7}", "kas:conn_by_project:{project:100}"],
        "an agent that comes and goes keeps the key alive: what a dead kas left there must go"
    );
}

#[test]
fn a_key_due_when_every_key_is_collected_is_collected_even_if_its_fields_went() {
    let mut t = tracker();
    let first = next_batch(&mut t);
    ack(&mut t, 0, &first, true);
    assert_eq!(
        gc_at(&mut t, 600, &[("k1:1", 1), ("k2:1", 2)]),
        ["kas:kas_instances"]
    );
    // A kas restarted: every key this kas holds fields in is collected after 1200 + 780.
    let live = [("k1:1", 1), ("k2:1", 3)];
    assert_eq!(gc_at(&mut t, 1200, &live), Vec::<String>::new());
    // An agent comes and goes (the writes need not land: the GC is scheduled as they are
    // made); its project key is due at 1500 + 780, in the same period as every key.
    t.handle_input(
        Time(1500),
        TrackerInput::AgentConnected(Box::new(info(7, 70))),
    );
    t.handle_input(
        Time(1550),
        TrackerInput::AgentDisconnected {
            agent: AgentId(7),
            project: ProjectId(100),
            connection: ConnectionId(70),
        },
    );
    assert_eq!(gc_at(&mut t, 1800, &live), ["kas:agent:{agent:7}"]);
    assert_eq!(
        gc_at(&mut t, 2400, &live),
        [PROJECT, "kas:kas_instances"],
        "due at 2280, when every key this kas holds fields in was collected too"
    );
    assert_eq!(gc_at(&mut t, 3000, &live), Vec::<String>::new());
}

#[test]
fn a_failed_gc_is_run_again_next_period() {
    let mut t = tracker();
    let first = next_batch(&mut t);
    ack(&mut t, 0, &first, true);
    let live = [("k1:1", 1)];
    let keys = gc_at(&mut t, 600, &live);
    assert_eq!(keys, ["kas:kas_instances"]);
    t.handle_input(Time(601), TrackerInput::GcFailed(keys.clone()));
    assert_eq!(gc_at(&mut t, 1200, &live), keys);
    assert_eq!(gc_at(&mut t, 1800, &live), Vec::<String>::new());
}

#[test]
fn a_kas_gone_restarted_or_appeared_has_every_key_collected_once_its_longest_lived_records_expired()
{
    let all = [
        "kas:agent:{agent:7}",
        "kas:conn_by_project:{project:100}",
        "kas:kas_instances",
    ];
    for after in [vec![("k1:1", 1)], vec![("k1:1", 1), ("k2:1", 3)]] {
        let mut t = tracker();
        let first = next_batch(&mut t);
        ack(&mut t, 0, &first, true);
        t.handle_input(Time(1), TrackerInput::AgentConnected(Box::new(info(7, 70))));
        let before = [("k1:1", 1), ("k2:1", 2)];
        assert_eq!(
            gc_at(&mut t, 600, &before),
            [all[0], all[2]],
            "new keys, a ttl after"
        );
        assert_eq!(
            gc_at(&mut t, 1200, &after),
            [PROJECT],
            "a new project key, once another kas's records there could have expired (781)"
        );
        assert_eq!(gc_at(&mut t, 1800, &after), Vec::<String>::new());
        assert_eq!(gc_at(&mut t, 2400, &after), all, "{after:?}: 1980 passed");
        assert_eq!(gc_at(&mut t, 3000, &after), Vec::<String>::new());
    }
    // A failed read sees nothing change; a kas that appears may follow an incarnation of
    // itself that lived and died between two reads (a sim seed found one's records left).
    let mut t = tracker();
    let first = next_batch(&mut t);
    ack(&mut t, 0, &first, true);
    let alone = [("k1:1", 1)];
    assert_eq!(gc_at(&mut t, 600, &alone), ["kas:kas_instances"]);
    t.handle_timeout(Time(1200));
    t.handle_input(Time(1200), TrackerInput::LiveKas(None));
    let joined = [("k1:1", 1), ("k3:1", 5)];
    assert_eq!(gc_at(&mut t, 1800, &joined), Vec::<String>::new());
    assert_eq!(gc_at(&mut t, 2400, &joined), Vec::<String>::new());
    assert_eq!(
        gc_at(&mut t, 3000, &joined),
        ["kas:kas_instances"],
        "2580 passed"
    );
    assert_eq!(gc_at(&mut t, 3600, &joined), Vec::<String>::new());
}

#[test]
fn shutdown_deletes_everything_then_completes() {
    let mut t = tracker();
    let first = next_batch(&mut t);
    t.handle_input(Time(1), TrackerInput::AgentConnected(Box::new(info(7, 70))));
    ack(&mut t, 1, &first, true);
    let b = next_batch(&mut t);
    t.handle_input(Time(2), TrackerInput::Shutdown);
    ack(&mut t, 2, &b, true);
    let del = next_batch(&mut t);
    assert_eq!(del.writes.len(), 3);
    assert!(
        del.writes
            .iter()
            .all(|w| w.set.is_empty() && !w.delete.is_empty())
    );
    t.handle_input(Time(3), TrackerInput::AgentConnected(Box::new(info(8, 80))));
    assert!(t.poll_output().is_none(), "no new writes after shutdown");
    ack(&mut t, 3, &del, true);
    assert_eq!(t.poll_output(), Some(TrackerOutput::ShutdownComplete));
    assert!(t.desired().is_empty());
}
