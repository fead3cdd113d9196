//! The node's scripts: `SCRIPT LOAD`, `EVAL` and `EVALSHA` run the store's Lua in Lua 5.1,
//! as Redis does, with `KEYS`, `ARGV` and `redis.call` bound to the node. A script is
//! atomic (nothing else runs meanwhile); an error stops it where it is, and what it wrote
//! before stays written, as in Redis.

use super::resp::Reply;
use mlua::{Function, Lua, MultiValue, Value};
use std::collections::BTreeMap;

/// The scripts a node has loaded (lost when it restarts) and the Lua they run in.
#[derive(Default)]
pub(super) struct Scripts {
    lua: Lua,
    /// Each script compiled, by SHA1 as `EVALSHA` names it (or why it does not compile).
    loaded: BTreeMap<String, Result<Function, String>>,
}

impl std::fmt::Debug for Scripts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scripts")
            .field("loaded", &self.loaded.keys())
            .finish()
    }
}

impl Scripts {
    /// `SCRIPT LOAD`: the script's SHA1.
    pub(super) fn load(&mut self, code: &[u8]) -> String {
        let code = String::from_utf8_lossy(code);
        let sha = redis::Script::new(&code).get_hash().to_string();
        // A shebang line (`#!lua flags=..`) is Redis's, not Lua's.
        let body = match code.strip_prefix("#!") {
            Some(rest) => rest.split_once('\n').map_or("", |(_, body)| body),
            None => &code,
        };
        let compiled = self.lua.load(body).set_name("user_script").into_function();
        self.loaded
            .insert(sha.clone(), compiled.map_err(|e| e.to_string()));
        sha
    }

    /// Runs the script `sha` names with `KEYS` and `ARGV`, each `redis.call` answered by
    /// `call`; `None` if no such script is loaded.
    pub(super) fn run(
        &self,
        sha: &[u8],
        keys: &[Vec<u8>],
        argv: &[Vec<u8>],
        call: &mut dyn FnMut(Vec<Vec<u8>>) -> Reply,
    ) -> Option<Reply> {
        let sha = std::str::from_utf8(sha).ok()?.to_ascii_lowercase();
        let script = match self.loaded.get(&sha)? {
            Ok(script) => script,
            Err(e) => return Some(Reply::Error(format!("ERR Error compiling script: {e}"))),
        };
        let lua = &self.lua;
        let ran = lua.scope(|scope| {
            let bridge = scope.create_function_mut(|lua, args: MultiValue| {
                let args = args
                    .iter()
                    .map(argument)
                    .collect::<mlua::Result<Vec<_>>>()?;
                match call(args) {
                    Reply::Error(e) => Err(mlua::Error::RuntimeError(e)),
                    reply => to_lua(lua, reply),
                }
            })?;
            let redis = lua.create_table()?;
            redis.set("call", bridge)?;
            let globals = lua.globals();
            globals.set("redis", redis)?;
            globals.set("KEYS", strings(lua, keys)?)?;
            globals.set("ARGV", strings(lua, argv)?)?;
            script.call::<Value>(())
        });
        Some(match ran {
            Ok(value) => from_lua(&value),
            Err(e) => Reply::Error(format!("ERR Error running script: {e}")),
        })
    }
}

fn strings(lua: &Lua, items: &[Vec<u8>]) -> mlua::Result<mlua::Table> {
    let strings = items
        .iter()
        .map(|s| lua.create_string(s))
        .collect::<mlua::Result<Vec<_>>>()?;
    lua.create_sequence_from(strings)
}

/// A `redis.call` argument as Redis takes it: a string, or a number written out.
fn argument(value: &Value) -> mlua::Result<Vec<u8>> {
    match value {
        Value::String(s) => Ok(s.as_bytes().to_vec()),
        Value::Integer(n) => Ok(n.to_string().into_bytes()),
        Value::Number(n) if n.fract() == 0.0 => Ok(format!("{}", *n as i64).into_bytes()),
        Value::Number(n) => Ok(n.to_string().into_bytes()),
        other => Err(mlua::Error::RuntimeError(format!(
            "Lua redis lib command arguments must be strings or integers, not {}",
            other.type_name()
        ))),
    }
}

/// A reply as Redis hands it to Lua.
fn to_lua(lua: &Lua, reply: Reply) -> mlua::Result<Value> {
    Ok(match reply {
        Reply::Int(n) => Value::Number(n as f64),
        Reply::Bulk(b) => Value::String(lua.create_string(&b)?),
        Reply::Nil => Value::Boolean(false),
        Reply::Status(s) => {
            let t = lua.create_table()?;
            t.set("ok", s)?;
            Value::Table(t)
        }
        Reply::Array(items) => {
            let items = items
                .into_iter()
                .map(|r| to_lua(lua, r))
                .collect::<mlua::Result<Vec<_>>>()?;
            Value::Table(lua.create_sequence_from(items)?)
        }
        Reply::Error(e) => return Err(mlua::Error::RuntimeError(e)),
    })
}

/// A script's return value as Redis answers it.
fn from_lua(value: &Value) -> Reply {
    match value {
        Value::Integer(n) => Reply::Int(*n),
        Value::Number(n) => Reply::Int(*n as i64),
        Value::String(s) => Reply::Bulk(s.as_bytes().to_vec()),
        Value::Boolean(true) => Reply::Int(1),
        Value::Table(t) => Reply::Array(
            t.clone()
                .sequence_values::<Value>()
                .map(|v| v.map_or(Reply::Nil, |v| from_lua(&v)))
                .collect(),
        ),
        _ => Reply::Nil,
    }
}
