//! Leased capacity, the client half: a limit served from this client's share of it, with no
//! round trip per acquire, whatever the store behind it ([`ShareSource`]: Redis, a `lanes
//! serve`).
//!
//! [`keep_share`] refreshes the share every third of a lease (every tenth while waiters go
//! unserved or after a cut, at once when the block of fencing tokens is spent), stating the
//! demand — permits out plus waiters by priority level (a share goes first to clients with
//! high-level demand), and for a limit with a rate the rate acquires arrive at — and the
//! permits out. [`LocalShare`] grants locally, highest level first, fairness keys taking turns
//! within a level (weighted fair queuing: no credit for a key that was idle), first come first
//! served within a key, while fewer than the share are out and, for a rate, at the share's part of
//! it (GCRA), each grant with a fencing token from the block the last refresh reserved (sized
//! to twice the grants of the last interval). A share that is not refreshed before its lease
//! ends becomes nothing, and every permit handed out from it is reported lost, because the
//! store gives the capacity to others from then on.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{Demand, SharePolicy};
use crate::BoxFuture;
use crate::limit::backend::Answer;
use crate::limit::core::{Grant, Released};
use crate::limit::error::LimitError;
use crate::limit::priority::Priority;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What a client asks of the store at a refresh of its share.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ShareRequest {
    /// What it wants: permits out and waiters, by level.
    pub demand: Demand,
    /// Permits it has out now (handed to local holders).
    pub held: u32,
    /// How the limit's capacity is shared.
    pub policy: SharePolicy,
    /// A block of this many fencing tokens (0: none).
    pub tokens: u64,
    /// The highest fencing token it has handed out (0: none).
    pub last_token: u64,
    /// Whether it believes it holds a live share.
    pub believes_held: bool,
    /// The client's number for this refresh, increasing: a refresh older than one already
    /// applied is not applied.
    pub seq: u64,
    /// For a limit with a rate (or one not yet known not to have one): its part of the rate.
    pub rate: Option<RateDemand>,
}

impl ShareRequest {
    /// A request for `demand` with `held` permits out, shared by `policy`, with a block of
    /// `tokens` fencing tokens, and nothing about a rate.
    pub fn new(demand: Demand, held: u32, policy: SharePolicy, tokens: u64) -> Self {
        Self {
            demand,
            held,
            policy,
            tokens,
            last_token: 0,
            believes_held: false,
            seq: 0,
            rate: None,
        }
    }
}

/// A client's part of a rate at a refresh, in thousandths of a grant per second.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct RateDemand {
    /// The part it enforces now.
    pub held: u64,
    /// What it wants, by level.
    pub demand: Demand,
}

impl RateDemand {
    /// A part `held` enforced now and a demand `demand` (thousandths of a grant per second).
    pub fn new(held: u64, demand: Demand) -> Self {
        Self { held, demand }
    }
}

/// A client's share of a leased limit, as the store answers a refresh.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ShareLease {
    /// The most permits this client may have out until the lease ends.
    pub share: u32,
    /// When the lease ends, on the store's clock (since the Unix epoch).
    pub expires_at: Duration,
    /// Fencing tokens reserved for the grants this client makes from its share: unique across
    /// the limit, increasing within the block.
    pub tokens: Range<u64>,
    /// The client's share had lapsed in the store before this refresh: permits it had out may
    /// have gone to others, and must be reported lost.
    pub lapsed: bool,
    /// For a limit with a rate, asked for with a rate demand: this client's part of the rate.
    pub rate: Option<RateLease>,
}

impl ShareLease {
    /// A share of `share` permits until `expires_at`, with the fencing tokens `tokens`.
    pub fn new(share: u32, expires_at: Duration, tokens: Range<u64>) -> Self {
        Self { share, expires_at, tokens, lapsed: false, rate: None }
    }

    /// This lease, marked lapsed (see [`lapsed`](Self::lapsed)).
    #[must_use]
    pub fn lapsed(mut self, lapsed: bool) -> Self {
        self.lapsed = lapsed;
        self
    }

    /// This lease with a part of the limit's rate.
    #[must_use]
    pub fn with_rate(mut self, rate: RateLease) -> Self {
        self.rate = Some(rate);
        self
    }
}

/// This client's part of a leased limit's rate, in thousandths of a grant per second (so that
/// small rates split finely); the client makes at most `share / 1000` grants a second, with a
/// burst of the limit's burst in proportion to its share (at least one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct RateLease {
    /// This client's part, in thousandths of a grant per second.
    pub share: u64,
    /// The limit's whole rate, in thousandths of a grant per second.
    pub limit: u64,
    /// The limit's burst.
    pub burst: u32,
}

impl RateLease {
    /// A part `share` of a rate `limit` (thousandths of a grant per second) with burst `burst`.
    pub fn new(share: u64, limit: u64, burst: u32) -> Self {
        Self { share, limit, burst }
    }

    /// The burst this client may use: the limit's, in proportion to its share, at least 1.
    pub fn burst_share(&self) -> u32 {
        if self.limit == 0 {
            return 1;
        }
        let part = u128::from(self.burst) * u128::from(self.share) / u128::from(self.limit);
        u32::try_from(part).unwrap_or(u32::MAX).max(1)
    }
}

/// A store that keeps the ledger of leased limits, seen from one client.
pub trait ShareSource: Send + Sync + 'static {
    /// The lease this client holds shares for.
    fn lease(&self) -> Duration;

    /// Sends one refresh of `name`'s share. `Ok(None)`: the answer was overtaken by a later
    /// refresh of this client, and there is nothing to apply.
    fn refresh<'a>(
        &'a self,
        name: &'a str,
        request: ShareRequest,
    ) -> BoxFuture<'a, Result<Option<ShareLease>, LimitError>>;

    /// The permit of `ticket` on `name`, handed out from the share, is lost (the share lapsed).
    fn lost(&self, name: &str, ticket: u64);

    /// [`keep_share`] stopped keeping `share` of `name`: the limit is gone from the store, and
    /// the share held and awaited nothing. A source drops it from what it serves (if it is
    /// still the one it serves `name` from). By default, nothing.
    fn retired(&self, name: &str, share: &Arc<LocalShare>) {
        let _ = (name, share);
    }

    /// Whether `share` is still the one the source serves `name` from. One that is not (the
    /// limit was removed here, and maybe defined leased again with a share of its own) is
    /// refreshed no more: its keeper's refreshes would report its holdings for the same name
    /// over the new share's. By default, always.
    fn serves(&self, name: &str, share: &Arc<LocalShare>) -> bool {
        let _ = (name, share);
        true
    }
}

