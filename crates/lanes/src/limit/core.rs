//! The limit table: named limits, each a counting semaphore and a GCRA token bucket in front of
//! one [`WaitQueue`]. A pure, deterministic state machine: time is an argument.
//!
//! # Invariants
//!
//! 1. Only the ticket the queue serves next may be granted (no barging), and only while
//!    `in_use < concurrent` and the bucket has a token.
//! 2. A held permit is never revoked by a redefinition: shrinking `concurrent` only delays the
//!    next grants until `in_use` falls below the new bound.
//! 3. A leased permit whose lease has expired at `now` no longer counts; it is reclaimed by the
//!    next operation on its limit.
//! 4. Fencing tokens grow strictly per limit name, one per grant, for the life of the table:
//!    a limit defined anew (after a removal) starts above every token the table ever issued.
//! 6. A released or withdrawn ticket is finished: `check` answers [`Acquire::Finished`] and
//!    never queues it again; only a first ask (`acquire`) queues.
//! 5. Limits are found by hashing their name, but nothing iterates the hash map in its own
//!    order: listings, expiries and the saved form are sorted by name, so answers and saved
//!    bytes stay deterministic.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::config::LimitSpec;
use super::error::LimitError;
use super::priority::Priority;
use super::snapshot::{LimitInfo, Observations, Observed, ObservedCell};
use super::waiters::WaitQueue;
use crate::util::FastMap;

/// The answer to an acquire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "answer", rename_all = "snake_case")]
pub enum Acquire {
    /// The ticket holds a permit.
    Granted(Grant),
    /// The ticket waits: other tickets are served first, or every permit is held.
    Queued,
    /// The ticket is served next but the bucket is empty: ask again at this time.
    RetryAt(Duration),
    /// The ticket neither waits nor holds a permit: it was released, withdrawn, reclaimed
    /// when its lease ended, or never asked. Only [`LimitTable::check`] answers this; nothing
    /// queues a finished ticket again.
    Finished,
}

/// A granted permit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    /// Strictly increasing per limit: hand it to a downstream to fence out stale holders.
    pub fencing_token: u64,
    /// When the permit's lease ends, for leased permits.
    pub expires_at: Option<Duration>,
}

/// The counters of a limit that travel between the table and the in-process fast path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Counters {
    /// GCRA's theoretical arrival time.
    pub(crate) tat: Duration,
    /// The last fencing token issued.
    pub(crate) fencing: u64,
    /// Grants so far.
    pub(crate) granted_total: u64,
    /// The most permits held at once.
    pub(crate) max_in_use: u32,
}

/// What a release did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Released {
    /// A held permit was returned.
    Permit,
    /// A waiting ticket left the queue.
    Withdrawn,
    /// The ticket was unknown (already released, expired, or never asked): nothing changed.
    Unknown,
}

/// What the queue of a limit will do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// `ticket` can be granted now.
    Ready(u64),
    /// `ticket` is served next once the bucket refills at this time.
    At(u64, Duration),
    /// `ticket` is served next once a permit is returned.
    Blocked(u64),
}

