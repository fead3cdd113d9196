//! Part 9, instructions: what a call costs kas in instructions, counted by valgrind's
//! callgrind over a fixed number of calls on each route: GitLab's unary GetPods, then a
//! Kubernetes API `GET /api/v1/pods`. Unlike CPU time, the count hardly depends on what
//! else the machine runs, so two builds can be compared on any machine, 2 cores included.
//! Callgrind runs kas some 50 times slower: the calls are few, one at a time and then 16
//! at once, after a warm-up that is not counted.

use crate::setup::{self, KasOptions, World};
use crate::unary::{self, CallFn};
use crate::{agent_with, gitlab, kube, pair, stop};
use kas_tools::local::kas_process::KasProcess;
use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

/// Calls in flight at each point.
const CONCURRENCY: [usize; 2] = [1, 16];

/// The part: `calls` calls per kind, route and concurrency; the `top` functions of each
/// kas by inclusive and by own count at the first point of each kind and route.
pub async fn part(
    world: &mut World,
    base: KasOptions,
    calls: usize,
    top: usize,
) -> Result<Value, String> {
    let version = Command::new("valgrind").arg("--version").output();
    if !version.is_ok_and(|o| o.status.success()) {
        return Err("the instructions part needs valgrind (apt-get install valgrind)".into());
    }
    let options = KasOptions {
        callgrind: true,
        kubernetes_api: true,
        ..base
    };
    // `a` holds the agent; `b` forwards to it.
    let (a, b) = pair(world, options).await?;
    let server = kube::api_server().await?;
    let modules = setup::modules(|| {}).with_kubernetes_api(kube::upstream(&server)?);
    let agents = vec![agent_with(world, &a, 1, false, modules.into(), 256).await?];
    println!("\n## Instructions per call (callgrind, {calls} calls a point)\n");
    println!(
        "| call | route | in flight | serving kas | routing kas | both | both / local route's | errors |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let unary = [
        unary::routed(gitlab(world, &a, false).await?, 1),
        unary::routed(gitlab(world, &b, false).await?, 1),
    ];
    let get = |k: &KasProcess| kube::getter(kube::route("kas", k), "/api/v1/pods");
    let kinds = [("GetPods", unary), ("GET /api/v1/pods", [get(&a), get(&b)])];
    let mut rows = Vec::new();
    let mut profiles = Vec::new();
    for (kind, [on_a, on_b]) in &kinds {
        let mut local = Vec::new();
        for (route, call) in [("local", on_a), ("remote", on_b)] {
            for (i, &concurrency) in CONCURRENCY.iter().enumerate() {
                count(call, concurrency, calls / 4 + 1).await; // warm-up
                for k in [&a, &b] {
                    callgrind_control(k, "--zero")?;
                }
                let errors = count(call, concurrency, calls).await;
                let mut per_call = Vec::new();
                for (k, which) in [(&a, "serving"), (&b, "routing")] {
                    let dump = dump(world, k).await?;
                    per_call.push(total(&dump)? as f64 / calls as f64);
                    if i == 0 && (route == "remote" || which == "serving") {
                        let title = format!("{kind}, {route} route, {which} kas");
                        profiles.push(profile(&dump, &title, calls, top)?);
                    }
                }
                let (serving, routing) = (per_call[0], per_call[1]);
                // On the local route the other kas only idles: its count is not the call's.
                let both = if route == "local" {
                    serving
                } else {
                    serving + routing
                };
                if route == "local" {
                    local.push(both);
                }
                let ratio = both / local[i].max(1.0);
                let routing_shown = match route {
                    "local" => "-".into(),
                    _ => format!("{routing:.0}"),
                };
                println!(
                    "| {kind} | {route} | {concurrency} | {serving:.0} | {routing_shown} | {both:.0} | {ratio:.2} | {errors} |",
                );
                rows.push(json!({
                    "call": kind, "route": route, "concurrency": concurrency, "calls": calls,
                    "errors": errors,
                    "serving_kas_instructions_per_call": serving,
                    "routing_kas_instructions_per_call": (route == "remote").then_some(routing),
                    "instructions_per_call": both, "ratio_to_local": ratio,
                }));
            }
        }
    }
    for p in &profiles {
        println!("{}", p["text"].as_str().unwrap_or_default());
    }
    stop(agents).await;
    Ok(json!({ "points": rows, "profiles": profiles }))
}

/// Makes `n` calls, `concurrency` at a time; returns how many failed.
async fn count(call: &CallFn, concurrency: usize, n: usize) -> usize {
    let workers: Vec<_> = (0..concurrency)
        .map(|w| {
            let call = call.clone();
            let mine = n / concurrency + usize::from(w < n % concurrency);
            tokio::spawn(async move {
                let mut errors = 0;
                for _ in 0..mine {
                    errors += usize::from(call().await.is_err());
                }
                errors
            })
        })
        .collect();
    let mut errors = 0;
    for w in workers {
        errors += w.await.unwrap_or(1);
    }
    errors
}

