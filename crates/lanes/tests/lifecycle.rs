//! One generic function, compiled against every handle that implements the lifecycle
//! contract: close refuses new work, drained resolves with everything admitted ended, abort
//! ends admitted work at once and still records every item, and the snapshot is what the
//! registry stores.

mod common;

use std::time::Duration;

use lanes::channel::{ChannelSnapshot, ConsumerOptions};
use lanes::pool::PoolSnapshot;
use lanes::spill::MemStorage;
use lanes::{
    Channel, ChannelConfig, Dispatcher, KeyedPool, LaneLimits, LaneSet, LaneSetSnapshot, Lifecycle,
    Run, SpillOptions, SpillQueue,
};

/// Admits `n` items that each take 10 ms, closes (or aborts) the primitive, waits for it to
/// drain, and answers its snapshot. `admit` answers whether an admission was accepted.
async fn close_and_drain<P: Lifecycle>(
    primitive: &P,
    admit: impl Fn() -> bool,
    n: usize,
    abort: bool,
) -> P::Snapshot {
    for _ in 0..n {
        assert!(admit(), "accepted while open");
    }
    assert!(!primitive.is_closed());
    if abort {
        primitive.abort();
    } else {
        primitive.close();
    }
    assert!(primitive.is_closed());
    assert!(!admit(), "refused once closed");
    primitive.close(); // twice does nothing
    tokio::time::timeout(Duration::from_secs(30), primitive.drained())
        .await
        .expect("drains (paused clock: no real wait)");
    let snapshot = primitive.snapshot();
    serde_json::to_value(&snapshot).expect("a snapshot serializes");
    snapshot
}

fn lanes() -> LaneSet {
    common::one_lane("work", LaneLimits::new(2, 64)).build().unwrap()
}

fn slow_run() -> Run<impl lanes::lane::Job<Output = ()>, impl lanes::lane::Finalize<()>> {
    Run::typed(|cx: lanes::RunContext| async move {
        tokio::select! {
            _ = cx.cancelled() => Err(std::io::Error::other("cancelled")),
            () = tokio::time::sleep(Duration::from_millis(10)) => Ok(()),
        }
    })
    .finalizer(|outcome| async move { outcome.map(|_| ()) })
}

fn check_lanes(snapshot: &LaneSetSnapshot, n: u64, aborted: bool) {
    let lane = &snapshot.lanes[0];
    assert_eq!(snapshot.owned, 0, "every run ended");
    assert_eq!(lane.admitted, n);
    assert_eq!(lane.completed + lane.failed.total(), n, "one terminal state each: {lane:?}");
    if !aborted {
        // A lane's close fails the queued runs and cancels the executing ones.
        assert_eq!(lane.executing + lane.queued, 0);
    }
}

fn check_pool(snapshot: &PoolSnapshot, n: u64, aborted: bool) {
    let s = snapshot.stats;
    assert_eq!(s.submitted, n);
    assert_eq!(s.completed + s.failed + s.panicked + s.dropped, n, "one end each: {s:?}");
    assert_eq!(s.inflight + s.queued, 0);
    if aborted {
        assert!(s.dropped > 0, "abort drops what was queued: {s:?}");
    } else {
        assert_eq!(s.completed, n, "close lets accepted items finish: {s:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_lane_set_keeps_the_contract() {
    for abort in [false, true] {
        let set = lanes();
        let admit = || set.spawn("work", slow_run()).is_ok();
        let snapshot = close_and_drain(&set, admit, 20, abort).await;
        check_lanes(&snapshot, 20, abort);
    }
}

#[tokio::test(start_paused = true)]
async fn a_dispatcher_keeps_the_contract() {
    for abort in [false, true] {
        let pool = Dispatcher::builder()
            .workers(2)
            .queue_size(64)
            .build(|_: u32| async {
                tokio::time::sleep(Duration::from_millis(10)).await;
                Ok::<_, std::io::Error>(())
            })
            .unwrap();
        let snapshot = close_and_drain(&pool, || pool.submit(1).is_ok(), 20, abort).await;
        check_pool(&snapshot, 20, abort);
    }
}

#[tokio::test(start_paused = true)]
async fn a_keyed_pool_keeps_the_contract() {
    for abort in [false, true] {
        let pool = KeyedPool::builder()
            .workers(2)
            .queue_size(64)
            .key_of(|n: &u32| n % 3)
            .build(|_, _: u32| async {
                tokio::time::sleep(Duration::from_millis(10)).await;
                Ok::<_, std::io::Error>(())
            })
            .unwrap();
        let next = std::sync::atomic::AtomicU32::new(0);
        let admit = || pool.submit(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)).is_ok();
        let snapshot = close_and_drain(&pool, admit, 20, abort).await;
        check_pool(&snapshot, 20, abort);
    }
}

/// A channel: drained once every delivered record is settled; abort drops what is queued.
#[tokio::test(start_paused = true)]
async fn a_channel_keeps_the_contract() {
    for abort in [false, true] {
        let channel: Channel<u32> = Channel::named("jobs", ChannelConfig::new(64)).unwrap();
        let mut consumer = channel.consumer(ConsumerOptions::new()).unwrap();
        let worker = tokio::spawn(async move {
            while let Some(batch) = consumer.next_batch().await {
                tokio::time::sleep(Duration::from_millis(10)).await;
                batch.ack().await.unwrap();
            }
        });
        let snapshot: ChannelSnapshot =
            close_and_drain(&channel, || channel.try_emit(1).is_ok(), 20, abort).await;
        assert!(snapshot.reconciles(), "{snapshot:?}");
        assert_eq!(snapshot.emitted, 20);
        assert_eq!(snapshot.depth, 0);
        assert_eq!(snapshot.delivered, snapshot.processed + snapshot.failed + snapshot.abandoned);
        if abort {
            assert!(snapshot.dropped > 0, "abort drops what was queued: {snapshot:?}");
        } else {
            assert_eq!(snapshot.processed, 20, "close lets queued records through: {snapshot:?}");
        }
        worker.await.unwrap();
    }
}

/// A spill queue: drained once every accepted append is durable and the writer stopped.
#[tokio::test]
async fn a_spill_queue_keeps_the_contract() {
    for abort in [false, true] {
        let (queue, _) =
            SpillQueue::open_with(MemStorage::new(), SpillOptions::default()).await.unwrap();
        let admit = || queue.start_append([b"record"]).is_ok();
        let snapshot = close_and_drain(&queue, admit, 20, abort).await;
        assert_eq!(snapshot.appended, 20);
        assert_eq!(snapshot.records, 20, "durable, not consumed");
        assert!(queue.append(b"late").await.is_err());
    }
}
