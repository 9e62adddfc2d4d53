//! The ground floor of configuration, shared by every primitive: the error that names the
//! offending field and the rule it broke, and the validation helpers builders use. Nothing
//! here knows a primitive.

use std::fmt;

/// The rule a configuration value broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigRule {
    /// The value must be at least 1.
    Zero,
    /// The value is over its maximum.
    OverMax {
        /// The largest accepted value.
        max: usize,
    },
    /// A timeout must be longer than zero.
    ZeroTimeout,
    /// The value has no default and was not set.
    Missing,
    /// At least one lane is required.
    NoLanes,
    /// The name is already taken.
    Duplicate,
    /// The operation is not supported by this configuration.
    Unsupported,
    /// Building needs a tokio runtime (call it inside one).
    NoRuntime,
    /// The value must be at least `min` (which depends on other settings; the field's docs say
    /// how).
    AtLeast {
        /// The smallest accepted value.
        min: u64,
    },
    /// The value must be a finite number above zero.
    Positive,
    /// The value must be at least another setting's (named here).
    AtLeastSetting {
        /// The setting it must not be below.
        setting: &'static str,
    },
    /// The duration must be at least `min`.
    AtLeastTime {
        /// The shortest accepted duration.
        min: std::time::Duration,
    },
    /// The value does not have the form given here (a name, an address).
    Form {
        /// What the value must be.
        must_be: &'static str,
    },
}

/// An invalid configuration: names the field and the rule it broke.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use lanes::{ConfigRule, LaneLimits, LaneSet};
///
/// let err = LaneSet::builder()
///     .lane("blocking", LaneLimits::new(0, 4))
///     .audit_timeout(Duration::from_secs(1))
///     .finalization_timeout(Duration::from_secs(1))
///     .worker_drain_timeout(Duration::from_secs(1))
///     .build()
///     .unwrap_err();
/// assert_eq!(err.field(), "lanes.blocking.concurrent");
/// assert_eq!(err.rule(), ConfigRule::Zero);
/// assert_eq!(err.to_string(), "invalid configuration: lanes.blocking.concurrent must be at least 1");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    // Boxed: the error rides inside others (`SpillError`, and so a channel's `EmitError`, on
    // the producer's path), and a rule that names a setting takes two words.
    field: Box<str>,
    rule: ConfigRule,
}

impl ConfigError {
    /// An error for `field` (a dotted path) breaking `rule`: for crates that build on `lanes`
    /// (a backend's options, say), so that their settings fail the way ours do.
    ///
    /// # Examples
    ///
    /// ```
    /// use lanes::{ConfigError, ConfigRule};
    ///
    /// let err = ConfigError::new("replicas", ConfigRule::Zero);
    /// assert_eq!(err.to_string(), "invalid configuration: replicas must be at least 1");
    /// ```
    pub fn new(field: impl Into<String>, rule: ConfigRule) -> Self {
        Self { field: field.into().into_boxed_str(), rule }
    }

    /// The offending field, as a dotted path (`lanes.blocking.queued`).
    pub fn field(&self) -> &str {
        &self.field
    }

    /// The rule the field broke.
    pub fn rule(&self) -> ConfigRule {
        self.rule
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid configuration: {} ", self.field)?;
        match self.rule {
            ConfigRule::Zero => f.write_str("must be at least 1"),
            ConfigRule::AtLeast { min } => write!(f, "must be at least {min}"),
            ConfigRule::OverMax { max } => write!(f, "must be at most {max}"),
            ConfigRule::ZeroTimeout => f.write_str("must be longer than zero"),
            ConfigRule::Missing => f.write_str("must be set (it has no default)"),
            ConfigRule::NoLanes => f.write_str("must name at least one lane"),
            ConfigRule::Duplicate => f.write_str("is already taken"),
            ConfigRule::Unsupported => f.write_str("is not supported here"),
            ConfigRule::NoRuntime => f.write_str("needs a tokio runtime (build inside one)"),
            ConfigRule::Positive => f.write_str("must be finite and above zero"),
            ConfigRule::AtLeastSetting { setting } => write!(f, "must be at least {setting}"),
            ConfigRule::AtLeastTime { min } => write!(f, "must be at least {min:?}"),
            ConfigRule::Form { must_be } => write!(f, "must be {must_be}"),
        }
    }
}

impl std::error::Error for ConfigError {}

/// A required count: set, and at least 1.
pub(crate) fn require(value: Option<usize>, field: &str) -> Result<usize, ConfigError> {
    match value {
        None => Err(ConfigError::new(field, ConfigRule::Missing)),
        Some(0) => Err(ConfigError::new(field, ConfigRule::Zero)),
        Some(n) => Ok(n),
    }
}

/// Building needs a tokio runtime: fails with [`ConfigRule::NoRuntime`] outside one.
pub(crate) fn runtime() -> Result<(), ConfigError> {
    tokio::runtime::Handle::try_current()
        .map(drop)
        .map_err(|_| ConfigError::new("runtime", ConfigRule::NoRuntime))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error rides inside the spill queue's error, and so inside a channel's `EmitError`,
    /// the answer of every `emit`: a larger one is written and copied on the producer's path
    /// (suite 3's stop-52 note). Five words, as before rules that name a setting came.
    #[test]
    fn a_config_error_stays_five_words() {
        assert_eq!(std::mem::size_of::<ConfigError>(), 40);
    }
}
