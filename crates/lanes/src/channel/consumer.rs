//! The consumer: batches out, settlements back.

use std::collections::VecDeque;
use std::fmt;
use std::future::poll_fn;
use std::ops::Deref;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::{Instant, Sleep};

use super::codec::{Codec, Envelope};
use super::config::{ConsumerLimit, ConsumerOptions, FailurePolicy, PermitPer};
use super::core::Due;
use super::error::SettleError;
use super::handle::{ChannelShared, State, Took};
use super::receipt::{ReceiptState, Settlement};
use crate::limit::{LimitError, OnRefusal, Permit};
use crate::spill::DurableQueue;
use crate::util::{keep_waker, same_waker, spin_lock};
use crate::{BoxError, BoxFuture};

/// The most records `recv` takes under one lock: a block of large records
/// ([`BLOCK`](super::buffer::BLOCK)), so that a read of a busy channel takes one whole.
const PREFETCH: usize = super::buffer::BLOCK;

/// Receipts of records taken together, each with its record's place among them.
type Placed = Vec<(usize, Arc<ReceiptState>)>;

/// How a consumer's batches are formed and settled; shared with its batches.
pub(crate) struct Plan<T> {
    batch_max: usize,
    batch_flush: Duration,
    on_failure: FailurePolicy,
    output: Option<Arc<dyn DurableQueue>>,
    codec: Option<Arc<dyn Codec<T>>>,
    limit: Option<ConsumerLimit>,
}

impl<T> Plan<T> {
    /// The first and longest pause after a refusal of the consumer's limit.
    fn backoff(&self) -> (Duration, Duration) {
        match self.limit.as_ref().map(|limit| limit.throttle.refusal_policy()) {
            Some(OnRefusal::Retry { first, max }) => (first, max),
            // Refused when the consumer was built: a consumer only retries.
            _ => match OnRefusal::RETRY {
                OnRefusal::Retry { first, max } => (first, max),
                OnRefusal::Fail => unreachable!("RETRY retries"),
            },
        }
    }
}

/// The receiving end of a [`Channel`](super::Channel): delivers records in [`Batch`]es of up
/// to `batch_max`, a partial batch once its oldest record has waited `batch_flush`, and what is
/// left when the channel closes. Also a [`Stream`](futures_core::Stream) of batches.
///
/// Dropping the consumer closes the channel; records still queued are dropped (counted, their
/// receipts settle [`Dropped`](Settlement::Dropped)).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use lanes::channel::{Channel, ChannelConfig, ConsumerOptions};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let channel = Channel::new(ChannelConfig::new(1024))?;
/// let mut consumer = channel.consumer(
///     ConsumerOptions::new().batch_max(64).batch_flush(Duration::from_millis(10)),
/// )?;
/// tokio::spawn(async move {
///     for n in 0..100u64 {
///         channel.emit(n).await.expect("open");
///     }
/// });
///
/// let mut seen = 0;
/// while let Some(batch) = consumer.next_batch().await {
///     assert!(batch.len() <= 64);
///     seen += batch.len();
///     batch.ack().await?;
/// }
/// assert_eq!(seen, 100);
/// # Ok(())
/// # }
/// ```
pub struct Consumer<T> {
    shared: Arc<ChannelShared<T>>,
    plan: Arc<Plan<T>>,
    linger: Option<Pin<Box<Sleep>>>,
    acquiring: Option<BoxFuture<'static, Result<Vec<Permit>, LimitError>>>,
    permits: Vec<Permit>,
    backoff: Option<Pin<Box<Sleep>>>,
    /// The next pause after a refusal of the limit; `None` until one happens.
    next_backoff: Option<Duration>,
    /// Records `recv` took and has not handed out yet, in order (the first at the front).
    local: VecDeque<T>,
    /// The receipts of records in `local`, in order, each with its record's number: the
    /// records ever moved into `local` before it (the front record's is `local_end -
    /// local.len()`). Kept apart, as the channel keeps them ([`core::Entry`]), so that a record
    /// without one moves and reads as the bare record.
    ///
    /// [`core::Entry`]: super::core::Entry
    local_receipts: VecDeque<(u64, Arc<ReceiptState>)>,
    /// Records ever moved into `local`.
    local_end: u64,
    /// The wakers of producers a take handed slots to (kept: no allocation per hand-off).
    wakers: Vec<Waker>,
    /// The waker last registered for the next record (while the channel's `recv_armed`
    /// holds, a poll with the same waker may return `Pending` without the lock).
    armed: Option<Waker>,
    /// The registration in `armed` is a plain read's, which the next record is handed to: a
    /// batch read goes to the lock to withdraw it rather than wait on it.
    armed_read: bool,
}

