//! The files in `deploy/` hold together: kas configurations pass kas's own validation, and
//! the agentk manifest wires the downward API, RBAC, token and flags agentk understands.

mod support;

use kas_server::config::Config;
use serde::Deserialize;
use serde_yaml::Value;
use std::path::{Path, PathBuf};

fn deploy(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy")
        .join(name)
}

/// Every document of a multi-document YAML file.
fn documents(name: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(deploy(name)).expect("readable");
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap_or_else(|e| panic!("{name}: {e}")))
        .collect()
}

fn kind<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind}"))
}

/// Validates kas configuration text whose files live under /etc/kas, with those files
/// created in a temporary directory, as kas in a pod with OWN_PRIVATE_API_ADDRESS set.
fn check_kas_config(text: &str) -> Config {
    let dir = tempfile::tempdir().unwrap();
    for f in ["gitlab-kas-secret", "private-api-secret"] {
        std::fs::write(dir.path().join(f), "S2FzS2Fz".repeat(8)).unwrap();
    }
    // The TLS Secret's files, as cert-manager mounts them.
    let ca = kas_transport::local_ca::LocalCa::new("deploy test CA").unwrap();
    let (cert, key) = ca.issue().unwrap();
    std::fs::write(dir.path().join("tls.crt"), cert).unwrap();
    std::fs::write(dir.path().join("tls.key"), key).unwrap();
    let text = text
        .replace("/etc/kas/", &format!("{}/", dir.path().display()))
        .replace("/etc/kas-tls/", &format!("{}/", dir.path().display()));
    let path = dir.path().join("kas.yaml");
    std::fs::write(&path, text).unwrap();
    let pod_ip: std::net::SocketAddr = "10.0.0.12:8155".parse().unwrap();
    let config = Config::load(&path, Some(pod_ip.into())).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.advertise_address(), pod_ip);
    config
}

#[test]
fn kas_manifest_config_is_valid_and_uses_redis() {
    let docs = documents("kas.yaml");
    let text = kind(&docs, "ConfigMap")["data"]["kas.yaml"]
        .as_str()
        .expect("kas.yaml in the ConfigMap");
    let config = check_kas_config(text);
    assert!(config.redis.is_some(), "three replicas need Redis");
    assert!(config.agent.listen.tls().is_some() && config.api.listen.tls().is_some());
    assert!(config.agent.listen.websocket, "agentk's wss:// needs it");
    let deployment = kind(&docs, "Deployment");
    let secret = kind(&docs, "Certificate")["spec"]["secretName"].clone();
    let volumes = deployment["spec"]["template"]["spec"]["volumes"]
        .as_sequence()
        .unwrap();
    assert!(
        volumes.iter().any(|v| v["secret"]["secretName"] == secret),
        "the Certificate's Secret is mounted"
    );
    assert_eq!(deployment["spec"]["replicas"], 3);
    let env = &deployment["spec"]["template"]["spec"]["containers"][0]["env"];
    let own = env
        .as_sequence()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "OWN_PRIVATE_API_ADDRESS")
        .expect("OWN_PRIVATE_API_ADDRESS");
    assert_eq!(own["value"], "$(POD_IP):8155");
}

/// The Deployments run the images `scripts/image` builds, at this version (it tags them
/// so; the fleet test checks the tags exist).
#[test]
fn manifests_name_this_version_s_images() {
    for (file, program) in [("kas.yaml", "kas"), ("agentk.yaml", "agentk")] {
        let docs = documents(file);
        let image =
            &kind(&docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"];
        let want = format!("kas-router/{program}:{}", env!("CARGO_PKG_VERSION"));
        assert_eq!(image.as_str(), Some(want.as_str()), "{file}");
    }
}

#[test]
fn kas_example_config_is_valid() {
    let text = std::fs::read_to_string(deploy("kas-config.example.yaml")).unwrap();
    let config = check_kas_config(&text);
    assert!(config.redis.is_some());
}

#[test]
fn agentk_manifest_wires_downward_api_rbac_token_and_known_flags() {
    let docs = documents("agentk.yaml");
    let deployment = kind(&docs, "Deployment");
    let pod = &deployment["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let env: Vec<&Value> = container["env"].as_sequence().unwrap().iter().collect();
    let field_ref = |name: &str| {
        env.iter()
            .find(|e| e["name"] == name)
            .map(|e| e["valueFrom"]["fieldRef"]["fieldPath"].clone())
    };
    assert_eq!(
        field_ref("POD_NAMESPACE"),
        Some("metadata.namespace".into())
    );
    assert_eq!(field_ref("POD_NAME"), Some("metadata.name".into()));

    let account = kind(&docs, "ServiceAccount")["metadata"]["name"].clone();
    assert_eq!(pod["serviceAccountName"], account);
    let binding = kind(&docs, "ClusterRoleBinding");
    assert_eq!(binding["subjects"][0]["name"], account);
    let role = kind(&docs, "ClusterRole");
    assert_eq!(binding["roleRef"]["name"], role["metadata"]["name"]);
    let rule = &role["rules"][0];
    assert!(
        rule["resources"]
            .as_sequence()
            .unwrap()
            .contains(&"pods".into())
    );
    assert!(
        rule["verbs"]
            .as_sequence()
            .unwrap()
            .contains(&"list".into())
    );

    let secret = kind(&docs, "Secret")["metadata"]["name"].clone();
    assert_eq!(pod["volumes"][0]["secret"]["secretName"], secret);
    let token_file = env
        .iter()
        .find(|e| e["name"] == "AGENTK_TOKEN_FILE")
        .map(|e| e["value"].as_str().unwrap().to_string())
        .unwrap();
    let mount = container["volumeMounts"][0]["mountPath"].as_str().unwrap();
    assert_eq!(token_file, format!("{mount}/token"));

    let kas = env
        .iter()
        .find(|e| e["name"] == "AGENTK_KAS")
        .and_then(|e| e["value"].as_str())
        .expect("AGENTK_KAS");
    let url = kas_transport::tls::KasUrl::parse(kas).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        url.tls && url.websocket,
        "agentk dials kas with wss://: {kas}"
    );

    // Every flag in the manifest is one agentk accepts.
    let help = std::process::Command::new(support::bin("agentk"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for arg in container["args"].as_sequence().unwrap() {
        let flag = arg.as_str().unwrap().split('=').next().unwrap();
        assert!(help.contains(flag), "agentk has no {flag}:\n{help}");
    }
}
