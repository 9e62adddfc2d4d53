//! The table of every metric the library emits, with its kind, labels and help text.
//!
//! The naming rule: `lanes_<primitive>_<quantity>`, where `<primitive>` is `lane`, `limit`, `pool`,
//! `channel` or `spill`; counters end in `_total`, durations are histograms in `_seconds`, sizes in
//! `_bytes`; gauges have no suffix. Every series carries the label that names its primitive
//! (`lane_set` and `lane`, `limit`, `pool`, `channel`, `spill`). A limit's series come in two
//! views: this process's handles (`acquired`, `held`, `waiters`...) and, rendered by `lanes serve`
//! from the store, every client's (`in_use`, `waiting`, `granted`...).

/// What kind of series a metric is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MetricKind {
    /// Only goes up.
    Counter,
    /// Goes up and down.
    Gauge,
    /// A distribution (durations in seconds).
    Histogram,
}

/// One metric: its name, kind, labels and help text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct MetricName {
    /// The series name.
    pub name: &'static str,
    /// Counter, gauge or histogram.
    pub kind: MetricKind,
    /// The labels every series of it carries.
    pub labels: &'static [&'static str],
    /// The `# HELP` text.
    pub help: &'static str,
}

const fn metric(
    name: &'static str,
    kind: MetricKind,
    labels: &'static [&'static str],
    help: &'static str,
) -> MetricName {
    MetricName { name, kind, labels, help }
}

use MetricKind::{Counter, Gauge, Histogram};

const LANE: &[&str] = &["lane_set", "lane"];
const LANE_OUTCOME: &[&str] = &["lane_set", "lane", "outcome"];
const LIMIT: &[&str] = &["limit"];
const POOL: &[&str] = &["pool"];
const CHANNEL: &[&str] = &["channel"];
const CHANNEL_REASON: &[&str] = &["channel", "reason"];
const SPILL: &[&str] = &["spill"];

