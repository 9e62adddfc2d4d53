//! The producer's handle: emit records, take the consumer, close.

use std::fmt;
use std::future::poll_fn;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use std::task::Poll;

use super::config::{ChannelConfig, ConsumerOptions, Emitted, Overflow};
use super::consumer::Consumer;
use super::error::{ChannelError, EmitError};
use super::handle::{ChannelShared, Entry, Pushed, Waiter};
use super::receipt::{Receipt, ReceiptState, Settlement};
use super::snapshot::ChannelSnapshot;
use crate::observe::{Observe, Snapshot};
use crate::util::lock;

/// A bounded in-process channel of records: the producers' handle. Clones are more producers
/// of the same channel; one [`Consumer`] receives.
///
/// A channel made with [`Channel::new`] closes when its last handle is dropped (the consumer
/// then drains what is queued); a channel of a [`Channels`](super::Channels) registry stays
/// open until it is closed.
///
/// # Examples
///
/// ```
/// use lanes::channel::{Channel, ChannelConfig, ConsumerOptions, Emitted, Overflow};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let channel = Channel::new(ChannelConfig::new(2).overflow(Overflow::DropOldest))?;
/// let mut consumer = channel.consumer(ConsumerOptions::new().batch_max(10))?;
///
/// for n in 1..=3u32 {
///     channel.emit(n).await?;
/// }
/// // The channel held two records: the third emit dropped the oldest.
/// assert!(matches!(channel.try_emit(4)?, Emitted::DroppedOldest(2)));
/// channel.close();
///
/// let batch = consumer.next_batch().await.expect("a batch");
/// assert_eq!(&batch[..], &[3, 4]);
/// batch.ack().await?;
/// assert!(consumer.next_batch().await.is_none());
///
/// let snapshot = channel.snapshot();
/// assert_eq!((snapshot.emitted, snapshot.delivered, snapshot.dropped), (4, 2, 2));
/// # Ok(())
/// # }
/// ```
pub struct Channel<T> {
    pub(crate) shared: Arc<ChannelShared<T>>,
}

