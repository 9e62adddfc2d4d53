//! A fleet against leased capacity's pure core (`lanes::limit::share`): 1,000 simulated clients
//! with shifting demand share one limit through a `Ledger`; each refreshes once per interval, at a
//! random moment of it (twice if it has waiters its share cannot serve), reporting what it wants
//! and what it has out (its holders turn over within an interval). Reports per policy: utilisation
//! (permits in use over what could be in use), fairness (Jain's index over each client's use
//! divided by its demand-capped fair share) and how many intervals shares take to reach their new
//! targets after a large demand shift. Runs in a few seconds:
//!
//! ```text
//! cargo run --release -p lanes-benches --bin fleet [-- --clients 1000 --capacity 5000]
//! ```
#![allow(missing_docs)]

use std::time::Instant;

use lanes::limit::share::{Demand, Ledger, SharePolicy, apportion};

const INTERVALS: usize = 120;
/// The interval in which the demand shifts: a tenth of the clients go from little to much.
const SHIFT: usize = 60;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

struct Run {
    utilisation: Vec<f64>,
    jain: Vec<f64>,
    converged_after: Option<usize>,
    refresh_us: f64,
}

fn jain(xs: &[f64]) -> f64 {
    let sum: f64 = xs.iter().sum();
    let squares: f64 = xs.iter().map(|x| x * x).sum();
    if squares == 0.0 { 1.0 } else { sum * sum / (xs.len() as f64 * squares) }
}

fn simulate(clients: usize, capacity: u32, policy: SharePolicy, seed: u64) -> Run {
    let mut rng = Rng(seed | 1);
    let interval_ms = 1_000u64;
    let mut ledger = Ledger::new(capacity, policy, 3 * interval_ms);
    // Demands: most clients want a little, some a lot (about 1.4x the capacity in all).
    let mut demand: Vec<u32> =
        (0..clients)
            .map(|_| {
                if rng.below(10) == 0 { 20 + rng.below(40) as u32 } else { 1 + rng.below(9) as u32 }
            })
            .collect();
    let mut share = vec![0u32; clients];
    let mut run =
        Run { utilisation: Vec::new(), jain: Vec::new(), converged_after: None, refresh_us: 0.0 };
    let (mut refreshes, mut spent) = (0u64, 0f64);
    let mut order: Vec<usize> = (0..clients).collect();
    for interval in 0..INTERVALS {
        // Demand shifts: every interval a few clients change their mind; at SHIFT a tenth of
        // them go from little to much.
        for _ in 0..clients / 50 {
            let i = rng.below(clients as u64) as usize;
            demand[i] = 1 + rng.below(30) as u32;
        }
        if interval == SHIFT {
            for d in demand.iter_mut().take(clients / 10) {
                *d = 60 + rng.below(20) as u32;
            }
        }
        // Every client refreshes once an interval; one with waiters it cannot serve (its share
        // below its demand) twice, so it takes freed capacity sooner.
        order.clear();
        order.extend(0..clients);
        order.extend((0..clients).filter(|&i| share[i] < demand[i]));
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let base = interval as u64 * interval_ms;
        let slots = order.len() as u64;
        for (k, &i) in order.iter().enumerate() {
            let now = base + (k as u64 * interval_ms) / slots;
            let held = share[i].min(demand[i]);
            let started = Instant::now();
            share[i] = ledger.refresh(i as u64, Demand::of(demand[i]), held, now).share;
            spent += started.elapsed().as_secs_f64();
            refreshes += 1;
        }
        let demands: Vec<(u64, Demand)> =
            demand.iter().enumerate().map(|(i, d)| (i as u64, Demand::of(*d))).collect();
        let fair = apportion(capacity, &demands, policy);
        let used: u64 = share.iter().zip(&demand).map(|(s, d)| u64::from(*s.min(d))).sum();
        let could: u64 = u64::from(capacity).min(demand.iter().map(|d| u64::from(*d)).sum());
        run.utilisation.push(used as f64 / could as f64);
        let xs: Vec<f64> = share
            .iter()
            .zip(&demand)
            .zip(&fair)
            .filter(|(_, f)| **f > 0)
            .map(|((s, d), f)| f64::from(*s.min(d)) / f64::from(*f))
            .collect();
        run.jain.push(jain(&xs));
        if interval >= SHIFT && run.converged_after.is_none() {
            // Converged when every client is within one permit of its fair share for the
            // demand it has now, the small churn of other clients aside.
            let off = share
                .iter()
                .zip(&fair)
                .take(clients / 10)
                .filter(|(s, f)| s.abs_diff(**f) > 1)
                .count();
            if off == 0 {
                run.converged_after = Some(interval - SHIFT + 1);
            }
        }
    }
    run.refresh_us = spent / refreshes as f64 * 1e6;
    run
}

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len() as f64
}

fn min(xs: &[f64]) -> f64 {
    xs.iter().copied().fold(f64::INFINITY, f64::min)
}

fn main() {
    let mut clients = 1_000usize;
    let mut capacity = 5_000u32;
    let args: Vec<String> = std::env::args().skip(1).collect();
    for pair in args.chunks(2) {
        match (pair[0].as_str(), pair.get(1).and_then(|v| v.parse::<u64>().ok())) {
            ("--clients", Some(n)) if n > 0 => clients = n as usize,
            ("--capacity", Some(n)) if n > 0 => capacity = n as u32,
            _ => {
                eprintln!("fleet: options are --clients N and --capacity N (both > 0)");
                std::process::exit(2);
            }
        }
    }
    let started = Instant::now();
    println!(
        "{clients} clients, capacity {capacity}, {INTERVALS} refresh intervals (one refresh per client each), \
         a tenth of the clients going from little to much demand in interval {SHIFT}\n"
    );
    println!(
        "| policy | utilisation mean (min) | Jain fairness mean (min) | intervals to the new shares after the shift | ledger refresh |"
    );
    println!("|---|---|---|---|---|");
    for (label, policy) in
        [("max-min fair", SharePolicy::MaxMinFair), ("proportional", SharePolicy::Proportional)]
    {
        let run = simulate(clients, capacity, policy, 0x5eed_cafe);
        // The first intervals fill the ledger from nothing: measured from the fifth on.
        let settled = 5..;
        println!(
            "| {label} | {:.1}% ({:.1}%) | {:.3} ({:.3}) | {} | {:.1} µs |",
            mean(&run.utilisation[settled.clone()]) * 100.0,
            min(&run.utilisation[settled.clone()]) * 100.0,
            mean(&run.jain[settled.clone()]),
            min(&run.jain[settled]),
            run.converged_after.map_or("not within the run".to_owned(), |n| n.to_string()),
            run.refresh_us,
        );
    }
    println!("\n(simulated in {:.1} s)", started.elapsed().as_secs_f64());
}
