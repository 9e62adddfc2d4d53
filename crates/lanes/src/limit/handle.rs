//! The `Limits` facade, the per-limit `Limit` handle, and `Permit`.

use std::fmt;
use std::future::poll_fn;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use tokio::time::Instant;

use super::acquire::{Withdraw, drive, release_in_background};
use super::backend::{Answer, LimitBackend};
use super::cell::Miss;
use super::config::LimitSpec;
use super::core::{Acquire, Grant};
use super::error::{AcquireError, LimitError, TryAcquireError};
use super::local::{Granted, LocalLimits, Slot, Wait};
use super::metrics::count_off;
use super::priority::Priority;
use super::snapshot::LimitInfo;
use crate::config::{ConfigError, ConfigRule};
use crate::observe::{Observe, Registration, Registry, Snapshot};

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

    /// A builder: the backend, the waiting room, and where the limits report.
    ///
    /// # Examples
    ///
    /// ```
    /// use lanes::{LimitSpec, Limits, Registry};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// let registry = Registry::new();
    /// let limits = Limits::builder().max_waiters(1_000).registry(&registry, "app").build()?;
    /// limits.define("search", LimitSpec::concurrent(4)).await?;
    /// let reported = registry.snapshot().limits("app").expect("reported");
    /// assert_eq!(reported[0].name, "search");
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder() -> LimitsBuilder {
        LimitsBuilder::default()
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

    /// A handle on the limit `name`: the same operations without naming it each time.
    pub fn limit(&self, name: &str) -> Limit {
        let slot = match &self.backend {
            Backend::Local(local) => local.slot(name),
            Backend::Dyn(_) => None,
        };
        let name = slot.as_ref().map_or_else(|| Arc::from(name), |slot| slot.name.clone());
        Limit { limits: self.clone(), name, slot }
    }

    /// The fast path of a local limit: a permit without the lock while nobody waits.
    fn fast(
        &self,
        name: &str,
        cached: Option<&Arc<Slot>>,
    ) -> Option<(Arc<Slot>, Result<u64, Miss>)> {
        let Backend::Local(local) = &self.backend else { return None };
        let slot = match cached {
            Some(slot) if !slot.is_removed() => slot.clone(),
            _ => local.slot(name)?,
        };
        let answer = local.try_fast(&slot);
        Some((slot, answer))
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
        match self.acquire_now(name, None) {
            Ok(permit) => Ok(permit),
            Err(missed) => self.acquire_waiting(name, &priority, missed).await,
        }
    }

    /// An acquire's fast path: a permit, or why it must wait (the limit's slot when it is held
    /// in this process). Each `acquire` future calls it directly (always inlined), so that the
    /// common answer costs no call into a shared future.
    #[inline(always)]
    fn acquire_now(
        &self,
        name: &str,
        cached: Option<&Arc<Slot>>,
    ) -> Result<Permit, Option<Arc<Slot>>> {
        match self.fast(name, cached) {
            Some((slot, Ok(fence))) => Ok(Permit::fast(slot, fence)),
            Some((slot, Err(_))) => Err(Some(slot)),
            None => Err(None),
        }
    }

    /// An acquire that missed the fast path: it waits, without a deadline.
    async fn acquire_waiting(
        &self,
        name: &str,
        priority: &Priority,
        missed: Option<Arc<Slot>>,
    ) -> Result<Permit, LimitError> {
        if let (Backend::Local(local), Some(slot)) = (&self.backend, missed) {
            return Self::wait_local(local, slot, priority).await.map_err(|err| match err {
                AcquireError::Limit(err) => err,
                AcquireError::Timeout(_) => unreachable!("no deadline, no timeout"),
            });
        }
        match self.acquire_inner(name, priority, None, None).await {
            Ok(permit) => Ok(permit),
            Err(AcquireError::Limit(err)) => Err(err),
            Err(AcquireError::Timeout(_)) => unreachable!("no deadline, no timeout"),
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
        // A timeout past the clock's range waits as long as it takes.
        self.acquire_inner(name, &priority, Instant::now().checked_add(timeout), None).await
    }

    /// Like [`acquire`](Self::acquire), giving up at `deadline` (tokio's clock).
    ///
    /// # Cancel safety
    ///
    /// As for [`acquire`](Self::acquire).
    ///
    /// # Errors
    ///
    /// [`AcquireError::Timeout`] when the deadline passed (the ticket was withdrawn), or
    /// [`AcquireError::Limit`].
    pub async fn acquire_until(
        &self,
        name: &str,
        priority: Priority,
        deadline: Instant,
    ) -> Result<Permit, AcquireError> {
        self.acquire_inner(name, &priority, Some(deadline), None).await
    }

    /// The one acquire future. In process, a [`Wait`]: in the limit's line for the default
    /// priority while the fast path governs, else a fresh ticket in the table; dropped or past
    /// its deadline, it leaves the line or withdraws its ticket (and returns a permit handed to
    /// it meanwhile). Another backend's: a fresh ticket driven by `acquire.rs`, withdrawn the
    /// same way. Either wakes on grant, refill or lease end.
    async fn acquire_inner(
        &self,
        name: &str,
        priority: &Priority,
        deadline: Option<Instant>,
        missed: Option<Arc<Slot>>,
    ) -> Result<Permit, AcquireError> {
        // The clock is read only when a deadline needs the wait's length.
        let started = deadline.map(|_| Instant::now());
        let timed_out = |deadline: Instant| {
            AcquireError::Timeout(deadline.saturating_duration_since(started.unwrap_or(deadline)))
        };
        match &self.backend {
            Backend::Local(local) => {
                // The fast path first (unless the caller just missed it), then the table.
                let slot = match missed {
                    Some(slot) => slot,
                    None => match self.fast(name, None) {
                        Some((slot, Ok(fence))) => return Ok(Permit::fast(slot, fence)),
                        Some((slot, Err(_))) => slot,
                        None => {
                            let err = LimitError::UnknownLimit(name.to_owned());
                            return Err(AcquireError::Limit(err));
                        }
                    },
                };
                let Some(deadline) = deadline else {
                    return Self::wait_local(local, slot, priority).await;
                };
                let since = crate::observe::timing_start();
                tracing::trace!(limit = %slot.name, "waiting for a permit");
                let mut wait = Wait::new(local, &slot, priority);
                let mut expiry = Box::pin(tokio::time::sleep_until(deadline));
                let granted = poll_fn(|cx| {
                    if let Poll::Ready(done) = wait.poll(cx) {
                        return Poll::Ready(done.map_err(AcquireError::Limit));
                    }
                    match expiry.as_mut().poll(cx) {
                        Poll::Ready(()) => Poll::Ready(Err(timed_out(deadline))),
                        Poll::Pending => Poll::Pending,
                    }
                })
                .await;
                // The permit first (see `waited`); a wait that ended undoes nothing, one that
                // timed out leaves (cancel safe).
                let permit = Self::waited(local, slot.clone(), granted, since);
                drop(wait);
                permit
            }
            // Boxed: a remote wait makes round trips, and its future inline would make every
            // in-process acquire future several hundred bytes larger.
            Backend::Dyn(backend) => {
                Box::pin(Self::acquire_remote(backend, name, priority, deadline, started)).await
            }
        }
    }

    /// [`acquire_inner`](Self::acquire_inner) in process without a deadline, once the fast
    /// path missed: only the [`Wait`] (no timer to poll beside it).
    async fn wait_local(
        local: &Arc<LocalLimits>,
        slot: Arc<Slot>,
        priority: &Priority,
    ) -> Result<Permit, AcquireError> {
        let since = crate::observe::timing_start();
        tracing::trace!(limit = %slot.name, "waiting for a permit");
        let mut wait = Wait::new(local, &slot, priority);
        let granted = poll_fn(|cx| wait.poll(cx)).await.map_err(AcquireError::Limit);
        // The permit first (see `waited`); a wait that ended undoes nothing, one dropped
        // before leaves (cancel safe).
        let permit = Self::waited(local, slot.clone(), granted, since);
        drop(wait);
        permit
    }

    /// The permit (or the error) an in-process wait that began at `since` ended with: made
    /// before anything calls a recorder or a subscriber (the wait's drop counts it off the
    /// `waiters` gauge), so that one that panics unwinds through the permit, which gives it
    /// back, rather than losing the grant.
    fn waited(
        local: &Arc<LocalLimits>,
        slot: Arc<Slot>,
        granted: Result<Granted, AcquireError>,
        since: Option<tokio::time::Instant>,
    ) -> Result<Permit, AcquireError> {
        match granted {
            Ok(Granted::Line(fence)) => {
                let permit = Permit::fast_waited(slot, fence, since);
                tracing::trace!(limit = %permit.limit(), fencing_token = fence, "granted in line");
                Ok(permit)
            }
            Ok(Granted::Table(ticket, grant)) => {
                let fence = grant.fencing_token;
                let permit = Permit::local(local, slot, ticket, grant, since);
                tracing::trace!(limit = %permit.limit(), ticket, fencing_token = fence, "granted");
                Ok(permit)
            }
            Err(err) => {
                if matches!(err, AcquireError::Timeout(_)) {
                    slot.metrics().timed_out.increment(1);
                }
                tracing::debug!(limit = %slot.name, error = %err, "acquire ended without a permit");
                Err(err)
            }
        }
    }

    /// [`acquire_inner`](Self::acquire_inner) on another backend: a fresh ticket driven by
    /// `acquire.rs`, withdrawn if the wait is dropped or times out.
    async fn acquire_remote(
        backend: &Arc<dyn LimitBackend>,
        name: &str,
        priority: &Priority,
        deadline: Option<Instant>,
        started: Option<Instant>,
    ) -> Result<Permit, AcquireError> {
        let timed_out = |deadline: Instant| {
            AcquireError::Timeout(deadline.saturating_duration_since(started.unwrap_or(deadline)))
        };
        let name: Arc<str> = Arc::from(name);
        let mut withdraw = Withdraw {
            backend: backend.clone(),
            name: name.clone(),
            ticket: backend.ticket(),
            armed: true,
        };
        let mut first = Some(priority);
        loop {
            let ticket = withdraw.ticket;
            let answer = drive(&**backend, &name, ticket, first.take(), None, deadline)
                .await
                .map_err(AcquireError::Limit)?;
            match answer {
                Answer::Granted(grant) => {
                    withdraw.armed = false;
                    let release = Backend::Dyn(backend.clone());
                    return Ok(Permit::of_ticket(release, name, ticket, grant));
                }
                // Its owner is still waiting, so the store lost the ticket (a restart), or
                // withdrew it (a server's queue grace): ask anew, with a ticket of its own. (A
                // number is used once: `lanes serve` answers a finished one 410 for a while,
                // and asked again under it, this loop spun on those answers.)
                Answer::Finished => {
                    if let Some(deadline) = deadline.filter(|deadline| Instant::now() >= *deadline)
                    {
                        return Err(timed_out(deadline));
                    }
                    withdraw.ticket = backend.ticket();
                    first = Some(priority);
                }
                Answer::Queued | Answer::RetryAfter(_) => {
                    let deadline = deadline.expect("drive returns pending only at one");
                    return Err(timed_out(deadline));
                }
            }
        }
    }

    /// A permit of `name` if one can be granted right now (nobody waits ahead, a permit is
    /// free, the bucket has a token). Never queues and never waits, so it never fails for a
    /// full waiting room.
    ///
    /// # Errors
    ///
    /// [`TryAcquireError::Busy`] (every permit is held or others wait),
    /// [`TryAcquireError::RateLimited`] with the time until the bucket has a token, or
    /// [`TryAcquireError::Limit`] (an unknown limit, a backend failure).
    pub async fn try_acquire(
        &self,
        name: &str,
        priority: Priority,
    ) -> Result<Permit, TryAcquireError> {
        let _ = priority;
        match &self.backend {
            Backend::Local(local) => Self::try_local(local, name, None),
            Backend::Dyn(backend) => Self::try_dyn(backend, name).await,
        }
    }

    /// Spends one token of `name`'s rate now, if a permit could be granted now, and holds
    /// nothing: a permit taken and returned at once (counted as a grant; its fencing token is
    /// used up). What a rate limiter's `check` does, for a limit that guards a rate rather
    /// than work in flight. Never queues and never waits.
    ///
    /// In process, while nobody waits, a check is a few atomic operations on the limit: no
    /// lock, and (through a [`Limit`] handle, or by a name this thread used lately) no
    /// reference count. Otherwise (others wait, or another backend holds the limit) it is a
    /// [`try_acquire`](Self::try_acquire) whose permit is dropped at once; a backend that
    /// returns permits over the network returns it in a background task, so there a check
    /// holds a permit of a `concurrent` bound for that round trip.
    ///
    /// ```
    /// use lanes::{LimitSpec, Limits};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let limits = Limits::new();
    /// limits.define("api", LimitSpec::rate(10.0).burst(2)).await?;
    /// limits.check("api").await?;
    /// limits.check("api").await?;
    /// let refused = limits.check("api").await.unwrap_err();
    /// assert!(refused.retry_after().is_some());
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// As for [`try_acquire`](Self::try_acquire).
    pub async fn check(&self, name: &str) -> Result<(), TryAcquireError> {
        match self.check_now(name, None) {
            Some(answer) => answer,
            None => self.try_cached(name, None).await.map(drop),
        }
    }

    /// A check's answer on the fast path, `None` when the table (or another backend) must
    /// answer. Each `check` future calls it directly (always inlined), so that the common
    /// answer costs no call into a shared future.
    #[inline(always)]
    fn check_now(
        &self,
        name: &str,
        cached: Option<&Arc<Slot>>,
    ) -> Option<Result<(), TryAcquireError>> {
        let Backend::Local(local) = &self.backend else { return None };
        let answer = match cached {
            Some(slot) if !slot.is_removed() => check_answer(local, slot),
            _ => match check_by_name(local, name) {
                Some(answer) => answer,
                None => {
                    return Some(Err(TryAcquireError::Limit(LimitError::UnknownLimit(
                        name.to_owned(),
                    ))));
                }
            },
        };
        answer.map(|answer| answer.map_err(|refusal| refusal.error(local)))
    }

    /// A try at the default priority (a check's, when the fast path cannot answer it).
    async fn try_cached(
        &self,
        name: &str,
        cached: Option<&Arc<Slot>>,
    ) -> Result<Permit, TryAcquireError> {
        match &self.backend {
            Backend::Local(local) => Self::try_local(local, name, cached),
            Backend::Dyn(backend) => Self::try_dyn(backend, name).await,
        }
    }

    /// A try of a limit held in this process: the fast path, else the table (no waiting, so
    /// no future). Always inlined, so that each `try_acquire` future holds the common answer
    /// itself rather than calling into a shared one.
    #[inline(always)]
    fn try_local(
        local: &Arc<LocalLimits>,
        name: &str,
        cached: Option<&Arc<Slot>>,
    ) -> Result<Permit, TryAcquireError> {
        let slot = match cached {
            Some(slot) if !slot.is_removed() => slot.clone(),
            _ => match local.slot(name) {
                Some(slot) => slot,
                None => {
                    return Err(TryAcquireError::Limit(LimitError::UnknownLimit(name.to_owned())));
                }
            },
        };
        let refused = match local.try_fast(&slot) {
            Ok(fence) => return Ok(Permit::fast(slot, fence)),
            Err(miss) => match Refusal::of(&slot, miss) {
                Some(refusal) => refusal.error(local),
                // The table governs the limit: ask it.
                None => {
                    let ticket = local.next_ticket();
                    match local.try_now(&slot, ticket, None)? {
                        Acquire::Granted(grant) => {
                            return Ok(Permit::local(local, slot, ticket, grant, None));
                        }
                        Acquire::RetryAt(at) => rate_limited(local, at),
                        Acquire::Queued | Acquire::Finished => TryAcquireError::Busy,
                    }
                }
            },
        };
        slot.metrics().refused.increment(1);
        Err(refused)
    }

    /// A try of a limit another backend holds.
    async fn try_dyn(
        backend: &Arc<dyn LimitBackend>,
        name: &str,
    ) -> Result<Permit, TryAcquireError> {
        let ticket = backend.ticket();
        // Given back unless the answer says what became of the ticket: a grant whose answer
        // was lost (an error), or a try dropped while it asked, would hold a permit nobody
        // releases until its lease ends. (Releasing a ticket that holds nothing does nothing.)
        let mut withdraw =
            Withdraw { backend: backend.clone(), name: Arc::from(name), ticket, armed: true };
        let answer = backend.try_acquire(name, ticket, None).await;
        // A refusal the backend decided (no such limit, a full line) left nothing.
        withdraw.armed = matches!(answer, Err(LimitError::Backend(_)));
        let answer = answer?;
        match answer {
            Answer::Granted(grant) => Ok(Permit::of_ticket(
                Backend::Dyn(backend.clone()),
                withdraw.name.clone(),
                ticket,
                grant,
            )),
            Answer::RetryAfter(after) => Err(TryAcquireError::RateLimited(after)),
            Answer::Queued | Answer::Finished => Err(TryAcquireError::Busy),
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
}

impl Observe for LocalLimits {
    fn report(&self, name: &str, snapshot: &mut Snapshot) {
        snapshot.insert("limits", name, &self.infos());
    }
}

/// A permit of a limit. Returned to the limit when dropped.
#[must_use = "a permit is returned as soon as it is dropped"]
pub struct Permit {
    kind: Kind,
}

enum Kind {
    /// Taken on the in-process fast path: no ticket, no lock.
    Fast { slot: Arc<Slot>, fence: u64 },
    /// Granted to a ticket by the in-process table, with this fencing token (its lease, if it
    /// asked for one, is the table's to keep: an in-process permit is never lost).
    Local { local: Arc<LocalLimits>, slot: Arc<Slot>, ticket: u64, fence: u64 },
    /// Granted to a ticket by another backend (boxed: a remote permit is rare next to the
    /// in-process ones, and inline it made every `Permit` and every acquire's result larger).
    Ticket(Box<TicketPermit>),
}

/// A permit granted to a ticket by another backend.
struct TicketPermit {
    release: Backend,
    name: Arc<str>,
    ticket: u64,
    grant: Grant,
}

/// Why the fast path refused a caller, when that is the answer (nobody waits). Small, so that
/// the fast path's answer stays in registers; [`error`](Self::error) makes the caller's error.
#[derive(Debug, Clone, Copy)]
enum Refusal {
    /// No permit is free.
    Busy,
    /// The bucket has a token at this time (the backend's).
    RateAt(Duration),
}

impl Refusal {
    /// The fast path's miss as the answer, if it is one (nobody waits: no permit is free, or
    /// the bucket is empty); `None` when the table must be asked.
    fn of(slot: &Slot, miss: Miss) -> Option<Self> {
        match miss {
            Miss::Rate(at) if !slot.cell.is_slow() => Some(Self::RateAt(Duration::from_nanos(at))),
            Miss::Slow if !slot.cell.is_slow() => Some(Self::Busy),
            _ => None,
        }
    }

    fn error(self, local: &LocalLimits) -> TryAcquireError {
        match self {
            Self::Busy => TryAcquireError::Busy,
            Self::RateAt(at) => rate_limited(local, at),
        }
    }
}

/// A check of `slot` on the fast path: `None` when the table must answer.
#[inline]
fn check_answer(local: &LocalLimits, slot: &Slot) -> Option<Result<(), Refusal>> {
    match local.check_fast(slot) {
        Ok(()) => {
            slot.metrics().acquired.increment(1);
            Some(Ok(()))
        }
        Err(miss) => {
            let refusal = Refusal::of(slot, miss)?;
            slot.metrics().refused.increment(1);
            Some(Err(refusal))
        }
    }
}

/// [`check_answer`] of the limit called `name`; `None` if it is not defined. Not inlined, so
/// that a handle's check (which needs no lookup) stays small enough to be inlined itself.
#[inline(never)]
fn check_by_name(local: &LocalLimits, name: &str) -> Option<Option<Result<(), Refusal>>> {
    local.with_slot(name, |slot| check_answer(local, slot))
}

/// Refused until the bucket has a token at `at` (the backend's time): the clock is read only
/// on a refusal (the fast path reads its own).
fn rate_limited(local: &LocalLimits, at: Duration) -> TryAcquireError {
    TryAcquireError::RateLimited(local.at(at).saturating_duration_since(Instant::now()))
}

impl Permit {
    fn fast(slot: Arc<Slot>, fence: u64) -> Self {
        Self::fast_waited(slot, fence, None)
    }

    /// A fast permit handed over in the limit's line, after waiting since `waited`.
    ///
    /// Counted with [`Unfast`] standing in for it, which a `metrics` recorder that panics
    /// unwinds through, giving the permit back. (Made first and counted after, as a table's
    /// permit is, it went through the stack and back to the caller: two 8-byte stores read by
    /// 16-byte loads, a store-forwarding stall; the uncontended acquire + release ran at
    /// 27 M/s against 30, pinned.)
    fn fast_waited(slot: Arc<Slot>, fence: u64, waited: Option<tokio::time::Instant>) -> Self {
        let mut unfast = Unfast { slot: &slot, held: false };
        let metrics = slot.metrics();
        metrics.held.increment(1.0);
        unfast.held = true;
        metrics.counted(waited);
        std::mem::forget(unfast);
        Self { kind: Kind::Fast { slot, fence } }
    }

    /// A permit granted by the in-process table, after waiting since `waited` if it waited.
    fn local(
        local: &Arc<LocalLimits>,
        slot: Arc<Slot>,
        ticket: u64,
        grant: Grant,
        waited: Option<tokio::time::Instant>,
    ) -> Self {
        let fence = grant.fencing_token;
        let permit = Self { kind: Kind::Local { local: local.clone(), slot, ticket, fence } };
        if let Kind::Local { slot, .. } = &permit.kind {
            slot.metrics().granted(waited);
        }
        permit
    }

    fn of_ticket(release: Backend, name: Arc<str>, ticket: u64, grant: Grant) -> Self {
        Self { kind: Kind::Ticket(Box::new(TicketPermit { release, name, ticket, grant })) }
    }

    /// The limit this permit belongs to.
    pub fn limit(&self) -> &str {
        match &self.kind {
            Kind::Fast { slot, .. } | Kind::Local { slot, .. } => &slot.name,
            Kind::Ticket(permit) => &permit.name,
        }
    }

    /// The ticket the permit was granted to; 0 for a permit taken in process without the
    /// table (nobody waited, or it waited in its limit's line): it never needed a ticket.
    pub fn ticket(&self) -> u64 {
        match &self.kind {
            Kind::Fast { .. } => 0,
            Kind::Local { ticket, .. } => *ticket,
            Kind::Ticket(permit) => permit.ticket,
        }
    }

    /// Strictly increasing per limit: hand it to a downstream so it can refuse stale holders.
    pub fn fencing_token(&self) -> u64 {
        match &self.kind {
            Kind::Fast { fence, .. } | Kind::Local { fence, .. } => *fence,
            Kind::Ticket(permit) => permit.grant.fencing_token,
        }
    }

    /// Whether this permit is known lost: its lease could not be renewed in time, or the store
    /// (Redis) lost its state. Another holder may have it now; stop the work it guards. A
    /// permit of the in-process backend is never lost.
    pub fn lease_lost(&self) -> bool {
        match &self.kind {
            Kind::Ticket(permit) => match &permit.release {
                Backend::Dyn(backend) => backend.lease_lost(&permit.name, permit.ticket),
                Backend::Local(_) => false,
            },
            _ => false,
        }
    }

    /// Resolves once this permit is known lost (see [`lease_lost`](Self::lease_lost)); never,
    /// for the in-process backend. Select on it beside the work the permit guards.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future changes nothing.
    pub async fn lost(&self) {
        match &self.kind {
            Kind::Ticket(permit) if let Backend::Dyn(backend) = &permit.release => {
                backend.lost(&permit.name, permit.ticket).await;
            }
            _ => std::future::pending().await,
        }
    }
}

/// A fast permit taken and not yet made into a [`Permit`]: gives it back if dropped, which only
/// a panic does (a `metrics` recorder's, as the permit is counted granted), and counts it off
/// `held` if it was counted there.
struct Unfast<'a> {
    slot: &'a Slot,
    held: bool,
}

impl Drop for Unfast<'_> {
    fn drop(&mut self) {
        self.slot.release_fast();
        if self.held {
            count_off(&self.slot.metrics().held);
        }
    }
}

impl Drop for Permit {
    /// Gives the permit back, then counts it: a `metrics` recorder that panics unwinds with
    /// nothing held (and while a panic unwinds, its call is contained).
    fn drop(&mut self) {
        match &self.kind {
            Kind::Fast { slot, .. } => {
                slot.release_fast();
                count_off(&slot.metrics().held);
            }
            Kind::Local { local, slot, ticket, .. } => {
                local.release_slot(slot, *ticket);
                count_off(&slot.metrics().held);
            }
            Kind::Ticket(permit) => {
                let TicketPermit { release, name, ticket, .. } = &**permit;
                match release {
                    Backend::Local(local) => {
                        local.release_now(name, *ticket);
                    }
                    Backend::Dyn(backend) => {
                        // A local permit goes back at once; any other in a task.
                        if !backend.release_local(name, *ticket) {
                            release_in_background(backend.clone(), name.clone(), *ticket);
                        }
                    }
                }
            }
        }
    }
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("limit", &self.limit())
            .field("ticket", &self.ticket())
            .field("fencing_token", &self.fencing_token())
            .finish()
    }
}

