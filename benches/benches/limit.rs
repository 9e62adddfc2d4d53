//! Suites 1 (permits), 6 (rate check) and 7 (fair wait queue), against tokio's `Semaphore` and
//! governor, in the same run. Fairness results are correctness results: they are written to
//! `target/lanes-bench/fairness.json` for the report, next to the speed tables.
#![allow(missing_docs)] // criterion_group! generates an undocumented function

use std::collections::VecDeque;
use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Instant;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use governor::{Quota, RateLimiter};
use lanes::{KeyedLimit, LimitSpec, LimitTable, Limits, Priority};
use lanes_benches::scenarios::{FairQueueCell, PER_TASK, Permits, contended};
use lanes_benches::{Flavor, config, rss_bytes, write_result};
use tokio::sync::Semaphore;

fn block_on<F: std::future::Future>(rt: &tokio::runtime::Runtime, fut: F) -> F::Output {
    rt.block_on(fut)
}

fn limits_with(name: &str, spec: LimitSpec) -> Limits {
    let rt = Flavor::CurrentThread.runtime();
    let limits = Limits::new();
    block_on(&rt, limits.define(name, spec)).expect("define");
    limits
}

/// Suite 1: acquire + release.
fn permits(c: &mut Criterion) {
    let mut group = c.benchmark_group("permits_uncontended");
    let rt = Flavor::CurrentThread.runtime();
    let limits = limits_with("l", LimitSpec::concurrent(1_000));
    group.bench_function("lanes", |b| {
        b.iter_custom(|iters| {
            block_on(&rt, async {
                let start = Instant::now();
                for _ in 0..iters {
                    let permit = limits.acquire("l", Priority::default()).await.expect("permit");
                    drop(black_box(permit));
                }
                start.elapsed()
            })
        })
    });
    let handle = limits.limit("l");
    group.bench_function("lanes_handle", |b| {
        b.iter_custom(|iters| {
            block_on(&rt, async {
                let start = Instant::now();
                for _ in 0..iters {
                    let permit = handle.acquire().await.expect("permit");
                    drop(black_box(permit));
                }
                start.elapsed()
            })
        })
    });
    let sem = Semaphore::new(1_000);
    group.bench_function("tokio_semaphore", |b| {
        b.iter_custom(|iters| {
            block_on(&rt, async {
                let start = Instant::now();
                for _ in 0..iters {
                    let permit = sem.acquire().await.expect("permit");
                    drop(black_box(permit));
                }
                start.elapsed()
            })
        })
    });
    group.finish();

    let mut group = c.benchmark_group("permits_contended");
    let rt = Flavor::MultiThread.runtime();
    for tasks in [2u64, 8, 64, 1024] {
        group.throughput(Throughput::Elements(tasks * PER_TASK));
        let limits = limits_with("l", LimitSpec::concurrent(2));
        let sides = [
            ("lanes", Permits::Lanes(limits.limit("l"))),
            ("tokio_semaphore", Permits::Tokio(Arc::new(Semaphore::new(2)))),
        ];
        for (side, permits) in sides {
            group.bench_function(BenchmarkId::new(side, tasks), |b| {
                b.iter_custom(|iters| {
                    block_on(&rt, async {
                        let start = Instant::now();
                        for _ in 0..iters {
                            contended(&permits, tasks).await;
                        }
                        start.elapsed()
                    })
                })
            });
        }
    }
    group.finish();
}

const KEYS: usize = 100_000;

/// Resident bytes per key after creating `KEYS` keyed rate limits, measured in a fresh process
/// (this binary, re-run with `LANES_MEM_PROBE`) so earlier allocations cannot hide growth.
fn memory_per_key(which: &str) -> f64 {
    let exe = std::env::current_exe().expect("own path");
    let out = std::process::Command::new(exe)
        .args(["--bench", "rate_check_keyed_100k"])
        .env("LANES_MEM_PROBE", which)
        .output()
        .expect("run the memory probe");
    let text = String::from_utf8_lossy(&out.stdout);
    let bytes: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("LANES_MEM_PROBE "))
        .and_then(|b| b.trim().parse().ok())
        .unwrap_or(f64::NAN);
    bytes / KEYS as f64
}

