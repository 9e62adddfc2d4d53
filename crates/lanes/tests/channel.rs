//! Channels: every overflow policy at the boundary, cancellation, batching by size, time and
//! close, failure policies, receipts and `AckSet`, the consumer's limit, the registry (budget,
//! cascade), counter reconciliation under stress, and spill end to end.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use lanes::channel::{
    AckSet, BinaryCodec, Channel, ChannelConfig, ChannelError, Channels, Codec, ConsumerOptions,
    EmitError, Emitted, Envelope, FailurePolicy, JsonCodec, Overflow, PermitPer, Settlement,
};
use lanes::spill::{MemStorage, SpillError, SpillOptions, SpillQueue};
use lanes::{ConfigRule, LimitSpec, Limits, Priority, Registry};
use tokio::time::Instant;

async fn mem_queue() -> SpillQueue {
    SpillQueue::open_with(MemStorage::new(), SpillOptions::default()).await.unwrap().0
}

async fn read_envelopes(queue: &SpillQueue) -> Vec<Envelope> {
    let mut reader = queue.reader().unwrap();
    let mut out = Vec::new();
    loop {
        let batch = reader.try_next_batch(1000).await.unwrap();
        if batch.is_empty() {
            return out;
        }
        out.extend(batch.iter().map(|r| Envelope::from_bytes(r.data()).unwrap()));
    }
}

async fn read_records<T: serde::Serialize + serde::de::DeserializeOwned>(
    queue: &SpillQueue,
) -> Vec<T> {
    let mut reader = queue.reader().unwrap();
    let mut out = Vec::new();
    loop {
        let batch = reader.try_next_batch(1000).await.unwrap();
        if batch.is_empty() {
            return out;
        }
        out.extend(batch.iter().map(|r| BinaryCodec::new().decode(r.data()).unwrap()));
    }
}

fn options<T>(batch_max: usize) -> ConsumerOptions<T> {
    ConsumerOptions::new().batch_max(batch_max)
}

// ---------------------------------------------------------------- overflow at the boundary

#[tokio::test]
async fn block_try_emit_on_a_full_channel_hands_the_record_back() {
    let channel = Channel::new(ChannelConfig::new(2)).unwrap();
    assert!(channel.try_emit(1).unwrap().is_queued());
    assert!(channel.try_emit(2).unwrap().is_queued());
    let err = channel.try_emit(3).unwrap_err();
    assert!(err.is_full());
    assert_eq!(err.into_record(), 3);
    let s = channel.snapshot();
    assert_eq!((s.emitted, s.depth, s.dropped), (2, 2, 0));
    assert!(s.reconciles());
}

#[tokio::test(start_paused = true)]
async fn block_emit_waits_for_room_and_counts_the_wait() {
    let channel = Channel::new(ChannelConfig::new(1)).unwrap();
    let mut consumer = channel.consumer(options(1)).unwrap();
    channel.emit(1).await.unwrap();
    let producer = channel.clone();
    let waiting = tokio::spawn(async move { producer.emit(2).await.map(|e| e.is_queued()) });
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(!waiting.is_finished());
    assert_eq!(channel.snapshot().blocked_waits, 1);

    assert_eq!(consumer.recv().await, Some(1));
    assert!(waiting.await.unwrap().unwrap());
    assert_eq!(consumer.recv().await, Some(2));
    let s = channel.snapshot();
    assert_eq!((s.emitted, s.delivered, s.blocked_waits), (2, 2, 1));
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_blocked_emit_leaves_nothing_enqueued_and_passes_its_turn() {
    let channel = Channel::new(ChannelConfig::new(1)).unwrap();
    let mut consumer = channel.consumer(options(1)).unwrap();
    channel.emit("first").await.unwrap();

    // A waiting emit cancelled by a deadline.
    let cancelled = tokio::time::timeout(Duration::from_millis(5), channel.emit("cancelled")).await;
    assert!(cancelled.is_err());
    assert_eq!(channel.len(), 1);

    // Two waiters: the first is woken by a free slot, then dropped before it runs; the
    // second must get the slot.
    let first = {
        let channel = channel.clone();
        tokio::spawn(async move { channel.emit("a").await.map(|_| ()) })
    };
    tokio::time::sleep(Duration::from_millis(1)).await;
    let second = {
        let channel = channel.clone();
        tokio::spawn(async move { channel.emit("b").await.map(|_| ()) })
    };
    tokio::time::sleep(Duration::from_millis(1)).await;
    first.abort();
    assert_eq!(consumer.recv().await, Some("first"));
    let _ = first.await;
    tokio::time::timeout(Duration::from_secs(1), second)
        .await
        .expect("b got the slot")
        .unwrap()
        .unwrap();
    assert_eq!(consumer.recv().await, Some("b"));
    assert!(channel.is_empty());
    let s = channel.snapshot();
    assert_eq!(s.emitted, 2, "only first and b were enqueued");
    assert!(s.reconciles());
}

/// An emit with a receipt waits for room like a plain one: cancelled while in line it leaves
/// nothing behind, and once room comes its receipt settles with the record.
#[tokio::test(start_paused = true)]
async fn a_blocked_emit_with_receipt_waits_its_turn_and_cancels_cleanly() {
    let channel = Channel::new(ChannelConfig::new(1)).unwrap();
    let mut consumer = channel.consumer(options(1)).unwrap();
    let first = channel.emit_with_receipt(1u32).await.unwrap();
    let cancelled =
        tokio::time::timeout(Duration::from_millis(5), channel.emit_with_receipt(2)).await;
    assert!(cancelled.is_err(), "a full channel made it wait");
    drop(channel.emit_with_receipt(3)); // never polled: nothing happens
    let waiting = {
        let channel = channel.clone();
        tokio::spawn(async move { channel.emit_with_receipt(4).await })
    };
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert!(!waiting.is_finished());

    assert_eq!(consumer.recv().await, Some(1));
    assert_eq!(first.await, Settlement::Processed);
    let fourth = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the cancelled emit passed its turn on")
        .unwrap()
        .unwrap();
    assert_eq!(consumer.recv().await, Some(4));
    assert_eq!(fourth.await, Settlement::Processed);
    let s = channel.snapshot();
    assert_eq!((s.emitted, s.delivered, s.depth, s.blocked_waits), (2, 2, 0, 2));
    assert!(s.reconciles());
}

/// A close reaches producers waiting for room: each gets its record back as `Closed`, the one
/// handed a slot just before the close as well, and none of them is counted emitted.
#[tokio::test(start_paused = true)]
async fn producers_blocked_on_a_full_channel_get_their_records_back_when_it_closes() {
    let channel = Channel::new(ChannelConfig::new(1)).unwrap();
    let mut consumer = channel.consumer(options(1)).unwrap();
    channel.emit(0u32).await.unwrap();
    let blocked: Vec<_> = (1..=3u32)
        .map(|n| {
            let channel = channel.clone();
            tokio::spawn(async move { channel.emit(n).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(channel.snapshot().blocked_waits, 3);

    // The first in line is handed the freed slot; the channel closes before it can use it.
    assert_eq!(consumer.recv().await, Some(0));
    channel.close();
    for (n, producer) in (1..=3u32).zip(blocked) {
        let emitted = tokio::time::timeout(Duration::from_secs(5), producer)
            .await
            .expect("a blocked producer saw the close")
            .unwrap();
        assert!(matches!(emitted, Err(EmitError::Closed(record)) if record == n), "{n}");
    }
    let s = channel.snapshot();
    assert_eq!((s.emitted, s.delivered, s.depth, s.blocked_waits), (1, 1, 0, 3));
    assert!(s.reconciles());
    assert_eq!(consumer.recv().await, None);
}

/// Blocked producers get room first come first served, and a slot freed for the first of them
/// is its own until it uses it: a non-waiting emit cannot take it.
#[tokio::test(start_paused = true)]
async fn blocked_producers_are_served_in_arrival_order_and_nobody_barges() {
    let channel = Channel::new(ChannelConfig::new(1)).unwrap();
    let mut consumer = channel.consumer(options(1)).unwrap();
    channel.emit(0u32).await.unwrap();
    let mut producers = Vec::new();
    for n in 1..=5u32 {
        let channel = channel.clone();
        producers.push(tokio::spawn(async move { channel.emit(n).await.map(|_| ()) }));
        tokio::task::yield_now().await; // each is blocked before the next arrives
    }
    assert_eq!(channel.snapshot().blocked_waits, 5);
    assert_eq!(consumer.recv().await, Some(0));
    // The freed slot is producer 1's, which has not run yet.
    assert!(matches!(channel.try_emit(99), Err(EmitError::Full(99))), "a try_emit barged");
    let mut received = Vec::new();
    for _ in 1..=5 {
        received.push(consumer.recv().await.unwrap());
    }
    assert_eq!(received, [1, 2, 3, 4, 5]);
    for producer in producers {
        producer.await.unwrap().unwrap();
    }
    assert!(channel.snapshot().reconciles());
}

/// A budget unit handed to the first blocked producer passes to the next if that producer goes
/// away before using it.
#[tokio::test(start_paused = true)]
async fn a_budget_unit_handed_to_a_producer_that_went_away_passes_on() {
    let channels = Channels::with_budget(1).unwrap();
    let a = channels.create::<u32>("a", ChannelConfig::new(4)).unwrap();
    let b = channels.create::<u32>("b", ChannelConfig::new(4)).unwrap();
    let c = channels.create::<u32>("c", ChannelConfig::new(4)).unwrap();
    let mut consumer_a = a.consumer(options(1)).unwrap();
    let mut consumer_c = c.consumer(options(1)).unwrap();
    a.emit(1).await.unwrap();
    let first = tokio::spawn({
        let b = b.clone();
        async move { b.emit(2).await.map(|_| ()) }
    });
    tokio::task::yield_now().await;
    let second = tokio::spawn(async move { c.emit(3).await.map(|_| ()) });
    tokio::task::yield_now().await;
    // The unit comes back and is handed to `first`, which is aborted before it runs.
    assert_eq!(consumer_a.recv().await, Some(1));
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    tokio::time::timeout(Duration::from_secs(1), second)
        .await
        .expect("the second producer got the unit")
        .unwrap()
        .unwrap();
    assert_eq!(consumer_c.recv().await, Some(3));
    assert_eq!(channels.budget_used(), Some(0));
    assert!(b.is_empty());
}

#[tokio::test]
async fn drop_newest_hands_back_the_new_record() {
    let channel = Channel::new(ChannelConfig::new(2).overflow(Overflow::DropNewest)).unwrap();
    let mut consumer = channel.consumer(options(10)).unwrap();
    channel.emit(1).await.unwrap();
    channel.emit(2).await.unwrap();
    assert!(matches!(channel.emit(3).await.unwrap(), Emitted::Dropped(3)));
    assert!(matches!(channel.try_emit(4).unwrap(), Emitted::Dropped(4)));
    channel.close();
    let batch = consumer.next_batch().await.unwrap();
    assert_eq!(&batch[..], &[1, 2]);
    batch.ack().await.unwrap();
    let s = channel.snapshot();
    assert_eq!((s.emitted, s.delivered, s.dropped, s.processed), (4, 2, 2, 2));
    assert!(s.reconciles());
}

#[tokio::test]
async fn drop_oldest_evicts_the_head() {
    let channel = Channel::new(ChannelConfig::new(2).overflow(Overflow::DropOldest)).unwrap();
    let mut consumer = channel.consumer(options(10)).unwrap();
    channel.emit(1).await.unwrap();
    channel.emit(2).await.unwrap();
    assert!(matches!(channel.emit(3).await.unwrap(), Emitted::DroppedOldest(1)));
    assert!(matches!(channel.try_emit(4).unwrap(), Emitted::DroppedOldest(2)));
    channel.close();
    let batch = consumer.next_batch().await.unwrap();
    assert_eq!(&batch[..], &[3, 4]);
    drop(batch);
    let s = channel.snapshot();
    assert_eq!((s.emitted, s.delivered, s.dropped, s.abandoned), (4, 2, 2, 2));
    assert!(s.reconciles());
}

#[tokio::test]
async fn spill_sends_overflow_to_the_queue_once_and_never_back() {
    let queue = mem_queue().await;
    let channel = Channel::new(
        ChannelConfig::new(2).overflow(Overflow::spill(queue.clone(), BinaryCodec::new())),
    )
    .unwrap();
    let mut consumer = channel.consumer(options(10)).unwrap();
    for n in 0..5u64 {
        let emitted = channel.emit(n).await.unwrap();
        assert_eq!(emitted.is_queued(), n < 2, "record {n}");
    }
    assert!(matches!(channel.try_emit(5).unwrap(), Emitted::Spilled));
    channel.close();
    let batch = consumer.next_batch().await.unwrap();
    assert_eq!(&batch[..], &[0, 1]);
    batch.ack().await.unwrap();
    assert!(consumer.next_batch().await.is_none());
    // `try_emit` hands the last one to the writer without waiting: read until it is there.
    let mut reader = queue.reader().unwrap();
    let mut spilled: Vec<u64> = Vec::new();
    while spilled.len() < 4 {
        let batch = tokio::time::timeout(Duration::from_secs(5), reader.next_batch(10))
            .await
            .expect("the spilled records arrive")
            .unwrap();
        spilled.extend(
            batch.iter().map(|r| Codec::<u64>::decode(&BinaryCodec::new(), r.data()).unwrap()),
        );
    }
    assert_eq!(spilled, [2, 3, 4, 5]);
    let s = channel.snapshot();
    assert_eq!((s.emitted, s.delivered, s.spilled, s.depth), (6, 2, 4, 0));
}

/// A spilled record is counted once the spill queue took it, never before and never taken
/// back: an emit cancelled while its append is in the queue's write path still counts it, and
/// the counters reconcile with what the queue holds.
#[tokio::test]
async fn a_cancelled_spilling_emit_is_counted_as_the_queue_holds_it() {
    let queue = mem_queue().await;
    let channel = Channel::new(
        ChannelConfig::new(1).overflow(Overflow::spill(queue.clone(), BinaryCodec::new())),
    )
    .unwrap();
    channel.emit(1u64).await.unwrap();
    // Each emit is polled once, then dropped if its append is still in the write path; go on
    // until a few were dropped that way (most appends finish within the first poll).
    let (mut cancelled, mut n) = (0, 1u64);
    while cancelled < 5 && n < 2_000 {
        n += 1;
        if tokio::time::timeout(Duration::ZERO, channel.emit(n)).await.is_err() {
            cancelled += 1;
        }
        let s = channel.snapshot();
        assert!(s.reconciles(), "{s:?}");
    }
    assert!(cancelled > 0, "no emit was cancelled mid-append: the test saw nothing");
    let spilled_total = usize::try_from(n - 1).unwrap();
    let mut reader = queue.reader().unwrap();
    let mut spilled: Vec<u64> = Vec::new();
    while spilled.len() < spilled_total {
        let batch = tokio::time::timeout(Duration::from_secs(5), reader.next_batch(1000))
            .await
            .expect("every started append arrives")
            .unwrap();
        spilled.extend(
            batch.iter().map(|r| Codec::<u64>::decode(&BinaryCodec::new(), r.data()).unwrap()),
        );
    }
    assert_eq!(spilled, (2..=n).collect::<Vec<_>>());
    let s = channel.snapshot();
    assert_eq!((s.emitted, s.spilled, s.depth), (n, n - 1, 1), "{cancelled} cancelled");
    assert!(s.reconciles());
}

#[tokio::test]
async fn a_refused_spill_hands_the_record_back_uncounted() {
    let (queue, _) =
        SpillQueue::open_with(MemStorage::new(), SpillOptions::default().max_record(16))
            .await
            .unwrap();
    let channel = Channel::new(
        ChannelConfig::new(1).overflow(Overflow::spill(queue.clone(), JsonCodec::new())),
    )
    .unwrap();
    channel.emit("short".to_owned()).await.unwrap();
    let err =
        channel.emit("this record is longer than sixteen bytes".to_owned()).await.unwrap_err();
    assert!(matches!(err, EmitError::Spill(_, SpillError::TooLarge { .. })), "{err}");
    assert_eq!(err.into_record(), "this record is longer than sixteen bytes");
    let err = channel.try_emit("and this one is too, by far".to_owned()).unwrap_err();
    assert!(matches!(err, EmitError::Spill(..)));
    let s = channel.snapshot();
    assert_eq!((s.emitted, s.spilled, s.depth), (1, 0, 1));
    assert!(s.reconciles());
}

#[tokio::test]
async fn a_closed_channel_refuses_records_and_closing_twice_is_a_no_op() {
    let channel = Channel::new(ChannelConfig::new(4)).unwrap();
    let mut consumer = channel.consumer(options(4)).unwrap();
    channel.emit(1).await.unwrap();
    channel.close();
    channel.close();
    assert!(channel.emit(2).await.unwrap_err().is_closed());
    assert!(matches!(channel.try_emit(3), Err(EmitError::Closed(3))));
    assert_eq!(&consumer.next_batch().await.unwrap()[..], &[1]);
    assert!(consumer.next_batch().await.is_none());
}

#[tokio::test]
async fn dropping_every_producer_closes_a_standalone_channel() {
    let channel = Channel::new(ChannelConfig::new(4)).unwrap();
    let mut consumer = channel.consumer(options(4)).unwrap();
    let other = channel.clone();
    channel.emit(1).await.unwrap();
    drop(channel);
    other.emit(2).await.unwrap();
    drop(other);
    let mut got = Vec::new();
    assert_eq!(consumer.recv_many(&mut got, 10).await, 2);
    assert_eq!(got, [1, 2]);
    assert_eq!(consumer.recv_many(&mut got, 10).await, 0);
}

// A consumer that takes the last queued record registers for the next one under the same lock
// and waits again without the lock until a record (or the close) comes. These check the wakes
// it relies on, each bounded by a timeout so that a lost wake fails instead of hanging.

#[tokio::test(start_paused = true)]
async fn a_consumer_that_emptied_the_channel_is_woken_by_the_next_record_and_by_the_close() {
    let channel = Channel::new(ChannelConfig::new(4)).unwrap();
    let mut consumer = channel.consumer(options(4)).unwrap();
    channel.emit(1).await.unwrap();
    assert_eq!(consumer.recv().await, Some(1));
    let producer = channel.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(5)).await;
        producer.emit(2).await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        producer.close();
    });
    let bound = Duration::from_secs(1);
    assert_eq!(tokio::time::timeout(bound, consumer.recv()).await, Ok(Some(2)));
    assert_eq!(tokio::time::timeout(bound, consumer.recv()).await, Ok(None));
}

#[tokio::test(start_paused = true)]
async fn a_consumer_moved_to_another_task_after_emptying_the_channel_waits_with_its_own_waker() {
    let channel = Channel::new(ChannelConfig::new(4)).unwrap();
    let mut consumer = channel.consumer(options(4)).unwrap();
    channel.emit(1).await.unwrap();
    // The first task empties the channel (registering its own waker), then ends.
    let mut consumer = tokio::spawn(async move {
        assert_eq!(consumer.recv().await, Some(1));
        consumer
    })
    .await
    .unwrap();
    // This task's recv must register its waker: the first task's is gone.
    let reader = tokio::spawn(async move { consumer.recv().await });
    tokio::time::sleep(Duration::from_millis(5)).await;
    channel.emit(2).await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(1), reader).await;
    assert_eq!(got.expect("woken").unwrap(), Some(2));
}

// A plain read that waits is handed the next record: delivered at once, outside the capacity.

/// Polls `consumer.recv()` in a task until it waits, and returns the task.
async fn waiting_read<T: Send + 'static>(
    mut consumer: lanes::channel::Consumer<T>,
) -> tokio::task::JoinHandle<(Option<T>, lanes::channel::Consumer<T>)> {
    let reader = tokio::spawn(async move {
        let got = consumer.recv().await;
        (got, consumer)
    });
    // current_thread: the spawned read runs (and waits) at the next yield.
    tokio::task::yield_now().await;
    assert!(!reader.is_finished(), "nothing was queued: the read waits");
    reader
}

