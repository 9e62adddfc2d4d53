//! A fleet on paper: what `RedisLimits` asks of Redis for a fleet of service instances, from
//! the per-operation costs suite 10 measured on this host (`target/lanes-bench/redis.json`).
//!
//! ```text
//! cargo bench -p lanes-benches --bench redis      # measure (Redis, and the cluster if up)
//! cargo run -p lanes-benches --bin scale -- --instances 1000 --rate 50 --limits 1
//! ```
//!
//! Options, with their defaults: `--instances 1000`, `--rate 50` (acquires per second per
//! instance), `--limits 1` (the load is spread evenly over them), `--hold-ms 100` (how long a
//! permit is held), `--lease-ms 3000`, `--waiting 0` (the share of acquires that queue first).
//! See docs/scale.md for what the numbers mean.
#![allow(missing_docs)]

use serde_json::Value;

struct Fleet {
    instances: f64,
    rate: f64,
    limits: f64,
    hold_ms: f64,
    lease_ms: f64,
    waiting: f64,
}

fn parse() -> Result<Fleet, String> {
    let mut fleet = Fleet {
        instances: 1000.0,
        rate: 50.0,
        limits: 1.0,
        hold_ms: 100.0,
        lease_ms: 3000.0,
        waiting: 0.0,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    for pair in args.chunks(2) {
        let [name, value] = pair else { return Err(format!("{} needs a value", pair[0])) };
        let value: f64 = value.parse().map_err(|_| format!("{name}: not a number: {value}"))?;
        if !(value.is_finite() && value >= 0.0) {
            return Err(format!("{name} must be a number ≥ 0"));
        }
        match name.as_str() {
            "--instances" => fleet.instances = value,
            "--rate" => fleet.rate = value,
            "--limits" => fleet.limits = value.max(1.0),
            "--hold-ms" => fleet.hold_ms = value,
            "--lease-ms" => fleet.lease_ms = value.max(100.0),
            "--waiting" => fleet.waiting = value.min(1.0),
            other => return Err(format!("unknown option {other}")),
        }
    }
    Ok(fleet)
}

fn main() {
    let fleet = match parse() {
        Ok(fleet) => fleet,
        Err(err) => {
            eprintln!("scale: {err}");
            std::process::exit(2);
        }
    };
    let path = lanes_benches::results_dir().join("redis.json");
    let measured: Value = match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text).expect("redis.json is JSON"),
        Err(_) => {
            eprintln!(
                "scale: no {} yet: run `cargo bench -p lanes-benches --bench redis` first",
                path.display()
            );
            std::process::exit(1);
        }
    };
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let cpu_us = f(&measured["spread"]["server_cpu_us_per_cycle"]);
    let commands = f(&measured["commands"]["commands_per_cycle"]);
    let per_core = 1e6 / cpu_us;

    // Acquire + release cycles, and what a queued acquire adds. Measured with MONITOR: a cycle
    // granted at once is 2 calls and 12 commands; a queued one is 2 calls and 63 commands (26 to
    // queue, 37 for the release that hands the permit on, its PUBLISH included). At about 5.7 us
    // per call and 1.2 us per command (suite 10's 26 us per uncontended cycle), a queued cycle
    // costs about 3.4 times an uncontended one.
    let cycles = fleet.instances * fleet.rate;
    let per_limit = cycles / fleet.limits;
    let queued_extra = 1.0 + fleet.waiting * 2.4;
    let limit_cores = per_limit * queued_extra / per_core;
    // Background work per instance: the epoch check every 250 ms; renewals every third of a
    // lease for permits held longer than that (one call per limit, 3 + 3 per ticket commands);
    // touches every 500 ms for limits with waiters.
    let epoch_ops = fleet.instances * 4.0;
    let renew_every_ms = fleet.lease_ms / 3.0;
    let renewed_share =
        if fleet.hold_ms > renew_every_ms { 1.0 - renew_every_ms / fleet.hold_ms } else { 0.0 };
    let held = cycles * fleet.hold_ms / 1000.0;
    // Renewals: every third of a lease, each instance renews its permits of a limit in one call
    // (3 commands, plus 3 per permit), if it holds any that long.
    let ticks = 1000.0 / renew_every_ms;
    let renewed = held * renewed_share;
    let renew_calls =
        if renewed > 0.0 { fleet.instances * fleet.limits.min(renewed) * ticks } else { 0.0 };
    let renew_commands = renew_calls * 3.0 + renewed * ticks * 3.0;
    let calls = cycles * 2.0 * queued_extra + epoch_ops + renew_calls;
    let store_ops = cycles * commands * queued_extra + epoch_ops + renew_commands;
    // A background command costs about what a command inside a call does (~2 us here).
    let total_cores = cycles * queued_extra / per_core + (epoch_ops + renew_commands) * 2e-6;
    let limit_cores = limit_cores + renew_commands / fleet.limits * 2e-6;
    let primaries = (total_cores / 0.7).ceil().max(limit_cores.ceil());

    println!(
        "measured on this host (suite 10): {cpu_us:.1} µs of Redis CPU and {commands:.0} commands per acquire + release"
    );
    println!(
        "  -> one Redis core sustains about {per_core:.0} acquire + release cycles per second\n"
    );
    println!(
        "fleet: {} instances x {} acquires/s over {} limit(s), held {} ms, lease {} ms, {:.0}% queued first",
        fleet.instances,
        fleet.rate,
        fleet.limits,
        fleet.hold_ms,
        fleet.lease_ms,
        fleet.waiting * 100.0
    );
    println!("  acquires + releases:        {cycles:.0}/s ({per_limit:.0}/s per limit)");
    println!(
        "  Redis calls (round trips):  {calls:.0}/s (epoch checks {epoch_ops:.0}/s, renewals {renew_calls:.0}/s)"
    );
    println!("  commands run inside them:   {store_ops:.0}/s");
    println!("  permits held at any moment: {held:.0}");
    println!(
        "  Redis CPU:                  {total_cores:.2} cores in all; {limit_cores:.2} cores for each limit"
    );
    if limit_cores > 1.0 {
        println!(
            "  DOES NOT FIT: one limit lives in one slot, so on one primary's one core; this one \
             needs {limit_cores:.2}. Split it, or hold leased capacity (docs/scale.md)."
        );
    } else {
        println!(
            "  fits: at least {primaries:.0} primar{} (each under 70% busy; one limit never spans two)",
            if primaries == 1.0 { "y" } else { "ies" }
        );
    }
}
