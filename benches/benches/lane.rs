//! Suite 2, run lane: admit → run → finalize of a no-op job, and the reject path when full,
//! against a hand-rolled two-semaphore lane and tokio mpsc + N workers, in the same run.

#![allow(missing_docs)] // criterion_group! generates an undocumented function
use std::convert::Infallible;
use std::future::ready;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use lanes_benches::scenarios::{
    HandRolled, full_hand_rolled, full_lane, hand_rolled, lane, lane_runs, refuse,
    refuse_hand_rolled,
};
use lanes_benches::{Done, Flavor, calibrate, config};
use tokio::sync::mpsc;

/// Runs per measured batch.
const RUNS: u64 = 1_000;
/// Execution slots of every lane under test.
const CONCURRENT: usize = 8;
/// Waiting room: enough for a whole batch, so nothing is refused in the throughput scenario.
const QUEUED: usize = 2_000;

/// A bounded mpsc queue drained by `CONCURRENT` worker tasks.
async fn mpsc_workers(runs: u64) {
    let done = Done::new(runs);
    let (tx, rx) = mpsc::channel::<()>(QUEUED);
    let rx = Arc::new(tokio::sync::Mutex::new(rx));
    let workers: Vec<_> = (0..CONCURRENT)
        .map(|_| {
            let (rx, done) = (rx.clone(), done.clone());
            tokio::spawn(async move {
                loop {
                    let job = rx.lock().await.recv().await;
                    match job {
                        Some(()) => {
                            black_box(ready(Ok::<(), Infallible>(())).await).ok();
                            done.finish_one();
                        }
                        None => return,
                    }
                }
            })
        })
        .collect();
    for _ in 0..runs {
        tx.try_send(()).expect("the channel refused");
    }
    done.wait().await;
    drop(tx);
    for worker in workers {
        worker.await.expect("worker");
    }
}

fn throughput(c: &mut Criterion) {
    let mut group = c.benchmark_group("lane_admit_run_finalize");
    group.throughput(Throughput::Elements(RUNS));
    for flavor in Flavor::ALL {
        let rt = flavor.runtime();
        let ours_lane = lane(CONCURRENT, QUEUED);
        group.bench_function(BenchmarkId::new("lanes", flavor.name()), |b| {
            b.iter_custom(|iters| {
                let lane = ours_lane.clone();
                rt.block_on(async move {
                    tokio::spawn(async move {
                        let start = Instant::now();
                        for _ in 0..iters {
                            lane_runs(lane.clone(), RUNS).await;
                        }
                        start.elapsed()
                    })
                    .await
                    .expect("bench task")
                })
            })
        });
        let hand = HandRolled::new(CONCURRENT, QUEUED);
        group.bench_function(BenchmarkId::new("hand_rolled_two_semaphores", flavor.name()), |b| {
            b.iter_custom(|iters| {
                let hand = hand.clone();
                rt.block_on(async move {
                    tokio::spawn(async move {
                        let start = Instant::now();
                        for _ in 0..iters {
                            hand_rolled(hand.clone(), RUNS).await;
                        }
                        start.elapsed()
                    })
                    .await
                    .expect("bench task")
                })
            })
        });
        group.bench_function(BenchmarkId::new("tokio_mpsc_workers", flavor.name()), |b| {
            b.iter_custom(|iters| {
                rt.block_on(async move {
                    tokio::spawn(async move {
                        let start = Instant::now();
                        for _ in 0..iters {
                            mpsc_workers(RUNS).await;
                        }
                        start.elapsed()
                    })
                    .await
                    .expect("bench task")
                })
            })
        });
    }
    group.finish();
}

fn reject(c: &mut Criterion) {
    let mut group = c.benchmark_group("lane_reject_when_full");
    let rt = Flavor::CurrentThread.runtime();
    let _guard = rt.enter();
    // One slot, no waiting room, held by a job that never ends while we measure.
    let (full, hold) = full_lane();
    group.bench_function("lanes", |b| b.iter(|| black_box(refuse(&full))));
    let (hand, _held) = full_hand_rolled();
    group.bench_function("hand_rolled_two_semaphores", |b| {
        b.iter(|| black_box(refuse_hand_rolled(&hand)))
    });
    let (tx, _rx) = mpsc::channel::<()>(1);
    tx.try_send(()).expect("first message");
    group.bench_function("tokio_mpsc_try_send", |b| b.iter(|| black_box(tx.try_send(()).is_err())));
    group.finish();
    hold.add_permits(1);
}

criterion_group! {
    name = benches;
    config = config();
    targets = calibrate, throughput, reject
}
criterion_main!(benches);
