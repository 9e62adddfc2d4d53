//! Both sides of the suite-1 contended permit cell (ours and tokio's `Semaphore`), of the
//! suite-2 lane and reject cells (ours and the hand-rolled two-semaphore lane) and of the
//! suite-3 block-mode cells (ours and tokio mpsc), and suite 7's pop + push of the wait queue,
//! shared by the criterion benches and the fixed-work and paired drivers (`src/bin/`), so all
//! of them run the same code.

use std::convert::Infallible;
use std::future::ready;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use lanes::channel::{Channel, ChannelConfig, ConsumerOptions};
use lanes::pool::KeyedPool;
use lanes::{Lane, LaneLimits, LaneSet, Limit, Limits, Priority, Run, WaitQueue};
use tokio::sync::Semaphore;

use crate::Done;

/// Records per channel run.
pub const RECORDS: usize = 10_000;

/// Acquires per task in suite 1's contended cell.
pub const PER_TASK: u64 = 64;

/// The permit a contended task takes: a `Limit` handle's, or a semaphore's.
#[derive(Debug, Clone)]
pub enum Permits {
    /// Ours, through a handle (as each tokio task holds an `Arc<Semaphore>`).
    Lanes(Limit),
    /// Ours, by the limit's name (as the tower layer and a lane's limited runs ask).
    Named(Limits),
    /// The anchor.
    Tokio(Arc<Semaphore>),
}

/// Suite 1's contended cell: `tasks` tasks share the permits, each taking and returning one
/// [`PER_TASK`] times with a yield while holding it; returns when every task is done.
pub async fn contended(permits: &Permits, tasks: u64) {
    let running: Vec<_> = (0..tasks)
        .map(|_| {
            let permits = permits.clone();
            tokio::spawn(async move {
                for _ in 0..PER_TASK {
                    match &permits {
                        Permits::Lanes(handle) => {
                            let permit = handle.acquire().await;
                            tokio::task::yield_now().await;
                            drop(permit);
                        }
                        Permits::Named(limits) => {
                            let permit = limits.acquire("l", Priority::default()).await;
                            tokio::task::yield_now().await;
                            drop(permit);
                        }
                        Permits::Tokio(semaphore) => {
                            let permit = semaphore.acquire().await;
                            tokio::task::yield_now().await;
                            drop(permit);
                        }
                    }
                }
            })
        })
        .collect();
    for task in running {
        task.await.expect("task");
    }
}

/// A record type of the channel matrix.
pub trait Record: Send + 'static {
    /// The `i`th record.
    fn make(i: usize) -> Self;
}

impl Record for u64 {
    fn make(i: usize) -> Self {
        i as u64
    }
}

/// A 256-byte record, moved by value (read through `black_box` only).
#[derive(Debug)]
#[allow(dead_code)]
pub struct Big([u8; 256]);

impl Record for Big {
    fn make(i: usize) -> Self {
        Big([i as u8; 256])
    }
}

/// A lane of `concurrent` execution slots and `queued` waiting slots, every bound one second.
pub fn lane(concurrent: usize, queued: usize) -> Lane {
    LaneSet::builder()
        .lane("bench", LaneLimits::new(concurrent, queued))
        .audit_timeout(Duration::from_secs(1))
        .finalization_timeout(Duration::from_secs(1))
        .worker_drain_timeout(Duration::from_secs(1))
        .build()
        .expect("valid lane")
        .lane("bench")
        .expect("lane exists")
}

/// Suite 2's reject path: a lane of one execution slot and no waiting room, held by a run
/// that waits until the returned semaphore gets a permit (add one to end it).
pub fn full_lane() -> (Lane, Arc<Semaphore>) {
    let full = lane(1, 0);
    let hold = Arc::new(Semaphore::new(0));
    let held = hold.clone();
    let holder = Run::typed(move |_cx| async move {
        let _ = held.acquire().await;
        Ok::<(), Infallible>(())
    });
    full.spawn(holder).expect("first run admitted");
    (full, hold)
}

/// One admission into a [`full_lane`]: whether it was refused (always, while the lane is held).
#[inline]
pub fn refuse(full: &Lane) -> bool {
    full.spawn(Run::typed(|_cx| ready(Ok::<(), Infallible>(())))).is_err()
}

