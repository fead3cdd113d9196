//! Which agentk versions this kas supports, and the warnings listings show for the others
//! (as GitLab's listing of an agent's connections warns of an outdated agentk).
//!
//! kas supports agentk of its own minor version and of the one before, within its major
//! version: kas is upgraded first, and agentk follows within a release. An agentk of a
//! newer minor version than kas may rely on what this kas lacks; patch releases of one
//! minor version work together.

use kas_proto::registry::AgentMeta;

/// The warnings about the replica that sent `meta`, for a kas of version `kas`.
pub fn warnings(meta: &AgentMeta, kas: &str) -> Vec<String> {
    let Some(ours) = parse(kas) else {
        return Vec::new(); // a kas built without a version compares nothing
    };
    let theirs = match parse(&meta.version) {
        Some(v) => v,
        None if meta.version.is_empty() => {
            return vec![
                "agentk reported no version: kas cannot tell whether it supports it".into(),
            ];
        }
        None => {
            return vec![format!(
                "agentk version {:?} is not MAJOR.MINOR.PATCH: kas cannot tell whether it supports it",
                meta.version
            )];
        }
    };
    let oldest = (ours.0, ours.1.saturating_sub(1));
    if (theirs.0, theirs.1) < oldest {
        vec![format!(
            "agentk {} is older than this kas ({kas}) supports: upgrade agentk to {}.{} or later",
            meta.version, oldest.0, oldest.1
        )]
    } else if (theirs.0, theirs.1) > (ours.0, ours.1) {
        vec![format!(
            "agentk {} is newer than this kas ({kas}): upgrade kas, agentk may rely on what this kas lacks",
            meta.version
        )]
    } else {
        Vec::new()
    }
}

/// `MAJOR.MINOR.PATCH` of a version such as `v17.6.1`, `0.1.0-rc1` or `1.2.3+build`.
fn parse(version: &str) -> Option<(u64, u64, u64)> {
    let core = version.strip_prefix('v').unwrap_or(version);
    let core = core.split(['-', '+']).next()?;
    let mut parts = core.split('.').map(|p| p.parse::<u64>().ok());
    let v = (parts.next()??, parts.next()??, parts.next()??);
    parts.next().is_none().then_some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn warned(agent: &str, kas: &str) -> Vec<String> {
        let meta = AgentMeta {
            version: agent.into(),
            ..Default::default()
        };
        warnings(&meta, kas)
    }

    #[test]
    fn an_agent_of_this_minor_or_the_one_before_is_supported() {
        for agent in ["17.6.0", "v17.6.3", "17.5.9", "17.6.1-rc1", "17.6.0+abc"] {
            assert_eq!(warned(agent, "17.6.1"), Vec::<String>::new(), "{agent}");
        }
        assert!(warned("0.1.0-at-upgrade-from", "0.1.0").is_empty());
    }

    #[test]
    fn an_older_agent_is_told_what_to_upgrade_to() {
        let w = warned("17.4.2", "17.6.1");
        assert_eq!(w.len(), 1);
        assert!(
            w[0].contains("older than this kas (17.6.1) supports: upgrade agentk to 17.5 or later"),
            "{w:?}"
        );
        assert_eq!(warned("16.11.0", "17.0.0").len(), 1, "another major");
    }

    #[test]
    fn a_newer_agent_is_named() {
        for agent in ["17.7.0", "v17.7.0-rc1", "18.0.0"] {
            let w = warned(agent, "17.6.1");
            assert!(
                w.len() == 1 && w[0].contains("newer than this kas"),
                "{agent}: {w:?}"
            );
        }
    }

    #[test]
    fn a_version_kas_cannot_read_is_named() {
        assert!(warned("", "17.6.1")[0].contains("no version"));
        for agent in ["17.6", "latest", "17.6.1.2", "v17.x.1"] {
            let w = warned(agent, "17.6.1");
            assert!(
                w.len() == 1 && w[0].contains("not MAJOR.MINOR.PATCH"),
                "{agent}: {w:?}"
            );
        }
    }
}