impl<T: Send + 'static> Channel<T> {
    /// A standalone channel, named after its [registry name](ChannelConfig::registry), else
    /// `"channel"`.
    ///
    /// # Errors
    ///
    /// [`ChannelError::Config`] for a zero or oversized capacity, a zero `ack_timeout`, or a
    /// registry name already taken.
    pub fn new(config: ChannelConfig<T>) -> Result<Self, ChannelError> {
        let name = config.registry.as_ref().map_or("channel", |r| r.name.as_str()).to_owned();
        Self::named(name, config)
    }

    /// A standalone channel named `name` (the name labels its metrics and snapshot).
    ///
    /// # Errors
    ///
    /// As for [`new`](Self::new).
    pub fn named(
        name: impl Into<Arc<str>>,
        config: ChannelConfig<T>,
    ) -> Result<Self, ChannelError> {
        let name = name.into();
        config.validate(&name)?;
        let registration = config.registry.clone();
        if let Some(registration) = &registration {
            registration.check()?;
        }
        let shared = Arc::new(ChannelShared::new(name, config, false, None, Weak::new()));
        if let Some(registration) = registration {
            registration.register(&shared)?;
        }
        Ok(Self::from_shared(shared))
    }

    pub(crate) fn from_shared(shared: Arc<ChannelShared<T>>) -> Self {
        shared.producers.fetch_add(1, Ordering::Relaxed);
        Self { shared }
    }

    /// Emits `record` without waiting, saying what happened to it.
    ///
    /// Under [`Overflow::Spill`], the record is encoded and handed to the spill queue's writer
    /// (an append that cannot be withdrawn); use [`emit`](Self::emit) to wait until it is there
    /// under the queue's sync policy.
    ///
    /// # Errors
    ///
    /// The record is handed back: [`EmitError::Full`] (a full channel under
    /// [`Overflow::Block`]), [`EmitError::Closed`], or, for a spill,
    /// [`EmitError::Spill`] / [`EmitError::Encode`].
    pub fn try_emit(&self, record: T) -> Result<Emitted<T>, EmitError<T>> {
        match self.shared.push_now(Entry { record, receipt: None }) {
            Pushed::Spill(entry) => self.spill_now(entry).map(|()| Emitted::Spilled),
            pushed => finish(pushed),
        }
    }

    /// Emits `record`, waiting for room under [`Overflow::Block`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future while it waits for room leaves nothing enqueued (the
    /// record is dropped with it) and passes its turn to the next waiting producer. Under
    /// [`Overflow::Spill`], a record handed to the spill queue stays there.
    ///
    /// # Errors
    ///
    /// As for [`try_emit`](Self::try_emit), except that a full channel waits instead.
    pub async fn emit(&self, record: T) -> Result<Emitted<T>, EmitError<T>> {
        let entry = Entry { record, receipt: None };
        // Written out here and in `emit_with_receipt` rather than in a shared async helper: the
        // helper's extra future cost 9-12% of the fast path (A/B, three alternating rounds).
        let pushed = if self.shared.blocks() {
            match self.shared.try_queue(entry) {
                Ok(()) => return Ok(Emitted::Queued),
                Err(entry) => self.push_waiting(entry).await,
            }
        } else {
            // Never waits: fits, or the overflow rule applies at once, under one lock.
            self.shared.push_now(entry)
        };
        match pushed {
            Pushed::Spill(entry) => self.spill_waiting(entry).await.map(|()| Emitted::Spilled),
            pushed => finish(pushed),
        }
    }

    /// Emits `record` like [`emit`](Self::emit) and returns its [`Receipt`], which settles
    /// exactly once: when the consumer settles the record, when the record is dropped or
    /// spilled, or `TimedOut` after the channel's `ack_timeout`.
    ///
    /// # Errors
    ///
    /// As for [`emit`](Self::emit); a record dropped by the overflow policy is not an error (its
    /// receipt settles [`Dropped`](Settlement::Dropped)).
    pub async fn emit_with_receipt(&self, record: T) -> Result<Receipt, EmitError<T>> {
        let state = ReceiptState::new(self.shared.config.ack_timeout);
        let entry = Entry { record, receipt: Some(state.clone()) };
        let pushed = if self.shared.blocks() {
            match self.shared.try_queue(entry) {
                Ok(()) => return Ok(Receipt::new(state)),
                Err(entry) => self.push_waiting(entry).await,
            }
        } else {
            self.shared.push_now(entry)
        };
        match pushed {
            Pushed::Queued => {}
            Pushed::DroppedNewest(entry) | Pushed::DroppedOldest(entry) => {
                entry.settle(Settlement::Dropped);
            }
            Pushed::Spill(entry) => self.spill_waiting(entry).await?,
            Pushed::Full(entry) => return Err(EmitError::Full(entry.record)),
            Pushed::Closed(entry) => return Err(EmitError::Closed(entry.record)),
        }
        Ok(Receipt::new(state))
    }

    async fn push_waiting(&self, entry: Entry<T>) -> Pushed<T> {
        let mut entry = Some(entry);
        let mut guard = WaitGuard { shared: &self.shared, waiter: Waiter::default() };
        poll_fn(|cx| {
            let pending = entry.take().expect("polled after completion");
            match self.shared.push(pending, Some((&mut guard.waiter, cx.waker()))) {
                Pushed::Full(pending) => {
                    entry = Some(pending);
                    Poll::Pending
                }
                done => Poll::Ready(done),
            }
        })
        .await
    }

    /// Hands a record the core answered `Spill` to the spill queue's writer, without waiting;
    /// it is counted spilled once the queue took it.
    fn spill_now(&self, entry: Entry<T>) -> Result<(), EmitError<T>> {
        let Overflow::Spill(queue, codec) = &self.shared.config.overflow else {
            unreachable!("only a spill policy spills");
        };
        let bytes = match codec.encode(&entry.record) {
            Ok(bytes) => bytes,
            Err(err) => return Err(EmitError::Encode(entry.record, err)),
        };
        match queue.enqueue(&[bytes.as_slice()]) {
            Ok(_in_write_path) => {
                self.shared.spilled();
                tracing::trace!(channel = %self.shared.name, "spilled");
                entry.settle(Settlement::Spilled);
                Ok(())
            }
            Err(err) => {
                tracing::debug!(channel = %self.shared.name, error = %err, "spill refused");
                Err(EmitError::Spill(entry.record, err))
            }
        }
    }

    /// Appends a record the core answered `Spill` to the spill queue and waits until it is
    /// there under the queue's sync policy; it is counted spilled then. Cancelled while the
    /// append is in the queue's write path, it is counted spilled too: the append goes on.
    async fn spill_waiting(&self, entry: Entry<T>) -> Result<(), EmitError<T>> {
        let Overflow::Spill(queue, codec) = &self.shared.config.overflow else {
            unreachable!("only a spill policy spills");
        };
        let (queue, codec) = (queue.clone(), codec.clone());
        let bytes = match codec.encode(&entry.record) {
            Ok(bytes) => bytes,
            Err(err) => return Err(EmitError::Encode(entry.record, err)),
        };
        let written = match queue.enqueue(&[bytes.as_slice()]) {
            Ok(pending) => {
                let mut in_flight = SpillInFlight { shared: &self.shared, armed: true };
                let written = pending.await;
                in_flight.armed = false;
                written
            }
            Err(err) => Err(err),
        };
        match written {
            Ok(()) => {
                self.shared.spilled();
                tracing::trace!(channel = %self.shared.name, "spilled");
                entry.settle(Settlement::Spilled);
                Ok(())
            }
            Err(err) => {
                tracing::debug!(channel = %self.shared.name, error = %err, "spill failed");
                Err(EmitError::Spill(entry.record, err))
            }
        }
    }

    /// Takes the channel's one consumer.
    ///
    /// # Errors
    ///
    /// [`ChannelError::ConsumerTaken`] if it was taken before, [`ChannelError::Config`] for
    /// invalid options.
    pub fn consumer(&self, options: ConsumerOptions<T>) -> Result<Consumer<T>, ChannelError> {
        let mut options = options;
        // The codec is given once: a spilling channel's codec also encodes its consumer's
        // output and dead letters, unless the consumer names its own.
        if options.codec.is_none()
            && let Overflow::Spill(_, codec) = &self.shared.config.overflow
        {
            options.codec = Some(codec.clone());
        }
        options.validate(&self.shared.name)?;
        {
            let mut st = lock(&self.shared.state);
            if st.consumer_taken {
                return Err(ChannelError::ConsumerTaken(self.shared.name.to_string()));
            }
            st.consumer_taken = true;
        }
        Ok(Consumer::new(self.shared.clone(), options))
    }
}

