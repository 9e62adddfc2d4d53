//! The async shell of a channel: one lock around the pure [`Core`] (buffer, counters, rules)
//! and the waiters, the wake-ups, the shared budget and the metrics. A snapshot taken under the
//! lock always reconciles.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::Waker;
use std::time::Duration;

use metrics::Counter;
use tokio::time::Instant;

use super::buffer::Take;
use super::channels::ChannelsInner;
use super::config::{ChannelConfig, OverflowKind};
use super::core::{Core, MakeEntry, Offer, Room};
use super::receipt::{ReceiptState, Settlement};
use super::snapshot::ChannelSnapshot;
use crate::util::{
    Contained, Padded, SpinGuard, SpinLock, WaitKey, WaitList, keep_waker, lock, spin_lock,
};

/// A record and, if its producer asked for one, its receipt (the core keeps them apart once
/// the record is queued: [`core::Entry`](super::core::Entry)).
pub(crate) type Entry<T> = super::core::Entry<T, Arc<ReceiptState>>;

impl<T> Entry<T> {
    pub(crate) fn settle(&self, outcome: Settlement) -> bool {
        self.receipt.as_ref().is_none_or(|receipt| receipt.settle(outcome))
    }
}

fn wake_all(wakers: Vec<Waker>) {
    for waker in wakers {
        waker.wake();
    }
}

/// What a push under the channel's lock leaves for after it ([`ChannelShared::push_locked`]):
/// the producers it handed a slot or a budget unit to wake, and whether a producer began to
/// wait (the `blocked_waits` count).
#[derive(Default)]
struct PushLater {
    wakers: Vec<Waker>,
    first_wait: bool,
}

/// The in-flight records shared by a registry's dynamic channels. Producers blocked on it wait
/// in one FIFO list; a unit that comes back while some wait is handed to the first of them.
pub(crate) struct Budget {
    pub(crate) max: usize,
    used: AtomicUsize,
    waiting: AtomicUsize,
    waiters: Mutex<WaitList>,
}

/// Where a producer that asked to wait on the budget stands.
pub(crate) enum BudgetWait {
    /// Queued under this key.
    Waiting(WaitKey),
    /// Units were free: it was handed one at once.
    Handed,
}

impl Budget {
    pub(crate) fn new(max: usize) -> Self {
        Self {
            max,
            used: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            waiters: Mutex::new(WaitList::default()),
        }
    }

    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::SeqCst)
    }

    fn try_reserve(&self) -> bool {
        self.used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |u| (u < self.max).then_some(u + 1))
            .is_ok()
    }

    /// Gives `n` units back; while producers wait, free units go to the first of them.
    fn release(&self, n: usize) {
        let mut wakers = Vec::new();
        self.release_into(n, &mut wakers);
        wake_all(wakers);
    }

    /// [`release`](Self::release), leaving the wakes of the producers handed a unit in
    /// `wakers`, for a caller that holds a channel's lock and wakes them after it.
    fn release_into(&self, n: usize, wakers: &mut Vec<Waker>) {
        if n == 0 {
            return;
        }
        self.used.fetch_sub(n, Ordering::SeqCst);
        if self.waiting.load(Ordering::SeqCst) > 0 {
            let mut waiters = lock(&self.waiters);
            self.hand_off(&mut waiters, wakers);
        }
    }

    /// Hands every free unit to the first waiters (under the waiters' lock).
    fn hand_off(&self, waiters: &mut WaitList, wakers: &mut Vec<Waker>) {
        while !waiters.is_empty() && self.try_reserve() {
            wakers.extend(waiters.pop());
        }
        self.waiting.store(waiters.len(), Ordering::SeqCst);
    }

    /// Queues a producer, unless units are free (then the first waiters, this one last, are
    /// handed one each, their wakes left in `wakers` for the caller to make after its
    /// channel's lock). Waiters counted before the check, so a release that frees a unit after
    /// it sees them.
    fn wait(&self, waker: &Waker, wakers: &mut Vec<Waker>) -> BudgetWait {
        let mut waiters = lock(&self.waiters);
        let key = waiters.push(waker);
        self.waiting.store(waiters.len(), Ordering::SeqCst);
        self.hand_off(&mut waiters, wakers);
        // This producer's own waker is among them when it was handed a unit: harmless.
        if waiters.contains(key) { BudgetWait::Waiting(key) } else { BudgetWait::Handed }
    }

    /// Whether `key` still waits; refreshes its waker if so.
    fn refresh(&self, key: WaitKey, waker: &Waker) -> bool {
        lock(&self.waiters).refresh(key, waker)
    }

    /// A waiting producer went away; a unit it was handed meanwhile goes to the next one.
    fn cancel(&self, key: WaitKey) {
        let removed = {
            let mut waiters = lock(&self.waiters);
            let removed = waiters.remove(key);
            self.waiting.store(waiters.len(), Ordering::SeqCst);
            removed
        };
        if !removed {
            self.release(1);
        }
    }

    /// Wakes every waiter in place (a channel closed: its own waiters find out, the others
    /// keep their places).
    fn wake_everyone(&self) {
        let wakers = lock(&self.waiters).wakers();
        wake_all(wakers);
    }
}