fn memory_probe(which: &str) -> ! {
    let names: Vec<String> = (0..KEYS).map(|i| format!("key-{i}")).collect();
    let fast = LimitSpec::concurrent(u32::MAX).per_second(1e9).burst(u32::MAX);
    let before = rss_bytes();
    let keep: Box<dyn std::any::Any> = if which == "keyed" {
        // Keys stay in use: each check leaves its bucket short of full for a second.
        let keyed: KeyedLimit = KeyedLimit::new("keyed", keyed_spec()).expect("spec");
        for name in &names {
            keyed.check(name.as_str()).expect("check");
        }
        assert_eq!(keyed.keys(), KEYS, "every key kept");
        Box::new(keyed)
    } else if which == "lanes" {
        let rt = Flavor::CurrentThread.runtime();
        let limits = Limits::new();
        block_on(&rt, async {
            for name in &names {
                limits.define(name, fast).await.expect("define");
                drop(limits.try_acquire(name, Priority::default()).await.expect("check"));
            }
        });
        Box::new(limits)
    } else {
        let quota = Quota::per_second(NonZeroU32::new(1_000_000_000).expect("non-zero"));
        let keyed = RateLimiter::keyed(quota);
        for name in &names {
            let _ = keyed.check_key(name);
        }
        Box::new(keyed)
    };
    let grown = rss_bytes().saturating_sub(before);
    println!("LANES_MEM_PROBE {grown}");
    drop(keep);
    std::process::exit(0);
}

/// A keyed limit's spec for suite 6: every check passes (a bucket of 2^32 tokens) and leaves
/// the key in use (one token a second refills it), as governor's keyed limiter keeps every key
/// until `retain_recent`.
fn keyed_spec() -> LimitSpec {
    LimitSpec::rate(1.0).burst(u32::MAX)
}

/// Suite 6: the rate check, direct and keyed, and memory per key.
fn rate(c: &mut Criterion) {
    if let Ok(which) = std::env::var("LANES_MEM_PROBE") {
        memory_probe(&which);
    }
    let mut group = c.benchmark_group("rate_check_direct");
    let rt = Flavor::CurrentThread.runtime();
    // A rate no check will exhaust during the measurement: every check passes, as in governor's
    // own benchmark.
    let fast = LimitSpec::concurrent(u32::MAX).per_second(1e9).burst(u32::MAX);
    let limits = limits_with("r", fast);
    group.bench_function("lanes_limits", |b| {
        b.iter_custom(|iters| {
            block_on(&rt, async {
                let start = Instant::now();
                for _ in 0..iters {
                    let permit = limits.try_acquire("r", Priority::default()).await.expect("limit");
                    drop(black_box(permit));
                }
                start.elapsed()
            })
        })
    });
    let handle = limits.limit("r");
    group.bench_function("lanes_handle", |b| {
        b.iter_custom(|iters| {
            block_on(&rt, async {
                let start = Instant::now();
                for _ in 0..iters {
                    let permit = handle.try_acquire().await.expect("limit");
                    drop(black_box(permit));
                }
                start.elapsed()
            })
        })
    });
    // A check holds nothing, as governor's `check` does.
    group.bench_function("lanes_check", |b| {
        b.iter_custom(|iters| {
            block_on(&rt, async {
                let start = Instant::now();
                for _ in 0..iters {
                    handle.check().await.expect("limit");
                }
                start.elapsed()
            })
        })
    });
    group.bench_function("lanes_limits_check", |b| {
        b.iter_custom(|iters| {
            block_on(&rt, async {
                let start = Instant::now();
                for _ in 0..iters {
                    limits.check("r").await.expect("limit");
                }
                start.elapsed()
            })
        })
    });
    let mut table = LimitTable::new();
    table.define("r", fast).expect("define");
    let origin = Instant::now();
    let mut ticket = 0u64;
    group.bench_function("lanes_table", |b| {
        b.iter(|| {
            ticket += 1;
            let now = origin.elapsed();
            let answer = table.acquire("r", ticket, &Priority::default(), now).expect("acquire");
            table.release("r", ticket, now).expect("release");
            black_box(answer)
        })
    });
    let quota = Quota::per_second(NonZeroU32::new(1_000_000_000).expect("non-zero"));
    let direct = RateLimiter::direct(quota);
    group.bench_function("governor", |b| b.iter(|| black_box(direct.check().is_ok())));
    group.finish();

    let names: Vec<String> = (0..KEYS).map(|i| format!("key-{i}")).collect();
    let mut group = c.benchmark_group("rate_check_keyed_100k");
    let keyed_limits = Limits::new();
    block_on(&rt, async {
        for name in &names {
            keyed_limits.define(name, fast).await.expect("define");
        }
    });
    let mut i = 0usize;
    group.bench_function("lanes_limits", |b| {
        b.iter_custom(|iters| {
            block_on(&rt, async {
                let start = Instant::now();
                for _ in 0..iters {
                    i = (i + 7919) % KEYS;
                    let permit = keyed_limits
                        .try_acquire(&names[i], Priority::default())
                        .await
                        .expect("limit");
                    drop(black_box(permit));
                }
                start.elapsed()
            })
        })
    });
    group.bench_function("lanes_check", |b| {
        b.iter_custom(|iters| {
            block_on(&rt, async {
                let start = Instant::now();
                for _ in 0..iters {
                    i = (i + 7919) % KEYS;
                    keyed_limits.check(&names[i]).await.expect("limit");
                }
                start.elapsed()
            })
        })
    });
    let family: KeyedLimit = KeyedLimit::new("keyed", keyed_spec()).expect("spec");
    for name in &names {
        family.check(name.as_str()).expect("check");
    }
    group.bench_function("lanes_keyed", |b| {
        b.iter(|| {
            i = (i + 7919) % KEYS;
            black_box(family.check(names[i].as_str()).is_ok())
        })
    });
    let keyed = RateLimiter::keyed(quota);
    for name in &names {
        let _ = keyed.check_key(name);
    }
    let mut j = 0usize;
    group.bench_function("governor", |b| {
        b.iter(|| {
            j = (j + 7919) % KEYS;
            black_box(keyed.check_key(&names[j]).is_ok())
        })
    });
    group.finish();
    write_result(
        "rate_memory",
        &serde_json::json!({
            "keys": KEYS,
            "lanes_bytes_per_key": memory_per_key("lanes"),
            "keyed_bytes_per_key": memory_per_key("keyed"),
            "governor_bytes_per_key": memory_per_key("governor"),
        }),
    );
}

