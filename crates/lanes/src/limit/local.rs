//! The in-process backend: per limit an atomic fast path ([`Cell`](super::cell)), and a
//! [`LimitTable`] under a mutex with the wakers of its waiters for when someone must wait.
//!
//! # Implementation details
//!
//! While nobody waits, `Limits::acquire` and `try_acquire` take and return a permit with a few
//! atomic operations on the limit's cell and never touch the mutex. The first caller that must
//! wait at another priority than the default (or any ticket's first ask) hands the limit to
//! the table (`go_slow`, under the mutex): from then on the table grants,
//! counting the fast permits still out as held, until its queue is empty and it holds no
//! ticket's permit, when it hands the limit back (`settle`). Tickets (the [`LimitBackend`]
//! protocol: leases, checks, renewals) always live in the table.
//!
//! A caller of the default priority that finds no permit while the fast path governs waits in
//! the limit's *line* instead: a FIFO list beside the cell, under a lock of its own, as a
//! semaphore's waiters wait (cell invariant 5). A returned permit goes straight to the first
//! in line, with its fencing token, through the caller's [`Handoff`]: no ticket, no table, no
//! hash lookup. Anything the line does not keep (another priority, a ticket, a rate, a
//! redefinition, 65,535 permits held at once) hands the limit to the table, which takes the
//! line's callers with it, in order, as tickets of the default priority.
//!
//! A waiter's future in the table asks it with its ticket on every poll and, unless granted,
//! leaves its waker under its ticket. Every change that can grant (a release, a withdrawal, a
//! redefinition, a grant that moved the queue) *pumps* the limit: it grants the queue head(s)
//! on their waiters' behalf and wakes exactly those waiters; if the head is only waiting for
//! the bucket, it wakes the head, which sleeps until the refill. Only the head ever sleeps on a
//! timer (a refill, or the end of the earliest lease when permits are leased), so a limit needs
//! one timer, not one per waiter.

use std::collections::hash_map::Entry;
use std::fmt;
use std::future::poll_fn;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::time::{Instant, Sleep, sleep_until};

use super::backend::{Answer, LimitBackend};
use super::cell::{Cell, Miss, Returned, Turn};
use super::config::LimitSpec;
use super::core::{Acquire, Grant, LimitTable, Next, Released};
use super::error::LimitError;
use super::metrics::{LimitMetrics, count_off};
use super::priority::Priority;
use super::snapshot::LimitInfo;
use crate::BoxFuture;
use crate::util::FastMap;
use crate::util::{WaitKey, WaitList, call_contained, lock, same_waker};

#[derive(Debug)]
struct Inner {
    /// The limits the table governs now (see the module docs), and their waiters.
    table: LimitTable,
    /// The highest fencing token of every limit removed so far: a limit defined anew starts
    /// above it.
    fence_floor: u64,
    /// Waiters by ticket (tickets are unique per backend). Only looked up, never iterated, so
    /// the map's order cannot leak into answers.
    wakers: FastMap<u64, Waiter>,
    /// What the lock's holder does once it lets the lock go ([`InnerGuard`]).
    later: Later,
}

/// The wakes and counts a holder of the table's lock makes after it: a waker and the `metrics`
/// recorder are user code, which may call back into this limit (and take the lock again).
#[derive(Debug, Default)]
struct Later {
    wakers: Vec<Waker>,
    /// Leases that ran out, by limit: how many, and the limit's `expired` counter (its name
    /// where its handles were not resolved yet: resolving them calls the recorder too).
    expired: Vec<(Expired, u64)>,
}

/// The `expired` counter of a limit, or its name where its handles were not resolved yet.
#[derive(Debug)]
enum Expired {
    Counter(metrics::Counter),
    Limit(Arc<str>),
}

impl Later {
    /// Wakes every waker and makes every count, each contained: a waker that panics (user
    /// code) leaves none of the others unwoken, whose grants were already handed to them. The
    /// first panic is raised again once all are done, unless the thread is unwinding already.
    fn run(self) {
        let mut panicked = None;
        for waker in self.wakers {
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| waker.wake())) {
                panicked.get_or_insert(payload);
            }
        }
        // Contained (a recorder's panic is reported by the panic hook): this runs in drops
        // too, a permit's among them.
        for (expired, n) in self.expired {
            let _ = call_contained(|| match expired {
                Expired::Counter(counter) => counter.increment(n),
                Expired::Limit(name) => {
                    metrics::counter!("lanes_limit_expired_total", "limit" => name.to_string())
                        .increment(n);
                }
            });
        }
        if let Some(payload) = panicked
            && !std::thread::panicking()
        {
            std::panic::resume_unwind(payload);
        }
    }
}

/// The table's lock, held: when it is dropped it lets the lock go first, then wakes the waiters
/// and makes the counts its holder left in [`Later`] (also while a panic unwinds). Every
/// wake-up and count of the table is made that way, never under the lock.
struct InnerGuard<'a>(Option<std::sync::MutexGuard<'a, Inner>>);

fn lock_inner(inner: &Mutex<Inner>) -> InnerGuard<'_> {
    InnerGuard(Some(lock(inner)))
}

impl std::ops::Deref for InnerGuard<'_> {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        self.0.as_deref().expect("held until dropped")
    }
}

impl std::ops::DerefMut for InnerGuard<'_> {
    fn deref_mut(&mut self) -> &mut Inner {
        self.0.as_deref_mut().expect("held until dropped")
    }
}

impl Drop for InnerGuard<'_> {
    fn drop(&mut self) {
        let Some(mut guard) = self.0.take() else { return };
        let later = std::mem::take(&mut guard.later);
        drop(guard);
        later.run();
    }
}

/// A waiting ticket's waker, and whether a release may grant on its behalf (and with which
/// lease) or only wake it so it asks itself.
#[derive(Debug)]
struct Waiter {
    waker: Waker,
    grant: OnBehalf,
    /// Where a grant made on its behalf is handed over, so the woken waiter takes it without
    /// the lock (the facade's waiters have one; a server ticket does not).
    handoff: Option<Handoff>,
}

/// A grant handed to a woken waiter without the lock.
pub(crate) type Handoff = Arc<GrantCell>;

/// Where a grant made on a waiter's behalf waits for it: set once (under the table's lock),
/// read without a lock. Three plain atomics: a `OnceLock`'s set goes through its `Once`, which
/// cost a contended cycle about 170 instructions.
#[derive(Debug, Default)]
pub(crate) struct GrantCell {
    /// The grant's fencing token; 0 until set (a table's tokens start at 1).
    fence: AtomicU64,
    /// The lease's end, seconds and nanoseconds; `NO_LEASE` nanoseconds for none.
    secs: AtomicU64,
    nanos: AtomicU32,
    /// The ticket of a waiter the table took from its limit's line (0 while it is in line or
    /// never was): a grant set after it is the table's, held by that ticket.
    ticket: AtomicU64,
}

/// [`GrantCell::nanos`] of a grant without a lease: more than any `Duration` holds.
const NO_LEASE: u32 = u32::MAX;

impl GrantCell {
    /// Hands `grant` over. Called once per wait, under the table's lock.
    fn set(&self, grant: Grant) {
        debug_assert!(grant.fencing_token != 0, "a table's fencing tokens start at 1");
        debug_assert_eq!(self.fence.load(Ordering::Relaxed), 0, "one grant per wait");
        let (secs, nanos) =
            grant.expires_at.map_or((0, NO_LEASE), |at| (at.as_secs(), at.subsec_nanos()));
        self.secs.store(secs, Ordering::Relaxed);
        self.nanos.store(nanos, Ordering::Relaxed);
        // Release: whoever sees the token sees the lease stored above.
        self.fence.store(grant.fencing_token, Ordering::Release);
    }