impl<T: Send + 'static> Consumer<T> {
    pub(crate) fn new(shared: Arc<ChannelShared<T>>, options: ConsumerOptions<T>) -> Self {
        let ConsumerOptions { batch_max, batch_flush, on_failure, output, codec, limit } = options;
        Self {
            shared,
            plan: Arc::new(Plan { batch_max, batch_flush, on_failure, output, codec, limit }),
            linger: None,
            acquiring: None,
            permits: Vec::new(),
            backoff: None,
            next_backoff: None,
            local: VecDeque::new(),
            local_receipts: VecDeque::new(),
            local_end: 0,
            wakers: Vec::new(),
            armed: None,
            armed_read: false,
        }
    }

    /// The next batch, or `None` once the channel is closed and drained.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: records stay queued until a batch is returned.
    pub async fn next_batch(&mut self) -> Option<Batch<T>> {
        poll_fn(|cx| self.poll_next_batch(cx)).await
    }

    /// The next record on its own, ignoring `batch_max` and `batch_flush`: a plain channel read.
    /// Taking a record settles it: its receipt (if any) settles
    /// [`Processed`](Settlement::Processed) and it counts as processed.
    ///
    /// To take the lock once per burst rather than once per record, `recv` moves up to 64
    /// queued records at a time into the consumer (they count as delivered then, like a
    /// batch; records a dropped consumer still holds count as abandoned). With a consumer
    /// limit it takes one record at a time, each under a permit released on return.
    ///
    /// A read that empties the channel registers the task for the next record under the same
    /// lock, so that the next read finds out whether one came without taking it again: the
    /// task may be woken once by the next record even if it is busy elsewhere by then.
    ///
    /// While it is registered, the next record emitted is handed to it rather than queued: it
    /// counts as delivered at once and does not take a slot of the channel's capacity, so its
    /// producer goes on without waiting for the consumer to run (at most one record at a
    /// time; order is kept, since the channel held nothing). A [`next_batch`](Self::next_batch)
    /// called after such a read takes that record first.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub fn recv(&mut self) -> impl Future<Output = Option<T>> + Send + '_ {
        Recv { consumer: self }
    }

    /// Moves up to `limit` queued records into `buffer` (waiting for at least one), settling
    /// them as [`recv`](Self::recv) does. Returns how many were added; 0 once the channel is
    /// closed and drained (or for a `limit` of 0).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn recv_many(&mut self, buffer: &mut Vec<T>, limit: usize) -> usize {
        if limit == 0 {
            return 0;
        }
        if self.local.is_empty() {
            let taken = poll_fn(|cx| self.poll_take(cx, limit, Duration::ZERO, None)).await;
            if taken.is_none() {
                return 0;
            }
            self.permits.clear();
        }
        let n = limit.min(self.local.len());
        // Handed out together: each receipt settles, then they count processed at once (as a
        // batch's settlement does), so that `drained` never sees them counted and unsettled.
        if !self.local_receipts.is_empty() {
            let end = self.local_end - (self.local.len() - n) as u64;
            while let Some((_, receipt)) =
                self.local_receipts.pop_front_if(|(number, _)| *number < end)
            {
                settle_read(&self.shared, &receipt);
            }
        }
        buffer.extend(self.local.drain(..n));
        self.shared.count_read(n as u64);
        n
    }

    /// Counts the record `recv` just took from the front of `local`: its receipt, if it has
    /// one, settles, then the record counts as processed.
    #[inline(always)]
    fn count_handed(&mut self) {
        if self.local_receipts.is_empty() {
            self.shared.count_read(1);
        } else {
            self.count_handed_with_receipts();
        }
    }

    /// [`count_handed`](Self::count_handed) while some record in `local` has a receipt: out of
    /// line, off the path of records without one.
    #[cold]
    #[inline(never)]
    fn count_handed_with_receipts(&mut self) {
        let number = self.local_end - self.local.len() as u64 - 1;
        match self.local_receipts.pop_front_if(|(at, _)| *at == number) {
            Some((_, receipt)) => read_with_receipt(&self.shared, &receipt),
            None => self.shared.count_read(1),
        }
    }

    /// Records `recv` took and did not hand out, in order, with their receipts, each at its
    /// record's place.
    fn take_back_local(&mut self) -> (Vec<T>, Placed) {
        let front = self.local_end - self.local.len() as u64;
        let receipts = self
            .local_receipts
            .drain(..)
            .map(|(number, receipt)| ((number - front) as usize, receipt))
            .collect();
        (Vec::from(std::mem::take(&mut self.local)), receipts)
    }

    /// Polls for the next batch.
    pub fn poll_next_batch(&mut self, cx: &mut Context<'_>) -> Poll<Option<Batch<T>>> {
        let (max, flush) = (self.plan.batch_max, self.plan.batch_flush);
        let (mut records, mut placed) = self.take_back_local();
        if records.len() > max {
            // The rest goes back, with its receipts, under the numbers it had.
            let rest = records.split_off(max);
            let front = self.local_end - rest.len() as u64;
            let kept = placed.partition_point(|(at, _)| *at < max);
            self.local_receipts
                .extend(placed.drain(kept..).map(|(at, r)| (front + (at - max) as u64, r)));
            self.local = VecDeque::from(rest);
        }
        if records.is_empty()
            && ready!(self.poll_take(cx, max, flush, Some((&mut records, &mut placed)))).is_none()
        {
            return Poll::Ready(None);
        }
        let mut receipts = Vec::new();
        if !placed.is_empty() {
            receipts.resize(records.len(), None);
            for (at, receipt) in placed {
                receipts[at] = Some(receipt);
            }
        }
        Poll::Ready(Some(Batch {
            records,
            receipts,
            permits: std::mem::take(&mut self.permits),
            shared: self.shared.clone(),
            plan: self.plan.clone(),
            settled: false,
        }))
    }

    /// [`poll_take`](Self::poll_take) into the read-ahead, for `recv`: a consumer polled again
    /// while it waits for the next record with the same waker, and none has come, is answered
    /// here inline, without the lock or a call (at capacity 1 every other poll is one of those,
    /// and the call's entry and exit cost more than its test), unless reads wait for the
    /// `processed` metric. The batch reads call
    /// `poll_take`, which makes the same test inside: for them the test out here cost two
    /// instructions a record and saved none.
    #[inline(always)]
    fn poll_recv(&mut self, cx: &mut Context<'_>, max: usize) -> Poll<Option<()>> {
        if self.backoff.is_none() && self.acquiring.is_none() && self.still_armed(cx) {
            self.shared.catch_up_reads();
            return Poll::Pending;
        }
        self.poll_take(cx, max, Duration::ZERO, None)
    }

    /// Whether the consumer waits for the next record with `cx`'s waker and none has come.
    #[inline(always)]
    fn still_armed(&self, cx: &Context<'_>) -> bool {
        self.shared.is_armed()
            && self.armed.as_ref().is_some_and(|armed| same_waker(armed, cx.waker()))
    }

    /// Takes up to `max` records once a batch is due, with the permits it needs, into `out`,
    /// or into the read-ahead (`local`) for `None`.
    fn poll_take(
        &mut self,
        cx: &mut Context<'_>,
        max: usize,
        flush: Duration,
        mut out: Option<(&mut Vec<T>, &mut Placed)>,
    ) -> Poll<Option<()>> {
        // A plain read (into the read-ahead, taking what is there, with no permits to take
        // first) is handed the next record when it waits ([`Core::await_read`]).
        let read = out.is_none() && flush.is_zero() && self.plan.limit.is_none();
        loop {
            if let Some(sleep) = &mut self.backoff {
                ready!(sleep.as_mut().poll(cx));
                self.backoff = None;
            }
            if let Some(acquiring) = &mut self.acquiring {
                let answer = ready!(acquiring.as_mut().poll(cx));
                self.acquiring = None;
                match answer {
                    Ok(permits) => {
                        self.permits.extend(permits);
                        self.next_backoff = None;
                    }
                    Err(_) => {
                        spin_lock(&self.shared.state).core.counters.limit_errors += 1;
                        let (first, max) = self.plan.backoff();
                        let wait = self.next_backoff.unwrap_or(first);
                        self.next_backoff = Some((wait * 2).min(max));
                        self.backoff = Some(Box::pin(tokio::time::sleep(wait)));
                        continue;
                    }
                }
            }
            // Read all it had: the `processed` metric is given the reads it lags by.
            self.shared.catch_up_reads();
            // Waiting for the next record with this waker, and none has come: no lock.
            if self.still_armed(cx) && (read || !self.armed_read) {
                return Poll::Pending;
            }
            // Producers on other threads hold the lock for a push at a time: waited for awake
            // (`util::SpinLock`). Stop 47 measured an awake wait against std's sleeping one
            // (then a spinning wait on std's mutex): two-worker `spsc_1024_256B` read
            // 1.11-1.58× tokio mpsc against 0.68-1.30× (BENCHMARKS.md, suite 3).
            let mut st = spin_lock(&self.shared.state);
            // A read takes a record handed to it besides `max` queued ones (a whole buffer
            // then still moves at once); a batch counts it among its `max`.
            let max = max.saturating_add(usize::from(read && st.core.has_handed()));
            let len = match st.core.due(max, flush, Instant::now) {
                Due::End => {
                    drop(st);
                    self.permits.clear();
                    return Poll::Ready(None);
                }
                Due::Empty => {
                    self.armed_read = read;
                    arm(&self.shared, &mut self.armed, &mut st, cx.waker(), read);
                    return Poll::Pending;
                }
                Due::Now(n) => n,
                Due::At(deadline) => {
                    self.shared.wait_for(&mut st, max, cx.waker());
                    drop(st);
                    let linger = match &mut self.linger {
                        Some(linger) => {
                            if linger.deadline() != deadline {
                                linger.as_mut().reset(deadline);
                            }
                            linger
                        }
                        None => self.linger.insert(Box::pin(tokio::time::sleep_until(deadline))),
                    };
                    if linger.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    continue;
                }
            };
            // Into the read-ahead, what one take finds (large records: up to a block's end),
            // so that permits taken per record are all used. (Permits are taken without the
            // lock: if a dropped oldest record shortens the front block meanwhile, the surplus
            // is released below, and a rate limit's tokens for it are spent.)
            let mut n = if out.is_none() { st.core.read_run(len) } else { len };
            // Permits beyond what this take uses, released after the lock: a permit's release
            // runs its limit's metrics (user code, which may call into this channel).
            let mut surplus = Vec::new();
            if let Some(limit) = &self.plan.limit {
                if self.permits.is_empty() {
                    drop(st);
                    let want = match limit.per {
                        PermitPer::Batch => 1,
                        PermitPer::Record => n,
                    };
                    self.acquiring = Some(acquire(limit, want));
                    continue;
                }
                if limit.per == PermitPer::Record {
                    n = n.min(self.permits.len());
                    if self.permits.len() > n {
                        surplus = self.permits.split_off(n);
                    }
                }
            }
            let took = match out.as_mut() {
                Some((out, placed)) => {
                    let at = out.len();
                    let mut receipts = |i, receipt| placed.push((at + i, receipt));
                    self.shared.take(&mut st, n, *out, &mut receipts, &mut self.wakers)
                }
                None => {
                    let (end, local_receipts) = (self.local_end, &mut self.local_receipts);
                    let mut receipts =
                        |i, receipt| local_receipts.push_back((end + i as u64, receipt));
                    let took = self.shared.take(
                        &mut st,
                        n,
                        &mut self.local,
                        &mut receipts,
                        &mut self.wakers,
                    );
                    self.local_end += took.records as u64;
                    took
                }
            };
            if st.core.len() == 0 && !st.core.is_closed() {
                // Emptied it: wait for the next record now, under this lock, so that the next
                // poll finds out whether one came without taking it again.
                self.armed_read = read;
                arm(&self.shared, &mut self.armed, &mut st, cx.waker(), read);
            }
            drop(st);
            drop(surplus);
            self.shared.after_take(took, &mut self.wakers);
            return Poll::Ready(Some(()));
        }
    }
}