/// Tenants: key 0 sends 90% of the requests, keys 1..=9 share the other 10%.
fn tenant_of(arrival: usize) -> usize {
    if arrival.is_multiple_of(10) { 1 + (arrival / 10) % 9 } else { 0 }
}

fn jain(shares: &[f64]) -> f64 {
    let sum: f64 = shares.iter().sum();
    let squares: f64 = shares.iter().map(|x| x * x).sum();
    sum * sum / (shares.len() as f64 * squares)
}

/// Grants per tenant among the first `first` grants, through an async facade that serves one
/// holder at a time: every request is queued first, then the blocker is released.
async fn served_lanes(weights: &[u32], requests: usize, first: usize) -> Vec<u64> {
    let limits = Limits::with_max_waiters(requests + 1);
    limits.define("f", LimitSpec::concurrent(1)).await.expect("define");
    let blocker = limits.acquire("f", Priority::default()).await.expect("blocker");
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut tasks = Vec::new();
    for arrival in 0..requests {
        let tenant = tenant_of(arrival);
        let priority = Priority::default().key(format!("t{tenant}")).weight(weights[tenant]);
        let (limits, tx) = (limits.clone(), tx.clone());
        tasks.push(tokio::spawn(async move {
            let permit = limits.acquire("f", priority).await.expect("permit");
            let _ = tx.send(tenant);
            tokio::task::yield_now().await;
            drop(permit);
        }));
        tokio::task::yield_now().await;
    }
    drop(blocker);
    let mut counts = vec![0u64; weights.len()];
    for _ in 0..first {
        counts[rx.recv().await.expect("grant")] += 1;
    }
    for task in tasks {
        task.abort();
    }
    counts
}

async fn served_tokio_fifo(tenants: usize, requests: usize, first: usize) -> Vec<u64> {
    let sem = Arc::new(Semaphore::new(0));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut tasks = Vec::new();
    for arrival in 0..requests {
        let tenant = tenant_of(arrival);
        let (sem, tx) = (sem.clone(), tx.clone());
        tasks.push(tokio::spawn(async move {
            let permit = sem.acquire().await.expect("permit");
            let _ = tx.send(tenant);
            tokio::task::yield_now().await;
            drop(permit);
        }));
        tokio::task::yield_now().await;
    }
    sem.add_permits(1);
    let mut counts = vec![0u64; tenants];
    for _ in 0..first {
        counts[rx.recv().await.expect("grant")] += 1;
    }
    for task in tasks {
        task.abort();
    }
    counts
}

