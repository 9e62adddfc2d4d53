//! A lane's `metrics` handles, resolved once when the set is built (see
//! [`observe::METRICS`](crate::observe::METRICS) for the names and help text).

use metrics::{Counter, Gauge, Histogram};

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

pub(super) struct LaneMetrics {
    pub(super) admitted: Counter,
    pub(super) rejected: Counter,
    pub(super) timed_out: Counter,
    /// `ok`, then one per entry of [`REASONS`].
    finished: [Counter; 1 + REASONS.len()],
    pub(super) executing: Gauge,
    pub(super) queued: Gauge,
    pub(super) queue_wait: Histogram,
}

impl LaneMetrics {
    pub(super) fn new(set: &str, lane: &str) -> Self {
        let labels = [("lane_set", set.to_owned()), ("lane", lane.to_owned())];
        let finished = |outcome: &'static str| {
            let labels = [labels[0].clone(), labels[1].clone(), ("outcome", outcome.to_owned())];
            metrics::counter!("lanes_lane_finished_total", &labels)
        };
        Self {
            admitted: metrics::counter!("lanes_lane_admitted_total", &labels),
            rejected: metrics::counter!("lanes_lane_rejected_total", &labels),
            timed_out: metrics::counter!("lanes_lane_timed_out_total", &labels),
            finished: std::array::from_fn(|i| match i {
                0 => finished("ok"),
                i => finished(REASONS[i - 1].as_str()),
            }),
            executing: metrics::gauge!("lanes_lane_executing", &labels),
            queued: metrics::gauge!("lanes_lane_queued", &labels),
            queue_wait: metrics::histogram!("lanes_lane_queue_wait_seconds", &labels),
        }
    }

    /// Moves the `queued` gauge by the difference from `from` runs to `to`: it moves by
    /// differences, not set, as the inbox's admissions count themselves without the lane's
    /// lock (see `LaneState::gauged`).
    pub(super) fn queued_moved(&self, from: usize, to: usize) {
        if to > from {
            self.queued.increment((to - from) as f64);
        } else {
            self.queued.decrement((from - to) as f64);
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