/// Under the lock: registers `waker` for the channel's next record, and keeps it in `armed` to
/// recognise the next poll's.
fn arm<T>(
    shared: &ChannelShared<T>,
    armed: &mut Option<Waker>,
    st: &mut State<T>,
    waker: &Waker,
    read: bool,
) {
    shared.arm(st, waker, read);
    keep_waker(armed, waker);
}

/// One attempt at one permit (waiting), then up to `want - 1` more that are free right now;
/// the consumer applies the throttle's backoff itself, to count each refusal.
fn acquire(
    limit: &ConsumerLimit,
    want: usize,
) -> BoxFuture<'static, Result<Vec<Permit>, LimitError>> {
    let throttle = limit.throttle.clone();
    Box::pin(async move { throttle.acquire_up_to_once(want).await })
}

/// A record handed out by a read had a receipt: it settles processed (late, if it timed out
/// first).
#[cold]
fn settle_read<T>(shared: &ChannelShared<T>, receipt: &ReceiptState) {
    if !receipt.settle(Settlement::Processed) {
        spin_lock(&shared.state).core.counters.late_settlements += 1;
    }
}

/// `recv` hands out a record with a receipt: the receipt settles first, as `recv_many` and a
/// batch settle, so that whoever sees the record processed sees its receipt settled; then the
/// record counts. Out of line, off the path of records without one.
#[cold]
#[inline(never)]
fn read_with_receipt<T>(shared: &ChannelShared<T>, receipt: &ReceiptState) {
    settle_read(shared, receipt);
    shared.count_read(1);
}