#[tokio::test]
async fn a_waiting_read_is_handed_the_next_record_without_it_taking_a_slot() {
    let channel = Channel::new(ChannelConfig::new(1)).unwrap();
    let consumer = channel.consumer(options(1)).unwrap();
    let reader = waiting_read(consumer).await;

    // The first record goes to the read; the channel's one slot is still free for the next.
    assert!(matches!(channel.try_emit(1u32), Ok(Emitted::Queued)));
    assert!(matches!(channel.try_emit(2), Ok(Emitted::Queued)), "the slot was free");
    assert!(matches!(channel.try_emit(3), Err(EmitError::Full(3))), "now the channel is full");
    let s = channel.snapshot();
    assert_eq!((s.depth, s.emitted, s.delivered), (1, 2, 1), "{s:?}");
    assert!(s.reconciles());

    let (got, mut consumer) = reader.await.unwrap();
    assert_eq!(got, Some(1));
    assert_eq!(consumer.recv().await, Some(2), "order is kept");
    let s = channel.snapshot();
    assert_eq!((s.depth, s.delivered, s.processed), (0, 2, 2), "{s:?}");
}

#[tokio::test]
async fn a_record_handed_to_a_consumer_that_goes_away_is_counted_abandoned() {
    let channel = Channel::new(ChannelConfig::new(1)).unwrap();
    let consumer = channel.consumer(options(1)).unwrap();
    let reader = waiting_read(consumer).await;
    // The read's task is aborted before it runs again: the handed record is never read.
    let receipt = channel.emit_with_receipt(7u32).await.unwrap();
    reader.abort();
    assert!(reader.await.unwrap_err().is_cancelled());
    assert_eq!(receipt.settlement(), Some(Settlement::Dropped));
    let s = channel.snapshot();
    assert_eq!((s.emitted, s.delivered, s.abandoned, s.processed), (1, 1, 1, 0), "{s:?}");
    assert!(s.reconciles() && s.closed);
    tokio::time::timeout(Duration::from_secs(5), channel.drained()).await.expect("drained");
}

#[tokio::test]
async fn a_record_handed_to_a_dropped_consumer_gives_its_budget_unit_back() {
    let channels = Channels::with_budget(1).unwrap();
    let a = channels.create::<u32>("a", ChannelConfig::new(4)).unwrap();
    let b = channels.create::<u32>("b", ChannelConfig::new(4)).unwrap();
    let reader = waiting_read(a.consumer(options(1)).unwrap()).await;
    // Handed to the read: it holds the registry's one unit until taken.
    assert!(matches!(a.try_emit(1), Ok(Emitted::Queued)));
    assert_eq!(channels.budget_used(), Some(1));
    assert!(matches!(b.try_emit(2), Err(EmitError::Full(2))), "the budget is used up");
    // The reader goes away without reading it: abandoned, and the unit is free again.
    reader.abort();
    assert!(reader.await.unwrap_err().is_cancelled());
    assert_eq!(channels.budget_used(), Some(0));
    let s = a.snapshot();
    assert_eq!((s.emitted, s.delivered, s.abandoned), (1, 1, 1), "{s:?}");
    assert!(matches!(b.try_emit(2), Ok(Emitted::Queued)));
}

/// A record emitted while a consumer is being dropped, after it withdrew its read: queued and
/// dropped by the close, never handed to the consumer going away. The emit runs inside the
/// drop, from the waker of a receipt the drop settles.
#[tokio::test]
async fn a_record_emitted_during_a_consumers_drop_is_not_handed_to_it() {
    struct EmitOnWake(Channel<u32>);
    impl std::task::Wake for EmitOnWake {
        fn wake(self: Arc<Self>) {
            assert!(matches!(self.0.try_emit(3), Ok(Emitted::Queued)));
        }
    }

    let channel = Channel::new(ChannelConfig::new(2)).unwrap();
    let mut consumer = channel.consumer(options(1)).unwrap();
    let first = channel.emit_with_receipt(1u32).await.unwrap();
    let mut second = channel.emit_with_receipt(2).await.unwrap();
    // The read takes both (it reads ahead), empties the channel and registers for the next.
    assert_eq!(consumer.recv().await, Some(1));
    assert_eq!(first.settlement(), Some(Settlement::Processed));
    let waker = std::task::Waker::from(Arc::new(EmitOnWake(channel.clone())));
    let polled = std::pin::Pin::new(&mut second).poll(&mut std::task::Context::from_waker(&waker));
    assert!(polled.is_pending(), "2 is in the consumer's read-ahead, unread");

    // The drop settles 2 (abandoned), whose waker emits 3 while the drop is under way.
    drop(consumer);
    assert_eq!(second.settlement(), Some(Settlement::Dropped));
    tokio::time::timeout(Duration::from_secs(5), channel.drained())
        .await
        .unwrap_or_else(|_| panic!("drained: {:?}", channel.snapshot()));
    let s = channel.snapshot();
    assert_eq!((s.emitted, s.processed, s.abandoned, s.dropped), (3, 1, 1, 1), "{s:?}");
    assert!(s.reconciles());
}

