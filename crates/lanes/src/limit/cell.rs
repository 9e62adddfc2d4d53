//! The in-process fast path: one limit's permits and token bucket as a few atomics, used while
//! nobody waits — as tokio's `Semaphore` and governor's GCRA are. When a caller must wait (no
//! free permit, or the bucket is empty for an acquire), the limit goes *slow*: the locked
//! [`LimitTable`](super::LimitTable) and its wait queue take over until the queue is empty
//! again, so the wait order (levels, fair keys, arrival, no barging) is never bypassed.
//!
//! # Invariants
//!
//! 1. `state` holds the permits taken through the fast path (low 32 bits), a generation (bits
//!    32..63, bumped at every hand-over to or from the table) and the `SLOW` bit. A fast
//!    acquire commits with one compare-and-swap of the whole word, so it can only commit
//!    while `SLOW` is clear, there is room, and no hand-over happened since it looked.
//! 2. A fast acquire takes its token (GCRA `tat`) and its fencing token *before* it commits.
//!    So the table, which reads both after setting `SLOW`, sees every committed fast grant;
//!    an attempt that fails to commit wastes at most one token and one fencing number (the
//!    rate is never exceeded, tokens never repeat; they need not be contiguous).
//! 3. While `SLOW` is set only the table grants; fast permits can still be returned (a release
//!    decrements the count, then lets the table hand the permit on).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use super::config::LimitSpec;
use super::core::Counters;

const COUNT: u64 = 0xFFFF_FFFF;
const GENERATION: u64 = 1 << 32;
const SLOW: u64 = 1 << 63;

/// Why the fast path could not grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Miss {
    /// The table governs the limit, or every permit is held: ask the table.
    Slow,
    /// The bucket has a token at this time (ns since the backend's origin).
    Rate(u64),
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
    /// The last fencing token issued.
    fence: AtomicU64,
    /// The fencing token before the first grant, so grants = `fence - fence_start` while fast.
    granted: AtomicU64,
    max_in_use: AtomicU32,
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
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
            fence: AtomicU64::new(fence),
            granted: AtomicU64::new(0),
            max_in_use: AtomicU32::new(0),
        };
        cell.set_spec(spec);
        cell
    }

    pub(crate) fn set_spec(&self, spec: LimitSpec) {
        let interval =
            spec.emission_interval().map_or(0, nanos).max(u64::from(spec.per_second.is_some()));
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
        let mut seen = self.state.load(Ordering::Acquire);
        if seen & SLOW != 0 || (seen & COUNT) as u32 >= self.concurrent.load(Ordering::Acquire) {
            return Err(Miss::Slow);
        }
        // Invariant 2: the token and the fencing number first, then the commit.
        let interval = self.interval.load(Ordering::Relaxed);
        if interval != 0 {
            let burst = u64::from(self.burst.load(Ordering::Relaxed).saturating_sub(1));
            let tolerance = interval.saturating_mul(burst);
            let mut tat = self.tat.load(Ordering::Acquire);
            loop {
                let base = tat.max(now);
                let earliest = base.saturating_sub(tolerance);
                if earliest > now {
                    return Err(Miss::Rate(earliest));
                }
                match self.tat.compare_exchange_weak(
                    tat,
                    base.saturating_add(interval),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => break,
                    Err(actual) => tat = actual,
                }
            }
        }
        let fence = self.fence.fetch_add(1, Ordering::AcqRel) + 1;
        loop {
            let used = (seen & COUNT) as u32;
            if seen & SLOW != 0 || used >= self.concurrent.load(Ordering::Acquire) {
                return Err(Miss::Slow);
            }
            match self.state.compare_exchange_weak(
                seen,
                seen + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    self.granted.fetch_add(1, Ordering::Relaxed);
                    if used + 1 > self.max_in_use.load(Ordering::Relaxed) {
                        self.max_in_use.fetch_max(used + 1, Ordering::Relaxed);
                    }
                    return Ok(fence);
                }
                // A hand-over happened since the token was taken: it may not count (inv. 1).
                Err(actual) if actual & !COUNT != seen & !COUNT => return Err(Miss::Slow),
                Err(actual) => seen = actual,
            }
        }
    }

    /// Returns a fast permit; answers whether the table governs the limit now (then the caller
    /// must let the table hand the permit on).
    pub(crate) fn release_fast(&self) -> bool {
        self.state.fetch_sub(1, Ordering::AcqRel) & SLOW != 0
    }

    /// Fast permits held now.
    pub(crate) fn fast_in_use(&self) -> u32 {
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
            let next = (seen | SLOW).wrapping_add(GENERATION) | SLOW;
            match self.state.compare_exchange_weak(seen, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(actual) => seen = actual,
            }
        }
        Counters {
            tat: origin_nanos(self.tat.load(Ordering::Acquire)),
            fencing: self.fence.load(Ordering::Acquire),
            granted_total: self.granted.load(Ordering::Acquire),
            max_in_use: self.max_in_use.load(Ordering::Acquire),
        }
    }

    /// Takes the limit back from the table (call under the table's lock) with its counters.
    pub(crate) fn go_fast(&self, counters: Counters) {
        self.tat.store(nanos(counters.tat), Ordering::Release);
        self.fence.fetch_max(counters.fencing, Ordering::AcqRel);
        self.granted.store(counters.granted_total, Ordering::Release);
        self.max_in_use.fetch_max(counters.max_in_use, Ordering::AcqRel);
        let mut seen = self.state.load(Ordering::Acquire);
        loop {
            let next = (seen & !SLOW).wrapping_add(GENERATION) & !SLOW;
            match self.state.compare_exchange_weak(seen, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(actual) => seen = actual,
            }
        }
    }

    /// The counters while fast: grants, the last token, the peak.
    pub(crate) fn counters(&self) -> (u64, u64, u32) {
        (
            self.granted.load(Ordering::Acquire),
            self.fence.load(Ordering::Acquire),
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
        assert!(!cell.release_fast());
        assert_eq!(cell.fast_in_use(), 1);
        assert!(cell.try_fast(0).unwrap() > 12, "tokens never repeat");
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
        assert!(cell.release_fast(), "a release while slow must reach the table");
        cell.go_fast(Counters { fencing: first + 5, ..counters });
        assert_eq!(cell.try_fast(0), Ok(first + 6));
    }

    #[test]
    fn racing_threads_never_exceed_the_bound_nor_repeat_a_token() {
        use std::sync::Arc;
        let cell = Arc::new(Cell::new(LimitSpec::concurrent(3), 0));
        let held = Arc::new(AtomicU32::new(0));
        let tokens = Arc::new(std::sync::Mutex::new(Vec::new()));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (cell, held, tokens) = (cell.clone(), held.clone(), tokens.clone());
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        if let Ok(token) = cell.try_fast(0) {
                            let now = held.fetch_add(1, Ordering::SeqCst) + 1;
                            assert!(now <= 3, "{now} holders");
                            tokens.lock().unwrap().push(token);
                            held.fetch_sub(1, Ordering::SeqCst);
                            cell.release_fast();
                        }
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        let mut tokens = Arc::try_unwrap(tokens).unwrap().into_inner().unwrap();
        let n = tokens.len();
        tokens.sort_unstable();
        tokens.dedup();
        assert_eq!(tokens.len(), n, "no token twice");
        assert_eq!(cell.fast_in_use(), 0);
    }
}