/// The future of [`Consumer::recv`]. Written by hand rather than as an `async fn`: a read
/// from the read-ahead (63 of 64 reads of a busy channel) is then a test and a pop, without
/// an `async fn`'s states to enter and leave. It keeps no state of its own (all of it is the
/// consumer's), so dropping it while it waits loses nothing, and polled again after it returned
/// it reads again, as a new `recv` would.
struct Recv<'a, T> {
    consumer: &'a mut Consumer<T>,
}

impl<T: Send + 'static> Future for Recv<'_, T> {
    type Output = Option<T>;

    // On every record's path, like `Emit::poll`.
    #[inline(always)]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let consumer = &mut *self.get_mut().consumer;
        if consumer.local.is_empty() {
            let max = if consumer.plan.limit.is_some() { 1 } else { PREFETCH };
            if ready!(consumer.poll_recv(cx, max)).is_none() {
                return Poll::Ready(None);
            }
            consumer.permits.clear();
        }
        let Some(record) = consumer.local.pop_front() else {
            return Poll::Ready(None);
        };
        consumer.count_handed();
        Poll::Ready(Some(record))
    }
}

impl<T: Send + 'static> futures_core::Stream for Consumer<T> {
    type Item = Batch<T>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Batch<T>>> {
        self.get_mut().poll_next_batch(cx)
    }
}

