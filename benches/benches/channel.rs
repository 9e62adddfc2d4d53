//! Suites 3, 4 and 5: channels in block mode against tokio mpsc, flume, kanal and async-channel;
//! overflow under a 10× producer/consumer imbalance against async-channel `force_send`; and
//! batching (64 records / 10 ms linger) against tokio `recv_many` and tokio-stream
//! `chunks_timeout`. Counter reconciliation and the batching latency scenario are written to
//! `target/lanes-bench/` for the report.
#![allow(missing_docs)] // criterion_group! generates an undocumented function

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use lanes::channel::{BinaryCodec, Channel, ChannelConfig, ConsumerOptions, Emitted, Overflow};
use lanes::spill::{SpillOptions, SpillQueue, SyncPolicy};
use lanes_benches::scenarios::{
    BATCH, Big, RECORDS, Record, channel_block, kanal_block, next_batch_block, recv_many_block,
    tokio_block, tokio_recv_many_block,
};
use lanes_benches::{Flavor, config, quick, write_result};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;

async fn flume_block<R: Record>(capacity: usize, producers: usize) {
    let (tx, rx) = flume::bounded(capacity);
    for _ in 0..producers {
        let tx = tx.clone();
        tokio::spawn(async move {
            for i in 0..RECORDS / producers {
                tx.send_async(R::make(i)).await.ok().unwrap();
            }
        });
    }
    drop(tx);
    let mut n = 0;
    while let Ok(record) = rx.recv_async().await {
        black_box(record);
        n += 1;
    }
    assert_eq!(n, RECORDS);
}

async fn async_channel_block<R: Record>(capacity: usize, producers: usize) {
    let (tx, rx) = async_channel::bounded(capacity);
    for _ in 0..producers {
        let tx = tx.clone();
        tokio::spawn(async move {
            for i in 0..RECORDS / producers {
                tx.send(R::make(i)).await.ok().unwrap();
            }
        });
    }
    drop(tx);
    let mut n = 0;
    while let Ok(record) = rx.recv().await {
        black_box(record);
        n += 1;
    }
    assert_eq!(n, RECORDS);
}

/// Suite 3: block mode, the whole matrix.
fn block(c: &mut Criterion) {
    let mut group = c.benchmark_group("channel_block");
    group.throughput(Throughput::Elements(RECORDS as u64));
    for flavor in Flavor::ALL {
        let rt = flavor.runtime();
        for producers in [1usize, 4] {
            let topology = if producers == 1 { "spsc" } else { "mpsc" };
            for capacity in [1usize, 64, 1024] {
                for record in ["u64", "256B"] {
                    let id = |name: &str| {
                        BenchmarkId::new(
                            format!("{topology}_{capacity}_{record}/{name}"),
                            flavor.name(),
                        )
                    };
                    macro_rules! bench {
                        ($name:literal, $f:ident) => {
                            group.bench_function(id($name), |b| {
                                b.iter(|| {
                                    rt.block_on(async {
                                        if record == "u64" {
                                            $f::<u64>(capacity, producers).await
                                        } else {
                                            $f::<Big>(capacity, producers).await
                                        }
                                    })
                                })
                            });
                        };
                    }
                    bench!("lanes", channel_block);
                    bench!("tokio_mpsc", tokio_block);
                    bench!("flume", flume_block);
                    bench!("kanal", kanal_block);
                    bench!("async_channel", async_channel_block);
                }
            }
        }
    }
    group.finish();
}

/// Work the slow consumer does per record: about ten producer emits' worth.
fn consumer_work() {
    let mut x = 0u64;
    for i in 0..200u64 {
        x = black_box(x.wrapping_mul(31).wrapping_add(i));
    }
    black_box(x);
}

/// Suite 4: a producer emitting without waiting into a slow consumer. The time is the
/// producer's: `RECORDS` emits while the consumer works (and falls behind).
fn overflow(c: &mut Criterion) {
    let mut group = c.benchmark_group("channel_overflow");
    group.throughput(Throughput::Elements(RECORDS as u64));
    let rt = Flavor::MultiThread.runtime();
    let spill_dir =
        std::env::temp_dir().join(format!("lanes-bench-overflow-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&spill_dir);
    let queue = rt.block_on(async {
        SpillQueue::open(
            &spill_dir,
            SpillOptions::default().sync(SyncPolicy::Never).max_bytes(1 << 34),
        )
        .await
        .unwrap()
        .0
    });
    let mut reconcile = serde_json::Map::new();
    let overflows: [(&str, Overflow<u64>); 3] = [
        ("lanes_drop_oldest", Overflow::DropOldest),
        ("lanes_drop_newest", Overflow::DropNewest),
        ("lanes_spill", Overflow::spill(queue.clone(), BinaryCodec::new())),
    ];
    for (name, overflow) in overflows {
        let mut all_reconciled = true;
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let (elapsed, reconciled) = rt.block_on(async {
                        let channel =
                            Channel::new(ChannelConfig::new(64).overflow(overflow.clone()))
                                .unwrap();
                        let mut consumer = channel.consumer(ConsumerOptions::new()).unwrap();
                        let drain = tokio::spawn(async move {
                            while let Some(record) = consumer.recv().await {
                                black_box(record);
                                consumer_work();
                            }
                        });
                        let start = Instant::now();
                        for i in 0..RECORDS as u64 {
                            match channel.try_emit(i) {
                                Ok(Emitted::Queued | Emitted::Spilled) => {}
                                Ok(Emitted::Dropped(r) | Emitted::DroppedOldest(r)) => {
                                    black_box(r);
                                }
                                Err(err) => panic!("{err}"),
                            }
                        }
                        let elapsed = start.elapsed();
                        channel.close();
                        drain.await.unwrap();
                        let s = channel.snapshot();
                        (elapsed, s.reconciles() && s.emitted == RECORDS as u64)
                    });
                    all_reconciled &= reconciled;
                    total += elapsed;
                }
                total
            })
        });
        reconcile.insert(name.to_owned(), serde_json::Value::Bool(all_reconciled));
    }
    group.bench_function("async_channel_force_send", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                total += rt.block_on(async {
                    let (tx, rx) = async_channel::bounded::<u64>(64);
                    let drain = tokio::spawn(async move {
                        while let Ok(record) = rx.recv().await {
                            black_box(record);
                            consumer_work();
                        }
                    });
                    let start = Instant::now();
                    for i in 0..RECORDS as u64 {
                        black_box(tx.force_send(i).unwrap());
                    }
                    let elapsed = start.elapsed();
                    drop(tx);
                    drain.await.unwrap();
                    elapsed
                });
            }
            total
        })
    });
    group.bench_function("tokio_mpsc_try_send", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                total += rt.block_on(async {
                    let (tx, mut rx) = tokio::sync::mpsc::channel::<u64>(64);
                    let drain = tokio::spawn(async move {
                        while let Some(record) = rx.recv().await {
                            black_box(record);
                            consumer_work();
                        }
                    });
                    let start = Instant::now();
                    for i in 0..RECORDS as u64 {
                        let _ = black_box(tx.try_send(i));
                    }
                    let elapsed = start.elapsed();
                    drop(tx);
                    drain.await.unwrap();
                    elapsed
                });
            }
            total
        })
    });
    group.finish();
    rt.block_on(async {
        queue.close().await.unwrap();
    });
    drop(queue);
    let _ = std::fs::remove_dir_all(&spill_dir);
    write_result("channel_overflow_reconcile", &serde_json::Value::Object(reconcile));
}

