//! Writes a kas configuration file from GitLab kas's dotted key names: what kas-local,
//! kas-bench, the simulation and the tests start kas with, in one form that the parser
//! reads back (no hand-indented YAML templates).

use serde_yaml::{Mapping, Value};
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

/// A configuration being written: keys set by their dotted names, later ones winning.
#[derive(Clone, Debug, Default)]
pub struct ConfigWriter(Mapping);

impl ConfigWriter {
    /// An empty configuration (every key at its default).
    pub fn new() -> ConfigWriter {
        ConfigWriter::default()
    }

    /// Sets `key` (dotted, like `agent.listen.address`) to `value`: a string, number,
    /// boolean, or list of them.
    pub fn set(mut self, key: &str, value: impl Into<Value>) -> ConfigWriter {
        let mut map = &mut self.0;
        let mut parts = key.split('.').peekable();
        while let Some(part) = parts.next() {
            let name = Value::String(part.to_string());
            if parts.peek().is_none() {
                map.insert(name, value.into());
                break;
            }
            let entry = map
                .entry(name)
                .or_insert_with(|| Value::Mapping(Mapping::new()));
            if !entry.is_mapping() {
                *entry = Value::Mapping(Mapping::new());
            }
            map = entry.as_mapping_mut().expect("made a mapping above");
        }
        self
    }

    /// Removes `key` (dotted): it takes its default again.
    pub fn unset(mut self, key: &str) -> ConfigWriter {
        let (path, last) = key.rsplit_once('.').unwrap_or(("", key));
        let mut map = &mut self.0;
        for part in path.split('.').filter(|p| !p.is_empty()) {
            match map.get_mut(part).and_then(Value::as_mapping_mut) {
                Some(inner) => map = inner,
                None => return self,
            }
        }
        map.remove(last);
        self
    }

    /// A kas listening on `listen` (agent, api, private API, observability) that reads
    /// its agent tokens and secrets from `dir`: `tokens.yaml`, `gitlab.secret` and
    /// `kas.secret` (the layout kas-bench, the simulation and the tests write).
    pub fn kas_in(dir: &Path, listen: [SocketAddr; 4]) -> ConfigWriter {
        let [agent, api, private, observability] = listen.map(|a| a.to_string());
        ConfigWriter::new()
            .set("agent.listen.address", agent)
            .path("agent.tokens_file", &dir.join("tokens.yaml"))
            .set("api.listen.address", api)
            .path(
                "api.listen.authentication_secret_file",
                &dir.join("gitlab.secret"),
            )
            .set("private_api.listen.address", private)
            .path(
                "private_api.listen.authentication_secret_file",
                &dir.join("kas.secret"),
            )
            .set("observability.listen.address", observability)
    }

    /// Sets `key` to a file's path.
    pub fn path(self, key: &str, path: &Path) -> ConfigWriter {
        self.set(key, path.display().to_string())
    }

    /// Sets `key` to a duration, in milliseconds.
    pub fn duration(self, key: &str, d: Duration) -> ConfigWriter {
        self.set(key, format!("{}ms", d.as_millis()))
    }

    /// Sets every key of `fragment`, a YAML document laid out like the configuration
    /// (for keys a caller writes as YAML); its keys win.
    pub fn merge(mut self, fragment: &str) -> Result<ConfigWriter, serde_yaml::Error> {
        if let Value::Mapping(m) = serde_yaml::from_str(fragment)? {
            merge(&mut self.0, m);
        }
        Ok(self)
    }

    /// The file's text.
    pub fn text(&self) -> String {
        serde_yaml::to_string(&self.0).expect("a mapping of strings serializes")
    }
}

fn merge(into: &mut Mapping, from: Mapping) {
    for (k, v) in from {
        match (into.get_mut(&k), v) {
            (Some(Value::Mapping(inner)), Value::Mapping(v)) => merge(inner, v),
            (_, v) => {
                into.insert(k, v);
            }
        }
    }
}