impl Next {
    /// The ticket served next.
    pub fn ticket(self) -> u64 {
        match self {
            Self::Ready(t) | Self::At(t, _) | Self::Blocked(t) => t,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Held {
    grant: Grant,
}

fn sorted_held<S: Serializer>(held: &FastMap<u64, Held>, serializer: S) -> Result<S::Ok, S::Error> {
    held.iter().collect::<BTreeMap<_, _>>().serialize(serializer)
}

/// One limit's state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct LimitState {
    spec: LimitSpec,
    #[serde(serialize_with = "sorted_held")]
    held: FastMap<u64, Held>,
    queue: WaitQueue,
    /// GCRA's theoretical arrival time.
    tat: Duration,
    granted_total: u64,
    max_in_use: u32,
    fencing: u64,
    /// The earliest lease expiry among held permits, to skip needless scans.
    next_expiry: Option<Duration>,
    /// Permits held outside the table (the in-process fast path's), counted in `in_use`.
    #[serde(default)]
    external: u32,
    /// Leases reclaimed since the owner last asked
    /// ([`LimitTable::take_expired_and_set_external`]).
    #[serde(skip)]
    expired: u64,
    /// What the table saw of this limit's waiters (for the snapshot; not state).
    #[serde(skip)]
    observed: ObservedCell,
}

impl LimitState {
    fn new(spec: LimitSpec, fencing: u64) -> Self {
        Self {
            spec,
            held: FastMap::default(),
            queue: WaitQueue::new(),
            tat: Duration::ZERO,
            granted_total: 0,
            max_in_use: 0,
            fencing,
            next_expiry: None,
            external: 0,
            expired: 0,
            observed: ObservedCell::default(),
        }
    }

    fn in_use(&self) -> u32 {
        u32::try_from(self.held.len()).unwrap_or(u32::MAX).saturating_add(self.external)
    }

    /// Reclaims permits whose lease ended at or before `now` (invariant 3).
    fn expire(&mut self, now: Duration, reclaimed: &mut Vec<u64>) {
        if self.next_expiry.is_none_or(|at| at > now) {
            return;
        }
        self.held.retain(|ticket, held| {
            let alive = held.grant.expires_at.is_none_or(|at| at > now);
            if !alive {
                reclaimed.push(*ticket);
                self.expired += 1;
            }
            alive
        });
        self.next_expiry = self.held.values().filter_map(|h| h.grant.expires_at).min();
    }

    /// GCRA: `Ok` if a token is available at `now`, else the time one will be.
    fn rate_check(&self, now: Duration) -> Result<Duration, Duration> {
        let Some(interval) = self.spec.emission_interval() else {
            return Ok(self.tat);
        };
        let tolerance = interval.saturating_mul(self.spec.burst.saturating_sub(1));
        let tat = self.tat.max(now);
        let earliest = tat.saturating_sub(tolerance);
        if earliest <= now { Ok(tat.saturating_add(interval)) } else { Err(earliest) }
    }

    fn next(&self, now: Duration) -> Option<Next> {
        let ticket = self.queue.peek()?;
        if self.in_use() >= self.spec.concurrent {
            return Some(Next::Blocked(ticket));
        }
        Some(match self.rate_check(now) {
            Ok(_) => Next::Ready(ticket),
            Err(at) => Next::At(ticket, at),
        })
    }

    /// The answer to a waiting `ticket`: granted if it is served next and can be (no barging),
    /// else when to ask again or plain queued.
    fn answer_waiting(&mut self, ticket: u64, now: Duration, lease: Option<Duration>) -> Acquire {
        match self.next(now) {
            Some(Next::Ready(next)) if next == ticket => {
                self.queue.pop();
                Acquire::Granted(self.grant(ticket, now, lease))
            }
            Some(Next::At(next, at)) if next == ticket => Acquire::RetryAt(at),
            _ => Acquire::Queued,
        }
    }

    fn grant(&mut self, ticket: u64, now: Duration, lease: Option<Duration>) -> Grant {
        if let Ok(tat) = self.rate_check(now) {
            self.tat = tat;
        }
        self.fencing += 1;
        let expires_at = lease.map(|lease| now.saturating_add(lease));
        let grant = Grant { fencing_token: self.fencing, expires_at };
        self.held.insert(ticket, Held { grant });
        if let Some(at) = expires_at {
            self.next_expiry = Some(self.next_expiry.map_or(at, |next| next.min(at)));
        }
        self.granted_total += 1;
        self.max_in_use = self.max_in_use.max(self.in_use());
        grant
    }
}

/// Named limits and their waiters, as a pure state machine. See the [module docs](super).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use lanes::{Acquire, LimitSpec, LimitTable, Priority};
///
/// let mut table = LimitTable::new();
/// table.define("db", LimitSpec::concurrent(1))?;
/// let now = Duration::ZERO;
/// let first = table.acquire("db", 1, &Priority::default(), now)?;
/// assert!(matches!(first, Acquire::Granted(_)));
/// assert_eq!(table.acquire("db", 2, &Priority::default(), now)?, Acquire::Queued);
/// table.release("db", 1, now)?;
/// assert!(matches!(table.acquire("db", 2, &Priority::default(), now)?, Acquire::Granted(_)));
/// # Ok::<(), lanes::LimitError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LimitTable {
    #[serde(serialize_with = "sorted", deserialize_with = "unsorted")]
    limits: ByName,
    max_waiters: usize,
    /// The highest fencing token of every limit removed so far: a limit defined anew starts
    /// above it (invariant 4).
    #[serde(default)]
    fence_floor: u64,
    /// The observations of limits handed back to the in-process fast path, until the table
    /// adopts them again (not state).
    #[serde(skip)]
    observed: Observations,
}

/// The error for a table operation on a name that is not defined.
#[cold]
#[inline(never)]
fn unknown(name: &str) -> LimitError {
    LimitError::UnknownLimit(name.to_owned())
}

fn sorted<S: Serializer>(limits: &ByName, serializer: S) -> Result<S::Ok, S::Error> {
    limits.iter().collect::<BTreeMap<_, _>>().serialize(serializer)
}

fn unsorted<'de, D: Deserializer<'de>>(deserializer: D) -> Result<ByName, D::Error> {
    let limits = BTreeMap::<Arc<str>, LimitState>::deserialize(deserializer)?;
    let mut by_name = ByName::default();
    for (name, state) in limits {
        by_name.insert(name, state);
    }
    Ok(by_name)
}

/// The table's limits by name: a map that keeps the entry its owner found last. The owner
/// asks about one limit several times per change (look, grant, settle, hand back), by the
/// name the table itself handed out, so comparing the name's address with the kept entry's
/// finds it without hashing the name (about a tenth of a contended acquire's cost went to
/// such lookups). The comparison is exact: the kept entry's name is alive, so no other
/// string can sit at its address.
#[derive(Debug, Clone, Default)]
struct ByName {
    entries: Vec<(Arc<str>, LimitState)>,
    /// Each name's place in `entries`.
    index: FastMap<Arc<str>, usize>,
    /// The entry [`get_mut`](Self::get_mut) found last; checked before use, never trusted.
    last: usize,
}

impl ByName {
    /// Where `name` is: the kept entry if `name` is its very string (the owner's calls, about
    /// ten a contended cycle, come here inlined), else the index.
    #[inline(always)]
    fn find(&self, name: &str) -> Option<usize> {
        if let Some((kept, _)) = self.entries.get(self.last)
            && std::ptr::eq(kept.as_ptr(), name.as_ptr())
            && kept.len() == name.len()
        {
            return Some(self.last);
        }
        self.find_hashed(name)
    }

