//! Pools in the registry's snapshot.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::completion::{CompletionSnapshot, Tracker};
use super::handle::{Core, Phase, PoolStats};
use crate::observe::{Observe, Snapshot};

/// Which kind of pool a snapshot describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolKind {
    /// A [`Dispatcher`](super::Dispatcher).
    Dispatcher,
    /// A [`KeyedPool`](super::KeyedPool) in per-key mode.
    PerKey,
    /// A [`KeyedPool`](super::KeyedPool) in hashed-shards mode.
    Hashed,
}

/// One pool, as it is now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PoolSnapshot {
    /// Dispatcher, per-key or hashed.
    pub kind: PoolKind,
    /// Running, stopping, stopped or aborted.
    pub phase: Phase,
    /// Counters and gauges.
    pub stats: PoolStats,
    /// Completion tracking, for dispatchers that track completions.
    pub completion: Option<CompletionSnapshot>,
}

pub(crate) struct Reporter<T> {
    pub(crate) kind: PoolKind,
    pub(crate) core: Arc<dyn Core<T>>,
    pub(crate) tracker: Option<Arc<Tracker<T>>>,
}

impl<T: Send + 'static> Reporter<T> {
    pub(crate) fn snapshot(&self) -> PoolSnapshot {
        PoolSnapshot {
            kind: self.kind,
            phase: self.core.phase(),
            stats: self.core.stats(),
            completion: self.tracker.as_ref().map(|t| t.snapshot()),
        }
    }
}

impl<T: Send + 'static> Observe for Reporter<T> {
    fn report(&self, name: &str, snapshot: &mut Snapshot) {
        snapshot.insert("pools", name, &self.snapshot());
    }
}

impl crate::observe::Snapshot {
    /// The dispatcher or keyed pool registered as `name`.
    pub fn pool(&self, name: &str) -> Option<PoolSnapshot> {
        self.get("pools", name)
    }
}
