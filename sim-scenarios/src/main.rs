//! `kas-sim-run`: runs named simulation scenarios over a range of seeds and prints each
//! seed's outcome, a table per scenario, and for a failure the command that replays it.
//!
//! Only in the madsim build:
//! `RUSTFLAGS="--cfg madsim" CARGO_TARGET_DIR=target/sim cargo run --profile sim -p kas-sim-scenarios -- --scenario all --seeds 1..1000`

#[cfg(not(madsim))]
fn main() -> std::process::ExitCode {
    eprintln!(
        "kas-sim-run runs only in the madsim build:\n  RUSTFLAGS=\"--cfg madsim\" CARGO_TARGET_DIR=target/sim cargo run --profile sim -p kas-sim-scenarios -- --scenario all --seeds 1..100"
    );
    std::process::ExitCode::from(2)
}

/// Most of a run's time not spent simulating is spent in malloc and free.
#[cfg(madsim)]
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[cfg(madsim)]
fn main() -> std::process::ExitCode {
    sim::main()
}

#[cfg(madsim)]
mod sim {
    use kas_sim::checker::{Stats, quantile};
    use kas_sim::scenario::{self, Scenario};
    use std::process::ExitCode;
    use std::time::{Duration, Instant};

    const USAGE: &str =
        "usage: kas-sim-run --scenario NAME|all --seeds A..B [--jobs N] [--check-determinism]
  --scenario   steady kas-crash partition redis-restart reconnect-storm agent-churn swarm
               rolling-restart kas-crash-ha, or all
  --seeds      seeds A to B, B excluded (default 1..101)
  --jobs       seeds run at once, each in a process of its own (default: the number of CPUs)
  --check-determinism   run every seed twice and fail it if the two reports differ
RUST_LOG=info shows the logs of the kas, agents and faults (for replaying one seed).";

    struct Args {
        scenarios: Vec<Scenario>,
        seeds: std::ops::Range<u64>,
        jobs: usize,
        check_determinism: bool,
    }

    fn args() -> Result<Args, String> {
        let mut a = Args {
            scenarios: Scenario::ALL.to_vec(),
            seeds: 1..101,
            jobs: std::thread::available_parallelism().map_or(1, |n| n.get()),
            check_determinism: false,
        };
        let mut it = std::env::args().skip(1);
        while let Some(arg) = it.next() {
            match arg.as_str() {
                "--scenario" => {
                    let name = it.next().ok_or("--scenario needs a name")?;
                    a.scenarios = if name == "all" {
                        Scenario::ALL.to_vec()
                    } else {
                        vec![Scenario::parse(&name).ok_or(format!("no scenario {name:?}"))?]
                    };
                }
                "--seeds" => {
                    let r = it.next().ok_or("--seeds needs A..B")?;
                    let (lo, hi) = r.split_once("..").ok_or(format!("--seeds {r}: not A..B"))?;
                    let parse = |s: &str| s.parse::<u64>().map_err(|e| format!("--seeds {r}: {e}"));
                    a.seeds = parse(lo)?..parse(hi)?;
                }
                "--jobs" => {
                    let n = it.next().ok_or("--jobs needs a number")?;
                    a.jobs = match n.parse::<usize>() {
                        Ok(n) if n > 0 => n,
                        _ => return Err(format!("--jobs {n}: not a positive number")),
                    };
                }
                "--check-determinism" => a.check_determinism = true,
                "--help" | "-h" => return Err(String::new()),
                other => return Err(format!("unknown argument {other:?}")),
            }
        }
        Ok(a)
    }

    fn ms(d: Duration) -> String {
        format!("{:.1}ms", d.as_secs_f64() * 1000.0)
    }

    /// What starts the lines a child process reports its run with.
    const TAG: &str = "@kas-sim ";

    /// Runs one seed in this process and prints its report as tagged lines (`--child`).
    fn child(s: Scenario, seed: u64) -> ExitCode {
        let mut rt =
            madsim::runtime::Runtime::with_seed_and_config(seed, madsim::Config::default());
        rt.set_time_limit(Duration::from_secs(600));
        let r = rt.block_on(scenario::run(s));
        let st = &r.stats;
        let ns = |d: Duration| d.as_nanos();
        println!(
            "{TAG}stats {} {} {} {} {} {} {}",
            st.requests,
            st.delivered,
            ns(st.p50),
            ns(st.p99),
            ns(st.wakeup_p50),
            ns(st.wakeup_p99),
            r.faults
        );
        for (code, n) in &st.errors {
            println!("{TAG}error {n} {code}");
        }
        for w in &r.wakeups {
            println!("{TAG}wakeup {}", ns(*w));
        }
        for v in &r.violations {
            println!("{TAG}violation {}", v.replace('\n', " / "));
        }
        ExitCode::SUCCESS
    }

