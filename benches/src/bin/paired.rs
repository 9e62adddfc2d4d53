//! Paired rounds of one block-mode channel cell of suite 3, ours against tokio mpsc, for the
//! cells whose one-run ratio swings with the host's scheduler (the `multi_thread_2` cells:
//! two runs of the same build read `spsc_1_u64` at 0.47× and 1.97×).
//!
//! Each pair runs both sides back to back, in alternating order (ours first in even pairs,
//! tokio first in odd ones), each side for the same number of whole cells; the ratio of a
//! pair is tokio's time over ours (above 1: ours is faster). Drift of the host between pairs
//! cancels out of each pair's ratio, and the median over the pairs is the figure, with its
//! quartiles as the spread:
//!
//! ```sh
//! cargo run --release -p lanes-benches --bin paired -- mt 64 4 u64 41
//! ```
//!
//! Arguments: the runtime (`ct` or `mt`), the capacity, the producers, the record (`u64` or
//! `256B`), and the pairs (odd: the median is one of them).

use std::time::{Duration, Instant};

use lanes_benches::Flavor;
use lanes_benches::scenarios::{Big, Record, channel_block, tokio_block};

/// Cells per side in a pair: enough that one side takes a few milliseconds at the slowest.
const CELLS: usize = 5;

/// The time of `CELLS` cells of one side.
fn side<R: Record>(
    rt: &tokio::runtime::Runtime,
    ours: bool,
    capacity: usize,
    producers: usize,
) -> Duration {
    let start = Instant::now();
    for _ in 0..CELLS {
        rt.block_on(async {
            if ours {
                channel_block::<R>(capacity, producers).await;
            } else {
                tokio_block::<R>(capacity, producers).await;
            }
        });
    }
    start.elapsed()
}

/// The ratio (tokio's time over ours) of each of `pairs` pairs.
fn ratios<R: Record>(
    rt: &tokio::runtime::Runtime,
    capacity: usize,
    producers: usize,
    pairs: usize,
) -> Vec<f64> {
    // One unmeasured pair warms both sides up.
    side::<R>(rt, true, capacity, producers);
    side::<R>(rt, false, capacity, producers);
    (0..pairs)
        .map(|pair| {
            let (ours, tokio) = if pair % 2 == 0 {
                let ours = side::<R>(rt, true, capacity, producers);
                (ours, side::<R>(rt, false, capacity, producers))
            } else {
                let tokio = side::<R>(rt, false, capacity, producers);
                (side::<R>(rt, true, capacity, producers), tokio)
            };
            tokio.as_secs_f64() / ours.as_secs_f64()
        })
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: paired (ct|mt) CAPACITY PRODUCERS (u64|256B) PAIRS";
    let flavor = match args.first().map(String::as_str) {
        Some("ct") => Flavor::CurrentThread,
        Some("mt") => Flavor::MultiThread,
        _ => panic!("{usage}"),
    };
    let number = |i: usize| -> usize { args.get(i).and_then(|a| a.parse().ok()).expect(usage) };
    let (capacity, producers, pairs) = (number(1), number(2), number(4));
    assert!(capacity > 0 && producers > 0 && pairs > 0, "{usage}");
    let rt = flavor.runtime();
    let mut ratios = match args.get(3).map(String::as_str) {
        Some("u64") => ratios::<u64>(&rt, capacity, producers, pairs),
        Some("256B") => ratios::<Big>(&rt, capacity, producers, pairs),
        _ => panic!("{usage}"),
    };
    ratios.sort_by(f64::total_cmp);
    let at = |q: f64| ratios[((ratios.len() - 1) as f64 * q).round() as usize];
    let topology = if producers == 1 { "spsc" } else { "mpsc" };
    println!(
        "{} {topology}_{capacity}_{}: ours / tokio mpsc = {:.2}× (quartiles {:.2}–{:.2}, {} pairs)",
        flavor.name(),
        args[3],
        at(0.5),
        at(0.25),
        at(0.75),
        ratios.len(),
    );
}
