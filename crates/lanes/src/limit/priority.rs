//! Priorities of waiters: a level, a fairness key and a weight.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// How a waiter is ordered among the others of its limit.
///
/// - The highest `level` is served first (levels are strict: a busy higher level starves lower
///   ones).
/// - Within a level, fairness keys take turns by weighted round-robin: a key takes up to its
///   weight in grants per turn, so one key's backlog cannot starve the others.
/// - Within a key, arrival order.
///
/// The default (level 0, no key, weight 1) is plain arrival order. A waiter keeps the priority it
/// first asked with.
///
/// # Examples
///
/// ```
/// use lanes::Priority;
///
/// let interactive = Priority::level(10);
/// let tenant = Priority::default().key("tenant-42").weight(3);
/// assert_eq!(interactive.level, 10);
/// assert_eq!(tenant.fairness_key.as_deref(), Some("tenant-42"));
/// ```
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Priority {
    /// Higher levels are served first.
    pub level: i32,
    /// The tenant (or any fairness group) the waiter belongs to; `None` is a group of its own.
    #[serde(rename = "key")]
    pub fairness_key: Option<Arc<str>>,
    /// Grants the key may take per turn, at least 1 (0 counts as 1). The key's weight is the one
    /// its latest waiter asked with.
    #[serde(rename = "weight")]
    pub fairness_weight: u32,
}

impl Priority {
    /// The default priority at `level`.
    pub fn level(level: i32) -> Self {
        Self { level, ..Self::default() }
    }

    /// Sets the fairness key.
    #[must_use]
    pub fn key(mut self, key: impl Into<Arc<str>>) -> Self {
        self.fairness_key = Some(key.into());
        self
    }

    /// Sets the fairness weight (0 counts as 1).
    #[must_use]
    pub fn weight(mut self, weight: u32) -> Self {
        self.fairness_weight = weight;
        self
    }

    /// Whether this is the default priority (plain arrival order).
    pub fn is_default(&self) -> bool {
        self.level == 0 && self.fairness_key.is_none() && self.fairness_weight <= 1
    }

    pub(crate) fn effective_weight(&self) -> u32 {
        self.fairness_weight.max(1)
    }

    /// [`Priority::default()`], as a constant a `static` can borrow.
    pub(crate) const DEFAULT: Self = Self { level: 0, fairness_key: None, fairness_weight: 1 };
}

impl Default for Priority {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl fmt::Debug for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Priority")
            .field("level", &self.level)
            .field("key", &self.fairness_key)
            .field("weight", &self.fairness_weight)
            .finish()
    }
}