/// A consumer dropped right after a read that emptied the channel (so registered for the next
/// record) while producers keep emitting on other threads: every record ends processed,
/// abandoned or dropped, and `drained` returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_dropped_while_records_come_leaves_every_record_settled() {
    for round in 0..200u32 {
        let channel = Channel::new(ChannelConfig::new(1)).unwrap();
        let mut consumer = channel.consumer(options(1)).unwrap();
        let producer = {
            let channel = channel.clone();
            tokio::spawn(async move {
                let mut receipts = Vec::new();
                for n in 0..50u32 {
                    match channel.emit_with_receipt(n).await {
                        Ok(receipt) => receipts.push(receipt),
                        Err(EmitError::Closed(_)) => break,
                        Err(e) => panic!("{e}"),
                    }
                }
                receipts
            })
        };
        // Reads a few records (none in every seventh round), then drops the consumer.
        let reads = usize::try_from(round % 7).unwrap();
        for _ in 0..reads {
            if consumer.recv().await.is_none() {
                break;
            }
        }
        drop(consumer);
        let receipts = producer.await.unwrap();
        tokio::time::timeout(Duration::from_secs(5), channel.drained())
            .await
            .unwrap_or_else(|_| panic!("round {round}: drained: {:?}", channel.snapshot()));
        let s = channel.snapshot();
        assert!(s.reconciles(), "round {round}: {s:?}");
        assert_eq!(s.delivered, s.processed + s.abandoned, "round {round}: {s:?}");
        assert_eq!(s.emitted, receipts.len() as u64, "round {round}: {s:?}");
        for receipt in &receipts {
            assert!(receipt.settlement().is_some(), "round {round}: a receipt is unsettled: {s:?}");
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_batch_read_after_a_plain_read_still_lingers() {
    let channel = Channel::new(ChannelConfig::new(4)).unwrap();
    let mut consumer = channel.consumer(options(4).batch_flush(Duration::from_millis(20))).unwrap();
    // The read empties the channel and stays registered for the next record.
    channel.emit(0u32).await.unwrap();
    assert_eq!(consumer.recv().await, Some(0));
    let producer = channel.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(5)).await;
        producer.emit(1).await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        producer.emit(2).await.unwrap();
    });
    // A batch read in the same task (so with the read's waker) withdraws that registration:
    // the next record is queued, not handed over, and the batch waits its linger for more.
    let start = Instant::now();
    let batch = consumer.next_batch().await.expect("a batch");
    assert_eq!(&batch[..], &[1, 2]);
    // The first record came at 5 ms; the batch leaves batch_flush later, less the timer's tick.
    assert!(start.elapsed() >= Duration::from_millis(24), "it lingered: {:?}", start.elapsed());
}

#[tokio::test]
async fn a_record_handed_to_the_read_is_still_delivered_after_the_close() {
    let channel = Channel::new(ChannelConfig::new(1).discard_on_close()).unwrap();
    let consumer = channel.consumer(options(1)).unwrap();
    let reader = waiting_read(consumer).await;
    channel.try_emit(1u32).unwrap();
    channel.try_emit(2).unwrap();
    // A discarding close drops what is queued (2), not what the read was handed (1).
    channel.close();
    let (got, mut consumer) = reader.await.unwrap();
    assert_eq!(got, Some(1));
    assert_eq!(consumer.recv().await, None);
    let s = channel.snapshot();
    assert_eq!((s.emitted, s.delivered, s.dropped, s.processed), (2, 1, 1, 1), "{s:?}");
    assert!(s.reconciles());
}

#[tokio::test]
async fn a_batch_after_a_read_takes_the_record_handed_to_the_read_first() {
    let channel = Channel::new(ChannelConfig::new(2)).unwrap();
    let mut consumer = channel.consumer(options(4)).unwrap();
    // A read that empties the channel registers for the next record.
    channel.emit(0u32).await.unwrap();
    assert_eq!(consumer.recv().await, Some(0));
    for n in 1..=3 {
        channel.try_emit(n).unwrap();
    }
    assert_eq!(channel.len(), 2, "1 went to the read's registration, 2 and 3 are queued");
    let batch = consumer.next_batch().await.unwrap();
    assert_eq!(&batch[..], &[1, 2, 3]);
    batch.ack().await.unwrap();
    let s = channel.snapshot();
    assert_eq!((s.delivered, s.processed), (4, 4), "{s:?}");
}

#[tokio::test]
async fn batches_and_reads_under_a_limit_are_not_handed_records() {
    // A batching consumer waits for its batch, and a limited one for its permit first: the
    // record queues in both cases.
    let limits = Limits::new();
    limits.define("sink", LimitSpec::concurrent(1)).await.unwrap();
    for batching in [true, false] {
        let channel = Channel::new(ChannelConfig::new(1)).unwrap();
        let reader = if batching {
            let mut consumer =
                channel.consumer(options(4).batch_flush(Duration::from_millis(5))).unwrap();
            tokio::spawn(async move { consumer.next_batch().await.map(|b| b.len()) })
        } else {
            let limit = options(1).limit(&limits, "sink", Priority::default(), PermitPer::Record);
            let mut consumer = channel.consumer(limit).unwrap();
            tokio::spawn(async move { consumer.recv().await.map(|_| 1) })
        };
        tokio::task::yield_now().await;
        assert!(!reader.is_finished());
        channel.try_emit(1u32).unwrap();
        assert!(matches!(channel.try_emit(2), Err(EmitError::Full(2))), "batching: {batching}");
        assert_eq!(channel.len(), 1);
        reader.abort();
    }
}

#[tokio::test]
async fn a_limited_read_releases_its_permit_when_it_returns() {
    // Under a consumer limit, `recv` takes one record under one permit, released on return:
    // between reads the limit is free for others, and a read waits while others hold it.
    for per in [PermitPer::Record, PermitPer::Batch] {
        let limits = Limits::new();
        limits.define("sink", LimitSpec::concurrent(1)).await.unwrap();
        let channel = Channel::new(ChannelConfig::new(8)).unwrap();
        let mut consumer =
            channel.consumer(options(1).limit(&limits, "sink", Priority::default(), per)).unwrap();
        for n in 0..3u32 {
            channel.try_emit(n).unwrap();
        }
        assert_eq!(consumer.recv().await, Some(0));
        let outside = limits.try_acquire("sink", Priority::default()).await;
        assert!(outside.is_ok(), "{per:?}: the read kept its permit");
        drop(outside);
        assert_eq!(consumer.recv().await, Some(1));
        let held = limits.acquire("sink", Priority::default()).await.unwrap();
        let waited = tokio::time::timeout(Duration::from_millis(20), consumer.recv()).await;
        assert!(waited.is_err(), "{per:?}: read past a held limit");
        drop(held);
        assert_eq!(consumer.recv().await, Some(2), "{per:?}");
        let s = channel.snapshot();
        assert_eq!((s.emitted, s.delivered, s.processed), (3, 3, 3), "{per:?}: {s:?}");
    }
}

#[tokio::test]
async fn a_read_dropped_while_it_waits_loses_nothing() {
    // A `recv` given up while it waits (here by a timeout, then by `select!` in the same task,
    // whose next read has the same waker) leaves the consumer registered for the next record:
    // the record handed to it is read next, in order, and the counters reconcile.
    let channel = Channel::new(ChannelConfig::new(4)).unwrap();
    let mut consumer = channel.consumer(options(1)).unwrap();
    assert!(tokio::time::timeout(Duration::from_millis(5), consumer.recv()).await.is_err());
    channel.try_emit(1u32).unwrap();
    channel.try_emit(2).unwrap();
    assert_eq!(channel.len(), 1, "the first record was handed to the dropped read");
    assert_eq!(consumer.recv().await, Some(1));
    assert_eq!(consumer.recv().await, Some(2));
    for n in 3..6u32 {
        tokio::select! {
            biased;
            got = consumer.recv() => panic!("read {got:?} from an empty channel"),
            () = tokio::task::yield_now() => {}
        }
        channel.try_emit(n).unwrap();
        assert_eq!(consumer.recv().await, Some(n));
    }
    channel.close();
    assert_eq!(consumer.recv().await, None);
    let s = channel.snapshot();
    assert_eq!((s.emitted, s.delivered, s.processed, s.depth), (5, 5, 5, 0), "{s:?}");
}

#[tokio::test]
async fn records_read_ahead_are_still_read_after_a_discarding_close() {
    // `recv` took the queued records into the consumer: they were delivered, so a close that
    // discards what is queued does not drop them, and the read after it returns them first.
    let channel = Channel::new(ChannelConfig::new(8).discard_on_close()).unwrap();
    let mut consumer = channel.consumer(options(1)).unwrap();
    for n in 0..3u32 {
        channel.try_emit(n).unwrap();
    }
    assert_eq!(consumer.recv().await, Some(0));
    channel.close();
    assert_eq!(consumer.recv().await, Some(1));
    assert_eq!(consumer.recv().await, Some(2));
    assert_eq!(consumer.recv().await, None);
    let s = channel.snapshot();
    assert_eq!((s.delivered, s.processed, s.dropped), (3, 3, 0), "{s:?}");
}

#[tokio::test(start_paused = true)]
async fn a_batching_consumer_that_emptied_the_channel_still_lingers_for_a_partial_batch() {
    let channel = Channel::new(ChannelConfig::new(8)).unwrap();
    let mut consumer = channel.consumer(options(4).batch_flush(Duration::from_millis(20))).unwrap();
    for n in 0..4 {
        channel.emit(n).await.unwrap();
    }
    let batch = consumer.next_batch().await.expect("a full batch");
    assert_eq!(&batch[..], &[0, 1, 2, 3]);
    batch.ack().await.unwrap();
    let producer = channel.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(5)).await;
        producer.emit(4).await.unwrap();
    });
    let start = Instant::now();
    let batch = tokio::time::timeout(Duration::from_secs(1), consumer.next_batch())
        .await
        .expect("flushed")
        .expect("a partial batch");
    assert_eq!(&batch[..], &[4]);
    // Queued at 5 ms, flushed once it had waited batch_flush (less the timer's tick).
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(23) && waited <= Duration::from_millis(26),
        "{waited:?}"
    );
    batch.ack().await.unwrap();
}

#[tokio::test]
async fn dropping_the_consumer_closes_and_drops_what_is_queued() {
    let channel = Channel::new(ChannelConfig::new(4)).unwrap();
    let consumer = channel.consumer(options(4)).unwrap();
    let receipt = channel.emit_with_receipt(1).await.unwrap();
    channel.emit(2).await.unwrap();
    drop(consumer);
    assert_eq!(receipt.await, Settlement::Dropped);
    assert!(channel.emit(3).await.unwrap_err().is_closed());
    let s = channel.snapshot();
    assert_eq!((s.emitted, s.dropped, s.depth), (2, 2, 0));
    assert!(matches!(channel.consumer(options(1)), Err(ChannelError::ConsumerTaken(_))));
}

#[tokio::test]
async fn discard_on_close_drops_the_queue_at_close() {
    let channel = Channel::new(ChannelConfig::new(4).discard_on_close()).unwrap();
    let mut consumer = channel.consumer(options(4)).unwrap();
    channel.emit(1).await.unwrap();
    channel.close();
    assert!(consumer.next_batch().await.is_none());
    let s = channel.snapshot();
    assert_eq!((s.emitted, s.dropped, s.delivered), (1, 1, 0));
}

#[test]
fn invalid_configurations_are_typed_errors() {
    let err = Channel::<u8>::new(ChannelConfig::new(0)).unwrap_err();
    let ChannelError::Config(err) = err else { panic!("{err:?}") };
    assert_eq!((err.field(), err.rule()), ("channels.channel.capacity", ConfigRule::Zero));
    let err = Channel::<u8>::new(ChannelConfig::new(usize::MAX)).unwrap_err();
    assert!(
        matches!(err, ChannelError::Config(e) if matches!(e.rule(), ConfigRule::OverMax { .. }))
    );
    let err = Channel::<u8>::new(ChannelConfig::new(1).ack_timeout(Duration::ZERO)).unwrap_err();
    assert!(matches!(err, ChannelError::Config(e) if e.rule() == ConfigRule::ZeroTimeout));

    let channel = Channel::<u8>::new(ChannelConfig::new(1)).unwrap();
    let err = channel.consumer(options(0)).unwrap_err();
    assert!(
        matches!(&err, ChannelError::Config(e) if e.field() == "channels.channel.consumer.batch_max")
    );
    let err = channel
        .consumer(ConsumerOptions::new().on_failure(FailurePolicy::Tag("bad".into())))
        .unwrap_err();
    assert!(
        matches!(&err, ChannelError::Config(e) if e.field().ends_with("output") && e.rule() == ConfigRule::Missing)
    );
}

#[tokio::test]
async fn writing_consumers_need_a_codec() {
    let channel = Channel::<u8>::new(ChannelConfig::new(1)).unwrap();
    let err = channel.consumer(ConsumerOptions::new().output(mem_queue().await)).unwrap_err();
    assert!(matches!(&err, ChannelError::Config(e) if e.field().ends_with("codec")), "{err}");
}

/// The codec is given once: a spilling channel's consumer writes its output with the
/// channel's spill codec when it names none.
#[tokio::test]
async fn a_spilling_channels_codec_also_encodes_its_consumers_output() {
    let spill = mem_queue().await;
    let output = mem_queue().await;
    let channel = Channel::<u32>::new(
        ChannelConfig::new(4).overflow(Overflow::spill(spill, JsonCodec::new())),
    )
    .unwrap();
    let mut consumer = channel.consumer(ConsumerOptions::new().output(output.clone())).unwrap();
    channel.try_emit(42).unwrap();
    consumer.next_batch().await.unwrap().ack().await.unwrap();
    let written = read_envelopes(&output).await;
    assert_eq!(written.len(), 1);
    assert_eq!(written[0].payload, b"42", "JSON, the spill codec");
}

