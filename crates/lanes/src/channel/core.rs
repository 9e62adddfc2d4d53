//! The pure channel: the buffer, its counters, the overflow rule and the batching rule.
//!
//! No locks, no wakers, no clock reads, no metrics: the handle (`handle.rs`) holds a [`Core`]
//! under the channel's lock, hands it the time when a rule needs it, and turns its answers into
//! wake-ups and metric increments.
//!
//! # Invariants
//!
//! 1. `buf.len() + reserved <= capacity`: a slot handed to a woken producer
//!    ([`Core::hand_off`]) is its own until it offers or goes away; no other producer takes it.
//! 2. The counters reconcile after every call: `emitted = delivered + dropped + spilled +
//!    buf.len()`. A spilled record is counted only once the spill queue took it
//!    ([`Core::spilled`]): an [`Offer::Spill`] answer counts nothing.
//! 3. Records leave in the order they were queued (FIFO), by [`Core::take`], by
//!    [`Offer::DroppedOldest`], or by a discarding [`Core::close`].
//! 4. Once closed, every offer is refused with [`Offer::Closed`] and nothing is queued again.
//! 5. A record handed to the consumer's waiting read ([`Core::await_read`]) never occupies
//!    the buffer: it is counted emitted and delivered at once, and the next take returns it
//!    first. The read waits only while nothing is queued, so this keeps the order of 3.
//! 6. A record's receipt leaves with it, whichever way it leaves (a take, a drop, a
//!    discarding close, a take of the handed record), and only then. The buffer holds the
//!    records alone; the receipts of the queued records sit beside it by queue sequence
//!    (`receipts`), so that a record without one costs the buffer no room (see [`Entry`]).

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use super::buffer::{Buffer, Take, blocked};
use super::config::OverflowKind;

/// Every `STAMP_EVERY`th record (and every record that finds the channel empty) has its
/// enqueue time recorded: enough to know the age of the oldest record within 128 records,
/// without reading the clock on every emit. A clock read costs about 25 ns on the benchmark
/// hosts (a virtual machine's clock): every 32nd record, it was 7% of a one-thread channel's
/// time (BENCHMARKS.md, suite 3, stop 58).
const STAMP_EVERY: u64 = 128;

/// The resolution of tokio's timers: a linger deadline is aimed this much early (at most a
/// tenth of the linger) so a batch leaves within the linger rather than a tick after it.
pub(crate) const TIMER_TICK: Duration = Duration::from_millis(1);

/// The counters of a channel. The flow counters (`emitted` to `blocked_waits`) are kept by the
/// core; the settlement counters are added by the consumer's settlements, under the same lock,
/// so a snapshot reconciles: `emitted = delivered + dropped + spilled + depth`, and
/// `delivered = processed + failed + abandoned + (records in unsettled batches)`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Counters {
    pub(crate) emitted: u64,
    pub(crate) delivered: u64,
    pub(crate) dropped: u64,
    pub(crate) spilled: u64,
    pub(crate) blocked_waits: u64,
    pub(crate) processed: u64,
    pub(crate) failed: u64,
    pub(crate) tagged: u64,
    pub(crate) dead_lettered: u64,
    pub(crate) ignored: u64,
    pub(crate) abandoned: u64,
    pub(crate) late_settlements: u64,
    pub(crate) limit_errors: u64,
}

/// A record with its receipt, if its producer asked for one (the shell's receipt state; any
/// `R` in the tests), as the core takes it in and gives it back.
///
/// The core keeps the two apart: the buffer holds the records, and the receipts of queued
/// records wait beside it by queue sequence (the consumer's read-ahead does the same). A
/// receipt word beside every record doubled a `u64` record's room, in the buffer and in the
/// read-ahead, for a feature most records do not use: a channel of 1,024 `u64`s now holds
/// 8 KB of records rather than 16 KB, and a record costs fewer instructions (cachegrind,
/// `fixed channel 1024`: 149 → 144 a `u64` record; BENCHMARKS.md, suite 3, stop 68).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Entry<T, R> {
    pub(crate) record: T,
    pub(crate) receipt: Option<R>,
}

/// What makes an [`Entry`] where the core queues it: its receipt first, then its record, made
/// straight into its slot (see [`Core::queue`]). An entry already made is one.
pub(crate) trait MakeEntry<T, R> {
    /// The receipt, if any.
    fn receipt(&mut self) -> Option<R>;
    /// The record.
    fn record(self) -> T;
}

impl<T, R> MakeEntry<T, R> for Entry<T, R> {
    #[inline(always)]
    fn receipt(&mut self) -> Option<R> {
        self.receipt.take()
    }

    #[inline(always)]
    fn record(self) -> T {
        self.record
    }
}

/// Whether the registry's shared budget has room for one more record, as the handle found it
/// (it reserves a unit before offering, and only when the channel itself has room).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Room {
    /// No shared budget, or a unit was reserved for this record.
    Free,
    /// The budget is full of records (this channel's or others').
    Full,
}