/// Every metric the library emits.
///
/// Counts are exact at quiescence, with one exception kept off every record's path: a
/// channel's `lanes_channel_emitted_total` and `lanes_channel_processed_total` (for records
/// `recv` and `recv_many` hand out; a batch's records count as it settles) are given what they
/// lag by once 32 records are unpublished, so they may run up to 31 records behind the
/// channel's own counts (apart from publications in flight on other threads), never ahead.
/// `emitted` catches up when the consumer takes records or is woken for one, when the channel
/// closes or is dropped, and when a snapshot of the channel, or of a registry that holds it, is
/// taken; `processed` when the consumer goes back to the channel (to take more or to wait), is
/// dropped, when `drained` finds the channel drained, and at a snapshot. So both are exact once
/// the consumer has taken and read everything and waits for more, after a close, and after a
/// snapshot. The embedded dashboard's `/metrics` takes a registry snapshot before it renders;
/// an application that renders its own exporter can do the same.
pub const METRICS: &[MetricName] = &[
    metric("lanes_lane_admitted_total", Counter, LANE, "Runs admitted to the lane."),
    metric(
        "lanes_lane_rejected_total",
        Counter,
        LANE,
        "Runs refused because the lane was full (at once, or after waiting for room: those also count in timed_out).",
    ),
    metric(
        "lanes_lane_timed_out_total",
        Counter,
        LANE,
        "Runs that waited for room past their deadline.",
    ),
    metric(
        "lanes_lane_finished_total",
        Counter,
        LANE_OUTCOME,
        "Runs finished, by outcome: ok, or why the run failed (canceled, timeout, closed, \
         poisoned, job, panic, audit, finalizer, cleanup, limit).",
    ),
    metric("lanes_lane_executing", Gauge, LANE, "Runs executing now."),
    metric("lanes_lane_queued", Gauge, LANE, "Runs admitted and waiting for an execution slot."),
    metric(
        "lanes_lane_queue_wait_seconds",
        Histogram,
        LANE,
        "Time from admission to the start of execution.",
    ),
    metric(
        "lanes_lane_run_seconds",
        Histogram,
        LANE,
        "Time a run's job executed (with wait timing on).",
    ),
    metric(
        "lanes_limit_acquired_total",
        Counter,
        LIMIT,
        "Permits this process's handles acquired.",
    ),
    metric(
        "lanes_limit_refused_total",
        Counter,
        LIMIT,
        "Tries refused at once (every permit held, others waiting, or the bucket empty).",
    ),
    metric(
        "lanes_limit_timed_out_total",
        Counter,
        LIMIT,
        "Acquires that waited past their deadline.",
    ),
    metric(
        "lanes_limit_expired_total",
        Counter,
        LIMIT,
        "Leased permits reclaimed because their lease ran out before they were released.",
    ),
    metric("lanes_limit_held", Gauge, LIMIT, "Permits held by this process's handles now."),
    metric("lanes_limit_waiters", Gauge, LIMIT, "This process's acquires waiting now."),
    metric(
        "lanes_limit_wait_seconds",
        Histogram,
        LIMIT,
        "Time acquires that had to wait waited for their grant.",
    ),
    metric(
        "lanes_limit_in_use",
        Gauge,
        LIMIT,
        "Permits held now, by every client of the store (rendered by lanes serve).",
    ),
    metric(
        "lanes_limit_waiting",
        Gauge,
        LIMIT,
        "Tickets waiting now, of every client of the store (rendered by lanes serve).",
    ),
    metric(
        "lanes_limit_concurrent",
        Gauge,
        LIMIT,
        "The limit's concurrency (rendered by lanes serve).",
    ),
    metric(
        "lanes_limit_max_in_use",
        Gauge,
        LIMIT,
        "The most permits ever held at once (rendered by lanes serve).",
    ),
    metric(
        "lanes_limit_granted_total",
        Counter,
        LIMIT,
        "Permits the store granted, to every client (rendered by lanes serve).",
    ),
    metric(
        "lanes_limit_keyed_acquired_total",
        Counter,
        LIMIT,
        "Permits a keyed limit granted and checks it passed, over every key.",
    ),
    metric(
        "lanes_limit_keyed_refused_total",
        Counter,
        LIMIT,
        "Checks and tries a keyed limit refused, acquires that found a key's waiting room full, and new keys refused (past max_keys, or an invalid own spec).",
    ),
    metric(
        "lanes_limit_keyed_timed_out_total",
        Counter,
        LIMIT,
        "Acquires of a keyed limit that gave up at their deadline.",
    ),
    metric("lanes_limit_keyed_held", Gauge, LIMIT, "Permits of a keyed limit held now."),
    metric(
        "lanes_limit_keyed_waiters",
        Gauge,
        LIMIT,
        "Acquires of a keyed limit waiting now, for a permit or for their token.",
    ),
    metric(
        "lanes_limit_keyed_keys",
        Gauge,
        LIMIT,
        "Keys a keyed limit keeps now (in use, or idle and not yet forgotten).",
    ),
    metric("lanes_pool_submitted_total", Counter, POOL, "Items accepted by the pool."),
    metric("lanes_pool_rejected_total", Counter, POOL, "Items refused by the pool."),
    metric("lanes_pool_completed_total", Counter, POOL, "Items processed successfully."),
    metric("lanes_pool_failed_total", Counter, POOL, "Items whose processing returned an error."),
    metric("lanes_pool_panicked_total", Counter, POOL, "Items whose processing panicked."),
    metric("lanes_pool_dropped_total", Counter, POOL, "Items dropped unprocessed at shutdown."),
    metric("lanes_pool_inflight", Gauge, POOL, "Items being processed now."),
    metric("lanes_pool_queued", Gauge, POOL, "Items waiting for a worker."),
    metric(
        "lanes_pool_queue_wait_seconds",
        Histogram,
        POOL,
        "Time from submission to the start of processing.",
    ),
    metric("lanes_pool_processing_seconds", Histogram, POOL, "Time an item's processing took."),
    metric("lanes_channel_emitted_total", Counter, CHANNEL, "Records offered to the channel."),
    metric("lanes_channel_delivered_total", Counter, CHANNEL, "Records handed to a consumer."),
    metric(
        "lanes_channel_dropped_total",
        Counter,
        CHANNEL_REASON,
        "Records dropped unread, by reason: drop_newest (the new record, under DropNewest, or \
         under DropOldest when a full shared budget left the channel nothing of its own to \
         drop), drop_oldest (the oldest queued record, under DropOldest), or closed (still \
         queued when the channel closed without draining, or went away).",
    ),
    metric("lanes_channel_spilled_total", Counter, CHANNEL, "Records written to the spill queue."),
    metric(
        "lanes_channel_blocked_waits_total",
        Counter,
        CHANNEL,
        "Sends that had to wait for room.",
    ),
    metric("lanes_channel_processed_total", Counter, CHANNEL, "Records a consumer processed."),
    metric("lanes_channel_failed_total", Counter, CHANNEL, "Records whose processing failed."),
    metric("lanes_spill_appended_total", Counter, SPILL, "Records appended (durable per policy)."),
    metric("lanes_spill_appended_bytes_total", Counter, SPILL, "Payload bytes appended."),
    metric("lanes_spill_acked_total", Counter, SPILL, "Records acknowledged by a reader."),
    metric(
        "lanes_spill_recovered_total",
        Counter,
        SPILL,
        "Unacknowledged records found when the queue was opened.",
    ),
    metric(
        "lanes_spill_unacked_bytes",
        Gauge,
        SPILL,
        "Bytes on disk not yet acknowledged (counts against max_bytes).",
    ),
    metric(
        "lanes_spill_append_seconds",
        Histogram,
        SPILL,
        "Time from append to the record being durable under the sync policy.",
    ),
];

