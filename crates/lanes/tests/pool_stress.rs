//! Randomized stress of the keyed pool: per-key order over a million items and 10k keys with
//! random durations (0 violations), the same over more keys than the pool keeps idle (keys
//! forgotten and tracked again in freed entries), and a burst of a
//! million distinct keys that leaves nothing tracked behind; and eight OS threads submitting
//! through the pool's spin lock at once.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use lanes::pool::{KeyedMode, KeyedPool};

type Res = Result<(), std::io::Error>;

/// [`order_checked`] within five minutes: a pool that loses its workers (a panic in its
/// scheduler, say) leaves its producers waiting for room, and the test fails instead of hanging.
async fn order_holds(mode: KeyedMode, keys: usize, items: u64, producers: u64) {
    let checked = order_checked(mode, keys, items, producers);
    tokio::time::timeout(Duration::from_secs(300), checked).await.expect("the pool drained");
}

async fn order_checked(mode: KeyedMode, keys: usize, items: u64, producers: u64) {
    // `expected[k]` is the sequence number key k must see next.
    let expected: Arc<Vec<AtomicU64>> = Arc::new((0..keys).map(|_| AtomicU64::new(0)).collect());
    let violations = Arc::new(AtomicUsize::new(0));
    let processed = Arc::new(AtomicU64::new(0));
    let builder = KeyedPool::builder().queue_size(4_096).key_of(|item: &(u32, u64)| item.0);
    let builder = match mode {
        KeyedMode::PerKey => builder.workers(16),
        KeyedMode::Hashed => builder.hashed_shards(16),
    };
    let pool = {
        let (expected, violations, processed) =
            (expected.clone(), violations.clone(), processed.clone());
        builder
            .build(move |_, (key, seq): (u32, u64)| {
                let (expected, violations, processed) =
                    (expected.clone(), violations.clone(), processed.clone());
                async move {
                    // A pseudo-random duration from the item itself: most items finish at
                    // once, some yield, a few sleep.
                    let r = (u64::from(key) * 2_654_435_761 + seq * 40_503) % 1_000;
                    if r < 100 {
                        tokio::task::yield_now().await;
                    } else if r < 101 {
                        tokio::time::sleep(Duration::from_micros(r)).await;
                    }
                    let slot = &expected[key as usize];
                    if slot.load(Ordering::SeqCst) != seq {
                        violations.fetch_add(1, Ordering::SeqCst);
                    }
                    slot.store(seq + 1, Ordering::SeqCst);
                    processed.fetch_add(1, Ordering::SeqCst);
                    Res::Ok(())
                }
            })
            .unwrap()
    };
    let pool = Arc::new(pool);
    let per_producer = items / producers;
    let tasks: Vec<_> = (0..producers)
        .map(|p| {
            let pool = pool.clone();
            tokio::spawn(async move {
                // Producer p owns the keys k with k % producers == p, so each key's submit
                // order is this producer's order.
                let own: Vec<u32> =
                    (0..keys as u32).filter(|k| u64::from(*k) % producers == p).collect();
                let mut next = vec![0u64; own.len()];
                for i in 0..per_producer {
                    let slot = (i as usize * 7919) % own.len();
                    let item = (own[slot], next[slot]);
                    next[slot] += 1;
                    pool.submit_wait(item).await.unwrap();
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    pool.stop(Duration::from_secs(120)).await.unwrap();
    assert_eq!(violations.load(Ordering::SeqCst), 0, "{mode:?}: per-key order violated");
    assert_eq!(processed.load(Ordering::SeqCst), per_producer * producers);
    let stats = pool.stats();
    assert_eq!(stats.completed, per_producer * producers);
    assert_eq!((stats.keys, stats.queued, stats.inflight), (0, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_items_over_10k_keys_keep_per_key_order() {
    order_holds(KeyedMode::PerKey, 10_000, 1_000_000, 4).await;
    order_holds(KeyedMode::Hashed, 10_000, 200_000, 4).await;
}

/// 60,000 keys, each coming back every 60,000 items or so: between two of its items a key goes
/// idle behind more than the 16,384 idle keys the pool keeps, so it is forgotten and tracked
/// again in an entry another key freed; a key tracked twice at once could run two items at a
/// time, out of order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_forgotten_and_tracked_again_keep_per_key_order() {
    order_holds(KeyedMode::PerKey, 60_000, 600_000, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_a_million_keys_leaves_nothing_tracked() {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let pool = {
        let gate = gate.clone();
        KeyedPool::builder()
            .workers(4)
            .queue_size(1_000_000)
            .key_of(|n: &u64| *n)
            .build(move |_, _: u64| {
                let gate = gate.clone();
                async move {
                    let _ = gate.acquire().await.unwrap();
                    Res::Ok(())
                }
            })
            .unwrap()
    };
    for n in 0..1_000_000u64 {
        pool.submit(n).unwrap();
    }
    // Every key is tracked at the peak...
    assert_eq!(pool.stats().keys, 1_000_000);
    gate.add_permits(usize::MAX >> 4);
    pool.stop(Duration::from_secs(120)).await.unwrap();
    // ...and none once their items are done.
    let stats = pool.stats();
    assert_eq!((stats.keys, stats.completed), (0, 1_000_000));
}

/// More threads than cores (on hosts of up to 8) on one pool's lock (a spin lock, waited for
/// by spinning, then yielding): eight OS threads, each with a runtime of its own, submit keyed
/// items that wait for room in a small pool whose workers run on this runtime. Every item runs
/// once, each key in its producer's order, and the pool ends with nothing tracked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_submitting_threads_than_cores_keep_order_on_the_pool_lock() {
    const THREADS: u32 = 8;
    const EACH: u64 = 4_000;
    const KEYS_PER_THREAD: u32 = 16;
    let keys = (THREADS * KEYS_PER_THREAD) as usize;
    let expected: Arc<Vec<AtomicU64>> = Arc::new((0..keys).map(|_| AtomicU64::new(0)).collect());
    let violations = Arc::new(AtomicUsize::new(0));
    let processed = Arc::new(AtomicU64::new(0));
    let pool = {
        let (expected, violations, processed) =
            (expected.clone(), violations.clone(), processed.clone());
        KeyedPool::builder()
            .queue_size(32)
            .workers(4)
            .key_of(|item: &(u32, u64)| item.0)
            .build(move |_, (key, seq): (u32, u64)| {
                let slot = &expected[key as usize];
                if slot.load(Ordering::SeqCst) != seq {
                    violations.fetch_add(1, Ordering::SeqCst);
                }
                slot.store(seq + 1, Ordering::SeqCst);
                processed.fetch_add(1, Ordering::SeqCst);
                std::future::ready(Res::Ok(()))
            })
            .unwrap()
    };
    let pool = Arc::new(pool);
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let pool = pool.clone();
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_time().build();
                rt.unwrap().block_on(async move {
                    // Thread t owns keys t * 16.. t * 16 + 15, each fed in sequence order.
                    for i in 0..EACH {
                        let key = t * KEYS_PER_THREAD + (i % u64::from(KEYS_PER_THREAD)) as u32;
                        let seq = i / u64::from(KEYS_PER_THREAD);
                        pool.submit_wait((key, seq)).await.unwrap();
                    }
                });
            })
        })
        .collect();
    // A lost wake-up would leave a submit waiting: bounded, so that it fails instead.
    let joined = tokio::task::spawn_blocking(move || {
        threads.into_iter().for_each(|t| t.join().unwrap());
    });
    tokio::time::timeout(Duration::from_secs(120), joined)
        .await
        .expect("every submit returns")
        .unwrap();
    pool.stop(Duration::from_secs(120)).await.unwrap();
    let total = u64::from(THREADS) * EACH;
    assert_eq!(violations.load(Ordering::SeqCst), 0, "per-key order violated");
    assert_eq!(processed.load(Ordering::SeqCst), total, "each item ran once");
    let stats = pool.stats();
    assert_eq!(stats.completed, total);
    assert_eq!((stats.keys, stats.queued, stats.inflight), (0, 0, 0));
}

/// Producers that wait for room, give up waiting part way (some after a room was handed to
/// them and before they used it), and submit without waiting, at
/// random and at once on two workers, over few keys and a small bound (so producers wait for
/// the pool, for their key, and for a key to be tracked): every item accepted is processed
/// once, and at quiescence the pool takes exactly its bound again, so no room handed to a
/// waiting producer was lost or left counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_giving_up_and_barging_producers_lose_no_room() {
    let checked = rooms_checked();
    tokio::time::timeout(Duration::from_secs(120), checked).await.expect("every producer returns");
}

/// An item of [`rooms_checked`]: its key, its id, and whether it waits on the hold.
type Held = (u8, u64, bool);

async fn rooms_checked() {
    const WORKERS: usize = 2;
    const QUEUE: usize = 4;
    const CLIENTS: u64 = 8;
    const OPS: u64 = 400;
    let runs: Arc<Vec<AtomicUsize>> =
        Arc::new((0..CLIENTS * OPS).map(|_| AtomicUsize::new(0)).collect());
    let hold = Arc::new(tokio::sync::Semaphore::new(0));
    let pool = Arc::new(
        KeyedPool::builder()
            .workers(WORKERS)
            .queue_size(QUEUE)
            .key_queue_size(2)
            .max_keys(5)
            .key_of(|item: &Held| item.0)
            .build({
                let (runs, hold) = (runs.clone(), hold.clone());
                move |_, (_, id, held): Held| {
                    let (runs, hold) = (runs.clone(), hold.clone());
                    async move {
                        if held {
                            hold.acquire().await.unwrap().forget();
                        } else {
                            runs[id as usize].fetch_add(1, Ordering::SeqCst);
                            for _ in 0..id % 3 {
                                tokio::task::yield_now().await;
                            }
                        }
                        Res::Ok(())
                    }
                }
            })
            .unwrap(),
    );
    let clients: Vec<_> = (0..CLIENTS)
        .map(|client| {
            let pool = pool.clone();
            tokio::spawn(async move {
                let mut seed = client.wrapping_mul(0x9E37_79B9_7F4A_7C15) + 1;
                let mut next = move || common::xorshift(&mut seed);
                let mut accepted = Vec::new();
                for op in 0..OPS {
                    let id = client * OPS + op;
                    let item = ((next() % 10) as u8, id, false);
                    let admitted = match next() % 4 {
                        0 => pool.submit(item).is_ok(),
                        1 => {
                            pool.submit_wait(item).await.expect("the pool accepts");
                            true
                        }
                        2 => {
                            let patience = Duration::from_micros(next() % 50);
                            let waited = tokio::time::timeout(patience, pool.submit_wait(item));
                            waited.await.is_ok_and(|submitted| submitted.is_ok())
                        }
                        _ => {
                            // Polled once, then left alone a while (it may be handed a room
                            // meanwhile), then polled once more or dropped.
                            let mut waiting = Box::pin(pool.submit_wait(item));
                            let first = tokio::time::timeout(Duration::ZERO, &mut waiting).await;
                            for _ in 0..next() % 8 {
                                tokio::task::yield_now().await;
                            }
                            match first {
                                Ok(submitted) => submitted.is_ok(),
                                Err(_) if next() % 2 == 0 => {
                                    let again = tokio::time::timeout(Duration::ZERO, waiting);
                                    again.await.is_ok_and(|submitted| submitted.is_ok())
                                }
                                Err(_) => false,
                            }
                        }
                    };
                    if admitted {
                        accepted.push(id);
                    }
                }
                accepted
            })
        })
        .collect();
    let mut accepted = Vec::new();
    for client in clients {
        accepted.extend(client.await.unwrap());
    }
    // Quiescence: everything accepted has been processed.
    while pool.stats().queued + pool.stats().inflight > 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    for id in 0..CLIENTS * OPS {
        let expected = usize::from(accepted.contains(&id));
        assert_eq!(runs[id as usize].load(Ordering::SeqCst), expected, "item {id}");
    }
    // The bound: every worker held, then exactly `QUEUE` items queued (two a key, so that the
    // keys tracked stay within five), then `Full` for one more key.
    for key in 20..20 + WORKERS as u8 {
        pool.submit((key, 0, true)).unwrap();
    }
    while pool.stats().inflight < WORKERS {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    for key in (0..QUEUE as u8).map(|i| 30 + i / 2) {
        pool.submit((key, 0, false)).expect("a room of the bound was left taken");
    }
    assert!(matches!(pool.submit((40, 0, false)), Err(lanes::pool::SubmitError::Full(_))));
    hold.add_permits(WORKERS);
    pool.stop(Duration::from_secs(60)).await.unwrap();
}