/// What an offered record did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Offer<T> {
    /// Queued (counted emitted).
    Queued,
    /// Dropped under `DropNewest`, or under `DropOldest` with nothing of its own to drop (the
    /// budget is full of other channels' records). Counted emitted and dropped.
    DroppedNewest(T),
    /// Queued; this, the oldest, was dropped (counted). A reserved budget unit is not used:
    /// the oldest record's unit passes to the new one.
    DroppedOldest(T),
    /// Full under `Spill`: the caller writes it to the spill queue, then calls
    /// [`Core::spilled`]. Nothing is counted yet.
    Spill(T),
    /// Full under `Block`: `budget` says whether the budget (rather than the channel) was full.
    Full { record: T, budget: bool },
    /// The channel is closed.
    Closed(T),
}

/// The longest a partial batch lingers: thirty years (tokio's own endless sleep).
const LINGER_MAX: Duration = Duration::from_secs(86_400 * 365 * 30);

/// Whether a batch is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Due {
    /// Nothing is queued, and the channel is closed: the consumer is done.
    End,
    /// Nothing is queued: wait for one record.
    Empty,
    /// Take this many records now.
    Now(usize),
    /// Wait until this instant, or until `max` records are queued, whichever comes first.
    At(Instant),
}

/// The buffer, its counters, and the rules, for records `T` with receipts `R`.
#[derive(Debug)]
pub(crate) struct Core<T, R> {
    buf: Buffer<T>,
    /// The receipts of queued records, `(sequence, receipt)`, in queue order: a record's
    /// sequence is `head_seq` plus its place in the buffer.
    receipts: VecDeque<(u64, R)>,
    capacity: usize,
    overflow: OverflowKind,
    /// Records ever removed from the front (taken or dropped as oldest).
    head_seq: u64,
    /// The enqueue time of the last sample at or before the head (the oldest record's time,
    /// within `STAMP_EVERY` records), while anything is queued.
    first_stamp: Option<Instant>,
    /// The later `(sequence, enqueue time)` samples, after the head, in order. Kept apart from
    /// the first so that a record that finds the channel empty (every record, at capacity 1)
    /// writes one field rather than clearing and pushing a queue.
    stamps: VecDeque<(u64, Instant)>,
    /// The enqueue time of the oldest record of the partial batch that `DropOldest` took away
    /// since the last take: the batch's linger runs from it. (Run from the oldest record still
    /// queued, a channel that drops records faster than they linger never had a batch due.)
    dropped_from: Option<Instant>,
    closed: bool,
    /// Slots handed to woken producers, not yet used.
    reserved: usize,
    /// The consumer's read waits for the next record (set only while nothing is queued): the
    /// record that comes is handed to it rather than queued.
    reader: bool,
    /// A record handed to the waiting read, not taken yet: counted delivered, outside the
    /// buffer and its capacity.
    handed: Option<Entry<T, R>>,
    pub(crate) counters: Counters,
}

impl<T, R> Core<T, R> {
    pub(crate) fn new(capacity: usize, overflow: OverflowKind) -> Self {
        Self {
            buf: Buffer::new(),
            receipts: VecDeque::new(),
            capacity,
            overflow,
            head_seq: 0,
            first_stamp: None,
            stamps: VecDeque::new(),
            dropped_from: None,
            closed: false,
            reserved: 0,
            reader: false,
            handed: None,
            counters: Counters::default(),
        }
    }

    /// Records queued now (a record handed to the waiting read is not queued).
    pub(crate) fn len(&self) -> usize {
        self.buf.len()
    }

    /// Records the consumer's next take finds: those queued, and one handed to its read.
    #[inline]
    pub(crate) fn ready(&self) -> usize {
        self.buf.len() + usize::from(self.handed.is_some())
    }

    /// The consumer's plain read waits for the next record (`read`), or it waits otherwise
    /// (for a batch, or with a limit's permit to take first) or not at all. A read waits only
    /// while the channel is open and holds nothing: then the next record to come is handed to
    /// it, not queued ([`try_queue`](Self::try_queue), [`offer`](Self::offer)), and counted
    /// delivered as it is handed, as though the read had taken it as it came. A record
    /// queued ahead of it would have to be taken first, so the rule keeps the order.
    pub(crate) fn await_read(&mut self, read: bool) {
        self.reader = read && self.buf.is_empty() && self.handed.is_none() && !self.closed;
    }

    /// The record handed to the consumer's read and not taken, if any (a consumer that goes
    /// away counts it abandoned).
    pub(crate) fn take_handed(&mut self) -> Option<Entry<T, R>> {
        self.handed.take()
    }

    /// Whether a record of a producer holding no handed-off slot fits in the channel itself
    /// (the budget aside).
    pub(crate) fn has_room(&self) -> bool {
        self.buf.len() + self.reserved < self.capacity
    }

    /// Hands free slots to up to `waiters` waiting producers, first come first served; returns
    /// how many to wake. Each woken producer holds its slot until it offers
    /// (`offer(.., held: true, ..)`) or goes away ([`unreserve`](Self::unreserve)).
    pub(crate) fn hand_off(&mut self, waiters: usize) -> usize {
        if self.closed {
            return 0;
        }
        let free = self.capacity.saturating_sub(self.buf.len() + self.reserved);
        let handed = free.min(waiters);
        self.reserved += handed;
        handed
    }

    /// A producer handed a slot went away without using it.
    pub(crate) fn unreserve(&mut self) {
        self.reserved = self.reserved.saturating_sub(1);
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed
    }