    /// [`find`](Self::find) through the index: out of line, so that the inlined check stays
    /// small.
    #[inline(never)]
    fn find_hashed(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
    }

    fn get(&self, name: &str) -> Option<&LimitState> {
        self.find(name).map(|at| &self.entries[at].1)
    }

    fn get_key_value(&self, name: &str) -> Option<(&Arc<str>, &LimitState)> {
        self.find(name).map(|at| {
            let (name, state) = &self.entries[at];
            (name, state)
        })
    }

    fn get_mut(&mut self, name: &str) -> Option<&mut LimitState> {
        let at = self.find(name)?;
        self.last = at;
        Some(&mut self.entries[at].1)
    }

    fn contains_key(&self, name: &str) -> bool {
        self.find(name).is_some()
    }

    /// Sets `name`'s state, replacing any.
    fn insert(&mut self, name: Arc<str>, state: LimitState) {
        match self.index.get(&name) {
            Some(&at) => self.entries[at].1 = state,
            None => {
                self.index.insert(name.clone(), self.entries.len());
                self.entries.push((name, state));
            }
        }
    }

    /// `name`'s state, made by `make` if it has none.
    fn get_or_insert_with(
        &mut self,
        name: &Arc<str>,
        make: impl FnOnce() -> LimitState,
    ) -> &mut LimitState {
        if !self.contains_key(name) {
            self.insert(name.clone(), make());
        }
        self.get_mut(name).expect("inserted above")
    }

