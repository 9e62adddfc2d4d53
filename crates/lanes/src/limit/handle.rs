//! The `Limits` facade and its `Permit`.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::backend::{Answer, LimitBackend};
use super::local::LocalLimits;
use super::priority::Priority;
use super::spec::LimitSpec;
use super::table::{Grant, LimitError, LimitInfo};
use crate::lane::{ConfigError, ConfigRule};
use crate::registry::{Registry, Snapshot, Source};

/// How long a waiter of a non-local backend waits for a push before it asks again anyway: a
/// safety net for lost notifications, not the way waiters learn of releases.
const REASK: Duration = Duration::from_secs(1);

#[derive(Clone)]
enum Backend {
    Local(Arc<LocalLimits>),
    Dyn(Arc<dyn LimitBackend>),
}

/// Named concurrency + rate limits with a fair, prioritized wait queue. Cheap to clone: clones
/// share the limits.
///
/// [`Limits::new`] keeps the limits in this process; [`Limits::with_backend`] uses any
/// [`LimitBackend`] (Redis in `lanes-redis`, a `lanes serve` over HTTP) with the same
/// semantics.
///
/// # Examples
///
/// ```
/// use lanes::{LimitSpec, Limits, Priority};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lanes::LimitError> {
/// let limits = Limits::new();
/// limits.define("stripe", LimitSpec::concurrent(10).per_second(100.0)).await?;
///
/// let permit = limits.acquire("stripe", Priority::default().key("tenant-7")).await?;
/// // ... call the downstream, passing permit.fencing_token() along if it fences ...
/// drop(permit); // the permit goes back to the limit (its token does not)
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Limits {
    backend: Backend,
}

impl Default for Limits {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for Limits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.backend {
            Backend::Local(local) => f.debug_tuple("Limits").field(local).finish(),
            Backend::Dyn(backend) => f.debug_tuple("Limits").field(backend).finish(),
        }
    }
}

impl Limits {
    /// Limits held in this process, with up to [`LimitTable::DEFAULT_MAX_WAITERS`] waiters per
    /// limit.
    ///
    /// [`LimitTable::DEFAULT_MAX_WAITERS`]: super::LimitTable::DEFAULT_MAX_WAITERS
    pub fn new() -> Self {
        Self { backend: Backend::Local(Arc::new(LocalLimits::new())) }
    }

    /// Limits held in this process, with up to `max_waiters` waiters per limit (more waiters get
    /// [`LimitError::TooManyWaiters`]).
    pub fn with_max_waiters(max_waiters: usize) -> Self {
        Self { backend: Backend::Local(Arc::new(LocalLimits::with_max_waiters(max_waiters))) }
    }

    /// Limits held by `backend`.
    pub fn with_backend(backend: impl LimitBackend) -> Self {
        Self::from_backend(Arc::new(backend))
    }

    /// Limits held by a shared `backend`.
    pub fn from_backend(backend: Arc<dyn LimitBackend>) -> Self {
        Self { backend: Backend::Dyn(backend) }
    }

    /// Defines `name`, or redefines it: the new spec takes effect for the next grants and never
    /// revokes a held permit.
    ///
    /// # Errors
    ///
    /// [`LimitError::InvalidSpec`], or a backend failure.
    pub async fn define(&self, name: &str, spec: LimitSpec) -> Result<(), LimitError> {
        match &self.backend {
            Backend::Local(local) => local.define_now(name, spec),
            Backend::Dyn(backend) => backend.define(name, spec).await,
        }
    }

    /// Removes `name`.
    ///
    /// # Errors
    ///
    /// [`LimitError::UnknownLimit`], [`LimitError::InUse`] while permits are held or tickets
    /// wait, or a backend failure.
    pub async fn remove(&self, name: &str) -> Result<(), LimitError> {
        match &self.backend {
            Backend::Local(local) => local.remove_now(name),
            Backend::Dyn(backend) => backend.remove(name).await,
        }
    }

    /// Waits for a permit of `name`, queued at `priority`.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future withdraws its ticket from the queue (or returns a
    /// permit granted on its behalf meanwhile); no permit leaks.
    ///
    /// # Errors
    ///
    /// [`LimitError::UnknownLimit`], [`LimitError::TooManyWaiters`], or a backend failure.
    pub async fn acquire(&self, name: &str, priority: Priority) -> Result<Permit, LimitError> {
        match &self.backend {
            Backend::Local(local) => {
                let (name, ticket, grant) = local.acquire_local(name, &priority).await?;
                Ok(Permit { release: Backend::Local(local.clone()), name, ticket, grant })
            }
            Backend::Dyn(backend) => acquire_dyn(backend, name, &priority).await,
        }
    }

    /// Like [`acquire`](Self::acquire), giving up after `timeout`.
    ///
    /// # Cancel safety
    ///
    /// As for [`acquire`](Self::acquire).
    ///
    /// # Errors
    ///
    /// [`AcquireError::Timeout`] when the time is up (the ticket was withdrawn), or
    /// [`AcquireError::Limit`].
    pub async fn acquire_timeout(
        &self,
        name: &str,
        priority: Priority,
        timeout: Duration,
    ) -> Result<Permit, AcquireError> {
        match tokio::time::timeout(timeout, self.acquire(name, priority)).await {
            Ok(result) => result.map_err(AcquireError::Limit),
            Err(_elapsed) => Err(AcquireError::Timeout(timeout)),
        }
    }