    /// Offers `entry`; `held` says its producer was handed a slot (which this uses up).
    /// `budget` is the shared budget's answer, asked only when the record has room in the
    /// channel (pass [`Room::Free`] otherwise); `now` is read only if the record needs a
    /// timestamp.
    // Inlined, with `overflow` under it, into the shell's two callers: out of line, each
    // `try_emit` of a full `DropOldest` channel moved its record and the answer through two
    // more frames (cachegrind, `fixed drop-oldest`: 306 -> 246 instructions a record; 243
    // with `advance` inlined too). The emit future calls them out of line
    // (`ChannelShared::push_now_outlined`).
    #[inline(always)]
    pub(crate) fn offer(
        &mut self,
        entry: Entry<T, R>,
        budget: Room,
        held: bool,
        now: impl FnOnce() -> Instant,
    ) -> Offer<Entry<T, R>> {
        if held {
            self.unreserve();
        }
        if self.closed {
            return Offer::Closed(entry);
        }
        let channel_full = !self.has_room();
        if !channel_full && budget == Room::Free {
            self.counters.emitted += 1;
            self.enqueue(entry, now);
            return Offer::Queued;
        }
        self.overflow(entry, channel_full, now)
    }

    /// The fast path of [`offer`](Self::offer) for a producer holding no handed-off slot when
    /// no budget applies: queues `record` if the channel is open and has room, else hands it
    /// back untouched (nothing counted) for `offer` to decide.
    // On every record's path (see `Emit::poll`).
    #[inline(always)]
    pub(crate) fn try_queue(
        &mut self,
        entry: Entry<T, R>,
        now: impl FnOnce() -> Instant,
    ) -> Result<(), Entry<T, R>> {
        if !self.can_queue() {
            return Err(entry);
        }
        self.queue(entry, now);
        Ok(())
    }

    /// Whether [`try_queue`](Self::try_queue) would queue a record now: the channel is open
    /// and has room for a producer holding no handed-off slot.
    #[inline(always)]
    pub(crate) fn can_queue(&self) -> bool {
        !self.closed && self.has_room()
    }

    /// [`try_queue`](Self::try_queue) once [`can_queue`](Self::can_queue) said yes, of the
    /// entry `entry` makes: the caller's record moves straight into the buffer, rather than
    /// through a refusal's value.
    #[inline(always)]
    pub(crate) fn queue(&mut self, entry: impl MakeEntry<T, R>, now: impl FnOnce() -> Instant) {
        debug_assert!(self.can_queue());
        self.counters.emitted += 1;
        self.enqueue(entry, now);
    }

    /// The overflow rule, for a record that did not fit (the channel or the budget full).
    #[inline(always)]
    fn overflow(
        &mut self,
        entry: Entry<T, R>,
        channel_full: bool,
        now: impl FnOnce() -> Instant,
    ) -> Offer<Entry<T, R>> {
        match self.overflow {
            OverflowKind::Block => Offer::Full { record: entry, budget: !channel_full },
            OverflowKind::DropNewest => {
                self.counters.emitted += 1;
                self.counters.dropped += 1;
                Offer::DroppedNewest(entry)
            }
            OverflowKind::DropOldest => {
                self.counters.emitted += 1;
                self.counters.dropped += 1;
                let Some(oldest) = self.buf.pop_front() else {
                    // Nothing of its own to drop: the budget is full of other channels'.
                    return Offer::DroppedNewest(entry);
                };
                let receipt = self.receipt_of_head();
                if self.dropped_from.is_none() {
                    self.dropped_from = self.first_stamp;
                }
                self.advance(1);
                self.enqueue(entry, now);
                Offer::DroppedOldest(Entry { record: oldest, receipt })
            }
            OverflowKind::Spill => Offer::Spill(entry),
        }
    }

    /// The receipt of the record at the head (before `advance` moves past it), if it has one.
    #[inline(always)]
    fn receipt_of_head(&mut self) -> Option<R> {
        match self.receipts.front() {
            Some(&(seq, _)) if seq == self.head_seq => self.receipts.pop_front().map(|(_, r)| r),
            _ => None,
        }
    }

    /// A record answered [`Offer::Spill`] is in the spill queue: count it.
    pub(crate) fn spilled(&mut self) {
        self.counters.emitted += 1;
        self.counters.spilled += 1;
    }

    /// A producer started waiting for room (counted once per wait).
    pub(crate) fn blocked(&mut self) {
        self.counters.blocked_waits += 1;
    }

    /// Removes up to `n` records from the front into `out`, a record handed to the read
    /// first (counted delivered already); returns how many: `n`, or all there are if fewer,
    /// but a read-ahead of large records may take fewer (at most a block:
    /// [`Buffer::take_into`]). The taken records' receipts go to `receipts`, in order, each
    /// with its record's place among those taken (`0` for the first). The consumer no longer
    /// waits.
    pub(crate) fn take(
        &mut self,
        n: usize,
        out: &mut impl Take<T>,
        receipts: &mut impl FnMut(usize, R),
    ) -> usize {
        self.reader = false;
        self.dropped_from = None;
        let handed = if n > 0 { self.handed.take() } else { None };
        let at = out.held();
        let first = self.head_seq;
        // The queued records first, so that a whole ring or block into an empty read-ahead
        // is still swapped; then the handed record goes in ahead of them (at the front of a
        // read-ahead, where it costs nothing).
        let queued = self.buf.take_into(n - usize::from(handed.is_some()), out);
        self.advance(queued);
        self.counters.delivered += queued as u64;
        let Some(Entry { record, receipt }) = handed else {
            self.take_receipts(first, queued, 0, receipts);
            return queued;
        };
        out.put_at(at, record);
        if let Some(receipt) = receipt {
            receipts(0, receipt);
        }
        self.take_receipts(first, queued, 1, receipts);
        queued + 1
    }