    /// Reads a child's tagged lines back into a report.
    fn parse_report(lines: &[&str]) -> Option<scenario::Report> {
        let mut report = scenario::Report {
            stats: Stats::default(),
            faults: 0,
            violations: Vec::new(),
            wakeups: Vec::new(),
        };
        let mut has_stats = false;
        let dur = |s: &str| s.parse::<u64>().ok().map(Duration::from_nanos);
        for line in lines {
            let (kind, rest) = line.split_once(' ').unwrap_or((line, ""));
            match kind {
                "stats" => {
                    let f: Vec<&str> = rest.split(' ').collect();
                    let [req, del, p50, p99, w50, w99, faults] = f[..] else {
                        return None;
                    };
                    let st = &mut report.stats;
                    st.requests = req.parse().ok()?;
                    st.delivered = del.parse().ok()?;
                    (st.p50, st.p99) = (dur(p50)?, dur(p99)?);
                    (st.wakeup_p50, st.wakeup_p99) = (dur(w50)?, dur(w99)?);
                    report.faults = faults.parse().ok()?;
                    has_stats = true;
                }
                "error" => {
                    let (n, code) = rest.split_once(' ')?;
                    report
                        .stats
                        .errors
                        .insert(code.to_string(), n.parse().ok()?);
                }
                "wakeup" => report.wakeups.push(dur(rest)?),
                "violation" => report.violations.push(rest.to_string()),
                _ => return None,
            }
        }
        has_stats.then_some(report)
    }

    /// Runs one seed in a process of its own, so that it cannot depend on the runs before
    /// it (std's hash keys, drawn once per thread, made a seed's outcome depend on the seeds
    /// run before it on the same thread). Returns the report and the
    /// tagged lines it was read from (what the determinism check compares); an `Err` is a
    /// crash, with the end of the child's output.
    fn run_seed(s: Scenario, seed: u64) -> Result<(scenario::Report, String), String> {
        let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
        let out = std::process::Command::new(exe)
            .args(["--child", s.name(), &seed.to_string()])
            // mimalloc hands freed pages back to the kernel, which zeroes them again when
            // the run touches them anew: a fifth of a run's time. A run is short-lived.
            .env("MIMALLOC_PURGE_DELAY", "-1")
            .output()
            .map_err(|e| format!("cannot start a run: {e}"))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let mut tagged = Vec::new();
        for line in stdout.lines() {
            match line.strip_prefix(TAG) {
                Some(t) => tagged.push(t),
                None => println!("{line}"), // logs, when RUST_LOG asks for them
            }
        }
        match parse_report(&tagged) {
            Some(r) if out.status.success() => Ok((r, tagged.join("\n"))),
            _ => {
                let stderr = String::from_utf8_lossy(&out.stderr);
                let tail: Vec<&str> = stderr.lines().rev().take(20).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                Err(format!(
                    "crashed ({})\n    {}",
                    out.status,
                    tail.join("\n    ")
                ))
            }
        }
    }

    /// Runs a seed twice, in two processes: the runs must report the same, line for line.
    fn run_twice(s: Scenario, seed: u64) -> Result<scenario::Report, String> {
        let (report, first) = run_seed(s, seed)?;
        let (_, second) = run_seed(s, seed)?;
        match first.lines().zip(second.lines()).find(|(a, b)| a != b) {
            None if first == second => Ok(report),
            diff => Err(format!(
                "not deterministic: two runs of the seed reported differently: {:?}",
                diff.unwrap_or(("(one report is longer)", ""))
            )),
        }
    }