/// Runs `callgrind_control OPTION PID` for kas `k`.
fn callgrind_control(k: &KasProcess, option: &str) -> Result<(), String> {
    let pid = k.pid().ok_or("kas is not running")?.to_string();
    let out = Command::new("callgrind_control")
        .args([option, &pid])
        .output()
        .map_err(|e| format!("callgrind_control: {e}"))?;
    match out.status.success() {
        true => Ok(()),
        false => Err(format!(
            "callgrind_control {option} {pid}: {}",
            String::from_utf8_lossy(&out.stderr)
        )),
    }
}

/// Has kas `k` write its counts since the last zeroing; returns the new dump's path.
async fn dump(world: &World, k: &KasProcess) -> Result<PathBuf, String> {
    let pid = k.pid().ok_or("kas is not running")?.to_string();
    let dumps = || {
        let base = world.callgrind_file(&pid);
        let name = base.file_name().map(|n| n.to_string_lossy().into_owned());
        let dir = base.parent().map(PathBuf::from).unwrap_or_default();
        let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let file = e.file_name().to_string_lossy().into_owned();
                let part = file.strip_prefix(name.as_deref()?)?.strip_prefix('.')?;
                Some((part.parse().ok()?, e.path()))
            })
            .collect();
        found.sort();
        found
    };
    let before = dumps().len();
    callgrind_control(k, "--dump")?;
    // The dump is written when kas next runs (its timers wake it at least every second).
    for _ in 0..300 {
        let found = dumps();
        if found.len() > before
            && let Some((_, path)) = found.last()
            && std::fs::read_to_string(path).is_ok_and(|t| t.contains("\ntotals:"))
        {
            return Ok(path.clone());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!("callgrind wrote no dump for kas {pid} within 30 s"))
}

/// The instructions a dump counted (its `totals:` line).
fn total(dump: &PathBuf) -> Result<u64, String> {
    let text = std::fs::read_to_string(dump).map_err(|e| format!("{}: {e}", dump.display()))?;
    text.lines()
        .find_map(|l| l.strip_prefix("totals:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| format!("{}: no totals line", dump.display()))
}

/// The `top` functions of a dump per call, from `callgrind_annotate`: by inclusive count
/// (where the time goes, frames holding everything left out) and by their own (what
/// does the work).
fn profile(dump: &PathBuf, what: &str, calls: usize, top: usize) -> Result<Value, String> {
    let mut text = String::new();
    let mut out = json!({ "what": what });
    for (inclusive, title) in [(true, "inclusive"), (false, "own")] {
        let functions = functions(dump, inclusive, calls, top)?;
        text += &format!(
            "\n### {what}: top {top} functions by {title} instructions per call\n\n\
             | instructions per call | share | function |\n|---|---|---|\n"
        );
        for f in &functions {
            text += &format!(
                "| {:.0} | {} | `{}` |\n",
                f["per_call"].as_f64().unwrap_or(0.0),
                f["share"].as_str().unwrap_or(""),
                f["function"].as_str().unwrap_or("")
            );
        }
        out[title] = Value::Array(functions);
    }
    out["text"] = Value::String(text);
    Ok(out)
}

fn functions(
    dump: &PathBuf,
    inclusive: bool,
    calls: usize,
    top: usize,
) -> Result<Vec<Value>, String> {
    let out = Command::new("callgrind_annotate")
        .arg(format!(
            "--inclusive={}",
            if inclusive { "yes" } else { "no" }
        ))
        .arg("--threshold=100")
        .arg(dump)
        .output()
        .map_err(|e| format!("callgrind_annotate: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut functions = Vec::new();
    // Lines like `1,234,567 (81.20%)  file:function [object]`, after the header; the
    // threads' and the runtime's frames, which hold everything, left out.
    for line in text.lines().skip_while(|l| !l.contains("file:function")) {
        let Some((count, rest)) = line.trim().split_once(' ') else {
            continue;
        };
        let Ok(count) = count.replace(',', "").parse::<u64>() else {
            continue;
        };
        let Some((share, function)) = rest.trim().split_once(')') else {
            continue;
        };
        let share = share.trim_start_matches('(').trim().to_string();
        if share
            .trim_end_matches('%')
            .parse::<f64>()
            .is_ok_and(|s| s >= 99.0)
        {
            continue;
        }
        let function = function_name(function.trim());
        let per_call = count as f64 / calls as f64;
        functions.push(json!({ "per_call": per_call, "share": share, "function": function }));
        if functions.len() == top {
            break;
        }
    }
    Ok(functions)
}

/// The function of `file:function [object]`, without its file and object.
fn function_name(annotated: &str) -> &str {
    let annotated = annotated.split(" [").next().unwrap_or(annotated);
    let bytes = annotated.as_bytes();
    // The file ends at the first `:` that is not half of a `::`.
    let colon = (0..bytes.len()).find(|&i| {
        bytes[i] == b':' && bytes.get(i + 1) != Some(&b':') && (i == 0 || bytes[i - 1] != b':')
    });
    colon.map_or(annotated, |i| &annotated[i + 1..])
}
