//! The registry: where every primitive reports its live snapshot.
//!
//! Primitives register by name when they are built (for a lane set:
//! [`LaneSetBuilder::registry`](crate::LaneSetBuilder::registry)). The registry holds them
//! weakly: a dropped primitive disappears from the next snapshot and its name can be reused.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, Weak};

use serde::{Deserialize, Serialize};

use crate::channel::ChannelsSnapshot;
use crate::config::{ConfigError, ConfigRule};
use crate::lane::LaneSetSnapshot;
use crate::limit::LimitInfo;
use crate::pool::PoolSnapshot;
use crate::spill::SpillSnapshot;
use crate::util::lock;

/// Something that reports into a [`Snapshot`].
pub(crate) trait Source: Send + Sync {
    fn report(&self, name: &str, snapshot: &mut Snapshot);
}

/// Collects snapshots of everything registered with it. Cheap to clone: clones share entries.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use lanes::{LaneLimits, LaneSet, Registry};
///
/// let registry = Registry::new();
/// let _lanes = LaneSet::builder()
///     .lane("work", LaneLimits::new(2, 4))
///     .audit_timeout(Duration::from_secs(1))
///     .finalization_timeout(Duration::from_secs(1))
///     .worker_drain_timeout(Duration::from_secs(1))
///     .registry(&registry, "agent")
///     .build()?;
///
/// let snapshot = registry.snapshot();
/// assert_eq!(snapshot.lane_sets["agent"].lanes[0].name, "work");
/// assert!(snapshot.to_json().contains("\"agent\""));
/// # Ok::<(), lanes::ConfigError>(())
/// ```
#[derive(Clone, Default)]
pub struct Registry {
    entries: Arc<Mutex<BTreeMap<String, Weak<dyn Source>>>>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `source` under `name`.
    pub(crate) fn register(
        &self,
        name: String,
        source: Weak<dyn Source>,
    ) -> Result<(), ConfigError> {
        let mut entries = lock(&self.entries);
        entries.retain(|_, entry| entry.strong_count() > 0);
        if entries.contains_key(&name) {
            return Err(ConfigError::new(format!("registry.{name}"), ConfigRule::Duplicate));
        }
        entries.insert(name, source);
        Ok(())
    }

    /// The names registered now, in order.
    pub fn names(&self) -> Vec<String> {
        let entries = lock(&self.entries);
        entries
            .iter()
            .filter(|(_, entry)| entry.strong_count() > 0)
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// Everything registered, as it is now.
    pub fn snapshot(&self) -> Snapshot {
        let live: Vec<(String, Arc<dyn Source>)> = {
            let mut entries = lock(&self.entries);
            entries.retain(|_, entry| entry.strong_count() > 0);
            entries
                .iter()
                .filter_map(|(name, entry)| Some((name.clone(), entry.upgrade()?)))
                .collect()
        };
        // Sources are asked outside the registry lock: they take their own locks.
        let mut snapshot = Snapshot::default();
        for (name, source) in live {
            source.report(&name, &mut snapshot);
        }
        snapshot
    }
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registry").field("names", &self.names()).finish()
    }
}

/// Everything a [`Registry`] knows, by kind and name. Serializes to JSON.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Snapshot {
    /// Lane sets by registered name.
    pub lane_sets: BTreeMap<String, LaneSetSnapshot>,
    /// Limits by registered name, each in limit-name order.
    pub limits: BTreeMap<String, Vec<LimitInfo>>,
    /// Dispatchers and keyed pools by registered name.
    pub pools: BTreeMap<String, PoolSnapshot>,
    /// Spill queues by registered name.
    pub spill: BTreeMap<String, SpillSnapshot>,
    /// Channel registries (and single channels) by registered name.
    #[serde(default)]
    pub channels: BTreeMap<String, ChannelsSnapshot>,
}

impl Snapshot {
    /// The snapshot as compact JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("snapshots serialize to JSON")
    }

    /// The snapshot as indented JSON.
    pub fn to_json_pretty(&self) -> String {
        serde_json::to_string_pretty(self).expect("snapshots serialize to JSON")
    }
}