    /// Runs every (scenario, seed) of `runs` (each twice when `twice`) on `jobs` workers; hands each outcome to
    /// `each` in the order of `runs`.
    fn run_all(
        runs: &[(Scenario, u64)],
        jobs: usize,
        twice: bool,
        mut each: impl FnMut(Scenario, u64, Result<scenario::Report, String>),
    ) {
        let next = std::sync::atomic::AtomicUsize::new(0);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            for _ in 0..jobs.min(runs.len()) {
                let (tx, next) = (tx.clone(), &next);
                scope.spawn(move || {
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(s, seed)) = runs.get(i) else { break };
                        let outcome = if twice {
                            run_twice(s, seed)
                        } else {
                            run_seed(s, seed).map(|(r, _)| r)
                        };
                        if tx.send((i, outcome)).is_err() {
                            break;
                        }
                    }
                });
            }
            drop(tx);
            let mut done = std::collections::BTreeMap::new();
            let mut printed = 0;
            for (i, outcome) in rx {
                done.insert(i, outcome);
                while let Some(outcome) = done.remove(&printed) {
                    let (s, seed) = runs[printed];
                    each(s, seed, outcome);
                    printed += 1;
                }
            }
        });
    }

    /// One scenario's totals over its seeds.
    #[derive(Default)]
    struct Totals {
        all: Stats,
        p50s: Vec<Duration>,
        p99s: Vec<Duration>,
        wakeups: Vec<Duration>,
        faults: usize,
    }

    pub fn main() -> ExitCode {
        // Logs only when RUST_LOG asks for them (`RUST_LOG=info` to follow a replay): with
        // a logger, madsim enters a span at every poll of every task, a sixth of a run's
        // time. Set up on another thread: madsim seeds std's hash keys of the thread a run
        // starts on only if nothing on it has drawn them yet, and the logger's maps would.
        if std::env::var_os("RUST_LOG").is_some() {
            let _ = std::thread::spawn(madsim::runtime::init_logger).join();
        }
        let argv: Vec<String> = std::env::args().collect();
        if let [_, flag, name, seed] = &argv[..]
            && flag == "--child"
        {
            return match (Scenario::parse(name), seed.parse()) {
                (Some(s), Ok(seed)) => child(s, seed),
                _ => ExitCode::from(2),
            };
        }
        let a = match args() {
            Ok(a) => a,
            Err(e) => {
                if !e.is_empty() {
                    eprintln!("kas-sim-run: {e}");
                }
                eprintln!("{USAGE}");
                return ExitCode::from(2);
            }
        };
        let runs: Vec<(Scenario, u64)> = a
            .scenarios
            .iter()
            .flat_map(|&s| a.seeds.clone().map(move |seed| (s, seed)))
            .collect();
        let started = Instant::now();
        let mut failed = Vec::new();
        let mut totals: Vec<Totals> = a.scenarios.iter().map(|_| Totals::default()).collect();
        run_all(
            &runs,
            a.jobs,
            a.check_determinism,
            |s, seed, outcome| match outcome {
                Ok(r) if r.violations.is_empty() => {
                    println!(
                        "{} seed {seed}: ok  requests={} delivered={} errors={:?} p50={} p99={} wake-up p50={} p99={} faults={}",
                        s.name(),
                        r.stats.requests,
                        r.stats.delivered,
                        r.stats.errors,
                        ms(r.stats.p50),
                        ms(r.stats.p99),
                        ms(r.stats.wakeup_p50),
                        ms(r.stats.wakeup_p99),
                        r.faults
                    );
                    let t = &mut totals[a.scenarios.iter().position(|&x| x == s).unwrap_or(0)];
                    t.all.requests += r.stats.requests;
                    t.all.delivered += r.stats.delivered;
                    for (k, v) in r.stats.errors {
                        *t.all.errors.entry(k).or_default() += v;
                    }
                    t.p50s.push(r.stats.p50);
                    t.p99s.push(r.stats.p99);
                    t.wakeups.extend(r.wakeups);
                    t.faults += r.faults;
                }
                outcome => {
                    let why = match outcome {
                        Ok(r) => r.violations.join("\n    "),
                        Err(e) => e,
                    };
                    println!("{} seed {seed}: FAILED\n    {why}", s.name());
                    println!(
                        "    replay: RUSTFLAGS=\"--cfg madsim\" CARGO_TARGET_DIR=target/sim cargo run --profile sim -p kas-sim-scenarios -- --scenario {} --seeds {seed}..{}",
                        s.name(),
                        seed + 1
                    );
                    failed.push((s, seed));
                }
            },
        );
        let minutes = started.elapsed().as_secs_f64() / 60.0;
        println!(
            "\n| scenario | seeds | requests | delivered | errors | p50 (median of seeds) | p99 (median of seeds) | wake-up p50 | wake-up p99 | faults |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|");
        for (s, t) in a.scenarios.iter().zip(&mut totals) {
            t.p50s.sort();
            t.p99s.sort();
            t.wakeups.sort();
            let median = |v: &[Duration]| quantile(v, 0.5);
            println!(
                "| {} | {} | {} | {} | {:?} | {} | {} | {} | {} | {} |",
                s.name(),
                a.seeds.end.saturating_sub(a.seeds.start),
                t.all.requests,
                t.all.delivered,
                t.all.errors,
                ms(median(&t.p50s)),
                ms(median(&t.p99s)),
                ms(quantile(&t.wakeups, 0.5)),
                ms(quantile(&t.wakeups, 0.99)),
                t.faults
            );
        }
        println!(
            "\n{} runs in {:.1} s on {} jobs: {:.0} seeds per minute; {} failed",
            runs.len(),
            minutes * 60.0,
            a.jobs,
            runs.len() as f64 / minutes.max(1e-9),
            failed.len()
        );
        if failed.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    }
}
