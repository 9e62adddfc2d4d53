//! Live snapshots of lanes and lane sets (serde).

use serde::{Deserialize, Serialize};

use super::config::LaneLimits;

/// Admissions refused, by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct RejectedCounts {
    /// The lane was full.
    pub full: u64,
    /// The set was closed.
    pub closed: u64,
    /// The set was poisoned.
    pub poisoned: u64,
}

impl RejectedCounts {
    /// All refusals.
    pub fn total(&self) -> u64 {
        self.full + self.closed + self.poisoned
    }
}

/// Owned runs that ended in failure, by [`Reason`](super::Reason).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct FailedCounts {
    /// The caller dropped its handle.
    pub canceled: u64,
    /// A queue or execution timeout elapsed.
    pub timeout: u64,
    /// The set was closed.
    pub closed: u64,
    /// The set was poisoned.
    pub poisoned: u64,
    /// The job returned an error.
    pub job: u64,
    /// The job panicked.
    pub panic: u64,
    /// An audit call failed.
    pub audit: u64,
    /// The finalizer failed on a successful run.
    pub finalizer: u64,
    /// The cleanup failed on an otherwise successful run.
    pub cleanup: u64,
    /// The run's limit refused it.
    pub limit: u64,
}

impl FailedCounts {
    /// All failures.
    pub fn total(&self) -> u64 {
        self.canceled
            + self.timeout
            + self.closed
            + self.poisoned
            + self.job
            + self.panic
            + self.audit
            + self.finalizer
            + self.cleanup
            + self.limit
    }
}

#[derive(Debug, Clone, Default)]
pub(crate) struct LaneCounters {
    pub(crate) admitted: u64,
    pub(crate) completed: u64,
    pub(crate) rejected: RejectedCounts,
    pub(crate) failed: FailedCounts,
    pub(crate) max_executing: usize,
    pub(crate) max_owned: usize,
}

/// One lane, as it is now.
///
/// Counters reconcile: `admitted == completed + failed.total() + owned`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct LaneSnapshot {
    /// The lane's name.
    pub name: String,
    /// Its bounds.
    pub limits: LaneLimits,
    /// Runs holding an execution slot.
    pub executing: usize,
    /// Runs waiting for one.
    pub queued: usize,
    /// Runs owned: queued, executing or finalizing.
    pub owned: usize,
    /// Runs admitted since the lane was built.
    pub admitted: u64,
    /// Admissions refused, by reason.
    pub rejected: RejectedCounts,
    /// Owned runs that finished successfully.
    pub completed: u64,
    /// Owned runs that failed, by reason.
    pub failed: FailedCounts,
    /// The most runs ever executing at once (never above `limits.concurrent`).
    pub max_executing: usize,
    /// The most runs ever owned at once (never above `limits.capacity()`).
    pub max_owned: usize,
    /// The lane refuses admission because the set was closed.
    pub closed: bool,
    /// The lane refuses admission because the set was poisoned.
    pub poisoned: bool,
}

/// Whether a set admits runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SetState {
    /// Admitting.
    Open,
    /// Closed by [`LaneSet::close`](super::LaneSet::close).
    Closed,
    /// Poisoned by a job that ignored cancellation.
    Poisoned,
}

/// A lane set, as it is now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct LaneSetSnapshot {
    /// Open, closed or poisoned.
    pub state: SetState,
    /// Runs owned across all lanes (what [`LaneSet::drained`](super::LaneSet::drained) waits for).
    pub owned: usize,
    /// Every lane, in the order they were configured.
    pub lanes: Vec<LaneSnapshot>,
}

impl crate::observe::Snapshot {
    /// The lane set registered as `name`.
    pub fn lane_set(&self, name: &str) -> Option<LaneSetSnapshot> {
        self.get("lane_sets", name)
    }
}
