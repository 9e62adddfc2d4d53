//! A fixed amount of work for `perf stat`: the channel's block-mode SPSC cell of suite 3 (ours and
//! tokio mpsc's) and the run lane's admit → run → finalize cell of suite 2 (the same code,
//! `src/scenarios.rs`), on a `current_thread` runtime, a fixed number of rounds (criterion picks
//! its iteration counts by time, so two builds do not run the same work there).
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
//! `LANES_FIXED_RECORD=256B` runs the `channel`, `tokio` and `kanal` cells with suite 3's
//! 256-byte records instead of `u64`s.
//!
//! `LANES_FIXED_PRODUCERS=4` runs the `channel`, `tokio` and `kanal` cells with four producers
//! (suite 3's `mpsc` shape) instead of one.
//!
//! `LANES_FIXED_FLAVOR=multi_thread_2` runs any cell on two worker threads instead (for wall
//! time and system calls, not instruction counts: the work then depends on the scheduling).
//!
//! `LANES_FIXED_RUNTIMES=n` runs the `lane` and `hand-rolled` cells on n threads at once, each
//! with a `current_thread` runtime of its own, all sharing one lane (a server with a runtime per
//! core): each thread runs the rounds, and the rate is every thread's runs over the longest.
//! `LANES_FIXED_ADMITTERS=n` runs them in n tasks of the one runtime instead (with
//! `LANES_FIXED_FLAVOR=multi_thread_2`, admissions from both workers at once).
//!
//! Arguments: the cell (`channel`, `tokio`, `kanal`, `lane` or `hand-rolled`, suite 2's
//! two-semaphore lane), the channel's capacity (or the lane's execution slots), and the rounds
//! (10,000 records or 1,000 runs each). It prints the records or runs per second it measured, as
//! context.
//!
//! `permits` and `semaphore` are suite 1's contended cell on one thread: the second argument is
//! the number of tasks sharing 2 permits, each taking and returning one 64 times with a yield
//! while holding it, through a `Limit` handle or a `tokio::sync::Semaphore` (a round is every
//! task's 64 acquires); `permits-named` is the same cell through `Limits::acquire(name)`.
//!
//! `keyed`, `keyed-rate` and `governor-keyed` are suite 6's keyed check over as many keys as the
//! second argument says (the bench's stride through them): a `KeyedLimit` without a rate (a
//! concurrency per key, which reads no clock), one with suite 6's rate, and governor's keyed
//! limiter. A round is 10,000 checks.
//!
//! `rate`, `check` and `governor` are suite 6's direct rate check (a `Limit` handle's `try_acquire`
//! and its permit dropped, its `check`, `Limits::check(name)`, and governor's `check`);
//! `uncontended`, `named` and `tokio-uncontended` are suite 1's uncontended acquire + release
//! (through a `Limit` handle, by name through `Limits`, and of a `tokio::sync::Semaphore`). A round
//! is 10,000 of them; the second argument is ignored.
//!
//! Four more cells follow suites 4 and 5 on `current_thread` (their capacities are fixed; give
//! any): `drop-oldest` (`try_emit` into a 64-record `DropOldest` channel, a consumer that works
//! ~200 steps per record), `spill` (the same into a `Spill` channel whose spill queue, under
//! `SyncPolicy::Never`, lives in a fresh directory under the system's temporary one; cachegrind
//! counts its writer thread too), `next-batch` (`emit` into 1,024 records, `next_batch` of 64 +
//! `ack`; the linger is 10 s so that only the batch size and the close flush, as under cachegrind a
//! shorter one would fire at times that vary) and `recv-many` (`recv_many` of 64).
//!
//! `pool` and `pool-hashed` are suite 8's uniform cell: 10,000 no-op items over as many keys
//! as the second argument says, submitted from the runtime's `block_on` to a per-key pool of 8
//! workers, or to the hashed-shard pool of 8 shards; a round is 10,000 items.
//!
//! `reject` and `reject-hand-rolled` are suite 2's reject path: a run refused by a full lane
//! (one slot, held, no waiting room), and `try_acquire_owned` refused by the hand-rolled
//! lane's full outer semaphore; a round is 10,000 refusals, the second argument is ignored.
//!
//! `wait-queue` is suite 7's pop + push of the fair wait queue, the second argument being the
//! number of fairness keys (two tickets wait per key); a round is 100,000 pops and pushes. With
//! cachegrind's cache simulation and its last level set to this host's L2
//! (`--cache-sim=yes --LL=1048576,16,64`), the difference of two round counts gives the misses
//! per operation as well as the instructions. `wait-queue-fifo` keeps that many
//! default-priority waiters (a limit's plain line) and pops the oldest and pushes a new one;
//! `wait-queue-cancel` fills the queue with that many default-priority waiters and withdraws
//! every one in a scattered order.
//!
//! `limit-cancel` and `semaphore-cancel` do the same through a `Limit` (or tokio's
//! `Semaphore`): that many tasks wait on one held permit and are aborted in a scattered order
//! (`LANES_FIXED_KEYS=k` spreads the limit's waiters over k fairness keys).

