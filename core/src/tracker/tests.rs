use super::*;

const TTL: Duration = Duration::from_millis(300);

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
    assert_eq!(w.expire, Some(TTL));
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
    t.handle_input(Time(1), TrackerInput::AgentConnected(info(7, 70)));
    assert!(t.poll_output().is_none(), "one batch in flight at a time");
    ack(&mut t, 2, &first, true);
    let b = next_batch(&mut t);
    assert_eq!(
        keys_of(&b),
        vec![
            "kas:conn_by_agent:{agent:7}",
            "kas:conn_by_project:{project:100}"
        ]
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
    assert!(b.writes.iter().all(|w| w.expire.is_none()));
    ack(&mut t, 5, &b, true);
    assert_eq!(t.desired().len(), 1, "only the instance record remains");
}

#[test]
fn tunnel_presence_publishes_with_its_write() {
    let mut t = tracker();
    let first = next_batch(&mut t);
    ack(&mut t, 0, &first, true);
    t.handle_input(
        Time(1),
        TrackerInput::TunnelPresence {
            agent: AgentId(3),
            present: true,
        },
    );
    let b = next_batch(&mut t);
    let w = &b.writes[0];
    assert_eq!(w.key, "kas:tunnels_by_agent:{agent:3}");
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
    let mut t = tracker();
    let first = next_batch(&mut t);
    ack(&mut t, 0, &first, true);
    let presence = |present| TrackerInput::TunnelPresence {
        agent: AgentId(3),
        present,
    };
    t.handle_input(Time(1), presence(true));
    let b = next_batch(&mut t);
    assert!(
        b.writes[0].announce.is_empty(),
        "the explicit event says it"
    );
    ack(&mut t, 2, &b, true);
    t.handle_timeout(Time(240));
    let refresh = next_batch(&mut t);
    let w = refresh
        .writes
        .iter()
        .find(|w| w.key == "kas:tunnels_by_agent:{agent:3}")
        .unwrap();
    assert!(w.publish.is_empty());
    assert_eq!(w.announce.len(), 1);
    let event = TunnelEvent::decode(w.announce[0].1.as_slice()).unwrap();
    assert!(event.connected);
    ack(&mut t, 241, &refresh, true);
    t.handle_input(Time(242), presence(false));
    let gone = next_batch(&mut t);
    assert!(gone.writes[0].announce.is_empty());
}

#[test]
fn failed_batch_is_retried_after_backoff_with_its_deletes_and_events() {
    let mut t = tracker();
    let first = next_batch(&mut t);
    ack(&mut t, 0, &first, true);
    t.handle_input(
        Time(1),
        TrackerInput::TunnelPresence {
            agent: AgentId(3),
            present: false,
        },
    );
    let b = next_batch(&mut t);
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
    let mut t = Tracker::new(
        Time(0),
        TrackerConfig {
            liveness: Duration::from_millis(90),
            ..config()
        },
        Keys::new("kas"),
        KasId("k1:1".into()),
        &KasInstanceInfo::default(),
        1,
    );
    let first = next_batch(&mut t);
    assert_eq!(first.writes[0].expire, Some(Duration::from_millis(90)));
    t.handle_input(Time(1), TrackerInput::AgentConnected(info(7, 70)));
    ack(&mut t, 1, &first, true);
    let b = next_batch(&mut t);
    ack(&mut t, 2, &b, true);
    for w in &b.writes {
        assert_eq!(w.expire, Some(TTL), "{}: agent records keep the ttl", w.key);
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

#[test]
fn refresh_rewrites_everything_with_a_new_expiry() {
    let mut t = tracker();
    let first = next_batch(&mut t);
    t.handle_input(Time(1), TrackerInput::AgentConnected(info(7, 70)));
    ack(&mut t, 1, &first, true);
    let b = next_batch(&mut t);
    ack(&mut t, 2, &b, true);
    assert_eq!(t.poll_timeout(), Some(Time(240)));
    t.handle_timeout(Time(240));
    let refresh = next_batch(&mut t);
    assert_eq!(refresh.writes.len(), 3);
    for w in &refresh.writes {
        assert_eq!(expiring::decode(&w.set[0].1).unwrap().0, Time(540));
    }
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
fn gc_names_the_keys_this_kas_writes() {
    let mut t = tracker();
    let first = next_batch(&mut t);
    ack(&mut t, 0, &first, true);
    t.handle_timeout(Time(600));
    let gc = std::iter::from_fn(|| t.poll_output())
        .find_map(|o| match o {
            TrackerOutput::Gc { keys } => Some(keys),
            _ => None,
        })
        .unwrap();
    assert_eq!(gc, vec!["kas:kas_instances".to_string()]);
}

#[test]
fn shutdown_deletes_everything_then_completes() {
    let mut t = tracker();
    let first = next_batch(&mut t);
    t.handle_input(Time(1), TrackerInput::AgentConnected(info(7, 70)));
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
    t.handle_input(Time(3), TrackerInput::AgentConnected(info(8, 80)));
    assert!(t.poll_output().is_none(), "no new writes after shutdown");
    ack(&mut t, 3, &del, true);
    assert_eq!(t.poll_output(), Some(TrackerOutput::ShutdownComplete));
    assert!(t.desired().is_empty());
}