    /// The grant handed over, if any.
    pub(crate) fn get(&self) -> Option<Grant> {
        let fencing_token = self.fence.load(Ordering::Acquire);
        if fencing_token == 0 {
            return None;
        }
        let nanos = self.nanos.load(Ordering::Relaxed);
        let expires_at =
            (nanos != NO_LEASE).then(|| Duration::new(self.secs.load(Ordering::Relaxed), nanos));
        Some(Grant { fencing_token, expires_at })
    }

    /// The table's ticket of a waiter it took from the line, if it did.
    pub(crate) fn moved(&self) -> Option<u64> {
        match self.ticket.load(Ordering::Acquire) {
            0 => None,
            ticket => Some(ticket),
        }
    }

    /// Empty again, for the next wait (by its one holder).
    fn clear(&self) {
        self.fence.store(0, Ordering::Relaxed);
        self.ticket.store(0, Ordering::Relaxed);
    }
}

/// Empty [`Handoff`]s a thread keeps for its next waits.
const SPARE_HANDOFFS: usize = 16;

thread_local! {
    /// [`Handoff`]s finished waits on this thread left empty for the next ones, so that a
    /// limit whose callers wait on every acquire does not allocate one per wait.
    static SPARE_HANDOFF: std::cell::RefCell<Vec<Handoff>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// An empty [`Handoff`] for one wait; it goes back to its thread's spares when dropped, if
/// nothing else holds it then.
pub(crate) struct WaitHandoff(Option<Handoff>);

impl WaitHandoff {
    /// A spare from this thread's list, or a new cell.
    pub(crate) fn new() -> Self {
        let spare = SPARE_HANDOFF.try_with(|spare| spare.borrow_mut().pop()).ok().flatten();
        Self(Some(spare.unwrap_or_default()))
    }
}

impl std::ops::Deref for WaitHandoff {
    type Target = Handoff;

    fn deref(&self) -> &Handoff {
        self.0.as_ref().expect("held until dropped")
    }
}

impl Drop for WaitHandoff {
    fn drop(&mut self) {
        let Some(handoff) = self.0.take() else { return };
        // Only a handoff nobody else holds is emptied and kept (a waiter's entry in the table
        // may still hold it after a cancelled wait: then it is freed with the entry). Nothing
        // makes a `Weak` of it, so a count of one means this wait is its one holder and nobody
        // can clone it any more (cheaper than `Arc::get_mut`, which locks the weak count); the
        // fence pairs with the other holders' release of their clones, as `Arc`'s drop does.
        if Arc::strong_count(&handoff) == 1 {
            std::sync::atomic::fence(Ordering::Acquire);
            handoff.clear();
            let _ = SPARE_HANDOFF.try_with(|spare| {
                let mut spare = spare.borrow_mut();
                if spare.len() < SPARE_HANDOFFS {
                    spare.push(handoff);
                }
            });
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OnBehalf {
    /// Grant with this lease, then wake.
    Grant(Option<Duration>),
    /// Only wake: the waiter asks again itself (it knows its lease).
    WakeOnly,
}

impl Inner {
    fn park(&mut self, ticket: u64, waker: &Waker, grant: OnBehalf, handoff: Option<&Handoff>) {
        match self.wakers.entry(ticket) {
            Entry::Occupied(mut existing) => {
                let existing = existing.get_mut();
                if !same_waker(&existing.waker, waker) {
                    existing.waker = waker.clone();
                }
                existing.grant = grant;
            }
            Entry::Vacant(entry) => {
                let handoff = handoff.cloned();
                entry.insert(Waiter { waker: waker.clone(), grant, handoff });
            }
        }
    }
}

/// Limits held in this process. Reachable directly through [`Limits::new`](super::Limits::new)
/// and as a [`LimitBackend`].
pub struct LocalLimits {
    shared: Arc<LocalState>,
}

#[derive(Debug)]
struct LocalState {
    inner: Mutex<Inner>,
    /// Every defined limit's fast path, found by name without the mutex. Lock order: `inner`
    /// before `slots`.
    slots: RwLock<FastMap<Arc<str>, Arc<Slot>>>,
    origin: Instant,
    tickets: AtomicU64,
    /// The table's waiting room, which each limit's line keeps too.
    max_waiters: usize,
    /// The most limits defined at once (`usize::MAX`: no cap).
    max_limits: std::sync::atomic::AtomicUsize,
}

/// Entries in a thread's cache of recently looked-up slots.
const RECENT_WAYS: usize = 16;

thread_local! {
    /// The slots this thread looked up by name lately, one per way (the name's hash picks it),
    /// so that a lookup by name (`Limits::acquire(name)`) skips the shared map's lock: two
    /// atomic read-modify-writes on a word every thread shares, about as dear as the rest of
    /// an uncontended acquire. An entry is used only for the same backend and name while its
    /// limit is not removed (a redefinition changes a slot in place; a removal marks it), so it
    /// never answers what the map would not. It keeps at most 16 slots per thread alive after
    /// their limit's removal or their backend's drop (with the backend's allocation, not its
    /// contents), until their way is reused or the thread ends.
    static RECENT: std::cell::RefCell<[Recent; RECENT_WAYS]> =
        const { std::cell::RefCell::new([const { Recent { seen: 0, slot: None } }; RECENT_WAYS]) };
}

/// One way of [`RECENT`].
struct Recent {
    /// The hash of the last name that missed here. A slot is kept only when the same name
    /// misses twice in a row: a thread that looks up many names once each (keyed limits)
    /// would otherwise replace an entry on every lookup, touching the evicted slot's
    /// reference count (a cold cache line) and gaining nothing.
    seen: u64,
    slot: Option<Arc<Slot>>,
}

/// The way of `name` in [`RECENT`], and its hash.
fn recent_way(name: &str) -> (usize, u64) {
    use std::hash::BuildHasher;
    let hash = foldhash::fast::FixedState::with_seed(0).hash_one(name);
    // The high bits: foldhash's low bits mix less for short keys.
    ((hash >> 60) as usize % RECENT_WAYS, hash)
}

/// One limit's fast path, shared by its permits.
#[derive(Debug)]
pub(crate) struct Slot {
    pub(crate) name: Arc<str>,
    pub(crate) cell: Cell,
    shared: Weak<LocalState>,
    removed: AtomicBool,
    /// Whether a ticket of this limit ever asked for a lease: only then (or with a rate) do
    /// its table operations need the clock.
    leased: AtomicBool,
    /// Resolved on first use: a limit only a remote client ever touches (through `lanes
    /// serve`) gets no series of this process's handles, so deleting it leaves none behind.
    metrics: std::sync::OnceLock<LimitMetrics>,
    /// Callers of the default priority waiting for a permit while the fast path governs
    /// (see [`Line`]). Made when the first caller joins: most limits never have anyone in
    /// line, and a keyed limit's slot stays small (16 bytes here, not 96).
    line: Mutex<Option<Box<Line>>>,
}

/// The callers of one limit that wait for a permit at the default priority while the fast
/// path governs it, in arrival order: a semaphore's wait list (cell invariant 5). A returned
/// permit goes straight to the first of them, through its [`Handoff`], with no ticket, no
/// table and no hash lookup. The first caller of another priority, the first ticket (a
/// server's), a redefinition, or a full count field in the cell's word hands the limit to
/// the table, which takes the line with it, in order.
#[derive(Debug, Default)]
struct Line {
    waiters: WaitList<Handoff>,
    /// Callers refused because the line held `max_waiters` already.
    refused: u64,
    /// Callers that left the line without a permit (timed out or cancelled).
    withdrawn: u64,
}

/// What [`Slot::line_counts`] read.
struct LineCounts {
    waiting: usize,
    /// Permits held through the fast path (its own and those handed over in line).
    in_use: u32,
    refused: u64,
    withdrawn: u64,
    /// Grants, the last token, the peak (see [`Cell::counters`]).
    counters: (u64, u64, u32),
}

/// Where a caller that asked to wait in line stands.
pub(crate) enum Joined {
    /// A permit was free and nobody was in line: taken, with this fencing token.
    Granted(u64),
    /// In line under this key.
    InLine(WaitKey),
    /// The table governs the limit (or must take it): ask the table.
    Table,
}

impl Slot {
    /// Returns a fast permit, handing it to the first in line if anyone waits there, or
    /// letting the table hand it on if the table governs the limit now.
    pub(crate) fn release_fast(&self) {
        match self.cell.release_fast() {
            Returned::Done => {}
            Returned::Line => {
                if self.hand_on() {
                    self.via_table(true);
                }
            }
            Returned::Table => self.via_table(false),
        }
    }

    /// Lets the table hand the limit's free permits on; `take` hands it the limit first if
    /// the fast path governs (the line could not hand a permit on), else a limit handed back
    /// meanwhile is left to the fast path.
    #[cold]
    fn via_table(&self, take: bool) {
        let Some(shared) = self.shared.upgrade() else { return };
        let local = LocalLimits { shared };
        let now = local.now_for(self, None);
        let mut inner = lock_inner(&local.shared.inner);
        if take && !self.cell.is_slow() {
            local.go_slow(&mut inner, self, now);
        }
        LocalLimits::settle(&mut inner, self, now);
    }

    /// Queues a caller in line (its grant comes through `handoff`), unless a permit is free
    /// and nobody is in line, or the table must answer.
    ///
    /// # Errors
    ///
    /// [`LimitError::TooManyWaiters`] when `max_waiters` callers are in line already.
    pub(crate) fn join_line(
        &self,
        waker: &Waker,
        handoff: &Handoff,
        max_waiters: usize,
    ) -> Result<Joined, LimitError> {
        let mut line = lock(&self.line);
        match self.cell.enter_line() {
            Turn::Taken(fence) => Ok(Joined::Granted(fence)),
            Turn::Table => Ok(Joined::Table),
            Turn::Wait => {
                let line = line.get_or_insert_with(Box::default);
                if line.waiters.len() < max_waiters {
                    return Ok(Joined::InLine(line.waiters.push_with(waker, handoff.clone())));
                }
                line.refused += 1;
                if line.waiters.is_empty() {
                    self.cell.leave_line();
                }
                Err(LimitError::TooManyWaiters { limit: self.name.to_string(), max: max_waiters })
            }
        }
    }

    /// Whether `key` is still in line; refreshes its waker if so.
    pub(crate) fn refresh_line(&self, key: WaitKey, waker: &Waker) -> bool {
        lock(&self.line).as_mut().is_some_and(|line| line.waiters.refresh(key, waker))
    }

    /// Takes a caller out of line before its turn; `false` if it is no longer there (it was
    /// handed a permit, or the table took it: the caller undoes either).
    pub(crate) fn leave_line(&self, key: WaitKey) -> bool {
        let mut line = lock(&self.line);
        let Some(line) = line.as_mut() else { return false };
        if !line.waiters.remove(key) {
            return false;
        }
        line.withdrawn += 1;
        if line.waiters.is_empty() {
            self.cell.leave_line();
        }
        true
    }

    /// Hands free permits to the first callers in line, waking them once the line's lock is
    /// released. Answers whether the table must take the limit (the word's count is full,
    /// or the limit now has a rate).
    fn hand_on(&self) -> bool {
        let mut first: Option<Waker> = None;
        let mut more = Vec::new();
        let to_table = {
            let mut line = lock(&self.line);
            loop {
                // Emptied meanwhile: its last caller left, or the table took the line.
                let Some(line) = line.as_mut().filter(|line| !line.waiters.is_empty()) else {
                    break false;
                };
                match self.cell.take_for_line() {
                    Turn::Taken(fence_token) => {
                        let (waker, handoff) = line.waiters.pop_with().expect("someone in line");
                        handoff.set(Grant { fencing_token: fence_token, expires_at: None });
                        // Let go of the cell before the wake, so its waiter can reuse it.
                        drop(handoff);
                        match first {
                            None => first = Some(waker),
                            Some(_) => more.push(waker),
                        }
                        if line.waiters.is_empty() {
                            self.cell.leave_line();
                        }
                    }
                    Turn::Wait => break false,
                    Turn::Table => break true,
                }
            }
        };
        if let Some(waker) = first {
            waker.wake();
        }
        // Usually empty: one returned permit hands on to one caller.
        if !more.is_empty() {
            more.into_iter().for_each(Waker::wake);
        }
        to_table
    }

    /// For the snapshot (call under the table's lock): callers in line, those the line
    /// refused and lost, and the cell's counters, read under the line's lock (the line moves
    /// the counters' bases).
    fn line_counts(&self) -> LineCounts {
        let line = lock(&self.line);
        let (waiting, refused, withdrawn) = line
            .as_ref()
            .map_or((0, 0, 0), |line| (line.waiters.len(), line.refused, line.withdrawn));
        let in_use = self.cell.fast_in_use();
        LineCounts { waiting, refused, withdrawn, in_use, counters: self.cell.counters() }
    }

    /// The limit's `metrics` handles.
    pub(crate) fn metrics(&self) -> &LimitMetrics {
        self.metrics.get_or_init(|| LimitMetrics::new(&self.name))
    }

    /// Whether its limit was removed since the slot was looked up.
    pub(crate) fn is_removed(&self) -> bool {
        self.removed.load(Ordering::Acquire)
    }
}

impl fmt::Debug for LocalLimits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalLimits").field("limits", &self.infos()).finish()
    }
}

impl Default for LocalLimits {
    fn default() -> Self {
        Self::new()
    }
}

/// Where a waiting ticket stands after one look at the table.
pub(crate) enum Step {
    Granted(Grant),
    /// Waiting; sleep until this instant at most (a refill or a lease end), if any.
    Waiting(Option<Instant>),
    Finished,
}

impl LocalLimits {
    /// An empty backend allowing [`LimitTable::DEFAULT_MAX_WAITERS`] waiters per limit.
    pub fn new() -> Self {
        Self::with_max_waiters(LimitTable::DEFAULT_MAX_WAITERS)
    }

    /// An empty backend allowing `max_waiters` waiters per limit.
    pub fn with_max_waiters(max_waiters: usize) -> Self {
        crate::observe::describe_once();
        Self {
            shared: Arc::new(LocalState {
                inner: Mutex::new(Inner {
                    table: LimitTable::with_max_waiters(max_waiters),
                    fence_floor: 0,
                    wakers: FastMap::default(),
                    later: Later::default(),
                }),
                slots: RwLock::new(FastMap::default()),
                origin: Instant::now(),
                tickets: AtomicU64::new(1),
                max_waiters,
                max_limits: std::sync::atomic::AtomicUsize::new(usize::MAX),
            }),
        }
    }

    /// This backend with at most `max_limits` limits defined at once: defining a new name past
    /// it fails with [`LimitError::TooManyLimits`] (redefining one that exists never does), so
    /// that callers who name limits (a server's clients) cannot grow it without bound.
    ///
    /// ```
    /// use lanes::limit::{LimitBackend, LimitSpec, LocalLimits};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let backend = LocalLimits::new().with_max_limits(1);
    /// backend.define("db", LimitSpec::concurrent(4)).await.unwrap();
    /// backend.define("db", LimitSpec::concurrent(8)).await.unwrap();
    /// let refused = backend.define("api", LimitSpec::concurrent(4)).await.unwrap_err();
    /// assert!(refused.is_too_many_limits());
    /// # }
    /// ```
    pub fn with_max_limits(self, max_limits: usize) -> Self {
        self.shared.max_limits.store(max_limits, Ordering::Relaxed);
        self
    }

    fn now(&self) -> Duration {
        Instant::now().saturating_duration_since(self.shared.origin)
    }

    /// The time for a table operation on `slot`'s limit: the clock only if the limit has a
    /// rate or leased permits (without either, no answer depends on the time).
    fn now_for(&self, slot: &Slot, lease: Option<Duration>) -> Duration {
        if lease.is_some() {
            slot.leased.store(true, Ordering::Relaxed);
        }
        if slot.cell.has_rate() || slot.leased.load(Ordering::Relaxed) {
            self.now()
        } else {
            Duration::ZERO
        }
    }

    fn origin(&self) -> Instant {
        self.shared.origin
    }

    /// The instant of a table time.
    pub(crate) fn at(&self, at: Duration) -> Instant {
        self.shared.origin + at
    }

    pub(crate) fn next_ticket(&self) -> u64 {
        self.shared.tickets.fetch_add(1, Ordering::Relaxed)
    }

    /// The fast path of `name`, if it is defined.
    pub(crate) fn slot(&self, name: &str) -> Option<Arc<Slot>> {
        self.with_slot(name, Arc::clone)
    }

    /// Calls `f` with the slot of `name`, if it is defined, without taking a reference when
    /// this thread looked it up lately (a check holds nothing, so it needs none).
    pub(crate) fn with_slot<T>(&self, name: &str, f: impl FnOnce(&Arc<Slot>) -> T) -> Option<T> {
        let (way, hash) = recent_way(name);
        let mut f = Some(f);
        // `f` runs inside the borrow. What it calls may look a slot up (a check's count runs
        // the `metrics` recorder, the user's code): a hit shares the borrow, and a miss then
        // keeps nothing (`slot_missed`). A slot whose `metrics` handles are not resolved yet
        // is not lent (resolving them runs the recorder too). After this thread's locals are
        // gone (a lookup from another local's destructor), the map answers alone.
        let hit = RECENT
            .try_with(|recent| {
                let recent = recent.borrow();
                let slot = self.recent_hit(&recent[way].slot, name)?;
                slot.metrics.get()?;
                Some((f.take().expect("once"))(slot))
            })
            .ok()
            .flatten();
        match hit {
            Some(answer) => Some(answer),
            None => self.slot_missed(name, way, hash).map(|slot| (f.take().expect("once"))(&slot)),
        }
    }

    /// The cached slot in one way of [`RECENT`], if it is `name`'s in this backend and its
    /// limit was not removed.
    fn recent_hit<'a>(&self, cached: &'a Option<Arc<Slot>>, name: &str) -> Option<&'a Arc<Slot>> {
        cached.as_ref().filter(|slot| {
            std::ptr::eq(slot.shared.as_ptr(), Arc::as_ptr(&self.shared))
                && *slot.name == *name
                && !slot.is_removed()
        })
    }

    /// The slot of `name` from the shared map, kept in its way of [`RECENT`] if `name` (of
    /// `hash`) was the last to miss there.
    fn slot_missed(&self, name: &str, way: usize, hash: u64) -> Option<Arc<Slot>> {
        let slot = self
            .shared
            .slots
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(name)
            .cloned()?;
        // The entry it replaces is dropped after the borrow ends. A lookup made while this
        // thread's cache is lent (by a `metrics` recorder, the user's code, that a check called
        // under the borrow) is not kept.
        let evicted = RECENT.try_with(|recent| {
            let mut recent = recent.try_borrow_mut().ok()?;
            let recent = &mut recent[way];
            if recent.seen == hash {
                recent.slot.replace(slot.clone())
            } else {
                recent.seen = hash;
                None
            }
        });
        drop(evicted);
        Some(slot)
    }

    /// A permit of `slot` without the lock, or why not (see [`Cell::try_fast`]).
    #[inline]
    pub(crate) fn try_fast(&self, slot: &Slot) -> Result<u64, Miss> {
        slot.cell.try_fast(self.fast_now(slot))
    }

    /// A check of `slot` without the lock, or why not (see [`Cell::check_fast`]).
    #[inline]
    pub(crate) fn check_fast(&self, slot: &Slot) -> Result<(), Miss> {
        slot.cell.check_fast(self.fast_now(slot))
    }

    /// The time for the fast path, in ns since the origin: read only if the limit has a rate.
    #[inline]
    fn fast_now(&self, slot: &Slot) -> u64 {
        if slot.cell.has_rate() {
            u64::try_from(self.now().as_nanos()).unwrap_or(u64::MAX)
        } else {
            0
        }
    }

    /// Hands `name` to the table if the fast path governs it, with the callers in its line
    /// (queued in order, at the default priority), and tells the table how many fast permits
    /// are out. Call under the lock before a table operation that may grant; then settle.
    fn go_slow(&self, inner: &mut Inner, slot: &Slot, now: Duration) {
        if slot.cell.is_slow() {
            inner.table.set_external(&slot.name, slot.cell.fast_in_use());
            return;
        }
        // `SLOW` is set only under the line's lock (cell invariant 5).
        let mut line = lock(&slot.line);
        let counters = slot.cell.go_slow(Duration::from_nanos);
        inner.table.adopt(&slot.name, slot.cell.spec(), counters);
        inner.table.set_external(&slot.name, slot.cell.fast_in_use());
        let Some(line) = line.as_mut() else { return };
        let default = Priority::default();
        while let Some((waker, handoff)) = line.waiters.pop_with() {
            let ticket = self.next_ticket();
            // Before any grant: a grant seen after this is the table's.
            handoff.ticket.store(ticket, Ordering::Release);
            match inner.table.acquire_leased(&slot.name, ticket, &default, now, None) {
                Ok(Acquire::Granted(grant)) => {
                    handoff.set(grant);
                    inner.later.wakers.push(waker);
                }
                Ok(_) => inner.park(ticket, &waker, OnBehalf::Grant(None), Some(&handoff)),
                // The table's queue was empty and the line no longer than its room: only a
                // broken invariant lands here. The waiter asks and finds its ticket finished.
                Err(_) => {
                    debug_assert!(false, "the table refused a caller from the line");
                    inner.later.wakers.push(waker);
                }
            }
        }
    }

    /// After a table operation on `slot`'s limit: counts the fast permits, lets waiters in, and
    /// hands the limit back to the fast path once nothing waits and the table holds nothing.
    fn settle(inner: &mut Inner, slot: &Slot, now: Duration) {
        if !slot.cell.is_slow() || slot.is_removed() {
            return;
        }
        let expired =
            inner.table.take_expired_and_set_external(&slot.name, slot.cell.fast_in_use());
        Self::pump(inner, &slot.name, now);
        if let Some(counters) = inner.table.release_if_idle(&slot.name) {
            slot.cell.go_fast(counters);
        }
        // Counted once the table is settled, after the lock (`Later`), and contained: a grant
        // made for a caller just before (`try_now`) is not its permit yet, and this runs in
        // drops too.
        if expired > 0 {
            let counter = match slot.metrics.get() {
                Some(metrics) => Expired::Counter(metrics.expired.clone()),
                None => Expired::Limit(slot.name.clone()),
            };
            inner.later.expired.push((counter, expired));
        }
    }

    fn settle_name(&self, inner: &mut Inner, name: &str, now: Duration) {
        if let Some(slot) = self.slot(name) {
            Self::settle(inner, &slot, now);
        }
    }

    pub(crate) fn define_now(&self, name: &str, spec: LimitSpec) -> Result<(), LimitError> {
        spec.validate()?;
        let mut inner = lock_inner(&self.shared.inner);
        match self.slot(name) {
            Some(slot) => {
                // Set under the line's lock, so that a caller joins the line either before
                // (then the table takes the line below and decides what the new spec lets in:
                // more permits, or a rate, which the line does not keep) or after (then it
                // sees the new spec).
                let in_line = {
                    let _line = lock(&slot.line);
                    slot.cell.set_spec(spec);
                    slot.cell.has_line()
                };
                if in_line {
                    let now = self.now_for(&slot, None);
                    self.go_slow(&mut inner, &slot, now);
                }
                if slot.cell.is_slow() {
                    inner.table.define(name, spec)?;
                    // A larger spec may let waiters in.
                    let now = self.now();
                    Self::settle(&mut inner, &slot, now);
                }
            }
            None => {
                let max = self.shared.max_limits.load(Ordering::Relaxed);
                // Under `inner`, which every define and removal takes: the count cannot move.
                if self.shared.slots.read().unwrap_or_else(std::sync::PoisonError::into_inner).len()
                    >= max
                {
                    return Err(LimitError::TooManyLimits { max });
                }
                let name: Arc<str> = Arc::from(name);
                let slot = Arc::new(Slot {
                    name: name.clone(),
                    cell: Cell::new(spec, inner.fence_floor),
                    shared: Arc::downgrade(&self.shared),
                    removed: AtomicBool::new(false),
                    leased: AtomicBool::new(false),
                    metrics: std::sync::OnceLock::new(),
                    line: Mutex::new(None),
                });
                self.shared
                    .slots
                    .write()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .insert(name, slot);
            }
        }
        Ok(())
    }

    pub(crate) fn remove_now(&self, name: &str) -> Result<(), LimitError> {
        let mut inner = lock_inner(&self.shared.inner);
        let Some(slot) = self.slot(name) else {
            return Err(LimitError::UnknownLimit(name.to_owned()));
        };
        let now = self.now();
        self.reclaim_all(&mut inner, now);
        // Close the fast path first, so no fast acquire commits while the limit goes.
        self.go_slow(&mut inner, &slot, now);
        if let Err(err) = inner.table.remove(name, now) {
            Self::settle(&mut inner, &slot, now);
            return Err(err);
        }
        // The limit was handed to the table to be removed: its last token is the table's (the
        // cell's may be older), which the table's floor now holds.
        let (_, fence, _) = slot.cell.counters();
        inner.fence_floor = inner.fence_floor.max(fence).max(inner.table.fence_floor());
        slot.removed.store(true, Ordering::Release);
        self.shared.slots.write().unwrap_or_else(std::sync::PoisonError::into_inner).remove(name);
        Ok(())
    }

    /// One look at the table for a waiting `ticket` of `slot`'s limit: the first ask queues it,
    /// later looks never do. Leaves `waker` under the ticket unless it was granted or is
    /// finished.
    pub(crate) fn step(
        &self,
        slot: &Slot,
        ticket: u64,
        first: Option<&Priority>,
        lease: Option<Duration>,
        waker: &Waker,
        handoff: Option<&Handoff>,
    ) -> Result<Step, LimitError> {
        // The clock is read outside the lock: a slightly earlier `now` is only conservative
        // (GCRA takes the later of `tat` and `now`; a lease lapses a moment later).
        let now = self.now_for(slot, lease);
        let mut inner = lock_inner(&self.shared.inner);
        let answer = self.look(&mut inner, slot, ticket, first, lease, now)?;
        Ok(match answer {
            Acquire::Granted(grant) => {
                if !inner.wakers.is_empty() {
                    inner.wakers.remove(&ticket);
                }
                Step::Granted(grant)
            }
            Acquire::Finished => {
                inner.wakers.remove(&ticket);
                Step::Finished
            }
            Acquire::Queued | Acquire::RetryAt(_) => {
                inner.park(ticket, waker, OnBehalf::Grant(lease), handoff);
                let at = match answer {
                    Acquire::RetryAt(at) => Some(at),
                    // The head blocked by held permits wakes when the earliest lease can end.
                    // Without a lease held (expiring one never adds one) there is no such end,
                    // and the queue need not be asked.
                    _ if inner.table.next_expiry_of(&slot.name).is_none() => None,
                    _ => match inner.table.next(&slot.name, now) {
                        Ok(Some(Next::Blocked(head))) if head == ticket => {
                            inner.table.next_expiry_of(&slot.name)
                        }
                        _ => None,
                    },
                };
                Step::Waiting(at.map(|at| self.origin() + at))
            }
        })
    }

    /// One table look at `ticket`: the first ask hands the limit to the table (it may queue);
    /// a later look of a limit the table does not govern finds the ticket finished. A look that
    /// changed something (a grant, a finished ticket) settles the limit: the grant may have
    /// moved the queue, and nothing else would wake the new head while permits are held.
    fn look(
        &self,
        inner: &mut Inner,
        slot: &Slot,
        ticket: u64,
        first: Option<&Priority>,
        lease: Option<Duration>,
        now: Duration,
    ) -> Result<Acquire, LimitError> {
        if slot.is_removed() {
            return Err(LimitError::UnknownLimit(slot.name.to_string()));
        }
        if lease.is_some() {
            slot.leased.store(true, Ordering::Relaxed);
        }
        let answer = match first {
            Some(priority) => {
                self.go_slow(inner, slot, now);
                inner.table.acquire_leased(&slot.name, ticket, priority, now, lease)
            }
            None => {
                if !inner.table.governs(&slot.name) {
                    return Ok(Acquire::Finished);
                }
                self.go_slow(inner, slot, now);
                inner.table.check(&slot.name, ticket, now, lease)
            }
        };
        // Settling on a look that changed nothing would wake this very waiter again (it is the
        // head) and spin.
        if !matches!(answer, Ok(Acquire::Queued | Acquire::RetryAt(_))) {
            Self::settle(inner, slot, now);
        }
        answer
    }

    /// Answers once without waiting and without queuing.
    pub(crate) fn try_now(
        &self,
        slot: &Slot,
        ticket: u64,
        lease: Option<Duration>,
    ) -> Result<Acquire, LimitError> {
        let mut inner = lock_inner(&self.shared.inner);
        let now = self.now();
        if slot.is_removed() {
            return Err(LimitError::UnknownLimit(slot.name.to_string()));
        }
        if lease.is_some() {
            slot.leased.store(true, Ordering::Relaxed);
        }
        // A ticket's permit lives in the table (the fast path has no tickets).
        self.go_slow(&mut inner, slot, now);
        let answer = inner.table.try_acquire(&slot.name, ticket, now, lease)?;
        Self::settle(&mut inner, slot, now);
        Ok(answer)
    }

    /// Returns a permit or withdraws a ticket of `slot`'s limit, then lets the next waiters in.
    pub(crate) fn release_slot(&self, slot: &Slot, ticket: u64) -> Released {
        let now = self.now_for(slot, None);
        let mut inner = lock_inner(&self.shared.inner);
        // A waiter of this ticket (a long-poll between looks) learns at once that it finished.
        if let Some(waiter) = inner.wakers.remove(&ticket) {
            inner.later.wakers.push(waiter.waker);
        }
        match inner.table.release(&slot.name, ticket, now) {
            Ok(released) => {
                // Even an unknown ticket may have been reclaimed by this very call (its lease
                // had ended): settle, so an idle table hands the limit back.
                Self::settle(&mut inner, slot, now);
                released
            }
            Err(_) => Released::Unknown,
        }
    }

    /// [`release_slot`](Self::release_slot) by name.
    pub(crate) fn release_now(&self, name: &str, ticket: u64) -> Released {
        match self.slot(name) {
            Some(slot) => self.release_slot(&slot, ticket),
            None => Released::Unknown,
        }
    }

    /// Grants the queue head(s) on their waiters' behalf and wakes them; wakes a head that waits
    /// for a refill or a lease end so it (re)arms the limit's one timer.
    fn pump(inner: &mut Inner, name: &str, now: Duration) {
        if inner.wakers.is_empty() {
            // Nobody waits in this backend: nothing to grant on anyone's behalf.
            return;
        }
        // The queue's answer is asked once per change: after the loop it still holds (nothing
        // changed since; a break leaves a `Ready`, which needs no timer), so the head's timer
        // below reads it rather than asking again (each ask is a lookup and a queue peek).
        let mut next = inner.table.next(name, now);
        while let Ok(Some(Next::Ready(ticket))) = next {
            // A waiter that is not polling (a server ticket between long-polls) is left for its
            // own next look, so a grant never lands on an absent waiter; one that only wants a
            // wake-up asks itself, with its own lease.
            let Some(waiter) = inner.wakers.remove(&ticket) else { break };
            let OnBehalf::Grant(lease) = waiter.grant else {
                inner.later.wakers.push(waiter.waker);
                break;
            };
            if let Ok(Acquire::Granted(grant)) = inner.table.check(name, ticket, now, lease)
                && let Some(handoff) = &waiter.handoff
            {
                handoff.set(grant);
            }
            inner.later.wakers.push(waiter.waker);
            next = inner.table.next(name, now);
        }
        let head = match next {
            Ok(Some(Next::At(ticket, _))) => Some(ticket),
            // Blocked by held permits: only leases can end without a release, so only then does
            // the head need its timer (re)armed.
            Ok(Some(Next::Blocked(ticket))) if inner.table.next_expiry_of(name).is_some() => {
                Some(ticket)
            }
            _ => None,
        };
        if let Some(ticket) = head
            && let Some(waiter) = inner.wakers.remove(&ticket)
        {
            inner.later.wakers.push(waiter.waker);
        }
    }

    pub(crate) fn info_now(&self, name: &str) -> Option<LimitInfo> {
        let mut inner = lock_inner(&self.shared.inner);
        let now = self.now();
        self.reclaim_all(&mut inner, now);
        self.info_locked(&mut inner, name)
    }

    fn info_locked(&self, inner: &mut Inner, name: &str) -> Option<LimitInfo> {
        let slot = self.slot(name)?;
        let spec = slot.cell.spec();
        // The line's own count of who waits there, and of those it refused and lost: the
        // table counts its own (the line's callers it took are its waiters from then on).
        let line = slot.line_counts();
        let governed = if slot.cell.is_slow() {
            inner.table.set_external(name, slot.cell.fast_in_use());
            inner.table.info(name)
        } else {
            None
        };
        let mut info = governed.unwrap_or_else(|| {
            let (granted, _, max_in_use) = line.counters;
            LimitInfo::new(name, spec, line.in_use, line.waiting, granted, max_in_use)
        });
        info.refused_total += line.refused;
        info.withdrawn_total += line.withdrawn;
        Some(info)
    }

    pub(crate) fn infos(&self) -> Vec<LimitInfo> {
        let mut inner = lock_inner(&self.shared.inner);
        let now = self.now();
        self.reclaim_all(&mut inner, now);
        let mut names: Vec<Arc<str>> = self
            .shared
            .slots
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .keys()
            .cloned()
            .collect();
        names.sort();
        names.iter().filter_map(|name| self.info_locked(&mut inner, name)).collect()
    }

    /// Reclaims lapsed leases everywhere, lets the waiters they blocked in, and hands idle
    /// limits back to the fast path.
    fn reclaim_all(&self, inner: &mut Inner, now: Duration) {
        if inner.table.next_expiry().is_none_or(|at| at > now) {
            return;
        }
        let mut names: Vec<String> =
            inner.table.expire(now).into_iter().map(|(name, _)| name).collect();
        names.dedup();
        for name in names {
            Self::pump(inner, &name, now);
            self.settle_name(inner, &name, now);
        }
    }

    fn renew_now(
        &self,
        name: &str,
        tickets: &[u64],
        lease: Duration,
    ) -> Result<Vec<u64>, LimitError> {
        let mut inner = lock_inner(&self.shared.inner);
        let now = self.now();
        let Some(slot) = self.slot(name) else {
            return Err(LimitError::UnknownLimit(name.to_owned()));
        };
        if !inner.table.governs(name) {
            // The table holds no ticket of this limit: every one of them is gone.
            return Ok(tickets.to_vec());
        }
        let mut lost = Vec::new();
        for &ticket in tickets {
            if !inner.table.renew(name, ticket, now, lease)?
                && !inner.table.is_waiting(name, ticket)
            {
                lost.push(ticket);
            }
        }
        // A renewal may have reclaimed lapsed leases: let waiters in, hand an idle limit back.
        Self::settle(&mut inner, &slot, now);
        Ok(lost)
    }

    /// Resolves when the answer for `ticket` may have changed (it can be granted, it no longer
    /// waits, the refill or lease end it waits for is due), or after `at_most`.
    pub(crate) async fn wait_now(&self, name: &str, ticket: u64, at_most: Duration) {
        /// Takes the waker out however the wait ends (a cancelled long-poll included): a waker
        /// left behind would make the pump skip this ticket's grant-on-behalf rules.
        struct Unpark<'a> {
            local: &'a LocalLimits,
            ticket: u64,
        }
        impl Drop for Unpark<'_> {
            fn drop(&mut self) {
                lock_inner(&self.local.shared.inner).wakers.remove(&self.ticket);
            }
        }
        let _unpark = Unpark { local: self, ticket };
        let mut sleep = Box::pin(tokio::time::sleep(at_most));
        poll_fn(|cx| {
            if sleep.as_mut().poll(cx).is_ready() {
                return Poll::Ready(());
            }
            let mut inner = lock_inner(&self.shared.inner);
            let now = self.now();
            self.reclaim_all(&mut inner, now);
            let wake_at = match inner.table.next(name, now) {
                Ok(Some(Next::Ready(head))) if head == ticket => return Poll::Ready(()),
                Ok(Some(Next::At(head, at))) if head == ticket => Some(at),
                Ok(Some(Next::Blocked(head))) if head == ticket => inner.table.next_expiry_of(name),
                _ => None,
            };
            if !inner.table.is_waiting(name, ticket) {
                return Poll::Ready(());
            }
            inner.park(ticket, cx.waker(), OnBehalf::WakeOnly, None);
            drop(inner);
            if let Some(at) = wake_at {
                let at = self.origin() + at;
                if at < sleep.deadline() {
                    sleep.as_mut().reset(at);
                    if sleep.as_mut().poll(cx).is_ready() {
                        return Poll::Ready(());
                    }
                }
            }
            Poll::Pending
        })
        .await;
    }

    /// Polls a waiting ticket of the local facade once: see [`step`](Self::step). `timer` is the
    /// waiter's one sleep, re-armed to the instant the step asks for.
    pub(crate) fn poll_step(
        &self,
        cx: &mut Context<'_>,
        slot: &Slot,
        ticket: u64,
        first: &mut Option<&Priority>,
        timer: &mut Option<Pin<Box<Sleep>>>,
        handoff: &Handoff,
    ) -> Poll<Result<Grant, LimitError>> {
        // Granted on its behalf since the last poll: take it without the lock.
        if let Some(grant) = handoff.get() {
            return Poll::Ready(Ok(grant));
        }
        loop {
            let step = self.step(slot, ticket, first.take(), None, cx.waker(), Some(handoff));
            match step {
                Err(err) => return Poll::Ready(Err(err)),
                Ok(Step::Granted(grant)) => return Poll::Ready(Ok(grant)),
                // Only its owner finishes a local facade's ticket; a finished ticket here means
                // its limit was removed and defined again.
                Ok(Step::Finished) => {
                    return Poll::Ready(Err(LimitError::UnknownLimit(slot.name.to_string())));
                }
                Ok(Step::Waiting(None)) => {
                    *timer = None;
                    return Poll::Pending;
                }
                Ok(Step::Waiting(Some(deadline))) => {
                    match timer {
                        Some(sleep) if sleep.deadline() == deadline => {}
                        Some(sleep) => sleep.as_mut().reset(deadline),
                        None => *timer = Some(Box::pin(sleep_until(deadline))),
                    }
                    let sleep = timer.as_mut().expect("armed above");
                    if sleep.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    // The refill or lease end is due: look again.
                }
            }
        }
    }
}