use std::time::Instant;

use std::hint::black_box;
use std::time::Duration;

use std::sync::Arc;

use governor::{Quota, RateLimiter};
use lanes::channel::{BinaryCodec, Channel, ChannelConfig, ConsumerOptions, Overflow};
use lanes::spill::{SpillOptions, SpillQueue, SyncPolicy};
use lanes::{KeyedLimit, LimitSpec, Limits, Priority, WaitQueue};
use lanes_benches::scenarios::{
    Big, FairQueueCell, HandRolled, PER_TASK, POOL_ITEMS, Permits, RECORDS, Record, channel_block,
    contended, full_hand_rolled, full_lane, hand_rolled, kanal_block, keyed_pool, lane, lane_runs,
    next_batch_block, pool_cell, pool_items, recv_many_block, refuse, refuse_hand_rolled,
    tokio_block,
};
use lanes_benches::{Done, Flavor};
use std::num::NonZeroU32;
use tokio::sync::Semaphore;

const RUNS: u64 = 1_000;
/// Checks per round of the `rate`, `uncontended` and `governor` cells.
const CHECKS: u64 = 10_000;

/// `rounds` rounds of suite 3's block-mode cell with `R` records, through our channel, tokio
/// mpsc or kanal (`cell`).
fn channel_rounds<R: Record>(
    rt: &tokio::runtime::Runtime,
    cell: &str,
    capacity: usize,
    producers: usize,
    rounds: u64,
) -> (u64, Duration) {
    rt.block_on(async {
        let start = Instant::now();
        for _ in 0..rounds {
            match cell {
                "channel" => channel_block::<R>(capacity, producers).await,
                "tokio" => tokio_block::<R>(capacity, producers).await,
                _ => kanal_block::<R>(capacity, producers).await,
            }
        }
        (rounds * RECORDS as u64, start.elapsed())
    })
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: fixed (channel|tokio|kanal|lane|pool|pool-hashed|permits|semaphore|rate|check|check-named|governor|keyed|keyed-rate|governor-keyed|uncontended|named|tokio-uncontended|reject|reject-hand-rolled|drop-oldest|spill|next-batch|recv-many|wait-queue|wait-queue-fifo|wait-queue-cancel|limit-cancel|semaphore-cancel) CAPACITY ROUNDS";
    let cell = args.first().expect(usage).clone();
    let size: usize = args.get(1).and_then(|a| a.parse().ok()).expect(usage);
    let rounds: u64 = args.get(2).and_then(|a| a.parse().ok()).expect(usage);
    let producers: usize =
        std::env::var("LANES_FIXED_PRODUCERS").map_or(1, |p| p.parse().expect(usage));
    let flavor = match std::env::var("LANES_FIXED_FLAVOR").as_deref() {
        Ok("multi_thread_2") => Flavor::MultiThread,
        _ => Flavor::CurrentThread,
    };
    let big = match std::env::var("LANES_FIXED_RECORD").as_deref() {
        Ok("256B") => true,
        Ok("u64") | Err(_) => false,
        Ok(_) => panic!("LANES_FIXED_RECORD is u64 or 256B"),
    };
    let runtimes: usize =
        std::env::var("LANES_FIXED_RUNTIMES").map_or(1, |n| n.parse().expect(usage));
    let admitters: usize =
        std::env::var("LANES_FIXED_ADMITTERS").map_or(1, |n| n.parse().expect(usage));
    let rt = flavor.runtime();
    let (items, elapsed) = match cell.as_str() {
        "channel" | "tokio" | "kanal" if big => {
            channel_rounds::<Big>(&rt, &cell, size, producers, rounds)
        }
        "channel" | "tokio" | "kanal" => channel_rounds::<u64>(&rt, &cell, size, producers, rounds),
        "lane" | "hand-rolled" if runtimes > 1 => shared_rounds(&cell, size, runtimes, rounds),
        "lane" | "hand-rolled" if admitters > 1 => {
            admitters_rounds(&rt, &cell, size, admitters, rounds)
        }
        "hand-rolled" => {
            let lane = HandRolled::new(size, 2_000);
            lane_rounds(&rt, rounds, move || hand_rolled(lane.clone(), RUNS))
        }
        "lane" => {
            let lane = lane(size, 2_000);
            lane_rounds(&rt, rounds, move || lane_runs(lane.clone(), RUNS))
        }
        "pool" | "pool-hashed" => {
            let done = Done::new(0);
            let pool = {
                let _guard = rt.enter();
                keyed_pool(cell == "pool-hashed", done.clone())
            };
            let work = pool_items(size);
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..rounds {
                    pool_cell(&pool, &done, &work).await;
                }
                (rounds * POOL_ITEMS, start.elapsed())
            })
        }
        "permits" | "permits-named" | "semaphore" => rt.block_on(async {
            let permits = if cell != "semaphore" {
                let limits = Limits::new();
                limits.define("l", LimitSpec::concurrent(2)).await.expect("define");
                if cell == "permits" {
                    Permits::Lanes(limits.limit("l"))
                } else {
                    Permits::Named(limits)
                }
            } else {
                Permits::Tokio(Arc::new(Semaphore::new(2)))
            };
            let start = Instant::now();
            for _ in 0..rounds {
                contended(&permits, size as u64).await;
            }
            (rounds * size as u64 * PER_TASK, start.elapsed())
        }),
        "rate" | "check" => rt.block_on(async {
            let limits = Limits::new();
            let spec = LimitSpec::concurrent(u32::MAX).per_second(1e9).burst(u32::MAX);
            limits.define("r", spec).await.expect("define");
            let handle = limits.limit("r");
            let checks = rounds * CHECKS;
            let start = Instant::now();
            for _ in 0..checks {
                if cell == "check" {
                    handle.check().await.expect("limit");
                } else {
                    drop(black_box(handle.try_acquire().await.expect("limit")));
                }
            }
            (checks, start.elapsed())
        }),
        // An arm of its own: sharing the loop above changes how the compiler inlines it.
        "check-named" => rt.block_on(async {
            let limits = Limits::new();
            let spec = LimitSpec::concurrent(u32::MAX).per_second(1e9).burst(u32::MAX);
            limits.define("r", spec).await.expect("define");
            let checks = rounds * CHECKS;
            let start = Instant::now();
            for _ in 0..checks {
                limits.check("r").await.expect("limit");
            }
            (checks, start.elapsed())
        }),
        "uncontended" | "named" => rt.block_on(async {
            let limits = Limits::new();
            limits.define("l", LimitSpec::concurrent(1_000)).await.expect("define");
            let handle = limits.limit("l");
            let checks = rounds * CHECKS;
            let start = Instant::now();
            for _ in 0..checks {
                let permit = if cell == "named" {
                    limits.acquire("l", Priority::default()).await
                } else {
                    handle.acquire().await
                };
                drop(black_box(permit.expect("permit")));
            }
            (checks, start.elapsed())
        }),
        "reject" => rt.block_on(async {
            let (full, hold) = full_lane();
            let checks = rounds * CHECKS;
            let start = Instant::now();
            for _ in 0..checks {
                black_box(refuse(&full));
            }
            let elapsed = start.elapsed();
            hold.add_permits(1);
            (checks, elapsed)
        }),
        "reject-hand-rolled" => rt.block_on(async {
            let (hand, _held) = full_hand_rolled();
            let checks = rounds * CHECKS;
            let start = Instant::now();
            for _ in 0..checks {
                black_box(refuse_hand_rolled(&hand));
            }
            (checks, start.elapsed())
        }),
        "tokio-uncontended" => rt.block_on(async {
            let semaphore = Semaphore::new(1_000);
            let checks = rounds * CHECKS;
            let start = Instant::now();
            for _ in 0..checks {
                drop(black_box(semaphore.acquire().await.expect("permit")));
            }
            (checks, start.elapsed())
        }),
        "governor" => {
            let quota = Quota::per_second(NonZeroU32::new(1_000_000_000).expect("non-zero"));
            let limiter = RateLimiter::direct(quota);
            let checks = rounds * CHECKS;
            let start = Instant::now();
            for _ in 0..checks {
                black_box(limiter.check()).expect("limit");
            }
            (checks, start.elapsed())
        }
        "keyed" | "keyed-rate" | "governor-keyed" => {
            let names: Vec<String> = (0..size).map(|i| format!("key-{i}")).collect();
            let checks = rounds * CHECKS;
            let mut at = 0;
            let mut next = || {
                at = (at + 7919) % size;
                &names[at]
            };
            if cell == "governor-keyed" {
                let quota = Quota::per_second(NonZeroU32::new(1_000_000_000).expect("non-zero"));
                let limiter = RateLimiter::keyed(quota);
                names.iter().for_each(|name| drop(limiter.check_key(name)));
                let start = Instant::now();
                for _ in 0..checks {
                    black_box(limiter.check_key(next())).expect("limit");
                }
                (checks, start.elapsed())
            } else {
                let spec = match cell.as_str() {
                    "keyed" => LimitSpec::concurrent(u32::MAX),
                    _ => LimitSpec::rate(1.0).burst(u32::MAX),
                };
                let limit: KeyedLimit = KeyedLimit::new("keyed", spec).expect("spec");
                names.iter().for_each(|name| limit.check(name.as_str()).expect("check"));
                let start = Instant::now();
                for _ in 0..checks {
                    black_box(limit.check(next().as_str())).expect("limit");
                }
                (checks, start.elapsed())
            }
        }
        "drop-oldest" | "spill" | "next-batch" | "recv-many" => rt.block_on(async {
            let start = Instant::now();
            for round in 0..rounds {
                match cell.as_str() {
                    "drop-oldest" => drop_oldest().await,
                    "spill" => spill(round).await,
                    // A 10 s linger: under cachegrind a shorter one fires at times that vary.
                    "next-batch" => next_batch_block(Duration::from_secs(10)).await,
                    _ => recv_many_block().await,
                }
            }
            (rounds * RECORDS as u64, start.elapsed())
        }),
        "wait-queue" => {
            let mut cell = FairQueueCell::new(size);
            let ops = rounds * 100_000;
            let start = Instant::now();
            for _ in 0..ops {
                black_box(cell.step());
            }
            (ops, start.elapsed())
        }
        "limit-cancel" | "semaphore-cancel" => rt.block_on(async {
            // The same through a limit's async facade (or tokio's semaphore): `size` tasks
            // wait on one held permit, then are aborted in a scattered order; a round ends
            // when the permit is taken again at once.
            let n = size as u64;
            let keys: Option<u64> =
                std::env::var("LANES_FIXED_KEYS").ok().map(|k| k.parse().expect(usage));
            let limits = Limits::new();
            limits.define("l", LimitSpec::concurrent(1)).await.expect("define");
            let limit = limits.limit("l");
            let semaphore = Arc::new(Semaphore::new(1));
            let start = Instant::now();
            for _ in 0..rounds {
                let (lanes_held, tokio_held) = if cell == "limit-cancel" {
                    (Some(limit.acquire().await.expect("permit")), None)
                } else {
                    (None, Some(semaphore.clone().acquire_owned().await.expect("permit")))
                };
                let tasks: Vec<_> = (0..n)
                    .map(|i| {
                        let (limit, semaphore) = (limit.clone(), semaphore.clone());
                        let lanes = cell == "limit-cancel";
                        // With `LANES_FIXED_KEYS=k`, waiters take turns over k fairness keys
                        // (the limit's fair wait queue instead of its plain line).
                        let priority = keys.map(|k| Priority::default().key(format!("k{}", i % k)));
                        tokio::spawn(async move {
                            if lanes {
                                match priority {
                                    Some(priority) => drop(limit.acquire_with(priority).await),
                                    None => drop(limit.acquire().await),
                                }
                            } else {
                                drop(semaphore.acquire().await);
                            }
                        })
                    })
                    .collect();
                // Let every task reach the line.
                for _ in 0..4 {
                    tokio::task::yield_now().await;
                }
                let stride = (0x9e37_79b9_u64..).find(|s| gcd(*s, n) == 1).expect("a stride");
                for i in 0..n {
                    tasks[(i.wrapping_mul(stride) % n) as usize].abort();
                }
                for task in tasks {
                    let _ = task.await;
                }
                drop((lanes_held, tokio_held));
                if cell == "limit-cancel" {
                    drop(limit.try_acquire().await.expect("the permit is free again"));
                } else {
                    drop(semaphore.try_acquire().expect("the permit is free again"));
                }
            }
            (rounds * n, start.elapsed())
        }),
        "wait-queue-fifo" => {
            // A limit's plain line at a steady `size` waiters: pop the oldest, push a new one.
            let mut queue = WaitQueue::new();
            let n = size as u64;
            for ticket in 0..n {
                queue.push(ticket, &Priority::default());
            }
            let ops = rounds * 100_000;
            let start = Instant::now();
            for ticket in n..n + ops {
                black_box(queue.pop());
                queue.push(ticket, &Priority::default());
            }
            (ops, start.elapsed())
        }
        "wait-queue-cancel" => {
            // `size` waiters of the default priority, every one withdrawn in a scattered
            // order (as callers time out or go away); a round is one such fill and drain.
            let mut queue = WaitQueue::new();
            let start = Instant::now();
            let n = size as u64;
            for _ in 0..rounds {
                for ticket in 0..n {
                    queue.push(ticket, &Priority::default());
                }
                // A stride coprime with n visits every ticket once, far from its neighbours.
                let stride = (0x9e37_79b9_u64..).find(|s| gcd(*s, n) == 1).expect("a stride");
                for i in 0..n {
                    assert!(queue.remove(i.wrapping_mul(stride) % n));
                }
            }
            (rounds * n, start.elapsed())
        }
        _ => panic!("{usage}"),
    };
    println!("{cell}: {:.2} M/s", items as f64 / elapsed.as_secs_f64() / 1e6);
}

