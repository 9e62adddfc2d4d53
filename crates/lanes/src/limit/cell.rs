//! The in-process fast path: one limit's permits and token bucket as a few atomics, used while
//! nobody waits — as tokio's `Semaphore` and governor's GCRA are. When a caller must wait (no
//! free permit, or the bucket is empty for an acquire), the limit goes *slow*: the locked
//! [`LimitTable`](super::LimitTable) and its wait queue take over until the queue is empty
//! again, so the wait order (levels, fair keys, arrival, no barging) is never bypassed.
//!
//! # Invariants
//!
//! 1. `state` is one word: the permits taken through the fast path (bits 0..16), the fast
//!    grants since the table last handed the limit back (bits 16..30), the `WAIT` bit (bit
//!    30: callers wait in the limit's line, see invariant 5), a generation (bits 31..63,
//!    bumped at every hand-over to or from the table and whenever the line empties) and the
//!    `SLOW` bit. A fast acquire commits with one compare-and-swap of the whole word, so it
//!    can only commit while `SLOW` and `WAIT` are clear, there is room, and no hand-over
//!    happened since it looked. The
//!    generation has 32 bits because a fast acquire paused across exactly 2^31 hand-and-back
//!    cycles would commit against its stale look (and reuse a token); the two counts are
//!    narrower because running out of either only costs a visit to the table.
//! 2. A grant's fencing token is the fence at the last hand-back plus the grant's number in
//!    the word, and the total of grants is counted the same way: both are decided by the
//!    commit itself, so the table, which reads the word as it sets `SLOW`, sees exactly the
//!    committed grants and the last token (no extra atomic per grant, no token skipped). The
//!    bases are written only while `SLOW` is set, before the hand-back's new generation, or
//!    under the line's lock while `WAIT` is set (a full grants field moved into them); an
//!    attempt reads them before its commit, which the generation validates, and anyone else
//!    reads them under the table's or the line's lock.
//! 3. A fast acquire takes its GCRA token (`tat`) *before* it commits, so the table sees it
//!    too; an attempt that fails to commit wastes at most one token (the rate is never
//!    exceeded).
//! 4. While `SLOW` is set only the table grants; fast permits can still be returned (a release
//!    decrements the count, then lets the table hand the permit on). When either field of the
//!    word is full, the fast path answers [`Miss::Spent`]: the table takes the grant, and its
//!    hand-back starts the grants field again from zero.
//! 5. While the fast path governs, callers of the default priority that find no permit wait
//!    in the limit's *line* (a FIFO list under a lock of its own, as a semaphore's waiters
//!    do) instead of handing the limit to the table. Under the line's lock, `WAIT` is set
//!    exactly while someone is in line; no fast acquire commits while it is, so nobody
//!    barges. A returned permit that finds `WAIT` set is handed to the first in line: the
//!    count stays, the grants field counts one more ([`Cell::take_for_line`]). `SLOW` is
//!    set only with the line's lock held, and the table takes the line with it, so while
//!    the line has anyone in it the limit is not slow.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use super::config::{LimitSpec, gcra};
use super::core::Counters;

const COUNT: u64 = (1 << 16) - 1;
const GRANT: u64 = 1 << 16;
const GRANTS: u64 = ((1 << 14) - 1) << 16;
const WAIT: u64 = 1 << 30;
const GENERATION: u64 = 1 << 31;
const SLOW: u64 = 1 << 63;
/// The bits a commit must find unchanged besides the count and the grants.
const EPOCH: u64 = !(COUNT | GRANTS);
/// Either bit closes the fast path.
const CLOSED: u64 = SLOW | WAIT;

/// Why the fast path could not grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Miss {
    /// The table governs the limit, or every permit is held: ask the table.
    Slow,
    /// The bucket has a token at this time (ns since the backend's origin).
    Rate(u64),
    /// The fast path's word is full (invariant 4): ask the table, which may grant.
    Spent,
    /// The table took the limit (and may have handed it back) while this attempt looked:
    /// ask the table, which knows whether a permit is free now.
    Handover,
}

/// What a returned permit asks of its returner (see [`Cell::release_fast`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Returned {
    /// Nothing: nobody waits.
    Done,
    /// The table governs the limit: let it hand the permit on.
    Table,
    /// Callers wait in the line: hand the permit to the first of them.
    Line,
}