/// What a local wait ended with.
pub(crate) enum Granted {
    /// A permit handed over in the limit's line (or free when it asked): a fast permit, with
    /// this fencing token.
    Line(u64),
    /// A permit the table granted to this ticket.
    Table(u64, Grant),
}

/// Where a local wait stands.
enum Place<'p> {
    /// Not asked yet.
    Start(&'p Priority),
    /// In the limit's line.
    Line(WaitKey),
    /// Waiting in the table under `ticket` (`first` until the table queued it).
    Table { ticket: u64, first: Option<&'p Priority> },
    /// Granted, or failed: nothing to undo.
    Done,
}

/// One caller's wait for a permit of a local limit: in the limit's line when it asks at the
/// default priority while the fast path governs (a semaphore's wait), else in the table.
/// Dropped before its end, it leaves the line or withdraws its ticket, and returns a permit
/// handed to it meanwhile: cancel safe.
pub(crate) struct Wait<'a> {
    local: &'a LocalLimits,
    slot: &'a Slot,
    place: Place<'a>,
    /// The table's timer for the head of its queue (a refill or a lease end).
    timer: Option<Pin<Box<Sleep>>>,
    /// Where a grant made on this caller's behalf is handed over; dropped after the wait is
    /// undone (the fields drop after [`Drop::drop`]), so an emptied cell goes back to the
    /// thread's spares.
    handoff: WaitHandoff,
}