/// Suite 7: fairness (a correctness result) and the per-dequeue cost of the wait queue.
fn fairness(c: &mut Criterion) {
    let rt = Flavor::CurrentThread.runtime();
    let (requests, first) = (10_000, 1_000);
    let equal = [1u32; 10];
    let weighted = [3, 1, 1, 1, 1, 1, 1, 1, 1, 1];
    let (lanes_equal, lanes_weighted, fifo) = block_on(&rt, async {
        (
            served_lanes(&equal, requests, first).await,
            served_lanes(&weighted, requests, first).await,
            served_tokio_fifo(10, requests, first).await,
        )
    });
    let normalized = |counts: &[u64], weights: &[u32]| -> Vec<f64> {
        counts.iter().zip(weights).map(|(c, w)| *c as f64 / f64::from(*w)).collect()
    };
    let total_weight: u32 = weighted.iter().sum();
    let max_share_error = lanes_weighted
        .iter()
        .zip(&weighted)
        .map(|(c, w)| (*c as f64 / first as f64 - f64::from(*w) / f64::from(total_weight)).abs())
        .fold(0.0, f64::max);
    write_result(
        "fairness",
        &serde_json::json!({
            "requests": requests,
            "measured_grants": first,
            "lanes_equal_counts": lanes_equal,
            "lanes_equal_jain": jain(&normalized(&lanes_equal, &equal)),
            "lanes_weighted_counts": lanes_weighted,
            "lanes_weighted_max_share_error": max_share_error,
            "tokio_fifo_counts": fifo,
            "tokio_fifo_jain": jain(&normalized(&fifo, &equal)),
        }),
    );

    let mut group = c.benchmark_group("wait_queue_dequeue");
    for keys in [10usize, 1_000, 100_000] {
        let mut cell = FairQueueCell::new(keys);
        group.bench_function(BenchmarkId::new("lanes_pop_push", keys), |b| {
            b.iter(|| black_box(cell.step()))
        });
    }
    // The floor of scaling: the fair queue anyone would hand-roll (a map from the key's name
    // to its FIFO, and a round-robin list of the keys with waiters), no ticket index, no
    // levels, no weights, no removal of a waiter from the middle. The same keys and the same
    // pop + push as above; what its cost at 100,000 keys over its cost at 10 shows is what the
    // memory hierarchy alone does to anything that finds a waiter's queue by its key's name.
    for keys in [10usize, 1_000, 100_000] {
        let names: Vec<Arc<str>> = (0..keys).map(|k| Arc::from(format!("k{k}"))).collect();
        let mut queue = RoundRobin::default();
        let mut ticket = 0u64;
        for _ in 0..2 {
            for name in &names {
                ticket += 1;
                queue.push(ticket, name);
            }
        }
        let mut next_key = 0usize;
        group.bench_function(BenchmarkId::new("round_robin_floor", keys), |b| {
            b.iter(|| {
                let served = queue.pop();
                ticket += 1;
                next_key = (next_key + 1) % keys;
                queue.push(ticket, &names[next_key]);
                black_box(served)
            })
        });
    }
    let mut fifo: VecDeque<u64> = (0..1_000).collect();
    let mut n = 1_000u64;
    group.bench_function("vecdeque_floor", |b| {
        b.iter(|| {
            let served = fifo.pop_front();
            n += 1;
            fifo.push_back(n);
            black_box(served)
        })
    });
    group.finish();
}

/// A hand-rolled fair queue: a FIFO per key found by its name, keys served in turn (suite 7's
/// floor of scaling).
#[derive(Default)]
struct RoundRobin {
    queues: std::collections::HashMap<Arc<str>, VecDeque<u64>>,
    turns: VecDeque<Arc<str>>,
}

impl RoundRobin {
    fn push(&mut self, ticket: u64, key: &Arc<str>) {
        let queue = self.queues.entry(Arc::clone(key)).or_default();
        if queue.is_empty() {
            self.turns.push_back(Arc::clone(key));
        }
        queue.push_back(ticket);
    }

    fn pop(&mut self) -> Option<u64> {
        let key = self.turns.pop_front()?;
        let queue = self.queues.get_mut(&key).expect("a key in turn has a queue");
        let ticket = queue.pop_front();
        if queue.is_empty() {
            self.queues.remove(&key);
        } else {
            self.turns.push_back(key);
        }
        ticket
    }
}

criterion_group! {
    name = benches;
    config = config();
    targets = permits, rate, fairness
}
criterion_main!(benches);