/// What [`Cell::enter_line`] and [`Cell::take_for_line`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Turn {
    /// A permit, taken: its fencing token.
    Taken(u64),
    /// Every permit is held (or others are in line first): wait in line.
    Wait,
    /// The table must decide: it governs the limit, or the word is full (invariant 4).
    Table,
}

/// What a fast acquire saw before taking its token.
#[derive(Debug, Clone, Copy)]
struct Look {
    seen: u64,
    fence_base: u64,
}

#[derive(Debug)]
pub(crate) struct Cell {
    state: AtomicU64,
    concurrent: AtomicU32,
    burst: AtomicU32,
    /// Nanoseconds between grants at the sustained rate; 0 without a rate.
    interval: AtomicU64,
    /// The spec's `per_second`, as `f64` bits (meaningful only with an interval).
    per_second: AtomicU64,
    /// GCRA's theoretical arrival time, ns since the backend's origin.
    tat: AtomicU64,
    /// The last fencing token issued when the table last handed the limit back (invariant 2).
    fence_base: AtomicU64,
    /// The grants counted when the table last handed the limit back.
    granted_base: AtomicU64,
    max_in_use: AtomicU32,
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The fast grants in `state` since the last hand-back.
fn grants(state: u64) -> u64 {
    (state & GRANTS) >> 16
}

impl Cell {
    pub(crate) fn new(spec: LimitSpec, fence: u64) -> Self {
        let cell = Self {
            state: AtomicU64::new(0),
            concurrent: AtomicU32::new(0),
            burst: AtomicU32::new(1),
            interval: AtomicU64::new(0),
            per_second: AtomicU64::new(0),
            tat: AtomicU64::new(0),
            fence_base: AtomicU64::new(fence),
            granted_base: AtomicU64::new(0),
            max_in_use: AtomicU32::new(0),
        };
        cell.set_spec(spec);
        cell
    }

    pub(crate) fn set_spec(&self, spec: LimitSpec) {
        let interval = spec.interval_nanos();
        self.per_second.store(spec.per_second.unwrap_or(0.0).to_bits(), Ordering::Relaxed);
        self.burst.store(spec.burst, Ordering::Relaxed);
        self.interval.store(interval, Ordering::Relaxed);
        self.concurrent.store(spec.concurrent, Ordering::Release);
    }

    /// The spec, as last set.
    pub(crate) fn spec(&self) -> LimitSpec {
        let interval = self.interval.load(Ordering::Acquire);
        LimitSpec {
            concurrent: self.concurrent.load(Ordering::Acquire),
            per_second: (interval != 0)
                .then(|| f64::from_bits(self.per_second.load(Ordering::Acquire))),
            burst: self.burst.load(Ordering::Acquire),
        }
    }

    /// Whether the rate needs the clock.
    pub(crate) fn has_rate(&self) -> bool {
        self.interval.load(Ordering::Relaxed) != 0
    }

    /// Takes a permit (and a token) without a lock, if nobody waits, a permit is free and the
    /// bucket has a token at `now` (ns; ignored without a rate). Answers the fencing token.
    #[inline]
    pub(crate) fn try_fast(&self, now: u64) -> Result<u64, Miss> {
        let look = self.look()?;
        // Invariant 3: the token first, then the commit.
        self.take_token(now)?;
        self.commit(look, 1)
    }

    /// Spends a token at `now` if a permit could be taken now, and takes none: a permit taken
    /// and returned at once, counted as a grant (its fencing number is used up).
    #[inline]
    pub(crate) fn check_fast(&self, now: u64) -> Result<(), Miss> {
        let look = self.look()?;
        self.take_token(now)?;
        self.commit(look, 0).map(drop)
    }

    /// The word and the fence base under its generation, if the fast path may grant.
    #[inline]
    fn look(&self) -> Result<Look, Miss> {
        let seen = self.state.load(Ordering::Acquire);
        if seen & CLOSED != 0
            || (seen & COUNT) >= u64::from(self.concurrent.load(Ordering::Acquire))
        {
            return Err(Miss::Slow);
        }
        // Read after the word; the commit validates its generation (invariant 2).
        Ok(Look { seen, fence_base: self.fence_base.load(Ordering::Acquire) })
    }