/// One limit of a [`Limits`], by name: what a tokio user expects of a semaphore.
///
/// ```
/// use lanes::{LimitSpec, Limits};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let limits = Limits::new();
/// limits.define("db", LimitSpec::concurrent(2)).await?;
/// let db = limits.limit("db");
/// let first = db.acquire().await?;
/// let second = db.try_acquire().await?;
/// assert!(db.try_acquire().await.unwrap_err().is_busy());
/// drop((first, second));
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct Limit {
    limits: Limits,
    name: Arc<str>,
    /// The in-process fast path, looked up once (looked up again if the limit was removed).
    slot: Option<Arc<Slot>>,
}

/// The default priority, borrowed by a handle's waits ([`AcquireFuture`]).
static DEFAULT_PRIORITY: Priority = Priority::DEFAULT;

/// The future of [`Limit::acquire`]: a permit of the limit at the default priority.
///
/// In this process it takes a free permit at once, or waits in the limit's line (or its
/// queue) as [`Limits::acquire`] does. A handle whose limit is not live when the future is
/// first polled (not defined yet, or removed since the handle was made) looks the name up,
/// as [`Limits::acquire`] does, and waits through it if it must; so does a handle on another
/// backend.
///
/// # Cancel safety
///
/// As for [`Limits::acquire`]: dropping the future leaves the line or withdraws its ticket,
/// and a permit handed to it meanwhile goes back to the limit.
#[must_use = "futures do nothing unless polled"]
// One hand-written state machine rather than nested `async fn`s: each layer of `async fn`
// cost a contended acquire about a hundred instructions of moves and dispatch.
pub struct AcquireFuture<'a> {
    limit: &'a Limit,
    state: AcquireState<'a>,
}