/// `rounds` rounds of a lane cell (each [`RUNS`] runs) in a spawned task, as suite 2 runs
/// them: the runs and the time they took.
fn lane_rounds<F, Fut>(rt: &tokio::runtime::Runtime, rounds: u64, mut round: F) -> (u64, Duration)
where
    F: FnMut() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    rt.block_on(async {
        tokio::spawn(async move {
            let start = Instant::now();
            for _ in 0..rounds {
                round().await;
            }
            (rounds * RUNS, start.elapsed())
        })
        .await
        .expect("bench task")
    })
}

/// `rounds` rounds of a lane cell on each of `runtimes` threads, each with a `current_thread`
/// runtime of its own, all admitting into one lane of `size` slots (`LANES_FIXED_RUNTIMES`):
/// every thread's runs and the longest thread's time.
fn shared_rounds(cell: &str, size: usize, runtimes: usize, rounds: u64) -> (u64, Duration) {
    let queued = 2_000 * runtimes;
    let (ours, hand) = (lane(size, queued), HandRolled::new(size, queued));
    let start = Arc::new(std::sync::Barrier::new(runtimes));
    let threads: Vec<_> = (0..runtimes)
        .map(|_| {
            let (ours, hand, start) = (ours.clone(), hand.clone(), start.clone());
            let ours_cell = cell == "lane";
            std::thread::spawn(move || {
                let rt = Flavor::CurrentThread.runtime();
                start.wait();
                if ours_cell {
                    lane_rounds(&rt, rounds, move || lane_runs(ours.clone(), RUNS))
                } else {
                    lane_rounds(&rt, rounds, move || hand_rolled(hand.clone(), RUNS))
                }
            })
        })
        .collect();
    let times = threads.into_iter().map(|thread| thread.join().expect("bench thread"));
    let (runs, longest) =
        times.fold((0, Duration::ZERO), |(runs, longest), (n, took)| (runs + n, longest.max(took)));
    (runs, longest)
}