    fn remove(&mut self, name: &str) -> Option<LimitState> {
        let at = self.index.remove(name)?;
        let (_, state) = self.entries.swap_remove(at);
        if let Some((moved, _)) = self.entries.get(at) {
            *self.index.get_mut(moved).expect("every entry is indexed") = at;
        }
        Some(state)
    }

    fn iter(&self) -> impl Iterator<Item = (&Arc<str>, &LimitState)> {
        self.entries.iter().map(|(name, state)| (name, state))
    }

    fn iter_mut(&mut self) -> impl Iterator<Item = (&Arc<str>, &mut LimitState)> {
        self.entries.iter_mut().map(|(name, state)| (&*name, state))
    }

    fn values(&self) -> impl Iterator<Item = &LimitState> {
        self.entries.iter().map(|(_, state)| state)
    }
}

/// Equal as maps: the same names with equal states, whatever their order.
impl PartialEq for ByName {
    fn eq(&self, other: &Self) -> bool {
        self.entries.len() == other.entries.len()
            && self.iter().all(|(name, state)| other.get(name) == Some(state))
    }
}

impl Default for LimitTable {
    fn default() -> Self {
        Self::new()
    }
}

impl LimitTable {
    /// The default maximum of waiters per limit.
    pub const DEFAULT_MAX_WAITERS: usize = 100_000;

    /// An empty table allowing [`DEFAULT_MAX_WAITERS`](Self::DEFAULT_MAX_WAITERS) waiters per
    /// limit.
    pub fn new() -> Self {
        Self::with_max_waiters(Self::DEFAULT_MAX_WAITERS)
    }

    /// An empty table allowing `max_waiters` waiters per limit.
    pub fn with_max_waiters(max_waiters: usize) -> Self {
        Self {
            limits: ByName::default(),
            max_waiters,
            fence_floor: 0,
            observed: Observations::default(),
        }
    }

    /// The maximum of waiters per limit.
    pub fn max_waiters(&self) -> usize {
        self.max_waiters
    }

    /// Defines `name`, or redefines it: a new spec takes effect for the next grants and never
    /// revokes a held permit.
    ///
    /// # Errors
    ///
    /// [`LimitError::InvalidSpec`] if the spec breaks a rule.
    pub fn define(&mut self, name: &str, spec: LimitSpec) -> Result<(), LimitError> {
        spec.validate()?;
        match self.limits.get_mut(name) {
            Some(state) => state.spec = spec,
            None => {
                self.limits.insert(Arc::from(name), LimitState::new(spec, self.fence_floor));
            }
        }
        Ok(())
    }

    /// Removes `name`.
    ///
    /// # Errors
    ///
    /// [`LimitError::UnknownLimit`], or [`LimitError::InUse`] while permits are held (leases
    /// expired at `now` do not count) or tickets wait.
    pub fn remove(&mut self, name: &str, now: Duration) -> Result<LimitSpec, LimitError> {
        let state = self.state(name)?;
        state.expire(now, &mut Vec::new());
        if !state.held.is_empty() || !state.queue.is_empty() || state.external > 0 {
            return Err(LimitError::InUse(name.to_owned()));
        }
        let state = self.limits.remove(name).expect("present");
        self.fence_floor = self.fence_floor.max(state.fencing);
        self.observed.0.remove(name);
        Ok(state.spec)
    }

    /// `name`'s state. Inlined into every table operation (a contended cycle makes about ten),
    /// with the error built out of line.
    #[inline(always)]
    fn state(&mut self, name: &str) -> Result<&mut LimitState, LimitError> {
        match self.limits.get_mut(name) {
            Some(state) => Ok(state),
            None => Err(unknown(name)),
        }
    }