/// When a lease asked for at `sent` may end at the store, in local time: at the end of `lease`
/// counted from the ask (the store counts from a later moment), less 2% for clocks that run at
/// slightly different rates.
pub fn lease_end(sent: Instant, lease: Duration) -> Instant {
    sent + lease - lease / 50
}

/// One leased limit as this client serves it: its share, its holders and waiters.
pub struct LocalShare {
    policy: SharePolicy,
    state: Mutex<LeasedState>,
    /// Woken when a permit may be free (a release, a larger share, new tokens).
    room: Notify,
    /// Wakes the refresher early: the block of tokens ran out.
    hurry: Notify,
    /// Wakes the keeper to look at the leases again: one ends sooner than it knew.
    expiry: Notify,
    /// The last refresh failed (the store did not answer in time). Outside the lock: the
    /// common case, a store that answers, costs every ask one load.
    failed: std::sync::atomic::AtomicBool,
}

#[derive(Default)]
struct LeasedState {
    share: u32,
    /// When the share ends unless refreshed (local time, no later than Redis's end).
    until: Option<Instant>,
    tokens: Range<u64>,
    /// Permits out: ticket -> its fencing token and its level.
    holders: BTreeMap<u64, (u64, u8)>,
    /// The leases of the permits out that have one (see [`LocalShare::lease`]).
    leases: Leases,
    /// Tickets waiting: the highest level first; within a level by fair-queuing tag (the
    /// fairness keys take turns, in proportion to their weights), then in arrival order.
    waiting: BTreeMap<Place, u64>,
    /// Where each waiting ticket is in `waiting`, and its fairness key.
    waiting_at: HashMap<u64, (Place, Option<Arc<str>>)>,
    /// Per level: the tag of the last ticket granted (the level's virtual clock).
    clock: BTreeMap<u8, u64>,
    /// Per level and fairness key with waiters: the tag of its last waiting ticket, and how
    /// many of its tickets wait. (Keys without waiters have no entry: no credit is banked.)
    keys: HashMap<(u8, Arc<str>), (u64, u32)>,
    /// Arrivals so far (the order within a level).
    arrivals: u64,
    /// The highest fencing token handed out (0: none yet).
    last_token: u64,
    /// The most permits out plus waiters since the last refresh: the demand stated is never
    /// below it, or a share sized to one instant's demand would keep the client short.
    peak: u32,
    /// Refreshes sent.
    seq: u64,
    /// Grants since `counted_since` (the last refresh), to size the next block of tokens.
    granted: u64,
    counted_since: Option<Instant>,
    /// While a refresh is unanswered (or failed): the permits out when it was sent. Redis
    /// reserves for this client at least that many, and perhaps no more (it may already have
    /// cut the share), so no more than that may be out until an answer comes.
    cap: Option<u32>,
    /// For a limit with a rate: this client's part of it, once a refresh said so.
    rate: Option<RateState>,
    /// First asks since the last refresh, by level: the rate demand.
    arrived: BTreeMap<u8, u32>,
    /// When the arrivals began to be counted (the last refresh sent).
    arrived_since: Option<Instant>,
    /// The arrivals counted at the last refreshes, and over how long each: the rate is
    /// measured over the latest of them that cover a refresh interval, never over less (a few
    /// arrivals more or less would swing it).
    arrived_before: VecDeque<(BTreeMap<u8, u32>, Duration)>,
    /// Since when someone has waited (`None`: nobody waits).
    waiting_since: Option<Instant>,
    /// How long someone waited since the last refresh, up to `waiting_since`.
    waited: Duration,
}

/// How late a grant may come after its turn without losing that time to the rate.
const LATE: Duration = Duration::from_millis(2);

/// The leases of permits out: when each ends, found by ticket and in order of their ends.
#[derive(Default)]
struct Leases {
    by_ticket: HashMap<u64, Instant>,
    by_end: BTreeSet<(Instant, u64)>,
}

impl Leases {
    /// Sets `ticket`'s lease to end at `ends`; whether it now ends first of all.
    fn set(&mut self, ticket: u64, ends: Instant) -> bool {
        if let Some(before) = self.by_ticket.insert(ticket, ends) {
            self.by_end.remove(&(before, ticket));
        }
        self.by_end.insert((ends, ticket));
        self.by_end.first() == Some(&(ends, ticket))
    }

    fn remove(&mut self, ticket: u64) {
        // Most shares lease nothing (a client that renews its own): no hashing on a release.
        if self.by_ticket.is_empty() {
            return;
        }
        if let Some(ends) = self.by_ticket.remove(&ticket) {
            self.by_end.remove(&(ends, ticket));
        }
    }

    fn clear(&mut self) {
        self.by_ticket.clear();
        self.by_end.clear();
    }

    /// Whether `ticket` has a lease that ended by `now`.
    fn ended(&self, ticket: u64, now: Instant) -> bool {
        self.by_ticket.get(&ticket).is_some_and(|ends| *ends <= now)
    }

    /// The first lease to end.
    fn first_end(&self) -> Option<Instant> {
        self.by_end.first().map(|(ends, _)| *ends)
    }

    /// Takes out the leases ended by `now`: their tickets.
    fn take_ended(&mut self, now: Instant) -> Vec<u64> {
        let mut ended = Vec::new();
        while let Some(&(ends, ticket)) = self.by_end.first() {
            if ends > now {
                break;
            }
            self.by_end.pop_first();
            self.by_ticket.remove(&ticket);
            ended.push(ticket);
        }
        ended
    }
}

/// A waiting ticket's place in line: its level (highest first), its fair-queuing tag, its
/// arrival.
type Place = (Reverse<u8>, u64, u64);

/// The tag a ticket of weight 1 adds to its key's: a weight of `w` adds `TAG_STEP / w`.
const TAG_STEP: u64 = 1 << 16;

