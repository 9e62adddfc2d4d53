//! `lanes demo`: short, realistic workloads through the library, one scenario per primitive,
//! each with live progress and a final table read from the registry's snapshot.

use std::time::Duration;

use lanes::BoxError;

mod channel;
mod keyed;
mod limits;
mod runs;

/// Which scenarios to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Scenario {
    /// Every scenario, one after the other.
    All,
    /// Run lanes: owned runs, overload, close.
    Lanes,
    /// Limits: tenants with skewed load sharing one downstream limit.
    Limits,
    /// Keyed pool: versioned entity updates with one slow entity, per-key vs hashed shards.
    Keyed,
    /// Channel: a fast producer, a slow batching consumer, spill, a crash and a restart.
    Channel,
}

/// `--seconds`: a number from 0.5 to 60 (a NaN or an infinity made the demo panic).
fn demo_seconds(text: &str) -> Result<f64, String> {
    let seconds: f64 = text.parse().map_err(|e| format!("{e}"))?;
    if !(0.5..=60.0).contains(&seconds) {
        return Err(format!("{text}: from 0.5 to 60 seconds"));
    }
    Ok(seconds)
}

/// Options of `lanes demo`.
#[derive(Debug, clap::Args)]
pub(crate) struct DemoArgs {
    /// The scenario to run.
    #[arg(value_enum, default_value_t = Scenario::All)]
    scenario: Scenario,
    /// Jobs submitted in the run-lane scenario's steady phase.
    #[arg(long, default_value_t = 10_000)]
    runs: usize,
    /// Jobs submitted at once in the run-lane scenario's overload burst.
    #[arg(long, default_value_t = 3_000)]
    burst: usize,
    /// How long tenants send requests in the limits scenario, in seconds (0.5 to 60).
    #[arg(long, default_value_t = 4.0, value_parser = demo_seconds)]
    seconds: f64,
    /// Orders emitted in the channel scenario (the crash comes halfway).
    #[arg(long, default_value_t = 20_000)]
    records: u64,
    /// Seed of the workloads' randomness (the same seed gives the same workload).
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// After the scenarios, write every metric they recorded to this file, in the Prometheus
    /// text format that `lanes serve` answers at `/metrics` (`-` for standard output).
    #[arg(long, value_name = "FILE")]
    metrics_out: Option<std::path::PathBuf>,
}

pub(crate) async fn run(args: DemoArgs) -> Result<(), BoxError> {
    let prometheus = args.metrics_out.as_ref().map(|_| lanes_server::embed::prometheus());
    let all = args.scenario == Scenario::All;
    if all || args.scenario == Scenario::Lanes {
        runs::run(&args).await?;
    }
    if all || args.scenario == Scenario::Limits {
        if all {
            println!("\n{}\n", "─".repeat(72));
        }
        limits::run(&args).await?;
    }
    if all || args.scenario == Scenario::Keyed {
        if all {
            println!("\n{}\n", "─".repeat(72));
        }
        keyed::run(&args).await?;
    }
    if all || args.scenario == Scenario::Channel {
        if all {
            println!("\n{}\n", "─".repeat(72));
        }
        channel::run(&args).await?;
    }
    if let (Some(path), Some(prometheus)) = (&args.metrics_out, prometheus) {
        let rendered = prometheus.render();
        if path.as_os_str() == "-" {
            print!("{rendered}");
        } else {
            std::fs::write(path, rendered)
                .map_err(|err| format!("cannot write {}: {err}", path.display()))?;
        }
    }
    Ok(())
}

/// xorshift64*: the demo needs repeatable variety, not statistical quality.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// Keeps simulated panics (whose message is `message`) off the terminal; any other panic still
/// prints.
fn quiet_panics(message: &'static str) {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info.payload_as_str() != Some(message) {
            previous(info);
        }
    }));
}

/// Jain's fairness index of `shares`: 1 when all are equal, 1/n when one takes everything.
fn jain(shares: &[f64]) -> f64 {
    let sum: f64 = shares.iter().sum();
    let squares: f64 = shares.iter().map(|x| x * x).sum();
    if squares == 0.0 { 1.0 } else { sum * sum / (shares.len() as f64 * squares) }
}