    /// Gives `receipts` the receipts of the `queued` records from sequence `first` on, each
    /// with its place among the records taken (`shift` records went before them).
    #[inline(always)]
    fn take_receipts(
        &mut self,
        first: u64,
        queued: usize,
        shift: usize,
        receipts: &mut impl FnMut(usize, R),
    ) {
        if self.receipts.is_empty() {
            return;
        }
        let end = first + queued as u64;
        while let Some(&(seq, _)) = self.receipts.front()
            && seq < end
        {
            let (seq, receipt) = self.receipts.pop_front().expect("looked at");
            receipts(shift + (seq - first) as usize, receipt);
        }
    }

    /// How many records a read-ahead's take of `max` (at most [`ready`](Self::ready)) finds,
    /// so that permits taken per record for it are all used: all of them for small records;
    /// for large ones, a record handed to the read and the front block's
    /// ([`Buffer::front_run`]). Small records answer without a look: on `recv_many`'s path the
    /// look cost 4 instructions a record.
    #[inline]
    pub(crate) fn read_run(&self, max: usize) -> usize {
        debug_assert!(max <= self.ready());
        if !blocked::<T>() {
            return max;
        }
        (usize::from(self.handed.is_some()) + self.buf.front_run()).min(max)
    }

    /// Whether a record was handed to the read and not taken.
    #[inline]
    pub(crate) fn has_handed(&self) -> bool {
        self.handed.is_some()
    }

    /// Closes the channel; with `discard`, drops what is queued (counted) and returns it,
    /// with the dropped records' receipts. A record handed to the read stays there: it was
    /// delivered.
    pub(crate) fn close(&mut self, discard: bool) -> (Vec<T>, Vec<R>) {
        self.closed = true;
        self.reserved = 0;
        self.reader = false;
        if !discard {
            return (Vec::new(), Vec::new());
        }
        let n = self.buf.len();
        self.counters.dropped += n as u64;
        let dropped = self.buf.drain_all();
        self.advance(n);
        (dropped, self.receipts.drain(..).map(|(_, receipt)| receipt).collect())
    }

    /// When the oldest queued record was enqueued (at most `STAMP_EVERY` records early).
    pub(crate) fn oldest_enqueued(&self) -> Option<Instant> {
        if self.buf.is_empty() {
            return None;
        }
        self.first_stamp
    }

    /// The batching rule: a batch of up to `max` is due once `max` records are queued, when
    /// the channel is closed, or once its oldest record has lingered `flush` (all at once for a
    /// zero `flush`).
    /// `now` is read only for a partial batch of an open channel. A record handed to the read
    /// is due at once, with what is queued behind it.
    pub(crate) fn due(&self, max: usize, flush: Duration, now: impl FnOnce() -> Instant) -> Due {
        let len = self.buf.len();
        if self.handed.is_some() {
            return Due::Now((len + 1).min(max));
        }
        if len == 0 {
            return if self.closed { Due::End } else { Due::Empty };
        }
        if len >= max || self.closed || flush.is_zero() {
            return Due::Now(len.min(max));
        }
        self.lingering(max, flush, now())
    }

    /// [`due`](Self::due) for a partial batch that may linger. Out of line: inlined, the
    /// compiler hoisted `flush / 10` to the top of the consumer's loop, where every read paid
    /// for it (about 40 instructions a call, two calls per record at capacity 1).
    #[inline(never)]
    fn lingering(&self, max: usize, flush: Duration, now: Instant) -> Due {
        // A linger past any instant (`Duration::MAX`, for "only full batches") is thirty years,
        // as tokio's endless sleep: added to an instant, it would overflow.
        let flush = flush.min(LINGER_MAX);
        let early = TIMER_TICK.min(flush / 10);
        let oldest = self.dropped_from.or(self.oldest_enqueued());
        let deadline = oldest.map_or(now, |at| at + flush - early);
        if now >= deadline { Due::Now(self.buf.len().min(max)) } else { Due::At(deadline) }
    }

    /// Queues the record `entry` makes (its receipt beside the buffer), or hands the entry to
    /// the waiting read (counted emitted by the caller). The record is made only where it goes
    /// in, after the clock is read: made before, a large record was copied through the stack
    /// once more (cachegrind, 256-byte records at capacity 64: 545 → 513 instructions a
    /// record), and so was one made with its receipt and taken out of the entry (402 → 464).
    // On every record's path (see `Emit::poll`).
    #[inline(always)]
    fn enqueue(&mut self, mut entry: impl MakeEntry<T, R>, now: impl FnOnce() -> Instant) {
        let seq = self.head_seq + self.buf.len() as u64;
        let receipt = entry.receipt();
        if self.buf.is_empty() {
            // A read waits only while nothing is queued: tested here, off the path of a
            // record that joins others.
            if self.reader {
                self.reader = false;
                self.handed = Some(Entry { record: entry.record(), receipt });
                self.counters.delivered += 1;
                return;
            }
            if !self.stamps.is_empty() {
                self.stamps.clear();
            }
            self.first_stamp = Some(now());
        } else if seq.is_multiple_of(STAMP_EVERY) {
            self.stamps.push_back((seq, now()));
        }
        self.buf.push_back_with(|| entry.record());
        if let Some(receipt) = receipt {
            self.receipts.push_back((seq, receipt));
        }
    }