// ---------------------------------------------------------------- batching

#[tokio::test]
async fn batches_flush_at_batch_max() {
    let channel = Channel::new(ChannelConfig::new(16)).unwrap();
    let mut consumer = channel.consumer(options(3).batch_flush(Duration::from_secs(3600))).unwrap();
    for n in 0..7 {
        channel.emit(n).await.unwrap();
    }
    assert_eq!(&consumer.next_batch().await.unwrap()[..], &[0, 1, 2]);
    assert_eq!(&consumer.next_batch().await.unwrap()[..], &[3, 4, 5]);
    // The seventh waits for its linger (an hour) or a close.
    let early = tokio::time::timeout(Duration::from_millis(20), consumer.next_batch()).await;
    assert!(early.is_err(), "a partial batch must not be delivered early");
    channel.close();
    assert_eq!(&consumer.next_batch().await.unwrap()[..], &[6]);
    assert!(consumer.next_batch().await.is_none());
}

#[tokio::test(start_paused = true)]
async fn a_partial_batch_flushes_when_its_oldest_record_has_waited_batch_flush() {
    let channel = Channel::new(ChannelConfig::new(16)).unwrap();
    let mut consumer =
        channel.consumer(options(10).batch_flush(Duration::from_millis(50))).unwrap();
    let start = Instant::now();
    channel.emit(1).await.unwrap();
    tokio::time::sleep(Duration::from_millis(30)).await;
    channel.emit(2).await.unwrap();
    let batch = consumer.next_batch().await.unwrap();
    assert_eq!(&batch[..], &[1, 2]);
    // Measured from the first record, not the last (aimed a 1 ms timer tick early).
    assert_eq!(start.elapsed(), Duration::from_millis(49));

    // And the consumer waiting first: the clock starts with the record.
    let producer = channel.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        producer.emit(3).await.unwrap();
    });
    let start = Instant::now();
    let batch = consumer.next_batch().await.unwrap();
    assert_eq!(&batch[..], &[3]);
    assert_eq!(start.elapsed(), Duration::from_millis(149));
}

#[tokio::test]
async fn the_consumer_is_a_stream_of_batches() {
    use futures_core::Stream;
    let channel = Channel::new(ChannelConfig::new(16)).unwrap();
    let mut consumer = channel.consumer(options(4)).unwrap();
    for n in 0..10 {
        channel.emit(n).await.unwrap();
    }
    drop(channel);
    let mut sizes = Vec::new();
    let mut all = Vec::new();
    while let Some(batch) =
        std::future::poll_fn(|cx| std::pin::Pin::new(&mut consumer).poll_next(cx)).await
    {
        sizes.push(batch.len());
        all.extend_from_slice(&batch);
        batch.ack().await.unwrap();
    }
    assert_eq!(sizes, [4, 4, 2]);
    assert_eq!(all, (0..10).collect::<Vec<_>>());
}

// ---------------------------------------------------------------- failure policies

fn fail_odd(batch: &[u64]) -> Vec<Result<(), lanes::BoxError>> {
    batch.iter().map(|n| if n % 2 == 1 { Err(format!("odd {n}").into()) } else { Ok(()) }).collect()
}

#[tokio::test]
async fn ignore_counts_failures_and_drops_them() {
    let channel = Channel::new(ChannelConfig::new(8)).unwrap();
    let mut consumer = channel.consumer(options(8)).unwrap();
    for n in 0..4u64 {
        channel.emit(n).await.unwrap();
    }
    channel.close();
    let batch = consumer.next_batch().await.unwrap();
    let outcomes = fail_odd(&batch);
    let report = batch.settle(outcomes).await.unwrap();
    assert_eq!((report.processed, report.failed, report.ignored), (2, 2, 2));
    let s = channel.snapshot();
    assert_eq!((s.processed, s.failed, s.ignored, s.tagged), (2, 2, 2, 0));
}

#[tokio::test]
async fn tag_re_emits_failures_downstream_with_the_tag() {
    let output = mem_queue().await;
    let channel = Channel::new(ChannelConfig::new(8)).unwrap();
    let mut consumer = channel
        .consumer(
            options(8)
                .output(output.clone())
                .codec(BinaryCodec::new())
                .on_failure(FailurePolicy::Tag("enrich-failed".into())),
        )
        .unwrap();
    for n in 0..4u64 {
        channel.emit(n).await.unwrap();
    }
    channel.close();
    let batch = consumer.next_batch().await.unwrap();
    let outcomes = fail_odd(&batch);
    let report = batch.settle(outcomes).await.unwrap();
    assert_eq!((report.processed, report.tagged), (2, 2));
    let envelopes = read_envelopes(&output).await;
    assert_eq!(envelopes.len(), 4);
    for (n, envelope) in envelopes.iter().enumerate() {
        let record: u64 = BinaryCodec::new().decode(&envelope.payload).unwrap();
        assert_eq!(record, n as u64, "order kept");
        if n % 2 == 1 {
            assert_eq!(envelope.tags, ["enrich-failed".to_owned(), format!("error=odd {n}")]);
        } else {
            assert!(envelope.tags.is_empty());
        }
    }
    assert_eq!(channel.snapshot().tagged, 2);
}

#[tokio::test]
async fn dead_letter_sends_failures_to_their_queue() {
    let dead = mem_queue().await;
    let channel = Channel::new(ChannelConfig::new(8)).unwrap();
    let mut consumer = channel
        .consumer(
            options(8).codec(JsonCodec::new()).on_failure(FailurePolicy::dead_letter(dead.clone())),
        )
        .unwrap();
    let mut acks = AckSet::new();
    for n in 0..4u64 {
        acks.push(channel.emit_with_receipt(n).await.unwrap());
    }
    let batch = consumer.next_batch().await.unwrap();
    let outcomes = fail_odd(&batch);
    // One outcome short: the last record fails with "no outcome given".
    let report = batch.settle(outcomes.into_iter().take(3)).await.unwrap();
    assert_eq!((report.processed, report.dead_lettered), (2, 2));
    let envelopes = read_envelopes(&dead).await;
    let records: Vec<u64> =
        envelopes.iter().map(|e| JsonCodec::new().decode(&e.payload).unwrap()).collect();
    assert_eq!(records, [1, 3]);
    assert_eq!(envelopes[1].tags, ["error=no outcome given"]);
    let summary = acks.wait().await;
    assert_eq!((summary.processed, summary.dead_lettered), (2, 2));
    assert!(summary.may_commit());
    assert_eq!(channel.snapshot().dead_lettered, 2);
}

#[tokio::test]
async fn a_failed_output_write_fails_the_records_it_carried() {
    let storage = MemStorage::new();
    let (output, _) =
        SpillQueue::open_with(storage.clone(), SpillOptions::default()).await.unwrap();
    let channel = Channel::new(ChannelConfig::new(8)).unwrap();
    let mut consumer =
        channel.consumer(options(8).output(output.clone()).codec(BinaryCodec::new())).unwrap();
    let receipt = channel.emit_with_receipt(7u64).await.unwrap();
    output.close().await.unwrap();
    let err = consumer.next_batch().await.unwrap().ack().await.unwrap_err();
    assert!(matches!(err.error, SpillError::Closed));
    assert_eq!((err.report.processed, err.report.unwritten, err.report.failed), (0, 1, 1));
    assert_eq!(receipt.await, Settlement::Failed);
}

// ---------------------------------------------------------------- receipts

#[tokio::test]
async fn receipts_settle_for_every_outcome() {
    let spill = mem_queue().await;
    // Processed and failed.
    let channel = Channel::new(ChannelConfig::new(8)).unwrap();
    let mut consumer = channel.consumer(options(8)).unwrap();
    let ok = channel.emit_with_receipt(0u64).await.unwrap();
    let bad = channel.emit_with_receipt(1u64).await.unwrap();
    assert_eq!(ok.settlement(), None);
    let batch = consumer.next_batch().await.unwrap();
    let outcomes = fail_odd(&batch);
    batch.settle(outcomes).await.unwrap();
    assert_eq!(ok.await, Settlement::Processed);
    assert_eq!(bad.await, Settlement::Failed);

    // Dropped: newest, oldest, and in a batch dropped unsettled.
    let newest = Channel::new(ChannelConfig::new(1).overflow(Overflow::DropNewest)).unwrap();
    let _kept = newest.emit_with_receipt(1).await.unwrap();
    assert_eq!(newest.emit_with_receipt(2).await.unwrap().await, Settlement::Dropped);
    let oldest = Channel::new(ChannelConfig::new(1).overflow(Overflow::DropOldest)).unwrap();
    let first = oldest.emit_with_receipt(1).await.unwrap();
    let second = oldest.emit_with_receipt(2).await.unwrap();
    assert_eq!(first.await, Settlement::Dropped);
    let mut consumer = oldest.consumer(options(1)).unwrap();
    drop(consumer.next_batch().await.unwrap());
    assert_eq!(second.await, Settlement::Dropped);
    assert_eq!(oldest.snapshot().abandoned, 1);

    // Spilled.
    let spilling = Channel::new(
        ChannelConfig::new(1).overflow(Overflow::spill(spill.clone(), BinaryCodec::new())),
    )
    .unwrap();
    let _kept = spilling.emit_with_receipt(1u64).await.unwrap();
    assert_eq!(spilling.emit_with_receipt(2u64).await.unwrap().await, Settlement::Spilled);
}

#[tokio::test(start_paused = true)]
async fn a_receipt_times_out_and_a_late_settlement_is_ignored() {
    let channel = Channel::new(ChannelConfig::new(8).ack_timeout(Duration::from_secs(2))).unwrap();
    let mut consumer = channel.consumer(options(8)).unwrap();
    let mut acks = AckSet::new();
    let receipt = channel.emit_with_receipt(1).await.unwrap();
    acks.push(channel.emit_with_receipt(2).await.unwrap());
    let deadline = receipt.deadline();
    let start = Instant::now();
    assert_eq!(receipt.await, Settlement::TimedOut);
    assert_eq!(start.elapsed(), Duration::from_secs(2));
    assert_eq!(Instant::now(), deadline);
    assert!(acks.settled());
    assert!(!acks.may_commit(), "a timed-out record forbids the commit");

    let report = consumer.next_batch().await.unwrap().ack().await.unwrap();
    assert_eq!(report.late, 2);
    assert_eq!(acks.summary().timed_out, 1, "the late ack did not change the settlement");
    let s = channel.snapshot();
    assert_eq!((s.processed, s.late_settlements), (2, 2));
}

#[tokio::test]
async fn recv_many_settles_every_receipt_it_hands_out_as_processed() {
    // A call that takes the records itself, and hands out all it took.
    let channel = Channel::new(ChannelConfig::new(8)).unwrap();
    let mut consumer = channel.consumer(options(8)).unwrap();
    let mut receipts = Vec::new();
    for n in 0..5u32 {
        receipts.push(channel.emit_with_receipt(n).await.unwrap());
    }
    let mut got = Vec::new();
    assert_eq!(consumer.recv_many(&mut got, 8).await, 5);
    assert_eq!(got, [0, 1, 2, 3, 4]);
    for (n, receipt) in receipts.into_iter().enumerate() {
        assert_eq!(receipt.await, Settlement::Processed, "record {n}");
    }
    channel.close();
    assert_eq!(consumer.recv_many(&mut got, 8).await, 0);
    channel.drained().await;
    let s = channel.snapshot();
    assert_eq!((s.delivered, s.processed, s.late_settlements), (5, 5, 0), "{s:?}");
}

/// A read settles a record's receipt before it counts the record processed, so that whoever
/// sees every record processed (a snapshot, `drained`) sees every receipt settled: the receipt's
/// waker, run by the settle, still finds the record uncounted. For `recv` and `recv_many`.
#[tokio::test]
async fn a_read_settles_the_receipt_before_it_counts_the_record_processed() {
    struct SeeProcessed(Channel<u32>, std::sync::Mutex<Option<u64>>);
    impl std::task::Wake for SeeProcessed {
        fn wake(self: Arc<Self>) {
            *self.1.lock().unwrap() = Some(self.0.snapshot().processed);
        }
    }

    for many in [false, true] {
        let channel = Channel::new(ChannelConfig::new(2)).unwrap();
        let mut consumer = channel.consumer(options(1)).unwrap();
        let mut receipt = channel.emit_with_receipt(1u32).await.unwrap();
        let seen = Arc::new(SeeProcessed(channel.clone(), std::sync::Mutex::new(None)));
        let waker = std::task::Waker::from(seen.clone());
        let polled =
            std::pin::Pin::new(&mut receipt).poll(&mut std::task::Context::from_waker(&waker));
        assert!(polled.is_pending());
        if many {
            let mut got = Vec::new();
            assert_eq!(consumer.recv_many(&mut got, 4).await, 1);
        } else {
            assert_eq!(consumer.recv().await, Some(1));
        }
        assert_eq!(*seen.1.lock().unwrap(), Some(0), "recv_many: {many}");
        assert_eq!(receipt.settlement(), Some(Settlement::Processed));
        assert_eq!(channel.snapshot().processed, 1);
    }
}