/// `rounds` rounds of a lane cell in each of `admitters` tasks of `rt`, all admitting into one
/// lane of `size` slots (`LANES_FIXED_ADMITTERS`): every task's runs and the longest task's time.
fn admitters_rounds(
    rt: &tokio::runtime::Runtime,
    cell: &str,
    size: usize,
    admitters: usize,
    rounds: u64,
) -> (u64, Duration) {
    let queued = 2_000 * admitters;
    let (ours, hand) = (lane(size, queued), HandRolled::new(size, queued));
    let ours_cell = cell == "lane";
    rt.block_on(async {
        let tasks: Vec<_> = (0..admitters)
            .map(|_| {
                let (ours, hand) = (ours.clone(), hand.clone());
                tokio::spawn(async move {
                    let start = Instant::now();
                    for _ in 0..rounds {
                        if ours_cell {
                            lane_runs(ours.clone(), RUNS).await;
                        } else {
                            hand_rolled(hand.clone(), RUNS).await;
                        }
                    }
                    (rounds * RUNS, start.elapsed())
                })
            })
            .collect();
        let mut total = (0, Duration::ZERO);
        for task in tasks {
            let (runs, took) = task.await.expect("bench task");
            total = (total.0 + runs, total.1.max(took));
        }
        total
    })
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Work a slow consumer does per record (suite 4's).
fn consumer_work() {
    let mut x = 0u64;
    for i in 0..200u64 {
        x = black_box(x.wrapping_mul(31).wrapping_add(i));
    }
    black_box(x);
}

/// Suite 4's drop-oldest cell: `RECORDS` emits without waiting into a slow consumer.
async fn drop_oldest() {
    overflow(Overflow::DropOldest).await;
}

/// Suite 4's spill cell, with a spill queue of its own (`round` names its directory).
async fn spill(round: u64) {
    let dir =
        std::env::temp_dir().join(format!("lanes-fixed-spill-{}-{round}", std::process::id()));
    let options = SpillOptions::default().sync(SyncPolicy::Never).max_bytes(1 << 34);
    let (queue, _) = SpillQueue::open(&dir, options).await.expect("spill queue");
    overflow(Overflow::spill(queue, BinaryCodec::new())).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// `RECORDS` emits without waiting into a 64-record channel under `policy`, with a slow consumer.
async fn overflow(policy: Overflow<u64>) {
    let channel = Channel::new(ChannelConfig::new(64).overflow(policy)).unwrap();
    let mut consumer = channel.consumer(ConsumerOptions::new()).unwrap();
    let drain = tokio::spawn(async move {
        while let Some(record) = consumer.recv().await {
            black_box(record);
            consumer_work();
        }
    });
    for i in 0..RECORDS as u64 {
        black_box(channel.try_emit(i).unwrap());
    }
    channel.close();
    drain.await.unwrap();
}
