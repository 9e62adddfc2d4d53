//! The switch for wait-time histograms.

use std::sync::atomic::{AtomicBool, Ordering};

static WAIT_TIMING: AtomicBool = AtomicBool::new(false);

/// Turns the wait-time histograms (`lanes_lane_queue_wait_seconds`, `lanes_lane_run_seconds`,
/// `lanes_limit_wait_seconds`, `lanes_spill_append_seconds`, `lanes_pool_queue_wait_seconds`,
/// `lanes_pool_processing_seconds`) on or off, process-wide. Off by default: timing a wait reads
/// the clock twice (about 70 ns on the benchmark host), which is a tenth of a queued run's whole
/// cost; counters and gauges are always on. `lanes serve` turns it on.
///
/// # Examples
///
/// ```
/// lanes::observe::set_wait_timing(true);
/// assert!(lanes::observe::wait_timing());
/// ```
pub fn set_wait_timing(on: bool) {
    WAIT_TIMING.store(on, Ordering::Relaxed);
}

/// Whether wait-time histograms are recorded (see [`set_wait_timing`]).
pub fn wait_timing() -> bool {
    WAIT_TIMING.load(Ordering::Relaxed)
}

/// The clock (tokio's, so paused-time tests see their own), read only when wait timing is on.
pub(crate) fn start() -> Option<tokio::time::Instant> {
    wait_timing().then(tokio::time::Instant::now)
}
