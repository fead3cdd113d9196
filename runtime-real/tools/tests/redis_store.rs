//! The Redis store against a real redis-server of its own: the one-command batch write,
//! announcements only when a record is recreated, and the pub-sub connection reporting
//! when it goes down and comes back.

mod support;

use kas_core::tracker::{KeyExpiry, KeyWrite};
use kas_server::store::{PubSubEvent, RedisStore, RedisTopology, Store};
use std::time::Duration;
use support::Redis;
use tokio::sync::mpsc;

/// A store on `redis` (no TLS, no user) whose commands time out after `timeout`.
fn store(redis: &Redis, timeout: Duration) -> Store {
    let (auth, tls) = (Default::default(), Default::default());
    Store::new(
        RedisStore::new(
            &RedisTopology::Server(redis.address()),
            &auth,
            &tls,
            timeout,
        )
        .expect("store"),
    )
}

fn write(key: &str, set: &[(&str, &str)], delete: &[&str], publish: &str) -> KeyWrite {
    KeyWrite {
        key: key.into(),
        delete: delete.iter().map(|f| f.to_string()).collect(),
        set: set
            .iter()
            .map(|(f, v)| (f.to_string(), v.as_bytes().to_vec()))
            .collect(),
        expire: KeyExpiry::Renew(Duration::from_secs(60)),
        publish: (!publish.is_empty())
            .then(|| ("events".to_string(), publish.as_bytes().to_vec()))
            .into_iter()
            .collect(),
        announce: vec![("events".into(), format!("announce {key}").into_bytes())],
    }
}

/// The next event that is not a `Subscribed`, within 10 s.
async fn next(events: &mut mpsc::Receiver<PubSubEvent>) -> PubSubEvent {
    loop {
        let event = tokio::time::timeout(Duration::from_secs(10), events.recv())
            .await
            .expect("an event within 10 s")
            .expect("the pub-sub task is running");
        if !matches!(event, PubSubEvent::Subscribed(_)) {
            return event;
        }
    }
}

fn message(event: PubSubEvent) -> String {
    match event {
        PubSubEvent::Message { payload, .. } => String::from_utf8(payload).unwrap(),
        other => panic!("expected a message, got {other:?}"),
    }
}

/// Successful calls of `command` so far (`INFO commandstats`); the first `EVALSHA` of a
/// script fails with NOSCRIPT and is followed by `SCRIPT LOAD`.
fn calls(redis: &Redis, command: &str) -> u64 {
    let stats = redis.cli(&["INFO", "commandstats"]);
    let line = stats.lines().find_map(|l| {
        l.strip_prefix(&format!("cmdstat_{command}:"))
            .map(str::to_string)
    });
    let field = |name: &str| -> u64 {
        line.as_deref()
            .and_then(|l| l.split(',').find_map(|kv| kv.strip_prefix(name)))
            .map_or(0, |n| n.trim().parse().unwrap())
    };
    field("calls=") - field("failed_calls=")
}

#[tokio::test]
async fn batch_writes_are_one_command_and_announce_only_recreated_records() {
    let redis = Redis::start().expect("redis-server starts");
    let store = store(&redis, Duration::from_secs(2));
    let (pubsub, mut events) = store.pubsub();
    assert!(matches!(next(&mut events).await, PubSubEvent::Up));
    pubsub.subscribe("events".into());
    loop {
        if let Some(PubSubEvent::Subscribed(_)) = events.recv().await {
            break;
        }
    }

    // Two keys in one batch; both fields are new, so both are announced after the explicit
    // message.
    let first = [
        write("a", &[("f1", "v1")], &[], "explicit"),
        write("b", &[("f1", "v1"), ("f2", "v2")], &[], ""),
    ];
    store.execute(&first).await.unwrap();
    assert_eq!(message(next(&mut events).await), "explicit");
    assert_eq!(message(next(&mut events).await), "announce a");
    assert_eq!(message(next(&mut events).await), "announce b");
    // Rewriting existing fields announces nothing: the next message is the explicit one.
    store
        .execute(&[write("a", &[("f1", "v1b")], &[], "")])
        .await
        .unwrap();
    store
        .execute(&[write("b", &[], &["f2"], "after")])
        .await
        .unwrap();
    assert_eq!(message(next(&mut events).await), "after");
    // A deleted field written again is announced.
    store
        .execute(&[write("b", &[("f2", "v2")], &[], "")])
        .await
        .unwrap();
    assert_eq!(message(next(&mut events).await), "announce b");
    let mut b = store.read("b").await.unwrap();
    b.sort();
    assert_eq!(
        b,
        vec![("f1".into(), b"v1".to_vec()), ("f2".into(), b"v2".to_vec())]
    );
    let ttl: i64 = redis.cli(&["PTTL", "a"]).trim().parse().unwrap();
    assert!(ttl > 50_000 && ttl <= 60_000, "PEXPIRE applied: {ttl}");

    // A key with more fields than Lua's unpack takes at once.
    let many: Vec<(String, String)> = (0..1_000)
        .map(|i| (format!("f{i}"), format!("v{i}")))
        .collect();
    let refs: Vec<(&str, &str)> = many.iter().map(|(f, v)| (f.as_str(), v.as_str())).collect();
    store
        .execute(&[write("big", &refs, &[], "")])
        .await
        .unwrap();
    assert_eq!(store.read("big").await.unwrap().len(), 1_000);
    assert_eq!(message(next(&mut events).await), "announce big");

    // Five batches: five script calls, and no MULTI/EXEC round trips.
    let scripts = calls(&redis, "evalsha") + calls(&redis, "eval");
    assert_eq!(scripts, 5, "{}", redis.cli(&["INFO", "commandstats"]));
    assert_eq!(calls(&redis, "multi"), 0);
}