const LINGER: Duration = Duration::from_millis(10);

/// Suite 5, throughput: a producer at full speed, a consumer taking batches of 64.
fn batching(c: &mut Criterion) {
    let mut group = c.benchmark_group("channel_batching");
    group.throughput(Throughput::Elements(RECORDS as u64));
    let rt = Flavor::MultiThread.runtime();
    group.bench_function("lanes_next_batch", |b| {
        b.iter(|| rt.block_on(next_batch_block(LINGER)));
    });
    group.bench_function("lanes_recv_many", |b| {
        b.iter(|| rt.block_on(recv_many_block()));
    });
    group.bench_function("tokio_recv_many", |b| {
        b.iter(|| rt.block_on(tokio_recv_many_block()));
    });
    group.bench_function("tokio_stream_chunks_timeout", |b| {
        b.iter(|| {
            rt.block_on(async {
                let (tx, rx) = tokio::sync::mpsc::channel(1024);
                tokio::spawn(async move {
                    for i in 0..RECORDS as u64 {
                        tx.send(i).await.unwrap();
                    }
                });
                let chunks = ReceiverStream::new(rx).chunks_timeout(BATCH, LINGER);
                tokio::pin!(chunks);
                let mut n = 0;
                while let Some(chunk) = chunks.next().await {
                    n += chunk.len();
                    black_box(chunk);
                }
                assert_eq!(n, RECORDS);
            })
        })
    });
    group.finish();
    batching_latency(&rt);
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let at = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[at]
}

/// Suite 5, latency: records paced one per 500 µs (so batches flush on the linger, not on
/// size); the added latency of each record is from its emit to its batch's delivery.
fn batching_latency(rt: &tokio::runtime::Runtime) {
    let records = if quick() { 2_000 } else { 6_000 };
    let pace = Duration::from_micros(500);
    let lanes = rt.block_on(async {
        let channel = Channel::new(ChannelConfig::new(1024)).unwrap();
        let mut consumer =
            channel.consumer(ConsumerOptions::new().batch_max(BATCH).batch_flush(LINGER)).unwrap();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(pace);
            for _ in 0..records {
                tick.tick().await;
                channel.emit(Instant::now()).await.unwrap();
            }
        });
        let mut added = Vec::with_capacity(records);
        while let Some(batch) = consumer.next_batch().await {
            let now = Instant::now();
            added.extend(batch.iter().map(|at| (now - *at).as_secs_f64() * 1e3));
            batch.ack().await.unwrap();
        }
        added
    });
    let anchor = rt.block_on(async {
        let (tx, rx) = tokio::sync::mpsc::channel(1024);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(pace);
            for _ in 0..records {
                tick.tick().await;
                tx.send(Instant::now()).await.unwrap();
            }
        });
        let chunks = ReceiverStream::new(rx).chunks_timeout(BATCH, LINGER);
        tokio::pin!(chunks);
        let mut added = Vec::with_capacity(records);
        while let Some(chunk) = chunks.next().await {
            let now = Instant::now();
            added.extend(chunk.iter().map(|at: &Instant| (now - *at).as_secs_f64() * 1e3));
        }
        added
    });
    let summary = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        serde_json::json!({
            "records": v.len(),
            "p50_ms": percentile(&v, 0.5),
            "p99_ms": percentile(&v, 0.99),
            "max_ms": v.last().copied().unwrap_or(f64::NAN),
        })
    };
    write_result(
        "channel_batching_latency",
        &serde_json::json!({
            "linger_ms": LINGER.as_secs_f64() * 1e3,
            "pace_us": pace.as_micros() as u64,
            "lanes": summary(lanes),
            "chunks_timeout": summary(anchor),
        }),
    );
}

fn suites(c: &mut Criterion) {
    block(c);
    overflow(c);
    batching(c);
}

criterion_group! {
    name = benches;
    config = config();
    targets = suites
}
criterion_main!(benches);