    /// Takes a GCRA token at `now`, if the limit has a rate.
    #[inline]
    fn take_token(&self, now: u64) -> Result<(), Miss> {
        let interval = self.interval.load(Ordering::Relaxed);
        if interval == 0 {
            return Ok(());
        }
        let burst = u64::from(self.burst.load(Ordering::Relaxed).saturating_sub(1));
        let tolerance = interval.saturating_mul(burst);
        let mut tat = self.tat.load(Ordering::Acquire);
        loop {
            let next = gcra(tat, now, interval, tolerance).map_err(Miss::Rate)?;
            match self.tat.compare_exchange_weak(tat, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(()),
                Err(actual) => tat = actual,
            }
        }
    }

    /// Commits a grant against what `look` saw: only in the same generation (invariant 1).
    /// `held` is 1 for a permit kept, 0 for a check (returned at once).
    #[inline]
    fn commit(&self, look: Look, held: u64) -> Result<u64, Miss> {
        let mut seen = look.seen;
        loop {
            let used = seen & COUNT;
            if seen & CLOSED != 0 || used >= u64::from(self.concurrent.load(Ordering::Acquire)) {
                return Err(Miss::Slow);
            }
            if used == COUNT || seen & GRANTS == GRANTS {
                return Err(Miss::Spent);
            }
            match self.state.compare_exchange_weak(
                seen,
                seen + held + GRANT,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    self.peak(used);
                    return Ok(look.fence_base + grants(seen) + 1);
                }
                // A hand-over happened since the look: its fence base and the token taken
                // may not count (invariants 1 and 3).
                Err(actual) if actual & EPOCH != look.seen & EPOCH => {
                    return Err(Miss::Handover);
                }
                Err(actual) => seen = actual,
            }
        }
    }

    /// Returns a fast permit; answers who must hand it on, if anyone waits.
    #[inline]
    pub(crate) fn release_fast(&self) -> Returned {
        let seen = self.state.fetch_sub(1, Ordering::AcqRel);
        if seen & CLOSED == 0 {
            Returned::Done
        } else if seen & SLOW != 0 {
            Returned::Table
        } else {
            Returned::Line
        }
    }

