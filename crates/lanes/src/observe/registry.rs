//! The registry: where every primitive (and any adapter) reports its live snapshot.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, Weak};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::{ConfigError, ConfigRule};
use crate::util::lock;

/// Something that reports into a [`Snapshot`]: every primitive's shared state implements it, and
/// so can an adapter (a remote limit client, a completion tracker) that wants to be seen on the
/// dashboard.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use lanes::observe::{Observe, Registry, Snapshot};
///
/// struct Uploads(std::sync::atomic::AtomicU64);
///
/// impl Observe for Uploads {
///     fn report(&self, name: &str, snapshot: &mut Snapshot) {
///         let done = self.0.load(std::sync::atomic::Ordering::Relaxed);
///         snapshot.insert("uploads", name, &serde_json::json!({ "done": done }));
///     }
/// }
///
/// let registry = Registry::new();
/// let uploads = Arc::new(Uploads(3.into()));
/// registry.register("s3", &uploads)?;
/// assert_eq!(registry.snapshot().get::<serde_json::Value>("uploads", "s3").unwrap()["done"], 3);
/// # Ok::<(), lanes::ConfigError>(())
/// ```
pub trait Observe: Send + Sync {
    /// Writes what `self` holds now into `snapshot` under `name` (usually with
    /// [`Snapshot::insert`] into the section of its kind).
    fn report(&self, name: &str, snapshot: &mut Snapshot);
}

/// A builder's registration option: the registry to report in and the name to report under.
/// Every builder takes one (`.registry(&registry, name)`) and registers the handle when it is
/// built; the name is also the handle's metrics label unless it is given its own.
#[derive(Clone)]
pub(crate) struct Registration {
    pub(crate) registry: Registry,
    pub(crate) name: String,
}

impl Registration {
    pub(crate) fn new(registry: &Registry, name: impl Into<String>) -> Self {
        Self { registry: registry.clone(), name: name.into() }
    }

    /// Refuses a name already taken, before anything is built.
    pub(crate) fn check(&self) -> Result<(), ConfigError> {
        let entries = lock(&self.registry.entries);
        match entries.get(&self.name) {
            Some(entry) if entry.strong_count() > 0 => Err(self.taken()),
            _ => Ok(()),
        }
    }

    /// Registers the built handle's `source`.
    pub(crate) fn register<O: Observe + 'static>(
        &self,
        source: &Arc<O>,
    ) -> Result<(), ConfigError> {
        self.registry.register(self.name.clone(), source)
    }

    fn taken(&self) -> ConfigError {
        ConfigError::new(format!("registry.{}", self.name), ConfigRule::Duplicate)
    }
}

impl PartialEq for Registration {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.registry.entries, &other.registry.entries) && self.name == other.name
    }
}

impl Eq for Registration {}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Registration").field(&self.name).finish()
    }
}

/// Collects snapshots of everything registered with it. Cheap to clone: clones share entries.
///
/// Primitives register by name when they are built: every builder has a `registry` option
/// (for a lane set, [`LaneSetBuilder::registry`](crate::LaneSetBuilder::registry)); adapters
/// call [`register`](Self::register). The registry holds every
/// entry weakly: a dropped primitive disappears from the next snapshot and its name can be
/// reused.
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
/// assert_eq!(snapshot.lane_set("agent").unwrap().lanes[0].name, "work");
/// assert!(snapshot.to_json().contains("\"agent\""));
/// # Ok::<(), lanes::ConfigError>(())
/// ```
#[derive(Clone, Default)]
pub struct Registry {
    entries: Arc<Mutex<BTreeMap<String, Weak<dyn Observe>>>>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `source` under `name`, weakly: it is reported for as long as someone else
    /// holds it.
    ///
    /// # Errors
    ///
    /// [`ConfigRule::Duplicate`] if a live entry already has that name.
    pub fn register<O: Observe + 'static>(
        &self,
        name: impl Into<String>,
        source: &Arc<O>,
    ) -> Result<(), ConfigError> {
        let weak: Weak<dyn Observe> = Arc::downgrade(source) as Weak<dyn Observe>;
        self.register_weak(name.into(), weak)
    }

    /// Registers an already weak `source` under `name`.
    pub(crate) fn register_weak(
        &self,
        name: String,
        source: Weak<dyn Observe>,
    ) -> Result<(), ConfigError> {
        let mut entries = lock(&self.entries);
        entries.retain(|_, entry| entry.strong_count() > 0);
        if entries.contains_key(&name) {
            return Err(Registration { registry: self.clone(), name }.taken());
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
        let live: Vec<(String, Arc<dyn Observe>)> = {
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

/// The sections every snapshot has, one per primitive kind, present even when empty.
pub const SECTIONS: [&str; 5] = ["lane_sets", "limits", "pools", "spill", "channels"];

/// Everything a [`Registry`] knows: sections (one per kind of primitive, see [`SECTIONS`]), each
/// a map from registered name to that entry's snapshot. Serializes to JSON as
/// `{"lane_sets": {"agent": {...}}, "limits": {...}, ...}`.
///
/// Each primitive module adds a typed accessor: [`Snapshot::lane_set`], [`Snapshot::limits`],
/// [`Snapshot::pool`], [`Snapshot::spill`], [`Snapshot::channels`]; [`Snapshot::get`] reads any
/// section as any type.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Snapshot {
    sections: BTreeMap<String, BTreeMap<String, Value>>,
}

impl Default for Snapshot {
    fn default() -> Self {
        let sections = SECTIONS.iter().map(|kind| ((*kind).to_owned(), BTreeMap::new())).collect();
        Self { sections }
    }
}

impl Snapshot {
    /// Stores `value` as the entry `name` of `section`, replacing what was there.
    ///
    /// # Panics
    ///
    /// If `value` does not serialize to JSON (a map with non-string keys, say): snapshots are
    /// plain data.
    pub fn insert<T: Serialize + ?Sized>(&mut self, section: &str, name: &str, value: &T) {
        let value = serde_json::to_value(value).expect("snapshots serialize to JSON");
        self.sections.entry(section.to_owned()).or_default().insert(name.to_owned(), value);
    }

    /// The entry `name` of `section` read as a `T`; `None` if it is absent or of another shape.
    pub fn get<T: DeserializeOwned>(&self, section: &str, name: &str) -> Option<T> {
        let value = self.sections.get(section)?.get(name)?;
        T::deserialize(value).ok()
    }

    /// The names in `section`, in order.
    pub fn names(&self, section: &str) -> Vec<&str> {
        self.sections
            .get(section)
            .map_or_else(Vec::new, |entries| entries.keys().map(String::as_str).collect())
    }

    /// The section names present, in order (the [`SECTIONS`] and any an adapter added).
    pub fn sections(&self) -> impl Iterator<Item = &str> {
        self.sections.keys().map(String::as_str)
    }

    /// The snapshot as compact JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("snapshots serialize to JSON")
    }

    /// The snapshot as indented JSON.
    pub fn to_json_pretty(&self) -> String {
        serde_json::to_string_pretty(self).expect("snapshots serialize to JSON")
    }
}
