//! A fixed amount of work for `perf stat`: the channel's block-mode SPSC cell of suite 3 (ours
//! and tokio mpsc's) and the run lane's admit → run → finalize cell of suite 2 (the same code,
//! `src/scenarios.rs`),
//! on a `current_thread` runtime, a fixed number of rounds (criterion picks its iteration counts by time, so two builds do not
//! run the same work there).
//!
//! Instructions and cycles per record are much steadier than wall time on a shared host, so
//! an A/B of a small change reads them:
//!
//! ```sh
//! cargo build --release -p lanes-benches --bin fixed
//! perf stat -e instructions:u,cycles:u target/release/fixed channel 1024 200
//! perf stat -e instructions:u,cycles:u target/release/fixed tokio 1024 200
//! perf stat -e instructions:u,cycles:u target/release/fixed lane 8 200
//! ```
//!
//! Without hardware counters (a VM), `valgrind --tool=cachegrind --cache-sim=no` counts the
//! instructions; the cost per record is the difference of two round counts over the records
//! between them (setup cancels out).
//!
//! Arguments: the cell (`channel`, `tokio`, `kanal` or `lane`), the channel's capacity (or the lane's
//! execution slots), and the rounds (10,000 records or 1,000 runs each). It prints the records
//! or runs per second it measured, as context.

use std::time::Instant;

use lanes_benches::Flavor;
use lanes_benches::scenarios::{RECORDS, channel_block, kanal_block, lane, lane_runs, tokio_block};

const RUNS: u64 = 1_000;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: fixed (channel|tokio|kanal|lane) CAPACITY ROUNDS";
    let cell = args.first().expect(usage).clone();
    let size: usize = args.get(1).and_then(|a| a.parse().ok()).expect(usage);
    let rounds: u64 = args.get(2).and_then(|a| a.parse().ok()).expect(usage);
    let rt = Flavor::CurrentThread.runtime();
    let (items, elapsed) = match cell.as_str() {
        "channel" => rt.block_on(async {
            let start = Instant::now();
            for _ in 0..rounds {
                channel_block::<u64>(size, 1).await;
            }
            (rounds * RECORDS as u64, start.elapsed())
        }),
        "tokio" => rt.block_on(async {
            let start = Instant::now();
            for _ in 0..rounds {
                tokio_block::<u64>(size, 1).await;
            }
            (rounds * RECORDS as u64, start.elapsed())
        }),
        "kanal" => rt.block_on(async {
            let start = Instant::now();
            for _ in 0..rounds {
                kanal_block::<u64>(size, 1).await;
            }
            (rounds * RECORDS as u64, start.elapsed())
        }),
        "lane" => {
            let lane = lane(size, 2_000);
            rt.block_on(async {
                tokio::spawn(async move {
                    let start = Instant::now();
                    for _ in 0..rounds {
                        lane_runs(lane.clone(), RUNS).await;
                    }
                    (rounds * RUNS, start.elapsed())
                })
                .await
                .expect("bench task")
            })
        }
        _ => panic!("{usage}"),
    };
    println!("{cell}: {:.2} M/s", items as f64 / elapsed.as_secs_f64() / 1e6);
}