enum AcquireState<'a> {
    /// Not polled yet: nothing taken.
    Start,
    /// Waiting in this process; `since` is when, if wait timing is on.
    Local { local: &'a Arc<LocalLimits>, wait: Wait<'a>, since: Option<Instant> },
    /// Any other way: [`Limits::acquire`].
    Other(crate::BoxFuture<'a, Result<Permit, LimitError>>),
    /// Answered.
    Done,
}

impl fmt::Debug for AcquireFuture<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            AcquireState::Start => "start",
            AcquireState::Local { .. } => "waiting",
            AcquireState::Other(_) => "waiting (backend)",
            AcquireState::Done => "done",
        };
        f.debug_struct("AcquireFuture")
            .field("limit", &self.limit.name)
            .field("state", &state)
            .finish()
    }
}

impl Future for AcquireFuture<'_> {
    type Output = Result<Permit, LimitError>;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        loop {
            match &mut this.state {
                AcquireState::Start => {
                    let limit = this.limit;
                    if let (Backend::Local(local), Some(slot)) =
                        (&limit.limits.backend, &limit.slot)
                        && !slot.is_removed()
                    {
                        if let Ok(fence) = local.try_fast(slot) {
                            this.state = AcquireState::Done;
                            return Poll::Ready(Ok(Permit::fast(slot.clone(), fence)));
                        }
                        let since = crate::observe::timing_start();
                        tracing::trace!(limit = %slot.name, "waiting for a permit");
                        let wait = Wait::new(local, slot, &DEFAULT_PRIORITY);
                        this.state = AcquireState::Local { local, wait, since };
                    } else {
                        // Not live: by name, whose fast path allocates nothing (the boxed
                        // future is only for a wait, or another backend).
                        let name = &limit.name;
                        if let Backend::Local(local) = &limit.limits.backend
                            && let Some(slot) = local.slot(name)
                            && let Ok(fence) = local.try_fast(&slot)
                        {
                            this.state = AcquireState::Done;
                            return Poll::Ready(Ok(Permit::fast(slot, fence)));
                        }
                        let acquire = limit.limits.acquire(name, Priority::default());
                        this.state = AcquireState::Other(Box::pin(acquire));
                    }
                }
                AcquireState::Local { local, wait, since } => {
                    let Poll::Ready(granted) = wait.poll(cx) else { return Poll::Pending };
                    let slot = this.limit.slot.clone().expect("a local wait has the handle's slot");
                    let granted = granted.map_err(AcquireError::Limit);
                    // The permit first (see `Limits::waited`); a wait that ended undoes
                    // nothing.
                    let answer = Limits::waited(local, slot, granted, *since);
                    this.state = AcquireState::Done;
                    return Poll::Ready(answer.map_err(|err| match err {
                        AcquireError::Limit(err) => err,
                        AcquireError::Timeout(_) => unreachable!("no deadline, no timeout"),
                    }));
                }
                AcquireState::Other(acquire) => {
                    let done = std::task::ready!(acquire.as_mut().poll(cx));
                    this.state = AcquireState::Done;
                    return Poll::Ready(done);
                }
                AcquireState::Done => panic!("`AcquireFuture` polled after it completed"),
            }
        }
    }
}

