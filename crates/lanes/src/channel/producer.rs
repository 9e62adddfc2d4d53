//! The producer's handle: emit records, take the consumer, close.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use std::mem::ManuallyDrop;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::config::{ChannelConfig, ConsumerOptions, Emitted, Overflow};
use super::consumer::Consumer;
use super::core::MakeEntry;
use super::error::{ChannelError, EmitError};
use super::handle::{ChannelShared, Entry, Pushed, Refused, Waiter};
use super::receipt::{Receipt, ReceiptState, Settlement};
use super::snapshot::ChannelSnapshot;
use crate::BoxFuture;
use crate::observe::{Observe, Snapshot};
use crate::util::spin_lock;

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
    pub fn emit(
        &self,
        record: T,
    ) -> impl Future<Output = Result<Emitted<T>, EmitError<T>>> + Send + '_ {
        Emit::<T, false>::new(self, record, None)
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
        Emit::<T, true>::new(self, record, Some(state.clone())).await?;
        Ok(Receipt::new(state))
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
            let mut st = spin_lock(&self.shared.state);
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
        spin_lock(&self.shared.state).core.len()
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
    /// `Dropped`); batches the consumer holds still settle, and a record already handed to a
    /// waiting read is still read.
    pub fn abort(&self) {
        self.shared.close_with(true);
    }

    /// The channel's counters and state now. The `emitted` and `processed` metrics, which a
    /// busy channel publishes in steps, catch up with these counts
    /// ([`observe::METRICS`](crate::observe::METRICS)).
    pub fn snapshot(&self) -> ChannelSnapshot {
        self.shared.snapshot()
    }
}

// Inlined into `try_emit`, as the shell's `push_now` is (see `Core::offer`), and so into the
// emit future's tail too: left to the compiler there, `fixed channel 64 3000` read 44-62 M/s
// against 59-62 (alternating builds; the record path does not call it).
#[inline(always)]
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

/// The future of [`Channel::emit`] and [`Channel::emit_with_receipt`], written out rather than
/// an `async fn`: its first poll takes the fast path (the record fits: one lock), and dropping
/// the future of such an emit is one test, inline. An emit that must wait keeps its entry and
/// its place in line; one that spills goes on to the (boxed) append. `RECEIPT` says whether the
/// record carries a receipt, so that the plain emit's fast path has no test for one.
///
/// Against the `async fn` it replaces, on current_thread (cachegrind over `benches`' `fixed
/// channel`): 241 -> 206 instructions per record at capacity 1,024, 245 -> 209 at 64, 2,691 ->
/// 2,619 at 1.
struct Emit<'a, T, const RECEIPT: bool> {
    channel: &'a Channel<T>,
    /// The record, until the first poll.
    record: Option<T>,
    /// Dropped by hand (`Drop` below), only when past the fast path: the drop of an emit that
    /// queued its record at once is then a single test, inline.
    slow: ManuallyDrop<Slow<'a, T>>,
}

/// Where an [`Emit`] past its first poll stands.
enum Slow<'a, T> {
    /// Not past its first poll, or done.
    No,
    /// Not polled yet: the receipt the record's entry carries.
    Receipt(Arc<ReceiptState>),
    /// Waiting for room: the entry and its place in line.
    Waiting(Entry<T>, Waiter),
    /// Writing to the spill queue.
    Spilling(BoxFuture<'a, Result<(), EmitError<T>>>),
}

// No field is structurally pinned: the record moves, the spill is boxed.
impl<T, const RECEIPT: bool> Unpin for Emit<'_, T, RECEIPT> {}

impl<T: Send + 'static, const RECEIPT: bool> Future for Emit<'_, T, RECEIPT> {
    type Output = Result<Emitted<T>, EmitError<T>>;

    // Always inlined, like the channel's and the core's `try_queue` and `enqueue` under it:
    // whether the compiler inlined each depended on how many callers it had, and out of line
    // the fast path cost 15-40% more instructions per record.
    #[inline(always)]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let channel = this.channel;
        let shared = &channel.shared;
        let pushed = if this.record.is_some() {
            if !shared.blocks() {
                shared.push_now_outlined(this.first_entry())
            } else {
                match shared.try_queue(FirstEntry(this)) {
                    Ok(()) => return Poll::Ready(Ok(Emitted::Queued)),
                    Err(Refused::Locked(st)) => {
                        let mut waiter = Waiter::default();
                        let pushed = shared.block(st, this.first_entry(), &mut waiter, cx.waker());
                        match this.hold(pushed, waiter) {
                            Some(pushed) => pushed,
                            None => return Poll::Pending,
                        }
                    }
                    Err(Refused::Unlocked) => {
                        let entry = this.first_entry();
                        match this.wait(entry, Waiter::default(), cx) {
                            Some(pushed) => pushed,
                            None => return Poll::Pending,
                        }
                    }
                }
            }
        } else {
            match std::mem::replace(&mut *this.slow, Slow::No) {
                Slow::Waiting(entry, waiter) => match this.wait(entry, waiter, cx) {
                    Some(pushed) => pushed,
                    None => return Poll::Pending,
                },
                Slow::Spilling(spill) => return this.spill(spill, cx),
                Slow::No | Slow::Receipt(_) => panic!("emit polled after completion"),
            }
        };
        match pushed {
            // A blocked producer's record, queued with the slot it was handed.
            Pushed::Queued => Poll::Ready(Ok(Emitted::Queued)),
            Pushed::Spill(entry) => this.spill(Box::pin(this.channel.spill_waiting(entry)), cx),
            pushed => Poll::Ready(finish(pushed)),
        }
    }
}

