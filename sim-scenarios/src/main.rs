//! `kas-sim-run`: runs named simulation scenarios over a range of seeds and prints each
//! seed's outcome, a table per scenario, and for a failure the command that replays it.
//!
//! Only in the madsim build:
//! `RUSTFLAGS="--cfg madsim" CARGO_TARGET_DIR=target/sim cargo run --release -p kas-sim-scenarios -- --scenario all --seeds 1..1000`

#[cfg(not(madsim))]
fn main() -> std::process::ExitCode {
    eprintln!(
        "kas-sim-run runs only in the madsim build:\n  RUSTFLAGS=\"--cfg madsim\" CARGO_TARGET_DIR=target/sim cargo run --release -p kas-sim-scenarios -- --scenario all --seeds 1..100"
    );
    std::process::ExitCode::from(2)
}

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

    const USAGE: &str = "usage: kas-sim-run --scenario NAME|all --seeds A..B   (B excluded)\nscenarios: steady kas-crash partition redis-restart reconnect-storm agent-churn swarm";

    fn args() -> Result<(Vec<Scenario>, std::ops::Range<u64>), String> {
        let mut scenarios = Scenario::ALL.to_vec();
        let mut seeds = 1..101;
        let mut it = std::env::args().skip(1);
        while let Some(a) = it.next() {
            match a.as_str() {
                "--scenario" => {
                    let name = it.next().ok_or("--scenario needs a name")?;
                    scenarios = if name == "all" {
                        Scenario::ALL.to_vec()
                    } else {
                        vec![Scenario::parse(&name).ok_or(format!("no scenario {name:?}"))?]
                    };
                }
                "--seeds" => {
                    let r = it.next().ok_or("--seeds needs A..B")?;
                    let (a, b) = r.split_once("..").ok_or(format!("--seeds {r}: not A..B"))?;
                    let parse = |s: &str| s.parse::<u64>().map_err(|e| format!("--seeds {r}: {e}"));
                    seeds = parse(a)?..parse(b)?;
                }
                "--help" | "-h" => return Err(String::new()),
                other => return Err(format!("unknown argument {other:?}")),
            }
        }
        Ok((scenarios, seeds))
    }

    fn ms(d: Duration) -> String {
        format!("{:.1}ms", d.as_secs_f64() * 1000.0)
    }

    /// Runs one seed; a panic inside the simulation counts as a violation.
    fn run_seed(s: Scenario, seed: u64) -> Result<scenario::Report, String> {
        let mut rt =
            madsim::runtime::Runtime::with_seed_and_config(seed, madsim::Config::default());
        rt.set_time_limit(Duration::from_secs(600));
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            rt.block_on(scenario::run(s))
        }))
        .map_err(|p| {
            p.downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panic".into())
        })
    }

    pub fn main() -> ExitCode {
        let (scenarios, seeds) = match args() {
            Ok(a) => a,
            Err(e) => {
                if !e.is_empty() {
                    eprintln!("kas-sim-run: {e}");
                }
                eprintln!("{USAGE}");
                return ExitCode::from(2);
            }
        };
        let started = Instant::now();
        let mut runs = 0u64;
        let mut failed = Vec::new();
        let mut table = Vec::new();
        for s in scenarios {
            let mut all = Stats::default();
            let (mut p50s, mut p99s) = (Vec::new(), Vec::new());
            let mut wakeups = Vec::new();
            let mut faults = 0;
            for seed in seeds.clone() {
                runs += 1;
                match run_seed(s, seed) {
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
                        all.requests += r.stats.requests;
                        all.delivered += r.stats.delivered;
                        for (k, v) in r.stats.errors {
                            *all.errors.entry(k).or_default() += v;
                        }
                        p50s.push(r.stats.p50);
                        p99s.push(r.stats.p99);
                        wakeups.extend(r.wakeups);
                        faults += r.faults;
                    }
                    outcome => {
                        let why = match outcome {
                            Ok(r) => r.violations.join("\n    "),
                            Err(panic) => format!("panicked: {panic}"),
                        };
                        println!("{} seed {seed}: FAILED\n    {why}", s.name());
                        println!(
                            "    replay: RUSTFLAGS=\"--cfg madsim\" CARGO_TARGET_DIR=target/sim cargo run --release -p kas-sim-scenarios -- --scenario {} --seeds {seed}..{}",
                            s.name(),
                            seed + 1
                        );
                        failed.push((s, seed));
                    }
                }
            }
            p50s.sort();
            p99s.sort();
            wakeups.sort();
            let median = |v: &[Duration]| quantile(v, 0.5);
            table.push(format!(
                "| {} | {} | {} | {} | {:?} | {} | {} | {} | {} | {} |",
                s.name(),
                seeds.end.saturating_sub(seeds.start),
                all.requests,
                all.delivered,
                all.errors,
                ms(median(&p50s)),
                ms(median(&p99s)),
                ms(quantile(&wakeups, 0.5)),
                ms(quantile(&wakeups, 0.99)),
                faults
            ));
        }
        let minutes = started.elapsed().as_secs_f64() / 60.0;
        println!(
            "\n| scenario | seeds | requests | delivered | errors | p50 (median of seeds) | p99 (median of seeds) | wake-up p50 | wake-up p99 | faults |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|");
        for row in &table {
            println!("{row}");
        }
        println!(
            "\n{runs} runs in {:.1} s: {:.0} seeds per minute; {} failed",
            minutes * 60.0,
            runs as f64 / minutes.max(1e-9),
            failed.len()
        );
        if failed.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    }
}
