//! Suite 8 (keyed pool) and the dispatcher's part of suite 2, against the hashed-shard pool
//! (the seed's design), a `DashMap<Key, mpsc>` + task-per-key baseline, and tokio mpsc + N
//! workers, in the same run. Order violations, the slow-key latency scenario and memory per key
//! are written to `target/lanes-bench/` for the report.
#![allow(missing_docs)] // criterion_group! generates an undocumented function

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use dashmap::DashMap;
use lanes::pool::{Dispatcher, KeyedPool};
use lanes_benches::{Done, Flavor, config, rss_bytes, write_result};
use tokio::sync::mpsc;

type Res = Result<(), std::convert::Infallible>;

const ITEMS: u64 = 10_000;
const WORKERS: usize = 8;

/// Checks per-key order: `expected[k]` is the next sequence key k must see.
struct OrderCheck {
    expected: Vec<AtomicU64>,
    violations: AtomicU64,
}

impl OrderCheck {
    fn new(keys: usize) -> Arc<Self> {
        Arc::new(Self {
            expected: (0..keys).map(|_| AtomicU64::new(0)).collect(),
            violations: AtomicU64::new(0),
        })
    }

    fn see(&self, key: usize, seq: u64) {
        if self.expected[key].swap(seq + 1, Ordering::AcqRel) != seq {
            self.violations.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn reset(&self) {
        self.expected.iter().for_each(|e| e.store(0, Ordering::Relaxed));
    }
}

fn items(keys: usize) -> Vec<(usize, u64)> {
    let mut next = vec![0u64; keys];
    (0..ITEMS as usize)
        .map(|i| {
            let key = (i * 7919) % keys;
            let seq = next[key];
            next[key] += 1;
            (key, seq)
        })
        .collect()
}

fn keyed_pool(hashed: bool, check: Arc<OrderCheck>, done: Done) -> KeyedPool<(usize, u64)> {
    let builder =
        KeyedPool::builder().queue_size(ITEMS as usize).key_of(|item: &(usize, u64)| item.0 as u64);
    let builder = if hashed { builder.hashed_shards(WORKERS) } else { builder.workers(WORKERS) };
    builder
        .build(move |_, (key, seq): (usize, u64)| {
            check.see(key, seq);
            done.finish_one();
            async { Res::Ok(()) }
        })
        .expect("pool")
}

/// The hand-rolled baseline: a channel and a task per key, found in a `DashMap`.
async fn dashmap_per_key(items: &[(usize, u64)], check: &Arc<OrderCheck>) {
    let done = Done::new(items.len() as u64);
    let channels: DashMap<usize, mpsc::UnboundedSender<u64>> = DashMap::new();
    for (key, seq) in items {
        let sender = channels
            .entry(*key)
            .or_insert_with(|| {
                let (tx, mut rx) = mpsc::unbounded_channel::<u64>();
                let (check, done, key) = (check.clone(), done.clone(), *key);
                tokio::spawn(async move {
                    while let Some(seq) = rx.recv().await {
                        check.see(key, seq);
                        done.finish_one();
                    }
                });
                tx
            })
            .clone();
        sender.send(*seq).expect("task alive");
    }
    done.wait().await;
}

fn keyed(c: &mut Criterion) {
    let mut group = c.benchmark_group("keyed_uniform");
    group.throughput(Throughput::Elements(ITEMS));
    let rt = Flavor::MultiThread.runtime();
    let mut violations = serde_json::Map::new();
    for keys in [1usize, 16, 10_000] {
        let work = items(keys);
        let check = OrderCheck::new(keys);
        for (name, hashed) in [("lanes_per_key", false), ("lanes_hashed", true)] {
            let done = Done::new(0);
            let pool = {
                let _guard = rt.enter();
                keyed_pool(hashed, check.clone(), done.clone())
            };
            group.bench_function(BenchmarkId::new(name, keys), |b| {
                b.iter_custom(|iters| {
                    rt.block_on(async {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            check.reset();
                            done.reset(ITEMS);
                            let start = Instant::now();
                            for item in &work {
                                pool.submit(*item).expect("room for every item");
                            }
                            done.wait().await;
                            total += start.elapsed();
                        }
                        total
                    })
                })
            });
            rt.block_on(pool.stop(Duration::from_secs(30))).expect("drained");
        }
        group.bench_function(BenchmarkId::new("dashmap_task_per_key", keys), |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        check.reset();
                        let start = Instant::now();
                        dashmap_per_key(&work, &check).await;
                        total += start.elapsed();
                    }
                    total
                })
            })
        });
        violations.insert(keys.to_string(), check.violations.load(Ordering::Relaxed).into());
    }
    group.finish();
    write_result("keyed_order", &serde_json::Value::Object(violations));
}