impl<'a, T: Send + 'static, const RECEIPT: bool> Emit<'a, T, RECEIPT> {
    fn new(channel: &'a Channel<T>, record: T, receipt: Option<Arc<ReceiptState>>) -> Self {
        let slow = receipt.map_or(Slow::No, Slow::Receipt);
        Self { channel, record: Some(record), slow: ManuallyDrop::new(slow) }
    }

    /// The record's entry, on the first poll (`record` is still there).
    #[inline(always)]
    fn first_entry(&mut self) -> Entry<T> {
        let record = self.first_record();
        Entry { record, receipt: self.take_receipt() }
    }

    /// The record, on the first poll.
    #[inline(always)]
    fn first_record(&mut self) -> T {
        self.record.take().expect("an emit's first poll has its record")
    }

    /// The receipt of an emit with one (`RECEIPT`), on its first poll.
    #[inline]
    fn take_receipt(&mut self) -> Option<Arc<ReceiptState>> {
        if !RECEIPT || !matches!(*self.slow, Slow::Receipt(_)) {
            return None;
        }
        match std::mem::replace(&mut *self.slow, Slow::No) {
            Slow::Receipt(receipt) => Some(receipt),
            _ => unreachable!("matched above"),
        }
    }

    /// Offers `entry` as a producer that waits for room; `None` while the channel is full (the
    /// entry and its place in line are kept for the next poll).
    fn wait(&mut self, entry: Entry<T>, mut waiter: Waiter, cx: &Context<'_>) -> Option<Pushed<T>> {
        let pushed = self.channel.shared.push(entry, Some((&mut waiter, cx.waker())));
        self.hold(pushed, waiter)
    }

    /// What a producer that waits for room makes of `pushed`: a full channel keeps the entry
    /// and `waiter`'s place in line for the next poll (`None`); anything else is the answer.
    #[inline(always)]
    fn hold(&mut self, pushed: Pushed<T>, waiter: Waiter) -> Option<Pushed<T>> {
        match pushed {
            Pushed::Full(entry) => {
                // `slow` is `No` (the poll took it): assigned as a `ManuallyDrop`, nothing is
                // dropped first.
                self.slow = ManuallyDrop::new(Slow::Waiting(entry, waiter));
                None
            }
            pushed => Some(pushed),
        }
    }

    /// Polls the append of a record that spilled.
    fn spill(
        &mut self,
        mut spill: BoxFuture<'a, Result<(), EmitError<T>>>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Emitted<T>, EmitError<T>>> {
        let written = spill.as_mut().poll(cx);
        if written.is_pending() {
            *self.slow = Slow::Spilling(spill);
        }
        written.map(|written| written.map(|()| Emitted::Spilled))
    }
}

/// An emit's entry on its first poll, made where the channel queues it: the record moves from
/// the future straight into its slot ([`MakeEntry`]).
struct FirstEntry<'e, 'a, T, const RECEIPT: bool>(&'e mut Emit<'a, T, RECEIPT>);

impl<T: Send + 'static, const RECEIPT: bool> MakeEntry<T, Arc<ReceiptState>>
    for FirstEntry<'_, '_, T, RECEIPT>
{
    #[inline(always)]
    fn receipt(&mut self) -> Option<Arc<ReceiptState>> {
        self.0.take_receipt()
    }

    #[inline(always)]
    fn record(self) -> T {
        self.0.first_record()
    }
}

impl<T, const RECEIPT: bool> Emit<'_, T, RECEIPT> {
    /// Drops what the emit holds past its first poll; one dropped while in line leaves it,
    /// passing on a slot it was handed.
    #[cold]
    #[inline(never)]
    fn drop_slow(&mut self) {
        let slow = std::mem::replace(&mut self.slow, ManuallyDrop::new(Slow::No));
        if let Slow::Waiting(_, mut waiter) = ManuallyDrop::into_inner(slow)
            && waiter.is_placed()
        {
            self.channel.shared.cancel_wait(&mut waiter);
        }
    }
}

impl<T, const RECEIPT: bool> Drop for Emit<'_, T, RECEIPT> {
    #[inline]
    fn drop(&mut self) {
        if !matches!(*self.slow, Slow::No) {
            self.drop_slow();
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