    #[inline(always)]
    fn advance(&mut self, n: usize) {
        self.head_seq += n as u64;
        while let Some(&(seq, at)) = self.stamps.front()
            && seq <= self.head_seq
        {
            self.first_stamp = Some(at);
            self.stamps.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;

    use super::super::buffer::{BLOCK, BULK};
    use super::*;

    /// A record type of the model test: made from, and known by, its id.
    trait Rec: Clone + PartialEq + std::fmt::Debug {
        fn new(id: u64) -> Self;
        fn id(&self) -> u64;
    }

    impl Rec for u64 {
        fn new(id: u64) -> Self {
            id
        }
        fn id(&self) -> u64 {
            *self
        }
    }

    /// A record large enough to be kept in blocks.
    #[derive(Debug, Clone, PartialEq)]
    struct Wide(u64, [u64; 15]);

    impl Rec for Wide {
        fn new(id: u64) -> Self {
            Wide(id, [id; 15])
        }
        fn id(&self) -> u64 {
            self.0
        }
    }

    fn ids<R: Rec>(records: impl IntoIterator<Item = R>) -> Vec<u64> {
        records.into_iter().map(|r| r.id()).collect()
    }

    /// Whether the model's record `id` is offered with a receipt (its id, in the tests): about
    /// two records in three, so that runs with and without receipts mix.
    fn receipted(id: u64) -> bool {
        id % 3 != 1
    }

    /// The entry of the model's record `id`.
    fn entry<R: Rec>(id: u64) -> Entry<R, u64> {
        Entry { record: R::new(id), receipt: receipted(id).then_some(id) }
    }

    /// Whether `entry` is the model's record `id` with its own receipt.
    fn is_entry<R: Rec>(entry: &Entry<R, u64>, id: u64) -> bool {
        entry.record.id() == id && entry.receipt == receipted(id).then_some(id)
    }

    /// A record with no receipt, for the tests that do not look at receipts.
    fn plain<T>(record: T) -> Entry<T, ()> {
        Entry { record, receipt: None }
    }

    /// A sink for the receipts of a take, for the tests that offer none.
    fn no_receipts() -> impl FnMut(usize, ()) {
        |_, ()| unreachable!("no record has a receipt")
    }

    #[derive(Debug, Clone)]
    enum Op {
        Offer {
            budget_room: bool,
            spill_ok: bool,
            held: bool,
        },
        HandOff(usize),
        Unreserve,
        /// The fast path of a producer holding no handed-off slot, with no budget, this many
        /// times.
        TryQueue(usize),
        /// A take into the consumer's read-ahead (a `VecDeque`, which swaps a whole buffer) or
        /// a batch (a `Vec`); from `BULK` records on, both move them in bulk.
        Take {
            n: usize,
            ahead: bool,
        },
        Close {
            discard: bool,
        },
        Due {
            max: usize,
            flush_ms: u64,
        },
        Wait(u64),
        /// The consumer waits: a plain read (`true`, handed the next record) or otherwise.
        AwaitRead(bool),
        /// A consumer going away takes back what was handed to its read.
        TakeHanded,
    }

    fn op() -> impl Strategy<Value = Op> {
        op_mix(2)
    }

    /// The mix of ops, runs of queued records weighing `queue` (2 in the plain mix; more to
    /// fill several blocks of large records).
    fn op_mix(queue: u32) -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (any::<bool>(), any::<bool>())
                .prop_map(|(b, s)| Op::Offer { budget_room: b || s, spill_ok: s, held: false }),
            2 => any::<bool>().prop_map(|b| Op::Offer { budget_room: b, spill_ok: true, held: true }),
            2 => (0usize..4).prop_map(Op::HandOff),
            1 => Just(Op::Unreserve),
            queue => prop_oneof![3 => Just(1usize), 1 => 1usize..48, 1 => BLOCK..2 * BLOCK]
                .prop_map(Op::TryQueue),
            3 => (prop_oneof![0usize..6, BULK..48, BLOCK - 2..BLOCK + 3], any::<bool>())
                .prop_map(|(n, ahead)| Op::Take { n, ahead }),
            1 => any::<bool>().prop_map(|discard| Op::Close { discard }),
            2 => (1usize..6, 0u64..20).prop_map(|(max, flush_ms)| Op::Due { max, flush_ms }),
            2 => (0u64..10).prop_map(Op::Wait),
            2 => any::<bool>().prop_map(Op::AwaitRead),
            1 => Just(Op::TakeHanded),
        ]
    }

    /// The model's waiting read and the record handed to it.
    #[derive(Default)]
    struct Read {
        waits: bool,
        handed: Option<u64>,
    }