// No field is structurally pinned: records are only ever moved in and out of `Vec`s.
impl<T> Unpin for Consumer<T> {}

impl<T> Drop for Consumer<T> {
    fn drop(&mut self) {
        self.shared.publish_reads();
        let handed = {
            let mut st = spin_lock(&self.shared.state);
            // No record is handed to it from now on: the close that follows drops what comes
            // meanwhile with what is queued.
            st.core.await_read(false);
            // A record handed to its read was delivered: abandoned with the read-ahead.
            let handed = st.core.take_handed();
            st.core.counters.abandoned += (self.local.len() + usize::from(handed.is_some())) as u64;
            handed
        };
        let was_handed = handed.is_some();
        for (_, receipt) in self.local_receipts.drain(..) {
            receipt.settle(Settlement::Dropped);
        }
        self.local.clear();
        if let Some(handed) = handed {
            handed.settle(Settlement::Dropped);
        }
        self.shared.close_with(true);
        if was_handed {
            // As a take would: its budget unit goes back (once the channel is closed, so that
            // no producer of this channel uses it for a record the close would drop), and it
            // counts delivered.
            self.shared.after_take(Took::records(1), &mut self.wakers);
        }
    }
}

impl<T> fmt::Debug for Consumer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("channel", &self.shared.name)
            .field("batch_max", &self.plan.batch_max)
            .field("batch_flush", &self.plan.batch_flush)
            .finish()
    }
}

