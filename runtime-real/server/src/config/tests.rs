use super::*;

/// A directory with valid secret and tokens files, and YAML naming them.
struct Files {
    dir: tempfile::TempDir,
}

impl Files {
    fn new() -> Files {
        let dir = tempfile::tempdir().unwrap();
        let b64 = "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="; // 32 bytes
        std::fs::write(dir.path().join("s"), b64).unwrap();
        std::fs::write(
            dir.path().join("t"),
            "agents:\n  - token: abcdefghijklmnopqrstuvwxyz\n    agent_id: 1\n    project_id: 2\n",
        )
        .unwrap();
        Files { dir }
    }

    fn yaml(&self, extra: &str) -> String {
        let d = self.dir.path().display();
        format!(
            "agent:\n  tokens_file: {d}/t\napi:\n  listen:\n    address: 127.0.0.1:8153\n    authentication_secret_file: {d}/s\nprivate_api:\n  listen:\n    address: 127.0.0.1:8155\n    authentication_secret_file: {d}/s\n{extra}"
        )
    }
}

fn problems(text: &str) -> Vec<String> {
    Config::parse(text, "t.yaml").unwrap_err().problems
}

#[test]
fn minimal_file_gets_gitlab_defaults() {
    let f = Files::new();
    let c = Config::parse(&f.yaml(""), "t.yaml").unwrap();
    assert_eq!(c.agent.redis_conn_info_ttl, Duration::from_secs(300));
    assert_eq!(c.agent.redis_conn_info_refresh, Duration::from_secs(240));
    assert_eq!(c.agent.redis_conn_info_gc, Duration::from_secs(600));
    assert_eq!(c.agent.info_cache_ttl, Duration::from_secs(300));
    assert_eq!(c.agent.info_cache_error_ttl, Duration::from_secs(60));
    assert_eq!(c.agent.listen.address.port(), 8150);
    assert_eq!(c.observability.listen.address.port(), 8151);
    assert!(c.redis.is_none(), "no redis section: the in-memory store");
    assert_eq!(c.advertise_address().port(), 8155);
}

#[test]
fn redis_section_and_durations_parse() {
    let f = Files::new();
    let text = f
        .yaml("redis:\n  server:\n    address: 10.0.0.5:6379\nagent:\n  redis_conn_info_ttl: 2s\n");
    // `agent` twice is a YAML error, named with its line.
    assert!(
        problems(&text)[0].contains("duplicate"),
        "{:?}",
        problems(&text)
    );
    let text = f.yaml("redis:\n  server:\n    address: 10.0.0.5:6379\n  timeout: 250ms\n");
    let c = Config::parse(&text, "t.yaml").unwrap();
    let r = c.redis.unwrap();
    assert_eq!(r.key_prefix, "gitlab-kas");
    assert_eq!(r.timeout, Duration::from_millis(250));
    assert!(r.pubsub_wakeups);
}

#[test]
fn redis_is_one_server_a_sentinel_master_or_a_cluster() {
    let f = Files::new();
    let text = f.yaml(
        "redis:\n  sentinel:\n    master_name: gitlab-redis\n    addresses: [s1:26379, s2:26379]\n",
    );
    let r = Config::parse(&text, "t.yaml").unwrap().redis.unwrap();
    let s = r.sentinel.unwrap();
    assert_eq!(s.master_name, "gitlab-redis");
    assert_eq!(s.addresses, ["s1:26379", "s2:26379"]);
    let text = f.yaml("redis:\n  cluster:\n    addresses: [n1:7000]\n");
    let r = Config::parse(&text, "t.yaml").unwrap().redis.unwrap();
    assert_eq!(r.cluster.unwrap().addresses, ["n1:7000"]);
    for (yaml, problem) in [
        (
            "redis:\n  key_prefix: k\n",
            "redis: set exactly one of server, sentinel and cluster",
        ),
        (
            "redis:\n  server:\n    address: a:1\n  cluster:\n    addresses: [n1:7000]\n",
            "redis: set exactly one of server, sentinel and cluster",
        ),
        (
            "redis:\n  sentinel:\n    master_name: ''\n    addresses: [s:1]\n",
            "redis.sentinel.master_name is required",
        ),
        (
            "redis:\n  sentinel:\n    master_name: m\n    addresses: []\n",
            "redis.sentinel.addresses: list at least one sentinel, none empty",
        ),
        (
            "redis:\n  cluster:\n    addresses: ['']\n",
            "redis.cluster.addresses: list at least one node, none empty",
        ),
    ] {
        let p = problems(&f.yaml(yaml));
        assert!(p.iter().any(|x| x == problem), "{yaml}: {p:?}");
    }
}

#[test]
fn every_problem_is_reported_with_its_key() {
    let f = Files::new();
    let text = f.yaml(
        "observability:\n  listen:\n    address: 127.0.0.1:8153\nredis:\n  server:\n    address: ''\n  key_prefix: 'a{b}'\n",
    );
    let p = problems(&text);
    assert!(
        p.iter().any(|x| x.contains(
            "api.listen.address and observability.listen.address are both 127.0.0.1:8153"
        )),
        "{p:?}"
    );
    assert!(p.iter().any(|x| x.starts_with("redis.key_prefix")), "{p:?}");
    assert!(
        p.iter().any(|x| x == "redis.server.address is required"),
        "{p:?}"
    );
}