    /// The model's enqueue, sampling times as the core does; a waiting read is handed the
    /// record instead.
    fn enqueue(
        model: &mut VecDeque<(u64, u64)>,
        seq: &mut u64,
        stamps: &mut Vec<(u64, Instant)>,
        read: &mut Read,
        id: u64,
        now: Instant,
    ) {
        if read.waits {
            *read = Read { waits: false, handed: Some(id) };
            return;
        }
        if model.is_empty() || seq.is_multiple_of(STAMP_EVERY) {
            stamps.push((*seq, now));
        }
        model.push_back((id, *seq));
        *seq += 1;
    }

    fn overflow() -> impl Strategy<Value = OverflowKind> {
        prop_oneof![
            Just(OverflowKind::Block),
            Just(OverflowKind::DropNewest),
            Just(OverflowKind::DropOldest),
            Just(OverflowKind::Spill),
        ]
    }

    fn capacity() -> impl Strategy<Value = usize> {
        prop_oneof![1usize..5, BULK..48, BLOCK..3 * BLOCK]
    }

    proptest! {
        /// The core against a `VecDeque` model: the same records leave in the same order, the
        /// overflow rule does what the policy says, the counters reconcile after every step,
        /// the capacity holds, and a batch is due exactly when the rule says.
        #[test]
        fn matches_a_vecdeque_model(
            capacity in capacity(),
            overflow in overflow(),
            ops in proptest::collection::vec(op(), 1..120),
        ) {
            check_model::<u64>(capacity, overflow, ops)?;
        }

        /// The same, with records large enough to be kept in blocks, and ops that fill several
        /// blocks before they take.
        #[test]
        fn matches_a_vecdeque_model_in_blocks(
            capacity in prop_oneof![1usize..5, BLOCK - 1..BLOCK + 2, BLOCK..4 * BLOCK],
            overflow in overflow(),
            ops in proptest::collection::vec(op_mix(12), 1..200),
        ) {
            check_model::<Wide>(capacity, overflow, ops)?;
        }
    }

