//! Paired rounds of one cell, ours against its anchor, for the cells whose one-run ratio swings
//! with the host's scheduler (the `multi_thread_2` cells: two runs of the same build read the
//! channel's `spsc_1_u64` at 0.47× and 1.97× of tokio mpsc).
//!
//! Each pair runs both sides back to back, in alternating order (ours first in even pairs,
//! the anchor first in odd ones), each side for the same number of whole cells; the ratio of
//! a pair is the anchor's time over ours (above 1: ours is faster). Drift of the host between
//! pairs cancels out of each pair's ratio, and the median over the pairs is the figure, with
//! its quartiles as the spread:
//!
//! ```sh
//! cargo build --release -p lanes-benches --bin paired
//! target/release/paired channel mt 64 4 u64 21   # suite 3: against tokio mpsc
//! target/release/paired channel ct 1024 1 u64 21 kanal   # suite 3's kanal bar
//! target/release/paired lane mt 21               # suite 2: against the hand-rolled lane
//! target/release/paired permits mt 8 21          # suite 1: 8 tasks, against tokio's semaphore
//! target/release/paired pool 1 21                # suite 8: per-key against hashed, 1 key
//! ```
//!
//! Arguments: `channel`, the runtime (`ct` or `mt`), the capacity, the producers, the record (`u64`
//! or `256B`), the pairs and optionally the anchor (`tokio`, the default, or `kanal`); or `lane`,
//! the runtime and the pairs (1,000 runs into 8 execution slots, as in suite 2); or `permits`, the
//! runtime, the tasks and the pairs (suite 1's contended cell: the tasks share 2 permits through a
//! `Limit` handle or a `tokio::sync::Semaphore`, each taking and returning one 64 times); or
//! `pool`, the keys and the pairs (suite 8's uniform cell on two workers: 10,000 no-op items over
//! that many keys into a per-key pool of 8 workers, against the hashed-shard pool of 8 shards; no
//! runtime argument). `LANES_PAIRED_CONTROL=1` makes the anchor of a `pool` pair a second per-key
//! pool: the spread of a design against itself. An odd number of pairs makes the median one of
//! them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lanes::{LimitSpec, Limits};
use lanes_benches::scenarios::{
    Big, HandRolled, Permits, Record, channel_block, contended, hand_rolled, kanal_block,
    keyed_pool, lane, lane_runs, pool_cell, pool_items, tokio_block,
};
use lanes_benches::{Done, Flavor};
use tokio::sync::Semaphore;

/// Cells per side in a pair: enough that one side takes a few milliseconds at the slowest.
const CELLS: usize = 5;
/// Cells per side of a `permits` pair (a cell of 8 tasks is 512 acquires: well under 1 ms).
const PERMIT_CELLS: usize = 40;
/// Runs per lane cell, and the lane's slots (suite 2's).
const RUNS: u64 = 1_000;
const CONCURRENT: usize = 8;
const QUEUED: usize = 2_000;

/// The ratio (the anchor's time over ours) of each of `pairs` pairs; `side(ours)` runs
/// `CELLS` cells of one side.
fn ratios(pairs: usize, side: impl Fn(bool)) -> Vec<f64> {
    let timed = |ours: bool| -> Duration {
        let start = Instant::now();
        side(ours);
        start.elapsed()
    };
    // One unmeasured pair warms both sides up.
    timed(true);
    timed(false);
    (0..pairs)
        .map(|pair| {
            let (ours, anchor) = if pair % 2 == 0 {
                let ours = timed(true);
                (ours, timed(false))
            } else {
                let anchor = timed(false);
                (timed(true), anchor)
            };
            anchor.as_secs_f64() / ours.as_secs_f64()
        })
        .collect()
}

