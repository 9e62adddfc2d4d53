//! What several of this crate's test files share.

#![allow(dead_code)] // each test binary uses part of this module

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

/// One step of a xorshift generator: the stress tests' cheap, seeded randomness.
pub(crate) fn xorshift(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}