    fn check_model<R: Rec>(
        capacity: usize,
        overflow: OverflowKind,
        ops: Vec<Op>,
    ) -> Result<(), TestCaseError> {
        {
            let start = Instant::now();
            let mut now = start;
            let mut core = Core::<R, u64>::new(capacity, overflow);
            // (id, queue sequence); the stamp log mirrors the core's sampling of enqueue times.
            let mut model: VecDeque<(u64, u64)> = VecDeque::new();
            let (mut seq, mut stamps) = (0u64, Vec::<(u64, Instant)>::new());
            let mut reserved = 0usize;
            let mut read = Read::default();
            // The oldest sampled time of a partial batch that drop-oldest took records from
            // since the last take: its linger runs from there.
            let mut dropped_from: Option<Instant> = None;
            // The oldest record's time, as sampled: the last stamp at or before the head.
            let sampled = |stamps: &[(u64, Instant)], head: u64| {
                stamps.iter().rev().find(|(s, _)| *s <= head).unwrap().1
            };

            let mut closed = false;
            let (mut next, mut taken, mut dropped, mut spilled) =
                (0u64, Vec::new(), Vec::new(), 0u64);
            let mut read_ahead = VecDeque::new();
            for op in ops {
                match op {
                    Op::HandOff(waiters) => {
                        let free = capacity - model.len() - reserved;
                        let expected = if closed { 0 } else { free.min(waiters) };
                        prop_assert_eq!(core.hand_off(waiters), expected);
                        reserved += expected;
                    }
                    Op::Unreserve => {
                        if reserved > 0 {
                            core.unreserve();
                            reserved -= 1;
                        }
                    }
                    Op::Offer { budget_room, spill_ok, held } => {
                        // Only a producer that was handed a slot offers holding one.
                        let held = held && reserved > 0;
                        let id = next;
                        next += 1;
                        let budget = if budget_room { Room::Free } else { Room::Full };
                        let asked = if held || core.has_room() { budget } else { Room::Free };
                        let answer = core.offer(entry(id), asked, held, || now);
                        if held {
                            reserved -= 1;
                        }
                        let full = model.len() + reserved >= capacity || asked == Room::Full;
                        if held && !closed {
                            prop_assert!(
                                model.len() + reserved < capacity,
                                "a handed slot is free"
                            );
                        }
                        match answer {
                            Offer::Closed(r) => prop_assert!(closed && is_entry(&r, id)),
                            _ if closed => prop_assert!(false, "offered to a closed channel"),
                            Offer::Queued => {
                                prop_assert!(!full);
                                enqueue(&mut model, &mut seq, &mut stamps, &mut read, id, now);
                            }
                            Offer::Full { record, budget } => {
                                prop_assert!(
                                    full && overflow == OverflowKind::Block
                                        && is_entry(&record, id)
                                );
                                prop_assert_eq!(budget, model.len() + reserved < capacity);
                            }
                            Offer::DroppedNewest(r) => {
                                prop_assert!(is_entry(&r, id));
                                let r = r.record.id();
                                prop_assert!(full && r == id);
                                prop_assert!(
                                    overflow == OverflowKind::DropNewest
                                        || (overflow == OverflowKind::DropOldest
                                            && model.is_empty())
                                );
                                dropped.push(r);
                            }
                            Offer::DroppedOldest(r) => {
                                prop_assert!(full && overflow == OverflowKind::DropOldest);
                                let (oldest, head) = model.pop_front().unwrap();
                                dropped_from = dropped_from.or(Some(sampled(&stamps, head)));
                                // The oldest leaves with its own receipt.
                                prop_assert!(is_entry(&r, oldest));
                                let r = r.record.id();
                                dropped.push(r);
                                enqueue(&mut model, &mut seq, &mut stamps, &mut read, id, now);
                            }
                            Offer::Spill(r) => {
                                prop_assert!(
                                    full && overflow == OverflowKind::Spill && is_entry(&r, id)
                                );
                                // The spill write may fail: then nothing is counted.
                                if spill_ok {
                                    core.spilled();
                                    spilled += 1;
                                }
                            }
                        }
                    }
                    Op::TryQueue(times) => {
                        for _ in 0..times {
                            let id = next;
                            next += 1;
                            let answer = core.try_queue(entry(id), || now);
                            // Refused exactly when closed or every slot is taken or handed off: a
                            // producer on the fast path never takes a slot handed to another.
                            if closed || model.len() + reserved >= capacity {
                                prop_assert!(answer.is_err_and(|e| is_entry(&e, id)));
                            } else {
                                prop_assert_eq!(answer, Ok(()));
                                enqueue(&mut model, &mut seq, &mut stamps, &mut read, id, now);
                            }
                        }
                    }
                    Op::Take { n, ahead } => {
                        let mut out = Vec::new();
                        // What a read-ahead's take will find, as the consumer asks before it
                        // takes permits for it.
                        let run = core.read_run(n.min(core.ready()));
                        let mut receipts = Vec::new();
                        let mut sink = |at, receipt| receipts.push((at, receipt));
                        let got = if ahead {
                            // One read-ahead kept across takes, as the consumer keeps its own:
                            // the core may inherit its allocation through a swap.
                            let got = core.take(n, &mut read_ahead, &mut sink);
                            out.extend(read_ahead.drain(..));
                            got
                        } else {
                            core.take(n, &mut out, &mut sink)
                        };
                        let out = ids(out);
                        // Each taken record's receipt, at its place, in order, and no other.
                        let want_receipts: Vec<(usize, u64)> = out
                            .iter()
                            .enumerate()
                            .filter(|&(_, &id)| receipted(id))
                            .map(|(at, &id)| (at, id))
                            .collect();
                        prop_assert_eq!(receipts, want_receipts);
                        // The record handed to the read comes first.
                        let mut want: Vec<u64> = Vec::new();
                        if n > 0 {
                            want.extend(read.handed.take());
                        }
                        let mut rest = (n - want.len()).min(model.len());
                        if ahead {
                            // A read-ahead takes what `read_run` said: all it asks for of small
                            // records; of large ones, at most the front block, and at least one
                            // queued record when it asks for any.
                            prop_assert_eq!(got, run);
                            prop_assert!(
                                got >= want.len() + rest.min(1) && got <= want.len() + rest
                            );
                            if !blocked::<R>() {
                                prop_assert_eq!(got, want.len() + rest);
                            }
                            rest = got - want.len();
                        }
                        want.extend((0..rest).map(|_| model.pop_front().unwrap().0));
                        read.waits = false;
                        dropped_from = None;
                        prop_assert_eq!(got, want.len());
                        prop_assert_eq!(&out, &want);
                        taken.extend(out);
                    }
                    Op::Close { discard } => {
                        let (out, receipts) = core.close(discard);
                        let out = ids(out);
                        if discard {
                            let want: Vec<u64> = model.drain(..).map(|(id, _)| id).collect();
                            prop_assert_eq!(&out, &want);
                            let want: Vec<u64> =
                                want.into_iter().filter(|&id| receipted(id)).collect();
                            prop_assert_eq!(receipts, want);
                            dropped.extend(out);
                        } else {
                            prop_assert!(out.is_empty());
                        }
                        closed = true;
                        reserved = 0;
                        read.waits = false;
                    }
                    Op::Due { max, flush_ms } => {
                        let flush = Duration::from_millis(flush_ms);
                        let due = core.due(max, flush, || now);
                        let expected = match model.front() {
                            _ if read.handed.is_some() => Due::Now((model.len() + 1).min(max)),
                            None if closed => Due::End,
                            None => Due::Empty,
                            Some(_) if model.len() >= max || closed || flush.is_zero() => {
                                Due::Now(model.len().min(max))
                            }
                            Some(&(_, head)) => {
                                let oldest = dropped_from.unwrap_or_else(|| sampled(&stamps, head));
                                let early = TIMER_TICK.min(flush / 10);
                                let deadline = oldest + flush - early;
                                if now >= deadline {
                                    Due::Now(model.len().min(max))
                                } else {
                                    Due::At(deadline)
                                }
                            }
                        };
                        prop_assert_eq!(due, expected);
                    }
                    Op::Wait(ms) => now += Duration::from_millis(ms),
                    Op::AwaitRead(waits) => {
                        core.await_read(waits);
                        // A read waits only for a channel that is open and holds nothing.
                        read.waits = waits && model.is_empty() && read.handed.is_none() && !closed;
                    }
                    Op::TakeHanded => {
                        let handed = core.take_handed();
                        let want = read.handed.take();
                        prop_assert_eq!(handed.as_ref().map(|e| e.record.id()), want);
                        prop_assert!(handed.as_ref().is_none_or(|e| is_entry(e, e.record.id())));
                        let handed = handed.map(|e| e.record.id());
                        taken.extend(handed);
                    }
                }
                let c = core.counters;
                prop_assert!(core.len() + reserved <= capacity);
                prop_assert_eq!(core.len(), model.len());
                prop_assert_eq!(c.emitted, c.delivered + c.dropped + c.spilled + core.len() as u64);
                prop_assert_eq!(
                    c.delivered,
                    (taken.len() + usize::from(read.handed.is_some())) as u64
                );
                prop_assert_eq!(core.ready(), model.len() + usize::from(read.handed.is_some()));
                prop_assert_eq!(core.reader, read.waits);
                prop_assert_eq!(c.dropped, dropped.len() as u64);
                prop_assert_eq!(c.spilled, spilled);
                // The queued records' receipts, and no other, wait beside the buffer.
                let waiting: Vec<u64> = core.receipts.iter().map(|&(_, id)| id).collect();
                let want: Vec<u64> =
                    model.iter().map(|&(id, _)| id).filter(|&id| receipted(id)).collect();
                prop_assert_eq!(waiting, want);
            }
            // FIFO: taken records come out in the order they were offered.
            prop_assert!(taken.windows(2).all(|w| w[0] < w[1]));
        }
        Ok(())
    }

