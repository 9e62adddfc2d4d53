//! A local limit's `metrics` handles, resolved once when the limit is defined (see
//! [`observe::METRICS`](crate::observe::METRICS) for the names and help text). Limits held by
//! another backend (Redis, `lanes serve`) are reported by that backend's owner.
//!
//! A recorder that panics is not contained here (a lane's calls are: `lane::metrics`): the
//! uncontended acquire would pay about 17 instructions for it (BENCHMARKS.md, suite 2's stop-66
//! note). The panic reaches the caller instead, with nothing lost:
//! - a permit is made (on the fast path, a guard holding its slot) before it is counted
//!   granted, so a panic unwinds through something that gives it back;
//! - a permit is given back before it is counted off `held`, and a wait leaves the limit's
//!   line before it is counted off `waiters`;
//! - while a panic unwinds, a drop's call is contained ([`count_off`]): a second panic escaping
//!   a drop would abort;
//! - the one call made between a table's grant and its permit, a count of leases that
//!   expired, is contained.
//!
//! `tests/limit_recorder.rs` holds the cases.

use metrics::{Counter, Gauge, Histogram};

use crate::util::call_contained;

#[derive(Debug)]
pub(crate) struct LimitMetrics {
    pub(crate) acquired: Counter,
    pub(crate) refused: Counter,
    pub(crate) timed_out: Counter,
    pub(crate) expired: Counter,
    pub(crate) held: Gauge,
    pub(crate) waiters: Gauge,
    pub(crate) wait: Histogram,
}

impl LimitMetrics {
    pub(crate) fn new(limit: &str) -> Self {
        let labels = [("limit", limit.to_owned())];
        Self {
            acquired: metrics::counter!("lanes_limit_acquired_total", &labels),
            refused: metrics::counter!("lanes_limit_refused_total", &labels),
            timed_out: metrics::counter!("lanes_limit_timed_out_total", &labels),
            expired: metrics::counter!("lanes_limit_expired_total", &labels),
            held: metrics::gauge!("lanes_limit_held", &labels),
            waiters: metrics::gauge!("lanes_limit_waiters", &labels),
            wait: metrics::histogram!("lanes_limit_wait_seconds", &labels),
        }
    }

    /// Counts a grant; `waited` is when its wait began, if it waited and wait timing was on
    /// (an immediate grant records no wait: the fast path reads no clock and no switch).
    ///
    /// `held` first: a recorder that panics after it leaves it counted, as the permit's drop
    /// (which the panic unwinds through) counts it off.
    pub(crate) fn granted(&self, waited: Option<tokio::time::Instant>) {
        self.held.increment(1.0);
        self.counted(waited);
    }

    /// [`granted`](Self::granted) past the `held` gauge.
    #[inline]
    pub(crate) fn counted(&self, waited: Option<tokio::time::Instant>) {
        self.acquired.increment(1);
        if let Some(since) = waited {
            self.wait.record(since.elapsed().as_secs_f64());
        }
    }
}

/// Counts one off `gauge`, after what it counted was given back (a permit, a wait). While a
/// panic unwinds (one the recorder made as a permit was counted granted, say, or any other),
/// the call is contained: a second panic escaping a drop would abort the process.
#[inline]
pub(crate) fn count_off(gauge: &Gauge) {
    if std::thread::panicking() {
        let _ = call_contained(|| gauge.decrement(1.0));
    } else {
        gauge.decrement(1.0);
    }
}
