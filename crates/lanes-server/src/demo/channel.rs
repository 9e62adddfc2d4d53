//! The channel scenario: a fast producer into a slow batching consumer, overflow spilled to a
//! durable queue, processed records forwarded to a durable output queue; then a simulated
//! power loss, a restart, and the proof that nothing acknowledged was lost.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use lanes::BoxError;
use lanes::channel::{
    BinaryCodec, Channel, ChannelConfig, Codec, ConsumerOptions, Envelope, Overflow, Receipt,
    Settlement,
};
use lanes::spill::{MemStorage, SpillOptions, SpillQueue, SyncPolicy};

use super::DemoArgs;

/// A source record: an order id and its payload.
type Order = (u64, String);

/// Records per source chunk: the producer commits its source offset a chunk at a time.
const CHUNK: u64 = 500;

fn order(id: u64) -> Order {
    (id, format!("order-{id:06}: 3 items, ship to warehouse {}", id % 7))
}

fn queue_options() -> SpillOptions {
    SpillOptions::default().sync(SyncPolicy::Batch)
}

fn channel(overflow: &SpillQueue) -> Result<Channel<Order>, BoxError> {
    Ok(Channel::named(
        "orders",
        ChannelConfig::new(256).overflow(Overflow::spill(overflow.clone(), BinaryCodec::new())),
    )?)
}

/// The fast path: batches of up to 64 (or 20 ms), 2 ms of work each, written to `output`.
fn consume(
    channel: &Channel<Order>,
    output: &SpillQueue,
) -> Result<tokio::task::JoinHandle<()>, BoxError> {
    let mut consumer = channel.consumer(
        ConsumerOptions::new()
            .batch_max(64)
            .batch_flush(Duration::from_millis(20))
            .output(output.clone())
            .codec(BinaryCodec::new()),
    )?;
    Ok(tokio::spawn(async move {
        while let Some(batch) = consumer.next_batch().await {
            tokio::time::sleep(Duration::from_millis(2)).await;
            if batch.ack().await.is_err() {
                return; // the "disk" went away: the process is crashing
            }
        }
    }))
}

/// Ids of every record in a queue, whatever it is wrapped in.
async fn ids_in(queue: &SpillQueue, envelopes: bool) -> Result<Vec<u64>, BoxError> {
    let mut reader = queue.reader()?;
    let mut ids = Vec::new();
    loop {
        let batch = reader.try_next_batch(4096).await?;
        if batch.is_empty() {
            return Ok(ids);
        }
        for record in &batch {
            let bytes = if envelopes {
                Envelope::from_bytes(record.data())?.payload
            } else {
                record.data().to_vec()
            };
            let (id, _): Order = BinaryCodec::new().decode(&bytes)?;
            ids.push(id);
        }
    }
}

