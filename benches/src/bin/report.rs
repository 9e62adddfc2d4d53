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
            let barred = match (ours, hand) {
                (Some(o), Some(a)) => format!("{:.2}× {}", a / o, pass(a / o >= 1.0)),
                _ => "—".to_owned(),
            };
            let row = format!(
                "| {runtime} | {} | {} | {barred} | {} | {} |",
                rate(ours),
                rate(hand),
                rate(mpsc),
                ratio(mpsc)
            );
            self.line(&row);
        }
        self.line("");
        self.line(
            "Reject path when the lane is full (time per refused admission; lower is better):\n",
        );
        self.line("| lanes | hand-rolled (`try_acquire_owned`) | lanes / hand-rolled (bar ≤ 1.5×) | tokio mpsc `try_send` | lanes in CAS floors (bar ≤ 20) |");
        self.line("|---|---|---|---|---|");
        let ours = self.get("lane_reject_when_full/lanes");
        let hand = self.get("lane_reject_when_full/hand_rolled_two_semaphores");
        let mpsc = self.get("lane_reject_when_full/tokio_mpsc_try_send");
        let cell = |t: Option<f64>| t.map_or("—".to_owned(), fmt_ns);
        let floors = match (ours, cas) {
            (Some(o), Some(c)) => format!("{:.1}", o / c),
            _ => "—".to_owned(),
        };
        let versus = match (ours, hand) {
            (Some(o), Some(h)) => format!("{:.2}× {}", o / h, pass(o / h <= 1.5)),
            _ => "—".to_owned(),
        };
        let row =
            format!("| {} | {} | {versus} | {} | {floors} |", cell(ours), cell(hand), cell(mpsc));
        self.line(&row);
        self.line("");
    }
}

fn result(name: &str) -> Option<Value> {
    let text =
        std::fs::read_to_string(lanes_benches::results_dir().join(format!("{name}.json"))).ok()?;
    serde_json::from_str(&text).ok()
}

fn pass(ok: bool) -> &'static str {
    if ok { "pass" } else { "FAIL" }
}

impl Report {
    /// A row comparing times: ratio = ours / anchor (lower is better).
    fn time_row(&mut self, label: &str, ours: &str, anchor: &str, bar: &str) {
        let (o, a) = (self.get(ours), self.get(anchor));
        let ratio = match (o, a) {
            (Some(o), Some(a)) => format!("{:.2}×", o / a),
            _ => "—".to_owned(),
        };
        let cell = |t: Option<f64>| t.map_or("—".to_owned(), fmt_ns);
        let row = format!("| {label} | {} | {} | {ratio} | {bar} |", cell(o), cell(a));
        self.line(&row);
    }

    /// A row comparing throughputs of `elements` per iteration: ratio = ours / anchor.
    fn rate_row(&mut self, label: &str, elements: f64, ours: &str, anchor: &str, bar: &str) {
        let (o, a) = (self.get(ours), self.get(anchor));
        let rate = |t: Option<f64>| t.map_or("—".to_owned(), |t| fmt_rate(elements / (t / 1e9)));
        let ratio = match (o, a) {
            (Some(o), Some(a)) => format!("{:.2}×", a / o),
            _ => "—".to_owned(),
        };
        let row = format!("| {label} | {} | {} | {ratio} | {bar} |", rate(o), rate(a));
        self.line(&row);
    }