    /// Asks for the permit of `ticket` (no lease). See [`acquire_leased`](Self::acquire_leased).
    ///
    /// # Errors
    ///
    /// As for [`acquire_leased`](Self::acquire_leased).
    pub fn acquire(
        &mut self,
        name: &str,
        ticket: u64,
        priority: &Priority,
        now: Duration,
    ) -> Result<Acquire, LimitError> {
        self.acquire_leased(name, ticket, priority, now, None)
    }

    /// Asks for the permit of `ticket`. The first ask queues the ticket at `priority`; later asks
    /// keep that priority. Asking again for a granted ticket answers the same `Granted`.
    ///
    /// The ticket is granted only if it is the one the queue serves next, a permit is free and
    /// the bucket has a token; a granted permit is leased until `now + lease` if a lease is
    /// given.
    ///
    /// # Errors
    ///
    /// [`LimitError::UnknownLimit`], or [`LimitError::TooManyWaiters`] if a new ticket finds the
    /// waiting room full.
    pub fn acquire_leased(
        &mut self,
        name: &str,
        ticket: u64,
        priority: &Priority,
        now: Duration,
        lease: Option<Duration>,
    ) -> Result<Acquire, LimitError> {
        let max_waiters = self.max_waiters;
        let state = self.state(name)?;
        state.expire(now, &mut Vec::new());
        if let Some(held) = state.held.get(&ticket) {
            return Ok(Acquire::Granted(held.grant));
        }
        let key = &priority.fairness_key;
        let too_many = |observed: &mut Observed| {
            observed.refused += 1;
            Err(LimitError::TooManyWaiters { limit: name.to_owned(), max: max_waiters })
        };
        // Nobody waits: the ticket would be the head at once, so skip the queue.
        if state.queue.is_empty() && state.in_use() < state.spec.concurrent {
            return match state.rate_check(now) {
                Ok(_) => {
                    state.observed.0.granted(ticket, Some(key), now);
                    Ok(Acquire::Granted(state.grant(ticket, now, lease)))
                }
                Err(_) if max_waiters == 0 => too_many(&mut state.observed.0),
                Err(at) => {
                    state.queue.push(ticket, priority);
                    state.observed.0.queued(ticket, key.clone(), now);
                    Ok(Acquire::RetryAt(at))
                }
            };
        }
        // `push` answers whether the ticket is new, so a new one costs one lookup, not two.
        if state.queue.len() < max_waiters && state.queue.push(ticket, priority) {
            state.observed.0.queued(ticket, key.clone(), now);
            // Whatever path a ticket left by, the observations forget it before they grow.
            if state.observed.0.waiting_len() > 2 * state.queue.len() + 64 {
                let queue = &state.queue;
                state.observed.0.forget_unless(|ticket| queue.contains(ticket));
            }
        } else if !state.queue.contains(ticket) {
            return too_many(&mut state.observed.0);
        }
        let answer = state.answer_waiting(ticket, now, lease);
        if let Acquire::Granted(_) = answer {
            state.observed.0.granted(ticket, Some(key), now);
        }
        Ok(answer)
    }

    /// Asks again for a ticket that was asked before, never queuing it: `Granted` if it holds a
    /// permit (granted now if it is served next and can be), `Queued` or `RetryAt` while it
    /// waits, and [`Acquire::Finished`] if it neither waits nor holds (invariant 6).
    ///
    /// # Errors
    ///
    /// [`LimitError::UnknownLimit`].
    pub fn check(
        &mut self,
        name: &str,
        ticket: u64,
        now: Duration,
        lease: Option<Duration>,
    ) -> Result<Acquire, LimitError> {
        let state = self.state(name)?;
        state.expire(now, &mut Vec::new());
        // A waiting ticket holds nothing (a grant takes it out of the queue), so the head (the
        // ticket a release grants on its waiter's behalf) needs no lookup at all.
        if state.queue.peek() != Some(ticket) && !state.queue.contains(ticket) {
            return Ok(match state.held.get(&ticket) {
                Some(held) => Acquire::Granted(held.grant),
                None => Acquire::Finished,
            });
        }
        debug_assert!(!state.held.contains_key(&ticket), "a waiting ticket holds nothing");
        let answer = state.answer_waiting(ticket, now, lease);
        if let Acquire::Granted(_) = answer {
            state.observed.0.granted(ticket, None, now);
        }
        Ok(answer)
    }