#[tokio::test(start_paused = true)]
async fn recv_many_counts_records_whose_receipts_timed_out_as_late() {
    let channel = Channel::new(ChannelConfig::new(8).ack_timeout(Duration::from_secs(2))).unwrap();
    let mut consumer = channel.consumer(options(8)).unwrap();
    let mut receipts = Vec::new();
    for n in 0..3u32 {
        receipts.push(channel.emit_with_receipt(n).await.unwrap());
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut got = Vec::new();
    assert_eq!(consumer.recv_many(&mut got, 8).await, 3);
    for receipt in receipts {
        assert_eq!(receipt.await, Settlement::TimedOut, "a late read does not change it");
    }
    let s = channel.snapshot();
    assert_eq!((s.processed, s.late_settlements), (3, 3), "{s:?}");
}

#[tokio::test(start_paused = true)]
async fn an_ack_set_waits_for_all_and_gates_the_commit() {
    let channel = Channel::new(ChannelConfig::new(8)).unwrap();
    let mut consumer = channel.consumer(options(2)).unwrap();
    let mut acks: AckSet = AckSet::new();
    for n in 0..4 {
        acks.push(channel.emit_with_receipt(n).await.unwrap());
    }
    assert_eq!(acks.len(), 4);
    assert!(!acks.settled() && !acks.may_commit());
    consumer.next_batch().await.unwrap().ack().await.unwrap();
    let summary = acks.summary();
    assert_eq!((summary.processed, summary.pending), (2, 2));
    assert!(!summary.may_commit());
    let settle = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        consumer.next_batch().await.unwrap().ack().await.unwrap();
    });
    let summary = acks.wait().await;
    settle.await.unwrap();
    assert_eq!(summary.processed, 4);
    assert!(summary.may_commit() && acks.may_commit());
}

// ---------------------------------------------------------------- consumer limits

#[tokio::test]
async fn a_permit_per_batch_is_held_until_the_batch_settles() {
    let limits = Limits::new();
    limits.define("sink", LimitSpec::concurrent(1)).await.unwrap();
    let channel = Channel::new(ChannelConfig::new(16)).unwrap();
    let mut consumer = channel
        .consumer(options(2).limit(&limits, "sink", Priority::default(), PermitPer::Batch))
        .unwrap();
    for n in 0..4 {
        channel.emit(n).await.unwrap();
    }
    let first = consumer.next_batch().await.unwrap();
    assert_eq!(first.permits().len(), 1);
    let blocked = tokio::time::timeout(Duration::from_millis(20), consumer.next_batch()).await;
    assert!(blocked.is_err(), "the second batch waits for the permit");
    assert_eq!(channel.len(), 2, "records stay queued while the consumer waits");
    first.ack().await.unwrap();
    assert_eq!(&consumer.next_batch().await.unwrap()[..], &[2, 3]);
}

#[tokio::test]
async fn a_permit_per_record_sizes_the_batch() {
    let limits = Limits::new();
    limits.define("sink", LimitSpec::concurrent(3)).await.unwrap();
    let channel = Channel::new(ChannelConfig::new(16)).unwrap();
    let mut consumer = channel
        .consumer(options(10).limit(&limits, "sink", Priority::default(), PermitPer::Record))
        .unwrap();
    for n in 0..10 {
        channel.emit(n).await.unwrap();
    }
    let batch = consumer.next_batch().await.unwrap();
    assert_eq!((batch.len(), batch.permits().len()), (3, 3));
    drop(batch);
    let batch = consumer.next_batch().await.unwrap();
    assert_eq!(&batch[..], &[3, 4, 5]);
}

#[tokio::test(start_paused = true)]
async fn an_unknown_limit_is_counted_and_retried() {
    let limits = Limits::new();
    let channel = Channel::new(ChannelConfig::new(16)).unwrap();
    let mut consumer = channel
        .consumer(options(1).limit(&limits, "later", Priority::default(), PermitPer::Batch))
        .unwrap();
    channel.emit(1).await.unwrap();
    let pending = tokio::time::timeout(Duration::from_millis(350), consumer.next_batch()).await;
    assert!(pending.is_err());
    assert!(channel.snapshot().limit_errors >= 2);
    limits.define("later", LimitSpec::concurrent(1)).await.unwrap();
    assert_eq!(&consumer.next_batch().await.unwrap()[..], &[1]);
}

// ---------------------------------------------------------------- the registry

#[tokio::test]
async fn registry_names_are_unique_and_get_or_create_is_strict() {
    let channels = Channels::new();
    let a = channels.create::<u64>("a", ChannelConfig::new(4)).unwrap();
    assert!(matches!(
        channels.create::<u64>("a", ChannelConfig::new(4)),
        Err(ChannelError::Duplicate(_))
    ));
    assert!(matches!(
        channels.configure::<u64>("a", ChannelConfig::new(4)),
        Err(ChannelError::Duplicate(_))
    ));
    let same = channels.get_or_create::<u64>("a", ChannelConfig::new(4)).unwrap();
    same.emit(9).await.unwrap();
    assert_eq!(a.len(), 1);
    let err = channels
        .get_or_create::<u64>("a", ChannelConfig::new(4).overflow(Overflow::DropNewest))
        .unwrap_err();
    assert_eq!(err, ChannelError::ConfigMismatch { name: "a".into(), field: "overflow" });
    let err = channels.get_or_create::<u64>("a", ChannelConfig::new(4).owner("x")).unwrap_err();
    assert!(matches!(err, ChannelError::ConfigMismatch { field: "owner", .. }));
    assert!(matches!(
        channels.get_or_create::<String>("a", ChannelConfig::new(4)),
        Err(ChannelError::TypeMismatch(_))
    ));
    assert!(matches!(channels.get::<u64>("missing"), Err(ChannelError::NotFound(_))));
    assert_eq!(channels.get::<u64>("a").unwrap().len(), 1);

    // Spill policies compare by queue and codec.
    let queue = mem_queue().await;
    let spill = |codec_json: bool| {
        let overflow = if codec_json {
            Overflow::spill(queue.clone(), JsonCodec::new())
        } else {
            Overflow::spill(queue.clone(), BinaryCodec::new())
        };
        ChannelConfig::<u64>::new(4).overflow(overflow)
    };
    channels.get_or_create("s", spill(true)).unwrap();
    channels.get_or_create("s", spill(true)).unwrap();
    assert!(matches!(
        channels.get_or_create("s", spill(false)),
        Err(ChannelError::ConfigMismatch { field: "overflow", .. })
    ));

    // Closing frees the name.
    assert!(channels.close("a"));
    assert!(!channels.close("a"));
    assert!(a.is_closed());
    assert!(channels.create::<u64>("a", ChannelConfig::new(4)).unwrap().is_empty());
}