    /// Suites 1, 6 and 7: limits.
    fn limits(&mut self) {
        self.line(
            "## Suite 1 — permits
",
        );
        self.line("Acquire + release of one permit (time per pair; ratio = lanes / tokio, lower is better):
");
        self.line("| scenario | lanes | `tokio::sync::Semaphore` | ratio | bar |");
        self.line("|---|---|---|---|---|");
        self.time_row(
            "uncontended, current_thread, `Limits::acquire(name)`",
            "permits_uncontended/lanes",
            "permits_uncontended/tokio_semaphore",
            "≤ 1.3×",
        );
        self.time_row(
            "uncontended, current_thread, `Limit::acquire()` (a handle, as a semaphore is)",
            "permits_uncontended/lanes_handle",
            "permits_uncontended/tokio_semaphore",
            "≤ 1.3×",
        );
        self.line("");
        self.line(
            "Contended: N tasks on a 2-worker runtime share 2 permits, each taking and returning one 64 times with a yield while holding it (throughput; ratio = lanes / tokio, higher is better):
",
        );
        self.line("| tasks | lanes | `tokio::sync::Semaphore` | ratio | bar |");
        self.line("|---|---|---|---|---|");
        for tasks in [2u32, 8, 64, 1024] {
            let elements = f64::from(tasks) * 64.0;
            self.rate_row(
                &tasks.to_string(),
                elements,
                &format!("permits_contended/lanes/{tasks}"),
                &format!("permits_contended/tokio_semaphore/{tasks}"),
                "≥ 1.0×",
            );
        }
        self.line("");

        self.line(
            "## Suite 6 — rate check
",
        );
        self.line("One check of a rate that every check passes (time per check; ratio = lanes / governor, lower is better). `Limits` is the async facade: `try_acquire` takes a permit (dropped at once here), `check` spends a token and holds nothing (as governor's `check`); `LimitTable` is the pure core the facade locks:
");
        self.line("| scenario | lanes | governor | ratio | bar |");
        self.line("|---|---|---|---|---|");
        self.time_row(
            "direct, `Limits::try_acquire`",
            "rate_check_direct/lanes_limits",
            "rate_check_direct/governor",
            "≤ 2×",
        );
        self.time_row(
            "direct, `Limit::try_acquire()` (a handle)",
            "rate_check_direct/lanes_handle",
            "rate_check_direct/governor",
            "≤ 2×",
        );
        self.time_row(
            "direct, `Limit::check()` (a handle; holds nothing, as governor's `check`)",
            "rate_check_direct/lanes_check",
            "rate_check_direct/governor",
            "≤ 2×",
        );
        self.time_row(
            "direct, `Limits::check(name)`",
            "rate_check_direct/lanes_limits_check",
            "rate_check_direct/governor",
            "≤ 2×",
        );
        self.time_row(
            "direct, `LimitTable` acquire + release",
            "rate_check_direct/lanes_table",
            "rate_check_direct/governor",
            "≤ 2×",
        );
        self.time_row(
            "keyed, 100k keys, `Limits::try_acquire`",
            "rate_check_keyed_100k/lanes_limits",
            "rate_check_keyed_100k/governor",
            "≤ 2×",
        );
        self.time_row(
            "keyed, 100k keys, `Limits::check(name)`",
            "rate_check_keyed_100k/lanes_check",
            "rate_check_keyed_100k/governor",
            "≤ 2×",
        );
        self.time_row(
            "keyed, 100k keys, `KeyedLimit::check(key)` (one limit, a state per key, as governor's keyed limiter)",
            "rate_check_keyed_100k/lanes_keyed",
            "rate_check_keyed_100k/governor",
            "≤ 2×",
        );
        self.line("");
        if let Some(memory) = result("rate_memory") {
            let theirs = memory["governor_bytes_per_key"].as_f64().unwrap_or(f64::NAN);
            self.line("Memory per key after 100k keys, resident bytes measured in a fresh process (governor: its keyed limiter, a `DashMap`):
");
            self.line("| lanes | bytes per key | governor | ratio | bar ≤ 2× (aim ≤ 1×) |");
            self.line("|---|---|---|---|---|");
            for (what, field) in [
                ("`KeyedLimit`, one check per key", "keyed_bytes_per_key"),
                ("`Limits`, a named limit per key (`define`)", "lanes_bytes_per_key"),
            ] {
                let ours = memory[field].as_f64().unwrap_or(f64::NAN);
                let row = format!(
                    "| {what} | {ours:.0} B | {theirs:.0} B | {:.2}× | {} |",
                    ours / theirs,
                    pass(ours <= 2.0 * theirs)
                );
                self.line(&row);
            }
            self.line("");
        }

        self.line(
            "## Suite 7 — fair wait queue
",
        );
        if let Some(f) = result("fairness") {
            let grants = f["measured_grants"].as_u64().unwrap_or(0);
            let requests = f["requests"].as_u64().unwrap_or(0);
            self.line(&format!(
                "{requests} requests from 10 tenants, one sending 90%, all queued on one permit; the first {grants} grants, through the async facades (a correctness result):
"
            ));
            let counts = |key: &str| {
                f[key].as_array().map_or(String::new(), |a| {
                    a.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(" / ")
                })
            };
            let jain_eq = f["lanes_equal_jain"].as_f64().unwrap_or(0.0);
            let jain_fifo = f["tokio_fifo_jain"].as_f64().unwrap_or(0.0);
            let err = f["lanes_weighted_max_share_error"].as_f64().unwrap_or(1.0);
            self.line("| queue | grants per tenant (heavy tenant first) | result | bar | |");
            self.line("|---|---|---|---|---|");
            let rows = [
                format!(
                    "| lanes, weights 1:1 | {} | Jain index {jain_eq:.3} | ≥ 0.99 | {} |",
                    counts("lanes_equal_counts"),
                    pass(jain_eq >= 0.99)
                ),
                format!(
                    "| lanes, weights 3:1 (heavy tenant 3) | {} | max share error {:.1}% | ±2% | {} |",
                    counts("lanes_weighted_counts"),
                    err * 100.0,
                    pass(err <= 0.02)
                ),
                format!(
                    "| tokio `Semaphore` (FIFO baseline) | {} | Jain index {jain_fifo:.3} | — | unfair by design |",
                    counts("tokio_fifo_counts")
                ),
            ];
            for row in rows {
                self.line(&row);
            }
            self.line("");
        }
        self.line("Per-dequeue cost of the wait queue with every key holding 2 waiters (pop + push, time per pair), against a `VecDeque` FIFO floor and a hand-rolled round robin (a `HashMap` from the key's name to its FIFO and a list of keys in turn: no ticket index, levels, weights or removal):
");
        self.line("| keys | lanes `WaitQueue` | `VecDeque` floor | ratio | hand-rolled round robin | lanes / round robin |");
        self.line("|---|---|---|---|---|---|");
        let floor = self.get("wait_queue_dequeue/vecdeque_floor");
        let ns = |v: Option<f64>| v.map_or("—".to_owned(), fmt_ns);
        let ratio = |a: Option<f64>, b: Option<f64>, digits: usize| match (a, b) {
            (Some(a), Some(b)) => format!("{:.digits$}×", a / b),
            _ => "—".to_owned(),
        };
        for keys in [10u32, 1_000, 100_000] {
            let ours = self.get(&format!("wait_queue_dequeue/lanes_pop_push/{keys}"));
            let hand = self.get(&format!("wait_queue_dequeue/round_robin_floor/{keys}"));
            let row = format!(
                "| {keys} | {} | {} | {} | {} | {} |",
                ns(ours),
                ns(floor),
                ratio(ours, floor, 0),
                ns(hand),
                ratio(ours, hand, 2)
            );
            self.line(&row);
        }
        let hand_small = self.get("wait_queue_dequeue/round_robin_floor/10");
        let hand_large = self.get("wait_queue_dequeue/round_robin_floor/100000");
        if let (Some(small), Some(large)) = (hand_small, hand_large) {
            self.line(&format!(
                "\nThe hand-rolled round robin's own cost at 100k keys / at 10 keys: {:.2}× (context for the bar below: the same growth with none of the queue's bookkeeping).",
                large / small
            ));
        }
        let small = self.get("wait_queue_dequeue/lanes_pop_push/10");
        let large = self.get("wait_queue_dequeue/lanes_pop_push/100000");
        if let (Some(small), Some(large)) = (small, large) {
            let growth = large / small;
            self.line(&format!(
                "\nCost at 100k keys / cost at 10 keys: **{growth:.2}×** (bar ≤ 2×: {}).",
                pass(growth <= 2.0)
            ));
        }
        self.line("");
    }
}

impl Report {
    /// Suite 8 (keyed pool) and the dispatcher.
    fn pools(&mut self) {
        const ITEMS: f64 = 10_000.0;
        self.line("## Suite 8 — keyed pool\n");
        self.line("10,000 no-op items over N keys, 8 workers (or shards), 2-worker runtime (throughput; ratio = per-key / anchor, higher is better):\n");
        self.line("| keys | lanes per-key | lanes hashed (the seed's design) | ratio (bar ≥ 1.0) | `DashMap<Key, mpsc>` + task per key | ratio |");
        self.line("|---|---|---|---|---|---|");
        for keys in [1u32, 16, 10_000] {
            let ours = self.get(&format!("keyed_uniform/lanes_per_key/{keys}"));
            let hashed = self.get(&format!("keyed_uniform/lanes_hashed/{keys}"));
            let dash = self.get(&format!("keyed_uniform/dashmap_task_per_key/{keys}"));
            let rate = |t: Option<f64>| t.map_or("—".to_owned(), |t| fmt_rate(ITEMS / (t / 1e9)));
            let ratio = |a: Option<f64>| match (ours, a) {
                (Some(o), Some(a)) => format!("{:.2}×", a / o),
                _ => "—".to_owned(),
            };
            let barred = match (ours, hashed) {
                (Some(o), Some(a)) => format!("{:.2}× {}", a / o, pass(a / o >= 1.0)),
                _ => "—".to_owned(),
            };
            let row = format!(
                "| {keys} | {} | {} | {barred} | {} | {} |",
                rate(ours),
                rate(hashed),
                rate(dash),
                ratio(dash)
            );
            self.line(&row);
        }
        self.line("");
        let violations: u64 = result("keyed_order")
            .and_then(|v| v.as_object().map(|o| o.values().filter_map(Value::as_u64).sum()))
            .unwrap_or(u64::MAX);
        if let Some(slow) = result("keyed_slow_key") {
            let f = |k: &str| slow[k].as_f64().unwrap_or(f64::NAN);
            let violations =
                violations.saturating_add(slow["violations"].as_u64().unwrap_or(u64::MAX));
            let (p50, p99, h50, h99) =
                (f("per_key_p50_us"), f("per_key_p99_us"), f("hashed_p50_us"), f("hashed_p99_us"));
            self.line("Zipf keys (1,000 keys, weight 1/(k+1)), key 0 slow (5 ms per item), 4,000 items arriving over time, 8 workers/shards: latency from submit to processed of the *other* keys' items (a correctness-style result, one run):\n");
            self.line("| mode | p50 | p99 | |");
            self.line("|---|---|---|---|");
            let us = |v: f64| fmt_ns(v * 1e3);
            let rows = [
                format!("| lanes per-key | {} | {} | |", us(p50), us(p99)),
                format!("| lanes hashed shards | {} | {} | |", us(h50), us(h99)),
                format!(
                    "| p99 hashed / per-key | | {:.0}× | bar ≥ 100×: {} |",
                    h99 / p99,
                    pass(h99 / p99 >= 100.0)
                ),
            ];
            for row in rows {
                self.line(&row);
            }
            self.line("");
            self.line(&format!(
                "Per-key order violations across every keyed run above: **{violations}** ({}).\n",
                pass(violations == 0)
            ));
            self.line(&format!(
                "Memory: a burst of 1,000,000 distinct keys queued at once took {:.0} MB resident ({:.0} B per key); \
                 once drained, {:.0} MB remained above the starting point (the 16,384 most recently idle keys are kept for their \
                 return, older ones are forgotten and the tables shrink; the remainder is allocator retention).\n",
                f("million_keys_peak_mb"),
                f("million_keys_peak_mb") * 1e6 / 1e6,
                f("million_keys_after_mb"),
            ));
        }
        self.line("## Suite 2 — dispatcher\n");
        self.line("10,000 no-op items through 8 workers (throughput; ratio = lanes / anchor, higher is better):\n");
        self.line("| runtime | lanes `Dispatcher` | tokio mpsc + 8 workers | ratio (bar ≥ 1.0 on multi_thread_2) |");
        self.line("|---|---|---|---|");
        for runtime in ["current_thread", "multi_thread_2"] {
            let ours = self.get(&format!("dispatcher/lanes_dispatcher/{runtime}"));
            let anchor = self.get(&format!("dispatcher/tokio_mpsc_workers/{runtime}"));
            let rate = |t: Option<f64>| t.map_or("—".to_owned(), |t| fmt_rate(ITEMS / (t / 1e9)));
            let ratio = match (ours, anchor) {
                (Some(o), Some(a)) if runtime == "multi_thread_2" => {
                    format!("{:.2}× {}", a / o, pass(a / o >= 1.0))
                }
                (Some(o), Some(a)) => format!("{:.2}×", a / o),
                _ => "—".to_owned(),
            };
            let row = format!("| {runtime} | {} | {} | {ratio} |", rate(ours), rate(anchor));
            self.line(&row);
        }
        self.line("");
    }
}

impl Report {
    /// Suite 11: `lanes serve`.
    fn serve(&mut self) {
        self.line("## Suite 11 — `lanes serve` over HTTP\n");
        let Some(r) = result("serve") else {
            self.missing.push("serve (suite 11 did not run)".to_owned());
            return;
        };
        let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
        self.line(&format!(
            "{} concurrent connections over loopback, client and server in one process on this host; the floor is a bare axum endpoint that parses a JSON body and echoes it (requests per second; latency per request):\n",
            r["connections"]
        ));
        self.line("| endpoint | requests/s | p50 | p99 |");
        self.line("|---|---|---|---|");
        for (label, key) in [
            ("axum JSON echo (floor)", "echo"),
            ("`lanes serve` acquire + release", "acquire_release"),
            ("axum JSON echo over TLS (floor)", "tls_echo"),
            ("`lanes serve` acquire + release, TLS and API tokens", "tls_acquire_release"),
        ] {
            if r[key].is_null() {
                continue;
            }
            let row = format!(
                "| {label} | {:.0} | {:.0} µs | {:.0} µs |",
                f(&r[key]["requests_per_s"]),
                f(&r[key]["p50_us"]),
                f(&r[key]["p99_us"])
            );
            self.line(&row);
        }
        let ratio = f(&r["acquire_release"]["requests_per_s"]) / f(&r["echo"]["requests_per_s"]);
        self.line(&format!(
            "\nRatio lanes / echo: **{ratio:.2}×** (bar ≥ 0.7: {}).\n",
            pass(ratio >= 0.7)
        ));
        if let (Some(echo), Some(lanes)) = (
            r["wrk_echo_requests_per_s"].as_f64(),
            r["wrk_acquire_release_requests_per_s"].as_f64(),
        ) {
            self.line(&format!(
                "Through wrk (an external load generator, 2 threads, the same connections; `lanes serve` \
                 pipelining a try and its release on each connection): echo {echo:.0} requests/s, `lanes serve` {lanes:.0} \
                 requests/s: **{:.2}×** (bar ≥ 0.7: {}).\n",
                lanes / echo,
                pass(lanes / echo >= 0.7)
            ));
        }
        if !r["tls_echo"].is_null() {
            let secured = f(&r["tls_acquire_release"]["requests_per_s"])
                / f(&r["tls_echo"]["requests_per_s"]);
            self.line(&format!(
                "With TLS and API tokens, against the echo over the same TLS (the same bearer header \
                 sent to both): **{secured:.2}×** (bar ≥ 0.7: {}; aim ≥ 0.9).\n",
                pass(secured >= 0.7)
            ));
        }
    }

    /// Suite 10: distributed limits on Redis.
    fn redis(&mut self) {
        self.line("## Suite 10 — distributed limits on Redis\n");
        let Some(r) = result("redis") else {
            self.missing.push("redis (suite 10 did not run: is Redis up?)".to_owned());
            return;
        };
        let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
        let ping = f(&r["ping"]["p50_us"]);
        self.line(&format!(
            "Floor: a `PING` round trip to the local Redis, p50 {:.0} µs, p99 {:.0} µs. Latency of `RedisLimits` \
             acquire and release (each one script call), N clients (each its own connection) cycling on a roomy limit:\n",
            ping,
            f(&r["ping"]["p99_us"])
        ));
        self.line("| clients | acquire p50 | acquire p99 | release p50 | release p99 | cycles/s | acquire p50 / PING (bar ≤ 1.3) |");
        self.line("|---|---|---|---|---|---|---|");
        for row in r["latency"].as_array().cloned().unwrap_or_default() {
            let acquire = f(&row["acquire"]["p50_us"]);
            let ratio = acquire / ping;
            let bar = if row["clients"] == 1 {
                format!("{ratio:.2}× {}", pass(ratio <= 1.3))
            } else {
                format!("{ratio:.2}× (queueing at the server)")
            };
            let line = format!(
                "| {} | {:.0} µs | {:.0} µs | {:.0} µs | {:.0} µs | {:.0} | {bar} |",
                row["clients"],
                acquire,
                f(&row["acquire"]["p99_us"]),
                f(&row["release"]["p50_us"]),
                f(&row["release"]["p99_us"]),
                f(&row["cycles_per_s"]),
            );
            self.line(&line);
        }
        self.line("");
        self.line("Throughput against the common sorted-set semaphore script (`ZREMRANGEBYSCORE` + `ZCARD` + `ZADD`, release `ZREM`, polling every 5 ms while full — the distributed-lock / Redisson pattern), same clients, same run (acquisitions per second, ratio = lanes / anchor):\n");
        self.line("The last column is the scenario's ceiling: the same tasks, limit and hold on an in-process `tokio::sync::Semaphore` in the same run (no Redis); with a hold, it bounds what any shared limit can reach, and ours and the anchor's share of it are shown.\n");
        self.line("| scenario | lanes `RedisLimits` | sorted-set script | ratio (bar ≥ 1.0) | in-process ceiling |");
        self.line("|---|---|---|---|---|");
        for row in r["throughput"].as_array().cloned().unwrap_or_default() {
            let (ours, anchor) = (f(&row["lanes_per_s"]), f(&row["sorted_set_per_s"]));
            // The bar is for clients of their own (processes); tasks sharing one client (and
            // the anchor's tasks sharing one connection) are shown for what pipelining does.
            let verdict = if row["shared"].as_bool() == Some(true) {
                "(tasks of one process, one connection)".to_owned()
            } else {
                pass(ours / anchor >= 1.0).to_owned()
            };
            let ceiling = match row["ceiling_per_s"].as_f64() {
                Some(ceiling) if row["hold_ms"].as_u64().is_some_and(|hold| hold > 0) => format!(
                    "{ceiling:.0}/s (lanes {:.0}%, anchor {:.0}%)",
                    100.0 * ours / ceiling,
                    100.0 * anchor / ceiling
                ),
                Some(ceiling) => format!("{ceiling:.0}/s"),
                None => "—".to_owned(),
            };
            let line = format!(
                "| {} ({} clients, limit {}, hold {} ms) | {:.0}/s | {:.0}/s | {:.2}× {verdict} | {ceiling} |",
                row["scenario"].as_str().unwrap_or("?"),
                row["clients"],
                row["limit"],
                row["hold_ms"],
                ours,
                anchor,
                ours / anchor,
            );
            self.line(&line);
        }
        self.line("");
        if let Some(spread) = r.get("spread") {
            let single = f(&spread["single_cycles_per_s"]);
            self.line(&format!(
 "Where the cost is: {:.0} Redis commands per acquire + release ({:.0} function calls; `INFO commandstats`), {:.1} µs of Redis CPU per acquire + release when 8 clients saturate it (`INFO cpu`), so one primary's core sustains about {:.0} acquires + releases per second; docs/scale.md extrapolates from these.\n",
                f(&r["commands"]["commands_per_cycle"]),
                f(&r["commands"]["fcalls_per_cycle"]),
                f(&spread["server_cpu_us_per_cycle"]),
                1e6 / f(&spread["server_cpu_us_per_cycle"]),
            ));
            self.line("The same load spread over 8 limits (8 clients, each its own limit), on the one Redis and on the local Redis Cluster (three primaries with a replica each, all on this host's 2 cores):\n");
            self.line("| target | acquire + release cycles/s | acquire p50 (1 client) |");
            self.line("|---|---|---|");
            self.line(&format!(
                "| one Redis | {single:.0} | {:.0} µs |",
                f(&r["latency"][0]["acquire"]["p50_us"])
            ));
            let cluster = &spread["cluster"];
            if cluster.is_null() {
                self.line(
                    "| Redis Cluster | (not running: `bash scripts/services.sh --cluster`) | |",
                );
            } else {
                self.line(&format!(
                    "| Redis Cluster, {} nodes | {:.0} | {:.0} µs |",
                    cluster["nodes"],
                    f(&cluster["spread_cycles_per_s"]),
                    f(&cluster["acquire"]["p50_us"])
                ));
            }
            self.line("");
        }
        if let Some(leased) = r.get("leased").and_then(|l| l["rows"].as_array()) {
            let find = |mode: &str| {
                leased.iter().find(|row| row["mode"] == mode).cloned().unwrap_or_default()
            };
            let (exact, lease) = (find("exact"), find("leased"));
            let ratio = f(&lease["acquires_per_s"]) / f(&exact["acquires_per_s"]);
            self.line(&format!(
                "Leased capacity against exact mode, same Redis: one client (one instance) with {} tasks acquiring and releasing a roomy limit as fast as they can (acquires per second; Redis calls per second):\n",
                r["leased"]["tasks"]
            ));
            self.line(
                "| mode | acquires/s per instance | Redis calls/s | leased / exact (bar ≥ 50×) |",
            );
            self.line("|---|---|---|---|");
            self.line(&format!(
                "| exact | {:.0} | {:.0} | |",
                f(&exact["acquires_per_s"]),
                f(&exact["calls_per_s"])
            ));
            self.line(&format!(
                "| leased | {:.0} | {:.1} | {ratio:.0}× {} |",
                f(&lease["acquires_per_s"]),
                f(&lease["calls_per_s"]),
                pass(ratio >= 50.0)
            ));
            self.line("");
        }
        let reclaim = &r["reclaim"];
        let worst = f(&reclaim["after_lease_ms_max"]);
        self.line(&format!(
            "Lease reclaim: a holder vanishes (no release, no renewal) with a {} ms lease; a waiting client got the permit at most {:.1} ms after the lease ended (p50 {:.1} ms) — bar ≤ lease + 100 ms: {}.\n",
            reclaim["lease_ms"],
            worst,
            f(&reclaim["after_lease_ms_p50"]),
            pass(worst <= 100.0)
        ));
    }

    /// Suites 3, 4 and 5: channels.
    fn channels(&mut self) {
        const RECORDS: f64 = 10_000.0;
        let rate = |t: Option<f64>| t.map_or("—".to_owned(), |t| fmt_rate(RECORDS / (t / 1e9)));
        self.line(
            "## Suite 3 — channel, block mode
",
        );
        self.line("10,000 records from 1 (SPSC) or 4 (MPSC) producers to one consumer reading one record at a time (`recv`), channel created per run (throughput; ratios = lanes / anchor, higher is better):\n");
        self.line("| runtime | shape | lanes | tokio mpsc | vs tokio (bar ≥ 1.0) | flume | kanal | async-channel | vs fastest (bar ≥ 0.8) |");
        self.line("|---|---|---|---|---|---|---|---|---|");
        let anchors = ["tokio_mpsc", "flume", "kanal", "async_channel"];
        for flavor in ["current_thread", "multi_thread_2"] {
            for topology in ["spsc", "mpsc"] {
                for capacity in [1, 64, 1024] {
                    for record in ["u64", "256B"] {
                        let shape = format!("{topology}_{capacity}_{record}");
                        let ours = self.get(&format!("channel_block/{shape}_lanes/{flavor}"));
                        let times: Vec<Option<f64>> = anchors
                            .iter()
                            .map(|a| self.get(&format!("channel_block/{shape}_{a}/{flavor}")))
                            .collect();
                        let ratio = |a: Option<f64>| match (ours, a) {
                            (Some(o), Some(a)) => Some(a / o),
                            _ => None,
                        };
                        let vs_tokio = ratio(times[0]);
                        let (fastest_name, fastest) = anchors
                            .iter()
                            .zip(&times)
                            .filter_map(|(name, t)| t.map(|t| (*name, t)))
                            .min_by(|a, b| a.1.total_cmp(&b.1))
                            .unwrap_or(("—", f64::NAN));
                        let vs_fastest = ratio(Some(fastest));
                        let cell = |r: Option<f64>, bar: f64| {
                            r.map_or("—".to_owned(), |r| format!("{r:.2}× {}", pass(r >= bar)))
                        };
                        let row = format!(
                            "| {flavor} | {shape} | {} | {} | {} | {} | {} | {} | {} ({fastest_name}) |",
                            rate(ours),
                            rate(times[0]),
                            cell(vs_tokio, 1.0),
                            rate(times[1]),
                            rate(times[2]),
                            rate(times[3]),
                            cell(vs_fastest, 0.8),
                        );
                        self.line(&row);
                    }
                }
            }
        }
        self.line("");
        self.line(
            "## Suite 4 — channel overflow
",
        );
        self.line("A producer emitting 10,000 records without waiting (`try_emit`) into a 64-record channel whose consumer does ~10× the producer's work per record; the time is the producer's (throughput, higher is better):\n");
        self.line("| policy | lanes | anchor | ratio | bar |");
        self.line("|---|---|---|---|---|");
        self.rate_row(
            "drop-oldest vs async-channel `force_send`",
            RECORDS,
            "channel_overflow/lanes_drop_oldest",
            "channel_overflow/async_channel_force_send",
            "≥ 1.0",
        );
        self.rate_row(
            "drop-newest vs tokio mpsc `try_send` (refuses, counts nothing)",
            RECORDS,
            "channel_overflow/lanes_drop_newest",
            "channel_overflow/tokio_mpsc_try_send",
            "—",
        );
        self.rate_row(
            "spill (sync `Never`, ext4) vs async-channel `force_send`",
            RECORDS,
            "channel_overflow/lanes_spill",
            "channel_overflow/async_channel_force_send",
            "—",
        );
        self.line("");
        if let Some(reconcile) = result("channel_overflow_reconcile") {
            let all =
                reconcile.as_object().is_some_and(|o| o.values().all(|v| v == &Value::Bool(true)));
            self.line(&format!(
                "Counters after every overflow run reconcile exactly (`emitted = delivered + dropped + spilled + depth`, and emitted = 10,000): **{}** ({}).\n",
                if all { "yes" } else { "no" },
                pass(all)
            ));
        }
        self.line(
            "## Suite 5 — batching
",
        );
        self.line("10,000 records from a producer at full speed, consumed in batches of up to 64 with a 10 ms linger (throughput, higher is better):\n");
        self.line("| consumer | lanes | anchor | ratio | bar |");
        self.line("|---|---|---|---|---|");
        self.rate_row(
            "`next_batch` + `ack` vs tokio `recv_many`",
            RECORDS,
            "channel_batching/lanes_next_batch",
            "channel_batching/tokio_recv_many",
            "≥ 1.0",
        );
        self.rate_row(
            "`next_batch` + `ack` vs tokio-stream `chunks_timeout`",
            RECORDS,
            "channel_batching/lanes_next_batch",
            "channel_batching/tokio_stream_chunks_timeout",
            "≥ 1.0",
        );
        self.rate_row(
            "`recv_many` vs tokio `recv_many`",
            RECORDS,
            "channel_batching/lanes_recv_many",
            "channel_batching/tokio_recv_many",
            "—",
        );
        self.line("");
        if let Some(latency) = result("channel_batching_latency") {
            let f = |path: [&str; 2]| latency[path[0]][path[1]].as_f64().unwrap_or(f64::NAN);
            let linger = latency["linger_ms"].as_f64().unwrap_or(f64::NAN);
            self.line(&format!(
                "Added latency, records paced one per {} µs so partial batches leave on the linger (one run):\n",
                latency["pace_us"]
            ));
            self.line("| consumer | p50 | p99 | max | bar: p99 ≤ linger + 1 ms |");
            self.line("|---|---|---|---|---|");
            for (label, key) in [
                ("lanes `next_batch`", "lanes"),
                ("tokio-stream `chunks_timeout`", "chunks_timeout"),
            ] {
                let p99 = f([key, "p99_ms"]);
                let row = format!(
                    "| {label} | {:.2} ms | {:.2} ms | {:.2} ms | {} |",
                    f([key, "p50_ms"]),
                    p99,
                    f([key, "max_ms"]),
                    if key == "lanes" { pass(p99 <= linger + 1.0) } else { "(anchor)" },
                );
                self.line(&row);
            }
            self.line("");
        }
    }

    /// Suite 9: the spill queue.
    fn spill(&mut self) {
        self.line("## Suite 9 — spill queue\n");
        let Some(s) = result("spill") else {
            self.missing.push("spill (bash benches/run.sh runs it)".to_owned());
            return;
        };
        let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
        self.line(&format!(
            "Filesystem: **{}** (not tmpfs or overlay: fsync reaches the disk). This disk's speed drifts within a run, \
             so every cell measures its floor and its redb counterpart next to it, in three alternating rounds, and shows \
             the medians. Floors: for `Always`, one frame of the record's size written and `fdatasync`ed at a time \
             (records/s); for the others, sequential 1 MiB writes and one `fdatasync` (MB/s).\n",
            s["fs"].as_str().unwrap_or("unknown")
        ));
        self.line("| policy | appenders × records per call | record | records/s | MB/s | floor | vs floor | bar | redb at equal durability (records per txn) | vs redb |");
        self.line("|---|---|---|---|---|---|---|---|---|---|");
        for (key, label, bar) in [
            ("always", "`Always`", Some(0.9)),
            ("batch", "`Batch`", None),
            ("batch_batched", "`Batch`", Some(0.0)),
            ("interval_500ms", "`Interval(500 ms)`", None),
            ("always_concurrent", "`Always`", None),
        ] {
            for size in ["64", "1024", "65536"] {
                let cell = &s["policies"][key][size];
                if cell.is_null() {
                    continue;
                }
                let (rate, mb) = (f(&cell["records_s"]), f(&cell["mb_s"]));
                let appenders = if key == "always" { 1 } else { 64 };
                let per_call = cell["per_call"].as_u64().unwrap_or(1);
                let size_label = match size {
                    "64" => "64 B",
                    "1024" => "1 KiB",
                    _ => "64 KiB",
                };
                let floor = f(&cell["floor"]);
                let (floor_label, ratio) = if key.starts_with("always") {
                    (format!("{floor:.0}/s"), rate / floor)
                } else {
                    (format!("{floor:.0} MB/s"), mb / floor)
                };
                let (floor_label, versus) = if cell["floor"].is_null() {
                    ("—".to_owned(), "—".to_owned())
                } else {
                    (floor_label, format!("{ratio:.2}×"))
                };
                let bar = match bar {
                    Some(b) if b > 0.0 => format!("≥ {b}×: {}", pass(ratio >= b)),
                    Some(_) => {
                        let b = if size == "64" { 0.3 } else { 0.5 };
                        format!("≥ {b}×: {}", pass(ratio >= b))
                    }
                    None => "—".to_owned(),
                };
                let (redb, redb_ratio) = if cell["redb_records_s"].is_null() {
                    ("—".to_owned(), "—".to_owned())
                } else {
                    let redb = f(&cell["redb_records_s"]);
                    let per_txn = cell["redb_per_txn"].as_u64().unwrap_or(1);
                    let ratio = rate / redb;
                    (
                        format!("{redb:.0}/s ({per_txn})"),
                        format!("{ratio:.2}× ≥ 1.0: {}", pass(ratio >= 1.0)),
                    )
                };
                self.line(&format!(
                    "| {label} | {appenders} × {per_call} | {size_label} | {rate:.0} | {mb:.1} | {floor_label} | {versus} | {bar} | {redb} | {redb_ratio} |"
                ));
            }
        }
        self.line("");
        let recovery = f(&s["recovery_1gib_s"]);
        self.line(&format!(
            "Read-back: **{:.0} MB/s**. Recovery (open, scanning and checking every frame) of 1 GiB in 1 KiB records: \
             **{recovery:.2} s** (bar < 2 s: {}).\n",
            f(&s["read_mb_s"]),
            pass(recovery < 2.0)
        ));
        self.line("Crash results (tests, not timings): the kill -9 harness (`crates/lanes/tests/spill_kill.rs`) runs 200 \
                   cycles of a child appending under `Always` and killed at random; every acknowledged append was present \
                   exactly once after each (0 lost). The crash-simulation proptest cuts unsynced writes at arbitrary bytes \
                   under `Always` and `Batch`, and `batch_acknowledges_only_what_its_sync_thread_made_durable` crashes a \
                   `Batch` queue under 12 appenders with appends in flight and segments rotating.\n");
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
    report.line(
        "Regenerate everything (quick mode, about 8 minutes on 2 cores; suite 10 needs Redis):\n",
    );
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
    report.limits();
    report.pools();
    report.channels();
    report.spill();
    report.redis();
    report.serve();

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