pub(super) async fn run(args: &DemoArgs) -> Result<(), BoxError> {
    let total = args.records;
    let crash_at = total / 2;
    println!(
        "channel: a producer emits {total} orders as fast as it can into a 256-record channel; \
         the consumer takes batches of 64 (20 ms linger) and needs 2 ms per batch, writing what it \
         processed to a durable output queue. Records the channel has no room for spill to a \
         durable overflow queue. The producer commits its source offset every {CHUNK} records, \
         once all of their receipts allow it. After {crash_at} orders the power fails: everything \
         in memory and every unsynced byte is gone.\n"
    );
    let (overflow_disk, output_disk) = (MemStorage::new(), MemStorage::new());
    let (overflow, _) = SpillQueue::open_with(overflow_disk.clone(), queue_options()).await?;
    let (output, _) = SpillQueue::open_with(output_disk.clone(), queue_options()).await?;

    // Phase 1: run until the crash.
    let started = Instant::now();
    let orders = channel(&overflow)?;
    let fast_path = consume(&orders, &output)?;
    let mut receipts: Vec<(u64, Receipt)> = Vec::with_capacity(crash_at as usize);
    let mut committed = 0u64;
    for id in 0..crash_at {
        receipts.push((id, orders.emit_with_receipt(order(id)).await.map_err(|e| e.to_string())?));
        // Commit whole chunks whose receipts all settled (none undecided, none timed out).
        while committed + CHUNK <= receipts.len() as u64 {
            let chunk = &receipts[committed as usize..(committed + CHUNK) as usize];
            let ready = chunk
                .iter()
                .all(|(_, r)| r.settlement().is_some_and(|s| s != Settlement::TimedOut));
            if !ready {
                break;
            }
            committed += CHUNK;
        }
        if id % 64 == 0 {
            tokio::task::yield_now().await;
        }
    }
    let before = orders.snapshot();
    let acknowledged: BTreeSet<u64> = receipts
        .iter()
        .filter(|(_, r)| {
            matches!(r.settlement(), Some(Settlement::Processed | Settlement::Spilled))
        })
        .map(|(id, _)| *id)
        .collect();
    // Power loss: unsynced bytes vanish, the process and its memory with them.
    overflow_disk.crash(|_, _| 0);
    output_disk.crash(|_, _| 0);
    fast_path.abort();
    drop((orders, overflow, output, receipts));
    println!("before the crash ({:.2?}):", started.elapsed());
    println!(
        "  emitted {}  processed {}  spilled {}  in the channel {}  source committed up to {committed}",
        before.emitted, before.processed, before.spilled, before.depth
    );
    println!("  acknowledged (receipt settled processed or spilled): {}\n", acknowledged.len());

    // Phase 2: restart from what the disk kept.
    let (overflow, recovered_overflow) =
        SpillQueue::open_with(overflow_disk.after_crash(), queue_options()).await?;
    let (output, recovered_output) =
        SpillQueue::open_with(output_disk.after_crash(), queue_options()).await?;
    let durable: BTreeSet<u64> =
        ids_in(&output, true).await?.into_iter().chain(ids_in(&overflow, false).await?).collect();
    let lost: Vec<u64> = acknowledged.difference(&durable).copied().collect();
    println!("after the restart:");
    println!(
        "  recovered: output {} records ({} torn bytes dropped), overflow {} records ({} torn bytes dropped)",
        output.len(),
        recovered_output.discarded_bytes(),
        overflow.len(),
        recovered_overflow.discarded_bytes()
    );
    println!("  acknowledged records lost: {}", lost.len());

    // Replay the source from its committed offset; a slow path drains the overflow queue.
    let orders = channel(&overflow)?;
    let fast_path = consume(&orders, &output)?;
    for id in committed..total {
        orders.emit(order(id)).await.map_err(|e| e.to_string())?;
        if id % 64 == 0 {
            tokio::task::yield_now().await;
        }
    }
    orders.close();
    fast_path.await?;
    let mut slow_path = overflow.reader()?;
    let mut drained = 0;
    loop {
        let batch = slow_path.try_next_batch(1024).await?;
        if batch.is_empty() {
            break;
        }
        let envelopes: Vec<Vec<u8>> = batch
            .iter()
            .map(|r| {
                Envelope { tags: vec!["slow-path".into()], payload: r.data().to_vec() }.to_bytes()
            })
            .collect();
        output.append_batch(&envelopes).await?;
        slow_path.commit_read().await?;
        drained += batch.len();
    }
    let after = orders.snapshot();
    let delivered = ids_in(&output, true).await?;
    let unique: BTreeSet<u64> = delivered.iter().copied().collect();
    let missing = (0..total).filter(|id| !unique.contains(id)).count();
    println!(
        "  replayed from offset {committed}: emitted {}  processed {}  spilled {}; slow path drained {drained} spilled records",
        after.emitted, after.processed, after.spilled
    );
    println!(
        "  output: {} records, {} distinct orders of {total}, {} duplicates (at least once), {missing} missing",
        delivered.len(),
        unique.len(),
        delivered.len() - unique.len()
    );
    println!(
        "\nnothing acknowledged was lost: {}",
        if lost.is_empty() && missing == 0 { "yes" } else { "NO" }
    );
    overflow.close().await?;
    output.close().await?;
    if !lost.is_empty() || missing != 0 {
        return Err(
            format!("{} acknowledged records lost, {missing} orders missing", lost.len()).into()
        );
    }
    Ok(())
}