#[tokio::test]
async fn concurrent_get_or_create_yields_one_channel() {
    let channels = Channels::new();
    let mut tasks = Vec::new();
    for n in 0..8u64 {
        let channels = channels.clone();
        tasks.push(tokio::spawn(async move {
            let channel = channels.get_or_create::<u64>("shared", ChannelConfig::new(64)).unwrap();
            channel.emit(n).await.unwrap();
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(channels.names(), ["shared"]);
    assert_eq!(channels.get::<u64>("shared").unwrap().len(), 8);
}

/// Threads that ask for one new name at the same moment: a channel is built before the
/// registry's lock, so several may be built, and exactly one is named. Every `get_or_create`
/// answers that one, and exactly one `create` succeeds; the others' budget goes nowhere.
#[test]
fn racing_threads_get_one_channel_per_name() {
    const THREADS: usize = 4;
    let channels = Channels::with_budget(1_000).unwrap();
    for round in 0..200 {
        let name = format!("race-{round}");
        let start = Arc::new(std::sync::Barrier::new(THREADS));
        let threads: Vec<_> = (0..THREADS)
            .map(|n| {
                let (channels, name, start) = (channels.clone(), name.clone(), Arc::clone(&start));
                std::thread::spawn(move || {
                    start.wait();
                    if n % 2 == 0 {
                        let channel =
                            channels.get_or_create::<u64>(&name, ChannelConfig::new(64)).unwrap();
                        channel.try_emit(n as u64).unwrap();
                        Ok(())
                    } else {
                        channels.create::<u64>(&name, ChannelConfig::new(64)).map(|channel| {
                            channel.try_emit(n as u64).unwrap();
                        })
                    }
                })
            })
            .collect();
        let answers: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        let creates_ok = answers.iter().skip(1).step_by(2).filter(|a| a.is_ok()).count();
        let refused = answers.iter().filter(|a| matches!(a, Err(ChannelError::Duplicate(_))));
        assert!(creates_ok <= 1, "round {round}: {answers:?}");
        assert_eq!(creates_ok + refused.count(), THREADS / 2, "round {round}: {answers:?}");
        let emitted = THREADS / 2 + creates_ok;
        assert_eq!(channels.get::<u64>(&name).unwrap().len(), emitted, "round {round}");
    }
    assert_eq!(channels.names().len(), 200);
    assert_eq!(
        channels.budget_used(),
        Some(channels.snapshot().channels.iter().map(|c| c.depth).sum())
    );
}

#[tokio::test]
async fn closing_an_owner_cascades() {
    let channels = Channels::new();
    let a = channels.create::<u8>("s1/a", ChannelConfig::new(4).owner("s1")).unwrap();
    let b = channels.create::<u8>("s1/b", ChannelConfig::new(4).owner("s1")).unwrap();
    let other = channels.create::<u8>("s2/a", ChannelConfig::new(4).owner("s2")).unwrap();
    let mut consumer = a.consumer(options(4)).unwrap();
    a.emit(1).await.unwrap();
    assert_eq!(channels.close_owner("s1"), 2);
    assert!(a.is_closed() && b.is_closed() && !other.is_closed());
    assert_eq!(channels.names(), ["s2/a"]);
    // The owner's records drain.
    assert_eq!(&consumer.next_batch().await.unwrap()[..], &[1]);
    assert!(consumer.next_batch().await.is_none());
    assert_eq!(channels.close_owner("s1"), 0);
}

#[tokio::test]
async fn the_budget_spans_dynamic_channels_and_each_applies_its_policy() {
    let channels = Channels::with_budget(4).unwrap();
    let block = channels.create::<u32>("block", ChannelConfig::new(10)).unwrap();
    let newest = channels
        .create::<u32>("newest", ChannelConfig::new(10).overflow(Overflow::DropNewest))
        .unwrap();
    let oldest = channels
        .create::<u32>("oldest", ChannelConfig::new(10).overflow(Overflow::DropOldest))
        .unwrap();
    let configured = channels.configure::<u32>("configured", ChannelConfig::new(10)).unwrap();
    for n in 0..3 {
        block.emit(n).await.unwrap();
    }
    newest.emit(10).await.unwrap();
    assert_eq!(channels.budget_used(), Some(4));
    // Budget exhausted: each channel follows its own policy.
    assert!(block.try_emit(3).unwrap_err().is_full());
    assert!(matches!(newest.try_emit(11).unwrap(), Emitted::Dropped(11)));
    assert!(
        matches!(oldest.try_emit(20).unwrap(), Emitted::Dropped(20)),
        "nothing of its own to drop"
    );
    assert!(matches!(newest.try_emit(12).unwrap(), Emitted::Dropped(12)));
    // Configured channels are outside the budget.
    for n in 0..10 {
        configured.try_emit(n).unwrap();
    }

    // A blocked emit waits for budget freed by another channel's consumer.
    let waiting = {
        let block = block.clone();
        tokio::spawn(async move { block.emit(3).await.map(|e| e.is_queued()) })
    };
    tokio::task::yield_now().await;
    assert!(!waiting.is_finished());
    let mut consumer = newest.consumer(options(10)).unwrap();
    consumer.next_batch().await.unwrap().ack().await.unwrap();
    assert!(waiting.await.unwrap().unwrap());
    assert_eq!(channels.budget_used(), Some(4));

    // Closing a channel with discard returns its share.
    let mut consumer = block.consumer(options(10)).unwrap();
    assert_eq!(consumer.next_batch().await.unwrap().len(), 4);
    assert_eq!(channels.budget_used(), Some(0));
    let snapshot = channels.snapshot();
    assert_eq!(snapshot.budget.unwrap().total, 4);
    assert!(snapshot.channels.iter().all(|c| c.reconciles()));
    assert!(snapshot.channels.iter().find(|c| c.name == "configured").is_some_and(|c| !c.dynamic));
}

#[tokio::test]
async fn channels_report_into_the_registry() {
    let registry = Registry::new();
    let channels =
        Channels::builder().total_budget(100).registry(&registry, "pipeline").build().unwrap();
    let events = channels.create::<u32>("events", ChannelConfig::default().owner("job-1")).unwrap();
    events.emit(1).await.unwrap();
    let solo = Channel::<u8>::new(ChannelConfig::new(2).registry(&registry, "solo")).unwrap();
    assert_eq!(solo.name(), "solo", "the registry name names the channel");

    let snapshot = registry.snapshot();
    let pipeline = &snapshot.channels("pipeline").unwrap();
    let events = &pipeline.channels[0];
    assert_eq!((events.name.as_str(), events.owner.as_deref()), ("events", Some("job-1")));
    assert_eq!((events.capacity, events.depth, events.emitted), (512, 1, 1));
    assert!(events.dynamic);
    assert_eq!(pipeline.budget.unwrap().used, 1);
    assert_eq!(snapshot.channels("solo").unwrap().channels[0].name, "solo");
    let json = snapshot.to_json();
    assert!(json.contains("\"blocked_waits\":0") && json.contains("\"oldest_age_ms\""), "{json}");
    let back: lanes::Snapshot = serde_json::from_str(&json).unwrap();
    assert_eq!(back, snapshot);
}

#[tokio::test(start_paused = true)]
async fn the_snapshot_reports_the_age_of_the_oldest_record() {
    let channel = Channel::new(ChannelConfig::new(256)).unwrap();
    let mut consumer = channel.consumer(options(1)).unwrap();
    let mut next = async || consumer.next_batch().await.unwrap()[0];
    assert_eq!(channel.snapshot().oldest_age_ms, 0);
    channel.emit(0).await.unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    for n in 1..200 {
        channel.emit(n).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(channel.snapshot().oldest_age_ms, 1000);
    // Ages are sampled every 128 records: the age is that of the nearest sample at or before
    // the head, never younger than the truth.
    assert_eq!(next().await, 0);
    assert_eq!(channel.snapshot().oldest_age_ms, 1000);
    for n in 1..128 {
        assert_eq!(next().await, n);
    }
    assert_eq!(channel.snapshot().oldest_age_ms, 300);
    while !channel.is_empty() {
        next().await;
    }
    assert_eq!(channel.snapshot().oldest_age_ms, 0);
}

// ---------------------------------------------------------------- stress and end to end

/// One step of a xorshift generator: the stress tests' cheap, seeded randomness.
fn xorshift(seed: &mut u64) {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
}

/// A record of the stress tests, made from and known by its id: a `u64`, or a [`Wide`] one.
trait Rec: Send + Sync + std::fmt::Debug + 'static {
    fn of(id: u64) -> Self;
    fn id(&self) -> u64;
}

impl Rec for u64 {
    fn of(id: u64) -> Self {
        id
    }
    fn id(&self) -> u64 {
        *self
    }
}

/// A 256-byte record: large enough that a channel keeps its records in blocks.
#[derive(Debug, Clone, PartialEq)]
struct Wide([u64; 32]);

impl Rec for Wide {
    fn of(id: u64) -> Self {
        Wide([id; 32])
    }
    fn id(&self) -> u64 {
        assert!(self.0.iter().all(|&word| word == self.0[0]), "a record arrives whole");
        self.0[0]
    }
}

/// Checks `rounds` snapshots of `channel`, yielding between them, while the others run: the
/// counters reconcile and the depth stays within `capacity` in each.
fn watch_reconciling<R: Rec>(
    channel: &Channel<R>,
    capacity: usize,
    rounds: usize,
) -> tokio::task::JoinHandle<()> {
    let channel = channel.clone();
    tokio::spawn(async move {
        for _ in 0..rounds {
            let s = channel.snapshot();
            assert!(s.reconciles(), "{s:?}");
            assert!(s.depth <= capacity, "{s:?}");
            tokio::task::yield_now().await;
        }
    })
}

/// A producer of records `first..first + count` into `channel`, seeded: each record is offered
/// without waiting, by an emit polled once and dropped if it must wait (cancel safe: then it
/// is not enqueued), or by an emit that waits. Returns the records handed back (refused, or
/// dropped by the overflow policy).
fn random_producer<R: Rec>(
    channel: Channel<R>,
    first: u64,
    count: u64,
    mut seed: u64,
) -> tokio::task::JoinHandle<Vec<u64>> {
    tokio::spawn(async move {
        let mut turned_away = Vec::new();
        for id in first..first + count {
            let record = R::of(id);
            xorshift(&mut seed);
            let result = match seed % 4 {
                0 => channel.try_emit(record),
                1 => match tokio::time::timeout(Duration::ZERO, channel.emit(record)).await {
                    Ok(result) => result,
                    // The emit was dropped before it queued the record: handed back unsent.
                    Err(_) => Err(EmitError::Full(R::of(id))),
                },
                _ => channel.emit(record).await,
            };
            match result {
                Ok(Emitted::Queued) => {}
                Ok(Emitted::Dropped(r) | Emitted::DroppedOldest(r)) => turned_away.push(r.id()),
                Err(EmitError::Full(r)) => turned_away.push(r.id()),
                other => panic!("{other:?}"),
            }
            if seed.is_multiple_of(8) {
                tokio::task::yield_now().await;
            }
        }
        turned_away
    })
}

/// Closes `channel` and waits (bounded) for its reader to drain it; checks that the counters
/// reconcile and that every record delivered was read and counted processed.
async fn close_and_read<R: Rec>(
    channel: &Channel<R>,
    reader: tokio::task::JoinHandle<Vec<u64>>,
) -> (Vec<u64>, lanes::channel::ChannelSnapshot) {
    channel.close();
    let read = tokio::time::timeout(Duration::from_secs(60), reader)
        .await
        .expect("the consumer ends once the channel is closed and drained")
        .unwrap();
    let s = channel.snapshot();
    assert!(s.reconciles(), "{s:?}");
    assert_eq!(s.delivered, read.len() as u64, "{s:?}");
    assert_eq!(s.processed, s.delivered, "{s:?}");
    (read, s)
}

/// A consumer that switches at random (seeded) between `recv`, `recv_many` and `next_batch`
/// until the channel is closed and drained; returns what it read, in order.
fn random_reader<R: Rec>(
    mut consumer: lanes::channel::Consumer<R>,
    mut seed: u64,
) -> tokio::task::JoinHandle<Vec<u64>> {
    tokio::spawn(async move {
        let (mut delivered, mut buffer) = (Vec::new(), Vec::new());
        loop {
            xorshift(&mut seed);
            match seed % 3 {
                0 => match consumer.recv().await {
                    Some(r) => delivered.push(r.id()),
                    None => break,
                },
                1 => {
                    buffer.clear();
                    if consumer.recv_many(&mut buffer, 1 + (seed % 5) as usize).await == 0 {
                        break;
                    }
                    delivered.extend(buffer.iter().map(Rec::id));
                }
                _ => match consumer.next_batch().await {
                    Some(batch) => {
                        delivered.extend(batch.iter().map(Rec::id));
                        batch.ack().await.unwrap();
                    }
                    None => break,
                },
            }
        }
        delivered
    })
}

/// Reads that wait are handed records (suite 3's fast path at small capacities): with
/// producers that block, give up (an emit dropped after one poll) or do not wait, and a
/// consumer that switches between `recv`, `recv_many` and `next_batch`, every record is
/// delivered once or handed back, in each producer's order, and the counters reconcile with
/// the depth within the capacity throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reads_handed_records_lose_nothing_and_keep_order_under_random_stress() {
    const PRODUCERS: u64 = 4;
    const EACH: u64 = 5_000;
    for capacity in [1usize, 2, 16] {
        let channel = Channel::<u64>::new(ChannelConfig::new(capacity)).unwrap();
        let consumer = channel.consumer(options(3)).unwrap();
        let producers: Vec<_> = (0..PRODUCERS)
            .map(|p| random_producer(channel.clone(), p * EACH, EACH, p + 11))
            .collect();
        let watcher = watch_reconciling(&channel, capacity, 500);
        let consumer_task = random_reader(consumer, 7);
        let mut turned_away = Vec::new();
        for producer in producers {
            turned_away.extend(producer.await.unwrap());
        }
        watcher.await.unwrap();
        let (delivered, s) = close_and_read(&channel, consumer_task).await;
        assert_eq!(s.dropped, 0, "capacity {capacity}: {s:?}");
        check_delivery(delivered, turned_away, PRODUCERS, EACH, &format!("capacity {capacity}"));
    }
}

/// What `producers` producers of `each` records (producer p's are `p * each..`) sent came out
/// right: `delivered` keeps each producer's order, and with `turned_away` (refused or dropped)
/// holds every record exactly once.
fn check_delivery(
    delivered: Vec<u64>,
    turned_away: Vec<u64>,
    producers: u64,
    each: u64,
    what: &str,
) {
    let mut last = vec![None::<u64>; producers as usize];
    for &r in &delivered {
        let p = (r / each) as usize;
        assert!(last[p].is_none_or(|l| l < r), "{what}: per-producer FIFO");
        last[p] = Some(r);
    }
    let mut all: Vec<u64> = delivered.into_iter().chain(turned_away).collect();
    all.sort_unstable();
    assert_eq!(
        all,
        (0..producers * each).collect::<Vec<_>>(),
        "{what}: each record delivered once or handed back, none lost"
    );
}

/// Large records sit in blocks of 64, and a plain read takes a block whole: with capacities
/// below, at and across a block, producers that block, give up or do not wait, `Block` and
/// `DropOldest`, and a consumer that switches between `recv`, `recv_many` and `next_batch`,
/// every record arrives whole and is delivered once or handed back, in each producer's order,
/// and the counters reconcile with the depth within the capacity throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn large_records_lose_nothing_and_keep_order_under_random_stress() {
    const PRODUCERS: u64 = 4;
    const EACH: u64 = 3_000;
    for (capacity, overflow) in [
        (1usize, Overflow::Block),
        (63, Overflow::Block),
        (64, Overflow::DropOldest),
        (65, Overflow::Block),
        (300, Overflow::Block),
        (300, Overflow::DropOldest),
    ] {
        let kind = overflow.kind();
        let channel =
            Channel::<Wide>::new(ChannelConfig::new(capacity).overflow(overflow)).unwrap();
        let consumer = channel.consumer(options(70)).unwrap();
        let producers: Vec<_> = (0..PRODUCERS)
            .map(|p| random_producer(channel.clone(), p * EACH, EACH, p + 5))
            .collect();
        let watcher = watch_reconciling(&channel, capacity, 300);
        let consumer_task = random_reader(consumer, capacity as u64);
        let mut turned_away = Vec::new();
        for producer in producers {
            turned_away.extend(producer.await.unwrap());
        }
        watcher.await.unwrap();
        let (delivered, s) = close_and_read(&channel, consumer_task).await;
        if kind == lanes::channel::OverflowKind::Block {
            assert_eq!(s.dropped, 0, "{capacity}: {s:?}");
        }
        check_delivery(delivered, turned_away, PRODUCERS, EACH, &format!("{capacity} {kind:?}"));
    }
}

/// More threads than cores (on hosts of up to 8) on one channel's lock (a spin lock, waited
/// for by spinning, then yielding): eight OS threads, each with a runtime of its own, emit
/// into a small `Block` channel, two of them with `try_emit` retried on `Full`, while the
/// consumer reads on this thread. Nothing is lost or duplicated, each producer's order holds,
/// and the counters reconcile.
#[tokio::test]
async fn more_producer_threads_than_cores_lose_nothing_on_the_channel_lock() {
    const PRODUCERS: u64 = 8;
    const EACH: u64 = 5_000;
    let channel = Channel::<u64>::new(ChannelConfig::new(8)).unwrap();
    let mut consumer = channel.consumer(options(8)).unwrap();
    let threads: Vec<_> = (0..PRODUCERS)
        .map(|p| {
            let channel = channel.clone();
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_time().build();
                rt.unwrap().block_on(async move {
                    for r in p * EACH..(p + 1) * EACH {
                        if p < 2 {
                            let mut record = r;
                            loop {
                                match channel.try_emit(record) {
                                    Ok(Emitted::Queued) => break,
                                    Err(EmitError::Full(back)) => {
                                        record = back;
                                        std::thread::yield_now();
                                    }
                                    other => panic!("{other:?}"),
                                }
                            }
                        } else {
                            channel.emit(r).await.unwrap();
                        }
                    }
                });
            })
        })
        .collect();
    // A lost record would leave the read waiting: bounded, so that it fails instead.
    let delivered = tokio::time::timeout(Duration::from_secs(120), async {
        let mut delivered = Vec::new();
        while (delivered.len() as u64) < PRODUCERS * EACH {
            delivered.push(consumer.recv().await.expect("open until every record came"));
        }
        delivered
    })
    .await
    .expect("every record arrives");
    threads.into_iter().for_each(|t| t.join().unwrap());
    let s = channel.snapshot();
    assert!(s.reconciles(), "{s:?}");
    assert_eq!(
        (s.emitted, s.delivered, s.dropped, s.depth),
        (PRODUCERS * EACH, PRODUCERS * EACH, 0, 0)
    );
    check_delivery(delivered, Vec::new(), PRODUCERS, EACH, "eight producer threads");
}

