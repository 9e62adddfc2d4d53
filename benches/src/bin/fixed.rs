//! A fixed amount of work for `perf stat`: the channel's block-mode SPSC cell of suite 3 and
//! the run lane's admit → run → finalize cell of suite 2, on a `current_thread` runtime, a
//! fixed number of rounds (criterion picks its iteration counts by time, so two builds do not
//! run the same work there).
//!
//! Instructions and cycles per record are much steadier than wall time on a shared host, so
//! an A/B of a small change reads them:
//!
//! ```sh
//! cargo build --release -p lanes-benches --bin fixed
//! perf stat -e instructions:u,cycles:u target/release/fixed channel 1024 200
//! perf stat -e instructions:u,cycles:u target/release/fixed lane 8 200
//! ```
//!
//! Arguments: the cell (`channel` or `lane`), the channel's capacity (or the lane's execution
//! slots), and the rounds (10,000 records or 1,000 runs each). It prints the records or runs
//! per second it measured, as context.

use std::convert::Infallible;
use std::future::ready;
use std::hint::black_box;
use std::time::{Duration, Instant};

use lanes::channel::{Channel, ChannelConfig, ConsumerOptions};
use lanes::{LaneLimits, LaneSet, Run};
use lanes_benches::{Done, Flavor};

const RECORDS: usize = 10_000;
const RUNS: u64 = 1_000;

async fn channel_round(capacity: usize) {
    let channel = Channel::new(ChannelConfig::new(capacity)).expect("valid channel");
    let mut consumer = channel.consumer(ConsumerOptions::new()).expect("first consumer");
    let producer = channel.clone();
    tokio::spawn(async move {
        for i in 0..RECORDS as u64 {
            producer.emit(i).await.ok().unwrap(); // as in suite 3
        }
    });
    drop(channel);
    let mut n = 0;
    while let Some(record) = consumer.recv().await {
        black_box(record);
        n += 1;
    }
    assert_eq!(n, RECORDS);
}

async fn lane_round(lane: &lanes::Lane) {
    let done = Done::new(RUNS);
    for _ in 0..RUNS {
        let done = done.clone();
        let run = Run::typed(|_cx| ready(Ok::<(), Infallible>(()))).finalizer(move |_outcome| {
            done.finish_one();
            ready(Ok::<(), Infallible>(()))
        });
        assert!(lane.spawn(run).is_ok(), "the lane refused a run");
    }
    done.wait().await;
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: fixed (channel|lane) CAPACITY ROUNDS";
    let cell = args.first().expect(usage).clone();
    let size: usize = args.get(1).and_then(|a| a.parse().ok()).expect(usage);
    let rounds: u64 = args.get(2).and_then(|a| a.parse().ok()).expect(usage);
    let rt = Flavor::CurrentThread.runtime();
    let (items, elapsed) = match cell.as_str() {
        "channel" => rt.block_on(async {
            let start = Instant::now();
            for _ in 0..rounds {
                channel_round(size).await;
            }
            (rounds * RECORDS as u64, start.elapsed())
        }),
        "lane" => {
            let lane = LaneSet::builder()
                .lane("fixed", LaneLimits::new(size, 2_000))
                .audit_timeout(Duration::from_secs(1))
                .finalization_timeout(Duration::from_secs(1))
                .worker_drain_timeout(Duration::from_secs(1))
                .build()
                .expect("valid lane")
                .lane("fixed")
                .expect("lane exists");
            rt.block_on(async {
                tokio::spawn(async move {
                    let start = Instant::now();
                    for _ in 0..rounds {
                        lane_round(&lane).await;
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