/// A ticket's first ask: its level, fairness key and weight.
struct First {
    level: u8,
    key: Option<Arc<str>>,
    weight: u32,
}

/// A leased limit's part of its rate as this client enforces it: GCRA at the share's rate.
///
/// Unlike permits, a rate share has no holders to wait for: a share cut applies to the next
/// grant. The refresh states the share enforced until the answer (`held`), so Redis keeps it
/// reserved until the refresh after, by when the cut is in force.
struct RateState {
    lease: RateLease,
    /// The theoretical arrival time of the next grant at the share's rate.
    tat: Option<Instant>,
}

impl RateState {
    /// The time between grants at the share's rate; `None` for no share.
    fn interval(&self) -> Option<Duration> {
        (self.lease.share > 0)
            .then(|| Duration::from_nanos(1_000_000_000_000u64.div_ceil(self.lease.share)))
    }

    /// The earliest moment a grant fits (`None`: never, with no share).
    fn ready_at(&self, now: Instant) -> Option<Instant> {
        let interval = self.interval()?;
        let tolerance = interval.saturating_mul(self.lease.burst_share() - 1);
        Some(self.tat.and_then(|tat| tat.checked_sub(tolerance)).map_or(now, |at| at.max(now)))
    }

    /// A grant was made at `now`. A waiter woken for its turn is granted a little after it
    /// (the timer's tick, the wake-up, the ask): up to [`LATE`] (at most one interval) of that
    /// is not lost to the rate, or a share with a burst of one would run a few percent slow.
    /// So a client may grant one more than its burst in a window, never more.
    fn take(&mut self, now: Instant) {
        if let Some(interval) = self.interval() {
            let late = now.checked_sub(LATE.min(interval)).unwrap_or(now);
            self.tat = Some(self.tat.map_or(now, |tat| tat.max(late)) + interval);
        }
    }

    /// A new share from a refresh at `now`: the debt of the old rate is kept, up to a full
    /// bucket of the new (its burst of intervals), so a larger share applies at once and a
    /// spent burst stays spent.
    fn renew(&mut self, lease: RateLease, now: Instant) {
        self.lease = lease;
        if let (Some(tat), Some(interval)) = (self.tat, self.interval()) {
            self.tat = Some(tat.min(now + interval.saturating_mul(lease.burst_share())));
        }
    }
}

impl LeasedState {
    /// The most permits that may be out now.
    fn limit(&self) -> u32 {
        self.cap.map_or(self.share, |cap| cap.min(self.share))
    }

    /// When the rate lets the next grant go: now for a limit without a rate; `None` for a
    /// rate share of nothing.
    fn rate_ready(&self, now: Instant) -> Option<Instant> {
        self.rate.as_ref().map_or(Some(now), |rate| rate.ready_at(now))
    }

    fn note_peak(&mut self) {
        let now = (self.holders.len() + self.waiting.len()) as u32;
        self.peak = self.peak.max(now);
    }

    /// The ticket served next, if any waits.
    fn head(&self) -> Option<u64> {
        self.waiting.first_key_value().map(|(_, ticket)| *ticket)
    }

    /// Puts `ticket` in line. Within its level it is tagged after its key's last waiting
    /// ticket (or the level's clock, whichever is later) by `TAG_STEP / weight`; a ticket
    /// without a key is a group of its own.
    fn enqueue(&mut self, ticket: u64, first: First) {
        let clock = self.clock.get(&first.level).copied().unwrap_or(0);
        let step = TAG_STEP / u64::from(first.weight.max(1));
        let tag = match &first.key {
            Some(key) => {
                let entry = self.keys.entry((first.level, key.clone())).or_insert((clock, 0));
                entry.0 = entry.0.max(clock) + step.max(1);
                entry.1 += 1;
                entry.0
            }
            None => clock + TAG_STEP,
        };
        self.arrivals += 1;
        let at = (Reverse(first.level), tag, self.arrivals);
        self.waiting.insert(at, ticket);
        self.waiting_at.insert(ticket, (at, first.key));
    }

    fn unqueue(&mut self, ticket: u64) -> bool {
        let Some((at, key)) = self.waiting_at.remove(&ticket) else { return false };
        if let Some(key) = key {
            let slot = (at.0.0, key);
            if let Some(entry) = self.keys.get_mut(&slot) {
                entry.1 -= 1;
                if entry.1 == 0 {
                    self.keys.remove(&slot);
                }
            }
        }
        let removed = self.waiting.remove(&at).is_some();
        if self.waiting.is_empty()
            && let Some(since) = self.waiting_since.take()
        {
            self.waited += since.elapsed();
        }
        removed
    }
}

/// A priority level as a level of demand: `Priority::level`'s `i32` clamped to -128..=127,
/// shifted to 0..=255 (order kept).
pub fn level_of(priority: &Priority) -> u8 {
    (priority.level.clamp(-128, 127) + 128) as u8
}

impl std::fmt::Debug for LocalShare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = lock(&self.state);
        f.debug_struct("LocalShare")
            .field("policy", &self.policy)
            .field("share", &state.share)
            .field("out", &state.holders.len())
            .field("waiting", &state.waiting.len())
            .finish_non_exhaustive()
    }
}