/// Dynamic channels sharing a registry's budget, their reads handed records, on four
/// threads: producers that block, give up or do not wait, under `Block` and `DropOldest`;
/// consumers that switch between `recv`, `recv_many` and `next_batch`. Every record is
/// delivered once or handed back, in its producer's order, and every budget unit comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn channels_sharing_a_budget_hand_records_to_reads_and_return_every_unit() {
    share_a_budget::<u64>(3, |c| 1 + c as usize % 2).await;
}

/// The same with large records in channels of several blocks: a read-ahead that takes fewer
/// records than it asked for (the rest of a block that lost its oldest record) returns a
/// budget unit for each record it took, no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn channels_of_large_records_sharing_a_budget_return_every_unit() {
    share_a_budget::<Wide>(200, |c| 70 + 60 * (c as usize % 2)).await;
}

/// Large records sit in blocks of 64, and a plain read takes the rest of the front block: after
/// the oldest record was dropped, the first read takes 63 records, in order, and returns a
/// budget unit for each of them, no more.
#[tokio::test]
async fn a_read_of_large_records_returns_a_budget_unit_for_each_record_it_took() {
    let channels = Channels::with_budget(1_000).unwrap();
    let config = ChannelConfig::new(130).overflow(Overflow::DropOldest);
    let channel = channels.create::<Wide>("wide", config).unwrap();
    let mut consumer = channel.consumer(options(8)).unwrap();
    for id in 0..130 {
        assert!(matches!(channel.try_emit(Wide::of(id)), Ok(Emitted::Queued)));
    }
    match channel.try_emit(Wide::of(130)) {
        Ok(Emitted::DroppedOldest(oldest)) => assert_eq!(oldest.id(), 0),
        other => panic!("{other:?}"),
    }
    assert_eq!(channels.budget_used(), Some(130));
    assert_eq!(consumer.recv().await.map(|r| r.id()), Some(1));
    assert_eq!(channels.budget_used(), Some(130 - 63), "the rest of the front block, read ahead");
    for id in 2..131 {
        assert_eq!(consumer.recv().await.map(|r| r.id()), Some(id));
    }
    assert_eq!(channels.budget_used(), Some(0));
    let s = channel.snapshot();
    assert!(s.reconciles(), "{s:?}");
    assert_eq!((s.delivered, s.dropped, s.depth), (130, 1, 0));
}

/// A read of large records under a per-record rate limit asks for permits only for what one
/// take finds (the rest of a front block that lost its oldest record): no token is spent on a
/// record it did not take.
#[tokio::test(start_paused = true)]
async fn a_limited_read_of_large_records_spends_a_token_per_record_it_took() {
    let limits = Limits::new();
    limits.define("sink", LimitSpec::rate(0.001).burst(64)).await.unwrap();
    let config = ChannelConfig::new(130).overflow(Overflow::DropOldest);
    let channel = Channel::<Wide>::new(config).unwrap();
    let limit = options(8).limit(&limits, "sink", Priority::default(), PermitPer::Record);
    let mut consumer = channel.consumer(limit).unwrap();
    for id in 0..=130 {
        // The last one drops record 0.
        channel.try_emit(Wide::of(id)).unwrap();
    }
    let mut read = Vec::new();
    assert_eq!(consumer.recv_many(&mut read, 100).await, 63);
    assert_eq!(read.iter().map(Rec::id).collect::<Vec<_>>(), (1..64).collect::<Vec<_>>());
    assert!(limits.try_acquire("sink", Priority::default()).await.is_ok(), "one token is left");
    assert!(limits.try_acquire("sink", Priority::default()).await.is_err());
}