    #[test]
    fn the_oldest_time_is_known_within_stamp_every_records() {
        let t0 = Instant::now();
        let mut core = Core::new(1000, OverflowKind::Block);
        for i in 0..300u64 {
            let at = t0 + Duration::from_millis(i);
            assert_eq!(core.offer(plain(i), Room::Free, false, || at), Offer::Queued);
        }
        let mut out = Vec::new();
        core.take(140, &mut out, &mut no_receipts());
        // The head is record 140; the stamp at or before it is record 128's.
        assert_eq!(core.oldest_enqueued(), Some(t0 + Duration::from_millis(128)));
        core.take(160, &mut out, &mut no_receipts());
        assert_eq!(core.oldest_enqueued(), None);
    }

    #[test]
    fn the_clock_is_read_only_for_a_stamp() {
        let mut core = Core::new(300, OverflowKind::Block);
        let mut reads = 0;
        for i in 0..256u64 {
            core.offer(plain(i), Room::Free, false, || {
                reads += 1;
                Instant::now()
            });
        }
        assert_eq!(reads, 2, "records 0 and 128 are stamped");
    }

    #[test]
    fn a_read_ahead_takes_records_in_order_whether_it_swaps_or_copies() {
        let mut core = Core::new(8, OverflowKind::Block);
        let t0 = Instant::now();
        for i in 0..6 {
            assert!(core.try_queue(plain(i), || t0).is_ok());
        }
        let mut ahead = VecDeque::new();
        // Part of the buffer: copied.
        assert_eq!(core.take(2, &mut ahead, &mut no_receipts()), 2);
        // The rest into a non-empty read-ahead: copied after what it holds.
        assert_eq!(core.take(8, &mut ahead, &mut no_receipts()), 4);
        assert_eq!(ahead.drain(..).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4, 5]);
        // All of it into an empty read-ahead: swapped, and the channel goes on after it.
        for i in 6..9 {
            assert!(core.try_queue(plain(i), || t0).is_ok());
        }
        assert_eq!(core.take(64, &mut ahead, &mut no_receipts()), 3);
        assert_eq!(core.len(), 0);
        assert!(core.try_queue(plain(9), || t0).is_ok());
        assert_eq!(core.take(64, &mut ahead, &mut no_receipts()), 1);
        assert_eq!(ahead.into_iter().collect::<Vec<_>>(), vec![6, 7, 8, 9]);
        assert_eq!(core.counters.delivered, 10);
        assert_eq!(core.oldest_enqueued(), None);
    }
    #[test]
    fn a_bulk_take_keeps_order_from_a_wrapped_buffer() {
        let t0 = Instant::now();
        let mut core = Core::new(64, OverflowKind::Block);
        let mut next = 0u64;
        let mut fill = |core: &mut Core<u64, ()>, n: usize| {
            for _ in 0..n {
                assert!(core.try_queue(plain(next), || t0).is_ok());
                next += 1;
            }
        };
        let mut taken = Vec::new();
        for round in 0..20 {
            // The buffer's head walks around its allocation; full, partly full, wrapped.
            let room = 64 - core.len();
            fill(&mut core, room);
            let mut ahead = VecDeque::new();
            assert_eq!(core.take(BULK + round, &mut ahead, &mut no_receipts()), BULK + round);
            taken.extend(ahead);
            fill(&mut core, 7);
            let mut batch = Vec::new();
            assert_eq!(core.take(BULK + 3, &mut batch, &mut no_receipts()), BULK + 3);
            taken.extend(batch);
        }
        let mut rest = Vec::new();
        core.take(64, &mut rest, &mut no_receipts());
        taken.extend(rest);
        assert_eq!(taken, (0..next).collect::<Vec<_>>());
        assert_eq!(core.counters.delivered, next);
    }
}