impl Limit {
    /// The limit's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Waits for a permit at the default priority. See [`Limits::acquire`].
    ///
    /// # Cancel safety
    ///
    /// As for [`Limits::acquire`].
    ///
    /// # Errors
    ///
    /// As for [`Limits::acquire`].
    pub fn acquire(&self) -> AcquireFuture<'_> {
        AcquireFuture { limit: self, state: AcquireState::Start }
    }

    /// Waits for a permit at `priority`. See [`Limits::acquire`].
    ///
    /// # Cancel safety
    ///
    /// As for [`Limits::acquire`].
    ///
    /// # Errors
    ///
    /// As for [`Limits::acquire`].
    pub async fn acquire_with(&self, priority: Priority) -> Result<Permit, LimitError> {
        match self.limits.acquire_now(&self.name, self.slot.as_ref()) {
            Ok(permit) => Ok(permit),
            Err(missed) => self.limits.acquire_waiting(&self.name, &priority, missed).await,
        }
    }

    /// Waits at most `timeout`. See [`Limits::acquire_timeout`].
    ///
    /// # Cancel safety
    ///
    /// As for [`Limits::acquire`].
    ///
    /// # Errors
    ///
    /// As for [`Limits::acquire_timeout`].
    pub async fn acquire_timeout(&self, timeout: Duration) -> Result<Permit, AcquireError> {
        self.limits.acquire_timeout(&self.name, Priority::default(), timeout).await
    }

    /// Waits until `deadline`. See [`Limits::acquire_until`].
    ///
    /// # Cancel safety
    ///
    /// As for [`Limits::acquire`].
    ///
    /// # Errors
    ///
    /// As for [`Limits::acquire_until`].
    pub async fn acquire_until(&self, deadline: Instant) -> Result<Permit, AcquireError> {
        self.limits.acquire_until(&self.name, Priority::default(), deadline).await
    }

    /// A permit now or an error saying why not (and when to retry, for a rate).
    ///
    /// # Errors
    ///
    /// As for [`Limits::try_acquire`].
    pub async fn try_acquire(&self) -> Result<Permit, TryAcquireError> {
        match &self.limits.backend {
            Backend::Local(local) => Limits::try_local(local, &self.name, self.slot.as_ref()),
            Backend::Dyn(backend) => Limits::try_dyn(backend, &self.name).await,
        }
    }

    /// Spends one token of the limit's rate now, holding nothing. See [`Limits::check`].
    ///
    /// # Errors
    ///
    /// As for [`Limits::try_acquire`].
    pub async fn check(&self) -> Result<(), TryAcquireError> {
        let slot = self.slot.as_ref();
        match self.limits.check_now(&self.name, slot) {
            Some(answer) => answer,
            None => self.limits.try_cached(&self.name, slot).await.map(drop),
        }
    }

    /// The limit's state, `None` if it is not defined.
    ///
    /// # Errors
    ///
    /// A backend failure.
    pub async fn info(&self) -> Result<Option<LimitInfo>, LimitError> {
        self.limits.info(&self.name).await
    }
}