    /// Grants `ticket` a permit only if that can happen now — nobody waits, a permit is free,
    /// the bucket has a token — and never queues it: the answer is `Granted`, `Queued` (busy:
    /// permits are held or others wait; nothing was left behind) or `RetryAt` (the bucket has a
    /// token then). A try never needs the waiting room, so it never fails for a full one.
    ///
    /// # Errors
    ///
    /// [`LimitError::UnknownLimit`].
    pub fn try_acquire(
        &mut self,
        name: &str,
        ticket: u64,
        now: Duration,
        lease: Option<Duration>,
    ) -> Result<Acquire, LimitError> {
        let state = self.state(name)?;
        state.expire(now, &mut Vec::new());
        if let Some(held) = state.held.get(&ticket) {
            return Ok(Acquire::Granted(held.grant));
        }
        let answer = if !state.queue.is_empty() || state.in_use() >= state.spec.concurrent {
            Acquire::Queued
        } else {
            match state.rate_check(now) {
                Ok(_) => Acquire::Granted(state.grant(ticket, now, lease)),
                Err(at) => Acquire::RetryAt(at),
            }
        };
        let observed = &mut state.observed.0;
        match answer {
            Acquire::Granted(_) => observed.granted(ticket, Some(&None), now),
            _ => observed.refused += 1,
        }
        Ok(answer)
    }

    /// The earliest lease end among the permits of `name`, if any is leased: when the head of
    /// a queue blocked by held permits should ask again.
    pub fn next_expiry_of(&self, name: &str) -> Option<Duration> {
        self.limits.get(name).and_then(|s| s.next_expiry)
    }

    /// Grants the ticket the queue serves next if it can be granted now, on behalf of its
    /// waiter (who will find it granted when it asks again).
    ///
    /// # Errors
    ///
    /// [`LimitError::UnknownLimit`].
    pub fn grant_next(
        &mut self,
        name: &str,
        now: Duration,
        lease: Option<Duration>,
    ) -> Result<Option<(u64, Grant)>, LimitError> {
        let state = self.state(name)?;
        state.expire(now, &mut Vec::new());
        Ok(match state.next(now) {
            Some(Next::Ready(ticket)) => {
                state.queue.pop();
                let grant = state.grant(ticket, now, lease);
                state.observed.0.granted(ticket, None, now);
                Some((ticket, grant))
            }
            _ => None,
        })
    }

    /// What the queue of `name` will do next at `now`, if anyone waits.
    ///
    /// # Errors
    ///
    /// [`LimitError::UnknownLimit`].
    pub fn next(&mut self, name: &str, now: Duration) -> Result<Option<Next>, LimitError> {
        let state = self.state(name)?;
        state.expire(now, &mut Vec::new());
        Ok(state.next(now))
    }

    /// Returns the permit of `ticket`, or withdraws it from the queue. An unknown ticket is a
    /// no-op. The returned permit does not return its token.
    ///
    /// # Errors
    ///
    /// [`LimitError::UnknownLimit`].
    pub fn release(
        &mut self,
        name: &str,
        ticket: u64,
        now: Duration,
    ) -> Result<Released, LimitError> {
        let state = self.state(name)?;
        state.expire(now, &mut Vec::new());
        if state.held.remove(&ticket).is_some() {
            return Ok(Released::Permit);
        }
        Ok(if state.queue.remove(ticket) {
            state.observed.0.withdrawn(ticket);
            Released::Withdrawn
        } else {
            Released::Unknown
        })
    }