    /// A permit of `name` if one can be granted right now (nobody waits ahead, a permit is
    /// free, the bucket has a token), else `None`, leaving nothing queued.
    ///
    /// # Errors
    ///
    /// [`LimitError::UnknownLimit`], or a backend failure.
    pub async fn try_acquire(
        &self,
        name: &str,
        priority: Priority,
    ) -> Result<Option<Permit>, LimitError> {
        match &self.backend {
            Backend::Local(local) => {
                Ok(local.try_acquire_local(name, &priority)?.map(|(name, ticket, grant)| Permit {
                    release: Backend::Local(local.clone()),
                    name,
                    ticket,
                    grant,
                }))
            }
            Backend::Dyn(backend) => {
                let ticket = backend.ticket();
                match backend.acquire(name, ticket, &priority).await? {
                    Answer::Granted(grant) => Ok(Some(Permit {
                        release: Backend::Dyn(backend.clone()),
                        name: Arc::from(name),
                        ticket,
                        grant,
                    })),
                    Answer::Queued | Answer::RetryAfter(_) => {
                        backend.release(name, ticket).await?;
                        Ok(None)
                    }
                }
            }
        }
    }

    /// The state of `name`, `None` if it is not defined.
    ///
    /// # Errors
    ///
    /// A backend failure.
    pub async fn info(&self, name: &str) -> Result<Option<LimitInfo>, LimitError> {
        match &self.backend {
            Backend::Local(local) => Ok(local.info_now(name)),
            Backend::Dyn(backend) => backend.info(name).await,
        }
    }

    /// Every limit, in name order.
    ///
    /// # Errors
    ///
    /// A backend failure.
    pub async fn list(&self) -> Result<Vec<LimitInfo>, LimitError> {
        match &self.backend {
            Backend::Local(local) => Ok(local.infos()),
            Backend::Dyn(backend) => backend.list().await,
        }
    }

    /// Reports every limit in `registry` under `name`. Only limits held in this process can be
    /// snapshotted synchronously; other backends report through their own service.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] if `name` is taken, or [`ConfigRule::Unsupported`] for a backend that
    /// is not in this process.
    pub fn register(
        &self,
        registry: &Registry,
        name: impl Into<String>,
    ) -> Result<(), ConfigError> {
        match &self.backend {
            Backend::Local(local) => {
                let source: Arc<dyn Source> = local.clone();
                registry.register(name.into(), Arc::downgrade(&source))
            }
            Backend::Dyn(_) => Err(ConfigError::new("registry", ConfigRule::Unsupported)),
        }
    }
}

impl Source for LocalLimits {
    fn report(&self, name: &str, snapshot: &mut Snapshot) {
        snapshot.limits.insert(name.to_owned(), self.infos());
    }
}

async fn acquire_dyn(
    backend: &Arc<dyn LimitBackend>,
    name: &str,
    priority: &Priority,
) -> Result<Permit, LimitError> {
    let ticket = backend.ticket();
    let mut withdraw = DynWithdraw { backend: backend.clone(), name, ticket, armed: true };
    loop {
        let wait = match backend.acquire(name, ticket, priority).await? {
            Answer::Granted(grant) => {
                withdraw.armed = false;
                let release = Backend::Dyn(backend.clone());
                return Ok(Permit { release, name: Arc::from(name), ticket, grant });
            }
            Answer::Queued => REASK,
            Answer::RetryAfter(after) => after,
        };
        backend.wait(name, ticket, wait).await;
    }
}

/// Withdraws the ticket of a dropped acquire on a non-local backend, in the background.
struct DynWithdraw<'a> {
    backend: Arc<dyn LimitBackend>,
    name: &'a str,
    ticket: u64,
    armed: bool,
}

impl Drop for DynWithdraw<'_> {
    fn drop(&mut self) {
        if self.armed {
            release_in_background(self.backend.clone(), Arc::from(self.name), self.ticket);
        }
    }
}

fn release_in_background(backend: Arc<dyn LimitBackend>, name: Arc<str>, ticket: u64) {
    // Outside a runtime nothing can run the release; a leased backend reclaims the permit when
    // its lease expires.
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move {
            let _ = backend.release(&name, ticket).await;
        });
    }
}

/// A permit of a limit. Returned to the limit when dropped.
#[must_use = "a permit is returned as soon as it is dropped"]
pub struct Permit {
    release: Backend,
    name: Arc<str>,
    ticket: u64,
    grant: Grant,
}

impl Permit {
    /// The limit this permit belongs to.
    pub fn limit(&self) -> &str {
        &self.name
    }

    /// The ticket the permit was granted to.
    pub fn ticket(&self) -> u64 {
        self.ticket
    }

    /// Strictly increasing per limit: hand it to a downstream so it can refuse stale holders.
    pub fn fencing_token(&self) -> u64 {
        self.grant.fencing_token
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        match &self.release {
            Backend::Local(local) => local.release_now(&self.name, self.ticket),
            Backend::Dyn(backend) => {
                release_in_background(backend.clone(), self.name.clone(), self.ticket);
            }
        }
    }
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("limit", &self.name)
            .field("ticket", &self.ticket)
            .field("fencing_token", &self.grant.fencing_token)
            .finish()
    }
}

/// Why [`Limits::acquire_timeout`] gave up.
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