/// `runs` background runs of a no-op job whose finalizer counts completion, admitted at once;
/// returns when every finalizer has run.
pub async fn lane_runs(lane: Lane, runs: u64) {
    let done = Done::new(runs);
    for _ in 0..runs {
        let done = done.clone();
        let run = Run::typed(|_cx| ready(Ok::<(), Infallible>(()))).finalizer(move |_outcome| {
            done.finish_one();
            ready(Ok::<(), Infallible>(()))
        });
        if lane.spawn(run).is_err() {
            panic!("the bench lane refused a run");
        }
    }
    done.wait().await;
}

/// The hand-rolled lane users write today: an outer semaphore of `concurrent + queued` taken
/// with `try_acquire` at admission, an inner one of `concurrent` awaited in the spawned task.
#[derive(Debug, Clone)]
pub struct HandRolled {
    /// Admission: `concurrent + queued` permits, taken without waiting.
    pub outer: Arc<Semaphore>,
    /// Execution: `concurrent` permits, awaited by each run's task.
    pub inner: Arc<Semaphore>,
}

impl HandRolled {
    /// A lane of `concurrent` execution slots and `queued` waiting slots.
    pub fn new(concurrent: usize, queued: usize) -> Self {
        Self {
            outer: Arc::new(Semaphore::new(concurrent + queued)),
            inner: Arc::new(Semaphore::new(concurrent)),
        }
    }
}

/// Suite 2's reject path through the hand-rolled lane: its outer semaphore's one permit is
/// taken and kept in the returned permit.
pub fn full_hand_rolled() -> (HandRolled, tokio::sync::OwnedSemaphorePermit) {
    let hand = HandRolled::new(1, 0);
    let held = hand.outer.clone().try_acquire_owned().expect("first permit");
    (hand, held)
}

/// One admission into a [`full_hand_rolled`] lane: whether it was refused (always).
#[inline]
pub fn refuse_hand_rolled(full: &HandRolled) -> bool {
    full.outer.clone().try_acquire_owned().is_err()
}

/// [`lane_runs`] through the hand-rolled lane: `runs` tasks admitted at once, each taking an
/// execution slot, running the no-op job and counting its "finalizer".
pub async fn hand_rolled(lane: HandRolled, runs: u64) {
    let done = Done::new(runs);
    for _ in 0..runs {
        let owned = lane.outer.clone().try_acquire_owned().expect("the hand-rolled lane refused");
        let (inner, done) = (lane.inner.clone(), done.clone());
        tokio::spawn(async move {
            let slot = inner.acquire_owned().await.expect("open");
            black_box(ready(Ok::<(), Infallible>(())).await).ok();
            drop(slot);
            done.finish_one(); // the "finalizer"
            drop(owned);
        });
    }
    done.wait().await;
}

/// [`RECORDS`] records from `producers` tasks to one consumer reading with `recv`, through a
/// block-mode channel of `capacity` made for this run.
pub async fn channel_block<R: Record>(capacity: usize, producers: usize) {
    let channel = Channel::new(ChannelConfig::new(capacity)).unwrap();
    let mut consumer = channel.consumer(ConsumerOptions::new()).unwrap();
    for _ in 0..producers {
        let channel = channel.clone();
        tokio::spawn(async move {
            for i in 0..RECORDS / producers {
                channel.emit(R::make(i)).await.ok().unwrap();
            }
        });
    }
    drop(channel);
    let mut n = 0;
    while let Some(record) = consumer.recv().await {
        black_box(record);
        n += 1;
    }
    assert_eq!(n, RECORDS);
}

/// [`channel_block`] through a tokio mpsc channel: the anchor's side of the same cell.
pub async fn tokio_block<R: Record>(capacity: usize, producers: usize) {
    let (tx, mut rx) = tokio::sync::mpsc::channel(capacity);
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
    while let Some(record) = rx.recv().await {
        black_box(record);
        n += 1;
    }
    assert_eq!(n, RECORDS);
}

