//! A local limit's `metrics` handles, resolved once when the limit is defined (see
//! [`observe::METRICS`](crate::observe::METRICS) for the names and help text). Limits held by
//! another backend (Redis, `lanes serve`) are reported by that backend's owner.
//!
//! A recorder that panics is not contained here (a lane's calls are: `lane::metrics`): the
//! uncontended acquire would pay about 17 instructions for it (BENCHMARKS.md, suite 2's stop-66
//! note). The panic reaches the caller instead, with nothing lost: a permit is made before it
//! is counted granted (a panic then unwinds through its drop, which gives it back), given back
//! before it is counted off `held`, and a wait leaves the limit's line before it is counted
//! off `waiters`; while a panic unwinds, a drop calls no recorder (a second panic would abort).
//! `tests/limit_recorder.rs` holds the cases.

use metrics::{Counter, Gauge, Histogram};

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
    pub(crate) fn granted(&self, waited: Option<tokio::time::Instant>) {
        self.acquired.increment(1);
        self.held.increment(1.0);
        if let Some(since) = waited {
            self.wait.record(since.elapsed().as_secs_f64());
        }
    }
}
