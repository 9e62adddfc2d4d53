//! Lane configuration, its builder and its validation.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::audit::Audit;
use super::handle::LaneSet;
use crate::observe::{Registration, Registry};

/// The largest `queued` bound a lane accepts.
pub const MAX_QUEUED: usize = 10_000;

/// Bounds of one lane: `concurrent` execution slots and `queued` waiting slots.
///
/// A lane owns at most `concurrent + queued` runs at once, counted from admission until the
/// run's finalizer and cleanup have finished.
///
/// # Examples
///
/// ```
/// use lanes::LaneLimits;
///
/// let limits = LaneLimits::new(2, 8);
/// assert_eq!(limits.capacity(), 10);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LaneLimits {
    /// Runs executing at once; at least 1.
    pub concurrent: usize,
    /// Runs waiting for an execution slot; `0..=MAX_QUEUED` (0 means no waiting room).
    pub queued: usize,
}

impl LaneLimits {
    /// Bounds with `concurrent` execution slots and `queued` waiting slots. Validated when the
    /// [`LaneSet`] is built.
    pub const fn new(concurrent: usize, queued: usize) -> Self {
        Self { concurrent, queued }
    }

    /// The ownership cap, `concurrent + queued` (saturating).
    pub const fn capacity(&self) -> usize {
        self.concurrent.saturating_add(self.queued)
    }
}

use crate::config::{ConfigError, ConfigRule};

/// Builds a [`LaneSet`]. Every bound must be given: there are no hidden defaults.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use lanes::{LaneLimits, LaneSet};
///
/// let lanes = LaneSet::builder()
///     .lane("blocking", LaneLimits::new(1, 4))
///     .lane("background", LaneLimits::new(2, 8))
///     .audit_timeout(Duration::from_secs(1))
///     .finalization_timeout(Duration::from_secs(1))
///     .worker_drain_timeout(Duration::from_secs(2))
///     .build()?;
/// assert_eq!(lanes.lane_names().collect::<Vec<_>>(), ["blocking", "background"]);
/// # Ok::<(), lanes::ConfigError>(())
/// ```
#[must_use = "a builder does nothing until `build` is called"]
#[derive(Default)]
pub struct LaneSetBuilder {
    pub(crate) lanes: Vec<(String, LaneLimits)>,
    pub(crate) audit_timeout: Option<Duration>,
    pub(crate) finalization_timeout: Option<Duration>,
    pub(crate) worker_drain_timeout: Option<Duration>,
    pub(crate) audit: Option<Arc<dyn Audit>>,
    pub(crate) registry: Option<Registration>,
    pub(crate) name: Option<String>,
}

impl fmt::Debug for LaneSetBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LaneSetBuilder")
            .field("lanes", &self.lanes)
            .field("audit_timeout", &self.audit_timeout)
            .field("finalization_timeout", &self.finalization_timeout)
            .field("worker_drain_timeout", &self.worker_drain_timeout)
            .field("audit", &self.audit.is_some())
            .field("registry", &self.registry)
            .field("name", &self.name)
            .finish()
    }
}

impl LaneSetBuilder {
    /// Adds a lane. Lanes keep the order they were added in; they never borrow each other's
    /// capacity.
    pub fn lane(mut self, name: impl Into<String>, limits: LaneLimits) -> Self {
        self.lanes.push((name.into(), limits));
        self
    }

    /// Bounds every audit call and every run cleanup. Required, longer than zero.
    pub fn audit_timeout(mut self, timeout: Duration) -> Self {
        self.audit_timeout = Some(timeout);
        self
    }

    /// Bounds every finalizer. Required, longer than zero.
    pub fn finalization_timeout(mut self, timeout: Duration) -> Self {
        self.finalization_timeout = Some(timeout);
        self
    }

    /// How long a cancelled job may keep running before the set is poisoned. Required, longer
    /// than zero.
    pub fn worker_drain_timeout(mut self, timeout: Duration) -> Self {
        self.worker_drain_timeout = Some(timeout);
        self
    }

    /// Sends started / completed / failed events of every run to `audit`.
    pub fn audit(mut self, audit: impl Audit) -> Self {
        self.audit = Some(Arc::new(audit));
        self
    }

    /// Reports the set's snapshot in `registry` under `name`.
    pub fn registry(mut self, registry: &Registry, name: impl Into<String>) -> Self {
        self.registry = Some(Registration::new(registry, name));
        self
    }

    /// The set's name in metrics (the `lane_set` label); defaults to the registry name, else
    /// `unnamed`.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// The `lane_set` label: the explicit name, else the registry name, else "unnamed".
    pub(crate) fn metrics_name(&self) -> String {
        self.name
            .clone()
            .or_else(|| self.registry.as_ref().map(|r| r.name.clone()))
            .unwrap_or_else(|| "unnamed".to_owned())
    }

    /// Validates the configuration and builds the set.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] naming the first invalid field: no lanes, a duplicate lane name, zero
    /// `concurrent`, `queued` over [`MAX_QUEUED`], a missing or zero timeout, or a registry name
    /// already in use.
    pub fn build(self) -> Result<LaneSet, ConfigError> {
        if self.lanes.is_empty() {
            return Err(ConfigError::new("lanes", ConfigRule::NoLanes));
        }
        if let Some(registration) = &self.registry {
            registration.check()?;
        }
        for (index, (name, limits)) in self.lanes.iter().enumerate() {
            if self.lanes[..index].iter().any(|(other, _)| other == name) {
                return Err(ConfigError::new(format!("lanes.{name}"), ConfigRule::Duplicate));
            }
            if limits.concurrent == 0 {
                return Err(ConfigError::new(format!("lanes.{name}.concurrent"), ConfigRule::Zero));
            }
            if limits.queued > MAX_QUEUED {
                return Err(ConfigError::new(
                    format!("lanes.{name}.queued"),
                    ConfigRule::OverMax { max: MAX_QUEUED },
                ));
            }
        }
        let timeouts = [
            ("audit_timeout", self.audit_timeout),
            ("finalization_timeout", self.finalization_timeout),
            ("worker_drain_timeout", self.worker_drain_timeout),
        ];
        for (field, timeout) in timeouts {
            match timeout {
                None => return Err(ConfigError::new(field, ConfigRule::Missing)),
                Some(timeout) if timeout.is_zero() => {
                    return Err(ConfigError::new(field, ConfigRule::ZeroTimeout));
                }
                Some(_) => {}
            }
        }
        LaneSet::from_builder(self)
    }
}