impl<T> Channel<T> {
    /// The channel's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The most records the channel holds.
    pub fn capacity(&self) -> usize {
        self.shared.config.capacity
    }

    /// Records queued now.
    pub fn len(&self) -> usize {
        lock(&self.shared.state).core.len()
    }

    /// Whether no record is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Closes the channel: emits fail with [`EmitError::Closed`]; the consumer receives what is
    /// queued (unless the channel discards on close), then `None`. Closing twice does nothing.
    pub fn close(&self) {
        self.shared.close_with(false);
    }

    /// Whether the channel is closed.
    pub fn is_closed(&self) -> bool {
        self.shared.is_closed()
    }

    /// Resolves once the channel is closed, nothing is queued and every delivered record was
    /// settled (processed, failed or abandoned with its batch). Waits forever on a channel
    /// nobody closes, and on queued records no consumer takes.
    pub async fn drained(&self) {
        struct Counted<'a>(&'a AtomicUsize);
        impl Drop for Counted<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        self.shared.drain_waiters.fetch_add(1, Ordering::SeqCst);
        let _counted = Counted(&self.shared.drain_waiters);
        loop {
            let mut settled = std::pin::pin!(self.shared.settled.notified());
            settled.as_mut().enable();
            if self.shared.is_drained() {
                return;
            }
            settled.await;
        }
    }

    /// Closes the channel and drops what is queued (counted as `dropped`, receipts settled
    /// `Dropped`); batches the consumer holds still settle.
    pub fn abort(&self) {
        self.shared.close_with(true);
    }

    /// The channel's counters and state now.
    pub fn snapshot(&self) -> ChannelSnapshot {
        self.shared.snapshot()
    }
}