/// Where a blocked producer waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum WaitOn {
    #[default]
    Nothing,
    Channel,
    Budget,
}

/// A producer's place in a wait list: `key` in the list `on` names. Once the list woke it (it
/// is no longer there), it holds what it waited for: a channel slot or a budget unit.
#[derive(Debug, Default)]
pub(crate) struct Waiter {
    key: Option<WaitKey>,
    on: WaitOn,
    counted: bool,
}

impl Waiter {
    /// Whether it still has a place in a list (or a slot or unit handed to it): only then is
    /// there anything for [`ChannelShared::cancel_wait`] to undo.
    #[inline]
    pub(crate) fn is_placed(&self) -> bool {
        self.key.is_some()
    }
}

/// How far the `emitted` and `processed` metrics may run behind the channel's own counts:
/// each is given what it lags by once this many records are unpublished, and the rest at the
/// points `observe::METRICS` names (a take, a wake, the consumer's wait or drop, a close, a
/// snapshot, the channel's drop). Two calls into the `metrics` facade per record were 13.7% of
/// a one-thread channel's samples (BENCHMARKS.md, suite 3, stop 58), recorder or not.
pub(crate) const METRICS_STEP: u64 = 32;

/// What the channel's lock guards: the pure core and the wakers of the shell.
pub(crate) struct State<T> {
    pub(crate) core: Core<T, Arc<ReceiptState>>,
    pub(crate) consumer_taken: bool,
    recv_waker: Option<Waker>,
    recv_want: usize,
    senders: WaitList,
    /// Of the core's `emitted`, how many the `emitted` metric has been given.
    emitted_published: u64,
}

impl<T> State<T> {
    /// The emits the `emitted` metric has not been given, marked given: all of them if `now`,
    /// else only once they make a step ([`METRICS_STEP`]). The caller publishes them once it
    /// has let the lock go ([`ChannelShared::publish_emitted`]).
    #[inline]
    fn unpublished_emits(&mut self, now: bool) -> u64 {
        let behind = self.core.counters.emitted - self.emitted_published;
        if now || behind >= METRICS_STEP {
            self.emitted_published = self.core.counters.emitted;
            behind
        } else {
            0
        }
    }

    #[inline]
    fn consumer_waker(&mut self) -> Option<Waker> {
        // Whether the consumer waits first: while it works through a burst it does not, and
        // this is on every record's path.
        if self.recv_waker.is_some()
            && (self.core.ready() >= self.recv_want || self.core.is_closed())
        {
            self.recv_waker.take()
        } else {
            None
        }
    }

    /// Hands the free slots to the first waiting producers, collecting their wakers.
    fn hand_off(&mut self, wakers: &mut Vec<Waker>) {
        let handed = self.core.hand_off(self.senders.len());
        self.senders.pop_into(handed, wakers);
    }

    /// Asks to be woken when `want` records are queued (or on close). The caller arms
    /// [`ChannelShared::recv_armed`] for a `want` of 1 (see [`ChannelShared::arm`]); `read`
    /// says the consumer's plain read waits (it is handed the next record: [`Core::await_read`]).
    fn wait_for(&mut self, want: usize, read: bool, waker: &Waker) {
        self.core.await_read(read && want <= 1);
        self.recv_want = want.max(1);
        keep_waker(&mut self.recv_waker, waker);
    }
}

/// The channel's `metrics` handles, contained ([`Contained`]): some calls are made under the
/// channel's lock, and others between a change and what completes it (a close's wakes and
/// settlements, a take's records on their way into a batch, a consumer's drop that closes the
/// channel), where a recorder's panic unwound would leave producers or the consumer waiting
/// for good, or records unsettled. Most calls count many records at once (a take's, a batch's,
/// a step of emits or reads), so the containment's few instructions are spread over them; a
/// blocked wait, a dropped record and a spilled one are counted one by one.
pub(crate) struct ChannelMetrics {
    emitted: Contained<Counter>,
    delivered: Contained<Counter>,
    /// `lanes_channel_dropped_total` by reason.
    dropped_newest: Contained<Counter>,
    dropped_oldest: Contained<Counter>,
    dropped_closed: Contained<Counter>,
    spilled: Contained<Counter>,
    blocked_waits: Contained<Counter>,
    pub(crate) processed: Contained<Counter>,
    pub(crate) failed: Contained<Counter>,
}

