//! A channel that overflows into a spill queue on disk instead of dropping, with receipts
//! telling each producer what became of its record. `cargo run -p lanes --example channel_spill`

use std::time::Duration;

use lanes::channel::{BinaryCodec, Channel, ChannelConfig, ConsumerOptions, Overflow, Settlement};
use lanes::spill::{SpillOptions, SpillQueue, SyncPolicy};

#[tokio::main]
pub(crate) async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let dir = std::env::temp_dir().join(format!("lanes-example-spill-{}", std::process::id()));
    let (spill, _) =
        SpillQueue::open(&dir, SpillOptions::default().sync(SyncPolicy::Batch)).await?;
    // Room for 4 records in memory; what does not fit goes to disk, durably.
    let channel = Channel::new(
        ChannelConfig::new(4).overflow(Overflow::spill(spill.clone(), BinaryCodec::new())),
    )?;
    let mut consumer = channel
        .consumer(ConsumerOptions::new().batch_max(4).batch_flush(Duration::from_millis(5)))?;
    let mut receipts = Vec::new();
    for order in 0..10u64 {
        receipts.push(channel.emit_with_receipt(order).await?);
    }
    channel.close();
    while let Some(batch) = consumer.next_batch().await {
        println!("processed in memory: {:?}", &batch[..]);
        batch.ack().await?;
    }
    let mut settled = Vec::new();
    for receipt in receipts {
        settled.push(receipt.await);
    }
    let processed = settled.iter().filter(|s| **s == Settlement::Processed).count();
    let spilled = settled.iter().filter(|s| **s == Settlement::Spilled).count();
    println!("{processed} processed, {spilled} spilled to {}", dir.display());
    assert_eq!(processed + spilled, 10);
    // The spilled records wait on disk for a later consumer (or a restart).
    let mut reader = spill.reader()?;
    let on_disk = reader.try_next_batch(100).await?;
    assert_eq!(on_disk.len(), spilled);
    drop(reader);
    spill.close().await?;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