impl LocalShare {
    /// An empty share of a limit shared by `policy`: nothing is granted before a refresh.
    pub fn new(policy: SharePolicy) -> Self {
        Self {
            policy,
            state: Mutex::new(LeasedState::default()),
            room: Notify::new(),
            hurry: Notify::new(),
            expiry: Notify::new(),
            failed: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// A grant for `ticket` if its turn has come and the share has room; else, with a `level`
    /// (its first ask), it waits in line at that level (with no fairness key).
    pub fn ask(&self, ticket: u64, level: Option<u8>) -> Answer {
        let first = level.map(|level| First { level, key: None, weight: 1 });
        self.enter(ticket, first, usize::MAX).unwrap_or(Answer::Queued)
    }

    /// As [`ask`](Self::ask); `Err(max)` for a first ask that is not granted at once and
    /// finds `max` tickets waiting already (it does not wait).
    fn enter(&self, ticket: u64, first: Option<First>, max: usize) -> Result<Answer, usize> {
        let level = first.as_ref().map(|first| first.level);
        let mut state = lock(&self.state);
        if let Some((token, _)) = state.holders.get(&ticket) {
            return Ok(Answer::Granted(Grant { fencing_token: *token, expires_at: None }));
        }
        let now = Instant::now();
        if let Some(level) = level
            && !state.waiting_at.contains_key(&ticket)
        {
            let arrived = state.arrived.entry(level).or_insert(0);
            *arrived = arrived.saturating_add(1);
        }
        let live = state.until.is_some_and(|until| until > now);
        let served_next = state.head().is_none_or(|head| head == ticket);
        let room = (state.holders.len() as u32) < state.limit();
        if live && room && state.tokens.is_empty() {
            // The share has room but the block of tokens is spent: refresh now.
            self.hurry.notify_one();
        }
        let rate_ok = state.rate_ready(now).is_some_and(|at| at <= now);
        if live && served_next && room && rate_ok && !state.tokens.is_empty() {
            let at = state.waiting_at.get(&ticket).map(|(at, _)| *at);
            if let Some(at) = at {
                // The level's clock moves to the tag served.
                let clock = state.clock.entry(at.0.0).or_insert(0);
                *clock = (*clock).max(at.1);
            }
            let at = at.map(|at| at.0.0);
            state.unqueue(ticket);
            if let Some(rate) = &mut state.rate {
                rate.take(now);
            }
            let token = state.tokens.next().expect("checked above");
            state.last_token = state.last_token.max(token);
            state.holders.insert(ticket, (token, at.or(level).unwrap_or(128)));
            state.note_peak();
            state.granted += 1;
            let others_wait = !state.waiting.is_empty();
            drop(state);
            if others_wait {
                // The next in line may fit too.
                self.room.notify_waiters();
            }
            return Ok(Answer::Granted(Grant { fencing_token: token, expires_at: None }));
        }
        if let Some(first) = first
            && !state.waiting_at.contains_key(&ticket)
        {
            // Not granted: it would wait, in a line that may be full.
            if state.waiting_at.len() >= max {
                return Err(max);
            }
            state.enqueue(ticket, first);
            state.waiting_since.get_or_insert(now);
            state.note_peak();
        }
        Ok(Answer::Queued)
    }

    #[cfg(test)]
    fn keys_are_empty(&self) -> bool {
        lock(&self.state).keys.is_empty()
    }

    /// Whether nothing holds a permit from this share or waits for one.
    pub fn is_idle(&self) -> bool {
        let state = lock(&self.state);
        state.holders.is_empty() && state.waiting_at.is_empty()
    }

    /// Whether `ticket` holds a permit from this share.
    pub fn holds(&self, ticket: u64) -> bool {
        lock(&self.state).holders.contains_key(&ticket)
    }

    /// Every ticket that holds a permit here or waits for one.
    pub fn tickets(&self) -> Vec<u64> {
        let state = lock(&self.state);
        state.holders.keys().chain(state.waiting_at.keys()).copied().collect()
    }

    /// Whether `ticket` holds a permit here or waits for one.
    pub fn knows(&self, ticket: u64) -> bool {
        let state = lock(&self.state);
        state.holders.contains_key(&ticket) || state.waiting_at.contains_key(&ticket)
    }

    /// The rate share now, in grants per second (`None` for a limit without a rate).
    pub fn rate_share(&self) -> Option<f64> {
        let state = lock(&self.state);
        let live = state.until.is_some_and(|until| until > Instant::now());
        state.rate.as_ref().map(|rate| if live { rate.lease.share as f64 / 1000.0 } else { 0.0 })
    }

    /// (The share's limit now, permits out.)
    pub fn share(&self) -> (u32, u32) {
        let state = lock(&self.state);
        let live = state.until.is_some_and(|until| until > Instant::now());
        (if live { state.limit() } else { 0 }, state.holders.len() as u32)
    }

    /// Gives `ticket`'s permit back, or withdraws it from the line.
    pub fn release(&self, ticket: u64) -> Released {
        let mut state = lock(&self.state);
        let released = if state.holders.remove(&ticket).is_some() {
            state.leases.remove(ticket);
            Released::Permit
        } else if state.unqueue(ticket) {
            Released::Withdrawn
        } else {
            Released::Unknown
        };
        let others_wait = !state.waiting.is_empty();
        drop(state);
        if others_wait {
            self.room.notify_waiters();
        }
        released
    }

    /// Leases the permit `ticket` holds for `lease` from now, its first lease or a renewal:
    /// past its end unrenewed, the permit is taken back and reported lost by the share's
    /// keeper ([`keep_share`], [`ShareSource::lost`]), as a store ends an exact permit's lease.
    /// `false` if `ticket` holds no permit here, or its lease ended. A permit never leased is
    /// held until it is released or the share lapses.
    pub fn lease(&self, ticket: u64, lease: Duration) -> bool {
        let mut state = lock(&self.state);
        let now = Instant::now();
        // A lease that ended is not renewed, though its keeper has not taken it back yet.
        if !state.holders.contains_key(&ticket) || state.leases.ended(ticket, now) {
            return false;
        }
        let first = state.leases.set(ticket, now + lease);
        drop(state);
        if first {
            // It ends before any the keeper waits for.
            self.expiry.notify_one();
        }
        true
    }

    /// Takes back the permits whose leases ended unrenewed by `now`; returns them (lost).
    pub fn overdue(&self, now: Instant) -> Vec<u64> {
        let mut state = lock(&self.state);
        let mut lost = state.leases.take_ended(now);
        lost.retain(|ticket| state.holders.remove(ticket).is_some());
        let others_wait = !state.waiting.is_empty();
        drop(state);
        if !lost.is_empty() && others_wait {
            self.room.notify_waiters();
        }
        lost
    }

    /// When the first lease of a permit out ends, if any has one.
    pub fn next_lease_end(&self) -> Option<Instant> {
        lock(&self.state).leases.first_end()
    }

    /// Waits until `ticket` may be granted, for at most `at_most`. Registered for the wake-up
    /// before it looks, so a release between its last ask and this wait is not missed.
    pub async fn wait(&self, ticket: u64, at_most: Duration) {
        let notified = self.room.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let now = Instant::now();
        let at_most = match self.may_grant(ticket, now) {
            Some(at) if at <= now => return,
            // Only the rate holds it back: until the rate lets it go.
            Some(at) => at_most.min(at - now),
            None => at_most,
        };
        let _ = tokio::time::timeout(at_most, notified).await;
    }

    /// When an ask for `ticket` would be granted, if nothing but time holds it back: now, or
    /// when the rate lets it go. `None`: it waits for something else (room, its turn, a share,
    /// a block of tokens).
    fn may_grant(&self, ticket: u64, now: Instant) -> Option<Instant> {
        let state = lock(&self.state);
        let other = state.until.is_some_and(|until| until > now)
            && (state.holders.len() as u32) < state.limit()
            && !state.tokens.is_empty()
            && state.head().is_none_or(|head| head == ticket);
        if other { state.rate_ready(now) } else { None }
    }

    /// What to tell the store of the rate: the share enforced now, and the demand in
    /// thousandths of a grant per second by level — the rate arrivals came at over the last
    /// refresh interval or more, a tenth more (a share of exactly the rate measured would keep
    /// arrivals waiting), plus the waiters, to be served within a refresh interval (`every`).
    /// Tasks that acquire back to back arrive only as fast as they are granted, so a client
    /// bound by its share (someone waited for at least half the time since the last refresh)
    /// asks for at least four times its share, at its highest waiting level: a starved
    /// client's share grows geometrically to its fair part. Restarts the counts.
    fn rate_demand(&self, every: Duration) -> (u64, Demand) {
        let mut state = lock(&self.state);
        let now = Instant::now();
        let span = state.arrived_since.replace(now).map_or(every, |at| now - at);
        let counted = std::mem::take(&mut state.arrived);
        state.arrived_before.push_back((counted, span));
        let mut covered: Duration = state.arrived_before.iter().map(|(_, over)| *over).sum();
        while state.arrived_before.front().is_some_and(|(_, over)| covered - *over >= every) {
            covered -= state.arrived_before.pop_front().map_or(Duration::ZERO, |(_, over)| over);
        }
        let mut arrived: BTreeMap<u8, u32> = BTreeMap::new();
        for (counts, _) in &state.arrived_before {
            for (level, n) in counts {
                *arrived.entry(*level).or_insert(0) += n;
            }
        }
        let since = covered;
        // How long someone waited since the last refresh.
        let mut waited = std::mem::take(&mut state.waited);
        if let Some(since) = state.waiting_since {
            waited += now - since;
            state.waiting_since = Some(now);
        }
        let live = state.until.is_some_and(|until| until > now);
        let held = match &state.rate {
            Some(rate) if live => rate.lease.share,
            _ => 0,
        };
        let mut backlog: BTreeMap<u8, u32> = BTreeMap::new();
        for (Reverse(level), _, _) in state.waiting.keys() {
            *backlog.entry(*level).or_insert(0) += 1;
        }
        let per_second = |n: u32, over: Duration, margin: f64| {
            let milli = f64::from(n) * 1000.0 * margin / over.as_secs_f64().max(1e-3);
            milli.min(f64::from(u32::MAX)) as u32
        };
        let mut demand = Demand::none();
        for (level, n) in arrived {
            demand = demand.at(level, per_second(n, since, 1.1));
        }
        let top = backlog.keys().next_back().copied();
        for (level, n) in backlog {
            demand = demand.at(level, per_second(n, every, 1.0));
        }
        let starved = waited >= span / 2;
        if let Some(top) = top.filter(|_| starved) {
            let wanted = u32::try_from(held.saturating_mul(4)).unwrap_or(u32::MAX);
            let more = wanted.saturating_sub(demand.total());
            demand = demand.at(top, more);
        }
        (held, demand)
    }

    /// What to tell the store: the permits out, and the demand (permits out and waiters, by
    /// level). With `sending`, a refresh goes out now: no more than these permits may be out
    /// until it is answered.
    fn demand(&self, sending: bool) -> (u32, Demand) {
        let mut state = lock(&self.state);
        let held = state.holders.len() as u32;
        if sending {
            state.cap = Some(state.cap.map_or(held, |cap| cap.min(held)));
        }
        let mut demand = Demand::none();
        for (_, level) in state.holders.values() {
            demand = demand.at(*level, 1);
        }
        for (Reverse(level), _, _) in state.waiting.keys() {
            demand = demand.at(*level, 1);
        }
        // What was wanted at the busiest moment since the last refresh, beyond now, at the
        // default level.
        let now = held + state.waiting.len() as u32;
        demand = demand.at(128, state.peak.saturating_sub(now));
        if sending {
            state.peak = now;
        }
        (held, demand)
    }

    /// A refresh sent at `sent` came back: the new share until `until`, and a new block of
    /// tokens if asked. Returns the permits to report lost: all of those out if the share had
    /// lapsed before the answer (locally, or in Redis: `lapsed`), since their capacity may have
    /// gone to others meanwhile.
    pub fn renewed(&self, answer: ShareLease, until: Instant) -> Vec<u64> {
        let mut state = lock(&self.state);
        let ended = state.until.is_none_or(|old| old <= Instant::now());
        let lost = if answer.lapsed || (ended && !state.holders.is_empty()) {
            state.leases.clear();
            std::mem::take(&mut state.holders).into_keys().collect()
        } else {
            Vec::new()
        };
        state.share = answer.share;
        state.cap = None;
        state.until = Some(until);
        match (&mut state.rate, answer.rate) {
            (Some(rate), Some(lease)) => rate.renew(lease, Instant::now()),
            (rate, lease) => *rate = lease.map(|lease| RateState { lease, tat: None }),
        }
        if !answer.tokens.is_empty() {
            state.tokens = answer.tokens;
        }
        drop(state);
        self.room.notify_waiters();
        lost
    }

    /// The share lapsed unrefreshed by `now`: nothing more is granted, and every permit out is
    /// lost. Returns them.
    pub fn lapse(&self, now: Instant) -> Vec<u64> {
        let mut state = lock(&self.state);
        if state.until.is_none_or(|until| until > now) {
            return Vec::new();
        }
        state.share = 0;
        state.until = None;
        state.leases.clear();
        let lost = std::mem::take(&mut state.holders).into_keys().collect();
        drop(state);
        // Waiters ask again: a share out of touch sends them to the outage policy.
        self.room.notify_waiters();
        lost
    }

    /// When the share ends unless refreshed.
    pub fn until(&self) -> Option<Instant> {
        lock(&self.state).until
    }

    /// What the next refresh asks for besides the demand (the rate's part counted over the
    /// refresh interval `every`).
    fn share_ask(&self, demand: Demand, held: u32, tokens: u64, every: Duration) -> ShareRequest {
        let (rate_held, rate_demand) = self.rate_demand(every);
        let mut state = lock(&self.state);
        state.seq += 1;
        ShareRequest {
            demand,
            held,
            policy: self.policy,
            tokens,
            last_token: state.last_token,
            believes_held: state.until.is_some_and(|until| until > Instant::now()),
            seq: state.seq,
            rate: Some(RateDemand { held: rate_held, demand: rate_demand }),
        }
    }

    /// Whether the share has lapsed because the store stopped answering: the last refresh
    /// failed and the lease has ended. New asks then follow the client's outage policy, as for
    /// a limit in exact mode; tickets that hold or wait here stay here.
    pub fn out_of_touch(&self) -> bool {
        self.failed.load(Ordering::Acquire)
            && lock(&self.state).until.is_none_or(|until| until <= Instant::now())
    }

    /// Whether `ticket` is this share's to answer: it holds a permit here, or the share is not
    /// out of touch (see [`out_of_touch`](Self::out_of_touch)). A ticket waiting here for a
    /// share out of touch leaves the line: it goes to the client's outage policy instead.
    pub fn serves(&self, ticket: u64) -> bool {
        if !self.failed.load(Ordering::Acquire) {
            return true;
        }
        let mut state = lock(&self.state);
        if state.holders.contains_key(&ticket) {
            return true;
        }
        let out = state.until.is_none_or(|until| until <= Instant::now());
        if out {
            state.unqueue(ticket);
        }
        !out
    }

    fn note_answered(&self, answered: bool) {
        let state = lock(&self.state);
        let was_failed = self.failed.swap(!answered, Ordering::AcqRel);
        let newly_out =
            !answered && !was_failed && state.until.is_none_or(|until| until <= Instant::now());
        drop(state);
        if newly_out {
            // Out of touch now: waiters ask again, and go to the outage policy.
            self.room.notify_waiters();
        }
    }

    /// The store answered the client on another path: the share is not out of touch any
    /// more (asks wait here for its next refresh, which comes at once).
    pub fn store_answered(&self) {
        self.note_answered(true);
        self.hurry.notify_one();
    }

    /// The policy the limit is shared by.
    pub fn policy(&self) -> SharePolicy {
        self.policy
    }

    /// How `ticket` is asked about: its first ask at `priority` (it waits in line if it is not
    /// granted), a check (never starts a ticket: one that neither holds nor waits is finished),
    /// or a try (granted only at once).
    pub fn answer(&self, ticket: u64, first: Option<&Priority>, check: bool) -> Answer {
        self.answer_within(ticket, first, check, usize::MAX).unwrap_or(Answer::Queued)
    }

    /// As [`answer`](Self::answer), with a bounded line: `Err(max_waiters)` for a first ask
    /// that is not granted at once and finds `max_waiters` tickets waiting here already (it
    /// does not wait).
    ///
    /// # Errors
    ///
    /// The line is full: `max_waiters`.
    pub fn answer_within(
        &self,
        ticket: u64,
        first: Option<&Priority>,
        check: bool,
        max_waiters: usize,
    ) -> Result<Answer, usize> {
        match first {
            Some(priority) => {
                let first = First {
                    level: level_of(priority),
                    key: priority.fairness_key.clone(),
                    weight: priority.fairness_weight,
                };
                self.enter(ticket, Some(first), max_waiters)
            }
            None if check && !self.knows(ticket) => Ok(Answer::Finished),
            None => Ok(self.ask(ticket, None)),
        }
    }

    /// Whether waiters are held back by the rate share (they want more of it).
    fn rate_starved(&self) -> bool {
        let state = lock(&self.state);
        state.rate.is_some() && !state.waiting.is_empty()
    }

    /// The size of the next block of tokens to ask for (0: the block left lasts): enough for
    /// twice the grants a refresh interval (`every`) sees at the rate since the last refresh,
    /// and at least sixteen per permit wanted.
    fn tokens_wanted(&self, wanted: u32, every: Duration) -> u64 {
        let mut state = lock(&self.state);
        let used = std::mem::take(&mut state.granted);
        let now = Instant::now();
        let since = state.counted_since.replace(now).map_or(every, |at| now - at);
        let per_second = used as f64 / since.as_secs_f64().max(1e-3);
        let need =
            ((per_second * every.as_secs_f64() * 2.0) as u64).max(u64::from(wanted.max(16)) * 16);
        // At most what a store gives in one block (2^24; more and every refresh fails).
        if state.tokens.end - state.tokens.start >= need { 0 } else { (need * 2).min(1 << 24) }
    }
}

/// Keeps `name`'s share from `source` for as long as the source lives (or until the limit is
/// gone from the store while the share holds and awaits nothing: then
/// [`ShareSource::retired`]): refreshes it every third
/// of a lease (every tenth while it has waiters it cannot serve or after its share was cut, and
/// at once when its block of tokens is spent), and reports its permits lost the moment the
/// share lapses: at its end without a refresh, or when a refresh finds that it had lapsed.
/// A share its source no longer serves ([`ShareSource::serves`]) is refreshed no more: its
/// keeper ends once it holds nothing, its permits still out lost at its end.
pub async fn keep_share<S: ShareSource>(source: Weak<S>, name: String, share: Arc<LocalShare>) {
    loop {
        let Some(strong) = source.upgrade() else { return };
        for ticket in share.lapse(Instant::now()) {
            strong.lost(&name, ticket);
        }
        for ticket in share.overdue(Instant::now()) {
            strong.lost(&name, ticket);
        }
        if !strong.serves(&name, &share) {
            // Not served any more: refreshed no more. Waiters ask again (where the name is
            // served now); permits still out are lost when the share ends.
            share.room.notify_waiters();
            let Some(until) = share.until().filter(|_| !share.is_idle()) else { return };
            drop(strong);
            let wake = share.next_lease_end().map_or(until, |end| end.min(until));
            tokio::time::sleep_until(wake).await;
            continue;
        }
        let (held, demand) = share.demand(true);
        let wanted = demand.total();
        let lease = strong.lease();
        let tokens = share.tokens_wanted(wanted, lease / 3);
        let request = share.share_ask(demand, held, tokens, lease / 3);
        let rate_held = request.rate.as_ref().map_or(0, |rate| rate.held);
        let sent = Instant::now();
        // A share cut below what this client reserves: the next refresh, which reports the
        // cut in force, frees the rest for others, so it comes soon.
        let mut cut = false;
        // A store that hangs must not keep the share past its end unreported: a refresh gets
        // a third of a lease, and no time past the share's end (its permits are lost then,
        // below, not a refresh later).
        let give_up = share.until().map_or(sent + lease / 3, |until| until.min(sent + lease / 3));
        let refreshed = tokio::time::timeout_at(give_up, strong.refresh(&name, request)).await;
        if let Ok(Err(LimitError::UnknownLimit(_))) = &refreshed
            && share.is_idle()
        {
            // Removed from the store, and nothing here holds or waits: kept no more (a keeper
            // of every name ever leased would refresh forever).
            strong.retired(&name, &share);
            return;
        }
        share.note_answered(matches!(refreshed, Ok(Ok(_))));
        if let Ok(Ok(Some(answer))) = refreshed {
            cut = answer.share < held || answer.rate.is_some_and(|rate| rate.share < rate_held);
            for ticket in share.renewed(answer, lease_end(sent, lease)) {
                strong.lost(&name, ticket);
            }
        }
        for ticket in share.lapse(Instant::now()) {
            strong.lost(&name, ticket);
        }
        let wanted_now = share.demand(false).1.total();
        let starved = wanted_now > lock(&share.state).share || share.rate_starved();
        let until = share.until();
        drop(strong);
        let pause = if starved || cut { lease / 10 } else { lease / 3 };
        // Awake at the share's end too: its permits are reported lost then, not a pause later.
        let refresh_at =
            until.map_or(Instant::now() + pause, |until| (Instant::now() + pause).min(until));
        // And at each permit's lease end, to take it back (no refresh for that).
        loop {
            let wake = share.next_lease_end().map_or(refresh_at, |end| end.min(refresh_at));
            tokio::select! {
                () = tokio::time::sleep_until(wake) => {}
                () = share.hurry.notified() => break,
                () = share.expiry.notified() => continue,
            }
            if Instant::now() >= refresh_at {
                break;
            }
            let Some(strong) = source.upgrade() else { return };
            for ticket in share.overdue(Instant::now()) {
                strong.lost(&name, ticket);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store for a lease of 3 s whose refreshes never answer (`hangs`), or grant a share of
    /// two at once.
    #[derive(Default)]
    struct Store {
        hangs: bool,
        lost: Mutex<Vec<u64>>,
    }

    impl ShareSource for Store {
        fn lease(&self) -> Duration {
            Duration::from_secs(3)
        }

        fn refresh<'a>(
            &'a self,
            _name: &'a str,
            _request: ShareRequest,
        ) -> BoxFuture<'a, Result<Option<ShareLease>, LimitError>> {
            match self.hangs {
                true => Box::pin(std::future::pending()),
                false => Box::pin(std::future::ready(Ok(Some(ShareLease::new(
                    2,
                    Duration::ZERO,
                    1..1_000,
                ))))),
            }
        }

        fn lost(&self, _name: &str, ticket: u64) {
            lock(&self.lost).push(ticket);
        }
    }

    /// Review finding (stop 73, on the line's bound): a first ask is refused only when it
    /// would wait in a full line; one the share grants at once is granted, whatever the bound.
    #[tokio::test(start_paused = true)]
    async fn a_bounded_line_refuses_only_an_ask_that_would_wait() {
        let share = one_permit();
        let first = Priority::default();
        assert!(matches!(share.answer_within(1, Some(&first), false, 0), Ok(Answer::Granted(_))));
        assert_eq!(share.answer_within(2, Some(&first), false, 1), Ok(Answer::Queued));
        assert_eq!(share.answer_within(3, Some(&first), false, 1), Err(1), "the line is full");
        assert_eq!(share.answer_within(2, Some(&first), false, 1), Ok(Answer::Queued), "waits on");
    }

    /// Review finding (stop 73): a refresh that hung was given a third of a lease even when the
    /// share ended sooner, so its holders were told of the loss that much after the store had
    /// let the share go (and could give its permits to others).
    #[tokio::test(start_paused = true)]
    async fn a_hung_refresh_does_not_delay_the_loss_past_the_shares_end() {
        let share = Arc::new(LocalShare::new(SharePolicy::default()));
        let ends = Instant::now() + Duration::from_millis(100);
        share.renewed(ShareLease::new(1, Duration::ZERO, 1..1_000), ends);
        assert!(matches!(share.answer(7, Some(&Priority::default()), false), Answer::Granted(_)));
        let source = Arc::new(Store { hangs: true, ..Store::default() });
        let keeper = tokio::spawn(keep_share(Arc::downgrade(&source), "db".into(), share.clone()));
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(*lock(&source.lost), [7], "lost at the share's end, not a refresh later");
        keeper.abort();
    }

    /// A permit leased from a share is taken back when its lease runs out unrenewed, reported
    /// lost, and its place goes to the next in line; a renewal keeps it, a release ends its
    /// lease; a permit without a lease is held until released.
    #[tokio::test(start_paused = true)]
    async fn a_leased_permit_runs_out_unrenewed_and_its_place_goes_on() {
        let share = Arc::new(LocalShare::new(SharePolicy::default()));
        let source = Arc::new(Store::default());
        let keeper = tokio::spawn(keep_share(Arc::downgrade(&source), "db".into(), share.clone()));
        tokio::time::sleep(Duration::from_millis(10)).await;
        let first = Priority::default();
        for ticket in [1, 2] {
            assert!(matches!(share.answer(ticket, Some(&first), false), Answer::Granted(_)));
        }
        assert!(!share.lease(9, Duration::from_millis(100)), "no permit, no lease");
        assert!(share.lease(1, Duration::from_millis(500)));
        assert_eq!(share.answer(3, Some(&first), false), Answer::Queued);
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(share.lease(1, Duration::from_millis(500)), "renewed before its end");
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(share.holds(1), "the renewal moved its end");
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert!(!share.holds(1), "taken back at its end");
        assert!(!share.lease(1, Duration::from_millis(500)), "not renewed after its end");
        assert_eq!(*lock(&source.lost), [1]);
        assert!(matches!(share.answer(3, None, false), Answer::Granted(_)), "its place went on");
        assert!(share.holds(2), "a permit without a lease stays");
        assert!(share.lease(3, Duration::from_millis(100)));
        assert_eq!(share.release(3), Released::Permit);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(*lock(&source.lost), [1], "a released permit's lease ends with it");
        assert_eq!(share.next_lease_end(), None);
        keeper.abort();
    }

    /// Review finding (stop 74): a renewal that came after a lease's end, before the keeper
    /// took the permit back (late, or waiting on a refresh), renewed it.
    #[tokio::test(start_paused = true)]
    async fn a_lease_that_ended_is_not_renewed_before_it_is_taken_back() {
        let share = one_permit();
        assert!(matches!(share.answer(1, Some(&Priority::default()), false), Answer::Granted(_)));
        assert!(share.lease(1, Duration::from_millis(100)));
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert!(share.holds(1), "no keeper has taken it back");
        assert!(!share.lease(1, Duration::from_millis(100)), "its lease ended");
        assert_eq!(share.overdue(Instant::now()), [1]);
        assert_eq!(share.next_lease_end(), None);
    }

    /// A share of one permit that lasts: grants go one at a time.
    fn one_permit() -> LocalShare {
        let share = LocalShare::new(SharePolicy::default());
        let lease = ShareLease::new(1, Duration::ZERO, 1..1_000);
        share.renewed(lease, Instant::now() + Duration::from_secs(60));
        share
    }

    /// Releases `holder` and asks every waiting ticket in turn until one is granted; returns
    /// it (the one served next).
    fn next_served(share: &LocalShare, holder: u64, waiting: &mut Vec<u64>) -> u64 {
        assert_eq!(share.release(holder), Released::Permit);
        let granted = waiting
            .iter()
            .copied()
            .find(|&t| matches!(share.answer(t, None, true), Answer::Granted(_)))
            .expect("the one served next is granted");
        waiting.retain(|&t| t != granted);
        granted
    }

    fn order(share: &LocalShare, mut holder: u64, mut waiting: Vec<u64>) -> Vec<u64> {
        let mut served = Vec::new();
        while !waiting.is_empty() {
            holder = next_served(share, holder, &mut waiting);
            served.push(holder);
        }
        served
    }

    #[test]
    fn fairness_keys_take_turns_within_a_level_and_levels_come_first() {
        let share = one_permit();
        let first = share.answer(1, Some(&Priority::default()), false);
        assert!(matches!(first, Answer::Granted(_)));
        let a = Priority::default().key("a");
        for ticket in 2..5 {
            assert_eq!(share.answer(ticket, Some(&a), false), Answer::Queued);
        }
        assert_eq!(share.answer(5, Some(&Priority::default().key("b")), false), Answer::Queued);
        // A later, higher level goes first; then the keys take turns; within a key, FIFO.
        assert_eq!(share.answer(6, Some(&Priority::level(3)), false), Answer::Queued);
        assert_eq!(order(&share, 1, vec![2, 3, 4, 5, 6]), [6, 2, 5, 3, 4]);
    }

    /// A part of a rate: 10 a second with a burst of 1 (of a limit of 20/s, burst 2). On
    /// paused time: the burst goes at once, the next grant waits exactly one interval (the
    /// wait wakes by itself, with nothing else to wake it), and a third no sooner.
    #[tokio::test(start_paused = true)]
    async fn a_rate_share_paces_its_grants_and_its_wait_wakes_at_the_next_turn() {
        let share = LocalShare::new(SharePolicy::default());
        let lease = ShareLease::new(100, Duration::ZERO, 1..1_000)
            .with_rate(RateLease::new(10_000, 20_000, 2));
        share.renewed(lease, Instant::now() + Duration::from_secs(60));
        assert_eq!(share.rate_share(), Some(10.0));
        let start = Instant::now();
        let first = Priority::default();
        assert!(matches!(share.answer(1, Some(&first), false), Answer::Granted(_)));
        assert_eq!(share.answer(2, Some(&first), false), Answer::Queued);
        share.wait(2, Duration::from_secs(5)).await;
        assert_eq!(start.elapsed(), Duration::from_millis(100), "woken at its turn");
        assert!(matches!(share.answer(2, None, true), Answer::Granted(_)));
        assert_eq!(share.answer(3, Some(&first), false), Answer::Queued);
        tokio::time::advance(Duration::from_millis(99)).await;
        assert_eq!(share.answer(3, None, true), Answer::Queued, "not before its interval");
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(matches!(share.answer(3, None, true), Answer::Granted(_)));
    }

    #[test]
    fn a_heavier_key_gets_more_turns_and_an_idle_key_banks_nothing() {
        let share = one_permit();
        assert!(matches!(share.answer(1, Some(&Priority::default()), false), Answer::Granted(_)));
        let heavy = Priority::default().key("heavy").weight(2);
        let light = Priority::default().key("light");
        for ticket in 2..6 {
            share.answer(ticket, Some(&heavy), false);
        }
        for ticket in 6..8 {
            share.answer(ticket, Some(&light), false);
        }
        // Heavy's tags step by half: two of its turns to each of light's.
        assert_eq!(order(&share, 1, vec![2, 3, 4, 5, 6, 7]), [2, 3, 6, 4, 5, 7]);
        // Nobody waits: a key that comes back starts at the clock, not ahead of it.
        assert!(share.keys_are_empty());
    }
}