impl<'a> Wait<'a> {
    /// A wait for a permit of `slot`'s limit at `priority`.
    pub(crate) fn new(local: &'a LocalLimits, slot: &'a Slot, priority: &'a Priority) -> Self {
        slot.metrics().waiters.increment(1.0);
        Self {
            local,
            slot,
            place: Place::Start(priority),
            timer: None,
            handoff: WaitHandoff::new(),
        }
    }

    /// Polls the wait: granted, failed, or waiting with `cx`'s waker left where a grant
    /// will wake it.
    ///
    /// The common second poll of a wait in line, woken with its permit, is answered here
    /// (inlined into the caller's future); anything else in [`poll_any`](Self::poll_any).
    #[inline]
    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<Granted, LimitError>> {
        if let Place::Line(_) = self.place
            && let Some(grant) = self.handoff.get()
            && self.handoff.moved().is_none()
        {
            return self.end(Ok(Granted::Line(grant.fencing_token)));
        }
        self.poll_any(cx)
    }

    /// [`poll`](Self::poll), in every state.
    #[inline(never)]
    fn poll_any(&mut self, cx: &mut Context<'_>) -> Poll<Result<Granted, LimitError>> {
        loop {
            match self.place {
                Place::Start(priority) => {
                    // The line keeps arrival order and nothing else: no levels, keys or rate.
                    if priority.is_default() && !self.slot.cell.has_rate() {
                        let max_waiters = self.local.shared.max_waiters;
                        let joined = self.slot.join_line(cx.waker(), &self.handoff, max_waiters);
                        match joined {
                            Ok(Joined::Granted(fence)) => {
                                return self.end(Ok(Granted::Line(fence)));
                            }
                            Ok(Joined::InLine(key)) => {
                                self.place = Place::Line(key);
                                return Poll::Pending;
                            }
                            Ok(Joined::Table) => {}
                            Err(err) => return self.end(Err(err)),
                        }
                    }
                    let ticket = self.local.next_ticket();
                    self.place = Place::Table { ticket, first: Some(priority) };
                }
                Place::Line(key) => {
                    // The grant first, then whose it is: the table stores its ticket before
                    // it grants (`go_slow`), so a grant the table made is seen with it.
                    if let Some(grant) = self.handoff.get() {
                        return self.end(Ok(match self.handoff.moved() {
                            Some(ticket) => Granted::Table(ticket, grant),
                            None => Granted::Line(grant.fencing_token),
                        }));
                    }
                    if let Some(ticket) = self.handoff.moved() {
                        self.place = Place::Table { ticket, first: None };
                    } else if self.slot.refresh_line(key, cx.waker()) {
                        return Poll::Pending;
                    }
                    // Handed a permit or taken by the table since the look above: look again.
                }
                Place::Table { ticket, ref mut first } => {
                    let step = self.local.poll_step(
                        cx,
                        self.slot,
                        ticket,
                        first,
                        &mut self.timer,
                        &self.handoff,
                    );
                    return match step {
                        Poll::Ready(Ok(grant)) => self.end(Ok(Granted::Table(ticket, grant))),
                        // The ticket is withdrawn when the wait is dropped, as on a timeout.
                        Poll::Ready(Err(err)) => Poll::Ready(Err(err)),
                        Poll::Pending => Poll::Pending,
                    };
                }
                Place::Done => panic!("a wait polled after its end"),
            }
        }
    }

