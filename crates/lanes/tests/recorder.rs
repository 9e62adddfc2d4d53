//! A `metrics` recorder that panics (user code) never unwinds through a channel or a pool:
//! their calls into it are contained. Unwound, it would leave a channel's producers or its
//! consumer waiting for good, records unsettled, or a pool's worker gone with an item taken
//! and the pool's stop waiting for it. A spill queue's calls are made once what they count is
//! done. (A run lane's and a limit's cases are in
//! `tests/lane_runtime.rs` and `tests/limit_recorder.rs`.)

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::Breaking;
use lanes::channel::{Channel, ChannelConfig, ConsumerOptions};
use lanes::pool::Dispatcher;
use lanes::spill::{SpillOptions, SpillQueue, SyncPolicy};
use lanes::{LimitSpec, Limits, Priority};
use tokio::time::timeout;

const RECORDS: u32 = 200;

/// Every record of a channel whose every count panics arrives once and in order, through a
/// blocked producer, plain reads and batches; the consumer's drop closes the channel with a
/// record still queued, and the channel drains. (Before its counts were contained, the first
/// count that panicked unwound out of the read or the emit that made it.)
#[tokio::test]
async fn a_channel_loses_nothing_to_a_panicking_recorder() {
    let breaking = Breaking::default();
    let counters = [
        "lanes_channel_emitted_total",
        "lanes_channel_delivered_total",
        "lanes_channel_dropped_total",
        "lanes_channel_blocked_waits_total",
        "lanes_channel_processed_total",
        "lanes_channel_failed_total",
    ];
    let recorder = breaking.recorder(&counters, &[]);
    let channel = metrics::with_local_recorder(&recorder, || {
        Channel::new(ChannelConfig::new(4)).expect("a valid channel")
    });
    let mut consumer = channel.consumer(ConsumerOptions::new().batch_max(8)).unwrap();
    breaking.switch(true);
    let producer = channel.clone();
    let emits = tokio::spawn(async move {
        for i in 0..=RECORDS {
            producer.emit(i).await.expect("emitted");
        }
    });
    let mut next = 0;
    let read = async {
        while next < RECORDS {
            if next % 2 == 0 {
                assert_eq!(consumer.recv().await, Some(next));
                next += 1;
            } else {
                let batch = consumer.next_batch().await.expect("a batch");
                for record in batch.iter() {
                    assert_eq!(*record, next);
                    next += 1;
                }
            }
        }
    };
    timeout(Duration::from_secs(10), read).await.expect("every record arrives");
    timeout(Duration::from_secs(10), emits).await.expect("the producer ends").unwrap();
    // One record is left queued: the consumer's drop closes the channel without it.
    drop(consumer);
    timeout(Duration::from_secs(10), channel.drained()).await.expect("the channel drains");
    breaking.switch(false);
    assert!(breaking.panics() > 0, "the counts panicked");
    let snapshot = channel.snapshot();
    let emitted = u64::from(RECORDS) + 1;
    assert_eq!((snapshot.emitted, snapshot.depth), (emitted, 0), "{snapshot:?}");
    assert!(snapshot.closed, "{snapshot:?}");
}

/// A dispatcher whose every count panics processes every item, once, and stops. (Before its
/// counts were contained, the first count that panicked ended the worker that made it, with
/// its item taken, and the stop waited for that worker for good.)
#[tokio::test]
async fn a_pool_loses_nothing_to_a_panicking_recorder() {
    let breaking = Breaking::default();
    let counters = [
        "lanes_pool_submitted_total",
        "lanes_pool_rejected_total",
        "lanes_pool_completed_total",
        "lanes_pool_failed_total",
    ];
    let recorder = breaking.recorder(&counters, &["lanes_pool_inflight", "lanes_pool_queued"]);
    let done = Arc::new(AtomicUsize::new(0));
    let dispatcher = {
        let done = done.clone();
        metrics::with_local_recorder(&recorder, || {
            Dispatcher::builder().workers(2).queue_size(RECORDS as usize).build(move |n: u32| {
                let done = done.clone();
                async move {
                    done.fetch_add(1, Ordering::SeqCst);
                    if n.is_multiple_of(10) { Err(std::io::Error::other("fails")) } else { Ok(()) }
                }
            })
        })
        .expect("a valid dispatcher")
    };
    breaking.switch(true);
    for n in 0..RECORDS {
        dispatcher.submit(n).expect("room for every item");
    }
    dispatcher.stop(Duration::from_secs(10)).await.expect("every worker ends");
    breaking.switch(false);
    assert!(breaking.panics() >= 3 * RECORDS as usize, "every count panicked");
    assert_eq!(done.load(Ordering::SeqCst), RECORDS as usize, "every item processed once");
    let stats = dispatcher.stats();
    assert_eq!((stats.submitted, stats.completed, stats.failed), (200, 180, 20), "{stats:?}");
}