    /// For a caller about to wait in line (call under the line's lock): a permit if one is
    /// free and nobody is in line, else `WAIT` set, so that no fast acquire takes the next
    /// free permit before the line does (invariant 5). `Table` for a limit with a rate.
    pub(crate) fn enter_line(&self) -> Turn {
        // The line keeps no bucket: a limit with a rate waits in the table.
        if self.has_rate() {
            return Turn::Table;
        }
        let mut seen = self.state.load(Ordering::Acquire);
        loop {
            if seen & SLOW != 0 {
                return Turn::Table;
            }
            let used = seen & COUNT;
            let next =
                if seen & WAIT == 0 && used < u64::from(self.concurrent.load(Ordering::Acquire)) {
                    if used == COUNT || seen & GRANTS == GRANTS {
                        return Turn::Table;
                    }
                    seen + 1 + GRANT
                } else {
                    seen | WAIT
                };
            match self.state.compare_exchange_weak(seen, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) if next & WAIT != 0 => return Turn::Wait,
                // The bases are stable: `SLOW` is set only under the line's lock.
                Ok(_) => return Turn::Taken(self.granted(seen, used)),
                Err(actual) => seen = actual,
            }
        }
    }

    /// Takes a free permit for the first in line (call under the line's lock, someone in
    /// line): `Wait` while every permit is held; `Table` if the count field is full or the
    /// limit now has a rate.
    pub(crate) fn take_for_line(&self) -> Turn {
        // A rate set since the line formed: the table takes the line and keeps the bucket.
        if self.has_rate() {
            return Turn::Table;
        }
        let mut seen = self.state.load(Ordering::Acquire);
        loop {
            debug_assert!(seen & WAIT != 0 && seen & SLOW == 0, "someone is in line");
            let used = seen & COUNT;
            if used >= u64::from(self.concurrent.load(Ordering::Acquire)) {
                return Turn::Wait;
            }
            if used == COUNT {
                return Turn::Table;
            }
            if seen & GRANTS == GRANTS {
                // The grants field is full: its grants go into the bases (invariant 2), so
                // that a busy line never needs the table for them.
                match self.state.compare_exchange_weak(
                    seen,
                    seen & !GRANTS,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => {
                        self.fence_base.fetch_add(grants(seen), Ordering::AcqRel);
                        self.granted_base.fetch_add(grants(seen), Ordering::AcqRel);
                        seen &= !GRANTS;
                    }
                    Err(actual) => {
                        seen = actual;
                        continue;
                    }
                }
            }
            match self.state.compare_exchange_weak(
                seen,
                seen + 1 + GRANT,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Turn::Taken(self.granted(seen, used)),
                Err(actual) => seen = actual,
            }
        }
    }

    /// The line is empty (call under its lock): fast acquires may commit again. A new
    /// generation, so that an attempt that looked before the line formed never commits.
    pub(crate) fn leave_line(&self) {
        let mut seen = self.state.load(Ordering::Acquire);
        while seen & WAIT != 0 {
            // Never slow here (the table takes the line with the limit).
            let next = (seen & !(WAIT | SLOW)).wrapping_add(GENERATION) & !SLOW;
            match self.state.compare_exchange_weak(seen, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return,
                Err(actual) => seen = actual,
            }
        }
    }

    /// Whether callers wait in the line.
    pub(crate) fn has_line(&self) -> bool {
        self.state.load(Ordering::Acquire) & WAIT != 0
    }

    /// A grant just committed on `seen` under the line's lock (with `used` permits held
    /// before it): the peak, and its fencing token (invariant 2).
    #[inline]
    fn granted(&self, seen: u64, used: u64) -> u64 {
        self.peak(used);
        self.fence_base.load(Ordering::Acquire) + grants(seen) + 1
    }

    /// Notes `used + 1` permits held at once.
    #[inline]
    fn peak(&self, used: u64) {
        // `used` < COUNT < u32::MAX, so the peak fits.
        let peak = (used + 1) as u32;
        if peak > self.max_in_use.load(Ordering::Relaxed) {
            self.max_in_use.fetch_max(peak, Ordering::Relaxed);
        }
    }

    /// Fast permits held now.
    pub(crate) fn fast_in_use(&self) -> u32 {
        // At most `COUNT`, which fits.
        (self.state.load(Ordering::Acquire) & COUNT) as u32
    }

    pub(crate) fn is_slow(&self) -> bool {
        self.state.load(Ordering::Acquire) & SLOW != 0
    }

    /// Hands the limit to the table (call under the table's lock): closes the fast path and
    /// answers the counters as of now (invariant 2).
    pub(crate) fn go_slow(&self, origin_nanos: impl Fn(u64) -> Duration) -> Counters {
        let mut seen = self.state.load(Ordering::Acquire);
        loop {
            // The line, if any, goes to the table with it (invariant 5).
            let next = ((seen | SLOW) & !WAIT).wrapping_add(GENERATION) | SLOW;
            match self.state.compare_exchange_weak(seen, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(actual) => seen = actual,
            }
        }
        // While slow nothing commits, so the word just replaced holds every fast grant.
        Counters {
            tat: origin_nanos(self.tat.load(Ordering::Acquire)),
            fencing: self.fence_base.load(Ordering::Acquire) + grants(seen),
            granted_total: self.granted_base.load(Ordering::Acquire) + grants(seen),
            max_in_use: self.max_in_use.load(Ordering::Acquire),
        }
    }

    /// Takes the limit back from the table (call under the table's lock) with its counters.
    pub(crate) fn go_fast(&self, counters: Counters) {
        self.tat.store(nanos(counters.tat), Ordering::Release);
        self.fence_base.store(counters.fencing, Ordering::Release);
        self.granted_base.store(counters.granted_total, Ordering::Release);
        self.max_in_use.fetch_max(counters.max_in_use, Ordering::AcqRel);
        let mut seen = self.state.load(Ordering::Acquire);
        loop {
            // The grants start again from the new bases; the count stays.
            let next = (seen & !(SLOW | GRANTS)).wrapping_add(GENERATION) & !SLOW;
            match self.state.compare_exchange_weak(seen, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(actual) => seen = actual,
            }
        }
    }

    /// The counters while fast (call under the table's lock and the line's, so that neither
    /// a hand-over nor the line moves the bases meanwhile): grants, the last token, the
    /// peak.
    pub(crate) fn counters(&self) -> (u64, u64, u32) {
        let grants = grants(self.state.load(Ordering::Acquire));
        (
            self.granted_base.load(Ordering::Acquire) + grants,
            self.fence_base.load(Ordering::Acquire) + grants,
            self.max_in_use.load(Ordering::Acquire),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permits_are_bounded_and_returned() {
        let cell = Cell::new(LimitSpec::concurrent(2), 10);
        assert_eq!(cell.try_fast(0), Ok(11));
        assert_eq!(cell.try_fast(0), Ok(12));
        assert_eq!(cell.try_fast(0), Err(Miss::Slow));
        assert_eq!(cell.release_fast(), Returned::Done);
        assert_eq!(cell.fast_in_use(), 1);
        assert_eq!(cell.try_fast(0), Ok(13), "tokens never repeat, and none is skipped");
    }

    #[test]
    fn a_commit_across_a_hand_over_fails_and_never_reuses_the_old_base() {
        let cell = Cell::new(LimitSpec::concurrent(4), 10);
        assert_eq!(cell.try_fast(0), Ok(11));
        let look = cell.look().unwrap();
        // The table takes the limit, grants 8 tokens (12..=19), and hands it back.
        let counters = cell.go_slow(Duration::from_nanos);
        assert_eq!(counters.fencing, 11);
        cell.go_fast(Counters { fencing: 19, granted_total: 9, ..counters });
        assert_eq!(cell.commit(look, 1), Err(Miss::Handover));
        assert_eq!(cell.try_fast(0), Ok(20));
        assert_eq!(cell.counters(), (10, 20, 2));
    }

    #[test]
    fn a_check_spends_a_token_and_a_number_and_holds_nothing() {
        // 10 per second, burst 2, one permit.
        let cell = Cell::new(LimitSpec::concurrent(1).per_second(10.0).burst(2), 0);
        assert_eq!(cell.check_fast(0), Ok(()));
        assert_eq!(cell.fast_in_use(), 0);
        assert_eq!(cell.try_fast(0), Ok(2), "the check used up token 1");
        assert_eq!(cell.check_fast(100_000_000), Err(Miss::Slow), "the one permit is held");
        cell.release_fast();
        assert_eq!(cell.check_fast(0), Err(Miss::Rate(100_000_000)), "the bucket is empty");
        assert_eq!(cell.check_fast(100_000_000), Ok(()));
        assert_eq!(cell.counters(), (3, 3, 1));
    }

    #[test]
    fn the_generation_wraps_without_touching_the_slow_bit_or_the_counts() {
        let cell = Cell::new(LimitSpec::concurrent(4), 0);
        let first = cell.try_fast(0).unwrap();
        // The last generation before the wrap, with the permit and the grant just taken.
        cell.state.store((EPOCH & !SLOW) | 1 | GRANT, Ordering::Release);
        let counters = cell.go_slow(Duration::from_nanos);
        assert!(cell.is_slow());
        assert_eq!(cell.fast_in_use(), 1);
        assert_eq!((counters.fencing, counters.granted_total), (first, 1));
        cell.go_fast(counters);
        assert!(!cell.is_slow());
        assert_eq!(cell.state.load(Ordering::Acquire) & EPOCH, GENERATION, "wrapped to one");
        assert_eq!(cell.fast_in_use(), 1);
        assert_eq!(cell.try_fast(0), Ok(first + 1));
    }

    #[test]
    fn a_full_grants_field_sends_the_grant_to_the_table_and_the_hand_back_restarts_it() {
        let cell = Cell::new(LimitSpec::concurrent(1), 100);
        let mut last = 100;
        for _ in 0..GRANTS >> 16 {
            last = cell.try_fast(0).unwrap();
            cell.release_fast();
        }
        assert_eq!(last, 100 + (GRANTS >> 16));
        assert_eq!(cell.try_fast(0), Err(Miss::Spent));
        let counters = cell.go_slow(Duration::from_nanos);
        assert_eq!((counters.fencing, counters.granted_total), (last, GRANTS >> 16));
        // The table grants one, then hands the limit back.
        cell.go_fast(Counters {
            fencing: last + 1,
            granted_total: counters.granted_total + 1,
            ..counters
        });
        assert_eq!(cell.try_fast(0), Ok(last + 2));
        assert_eq!(cell.counters(), ((GRANTS >> 16) + 2, last + 2, 1));
    }

    #[test]
    fn the_line_closes_the_fast_path_and_takes_returned_permits_in_turn() {
        let cell = Cell::new(LimitSpec::concurrent(2), 10);
        assert_eq!(cell.try_fast(0), Ok(11));
        let stale = cell.look().unwrap();
        assert_eq!(cell.enter_line(), Turn::Taken(12), "free and nobody in line: taken");
        assert_eq!(cell.enter_line(), Turn::Wait);
        assert!(cell.has_line());
        assert_eq!(cell.release_fast(), Returned::Line, "a returned permit goes to the line");
        assert_eq!(cell.try_fast(0), Err(Miss::Slow), "nobody barges past the line");
        assert_eq!(cell.commit(stale, 1), Err(Miss::Handover), "nor commits what it saw before");
        assert_eq!(cell.take_for_line(), Turn::Taken(13));
        assert_eq!(cell.take_for_line(), Turn::Wait, "both permits held");
        cell.leave_line();
        assert!(!cell.has_line());
        assert_eq!(cell.release_fast(), Returned::Done);
        assert_eq!(cell.try_fast(0), Ok(14), "open again, tokens in grant order");
        assert_eq!(cell.counters(), (4, 14, 2));
    }

    #[test]
    fn the_table_takes_the_line_and_the_line_moves_a_full_grants_field_into_the_bases() {
        let cell = Cell::new(LimitSpec::concurrent(1), 0);
        assert!(matches!(cell.enter_line(), Turn::Taken(1)));
        assert_eq!(cell.enter_line(), Turn::Wait);
        let counters = cell.go_slow(Duration::from_nanos);
        assert!(cell.is_slow() && !cell.has_line(), "the table took the line");
        assert_eq!(cell.enter_line(), Turn::Table);
        assert_eq!(cell.release_fast(), Returned::Table);
        cell.go_fast(Counters { fencing: 1, granted_total: 1, ..counters });
        // Grants up to a full field, then a caller in line.
        for _ in 1..GRANTS >> 16 {
            cell.try_fast(0).unwrap();
            cell.release_fast();
        }
        assert!(matches!(cell.enter_line(), Turn::Taken(_)), "the field's last grant");
        assert_eq!(cell.enter_line(), Turn::Wait);
        assert_eq!(cell.release_fast(), Returned::Line);
        let last = 1 + (GRANTS >> 16);
        assert_eq!(cell.take_for_line(), Turn::Taken(last + 1), "the field starts again");
        assert_eq!(cell.counters(), (last + 1, last + 1, 1));
        let counters = cell.go_slow(Duration::from_nanos);
        assert_eq!((counters.fencing, counters.granted_total), (last + 1, last + 1));
    }

    #[test]
    fn a_limit_with_a_rate_never_grants_in_line() {
        let cell = Cell::new(LimitSpec::concurrent(1), 0);
        assert!(matches!(cell.enter_line(), Turn::Taken(1)));
        assert_eq!(cell.enter_line(), Turn::Wait);
        // A rate set while someone is in line: the returned permit goes to the table.
        cell.set_spec(LimitSpec::concurrent(1).per_second(10.0));
        assert_eq!(cell.release_fast(), Returned::Line);
        assert_eq!(cell.take_for_line(), Turn::Table, "the line keeps no bucket");
        assert_eq!(cell.enter_line(), Turn::Table);
    }

    #[test]
    fn the_bucket_is_gcra() {
        // 10 per second, burst 2: two at once, then one every 100 ms.
        let cell = Cell::new(LimitSpec::concurrent(100).per_second(10.0).burst(2), 0);
        assert!(cell.try_fast(0).is_ok());
        assert!(cell.try_fast(0).is_ok());
        assert_eq!(cell.try_fast(0), Err(Miss::Rate(100_000_000)));
        assert!(cell.try_fast(100_000_000).is_ok());
        assert_eq!(cell.try_fast(150_000_000), Err(Miss::Rate(200_000_000)));
    }

    #[test]
    fn a_slow_limit_grants_nothing_fast_and_hands_over_its_counters() {
        let cell = Cell::new(LimitSpec::concurrent(5), 0);
        let first = cell.try_fast(0).unwrap();
        let counters = cell.go_slow(Duration::from_nanos);
        assert_eq!((counters.fencing, counters.granted_total, counters.max_in_use), (first, 1, 1));
        assert_eq!(cell.try_fast(0), Err(Miss::Slow));
        assert_eq!(
            cell.release_fast(),
            Returned::Table,
            "a release while slow must reach the table"
        );
        cell.go_fast(Counters { fencing: first + 5, ..counters });
        assert_eq!(cell.try_fast(0), Ok(first + 6));
    }

    #[test]
    fn racing_threads_never_exceed_the_bound_nor_repeat_a_token() {
        use std::sync::Arc;
        let cell = Arc::new(Cell::new(LimitSpec::concurrent(3), 0));
        let held = Arc::new(AtomicU32::new(0));
        let tokens = Arc::new(std::sync::Mutex::new(Vec::new()));
        // Hand-overs mid-race: a slow period in which the table grants 8 tokens of its own
        // (counted with the fast ones), then the table hands the limit back.
        // The threads meet at a barrier so that the race overlaps, and the hand-overs go on
        // until every racing thread has made its attempts and the fast path has granted too:
        // a scheduler that parks the hand-over thread while the limit is slow cannot starve
        // the fast path for the whole run. A thread that panics ends every loop (`Stop`), and
        // the hand-overs give up after a minute, so a broken cell fails the test, not hangs it.
        struct Stop(Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Stop {
            fn drop(&mut self) {
                if std::thread::panicking() {
                    self.0.store(true, Ordering::Release);
                }
            }
        }
        let start = Arc::new(std::sync::Barrier::new(5));
        let (fast_granted, attempted) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let handover = {
            let (cell, tokens, start) = (cell.clone(), tokens.clone(), start.clone());
            let (fast_granted, attempted, done) =
                (fast_granted.clone(), attempted.clone(), done.clone());
            std::thread::spawn(move || {
                let _stop = Stop(done.clone());
                start.wait();
                let give_up = std::time::Instant::now() + Duration::from_secs(60);
                let mut granted = 0;
                let mut round = 0;
                while !done.load(Ordering::Acquire)
                    && std::time::Instant::now() < give_up
                    && (round < 200
                        || attempted.load(Ordering::Acquire) < 4
                        || fast_granted.load(Ordering::Relaxed) < 100)
                {
                    round += 1;
                    let counters = cell.go_slow(Duration::from_nanos);
                    let table = counters.fencing + 1..=counters.fencing + 8;
                    tokens.lock().unwrap().extend(table.clone());
                    granted += 8;
                    cell.go_fast(Counters {
                        fencing: *table.end(),
                        granted_total: counters.granted_total + 8,
                        ..counters
                    });
                    std::thread::yield_now();
                }
                done.store(true, Ordering::Release);
                granted
            })
        };
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (cell, held, tokens) = (cell.clone(), held.clone(), tokens.clone());
                let (start, fast_granted, done) =
                    (start.clone(), fast_granted.clone(), done.clone());
                let attempted = attempted.clone();
                std::thread::spawn(move || {
                    let _stop = Stop(done.clone());
                    start.wait();
                    for attempt in 0.. {
                        if attempt == 20_000 {
                            attempted.fetch_add(1, Ordering::Release);
                        }
                        if attempt >= 20_000 && done.load(Ordering::Acquire) {
                            break;
                        }
                        if let Ok(token) = cell.try_fast(0) {
                            let now = held.fetch_add(1, Ordering::SeqCst) + 1;
                            assert!(now <= 3, "{now} holders");
                            tokens.lock().unwrap().push(token);
                            held.fetch_sub(1, Ordering::SeqCst);
                            fast_granted.fetch_add(1, Ordering::Relaxed);
                            cell.release_fast();
                        }
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        let table_granted = handover.join().unwrap();
        let mut tokens = Arc::try_unwrap(tokens).unwrap().into_inner().unwrap();
        let n = tokens.len();
        tokens.sort_unstable();
        tokens.dedup();
        assert_eq!(tokens.len(), n, "no token twice");
        assert_eq!(cell.fast_in_use(), 0);
        // Every committed grant counted, and the last token is the highest given out.
        let counters = cell.go_slow(Duration::from_nanos);
        assert_eq!(counters.granted_total, n as u64);
        // The hand-overs ran until both had granted (or gave up: then this says so).
        let fast_granted = u64::from(fast_granted.load(Ordering::Relaxed));
        assert_eq!(n as u64, table_granted + fast_granted, "every grant recorded once");
        assert!(table_granted > 0 && fast_granted >= 100, "both granted");
        assert_eq!(counters.fencing, *tokens.last().unwrap());
    }
}