/// Records delivered together, in channel order. Read them through `Deref<Target = [T]>`, then
/// settle them: [`ack`](Self::ack) (all processed), [`settle`](Self::settle) (an outcome per
/// record) or [`fail_all`](Self::fail_all). A batch dropped unsettled counts its records as
/// `abandoned` and settles their receipts [`Dropped`](Settlement::Dropped). Permits taken for
/// the batch are held until it is settled or dropped.
pub struct Batch<T> {
    records: Vec<T>,
    /// Empty when no record has a receipt; else one slot per record.
    receipts: Vec<Option<Arc<ReceiptState>>>,
    permits: Vec<Permit>,
    shared: Arc<ChannelShared<T>>,
    plan: Arc<Plan<T>>,
    settled: bool,
}

/// What a [`Batch`] settlement did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SettleReport {
    /// Records processed (and, with an output queue, written there).
    pub processed: usize,
    /// Records failed: tagged, dead-lettered, ignored, or not written.
    pub failed: usize,
    /// Failed records re-emitted to the output queue with a tag.
    pub tagged: usize,
    /// Failed records written to the dead-letter queue.
    pub dead_lettered: usize,
    /// Failed records counted and dropped.
    pub ignored: usize,
    /// Records that could not be encoded or written (counted in `failed`).
    pub unwritten: usize,
    /// Receipts that had timed out before this settlement.
    pub late: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    Processed,
    Tagged,
    DeadLettered,
    Ignored,
    Unwritten,
}

impl Fate {
    fn settlement(self) -> Settlement {
        match self {
            Self::Processed => Settlement::Processed,
            Self::DeadLettered => Settlement::DeadLettered,
            Self::Tagged | Self::Ignored | Self::Unwritten => Settlement::Failed,
        }
    }
}

impl<T> Batch<T> {
    /// The permits held for this batch.
    pub fn permits(&self) -> &[Permit] {
        &self.permits
    }

    /// Settles every record as processed.
    ///
    /// # Errors
    ///
    /// As for [`settle`](Self::settle).
    pub async fn ack(self) -> Result<SettleReport, SettleError> {
        let n = self.records.len();
        self.settle(std::iter::repeat_with(|| Ok(())).take(n)).await
    }

    /// Settles every record as failed with `error`'s message, under the failure policy.
    ///
    /// # Errors
    ///
    /// As for [`settle`](Self::settle).
    pub async fn fail_all(self, error: impl fmt::Display) -> Result<SettleReport, SettleError> {
        let message = error.to_string();
        let n = self.records.len();
        self.settle(std::iter::repeat_with(|| Err(message.as_str().into())).take(n)).await
    }