    /// The end of the wait: nothing left to undo.
    fn end(&mut self, done: Result<Granted, LimitError>) -> Poll<Result<Granted, LimitError>> {
        self.place = Place::Done;
        Poll::Ready(done)
    }
}

impl Drop for Wait<'_> {
    /// Undoes the wait, then counts it off the `waiters` gauge: a `metrics` recorder that
    /// panics unwinds with the wait out of line, and anything it was granted given back (and
    /// while a panic unwinds, its call is contained: [`count_off`]).
    fn drop(&mut self) {
        match std::mem::replace(&mut self.place, Place::Done) {
            Place::Start(_) | Place::Done => {}
            Place::Line(key) => {
                // Out of line before a grant reached it; or else handed a permit, or taken by
                // the table, meanwhile (both under the line's lock, which `leave_line` took
                // after them).
                if !self.slot.leave_line(key) {
                    match self.handoff.moved() {
                        Some(ticket) => {
                            self.local.release_slot(self.slot, ticket);
                        }
                        None => {
                            debug_assert!(
                                self.handoff.get().is_some(),
                                "out of line: handed a permit"
                            );
                            self.slot.release_fast();
                        }
                    }
                }
            }
            Place::Table { ticket, .. } => {
                self.local.release_slot(self.slot, ticket);
            }
        }
        count_off(&self.slot.metrics().waiters);
    }
}