impl ChannelMetrics {
    fn new(name: &str) -> Self {
        crate::observe::describe_once();
        let labels = [("channel", name.to_owned())];
        let counter = |name: &'static str| Contained(metrics::counter!(name, &labels));
        let dropped = |reason: &'static str| {
            let labels = [("channel", name.to_owned()), ("reason", reason.to_owned())];
            Contained(metrics::counter!("lanes_channel_dropped_total", &labels))
        };
        Self {
            emitted: counter("lanes_channel_emitted_total"),
            delivered: counter("lanes_channel_delivered_total"),
            dropped_newest: dropped("drop_newest"),
            dropped_oldest: dropped("drop_oldest"),
            dropped_closed: dropped("closed"),
            spilled: counter("lanes_channel_spilled_total"),
            blocked_waits: counter("lanes_channel_blocked_waits_total"),
            processed: counter("lanes_channel_processed_total"),
            failed: counter("lanes_channel_failed_total"),
        }
    }

    /// Out of line: called once per [`METRICS_STEP`] emits on a busy channel.
    #[inline(never)]
    fn publish_emitted(&self, n: u64) {
        self.emitted.increment(n);
    }
}

/// What [`ChannelShared::take`] moved: the records taken, and the emits the `emitted` metric
/// is given after the lock ([`ChannelShared::after_take`]).
pub(crate) struct Took {
    pub(crate) records: usize,
    emitted: u64,
}

impl Took {
    /// A take of `records` that has no emits to publish.
    pub(crate) fn records(records: usize) -> Self {
        Self { records, emitted: 0 }
    }
}

/// The records the consumer's plain reads handed out (only the consumer adds to `count`), and
/// how many of them the `processed` metric has been given.
#[derive(Default)]
struct ReadCount {
    count: AtomicU64,
    published: AtomicU64,
}

/// Why [`ChannelShared::try_queue`] did not queue a record at once (its caller still holds
/// it), for the slow path.
pub(crate) enum Refused<'a, T> {
    /// The channel has a shared budget: nothing was tried.
    Unlocked,
    /// Closed or full, found under this lock (a `Block` channel's first poll goes on under it).
    Locked(SpinGuard<'a, State<T>>),
}

/// What [`ChannelShared::push`] did with a record.
pub(crate) enum Pushed<T> {
    Queued,
    /// Dropped under `DropNewest` (or `DropOldest` with nothing of its own to drop).
    DroppedNewest(Entry<T>),
    /// Queued; this, the oldest, was dropped.
    DroppedOldest(Entry<T>),
    /// Full under `Spill`: the caller writes it to the spill queue, then calls `spilled`.
    Spill(Entry<T>),
    /// Full under `Block` (registered as a waiter if the caller gave one).
    Full(Entry<T>),
    Closed(Entry<T>),
}

pub(crate) struct ChannelShared<T> {
    pub(crate) name: Arc<str>,
    pub(crate) config: ChannelConfig<T>,
    pub(crate) dynamic: bool,
    pub(crate) budget: Option<Arc<Budget>>,
    /// The lock producers and the consumer share, on lines of its own.
    pub(crate) state: Padded<SpinLock<State<T>>>,
    pub(crate) producers: AtomicUsize,
    /// Records the consumer's plain reads handed out: counted processed without the lock.
    read: Padded<ReadCount>,
    /// The consumer's waker is registered for the next record and none has come since (nor a
    /// close): the consumer may wait again without taking the lock. Set and cleared under the
    /// lock, read without it; whoever clears it takes the waker and wakes the consumer.
    recv_armed: AtomicBool,
    /// Woken when records may have reached their end (a settle, a drop, a close), for
    /// [`Channel::drained`](super::Channel::drained).
    pub(crate) settled: tokio::sync::Notify,
    /// Callers in `drained`: settles wake `settled` only if there are any (a notify takes a
    /// lock, and a settle happens per batch, per `recv_many` call or per record `recv` reads).
    pub(crate) drain_waiters: AtomicUsize,
    /// Close when the last producer handle is dropped (standalone channels).
    pub(crate) auto_close: bool,
    /// The overflow policy is `Block` (read on every emit).
    blocks: bool,
    pub(crate) home: Weak<ChannelsInner>,
    pub(crate) metrics: ChannelMetrics,
}

