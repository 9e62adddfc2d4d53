//! [`DurableQueue`]: what a channel writes records to when they must outlive the process — its
//! spill, its dead letters and its output queue. [`SpillQueue`] (a directory on this machine's
//! disk) is one; `lanes_nats::JetStreamQueue` (a NATS JetStream stream, on another machine or a
//! cluster) is another.

use std::any::Any;
use std::fmt;

use super::SpillError;
use super::handle::SpillQueue;
use crate::BoxFuture;

/// The end of an append to a [`DurableQueue`]: resolves once the records are durable.
pub type Appending = BoxFuture<'static, Result<(), SpillError>>;

/// A durable queue of records (opaque bytes), appended in order.
///
/// # Contract
///
/// - [`enqueue`](Self::enqueue) checks what it can at once (size, room, a failed queue) and then
///   hands the records over: from its `Ok` on they are in the queue's write path, in order, ahead
///   of any later append, and dropping the returned [`Appending`] (or the queue) does not
///   withdraw them. (A remote queue that must publish a record again after losing its
///   acknowledgement may store it after later ones.)
/// - The [`Appending`] resolves `Ok` only once every record is durable by the queue's own rule:
///   a [`SpillQueue`] under its [`SyncPolicy`](super::SyncPolicy), a JetStream queue once the
///   stream has stored them (its publish acknowledgements). A record whose append resolved `Ok`
///   is never lost; one whose append failed may or may not be in the queue (readers of durable
///   queues deliver at least once, so consumers deduplicate if they must).
/// - Bounds are typed: a record over the queue's maximum is [`SpillError::TooLarge`], a queue
///   at its bound [`SpillError::Full`], a remote store that cannot be reached or refuses
///   [`SpillError::Remote`].
///
/// Reading is each queue's own ([`SpillReader`](super::SpillReader) with committed positions,
/// a JetStream consumer with explicit acks and redelivery): readers live where the queue does.
pub trait DurableQueue: Send + Sync + 'static {
    /// Hands `records` to the queue (see the contract).
    ///
    /// # Errors
    ///
    /// Refusals that are known before anything is handed over (see the contract).
    fn enqueue(&self, records: &[&[u8]]) -> Result<Appending, SpillError>;

    /// Whether `other` is this very queue (not merely an equal one).
    fn same_as(&self, other: &dyn DurableQueue) -> bool;

    /// This queue as [`Any`], for [`same_as`](Self::same_as).
    fn as_any(&self) -> &dyn Any;

    /// Where the queue lives, for messages and `Debug` (a directory, a stream on a server).
    fn describe(&self) -> String;
}

impl fmt::Debug for dyn DurableQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DurableQueue({})", self.describe())
    }
}

impl DurableQueue for SpillQueue {
    fn enqueue(&self, records: &[&[u8]]) -> Result<Appending, SpillError> {
        let pending = self.start_append(records)?;
        Ok(Box::pin(pending))
    }

    fn same_as(&self, other: &dyn DurableQueue) -> bool {
        other
            .as_any()
            .downcast_ref::<SpillQueue>()
            .is_some_and(|other| Self::same_queue(self, other))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn describe(&self) -> String {
        format!("{self:?}")
    }
}