fn finish<T>(pushed: Pushed<T>) -> Result<Emitted<T>, EmitError<T>> {
    match pushed {
        Pushed::Queued => Ok(Emitted::Queued),
        Pushed::DroppedNewest(entry) => {
            entry.settle(Settlement::Dropped);
            Ok(Emitted::Dropped(entry.record))
        }
        Pushed::DroppedOldest(entry) => {
            entry.settle(Settlement::Dropped);
            Ok(Emitted::DroppedOldest(entry.record))
        }
        Pushed::Full(entry) => Err(EmitError::Full(entry.record)),
        Pushed::Closed(entry) => Err(EmitError::Closed(entry.record)),
        Pushed::Spill(_) => unreachable!("spills are written by the caller"),
    }
}

/// Leaves the wait list when an emit stops waiting for any reason.
struct WaitGuard<'a, T> {
    shared: &'a ChannelShared<T>,
    waiter: Waiter,
}

impl<T> Drop for WaitGuard<'_, T> {
    fn drop(&mut self) {
        // Checked here, inline: an emit that queued its record leaves nothing to undo.
        if self.waiter.is_placed() {
            self.shared.cancel_wait(&mut self.waiter);
        }
    }
}

impl<T> Clone for Channel<T> {
    fn clone(&self) -> Self {
        self.shared.producers.fetch_add(1, Ordering::Relaxed);
        Self { shared: self.shared.clone() }
    }
}

impl<T> Drop for Channel<T> {
    fn drop(&mut self) {
        if self.shared.producers.fetch_sub(1, Ordering::AcqRel) == 1 && self.shared.auto_close {
            self.shared.close_with(false);
        }
    }
}

impl<T> fmt::Debug for Channel<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Channel")
            .field("name", &self.shared.name)
            .field("capacity", &self.shared.config.capacity)
            .field("len", &self.len())
            .finish()
    }
}

impl<T: Send + 'static> Observe for ChannelShared<T> {
    fn report(&self, name: &str, snapshot: &mut Snapshot) {
        let channels = super::ChannelsSnapshot { budget: None, channels: vec![self.snapshot()] };
        snapshot.insert("channels", name, &channels);
    }
}

impl<T: Send + 'static> crate::Lifecycle for Channel<T> {
    type Snapshot = ChannelSnapshot;

    fn close(&self) {
        Channel::close(self);
    }

    fn is_closed(&self) -> bool {
        Channel::is_closed(self)
    }

    fn drained(&self) -> crate::BoxFuture<'_, ()> {
        Box::pin(Channel::drained(self))
    }

    fn abort(&self) {
        Channel::abort(self);
    }

    fn snapshot(&self) -> ChannelSnapshot {
        Channel::snapshot(self)
    }
}

/// An append in the spill queue's write path whose emit may be cancelled: counted spilled on
/// drop unless the emit saw how it ended.
struct SpillInFlight<'a, T> {
    shared: &'a ChannelShared<T>,
    armed: bool,
}

impl<T> Drop for SpillInFlight<'_, T> {
    fn drop(&mut self) {
        if self.armed {
            self.shared.spilled();
        }
    }
}
