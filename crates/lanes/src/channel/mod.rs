//! Record channels: bounded in-process queues of records between a producer stage and a
//! batching consumer, with an overflow policy, receipts and a registry.
//!
//! A [`Channel`] holds at most `capacity` records. When it is full, its [`Overflow`] policy
//! decides: the producer waits ([`Block`](Overflow::Block), the default), the new record is
//! dropped ([`DropNewest`](Overflow::DropNewest)), the oldest is
//! ([`DropOldest`](Overflow::DropOldest)), or the record goes to a durable
//! [`SpillQueue`](crate::spill::SpillQueue) ([`Spill`](Overflow::Spill)). Each record takes
//! exactly one path; spilled records never flow back into the channel — a slow-path consumer
//! reads the spill queue, so order across the two paths is not kept (use `Block` where it
//! matters). Records the consumer has taken are delivered and out of the channel: a `recv`
//! reads ahead up to 64 at a time, and a read waiting on an empty channel is handed the next
//! record directly, so its producer does not wait for the consumer to run.
//!
//! The [`Consumer`] receives [`Batch`]es of up to `batch_max` records, a partial batch once its
//! oldest record has waited `batch_flush`, and settles each record: processed (written to the
//! `output` queue, if any: the durable bridge downstream) or failed under a [`FailurePolicy`].
//! A producer that needs to know uses [`Channel::emit_with_receipt`]; an [`AckSet`] gates a
//! commit (say, of a source offset) on a set of receipts.
//!
//! [`Channels`] names channels: configured ones, and dynamic ones under a shared budget, with
//! owners for cascade close. Every channel reports a [`ChannelSnapshot`] whose counters
//! reconcile exactly: `emitted = delivered + dropped + spilled + depth`.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use lanes::channel::{Channel, ChannelConfig, ConsumerOptions, Overflow};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let events = Channel::new(ChannelConfig::new(1024).overflow(Overflow::DropOldest))?;
//! let mut consumer = events.consumer(
//!     ConsumerOptions::new().batch_max(100).batch_flush(Duration::from_millis(20)),
//! )?;
//!
//! let producer = events.clone();
//! tokio::spawn(async move {
//!     for n in 0..1000u32 {
//!         producer.emit(n).await.expect("open");
//!     }
//! });
//! drop(events); // the channel closes once the producer is done
//!
//! let mut received = 0;
//! while let Some(batch) = consumer.next_batch().await {
//!     received += batch.len();
//!     // Records may fail one by one: `settle` takes an outcome per record.
//!     let outcomes: Vec<_> = batch.iter().map(|_| Ok(())).collect();
//!     batch.settle(outcomes).await?;
//! }
//! assert_eq!(received, 1000);
//! # Ok(())
//! # }
//! ```
//!
//! # Durability
//!
//! Records queued in a channel live in memory: a crash loses them. What must survive goes
//! through a spill queue: `Overflow::Spill` for records the channel had no room for, the
//! consumer's `output` queue for processed records, a `DeadLetter` queue for failed ones. A
//! producer that commits its source only when an [`AckSet`] allows it re-reads, after a crash,
//! everything not yet processed or spilled (at least once).

mod buffer;
mod channels;
mod codec;
mod config;
mod consumer;
mod core;
mod error;
mod handle;
mod producer;
mod receipt;
mod snapshot;

pub use channels::{Channels, ChannelsBuilder};
pub use codec::{BinaryCodec, Codec, Envelope, JsonCodec};
pub use config::{
    ChannelConfig, ConsumerOptions, DEFAULT_ACK_TIMEOUT, DEFAULT_CAPACITY, Emitted, FailurePolicy,
    MAX_CAPACITY, Overflow, OverflowKind, PermitPer,
};
pub use consumer::{Batch, Consumer, SettleReport};
pub use error::{ChannelError, EmitError, SettleError};
pub use producer::Channel;
pub use receipt::{AckSet, AckSummary, Receipt, Settlement};
pub use snapshot::{BudgetSnapshot, ChannelSnapshot, ChannelsSnapshot};