    /// Extends the lease of a held permit to `now + lease`. Returns false if the ticket holds no
    /// permit (never granted, released, or already expired at `now`).
    ///
    /// # Errors
    ///
    /// [`LimitError::UnknownLimit`].
    pub fn renew(
        &mut self,
        name: &str,
        ticket: u64,
        now: Duration,
        lease: Duration,
    ) -> Result<bool, LimitError> {
        let state = self.state(name)?;
        state.expire(now, &mut Vec::new());
        let Some(held) = state.held.get_mut(&ticket) else {
            return Ok(false);
        };
        let at = now.saturating_add(lease);
        held.grant.expires_at = Some(at);
        state.next_expiry = state.held.values().filter_map(|h| h.grant.expires_at).min();
        Ok(true)
    }

    /// Reclaims every permit whose lease ended at or before `now`, returning `(limit, ticket)`
    /// pairs in name then ticket order.
    pub fn expire(&mut self, now: Duration) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        for (name, state) in self.limits.iter_mut() {
            let mut reclaimed = Vec::new();
            state.expire(now, &mut reclaimed);
            out.extend(reclaimed.into_iter().map(|ticket| (name.to_string(), ticket)));
        }
        out.sort();
        out
    }

    /// The earliest lease expiry across all limits, if any permit is leased.
    pub fn next_expiry(&self) -> Option<Duration> {
        self.limits.values().filter_map(|s| s.next_expiry).min()
    }

    /// Whether `name` is defined in this table.
    pub fn governs(&self, name: &str) -> bool {
        self.limits.contains_key(name)
    }

    /// Whether `ticket` holds a permit of `name` (ignoring lease expiry).
    pub fn holds(&self, name: &str, ticket: u64) -> bool {
        self.limits.get(name).is_some_and(|s| s.held.contains_key(&ticket))
    }

    /// Whether `ticket` waits in the queue of `name`.
    pub fn is_waiting(&self, name: &str, ticket: u64) -> bool {
        self.limits.get(name).is_some_and(|s| s.queue.contains(ticket))
    }

    /// The state of `name`.
    pub fn info(&self, name: &str) -> Option<LimitInfo> {
        self.limits.get(name).map(|state| {
            let observed = &state.observed.0;
            LimitInfo {
                name: name.to_owned(),
                spec: state.spec,
                in_use: state.in_use(),
                waiting: state.queue.len(),
                granted_total: state.granted_total,
                max_in_use: state.max_in_use,
                refused_total: observed.refused,
                withdrawn_total: observed.withdrawn,
                expired_total: observed.expired + state.expired,
                keys: observed.keys(&state.queue.waiting_by_key()),
                mode: None,
                shares: Vec::new(),
            }
        })
    }

    /// Every limit's name and spec, in name order.
    pub fn list(&self) -> Vec<(&str, &LimitSpec)> {
        let mut list: Vec<_> =
            self.limits.iter().map(|(name, state)| (&**name, &state.spec)).collect();
        list.sort_by(|a, b| a.0.cmp(b.0));
        list
    }

    /// Every limit's state, in name order.
    pub fn infos(&self) -> Vec<LimitInfo> {
        self.list().into_iter().filter_map(|(name, _)| self.info(name)).collect()
    }

    /// Takes in limit `name` with `spec` and the counters it had outside the table (the
    /// in-process fast path hands a limit to the table when a caller must wait).
    pub(crate) fn adopt(&mut self, name: &Arc<str>, spec: LimitSpec, counters: Counters) {
        let stashed = &mut self.observed;
        let state = self.limits.get_or_insert_with(name, || {
            let mut state = LimitState::new(spec, counters.fencing);
            state.observed.0 = stashed.0.remove(name).unwrap_or_default();
            state
        });
        state.spec = spec;
        state.tat = counters.tat;
        state.fencing = state.fencing.max(counters.fencing);
        state.granted_total = counters.granted_total;
        state.max_in_use = state.max_in_use.max(counters.max_in_use);
    }