fn answer(acquire: Acquire, now: Duration) -> Answer {
    match acquire {
        Acquire::Granted(grant) => Answer::Granted(grant),
        Acquire::Queued => Answer::Queued,
        Acquire::RetryAt(at) => Answer::RetryAfter(at.saturating_sub(now)),
        Acquire::Finished => Answer::Finished,
    }
}

impl LocalLimits {
    fn answer_now(
        &self,
        name: &str,
        ticket: u64,
        first: Option<&Priority>,
        lease: Option<Duration>,
    ) -> Result<Answer, LimitError> {
        let Some(slot) = self.slot(name) else {
            return Err(LimitError::UnknownLimit(name.to_owned()));
        };
        let mut inner = lock_inner(&self.shared.inner);
        let now = self.now();
        let acquire = self.look(&mut inner, &slot, ticket, first, lease, now)?;
        Ok(answer(acquire, now))
    }
}

impl LimitBackend for LocalLimits {
    fn ticket(&self) -> u64 {
        self.next_ticket()
    }

    fn define<'a>(
        &'a self,
        name: &'a str,
        spec: LimitSpec,
    ) -> BoxFuture<'a, Result<(), LimitError>> {
        Box::pin(std::future::ready(self.define_now(name, spec)))
    }

    fn remove<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), LimitError>> {
        Box::pin(std::future::ready(self.remove_now(name)))
    }

    fn acquire<'a>(
        &'a self,
        name: &'a str,
        ticket: u64,
        priority: &'a Priority,
        lease: Option<Duration>,
    ) -> BoxFuture<'a, Result<Answer, LimitError>> {
        Box::pin(std::future::ready(self.answer_now(name, ticket, Some(priority), lease)))
    }

    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        ticket: u64,
        lease: Option<Duration>,
    ) -> BoxFuture<'a, Result<Answer, LimitError>> {
        let now = self.now();
        Box::pin(std::future::ready(match self.slot(name) {
            Some(slot) => self.try_now(&slot, ticket, lease).map(|acquire| answer(acquire, now)),
            None => Err(LimitError::UnknownLimit(name.to_owned())),
        }))
    }

    fn check<'a>(
        &'a self,
        name: &'a str,
        ticket: u64,
        lease: Option<Duration>,
    ) -> BoxFuture<'a, Result<Answer, LimitError>> {
        Box::pin(std::future::ready(self.answer_now(name, ticket, None, lease)))
    }

    fn wait<'a>(&'a self, name: &'a str, ticket: u64, at_most: Duration) -> BoxFuture<'a, ()> {
        Box::pin(self.wait_now(name, ticket, at_most))
    }

    fn release<'a>(
        &'a self,
        name: &'a str,
        ticket: u64,
    ) -> BoxFuture<'a, Result<Released, LimitError>> {
        Box::pin(std::future::ready(Ok(self.release_now(name, ticket))))
    }

    /// At once, wherever the permit (or the waiting acquire) is dropped: in process there is
    /// nothing to wait for. (The default, a release in a spawned task, never ran on a thread
    /// without a runtime, and a permit without a lease was then held for good.)
    fn release_local(&self, name: &str, ticket: u64) -> bool {
        self.release_now(name, ticket);
        true
    }

    fn renew<'a>(
        &'a self,
        name: &'a str,
        tickets: &'a [u64],
        lease: Duration,
    ) -> BoxFuture<'a, Result<Vec<u64>, LimitError>> {
        Box::pin(std::future::ready(self.renew_now(name, tickets, lease)))
    }

    fn info<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<LimitInfo>, LimitError>> {
        Box::pin(std::future::ready(Ok(self.info_now(name))))
    }

    fn list(&self) -> BoxFuture<'_, Result<Vec<LimitInfo>, LimitError>> {
        Box::pin(std::future::ready(Ok(self.infos())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hand_over_cell_is_reused_only_when_its_wait_was_its_last_holder() {
        let spares = || SPARE_HANDOFF.with(|spare| spare.borrow().len());
        let grant = Grant { fencing_token: 9, expires_at: None };
        // Held elsewhere too (a table's waiter entry after a cancelled wait): not kept.
        let waited = WaitHandoff::new();
        let elsewhere = Handoff::clone(&waited);
        elsewhere.set(grant);
        let before = spares();
        drop(waited);
        assert_eq!(spares(), before, "a cell someone else holds is not kept");
        assert_eq!(elsewhere.get(), Some(grant), "and is left as it was");
        // Its last holder: emptied and kept, and the next wait on this thread gets it.
        let last = WaitHandoff::new();
        last.set(grant);
        let address = Arc::as_ptr(&last) as usize;
        let before = spares();
        drop(last);
        assert_eq!(spares(), before + 1, "kept for the next wait");
        let next = WaitHandoff::new();
        assert_eq!(Arc::as_ptr(&next) as usize, address, "the kept cell comes back");
        assert_eq!(next.get(), None, "emptied before reuse");
        assert_eq!(next.moved(), None);
    }

    #[test]
    fn a_grant_cell_hands_over_the_whole_grant_once_and_clears_for_the_next_wait() {
        let leases =
            [None, Some(Duration::ZERO), Some(Duration::new(7, 999_999_999)), Some(Duration::MAX)];
        let cell = GrantCell::default();
        for (i, expires_at) in leases.into_iter().enumerate() {
            assert_eq!(cell.get(), None, "empty before the grant");
            let grant = Grant { fencing_token: i as u64 + 1, expires_at };
            cell.set(grant);
            assert_eq!(cell.get(), Some(grant));
            assert_eq!(cell.get(), Some(grant), "reading does not take it");
            cell.clear();
        }
        assert_eq!(cell.get(), None);
    }

    #[test]
    fn a_wait_handoff_is_reused_only_when_nothing_else_holds_it() {
        let first = WaitHandoff::new();
        let first_ptr = Arc::as_ptr(&first);
        first.set(Grant { fencing_token: 3, expires_at: None });
        drop(first);
        // The spare comes back empty.
        let second = WaitHandoff::new();
        assert_eq!(Arc::as_ptr(&second), first_ptr, "the spare is reused");
        assert_eq!(second.get(), None, "and emptied");
        // One still held elsewhere (a waiter's entry) is not kept: its grant could still land.
        let held_elsewhere = Arc::clone(&second);
        drop(second);
        held_elsewhere.set(Grant { fencing_token: 4, expires_at: None });
        let third = WaitHandoff::new();
        assert_ne!(Arc::as_ptr(&third), first_ptr);
        assert_eq!(third.get(), None);
        assert_eq!(held_elsewhere.get().map(|g| g.fencing_token), Some(4));
    }
}