impl<T> ChannelShared<T> {
    pub(crate) fn new(
        name: Arc<str>,
        config: ChannelConfig<T>,
        dynamic: bool,
        budget: Option<Arc<Budget>>,
        home: Weak<ChannelsInner>,
    ) -> Self {
        let auto_close = home.strong_count() == 0;
        let blocks = config.overflow.kind() == OverflowKind::Block;
        let core = Core::new(config.capacity, config.overflow.kind());
        Self {
            metrics: ChannelMetrics::new(&name),
            name,
            config,
            dynamic,
            budget,
            state: Padded(SpinLock::new(State {
                core,
                consumer_taken: false,
                recv_waker: None,
                recv_want: 1,
                senders: WaitList::default(),
                emitted_published: 0,
            })),
            producers: AtomicUsize::new(0),
            read: Padded(ReadCount::default()),
            recv_armed: AtomicBool::new(false),
            settled: tokio::sync::Notify::new(),
            drain_waiters: AtomicUsize::new(0),
            auto_close,
            blocks,
            home,
        }
    }

    /// Puts `entry` in the channel or applies the overflow policy (the core decides). `wait`
    /// queues a blocked producer, first come first served: a producer still queued is not
    /// offered again, and one the list woke offers with the slot (or budget unit) it was
    /// handed, so nobody barges past it.
    pub(crate) fn push(&self, entry: Entry<T>, wait: Option<(&mut Waiter, &Waker)>) -> Pushed<T> {
        match wait {
            Some((waiter, waker)) if self.blocks && self.budget.is_none() => {
                self.push_block(entry, waiter, waker)
            }
            wait => self.push_locked(spin_lock(&self.state), entry, wait),
        }
    }

    /// [`push`](Self::push) for a producer that waits for room on a `Block` channel without a
    /// shared budget: the same rule without the budget's branches. A blocked producer comes
    /// here twice per record (to queue for a slot, then to use the slot it was handed), which
    /// makes it the path of a full channel.
    fn push_block(&self, entry: Entry<T>, waiter: &mut Waiter, waker: &Waker) -> Pushed<T> {
        let mut st = spin_lock(&self.state);
        if let Some(key) = waiter.key {
            // Still in line: the channel is open (a close empties the line).
            if st.senders.refresh(key, waker) {
                return Pushed::Full(entry);
            }
            // Woken: the slot it was handed is used now (or freed, if the channel closed).
            *waiter = Waiter { counted: waiter.counted, ..Waiter::default() };
            st.core.unreserve();
        }
        match st.core.try_queue(entry, Instant::now) {
            Ok(()) => {
                *waiter = Waiter::default();
                self.queued(st);
                Pushed::Queued
            }
            Err(entry) => self.block(st, entry, waiter, waker),
        }
    }

    /// A producer that waits for room on a `Block` channel without a shared budget, whose
    /// record the core just refused under `st` (the lock its caller holds): `Closed`, or it
    /// joins the line of blocked producers. The first poll of an emit that finds the channel
    /// full comes here from [`try_queue`](Self::try_queue) with the lock it already took, so
    /// that a producer blocking on every record locks twice per record, not three times.
    #[inline(always)]
    pub(crate) fn block(
        &self,
        mut st: SpinGuard<'_, State<T>>,
        entry: Entry<T>,
        waiter: &mut Waiter,
        waker: &Waker,
    ) -> Pushed<T> {
        if st.core.is_closed() {
            return Pushed::Closed(entry);
        }
        let first_wait = !waiter.counted;
        if first_wait {
            waiter.counted = true;
            st.core.blocked();
        }
        waiter.key = Some(st.senders.push(waker));
        waiter.on = WaitOn::Channel;
        // The recorder is user code: called out of the lock, it may call into this channel.
        drop(st);
        if first_wait {
            self.metrics.blocked_waits.increment(1);
        }
        Pushed::Full(entry)
    }

    /// [`push`](Self::push) for a producer that does not wait: the fast path of
    /// [`try_queue`](Self::try_queue) first, then, under the same lock, the overflow rule.
    #[inline(always)]
    pub(crate) fn push_now(&self, entry: Entry<T>) -> Pushed<T> {
        let mut st = spin_lock(&self.state);
        if self.budget.is_some() {
            return self.push_locked(st, entry, None);
        }
        match st.core.try_queue(entry, Instant::now) {
            Ok(()) => {
                self.queued(st);
                Pushed::Queued
            }
            Err(entry) => self.overflow_now(st, entry),
        }
    }

    /// [`push_now`](Self::push_now) out of line, for the emit future of a channel that does
    /// not block: inlined into the future, the overflow rule cost the `Block` fast path beside
    /// it 2-3% at capacities 64 and 1 (`fixed channel 64 3000`, alternating builds).
    #[inline(never)]
    pub(crate) fn push_now_outlined(&self, entry: Entry<T>) -> Pushed<T> {
        self.push_now(entry)
    }

