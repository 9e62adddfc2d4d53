//! What a spill queue reports: the snapshot the [`Registry`](crate::Registry) stores.

use serde::{Deserialize, Serialize};

use super::config::SyncPolicy;
use super::format::Position;
use super::recover::CheckReport;

/// The state of a spill queue, in the registry's snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct SpillSnapshot {
    /// The sync policy.
    pub sync: SyncPolicy,
    /// Unacknowledged records.
    pub records: u64,
    /// Their bytes, frames included.
    pub bytes: u64,
    /// The bound on `bytes`.
    pub max_bytes: u64,
    /// Segment files.
    pub segments: usize,
    /// The committed position.
    pub committed: Position,
    /// Records appended since open.
    pub appended: u64,
    /// Records acknowledged (committed) since open.
    pub acknowledged: u64,
    /// Set once a write or sync failed: the queue refuses appends until reopened.
    pub failed: Option<String>,
    /// What recovery found and repaired at open.
    pub recovered: CheckReport,
}

impl crate::observe::Snapshot {
    /// The spill queue registered as `name`.
    pub fn spill(&self, name: &str) -> Option<SpillSnapshot> {
        self.get("spill", name)
    }
}