/// Zipf-like keys (key k has weight 1/(k+1)); key 0 is slow (5 ms per item). Returns the p50
/// and p99 latency (submit → processed) of the other keys' items.
async fn slow_key_latency(hashed: bool) -> (Duration, Duration, u64) {
    const KEYS: usize = 1_000;
    const N: usize = 4_000;
    let weights: Vec<f64> = (0..KEYS).map(|k| 1.0 / (k as f64 + 1.0)).collect();
    let total: f64 = weights.iter().sum();
    let mut cumulative = Vec::with_capacity(KEYS);
    let mut acc = 0.0;
    for w in &weights {
        acc += w / total;
        cumulative.push(acc);
    }
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let mut keys_drawn = Vec::with_capacity(N);
    for _ in 0..N {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let u = (seed >> 11) as f64 / (1u64 << 53) as f64;
        keys_drawn.push(cumulative.partition_point(|c| *c < u).min(KEYS - 1));
    }
    let latencies = Arc::new(std::sync::Mutex::new(Vec::with_capacity(N)));
    let check = OrderCheck::new(KEYS);
    let builder =
        KeyedPool::builder().queue_size(N).key_of(|item: &(usize, u64, Instant)| item.0 as u64);
    let builder = if hashed { builder.hashed_shards(WORKERS) } else { builder.workers(WORKERS) };
    let pool = {
        let (latencies, check) = (latencies.clone(), check.clone());
        builder
            .build(move |_, (key, seq, submitted): (usize, u64, Instant)| {
                let (latencies, check) = (latencies.clone(), check.clone());
                async move {
                    if key == 0 {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    } else {
                        tokio::task::yield_now().await;
                    }
                    check.see(key, seq);
                    if key != 0 {
                        latencies.lock().expect("latencies").push(submitted.elapsed());
                    }
                    Res::Ok(())
                }
            })
            .expect("pool")
    };
    let mut next = vec![0u64; KEYS];
    for key in keys_drawn {
        let seq = next[key];
        next[key] += 1;
        pool.submit((key, seq, Instant::now())).expect("room");
        // Arrivals spread over time, as a stream of updates would be.
        if seq.is_multiple_of(8) {
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    }
    pool.stop(Duration::from_secs(120)).await.expect("drained");
    let mut latencies = latencies.lock().expect("latencies").clone();
    latencies.sort();
    let at = |p: f64| latencies[((latencies.len() - 1) as f64 * p) as usize];
    (at(0.50), at(0.99), check.violations.load(Ordering::Relaxed))
}

/// Resident bytes per key with a million keys queued, and after they drained (fresh process).
fn memory_per_key() -> (f64, f64) {
    let exe = std::env::current_exe().expect("own path");
    let out = std::process::Command::new(exe)
        .args(["--bench", "keyed_uniform/lanes_per_key/1$"])
        .env("LANES_MEM_PROBE", "keyed")
        .output()
        .expect("run the memory probe");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find_map(|l| l.strip_prefix("LANES_MEM_PROBE ")).unwrap_or("nan nan");
    let mut parts = line.split_whitespace().map(|v| v.parse::<f64>().unwrap_or(f64::NAN));
    let peak = parts.next().unwrap_or(f64::NAN);
    let after = parts.next().unwrap_or(f64::NAN);
    (peak / 1e6, after / 1e6)
}

fn memory_probe() -> ! {
    let rt = Flavor::MultiThread.runtime();
    let before = rss_bytes();
    let (peak, after) = rt.block_on(async {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let pool = {
            let gate = gate.clone();
            KeyedPool::builder()
                .workers(WORKERS)
                .queue_size(1_000_000)
                .key_of(|n: &u64| *n)
                .build(move |_, _: u64| {
                    let gate = gate.clone();
                    async move {
                        let _ = gate.acquire().await;
                        Res::Ok(())
                    }
                })
                .expect("pool")
        };
        for n in 0..1_000_000u64 {
            pool.submit(n).expect("room");
        }
        let peak = rss_bytes().saturating_sub(before);
        gate.add_permits(usize::MAX >> 4);
        pool.stop(Duration::from_secs(120)).await.expect("drained");
        (peak, rss_bytes().saturating_sub(before))
    });
    println!("LANES_MEM_PROBE {peak} {after}");
    std::process::exit(0);
}

fn slow_key(_c: &mut Criterion) {
    let rt = Flavor::MultiThread.runtime();
    let (per_key_p50, per_key_p99, per_key_violations) = rt.block_on(slow_key_latency(false));
    let (hashed_p50, hashed_p99, hashed_violations) = rt.block_on(slow_key_latency(true));
    let (peak_mb, after_mb) = memory_per_key();
    write_result(
        "keyed_slow_key",
        &serde_json::json!({
            "per_key_p50_us": per_key_p50.as_secs_f64() * 1e6,
            "per_key_p99_us": per_key_p99.as_secs_f64() * 1e6,
            "hashed_p50_us": hashed_p50.as_secs_f64() * 1e6,
            "hashed_p99_us": hashed_p99.as_secs_f64() * 1e6,
            "violations": per_key_violations + hashed_violations,
            "million_keys_peak_mb": peak_mb,
            "million_keys_after_mb": after_mb,
        }),
    );
}

/// Suite 2 for the dispatcher: no-op items through 8 workers, against tokio mpsc + 8 workers.
fn dispatcher(c: &mut Criterion) {
    let mut group = c.benchmark_group("dispatcher");
    group.throughput(Throughput::Elements(ITEMS));
    for flavor in Flavor::ALL {
        let rt = flavor.runtime();
        let counter = Done::new(0);
        let pool = {
            let _guard = rt.enter();
            let counter = counter.clone();
            Dispatcher::builder()
                .workers(WORKERS)
                .queue_size(ITEMS as usize)
                .build(move |_: u64| {
                    counter.finish_one();
                    async { Res::Ok(()) }
                })
                .expect("dispatcher")
        };
        group.bench_function(BenchmarkId::new("lanes_dispatcher", flavor.name()), |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        counter.reset(ITEMS);
                        let start = Instant::now();
                        for n in 0..ITEMS {
                            pool.submit(n).expect("room");
                        }
                        counter.wait().await;
                        total += start.elapsed();
                    }
                    total
                })
            })
        });
        group.bench_function(BenchmarkId::new("tokio_mpsc_workers", flavor.name()), |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let done = Done::new(ITEMS);
                        let (tx, rx) = mpsc::channel::<u64>(ITEMS as usize);
                        let rx = Arc::new(tokio::sync::Mutex::new(rx));
                        let start = Instant::now();
                        let workers: Vec<_> = (0..WORKERS)
                            .map(|_| {
                                let (rx, done) = (rx.clone(), done.clone());
                                tokio::spawn(async move {
                                    while let Some(_n) = rx.lock().await.recv().await {
                                        done.finish_one();
                                    }
                                })
                            })
                            .collect();
                        for n in 0..ITEMS {
                            tx.try_send(n).expect("room");
                        }
                        done.wait().await;
                        total += start.elapsed();
                        drop(tx);
                        for w in workers {
                            w.await.expect("worker");
                        }
                    }
                    total
                })
            })
        });
    }
    group.finish();
}

fn probe_or(c: &mut Criterion) {
    if std::env::var("LANES_MEM_PROBE").as_deref() == Ok("keyed") {
        memory_probe();
    }
    keyed(c);
}

criterion_group! {
    name = benches;
    config = config();
    targets = probe_or, slow_key, dispatcher
}
criterion_main!(benches);
