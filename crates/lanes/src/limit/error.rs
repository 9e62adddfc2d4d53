//! The limit's errors: one type per operation, each with what a caller needs to react.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Why a limit operation failed.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum LimitError {
    /// No limit has this name.
    UnknownLimit(String),
    /// The spec broke a rule.
    InvalidSpec(SpecError),
    /// The limit already has its maximum of waiters.
    TooManyWaiters {
        /// The limit.
        limit: String,
        /// The configured maximum.
        max: usize,
    },
    /// The limit cannot be removed while permits are held or tickets wait.
    InUse(String),
    /// A [`KeyedLimit`](super::KeyedLimit) keeps its maximum of keys (those of the new key's
    /// shard), in use (holding a permit, waited for, or with a bucket still refilling) or gone
    /// idle since the shard last looked (it looks again within 100 ms): a new key is refused
    /// until some make room.
    TooManyKeys {
        /// The keyed limit.
        limit: String,
        /// The configured maximum.
        max: usize,
    },
    /// The backend already keeps its maximum of limits (a cap set on the backend, such as
    /// [`LocalLimits::with_max_limits`](super::LocalLimits::with_max_limits)): a new name is
    /// refused until one is removed. Redefining a limit that exists is never refused.
    TooManyLimits {
        /// The configured maximum.
        max: usize,
    },
    /// The backend could not answer (I/O, timeout, outage, an odd reply): what it said, and the
    /// underlying error through `source()`.
    Backend(BackendError),
    /// A backend's options broke a rule (when it was built): the error names the setting.
    InvalidOptions(crate::ConfigError),
    /// A leased permit could not be renewed: its lease had ended and the permit was reclaimed
    /// (another holder may have it now; the fencing token of this one is stale).
    LeaseExpired {
        /// The limit.
        limit: String,
        /// The ticket whose permit lapsed.
        ticket: u64,
    },
}

impl LimitError {
    /// No such limit.
    pub fn is_unknown_limit(&self) -> bool {
        matches!(self, Self::UnknownLimit(_))
    }

    /// The waiting room is full.
    pub fn is_too_many_waiters(&self) -> bool {
        matches!(self, Self::TooManyWaiters { .. })
    }

    /// A keyed limit keeps its maximum of keys.
    pub fn is_too_many_keys(&self) -> bool {
        matches!(self, Self::TooManyKeys { .. })
    }

    /// The backend keeps its maximum of limits.
    pub fn is_too_many_limits(&self) -> bool {
        matches!(self, Self::TooManyLimits { .. })
    }

    /// A renewal came after the lease ended.
    pub fn is_lease_expired(&self) -> bool {
        matches!(self, Self::LeaseExpired { .. })
    }

    /// The backend could not answer.
    pub fn is_backend(&self) -> bool {
        matches!(self, Self::Backend(_))
    }
}

impl fmt::Display for LimitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownLimit(name) => write!(f, "unknown limit {name:?}"),
            Self::InvalidSpec(err) => err.fmt(f),
            Self::TooManyWaiters { limit, max } => {
                write!(f, "limit {limit:?} already has {max} waiters")
            }
            Self::InUse(name) => write!(f, "limit {name:?} has permits held or tickets waiting"),
            Self::TooManyKeys { limit, max } => {
                write!(f, "keyed limit {limit:?} already keeps {max} keys in use")
            }
            Self::TooManyLimits { max } => {
                write!(f, "the backend already keeps its maximum of {max} limits")
            }
            Self::Backend(err) => write!(f, "limit backend failed: {err}"),
            Self::InvalidOptions(err) => err.fmt(f),
            Self::LeaseExpired { limit, ticket } => {
                write!(f, "the lease of ticket {ticket} on limit {limit:?} expired")
            }
        }
    }
}

impl std::error::Error for LimitError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::InvalidSpec(err) => Some(err),
            Self::Backend(err) => Some(err),
            Self::InvalidOptions(err) => Some(err),
            _ => None,
        }
    }
}

impl LimitError {
    /// A backend failure with only a message.
    pub fn backend(message: impl Into<String>) -> Self {
        Self::Backend(BackendError::new(message))
    }
}

/// What a backend said when it could not answer, with the error underneath when there is one.
#[derive(Debug, Clone)]
pub struct BackendError {
    message: String,
    source: Option<Arc<dyn std::error::Error + Send + Sync>>,
}

impl BackendError {
    /// A failure described by `message` alone.
    pub fn new(message: impl Into<String>) -> Self {
        Self { message: message.into(), source: None }
    }

    /// A failure described by `message`, caused by `source` (kept for `source()`).
    pub fn with_source(
        message: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self { message: message.into(), source: Some(Arc::new(source)) }
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }
}

/// Equal when the messages are: the sources are for diagnosis.
impl PartialEq for BackendError {
    fn eq(&self, other: &Self) -> bool {
        self.message == other.message
    }
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for BackendError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|err| err as &(dyn std::error::Error + 'static))
    }
}

impl From<SpecError> for LimitError {
    fn from(err: SpecError) -> Self {
        Self::InvalidSpec(err)
    }
}

/// Why [`Limits::acquire_timeout`](super::Limits::acquire_timeout) gave up.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum AcquireError {
    /// No permit within the timeout; the ticket was withdrawn.
    Timeout(Duration),
    /// The limit refused.
    Limit(LimitError),
}

impl AcquireError {
    /// The timeout elapsed.
    pub fn is_timeout(&self) -> bool {
        matches!(self, Self::Timeout(_))
    }
}

impl fmt::Display for AcquireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Timeout(after) => write!(f, "no permit within {after:?}"),
            Self::Limit(err) => err.fmt(f),
        }
    }
}

impl std::error::Error for AcquireError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Timeout(_) => None,
            Self::Limit(err) => Some(err),
        }
    }
}

/// Why [`Limits::try_acquire`](super::Limits::try_acquire) gave no permit. A try never queues, so
/// nothing is left behind.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum TryAcquireError {
    /// Every permit is held, or others wait ahead: try again after a release.
    Busy,
    /// The rate bucket is empty: it has a token after this long.
    RateLimited(Duration),
    /// The limit refused (unknown limit, backend failure).
    Limit(LimitError),
}

impl TryAcquireError {
    /// No permit is free, or others wait ahead.
    pub fn is_busy(&self) -> bool {
        matches!(self, Self::Busy)
    }

    /// The rate bucket is empty.
    pub fn is_rate_limited(&self) -> bool {
        matches!(self, Self::RateLimited(_))
    }

    /// When a retry can succeed, if the limit knows: the bucket's refill time.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::RateLimited(after) => Some(*after),
            _ => None,
        }
    }
}

impl From<LimitError> for TryAcquireError {
    fn from(err: LimitError) -> Self {
        Self::Limit(err)
    }
}

impl fmt::Display for TryAcquireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Busy => f.write_str("no permit free"),
            Self::RateLimited(after) => write!(f, "rate limited; retry after {after:?}"),
            Self::Limit(err) => err.fmt(f),
        }
    }
}

impl std::error::Error for TryAcquireError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Limit(err) => Some(err),
            _ => None,
        }
    }
}

/// A [`LimitSpec`](super::LimitSpec) broke a rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecError {
    pub(super) field: &'static str,
    pub(super) rule: &'static str,
}

impl SpecError {
    /// The offending field: `concurrent`, `per_second` or `burst`.
    pub fn field(&self) -> &'static str {
        self.field
    }

    /// The rule it broke.
    pub fn rule(&self) -> &'static str {
        self.rule
    }
}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid limit: {} {}", self.field, self.rule)
    }
}

impl std::error::Error for SpecError {}