/// [`channel_block`] through a kanal channel: the fastest anchor of suite 3 on `current_thread`.
pub async fn kanal_block<R: Record>(capacity: usize, producers: usize) {
    let (tx, rx) = kanal::bounded_async(capacity);
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

/// Suite 5's batch size.
pub const BATCH: usize = 64;

/// Suite 5's `next_batch` cell: a producer at full speed into 1,024 records, a consumer
/// taking batches of up to [`BATCH`] that linger at most `linger`, each acked.
pub async fn next_batch_block(linger: Duration) {
    let channel = Channel::new(ChannelConfig::new(1024)).unwrap();
    let mut consumer =
        channel.consumer(ConsumerOptions::new().batch_max(BATCH).batch_flush(linger)).unwrap();
    tokio::spawn(async move {
        for i in 0..RECORDS as u64 {
            channel.emit(i).await.unwrap();
        }
    });
    let mut n = 0;
    while let Some(batch) = consumer.next_batch().await {
        n += batch.len();
        batch.ack().await.unwrap();
    }
    assert_eq!(n, RECORDS);
}

/// Suite 5's `recv_many` cell: the same producer, a consumer reading up to [`BATCH`] at a time.
pub async fn recv_many_block() {
    let channel = Channel::new(ChannelConfig::new(1024)).unwrap();
    let mut consumer = channel.consumer(ConsumerOptions::new()).unwrap();
    tokio::spawn(async move {
        for i in 0..RECORDS as u64 {
            channel.emit(i).await.unwrap();
        }
    });
    read_batches(async |buffer| consumer.recv_many(buffer, BATCH).await).await;
}

/// [`recv_many_block`] through a tokio mpsc channel: the anchor's side of the same cell.
pub async fn tokio_recv_many_block() {
    let (tx, mut rx) = tokio::sync::mpsc::channel(1024);
    tokio::spawn(async move {
        for i in 0..RECORDS as u64 {
            tx.send(i).await.unwrap();
        }
    });
    read_batches(async |buffer| rx.recv_many(buffer, BATCH).await).await;
}

/// Reads batches with `recv_many` until it returns 0; checks that every record came.
async fn read_batches(mut recv_many: impl AsyncFnMut(&mut Vec<u64>) -> usize) {
    let mut buffer = Vec::with_capacity(BATCH);
    let mut n = 0;
    loop {
        let got = recv_many(&mut buffer).await;
        if got == 0 {
            break;
        }
        n += got;
        black_box(&buffer);
        buffer.clear();
    }
    assert_eq!(n, RECORDS);
}

/// Suite 7's wait queue in its steady state: every one of `keys` fairness keys holds two
/// waiters, and each step serves the next ticket and queues a new one for the next key.
#[derive(Debug)]
pub struct FairQueueCell {
    queue: WaitQueue,
    priorities: Vec<Priority>,
    ticket: u64,
    next_key: usize,
}

impl FairQueueCell {
    /// The queue with two waiters for each of `keys` keys.
    pub fn new(keys: usize) -> Self {
        let priorities: Vec<Priority> =
            (0..keys).map(|k| Priority::default().key(format!("k{k}"))).collect();
        let mut queue = WaitQueue::new();
        let mut ticket = 0u64;
        for _ in 0..2 {
            for priority in &priorities {
                ticket += 1;
                queue.push(ticket, priority);
            }
        }
        Self { queue, priorities, ticket, next_key: 0 }
    }

    /// One pop + push; the ticket served.
    #[inline]
    pub fn step(&mut self) -> Option<u64> {
        let served = self.queue.pop();
        self.ticket += 1;
        self.next_key = (self.next_key + 1) % self.priorities.len();
        self.queue.push(self.ticket, &self.priorities[self.next_key]);
        served
    }
}

/// Items per keyed-pool cell (suite 8's).
pub const POOL_ITEMS: u64 = 10_000;
/// A keyed pool's workers, or shards (suite 8's).
pub const POOL_WORKERS: usize = 8;

/// A keyed pool of suite 8: per-key, or hashed shards (the seed's design); each item counts
/// itself on `done`.
pub fn keyed_pool(hashed: bool, done: Done) -> KeyedPool<(usize, u64)> {
    let builder = KeyedPool::builder()
        .queue_size(POOL_ITEMS as usize)
        .key_of(|item: &(usize, u64)| item.0 as u64);
    let builder =
        if hashed { builder.hashed_shards(POOL_WORKERS) } else { builder.workers(POOL_WORKERS) };
    builder
        .build(move |_, _: (usize, u64)| {
            done.finish_one();
            ready(Ok::<(), Infallible>(()))
        })
        .expect("pool")
}

/// Suite 8's uniform work: `POOL_ITEMS` items over `keys` keys, as (key, sequence).
pub fn pool_items(keys: usize) -> Vec<(usize, u64)> {
    (0..POOL_ITEMS).map(|i| ((i as usize * 7919) % keys, i)).collect()
}

/// One cell of suite 8: submits `work` to `pool` and waits until every item is done.
pub async fn pool_cell(pool: &KeyedPool<(usize, u64)>, done: &Done, work: &[(usize, u64)]) {
    done.reset(work.len() as u64);
    for item in work {
        pool.submit(*item).expect("room for every item");
    }
    done.wait().await;
}