#[tokio::test]
async fn pubsub_reports_down_and_up_across_a_redis_restart() {
    let mut redis = Redis::start().expect("redis-server starts");
    let store = store(&redis, Duration::from_millis(500));
    let (pubsub, mut events) = store.pubsub();
    assert!(matches!(next(&mut events).await, PubSubEvent::Up));
    pubsub.subscribe("events".into());
    redis.stop();
    assert!(matches!(next(&mut events).await, PubSubEvent::Down));
    redis.launch().expect("redis-server starts again");
    assert!(matches!(next(&mut events).await, PubSubEvent::Up));
    // The subscription is back: a message published now arrives.
    let published = redis.cli(&["PUBLISH", "events", "hello"]);
    assert_eq!(published.trim(), "1", "one subscriber");
    assert_eq!(message(next(&mut events).await), "hello");
}

#[tokio::test]
async fn gc_script_deletes_expired_and_undecodable_fields_only() {
    let redis = Redis::start().expect("redis-server starts");
    let store = store(&redis, Duration::from_secs(2));
    let now = kas_core::Time(1_700_000_000_000);
    let mut keys = Vec::new();
    for k in 0..300 {
        let key = format!("gc{k}");
        store
            .execute(&[support::gc_fixture(&key, now, vec![])])
            .await
            .unwrap();
        keys.push(key);
    }
    // 300 keys: two script calls (256 + 44), two garbage fields each.
    let before = calls(&redis, "evalsha");
    assert_eq!(store.gc(&keys, now).await.unwrap(), 600);
    assert_eq!(calls(&redis, "evalsha") - before, 2);
    support::only_live_left(&store, &keys).await;
}

#[tokio::test]
async fn a_key_is_renewed_when_asked_or_when_its_write_created_a_field() {
    let redis = Redis::start().expect("redis-server starts");
    let store = store(&redis, Duration::from_secs(2));
    let pttl = || -> i64 { redis.cli(&["PTTL", "k"]).trim().parse().unwrap() };
    let put = |field: &str, expire: KeyExpiry| KeyWrite {
        expire,
        ..write("k", &[(field, "v")], &[], "")
    };
    let minute = Duration::from_secs(60);

    store
        .execute(&[put("f1", KeyExpiry::IfCreated(minute))])
        .await
        .unwrap();
    assert!(pttl() > 50_000, "a new key gets its lifetime: {}", pttl());
    redis.cli(&["PEXPIRE", "k", "20000"]);
    store
        .execute(&[put("f1", KeyExpiry::IfCreated(minute))])
        .await
        .unwrap();
    assert!(
        pttl() <= 20_000,
        "a rewritten field renews nothing: {}",
        pttl()
    );
    store
        .execute(&[put("f2", KeyExpiry::IfCreated(minute))])
        .await
        .unwrap();
    assert!(
        pttl() > 50_000,
        "a created field renews the key: {}",
        pttl()
    );
    redis.cli(&["PEXPIRE", "k", "20000"]);
    store.execute(&[put("f2", KeyExpiry::Keep)]).await.unwrap();
    assert!(pttl() <= 20_000, "Keep renews nothing: {}", pttl());
    store
        .execute(&[put("f2", KeyExpiry::Renew(minute))])
        .await
        .unwrap();
    assert!(pttl() > 50_000, "Renew renews: {}", pttl());
}
