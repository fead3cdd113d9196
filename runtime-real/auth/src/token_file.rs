//! Files of tokens read once at start: agent tokens (`agent.tokens_file`) and user and CI
//! job tokens (`agent.kubernetes_api.tokens_file`). Both are YAML, a list of entries under
//! one key, each with a `token` of at least [`MIN_TOKEN_LEN`] characters listed once;
//! errors name the file and the entry at fault.
// A std hash map on purpose: looked up by client-presented tokens, never iterated into an
// output; a random seed keeps lookup cost unrelated to the tokens' content.
#![allow(clippy::disallowed_types)]

use serde::de::DeserializeOwned;
use std::collections::HashMap;
use std::path::Path;

/// The shortest token accepted.
pub const MIN_TOKEN_LEN: usize = 16;

/// One entry of a tokens file.
pub trait Entry: DeserializeOwned {
    /// What its token stands for.
    type Value;
    /// Checks the entry and splits it into its token and value; an error says what is
    /// wrong with the entry (the loader names the entry).
    fn into_pair(self) -> Result<(String, Self::Value), String>;
}

/// The tokens of the file at `path`, whose entries are listed under `list`.
pub fn read<E: Entry>(path: &Path, list: &str) -> Result<HashMap<String, E::Value>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    parse::<E>(&text, list).map_err(|e| format!("{}: {e}", path.display()))
}

/// The tokens of a file's YAML `text`, whose entries are listed under `list`.
pub fn parse<E: Entry>(text: &str, list: &str) -> Result<HashMap<String, E::Value>, String> {
    let mut file: HashMap<String, Vec<E>> =
        serde_yaml::from_str(text).map_err(|e| e.to_string())?;
    if let Some(other) = file.keys().find(|k| *k != list) {
        return Err(format!(
            "unknown key `{other}`: tokens are listed under `{list}`"
        ));
    }
    let entries = file
        .remove(list)
        .ok_or_else(|| format!("no `{list}` list"))?;
    let mut by_token = HashMap::new();
    for (i, entry) in entries.into_iter().enumerate() {
        let (token, value) = entry.into_pair().map_err(|e| format!("{list}[{i}]: {e}"))?;
        if token.len() < MIN_TOKEN_LEN {
            return Err(format!(
                "{list}[{i}].token is shorter than {MIN_TOKEN_LEN} characters"
            ));
        }
        if by_token.insert(token, value).is_some() {
            return Err(format!("{list}[{i}].token is listed twice"));
        }
    }
    Ok(by_token)
}
