//! What several of this crate's test files share.

use std::time::Duration;

use lanes::{LaneLimits, LaneSetBuilder};

/// A builder of a set with one lane, `name`, of `limits`, and audit, finalization and drain
/// timeouts of a second: long enough never to fire in a test, short enough that a hang fails.
pub(crate) fn one_lane(name: &str, limits: LaneLimits) -> LaneSetBuilder {
    lanes::LaneSet::builder()
        .lane(name, limits)
        .audit_timeout(Duration::from_secs(1))
        .finalization_timeout(Duration::from_secs(1))
        .worker_drain_timeout(Duration::from_secs(1))
}
