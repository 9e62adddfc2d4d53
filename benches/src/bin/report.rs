//! Writes `BENCHMARKS.md` from criterion's results in `target/criterion`.
//!
//! Run through `benches/run.sh`, which runs the suites first. Every figure is the median of its
//! criterion run; ratios compare results of the *same* run.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// The median time of one criterion benchmark, in nanoseconds.
fn median_ns(root: &Path, id: &str) -> Option<f64> {
    let path = root.join(id).join("new").join("estimates.json");
    let text = std::fs::read_to_string(path).ok()?;
    let value: Value = serde_json::from_str(&text).ok()?;
    value["median"]["point_estimate"].as_f64()
}

fn shell(command: &str) -> String {
    Command::new("sh")
        .arg("-c")
        .arg(command)
        .output()
        .ok()
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".to_owned())
}

fn fmt_ns(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.2} µs", ns / 1e3)
    } else {
        format!("{ns:.1} ns")
    }
}

fn fmt_rate(per_second: f64) -> String {
    if per_second >= 1e6 {
        format!("{:.2} M/s", per_second / 1e6)
    } else {
        format!("{:.0} k/s", per_second / 1e3)
    }
}

struct Report {
    root: PathBuf,
    out: String,
    missing: Vec<String>,
}

impl Report {
    fn get(&mut self, id: &str) -> Option<f64> {
        let found = median_ns(&self.root, id);
        if found.is_none() {
            self.missing.push(id.to_owned());
        }
        found
    }

    fn line(&mut self, text: &str) {
        self.out.push_str(text);
        self.out.push('\n');
    }

    fn calibration(&mut self) -> (Option<f64>, Option<f64>) {
        let cas = self.get("calibration/atomic_cas");
        let mutex = self.get("calibration/mutex_lock_unlock");
        self.line("## Calibration (the floor on this host)\n");
        self.line("| floor | median |");
        self.line("|---|---|");
        for (name, value) in [
            ("uncontended atomic compare-and-swap", cas),
            ("`std::sync::Mutex` lock + unlock", mutex),
        ] {
            let cell = value.map_or("not run".to_owned(), fmt_ns);
            self.line(&format!("| {name} | {cell} |"));
        }
        self.line("");
        (cas, mutex)
    }

    /// Suite 2: run lanes.
    fn lanes(&mut self, cas: Option<f64>) {
        const RUNS: f64 = 1_000.0;
        self.line("## Suite 2 — run lane\n");
        self.line(
            "Admit → run → finalize of a no-op job: 1,000 runs admitted at once into a lane of 8 \
             execution slots (enough waiting room for all), until every finalizer has run. \
             Throughput in runs per second; ratio = ours / anchor (higher is better).\n",
        );
        self.line("| runtime | lanes | hand-rolled two-semaphore lane | ratio (bar ≥ 1.0) | tokio mpsc + 8 workers | ratio |");
        self.line("|---|---|---|---|---|---|");
        for runtime in ["current_thread", "multi_thread_2"] {
            let ours = self.get(&format!("lane_admit_run_finalize/lanes/{runtime}"));
            let hand =
                self.get(&format!("lane_admit_run_finalize/hand_rolled_two_semaphores/{runtime}"));
            let mpsc = self.get(&format!("lane_admit_run_finalize/tokio_mpsc_workers/{runtime}"));
            let rate = |t: Option<f64>| t.map_or("—".to_owned(), |t| fmt_rate(RUNS / (t / 1e9)));
            let ratio = |anchor: Option<f64>| match (ours, anchor) {
                (Some(o), Some(a)) => format!("{:.2}×", a / o),
                _ => "—".to_owned(),
            };
            let row = format!(
                "| {runtime} | {} | {} | {} | {} | {} |",
                rate(ours),
                rate(hand),
                ratio(hand),
                rate(mpsc),
                ratio(mpsc)
            );
            self.line(&row);
        }
        self.line("");
        self.line(
            "Reject path when the lane is full (time per refused admission; lower is better):\n",
        );
        self.line("| lanes | hand-rolled (`try_acquire_owned`) | tokio mpsc `try_send` | lanes in CAS floors (bar ≤ 20) |");
        self.line("|---|---|---|---|");
        let ours = self.get("lane_reject_when_full/lanes");
        let hand = self.get("lane_reject_when_full/hand_rolled_two_semaphores");
        let mpsc = self.get("lane_reject_when_full/tokio_mpsc_try_send");
        let cell = |t: Option<f64>| t.map_or("—".to_owned(), fmt_ns);
        let floors = match (ours, cas) {
            (Some(o), Some(c)) => format!("{:.1}", o / c),
            _ => "—".to_owned(),
        };
        let row = format!("| {} | {} | {} | {floors} |", cell(ours), cell(hand), cell(mpsc));
        self.line(&row);
        self.line("");
    }
}

fn main() {
    let workspace =
        Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_owned();
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| workspace.join("target"), PathBuf::from);
    let mut report =
        Report { root: target.join("criterion"), out: String::new(), missing: Vec::new() };
    let mode = if std::env::var_os("LANES_BENCH_QUICK").is_some_and(|v| v != "0") {
        "quick"
    } else {
        "full"
    };

    report.line("# Benchmarks\n");
    report.line(
        "Side-by-side runs of `lanes` and the anchor crates users pick today, measured **in the same \
         process run** with criterion (`benches/`). Machines are shared and noisy: the ratios are the \
         figures; absolute times are context. The plan and the bars are in `../shared/benchmarks.md`.\n",
    );
    report.line("Regenerate everything (quick mode, under 3 minutes):\n");
    report.line("```sh\nLANES_BENCH_QUICK=1 bash benches/run.sh\n```\n");
    report.line(
        "(`bash benches/run.sh` without the variable runs the longer, steadier measurement.)\n",
    );
    report.line("## Host\n");
    let host = [
        ("CPU", shell("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2")),
        ("cores", shell("nproc")),
        ("kernel", shell("uname -sr")),
        ("rustc", shell("rustc --version")),
        ("mode", mode.to_owned()),
        ("date", shell("date -u +%Y-%m-%d")),
    ];
    report.line("| | |");
    report.line("|---|---|");
    for (key, value) in host {
        report.line(&format!("| {key} | {value} |"));
    }
    report.line("");

    let (cas, _mutex) = report.calibration();
    report.lanes(cas);

    if !report.missing.is_empty() {
        let mut note = String::from("Not measured in this run: ");
        for (i, id) in report.missing.iter().enumerate() {
            let _ = write!(note, "{}`{id}`", if i == 0 { "" } else { ", " });
        }
        let note = note + ".";
        report.line(&note);
    }
    let path = workspace.join("BENCHMARKS.md");
    std::fs::write(&path, &report.out).expect("write BENCHMARKS.md");
    println!("wrote {}", path.display());
}