    /// Settles the records in order, one outcome each: `Ok` processed (written to the output
    /// queue, if any), `Err` failed under the consumer's [`FailurePolicy`]. A record without an
    /// outcome (the iterator ended early) fails with "no outcome given"; extra outcomes are
    /// ignored. Returns once the output and dead-letter writes are durable under their queues'
    /// sync policies; receipts settle then.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future part-way counts the batch as abandoned; writes already handed to a
    /// queue stay there (delivery downstream is at least once).
    ///
    /// # Errors
    ///
    /// A [`SettleError`] if a write failed: those records are counted failed.
    pub async fn settle(
        mut self,
        outcomes: impl IntoIterator<Item = Result<(), BoxError>>,
    ) -> Result<SettleReport, SettleError> {
        let plan = self.plan.clone();
        let mut outcomes = outcomes.into_iter();
        let mut fates = Vec::with_capacity(self.records.len());
        let (mut out, mut out_at, mut dead, mut dead_at) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (i, record) in self.records.iter().enumerate() {
            let outcome = outcomes.next().unwrap_or_else(|| Err("no outcome given".into()));
            let (fate, tags, to_dead) = match (outcome, &plan.on_failure) {
                (Ok(()), _) if plan.output.is_none() => {
                    fates.push(Fate::Processed);
                    continue;
                }
                (Ok(()), _) => (Fate::Processed, Vec::new(), false),
                (Err(_), FailurePolicy::Ignore) => {
                    fates.push(Fate::Ignored);
                    continue;
                }
                (Err(err), FailurePolicy::Tag(tag)) => {
                    (Fate::Tagged, vec![tag.clone(), format!("error={err}")], false)
                }
                (Err(err), FailurePolicy::DeadLetter(_)) => {
                    (Fate::DeadLettered, vec![format!("error={err}")], true)
                }
            };
            let codec = plan.codec.as_ref().expect("validated: writes have a codec");
            match codec.encode(record) {
                Ok(payload) => {
                    let bytes = Envelope { tags, payload }.to_bytes();
                    if to_dead {
                        dead.push(bytes);
                        dead_at.push(i);
                    } else {
                        out.push(bytes);
                        out_at.push(i);
                    }
                    fates.push(fate);
                }
                Err(_) => fates.push(Fate::Unwritten),
            }
        }
        let dead_queue = match &plan.on_failure {
            FailurePolicy::DeadLetter(queue) => Some(queue),
            _ => None,
        };
        let mut error = None;
        for (queue, bytes, at) in [(plan.output.as_ref(), out, out_at), (dead_queue, dead, dead_at)]
        {
            let (Some(queue), false) = (queue, bytes.is_empty()) else { continue };
            let records: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
            let written = match queue.enqueue(&records) {
                Ok(pending) => pending.await,
                Err(err) => Err(err),
            };
            if let Err(err) = written {
                for i in at {
                    fates[i] = Fate::Unwritten;
                }
                error.get_or_insert(err);
            }
        }
        let report = self.finish(&fates);
        match error {
            None => Ok(report),
            Some(error) => Err(SettleError { report, error }),
        }
    }

    /// Records the fates, settles the receipts, releases the permits.
    fn finish(&mut self, fates: &[Fate]) -> SettleReport {
        let mut report = SettleReport::default();
        for (i, fate) in fates.iter().enumerate() {
            match fate {
                Fate::Processed => report.processed += 1,
                Fate::Tagged => report.tagged += 1,
                Fate::DeadLettered => report.dead_lettered += 1,
                Fate::Ignored => report.ignored += 1,
                Fate::Unwritten => report.unwritten += 1,
            }
            if let Some(Some(receipt)) = self.receipts.get(i)
                && !receipt.settle(fate.settlement())
            {
                report.late += 1;
            }
        }
        report.failed = fates.len() - report.processed;
        self.settled = true;
        {
            let mut st = spin_lock(&self.shared.state);
            let c = &mut st.core.counters;
            c.processed += report.processed as u64;
            c.failed += report.failed as u64;
            c.tagged += report.tagged as u64;
            c.dead_lettered += report.dead_lettered as u64;
            c.ignored += report.ignored as u64;
            c.late_settlements += report.late as u64;
        }
        self.shared.settled_changed();
        self.shared.metrics.processed.increment(report.processed as u64);
        self.shared.metrics.failed.increment(report.failed as u64);
        self.permits.clear();
        report
    }
}

impl<T> Deref for Batch<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        &self.records
    }
}

impl<T> Drop for Batch<T> {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        for receipt in self.receipts.iter().flatten() {
            receipt.settle(Settlement::Dropped);
        }
        spin_lock(&self.shared.state).core.counters.abandoned += self.records.len() as u64;
        self.shared.settled_changed();
    }
}

impl<T: fmt::Debug> fmt::Debug for Batch<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Batch")
            .field("records", &self.records)
            .field("permits", &self.permits.len())
            .finish()
    }
}