    /// How many leased permits of `name` were reclaimed since the last call; also sets how many
    /// of its permits are held outside the table, as [`set_external`](Self::set_external) does
    /// (the owner's settling step after every table operation, in one lookup of `name`).
    pub(crate) fn take_expired_and_set_external(&mut self, name: &str, external: u32) -> u64 {
        let Some(state) = self.limits.get_mut(name) else { return 0 };
        state.external = external;
        let taken = std::mem::take(&mut state.expired);
        state.observed.0.expired += taken;
        taken
    }

    /// The highest fencing token of every limit removed from this table so far.
    pub(crate) fn fence_floor(&self) -> u64 {
        self.fence_floor
    }

    /// Sets how many permits of `name` are held outside the table.
    pub(crate) fn set_external(&mut self, name: &str, external: u32) {
        if let Some(state) = self.limits.get_mut(name) {
            state.external = external;
        }
    }

    /// Hands limit `name` back to the fast path if nothing waits and the table holds no
    /// permit: removes it and answers its counters.
    pub(crate) fn release_if_idle(&mut self, name: &str) -> Option<Counters> {
        let state = self.limits.get(name)?;
        if !state.held.is_empty() || !state.queue.is_empty() {
            return None;
        }
        let mut state = self.limits.remove(name)?;
        self.fence_floor = self.fence_floor.max(state.fencing);
        let observed = std::mem::take(&mut state.observed.0);
        self.observed.0.insert(name.into(), observed);
        Some(Counters {
            tat: state.tat,
            fencing: state.fencing,
            granted_total: state.granted_total,
            max_in_use: state.max_in_use,
        })
    }

    /// The shared name of limit `name`, if defined (to hand out without allocating).
    pub fn name(&self, name: &str) -> Option<Arc<str>> {
        self.limits.get_key_value(name).map(|(name, _)| name.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(concurrent: u32) -> LimitState {
        LimitState::new(LimitSpec::concurrent(concurrent), 0)
    }

    fn concurrent(map: &ByName, name: &str) -> Option<u32> {
        map.get(name).map(|state| state.spec.concurrent)
    }

    #[test]
    fn by_name_finds_by_address_and_by_hash_across_removals() {
        let (a, b, c): (Arc<str>, Arc<str>, Arc<str>) = ("a".into(), "b".into(), "c".into());
        let mut map = ByName::default();
        map.insert(a.clone(), state(1));
        map.insert(b.clone(), state(2));
        map.insert(c.clone(), state(3));
        // Kept by address, then found by another copy of the name.
        assert_eq!(map.get_mut(&a).map(|s| s.spec.concurrent), Some(1));
        assert_eq!(concurrent(&map, &String::from("a")), Some(1));
        // "a" goes; "c" moves into its place, where the kept index points.
        assert_eq!(map.remove("a").map(|s| s.spec.concurrent), Some(1));
        assert_eq!(concurrent(&map, &a), None, "the kept index now holds another name");
        assert_eq!(concurrent(&map, &c), Some(3));
        assert_eq!(map.get_mut("c").map(|s| s.spec.concurrent), Some(3));
        assert_eq!(concurrent(&map, &b), Some(2));
        // Back under a new allocation: found by hash, the old address never matches it.
        map.insert(Arc::from("a"), state(4));
        assert_eq!(concurrent(&map, &a), Some(4));
        assert_eq!(map.get_key_value("b").map(|(name, _)| Arc::ptr_eq(name, &b)), Some(true));
        // Equal as maps, whatever the order.
        let mut other = ByName::default();
        for (name, concurrent) in [("a", 4), ("c", 3), ("b", 2)] {
            other.insert(Arc::from(name), state(concurrent));
        }
        assert_eq!(map, other);
        other.get_mut("b").unwrap().spec.concurrent = 5;
        assert_ne!(map, other);
    }
}