/// Four channels of `capacity(c)` sharing a budget of `budget` units, a producer and a
/// random reader each.
async fn share_a_budget<R: Rec>(budget: usize, capacity: impl Fn(u64) -> usize) {
    const CHANNELS: u64 = 4;
    const EACH: u64 = 3_000;
    let channels = Channels::with_budget(budget).unwrap();
    let mut runs = Vec::new();
    for c in 0..CHANNELS {
        let overflow = if c % 2 == 0 { Overflow::Block } else { Overflow::DropOldest };
        let config = ChannelConfig::new(capacity(c)).overflow(overflow);
        let channel = channels.create::<R>(&format!("c{c}"), config).unwrap();
        let reader = random_reader(channel.consumer(options(3)).unwrap(), c + 17);
        let producer = random_producer(channel.clone(), c * EACH, EACH, c + 3);
        runs.push((channel, producer, reader));
    }
    let mut turned_away = Vec::new();
    let mut readers = Vec::new();
    for (channel, producer, reader) in runs {
        turned_away.extend(producer.await.unwrap());
        readers.push((channel, reader));
    }
    let mut delivered = Vec::new();
    for (channel, reader) in readers {
        let (got, s) = close_and_read(&channel, reader).await;
        let mut last = None;
        for &r in &got {
            assert!(last.is_none_or(|l| l < r), "{}: FIFO", s.name);
            last = Some(r);
        }
        delivered.extend(got);
    }
    assert_eq!(channels.budget_used(), Some(0), "every unit came back");
    let mut all: Vec<u64> = delivered.into_iter().chain(turned_away).collect();
    all.sort_unstable();
    assert_eq!(all, (0..CHANNELS * EACH).collect::<Vec<_>>(), "each record once, none lost");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn counters_reconcile_under_random_stress() {
    const PRODUCERS: u64 = 4;
    const EACH: u64 = 5_000;
    for overflow in [Overflow::Block, Overflow::DropNewest, Overflow::DropOldest] {
        let kind = overflow.kind();
        let channel = Channel::new(ChannelConfig::new(16).overflow(overflow)).unwrap();
        let mut consumer =
            channel.consumer(options(7).batch_flush(Duration::from_micros(200))).unwrap();
        let mut producers = Vec::new();
        for p in 0..PRODUCERS {
            let channel = channel.clone();
            producers.push(tokio::spawn(async move {
                let mut dropped = Vec::new();
                let mut seed = p + 1;
                for i in 0..EACH {
                    let record = p * EACH + i;
                    xorshift(&mut seed);
                    let result = if seed % 3 == 0 {
                        channel.try_emit(record)
                    } else {
                        channel.emit(record).await
                    };
                    match result {
                        Ok(Emitted::Queued) => {}
                        Ok(Emitted::Dropped(r) | Emitted::DroppedOldest(r)) => dropped.push(r),
                        Ok(Emitted::Spilled) => unreachable!(),
                        Err(EmitError::Full(r)) => dropped.push(r),
                        Err(e) => panic!("{e}"),
                    }
                    if seed % 16 == 0 {
                        tokio::task::yield_now().await;
                    }
                }
                dropped
            }));
        }
        let watcher = watch_reconciling(&channel, 16, 200);
        drop(channel.clone());
        let consumer_task = tokio::spawn(async move {
            let mut delivered = Vec::new();
            let mut last = [None::<u64>; PRODUCERS as usize];
            while let Some(batch) = consumer.next_batch().await {
                for &r in batch.iter() {
                    let p = (r / EACH) as usize;
                    assert!(last[p].is_none_or(|l| l < r), "per-producer FIFO");
                    last[p] = Some(r);
                }
                delivered.extend_from_slice(&batch);
                batch.ack().await.unwrap();
            }
            delivered
        });
        let mut turned_away = Vec::new();
        for producer in producers {
            turned_away.extend(producer.await.unwrap());
        }
        watcher.await.unwrap();
        let snapshot_before_close = channel.snapshot();
        assert!(snapshot_before_close.reconciles());
        channel.close();
        let delivered = consumer_task.await.unwrap();
        let s = channel.snapshot();
        assert!(s.reconciles(), "{kind:?}: {s:?}");
        assert_eq!(s.delivered, delivered.len() as u64);
        assert_eq!(s.processed, s.delivered);
        let unique: HashSet<u64> = delivered.iter().copied().collect();
        assert_eq!(unique.len(), delivered.len(), "{kind:?}: nothing delivered twice");
        let mut all: Vec<u64> = delivered.into_iter().chain(turned_away).collect();
        all.sort_unstable();
        assert_eq!(all, (0..PRODUCERS * EACH).collect::<Vec<_>>(), "{kind:?}: nothing lost");
        if kind == lanes::channel::OverflowKind::Block {
            assert_eq!(s.dropped, 0);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_reads_on_two_threads_get_every_record_once_in_order_and_never_stall() {
    // A reading consumer that empties the channel waits for the next record without the lock;
    // producers on the other thread queue into it the moment it looks. Nothing may be missed.
    const PRODUCERS: u64 = 4;
    const EACH: u64 = 20_000;
    for capacity in [1, 4, 64] {
        let channel = Channel::new(ChannelConfig::new(capacity)).unwrap();
        let mut consumer = channel.consumer(options(8)).unwrap();
        for p in 0..PRODUCERS {
            let channel = channel.clone();
            tokio::spawn(async move {
                for i in 0..EACH {
                    channel.emit(p * EACH + i).await.unwrap();
                    if i % 97 == p {
                        tokio::task::yield_now().await;
                    }
                }
            });
        }
        drop(channel);
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut buffer = Vec::new();
            let mut seed = capacity as u64 + 1;
            loop {
                xorshift(&mut seed);
                if seed.is_multiple_of(2) {
                    match consumer.recv().await {
                        Some(record) => got.push(record),
                        None => break,
                    }
                } else {
                    buffer.clear();
                    if consumer.recv_many(&mut buffer, 1 + (seed % 5) as usize).await == 0 {
                        break;
                    }
                    got.extend_from_slice(&buffer);
                }
            }
            got
        });
        let got = tokio::time::timeout(Duration::from_secs(60), reader)
            .await
            .expect("the reader never stalls")
            .unwrap();
        let mut last = [None::<u64>; PRODUCERS as usize];
        for &r in &got {
            let p = (r / EACH) as usize;
            assert!(last[p].is_none_or(|l| l < r), "capacity {capacity}: per-producer FIFO");
            last[p] = Some(r);
        }
        let mut all = got;
        all.sort_unstable();
        assert_eq!(all, (0..PRODUCERS * EACH).collect::<Vec<_>>(), "capacity {capacity}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spilled_records_are_all_readable_exactly_once() {
    let queue = mem_queue().await;
    let channel = Channel::new(
        ChannelConfig::new(32).overflow(Overflow::spill(queue.clone(), BinaryCodec::new())),
    )
    .unwrap();
    let mut consumer = channel.consumer(options(8)).unwrap();
    let slow = tokio::spawn(async move {
        let mut got = Vec::new();
        while let Some(batch) = consumer.next_batch().await {
            got.extend_from_slice(&batch);
            batch.ack().await.unwrap();
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        got
    });
    let mut tasks = Vec::new();
    for p in 0..3u64 {
        let channel = channel.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..3_000u64 {
                channel.emit(p * 10_000 + i).await.unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    channel.close();
    let delivered = slow.await.unwrap();
    let spilled: Vec<u64> = read_records(&queue).await;
    let s = channel.snapshot();
    assert!(s.spilled > 0, "the overload spilled");
    assert_eq!(s.spilled as usize, spilled.len());
    assert_eq!(s.delivered as usize, delivered.len());
    let mut all: Vec<u64> = delivered.into_iter().chain(spilled).collect();
    all.sort_unstable();
    let expected: Vec<u64> =
        (0..3u64).flat_map(|p| (0..3_000u64).map(move |i| p * 10_000 + i)).collect();
    assert_eq!(all, expected, "every record exactly once, on one path");
}

#[tokio::test]
async fn recv_settles_receipts_as_processed() {
    let channel = Channel::new(ChannelConfig::new(4)).unwrap();
    let mut consumer = channel.consumer(options(4)).unwrap();
    let receipt = channel.emit_with_receipt(Arc::new(5)).await.unwrap();
    assert_eq!(*consumer.recv().await.unwrap(), 5);
    assert_eq!(receipt.await, Settlement::Processed);
}

#[tokio::test]
async fn records_recv_took_ahead_keep_their_order_and_count_as_abandoned_if_dropped() {
    let channel = Channel::new(ChannelConfig::new(256)).unwrap();
    let mut consumer = channel.consumer(options(3)).unwrap();
    let mut receipts = Vec::new();
    for n in 0..10u32 {
        receipts.push(channel.emit_with_receipt(n).await.unwrap());
    }
    assert_eq!(consumer.recv().await, Some(0));
    // Mixed with batches, order is kept.
    assert_eq!(&consumer.next_batch().await.unwrap()[..], &[1, 2, 3]);
    let mut got = Vec::new();
    assert_eq!(consumer.recv_many(&mut got, 2).await, 2);
    assert_eq!(got, [4, 5]);
    assert_eq!(consumer.recv().await, Some(6));
    let s = channel.snapshot();
    assert!(s.reconciles());
    assert_eq!(s.processed, 4, "0, 4, 5, 6 were handed out; the batch was dropped unsettled");
    assert_eq!(s.abandoned, 3);
    drop(consumer);
    let s = channel.snapshot();
    assert_eq!(s.delivered, s.processed + s.failed + s.abandoned, "{s:?}");
    assert_eq!((s.delivered, s.abandoned), (10, 6));
    for (n, receipt) in receipts.into_iter().enumerate() {
        let expected =
            if [0, 4, 5, 6].contains(&n) { Settlement::Processed } else { Settlement::Dropped };
        assert_eq!(receipt.await, expected, "record {n}");
    }
}

/// One step of [`receipts_follow_their_records`]'s consumer and producer.
#[derive(Debug, Clone)]
enum ReceiptStep {
    /// Emits the next record, with a receipt or without.
    Emit(bool),
    /// One poll of `recv` (a read that finds nothing waits, and is handed the next record).
    Recv,
    /// One poll of `recv_many` of up to this many.
    RecvMany(usize),
    /// One poll of `next_batch`; the batch is acked (0), failed (1), dropped (2), or settled
    /// record by record, the records of odd ids failed (3).
    Batch(u8),
}

fn receipt_step() -> impl proptest::strategy::Strategy<Value = ReceiptStep> {
    use proptest::prelude::*;
    prop_oneof![
        8 => any::<bool>().prop_map(ReceiptStep::Emit),
        4 => Just(ReceiptStep::Recv),
        1 => (1usize..40).prop_map(ReceiptStep::RecvMany),
        3 => (0u8..4).prop_map(ReceiptStep::Batch),
    ]
}

/// Polls `future` once: its output if it is ready (a read that is not waits, registered, and
/// is dropped; so is an emit that waits for room: every read and emit is cancel safe).
fn poll_once<F: std::future::Future>(future: F) -> Option<F::Output> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match std::pin::pin!(future).poll(&mut cx) {
        std::task::Poll::Ready(out) => Some(out),
        std::task::Poll::Pending => None,
    }
}

/// Runs `steps` through a channel of `capacity` under `DropOldest` or `Block`
/// and checks that every receipt settled as its own record ended, as the consumer saw it:
/// processed if a read handed it out or its batch settled it processed, failed if its batch
/// failed it, dropped if its batch was dropped or the consumer never saw it (dropped as the
/// oldest, or abandoned or dropped by the consumer's drop at the end). The channel keeps
/// receipts apart from the records, by position, so a receipt that slipped by one record
/// would settle another record's way. An emit that finds a `Block` channel full is dropped
/// (it emitted nothing, and has no receipt).
fn check_receipts<R: Rec>(
    capacity: usize,
    drop_oldest: bool,
    batch_max: usize,
    steps: &[ReceiptStep],
    drop_consumer: bool,
) {
    let overflow = if drop_oldest { Overflow::DropOldest } else { Overflow::Block };
    let channel = Channel::<R>::new(ChannelConfig::new(capacity).overflow(overflow)).unwrap();
    let options = ConsumerOptions::new().batch_max(batch_max).batch_flush(Duration::ZERO);
    let mut consumer = channel.consumer(options).unwrap();
    let (mut receipts, mut seen) = (Vec::new(), std::collections::HashMap::new());
    let mut see = |id: u64, settlement: Settlement| {
        assert!(seen.insert(id, settlement).is_none(), "record {id} seen twice");
    };
    let (mut next, mut emitted) = (0u64, 0u64);
    for step in steps {
        match *step {
            ReceiptStep::Emit(with_receipt) => {
                let record = R::of(next);
                let done = if with_receipt {
                    poll_once(channel.emit_with_receipt(record)).map(|receipt| {
                        receipts.push((next, receipt.unwrap()));
                    })
                } else {
                    poll_once(channel.emit(record)).map(|emitted| {
                        emitted.unwrap();
                    })
                };
                emitted += u64::from(done.is_some());
                next += 1;
            }
            ReceiptStep::Recv => {
                if let Some(Some(record)) = poll_once(consumer.recv()) {
                    see(record.id(), Settlement::Processed);
                }
            }
            ReceiptStep::RecvMany(limit) => {
                let mut out = Vec::new();
                if poll_once(consumer.recv_many(&mut out, limit)).is_some() {
                    for record in &out {
                        see(record.id(), Settlement::Processed);
                    }
                }
            }
            ReceiptStep::Batch(how) => {
                let Some(Some(batch)) = poll_once(consumer.next_batch()) else { continue };
                let ids: Vec<u64> = batch.iter().map(Rec::id).collect();
                let settlement = |id: u64| match how {
                    0 => Settlement::Processed,
                    1 => Settlement::Failed,
                    2 => Settlement::Dropped,
                    _ if id % 2 == 1 => Settlement::Failed,
                    _ => Settlement::Processed,
                };
                let failed = match how {
                    0 => poll_once(batch.ack()).unwrap().unwrap().failed,
                    1 => poll_once(batch.fail_all("no")).unwrap().unwrap().failed,
                    2 => {
                        drop(batch);
                        0
                    }
                    _ => {
                        let outcomes: Vec<Result<(), lanes::BoxError>> = ids
                            .iter()
                            .map(|&id| if id % 2 == 1 { Err("odd".into()) } else { Ok(()) })
                            .collect();
                        poll_once(batch.settle(outcomes)).unwrap().unwrap().failed
                    }
                };
                let want = ids.iter().filter(|&&id| settlement(id) == Settlement::Failed).count();
                assert_eq!(failed, want);
                for id in ids {
                    see(id, settlement(id));
                }
            }
        }
    }
    if drop_consumer {
        // What it holds read ahead, or was handed, is abandoned; what is queued is dropped.
        drop(consumer);
    } else {
        channel.close();
        while let Some(Some(record)) = poll_once(consumer.recv()) {
            see(record.id(), Settlement::Processed);
        }
    }
    for (id, receipt) in &receipts {
        let expected = seen.get(id).copied().unwrap_or(Settlement::Dropped);
        assert_eq!(receipt.settlement(), Some(expected), "record {id}'s receipt");
    }
    let snapshot = channel.snapshot();
    assert_eq!(snapshot.emitted, emitted);
    assert_eq!(snapshot.emitted, snapshot.delivered + snapshot.dropped + snapshot.depth as u64);
}

proptest::proptest! {
    /// Records with and without receipts, mixed at random, through every way a consumer
    /// reads (a read-ahead, a read handed the next record, `recv_many`, batches acked, failed,
    /// dropped and settled record by record, and a batch's rest put back), every way a record
    /// is dropped (as the oldest, by the consumer's drop), with emits that wait for room and
    /// are dropped, for small records and large ones: each receipt settles as its own record
    /// ended.
    #[test]
    fn receipts_follow_their_records(
        capacity in proptest::prop_oneof![1usize..4, 60usize..70, 120usize..140],
        drop_oldest in proptest::prelude::any::<bool>(),
        batch_max in 1usize..80,
        steps in proptest::collection::vec(receipt_step(), 1..400),
        drop_consumer in proptest::prelude::any::<bool>(),
        wide in proptest::prelude::any::<bool>(),
    ) {
        if wide {
            check_receipts::<Wide>(capacity, drop_oldest, batch_max, &steps, drop_consumer);
        } else {
            check_receipts::<u64>(capacity, drop_oldest, batch_max, &steps, drop_consumer);
        }
    }
}

/// Review finding (stop 74): an ack timeout past the clock's range panicked on every emit with
/// a receipt (`Instant + Duration` overflowed); it is as good as never.
#[tokio::test(start_paused = true)]
async fn an_ack_timeout_past_the_clocks_range_never_times_out() {
    let config = ChannelConfig::new(4).ack_timeout(Duration::MAX);
    let channel = Channel::new(config).unwrap();
    let receipt = channel.emit_with_receipt(1u32).await.expect("emitted");
    assert!(
        receipt.deadline() > tokio::time::Instant::now() + Duration::from_secs(10 * 365 * 86_400)
    );
}

/// Review finding (stop 74): a channel closed (or never read) before a consumer was taken,
/// whose handles then all went, took its queued records with it unrecorded: not counted
/// dropped, their receipts timing out rather than settling dropped, and their part of the
/// shared budget never given back (every later channel then short of it for good).
#[tokio::test(start_paused = true)]
async fn a_channel_gone_with_queued_records_drops_them_and_gives_its_budget_back() {
    let channels = Channels::with_budget(4).unwrap();
    let owned = channels.create::<u32>("a", ChannelConfig::new(4).owner("s")).unwrap();
    let receipt = owned.emit_with_receipt(0).await.unwrap();
    for n in 1..4 {
        owned.try_emit(n).unwrap();
    }
    assert_eq!(channels.budget_used(), Some(4));
    assert_eq!(channels.close_owner("s"), 1);
    drop(owned);
    assert_eq!(channels.budget_used(), Some(0), "the budget is given back");
    assert_eq!(receipt.await, Settlement::Dropped);
    let next = channels.create::<u32>("b", ChannelConfig::new(4)).unwrap();
    assert!(next.try_emit(1).is_ok(), "a later channel has the budget");
}

/// Review finding (stop 74): a record refused because the spill queue was at its `max_bytes`
/// said it was not full (`is_full` knew only the buffer's refusal).
#[tokio::test]
async fn a_full_spill_queue_is_a_full_channel() {
    let options = SpillOptions::default().max_record(64).max_bytes(256).segment_size(4096);
    let queue = SpillQueue::open_with(MemStorage::new(), options).await.unwrap().0;
    let channel = Channel::new(
        ChannelConfig::new(1).overflow(Overflow::spill(queue.clone(), BinaryCodec::new())),
    )
    .unwrap();
    let mut refused = None;
    for n in 0..100u64 {
        if let Err(err) = channel.emit(n).await {
            refused = Some(err);
            break;
        }
    }
    let err = refused.expect("the spill queue fills");
    assert!(matches!(err, EmitError::Spill(_, SpillError::Full { .. })), "{err:?}");
    assert!(err.is_full(), "{err:?}");
}

/// Review finding (stop 79): `recv_many` with a limit of `usize::MAX` ("everything there is")
/// added one for a record handed to the waiting read, which overflowed: a panic in a debug
/// build; in a release build a limit of 0, so the read answered 0 ("closed") on an open channel
/// and the handed record was never read.
#[tokio::test(start_paused = true)]
async fn recv_many_with_an_unbounded_limit_gets_the_record_handed_to_it() {
    let channel = Channel::new(ChannelConfig::new(8)).unwrap();
    let mut consumer = channel.consumer(ConsumerOptions::new()).unwrap();
    let producer = channel.clone();
    let emit = tokio::spawn(async move {
        // The read waits first: the record is handed to it.
        tokio::task::yield_now().await;
        producer.emit(7u64).await.unwrap();
    });
    let mut buffer = Vec::new();
    let n = consumer.recv_many(&mut buffer, usize::MAX).await;
    assert_eq!((n, buffer), (1, vec![7]));
    emit.await.unwrap();
    assert!(channel.snapshot().reconciles());
}

/// Review finding (stop 79): a linger past the clock's range (`Duration::MAX`, "full batches
/// only") panicked in the consumer as soon as a partial batch was queued (`Instant + Duration`
/// overflowed). It waits for a full batch, or the close.
#[tokio::test(start_paused = true)]
async fn an_endless_linger_waits_for_a_full_batch() {
    let channel = Channel::new(ChannelConfig::new(8)).unwrap();
    let options = ConsumerOptions::new().batch_max(3).batch_flush(Duration::MAX);
    let mut consumer = channel.consumer(options).unwrap();
    channel.emit(1u64).await.unwrap();
    let waited = tokio::time::timeout(Duration::from_secs(3600), consumer.next_batch()).await;
    assert!(waited.is_err(), "a partial batch lingers");
    channel.emit(2).await.unwrap();
    channel.emit(3).await.unwrap();
    let batch = consumer.next_batch().await.expect("a full batch");
    assert_eq!(&batch[..], &[1, 2, 3]);
}

/// Review finding (stop 79): a drop-oldest channel that drops records faster than they linger
/// never had a partial batch due: its linger ran from the oldest record still queued, which
/// the next emit dropped (at capacity 1, every emit). Every record was dropped, none delivered.
/// The linger runs from the batch's first record, dropped or not.
#[tokio::test(start_paused = true)]
async fn a_drop_oldest_channel_that_overflows_still_delivers_a_lingering_batch() {
    for capacity in [1, 4] {
        let config = ChannelConfig::new(capacity).overflow(Overflow::DropOldest);
        let channel = Channel::new(config).unwrap();
        let options =
            ConsumerOptions::new().batch_max(capacity + 1).batch_flush(Duration::from_millis(10));
        let mut consumer = channel.consumer(options).unwrap();
        let producer = channel.clone();
        // A record a millisecond: `capacity` of them never linger 10 ms.
        let emits = tokio::spawn(async move {
            for n in 0..1_000u64 {
                producer.try_emit(n).unwrap();
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        });
        let started = Instant::now();
        let batch = tokio::time::timeout(Duration::from_secs(1), consumer.next_batch())
            .await
            .unwrap_or_else(|_| panic!("capacity {capacity}: no batch in a second"))
            .expect("open");
        assert!(started.elapsed() <= Duration::from_millis(11), "capacity {capacity}");
        assert!(!batch.is_empty());
        emits.abort();
    }
}