    /// [`push_locked`](Self::push_locked) for a producer that does not wait on a channel
    /// without a shared budget, under the lock its caller took: the overflow rule without
    /// the waiter's and the budget's branches. Under `DropOldest`, `DropNewest` and `Spill`
    /// every record of a full channel comes here: inlined, with [`Core::offer`], into
    /// `try_emit` (and into [`push_now_outlined`](Self::push_now_outlined), which the emit
    /// future calls), so that its record and answer stay out of extra frames.
    #[inline(always)]
    fn overflow_now(&self, mut st: SpinGuard<'_, State<T>>, entry: Entry<T>) -> Pushed<T> {
        match st.core.offer(entry, Room::Free, false, Instant::now) {
            Offer::Queued => {
                self.queued(st);
                Pushed::Queued
            }
            Offer::Closed(entry) => Pushed::Closed(entry),
            Offer::Full { record, .. } => Pushed::Full(record),
            offer => self.overflowed(st, offer),
        }
    }

    /// What became of a record the overflow rule dropped or sent to the spill queue.
    #[inline(always)]
    fn overflowed(&self, mut st: SpinGuard<'_, State<T>>, offer: Offer<Entry<T>>) -> Pushed<T> {
        match offer {
            Offer::DroppedNewest(entry) => {
                let emitted = st.unpublished_emits(true);
                drop(st);
                self.publish_emitted(emitted);
                self.metrics.dropped_newest.increment(1);
                Pushed::DroppedNewest(entry)
            }
            Offer::DroppedOldest(oldest) => {
                self.queued(st);
                self.metrics.dropped_oldest.increment(1);
                Pushed::DroppedOldest(oldest)
            }
            Offer::Spill(entry) => {
                drop(st);
                Pushed::Spill(entry)
            }
            Offer::Queued | Offer::Closed(_) | Offer::Full { .. } => {
                unreachable!("neither dropped nor spilled")
            }
        }
    }

    /// [`push`](Self::push), under the lock its caller took.
    fn push_locked(
        &self,
        st: SpinGuard<'_, State<T>>,
        entry: Entry<T>,
        wait: Option<(&mut Waiter, &Waker)>,
    ) -> Pushed<T> {
        let mut later = PushLater::default();
        let pushed = self.push_under(st, entry, wait, &mut later);
        // Out of the lock, which `push_under` gave up: wakers and the recorder are user code,
        // and may call into this channel.
        wake_all(later.wakers);
        if later.first_wait {
            self.metrics.blocked_waits.increment(1);
        }
        pushed
    }

    /// [`push_locked`](Self::push_locked)'s rule, under the lock `st` (dropped on return);
    /// leaves in `later` what its caller does after the lock.
    fn push_under(
        &self,
        mut st: SpinGuard<'_, State<T>>,
        mut entry: Entry<T>,
        mut wait: Option<(&mut Waiter, &Waker)>,
        later: &mut PushLater,
    ) -> Pushed<T> {
        loop {
            let (mut held_slot, mut held_unit) = (false, false);
            if let Some((waiter, waker)) = wait.as_mut()
                && let Some(key) = waiter.key
            {
                let still_queued = match waiter.on {
                    WaitOn::Channel => st.senders.refresh(key, waker),
                    WaitOn::Budget => self.budget().refresh(key, waker),
                    WaitOn::Nothing => false,
                };
                if still_queued && !st.core.is_closed() {
                    return Pushed::Full(entry);
                }
                if !still_queued {
                    held_slot = waiter.on == WaitOn::Channel;
                    held_unit = waiter.on == WaitOn::Budget;
                    (waiter.key, waiter.on) = (None, WaitOn::Nothing);
                }
            }
            // A budget unit is reserved only for a record the channel itself has room for.
            let budget = match &self.budget {
                _ if held_unit => Room::Free,
                Some(budget) if (held_slot || st.core.has_room()) && !st.core.is_closed() => {
                    if budget.try_reserve() {
                        Room::Free
                    } else {
                        Room::Full
                    }
                }
                _ => Room::Free,
            };
            match st.core.offer(entry, budget, held_slot, Instant::now) {
                Offer::Queued => {
                    if let Some((waiter, _)) = wait {
                        *waiter = Waiter::default();
                    }
                    self.queued(st);
                    return Pushed::Queued;
                }
                Offer::Closed(entry) => {
                    drop(st);
                    if held_unit {
                        self.budget().release(1);
                    }
                    if let Some((waiter, _)) = wait {
                        self.cancel_wait(waiter);
                    }
                    return Pushed::Closed(entry);
                }
                offer @ (Offer::DroppedNewest(_) | Offer::DroppedOldest(_) | Offer::Spill(_)) => {
                    return self.overflowed(st, offer);
                }
                Offer::Full { record, budget: budget_full } => {
                    let Some((waiter, waker)) = wait.as_mut() else {
                        return Pushed::Full(record);
                    };
                    if !waiter.counted {
                        waiter.counted = true;
                        st.core.blocked();
                        later.first_wait = true;
                    }
                    if !budget_full {
                        // The channel is full: a unit it was handed goes back (to the next
                        // budget waiter), and it queues for a slot.
                        if held_unit {
                            self.budget().release_into(1, &mut later.wakers);
                        }
                        waiter.key = Some(st.senders.push(waker));
                        waiter.on = WaitOn::Channel;
                        return Pushed::Full(record);
                    }
                    // The budget is full: a slot it was handed goes to the next producer, and
                    // it queues on the budget.
                    if held_slot {
                        st.hand_off(&mut later.wakers);
                    }
                    match self.budget().wait(waker, &mut later.wakers) {
                        BudgetWait::Waiting(key) => {
                            (waiter.key, waiter.on) = (Some(key), WaitOn::Budget);
                            return Pushed::Full(record);
                        }
                        BudgetWait::Handed => {
                            // Handed a unit at once: offer again, holding it (the channel may
                            // have filled meanwhile; the loop gives the unit back then).
                            (waiter.key, waiter.on) = (Some(WaitKey::HANDED), WaitOn::Budget);
                            entry = record;
                        }
                    }
                }
            }
        }
    }