/// Gives every metric in [`METRICS`] its help text in the installed `metrics` recorder, so
/// exporters print `# HELP` lines. The first primitive built in a process calls it; call it
/// yourself after installing a recorder if a primitive was built before.
pub fn describe_metrics() {
    for metric in METRICS {
        let (name, help) = (metric.name, metric.help);
        match metric.kind {
            MetricKind::Counter => metrics::describe_counter!(name, help),
            MetricKind::Gauge => metrics::describe_gauge!(name, help),
            MetricKind::Histogram => {
                let unit = metrics::Unit::Seconds;
                metrics::describe_histogram!(name, unit, help);
            }
        }
    }
}

/// [`describe_metrics`], the first time only (primitives call it when built). The first caller
/// marks it done before it calls the recorder, and nobody waits for it: a recorder (user code)
/// that builds a primitive from its `describe_*` comes back here and returns at once (inside a
/// `Once` it deadlocked), and a primitive built on another thread meanwhile may register its
/// handles before the help text reaches the recorder, which exporters take in either order. A
/// recorder that panics there is contained, so the primitive being built is not.
pub(crate) fn describe_once() {
    use std::sync::atomic::{AtomicBool, Ordering};
    static DESCRIBED: AtomicBool = AtomicBool::new(false);
    if !DESCRIBED.load(Ordering::Relaxed) && !DESCRIBED.swap(true, Ordering::Relaxed) {
        let _ = crate::util::call_contained(describe_metrics);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_follows_the_rule() {
        let mut seen = std::collections::BTreeSet::new();
        for metric in METRICS {
            assert!(seen.insert(metric.name), "{} twice", metric.name);
            let primitive =
                metric.name.strip_prefix("lanes_").and_then(|rest| rest.split('_').next());
            assert!(
                matches!(primitive, Some("lane" | "limit" | "pool" | "channel" | "spill")),
                "{}",
                metric.name
            );
            match metric.kind {
                MetricKind::Counter => assert!(metric.name.ends_with("_total"), "{}", metric.name),
                MetricKind::Histogram => {
                    assert!(metric.name.ends_with("_seconds"), "{}", metric.name);
                }
                MetricKind::Gauge => assert!(!metric.name.ends_with("_total"), "{}", metric.name),
            }
            assert!(!metric.help.is_empty() && !metric.labels.is_empty());
        }
    }
}