#[test]
fn bad_values_name_their_key() {
    let f = Files::new();
    let p = problems(&f.yaml("shutdown_grace: soon\n"));
    assert!(
        p[0].contains("shutdown_grace") && p[0].contains("invalid duration \"soon\""),
        "{p:?}"
    );
    let p = problems("private_api:\n  listen:\n    address: 0.0.0.0:8155\n");
    assert!(
        p.iter()
            .any(|x| x.starts_with("private_api.advertise_address is required")),
        "{p:?}"
    );
    assert!(
        p.iter()
            .any(|x| x == "api.listen.authentication_secret_file is required"),
        "{p:?}"
    );
    let p = problems("agent:\n  redis_conn_info_ttl: 0s\n");
    assert!(
        p.iter()
            .any(|x| x == "agent.redis_conn_info_ttl must be greater than zero"),
        "{p:?}"
    );
}

#[test]
fn limits_have_defaults_and_bad_ones_are_named() {
    let f = Files::new();
    let c = Config::parse(&f.yaml(""), "t.yaml").unwrap();
    assert_eq!(c.agent.connections_per_token_per_minute(), 1000);
    assert_eq!(c.agent.max_connections_per_agent, 100);
    assert_eq!(c.agent.max_tunnels_per_connection, 200);
    assert_eq!(c.agent.max_message_size, 32 << 20);
    assert_eq!(c.agent.kas_liveness_ttl, Duration::from_secs(30));
    assert_eq!(c.api.listen.max_concurrent_streams, 1000);
    assert_eq!(c.api.listen.handshake_timeout, Duration::from_secs(10));
    assert_eq!(c.api.max_token_lifetime, Duration::from_secs(3600));
    let bad = problems(&f.yaml(
        "observability:\n  listen:\n    address: 127.0.0.1:8151\n    connections_per_token_per_minute: 5\n    handshake_timeout: 0s\n",
    ));
    assert!(
        bad.contains(
            &"observability.listen.connections_per_token_per_minute applies to agent.listen only"
                .to_string()
        ),
        "{bad:?}"
    );
    assert!(
        bad.contains(
            &"observability.listen.handshake_timeout must be greater than zero".to_string()
        ),
        "{bad:?}"
    );
    let zero = problems(
        &f.yaml("redis:\n  server:\n    address: x:1\n")
            .replace("agent:\n", "agent:\n  max_tunnels_per_connection: 0\n"),
    );
    assert!(
        zero.contains(&"agent.max_tunnels_per_connection must be greater than zero".to_string()),
        "{zero:?}"
    );
}

#[test]
fn tls_keys_are_checked_and_named() {
    let f = Files::new();
    let d = f.dir.path();
    let ca = kas_transport::local_ca::LocalCa::new("test CA").unwrap();
    let (cert, key) = ca.issue().unwrap();
    std::fs::write(d.join("c.pem"), cert).unwrap();
    std::fs::write(d.join("k.pem"), key).unwrap();
    std::fs::write(d.join("ca.pem"), &ca.pem).unwrap();
    let d = d.display();
    let good = f.yaml(&format!(
        "observability:\n  listen:\n    address: 127.0.0.1:8151\n    certificate_file: {d}/c.pem\n    key_file: {d}/k.pem\nredis:\n  server:\n    address: r:6380\n  username: kas\n  tls:\n    enabled: true\n    ca_certificate_file: {d}/ca.pem\n"
    ));
    let c = Config::parse(&good, "t.yaml").unwrap();
    assert!(c.observability.listen.tls().is_some() && c.api.listen.tls().is_none());
    let r = c.redis.unwrap();
    assert_eq!((r.username.as_deref(), r.tls.enabled), (Some("kas"), true));

    // The agent listener's files swapped: neither loads as what it should be.
    let bad = problems(
        &f.yaml(&format!(
            "observability:\n  listen:\n    address: 127.0.0.1:8151\n    certificate_file: {d}/c.pem\n    ca_certificate_file: {d}/ca.pem\nredis:\n  server:\n    address: r:6380\n  tls:\n    ca_certificate_file: {d}/nowhere.pem\n    key_file: {d}/k.pem\n"
        ))
        .replace(
            "agent:\n",
            &format!("agent:\n  listen:\n    address: 127.0.0.1:8150\n    certificate_file: {d}/k.pem\n    key_file: {d}/c.pem\n"),
        ),
    );
    for says in [
        "observability.listen.key_file is required with observability.listen.certificate_file",
        "observability.listen.ca_certificate_file applies to private_api.listen only",
        "agent.listen: ",
        "redis.tls.ca_certificate_file is set but redis.tls.enabled is false",
        "redis.tls.certificate_file and redis.tls.key_file go together",
    ] {
        assert!(bad.iter().any(|p| p.contains(says)), "{says}: {bad:?}");
    }
}