    /// Whether a producer waits for room (the overflow policy is `Block`); under any other
    /// policy a full channel decides at once.
    #[inline]
    pub(crate) fn blocks(&self) -> bool {
        self.blocks
    }

    /// The fast path of [`push`](Self::push) for a producer that is not waiting, on a channel
    /// without a shared budget: if the channel is open and has room, queues the entry `entry`
    /// makes (called under the lock, so that the record moves once: from the caller's future
    /// into the buffer); otherwise says why not, with the lock if it took it (for
    /// [`block`](Self::block)), and the caller keeps its record.
    // On every record's path (see `Emit::poll`).
    #[inline(always)]
    pub(crate) fn try_queue(
        &self,
        entry: impl MakeEntry<T, Arc<ReceiptState>>,
    ) -> Result<(), Refused<'_, T>> {
        if self.budget.is_some() {
            return Err(Refused::Unlocked);
        }
        let mut st = spin_lock(&self.state);
        if !st.core.can_queue() {
            return Err(Refused::Locked(st));
        }
        st.core.queue(entry, Instant::now);
        self.queued(st);
        Ok(())
    }

    /// A record went in: out of the lock, wakes the consumer if it waits for it, and gives the
    /// `emitted` metric what it lags by if that wakes the consumer or makes a step.
    // Not `inline(always)`: forced into the emit future's fast path, it left cachegrind's
    // count the same but took `fixed channel 1024 3000` from 88 to 56 M/s on an AMD host.
    #[inline]
    fn queued(&self, mut st: SpinGuard<'_, State<T>>) {
        let consumer = st.consumer_waker();
        if consumer.is_some() {
            self.recv_armed.store(false, Ordering::Release);
        }
        // A consumer that waited learns of the record now: so does the metric.
        let emitted = st.unpublished_emits(consumer.is_some());
        drop(st);
        if let Some(consumer) = consumer {
            consumer.wake();
        }
        self.publish_emitted(emitted);
    }

    /// Gives the `emitted` metric the emits [`State::unpublished_emits`] returned.
    #[inline(always)]
    fn publish_emitted(&self, n: u64) {
        if n > 0 {
            self.metrics.publish_emitted(n);
        }
    }

    fn budget(&self) -> &Budget {
        self.budget.as_deref().expect("only a channel with a budget waits on it")
    }

    /// A record answered `Spill` reached the spill queue: count it (never before).
    pub(crate) fn spilled(&self) {
        let emitted = {
            let mut st = spin_lock(&self.state);
            st.core.spilled();
            st.unpublished_emits(true)
        };
        self.publish_emitted(emitted);
        self.metrics.spilled.increment(1);
    }

    /// Under the lock: the consumer waits for the next record (or the close) with `waker`,
    /// and may wait again without the lock until one comes ([`is_armed`](Self::is_armed)).
    /// `read` says it is a plain read, which is handed the next record
    /// ([`Core::await_read`]).
    pub(crate) fn arm(&self, st: &mut State<T>, waker: &Waker, read: bool) {
        st.wait_for(1, read, waker);
        self.recv_armed.store(true, Ordering::Release);
    }

    /// Under the lock: the consumer waits for `want` records (or the close) with `waker`.
    pub(crate) fn wait_for(&self, st: &mut State<T>, want: usize, waker: &Waker) {
        if want <= 1 {
            return self.arm(st, waker, false);
        }
        st.wait_for(want, false, waker);
        self.recv_armed.store(false, Ordering::Release);
    }

    /// Whether the consumer's waker is still registered for the next record and nothing has
    /// come since its last look (nothing queued, not closed). Read without the lock: a
    /// producer that queues a record (or a close) clears it before waking the consumer.
    #[inline]
    pub(crate) fn is_armed(&self) -> bool {
        self.recv_armed.load(Ordering::Acquire)
    }

    /// Counts `n` records handed out by a plain read as processed (only the consumer calls
    /// it). The `processed` metric is given them once they make a step ([`METRICS_STEP`]).
    #[inline]
    pub(crate) fn count_read(&self, n: u64) {
        let read = self.read.count.load(Ordering::Relaxed) + n;
        self.read.count.store(read, Ordering::Release);
        if read - self.read.published.load(Ordering::Relaxed) >= METRICS_STEP {
            self.publish_reads();
        }
        self.settled_changed();
    }

    /// Gives the `processed` metric every read it has not been given.
    #[inline(never)]
    pub(crate) fn publish_reads(&self) {
        self.publish_reads_up_to(self.read.count.load(Ordering::Acquire));
    }

    /// Gives the `processed` metric the reads up to the `read`th it has not been given. Called
    /// by the consumer and by a snapshot, maybe at once: each read is given once
    /// (`fetch_max`), and a caller with an older count gives nothing.
    fn publish_reads_up_to(&self, read: u64) {
        let published = self.read.published.fetch_max(read, Ordering::AcqRel);
        if read > published {
            self.metrics.processed.increment(read - published);
        }
    }

    /// [`publish_reads`](Self::publish_reads) if any read waits for it: the consumer's
    /// check once it has read what it had, before it goes to the channel or waits.
    #[inline]
    pub(crate) fn catch_up_reads(&self) {
        if self.read.count.load(Ordering::Relaxed) != self.read.published.load(Ordering::Relaxed) {
            self.publish_reads();
        }
    }

    /// Records may have reached their end: wakes callers of `drained`, if any. A waiter counts
    /// itself (SeqCst) before it checks; a change made before this load is seen by its check.
    #[inline]
    pub(crate) fn settled_changed(&self) {
        if self.drain_waiters.load(Ordering::SeqCst) > 0 {
            self.settled.notify_waiters();
        }
    }

    /// Closed, nothing queued, and every delivered record settled (processed, failed or
    /// abandoned).
    ///
    /// Once drained, the `processed` metric is given the reads it lagged by, so that a caller
    /// of `drained` finds it exact.
    pub(crate) fn is_drained(&self) -> bool {
        let st = spin_lock(&self.state);
        let c = st.core.counters;
        let read = self.read.count.load(Ordering::Acquire);
        let drained = st.core.is_closed()
            && st.core.len() == 0
            && c.delivered == c.processed + read + c.failed + c.abandoned;
        drop(st);
        if drained {
            self.publish_reads_up_to(read);
        }
        drained
    }

    /// A blocked producer went away: it leaves its list, and what it was handed meanwhile (a
    /// slot, a budget unit) goes to the next producer in line.
    pub(crate) fn cancel_wait(&self, waiter: &mut Waiter) {
        let waiter = std::mem::take(waiter);
        let Some(key) = waiter.key else { return };
        match waiter.on {
            WaitOn::Nothing => {}
            WaitOn::Channel => {
                let mut wakers = Vec::new();
                {
                    let mut st = spin_lock(&self.state);
                    if !st.senders.remove(key) {
                        st.core.unreserve();
                        st.hand_off(&mut wakers);
                    }
                }
                wake_all(wakers);
            }
            WaitOn::Budget => self.budget().cancel(key),
        }
    }

    /// Removes up to `n` records from the front, for the consumer ([`Core::take`]: their
    /// receipts go to `receipts`; returns how many, with the emits the metric lags by), and
    /// hands the freed slots to the first waiting producers, collecting their wakers in
    /// `wakers` (the consumer's own, reused: no allocation per hand-off).
    pub(crate) fn take(
        &self,
        st: &mut State<T>,
        n: usize,
        out: &mut impl Take<T>,
        receipts: &mut impl FnMut(usize, Arc<ReceiptState>),
        wakers: &mut Vec<Waker>,
    ) -> Took {
        let taken = st.core.take(n, out, receipts);
        if !st.senders.is_empty() {
            st.hand_off(wakers);
        }
        Took { records: taken, emitted: st.unpublished_emits(true) }
    }

    /// After `take`: outside the lock, wakes producers (emptying `wakers`) and returns budget.
    #[inline(always)]
    pub(crate) fn after_take(&self, took: Took, wakers: &mut Vec<Waker>) {
        let Took { records: n, emitted } = took;
        match wakers.len() {
            0 => {}
            // The common hand-off, without a drain's bookkeeping.
            1 => wakers.pop().expect("one waker").wake(),
            _ => wakers.drain(..).for_each(Waker::wake),
        }
        if let Some(budget) = &self.budget {
            budget.release(n);
        }
        self.metrics.delivered.increment(n as u64);
        self.publish_emitted(emitted);
    }

    /// Closes the channel: producers get `Closed`; the consumer drains what is queued (unless
    /// the channel discards on close, or `discard` is set because the consumer went away).
    pub(crate) fn close_with(&self, discard: bool) {
        let ((dropped, receipts), wakers, consumer, was_closed, emitted) = {
            let mut st = spin_lock(&self.state);
            let was_closed = st.core.is_closed();
            let dropped = st.core.close(discard || self.config.discard_on_close);
            let mut wakers = Vec::new();
            let n = st.senders.len();
            st.senders.pop_into(n, &mut wakers);
            let consumer = st.recv_waker.take();
            self.recv_armed.store(false, Ordering::Release);
            (dropped, wakers, consumer, was_closed, st.unpublished_emits(true))
        };
        // No emit comes after a close: the metric is given what it lagged by.
        self.publish_emitted(emitted);
        self.drop_closed(dropped, receipts);
        wake_all(wakers);
        if let Some(consumer) = consumer {
            consumer.wake();
        }
        self.settled_changed();
        if !was_closed && let Some(home) = self.home.upgrade() {
            home.forget(&self.name, (self as *const Self).cast());
        }
    }

    /// Records a close took out of the queue: counted dropped, their receipts settled, their
    /// part of a shared budget given back (its waiters woken).
    fn drop_closed(&self, dropped: Vec<T>, receipts: Vec<Arc<ReceiptState>>) {
        self.metrics.dropped_closed.increment(dropped.len() as u64);
        if let Some(budget) = &self.budget {
            budget.release(dropped.len());
            budget.wake_everyone();
        }
        for receipt in &receipts {
            receipt.settle(Settlement::Dropped);
        }
        drop((dropped, receipts));
    }

    pub(crate) fn is_closed(&self) -> bool {
        spin_lock(&self.state).core.is_closed()
    }

    /// The channel's counts, exact and reconciled; the `emitted` and `processed` metrics are
    /// given what they lagged by ([`METRICS_STEP`]).
    pub(crate) fn snapshot(&self) -> ChannelSnapshot {
        let mut st = spin_lock(&self.state);
        let emitted = st.unpublished_emits(true);
        let read = self.read.count.load(Ordering::Acquire);
        let snapshot = self.snapshot_locked(&st, read);
        drop(st);
        // The metrics are given exactly what the snapshot counts.
        self.publish_emitted(emitted);
        self.publish_reads_up_to(read);
        snapshot
    }

    /// The snapshot under the lock `st`, with `read` records handed out by plain reads.
    fn snapshot_locked(&self, st: &State<T>, read: u64) -> ChannelSnapshot {
        let c = st.core.counters;
        let oldest_age = st.core.oldest_enqueued().map_or(Duration::ZERO, |at| at.elapsed());
        ChannelSnapshot {
            name: self.name.to_string(),
            owner: self.config.owner.as_deref().map(str::to_owned),
            dynamic: self.dynamic,
            overflow: self.config.overflow.kind(),
            capacity: self.config.capacity,
            depth: st.core.len(),
            emitted: c.emitted,
            delivered: c.delivered,
            dropped: c.dropped,
            spilled: c.spilled,
            blocked_waits: c.blocked_waits,
            processed: c.processed + read,
            failed: c.failed,
            tagged: c.tagged,
            dead_lettered: c.dead_lettered,
            ignored: c.ignored,
            abandoned: c.abandoned,
            late_settlements: c.late_settlements,
            limit_errors: c.limit_errors,
            closed: st.core.is_closed(),
            has_consumer: st.consumer_taken,
            oldest_age_ms: u64::try_from(oldest_age.as_millis()).unwrap_or(u64::MAX),
        }
    }
}

impl<T> Drop for ChannelShared<T> {
    /// A channel that goes away unclosed (a registry's, whose handles are all gone) gives its
    /// metrics what they lagged by. Records still queued, with no consumer left to read them
    /// (a channel closed, or never read, before a consumer was taken), are dropped as a
    /// discarding close drops them: counted, their receipts settled, their part of a shared
    /// budget given back.
    fn drop(&mut self) {
        let ((dropped, receipts), emitted) = {
            let mut st = spin_lock(&self.state);
            (st.core.close(true), st.unpublished_emits(true))
        };
        self.publish_emitted(emitted);
        if !dropped.is_empty() {
            self.drop_closed(dropped, receipts);
        }
        self.publish_reads();
    }
}
