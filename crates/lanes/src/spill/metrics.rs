//! A spill queue's `metrics` handles, resolved once when it is opened (see
//! [`observe::METRICS`](crate::observe::METRICS) for the names and help text).

use metrics::{Counter, Gauge, Histogram};

#[derive(Debug)]
pub(super) struct SpillMetrics {
    pub(super) appended: Counter,
    pub(super) appended_bytes: Counter,
    pub(super) acked: Counter,
    pub(super) unacked_bytes: Gauge,
    pub(super) append: Histogram,
    pub(super) recovered: Counter,
}

impl SpillMetrics {
    /// Resolves the handles of queue `name` (on the opening task's thread, so a thread-local
    /// recorder sees them).
    pub(super) fn new(name: &str) -> Self {
        crate::observe::describe_once();
        let labels = [("spill", name.to_owned())];
        Self {
            recovered: metrics::counter!("lanes_spill_recovered_total", &labels),
            appended: metrics::counter!("lanes_spill_appended_total", &labels),
            appended_bytes: metrics::counter!("lanes_spill_appended_bytes_total", &labels),
            acked: metrics::counter!("lanes_spill_acked_total", &labels),
            unacked_bytes: metrics::gauge!("lanes_spill_unacked_bytes", &labels),
            append: metrics::histogram!("lanes_spill_append_seconds", &labels),
        }
    }
}