/// Both sides of a channel cell.
fn channel<R: Record>(
    rt: &tokio::runtime::Runtime,
    capacity: usize,
    producers: usize,
    kanal: bool,
    ours: bool,
) {
    for _ in 0..CELLS {
        rt.block_on(async {
            if ours {
                channel_block::<R>(capacity, producers).await;
            } else if kanal {
                kanal_block::<R>(capacity, producers).await;
            } else {
                tokio_block::<R>(capacity, producers).await;
            }
        });
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: paired channel (ct|mt) CAPACITY PRODUCERS (u64|256B) PAIRS [tokio|kanal]\n       paired lane (ct|mt) PAIRS\n       paired permits (ct|mt) TASKS PAIRS\n       paired pool KEYS PAIRS";
    let flavor = match args.get(1).map(String::as_str) {
        _ if args.first().map(String::as_str) == Some("pool") => Flavor::MultiThread,
        Some("ct") => Flavor::CurrentThread,
        Some("mt") => Flavor::MultiThread,
        _ => panic!("{usage}"),
    };
    let number = |i: usize| -> usize {
        args.get(i).and_then(|a| a.parse().ok()).filter(|n| *n > 0).expect(usage)
    };
    let rt = flavor.runtime();
    let (cell, anchor, mut ratios) = match args.first().map(String::as_str) {
        Some("channel") => {
            let (capacity, producers, pairs) = (number(2), number(3), number(5));
            let record = args.get(4).map(String::as_str);
            let kanal = match args.get(6).map(String::as_str) {
                None | Some("tokio") => false,
                Some("kanal") => true,
                _ => panic!("{usage}"),
            };
            let ratios = match record {
                Some("u64") => {
                    ratios(pairs, |ours| channel::<u64>(&rt, capacity, producers, kanal, ours))
                }
                Some("256B") => {
                    ratios(pairs, |ours| channel::<Big>(&rt, capacity, producers, kanal, ours))
                }
                _ => panic!("{usage}"),
            };
            let topology = if producers == 1 { "spsc" } else { "mpsc" };
            let cell = format!("{topology}_{capacity}_{}", record.unwrap_or_default());
            (cell, if kanal { "kanal" } else { "tokio mpsc" }, ratios)
        }
        Some("lane") => {
            let (ours_lane, hand) = (lane(CONCURRENT, QUEUED), HandRolled::new(CONCURRENT, QUEUED));
            let ratios = ratios(number(2), |ours| {
                let (ours_lane, hand) = (ours_lane.clone(), hand.clone());
                rt.block_on(async move {
                    // Admitted from a task, as in suite 2 (block_on's future is not one).
                    tokio::spawn(async move {
                        for _ in 0..CELLS {
                            if ours {
                                lane_runs(ours_lane.clone(), RUNS).await;
                            } else {
                                hand_rolled(hand.clone(), RUNS).await;
                            }
                        }
                    })
                    .await
                    .expect("bench task");
                });
            });
            ("admit_run_finalize".to_owned(), "the hand-rolled lane", ratios)
        }
        Some("permits") => {
            let tasks = number(2);
            let limits = Limits::new();
            rt.block_on(limits.define("l", LimitSpec::concurrent(2))).expect("define");
            let ours = Permits::Lanes(limits.limit("l"));
            let anchor = Permits::Tokio(Arc::new(Semaphore::new(2)));
            let ratios = ratios(number(3), |side| {
                let permits = if side { &ours } else { &anchor };
                rt.block_on(async {
                    for _ in 0..PERMIT_CELLS {
                        contended(permits, tasks as u64).await;
                    }
                });
            });
            (format!("contended_{tasks}"), "tokio's semaphore", ratios)
        }
        Some("pool") => {
            let keys = number(1);
            let control = std::env::var("LANES_PAIRED_CONTROL").is_ok_and(|v| v == "1");
            let (work, done) = (pool_items(keys), Done::new(0));
            let (per_key, anchor) = {
                let _guard = rt.enter();
                (keyed_pool(false, done.clone()), keyed_pool(!control, done.clone()))
            };
            let ratios = ratios(number(2), |ours| {
                let pool = if ours { &per_key } else { &anchor };
                rt.block_on(async {
                    for _ in 0..CELLS {
                        pool_cell(pool, &done, &work).await;
                    }
                });
            });
            let anchor = if control { "a second per-key pool" } else { "the hashed-shard pool" };
            (format!("keyed_uniform_{keys}"), anchor, ratios)
        }
        _ => panic!("{usage}"),
    };
    ratios.sort_by(f64::total_cmp);
    let at = |q: f64| ratios[((ratios.len() - 1) as f64 * q).round() as usize];
    println!(
        "{} {cell}: ours / {anchor} = {:.2}× (quartiles {:.2}–{:.2}, {} pairs)",
        flavor.name(),
        at(0.5),
        at(0.25),
        at(0.75),
        ratios.len(),
    );
}