#[test]
fn an_advertised_scheme_must_match_the_private_listener() {
    let f = Files::new();
    let with = |adv: &str| {
        f.yaml("").replacen(
            "private_api:\n",
            &format!("private_api:\n  advertise_address: {adv}\n"),
            1,
        )
    };
    let c = Config::parse(&with("grpc://10.0.0.12:8155"), "t.yaml").unwrap();
    assert_eq!(c.advertise_address(), "10.0.0.12:8155".parse().unwrap());
    let p = problems(&with("grpcs://10.0.0.12:8155"));
    assert!(
        p.iter()
            .any(|x| x.contains("private_api.listen serves plaintext")),
        "{p:?}"
    );
    let p = problems(&with("https://10.0.0.12:8155"));
    assert!(
        p.iter().any(|x| x.contains("neither grpc:// nor grpcs://")),
        "{p:?}"
    );
}

#[test]
fn the_kubernetes_api_listener_is_off_unless_set_and_its_keys_are_checked() {
    let f = Files::new();
    let c = Config::parse(&f.yaml(""), "t.yaml").unwrap();
    assert!(c.agent.kubernetes_api.is_none());
    let with = |section: &str| {
        f.yaml("").replacen(
            "agent:\n",
            &format!("agent:\n  kubernetes_api: {section}\n"),
            1,
        )
    };
    let d = f.dir.path().display();
    std::fs::write(
        f.dir.path().join("u"),
        "tokens:\n  - {token: user-token-0123456789, kind: pat, agent_ids: [1], username: a}\n",
    )
    .unwrap();
    let c = Config::parse(&with(&format!("{{tokens_file: {d}/u}}")), "t.yaml").unwrap();
    let k = c.agent.kubernetes_api.expect("set");
    assert_eq!(k.listen.address.to_string(), "0.0.0.0:8154");
    assert_eq!(k.url_path_prefix, "/");
    assert_eq!(k.routing_timeout, Duration::from_secs(20));
    assert!(k.audit.is_none(), "the audit log is off unless set");
    let c = Config::parse(
        &with(&format!("{{tokens_file: {d}/u, audit: {{path: stdout}}}}")),
        "t.yaml",
    )
    .unwrap();
    let audit = c.agent.kubernetes_api.and_then(|k| k.audit).expect("set");
    assert!(audit.to_stdout());
    assert_eq!((audit.max_size, audit.max_files), (100 << 20, 5));
    let p = problems(&with(&format!(
        "{{tokens_file: {d}/missing, url_path_prefix: k8s, routing_timeout: 0s, listen: {{address: '127.0.0.1:8153'}}, audit: {{path: {d}/a, max_size: 10}}}}"
    )));
    for says in [
        "agent.kubernetes_api.audit.max_size 10 is below 4096 bytes",
        "agent.kubernetes_api.tokens_file: cannot read",
        "agent.kubernetes_api.url_path_prefix \"k8s\" must start with /",
        "agent.kubernetes_api.routing_timeout must be greater than zero",
        "api.listen.address and agent.kubernetes_api.listen.address are both 127.0.0.1:8153",
    ] {
        assert!(p.iter().any(|m| m.contains(says)), "{says}: {p:?}");
    }
    let p = problems(&with("{}"));
    assert!(
        p.iter()
            .any(|m| m.contains("agent.kubernetes_api needs tokens_file or gitlab")),
        "{p:?}"
    );
}

#[test]
fn what_the_writer_writes_parses_to_the_keys_it_was_given() {
    let f = Files::new();
    let text = ConfigWriter::new()
        .merge(&f.yaml(""))
        .unwrap()
        .set("agent.listen.address", "127.0.0.1:0")
        .set("agent.max_tunnels_per_connection", 8)
        .set("agent.listen.websocket", true)
        .duration("shutdown_grace", Duration::from_millis(250))
        .set("redis.server.address", "127.0.0.1:6379")
        .merge("agent:\n  listen:\n    max_connection_age: 2s\nredis:\n  key_prefix: p\n")
        .unwrap()
        .set("agent.listen.first_byte_timeout", "7s")
        .unset("agent.listen.first_byte_timeout")
        .unset("no.such.key")
        .text();
    let c = Config::parse(&text, "written.yaml").unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(c.agent.listen.address.to_string(), "127.0.0.1:0");
    assert_eq!(c.agent.max_tunnels_per_connection, 8);
    assert!(c.agent.listen.websocket);
    assert_eq!(
        c.agent.listen.max_connection_age,
        Some(Duration::from_secs(2))
    );
    assert_eq!(c.shutdown_grace, Duration::from_millis(250));
    assert_eq!(
        c.agent.listen.first_byte_timeout,
        default_first_byte_timeout(),
        "unset: its default again"
    );
    assert_eq!(
        c.api.listen.address.to_string(),
        "127.0.0.1:8153",
        "merged first"
    );
    let r = c.redis.expect("a redis section");
    assert_eq!(r.key_prefix, "p", "a merged key wins");
    assert_eq!(r.server.expect("a server").address, "127.0.0.1:6379");
}