/// A spill reader's commit whose count panics is sent all the same: after a restart, the
/// committed records do not come back. (Before, the commit was counted after the reader's
/// state moved past it and before it was sent to the writer: it was never written, a retry
/// found it done, and the restart redelivered its records.)
#[test]
fn a_spill_commit_whose_count_panics_is_kept() {
    let dir = std::env::temp_dir().join(format!("lanes-recorder-spill-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let breaking = Breaking::default();
    let recorder = breaking.recorder(&["lanes_spill_acked_total"], &["lanes_spill_unacked_bytes"]);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let options = SpillOptions::default().sync(SyncPolicy::Always);
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let (queue, _) = SpillQueue::open(&dir, options.clone()).await.unwrap();
            for i in 0..10u8 {
                queue.append([i]).await.unwrap();
            }
            let mut reader = queue.reader().unwrap();
            let read = reader.next_batch(10).await.unwrap();
            let to = read[4].position();
            breaking.switch(true);
            let commit = tokio::spawn(async move { reader.commit(to).await });
            assert!(commit.await.unwrap_err().is_panic(), "the count's panic reaches the reader");
            breaking.switch(false);
            queue.close().await.unwrap();
        });
    });
    runtime.block_on(async {
        let (queue, report) = SpillQueue::open(&dir, options).await.unwrap();
        assert_eq!(report.records, 5, "the first five were committed: {report:?}");
        queue.close().await.unwrap();
    });
    let _ = std::fs::remove_dir_all(&dir);
}

/// A dispatcher whose limit's counts panic (a limit's calls are not contained: the panic
/// reaches its caller, here the worker) fails each item whose permit's count panicked, gives
/// the permit back, and keeps its workers. (Before, the panic ended the worker with its item
/// taken, and the stop waited for it for good.)
#[tokio::test]
async fn a_pool_whose_limit_panics_keeps_its_workers() {
    let breaking = Breaking::default();
    let recorder = breaking.recorder(&["lanes_limit_acquired_total"], &["lanes_limit_held"]);
    let _recording = metrics::set_default_local_recorder(&recorder);
    let limits = Limits::new();
    limits.define("l", LimitSpec::concurrent(1)).await.unwrap();
    let done = Arc::new(AtomicUsize::new(0));
    let dispatcher = {
        let done = done.clone();
        let builder = Dispatcher::builder().workers(2).queue_size(RECORDS as usize);
        builder.limit(&limits, "l", Priority::default()).build(move |_: u32| {
            let done = done.clone();
            async move {
                done.fetch_add(1, Ordering::SeqCst);
                Ok::<(), std::io::Error>(())
            }
        })
    }
    .expect("a valid dispatcher");
    breaking.switch(true);
    for n in 0..RECORDS {
        dispatcher.submit(n).expect("room for every item");
    }
    dispatcher.stop(Duration::from_secs(10)).await.expect("every worker ends");
    breaking.switch(false);
    let stats = dispatcher.stats();
    assert_eq!((stats.completed, stats.failed), (0, 200), "each permit's count panicked");
    assert_eq!(done.load(Ordering::SeqCst), 0);
    drop(limits.limit("l").try_acquire().await.expect("the limit's permit is free"));
}