/// Builds [`Limits`]: held in this process (the default) or by a [`LimitBackend`], with a
/// bounded waiting room, reporting in a [`Registry`]; validated at [`build`](Self::build).
#[derive(Default)]
#[must_use]
pub struct LimitsBuilder {
    max_waiters: Option<usize>,
    backend: Option<Arc<dyn LimitBackend>>,
    registry: Option<Registration>,
}

impl fmt::Debug for LimitsBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LimitsBuilder")
            .field("max_waiters", &self.max_waiters)
            .field("backend", &self.backend)
            .field("registry", &self.registry)
            .finish()
    }
}

impl LimitsBuilder {
    /// Up to `max_waiters` waiters per limit held in this process (default
    /// [`LimitTable::DEFAULT_MAX_WAITERS`](super::LimitTable::DEFAULT_MAX_WAITERS)); more get
    /// [`LimitError::TooManyWaiters`]. A backend bounds its own waiting room.
    pub fn max_waiters(mut self, max_waiters: usize) -> Self {
        self.max_waiters = Some(max_waiters);
        self
    }

    /// The limits are held by `backend` (a Redis or remote client) instead of this process.
    pub fn backend(mut self, backend: Arc<dyn LimitBackend>) -> Self {
        self.backend = Some(backend);
        self
    }

