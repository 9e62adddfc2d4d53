//! A lane's `metrics` handles, resolved once when the set is built (see
//! [`observe::METRICS`](crate::observe::METRICS) for the names and help text).
//!
//! No call into the recorder is made under the lane's locks: the recorder is user code, which
//! may call into the lane (a snapshot, say). The gauges move by differences, decided under the
//! lock and made after it (`LaneShared::publish` and `LaneShared::gauge`).
//!
//! Every call into the recorder is contained ([`Contained`]): a recorder that panics never
//! unwinds through a lane. Many of these calls are made between a change to the lane and the
//! ticket that would end the run; unwound from there, a run could stay owned for good (or,
//! dropped while unwinding, abort the process). The panic is still reported, by the panic
//! hook, and the metric misses that update: a gauge's move is made again at the next change.
//!
//! Only a lane's own metrics: a run that names a limit ([`Run::limited_by`](crate::Run)) also
//! reaches the limit's, which are not contained but ordered so that a panic there gives back
//! whatever it interrupted (`limit::metrics`).

use metrics::{Counter, Gauge, Histogram};

use crate::util::{Contained, call_contained};

use super::error::Reason;

/// Every reason a run can fail for, in the order of `finished`'s entries after `ok`.
const REASONS: [Reason; 10] = [
    Reason::Canceled,
    Reason::Timeout,
    Reason::Closed,
    Reason::Poisoned,
    Reason::Job,
    Reason::Panic,
    Reason::Audit,
    Reason::Finalizer,
    Reason::Cleanup,
    Reason::Limit,
];

// The containment costs a run about 7 instructions in all (cachegrind, `fixed lane 8 30` minus
// `10`: 2,030 -> 2,037), and no time measured (BENCHMARKS.md, suite 2's stop-66 note).
impl Contained<Gauge> {
    /// Moves the gauge by `by` (up or down); false if the recorder panicked (it did not move).
    #[inline]
    pub(super) fn moved_by(&self, by: isize) -> bool {
        let size = by.unsigned_abs() as f64;
        call_contained(|| if by > 0 { self.0.increment(size) } else { self.0.decrement(size) })
            .is_ok()
    }
}

pub(super) struct LaneMetrics {
    pub(super) admitted: Contained<Counter>,
    pub(super) rejected: Contained<Counter>,
    pub(super) timed_out: Contained<Counter>,
    /// `ok`, then one per entry of [`REASONS`].
    finished: [Contained<Counter>; 1 + REASONS.len()],
    pub(super) executing: Contained<Gauge>,
    pub(super) queued: Contained<Gauge>,
    pub(super) queue_wait: Contained<Histogram>,
    /// How long a run's job executed (wait timing on).
    pub(super) run: Contained<Histogram>,
}

impl LaneMetrics {
    pub(super) fn new(set: &str, lane: &str) -> Self {
        let labels = [("lane_set", set.to_owned()), ("lane", lane.to_owned())];
        let finished = |outcome: &'static str| {
            let labels = [labels[0].clone(), labels[1].clone(), ("outcome", outcome.to_owned())];
            Contained(metrics::counter!("lanes_lane_finished_total", &labels))
        };
        Self {
            admitted: Contained(metrics::counter!("lanes_lane_admitted_total", &labels)),
            rejected: Contained(metrics::counter!("lanes_lane_rejected_total", &labels)),
            timed_out: Contained(metrics::counter!("lanes_lane_timed_out_total", &labels)),
            finished: std::array::from_fn(|i| match i {
                0 => finished("ok"),
                i => finished(REASONS[i - 1].as_str()),
            }),
            executing: Contained(metrics::gauge!("lanes_lane_executing", &labels)),
            queued: Contained(metrics::gauge!("lanes_lane_queued", &labels)),
            queue_wait: Contained(metrics::histogram!("lanes_lane_queue_wait_seconds", &labels)),
            run: Contained(metrics::histogram!("lanes_lane_run_seconds", &labels)),
        }
    }

    /// Counts a finished run: `None` for success, else the reason it failed.
    pub(super) fn finished(&self, failure: Option<Reason>) {
        let index = match failure {
            None => 0,
            Some(reason) => 1 + REASONS.iter().position(|r| *r == reason).unwrap_or(0),
        };
        self.finished[index].increment(1);
    }
}