    /// Reports every limit in `registry` under `name`. Only limits held in this process can be
    /// snapshotted synchronously; a backend reports through its own service.
    pub fn registry(mut self, registry: &Registry, name: impl Into<String>) -> Self {
        self.registry = Some(Registration::new(registry, name));
        self
    }

    /// Builds the handle.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`]: `max_waiters` zero, or given with a backend
    /// ([`ConfigRule::Unsupported`]); a registry with a backend ([`ConfigRule::Unsupported`]);
    /// a registry name already taken.
    pub fn build(self) -> Result<Limits, ConfigError> {
        if self.max_waiters == Some(0) {
            return Err(ConfigError::new("limits.max_waiters", ConfigRule::Zero));
        }
        if let Some(backend) = self.backend {
            if self.max_waiters.is_some() {
                return Err(ConfigError::new("limits.max_waiters", ConfigRule::Unsupported));
            }
            if self.registry.is_some() {
                return Err(ConfigError::new("limits.registry", ConfigRule::Unsupported));
            }
            return Ok(Limits::from_backend(backend));
        }
        if let Some(registration) = &self.registry {
            registration.check()?;
        }
        let local = Arc::new(match self.max_waiters {
            Some(max) => LocalLimits::with_max_waiters(max),
            None => LocalLimits::new(),
        });
        if let Some(registration) = &self.registry {
            registration.register(&local)?;
        }
        Ok(Limits { backend: Backend::Local(local) })
    }
}
