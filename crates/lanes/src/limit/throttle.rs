//! The one glue between a limit and the primitives that run work under it: a run lane's run, a
//! pool's item and a channel consumer's batch each take their permits through a [`Throttle`].

use std::sync::Arc;
use std::time::Duration;

use super::error::LimitError;
use super::error::TryAcquireError;
use super::handle::{Limits, Permit};
use super::priority::Priority;

/// What work does when its limit refuses it (an unknown limit, too many waiters, a backend
/// failure). Waiting for a busy limit is never a refusal: that is what the throttle is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnRefusal {
    /// The work fails with the limit's error as its cause: a run fails at the queue stage with
    /// [`Reason::Limit`](crate::Reason::Limit), a pool's item counts as failed and reaches the
    /// pool's `on_error`. The default for run lanes and pools.
    Fail,
    /// The work keeps its place and asks again after a backoff that doubles from `first` up to
    /// `max`, for as long as it is not cancelled (a run's queue timeout, close or dropped
    /// handle still end it). The only policy of channel consumers, whose records must not be
    /// lost to a refusal.
    Retry {
        /// The first pause.
        first: Duration,
        /// The longest pause.
        max: Duration,
    },
}

impl OnRefusal {
    /// `Retry` from 100 ms up to 5 s.
    pub const RETRY: Self =
        Self::Retry { first: Duration::from_millis(100), max: Duration::from_secs(5) };
}

/// A limit that work takes a permit of before it runs: the limit's name, the priority the work
/// waits at, and what it does on a refusal ([`OnRefusal`]).
///
/// A run waiting for its permit holds no execution slot (the *fusee rule*), and a consumer's
/// batch takes no records out of the channel before its permits; a pool's item waits in the
/// worker that took it (a pool's workers are its concurrency, and per-key order needs the item
/// in hand).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use lanes::limit::{OnRefusal, Throttle};
/// use lanes::{LaneLimits, LaneSet, LimitSpec, Limits, Priority, Run};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let limits = Limits::new();
/// limits.define("payments-api", LimitSpec::concurrent(4)).await?;
/// let throttle = Throttle::new(&limits, "payments-api", Priority::default())
///     .on_refusal(OnRefusal::RETRY);
///
/// let lanes = LaneSet::builder()
///     .lane("charges", LaneLimits::new(8, 100))
///     .audit_timeout(Duration::from_secs(1))
///     .finalization_timeout(Duration::from_secs(1))
///     .worker_drain_timeout(Duration::from_secs(1))
///     .build()?;
/// let charged = lanes
///     .run("charges", Run::typed(|_| async { Ok::<_, std::io::Error>("ok") }).throttle(throttle))?
///     .await?;
/// assert_eq!(charged, "ok");
/// # Ok(())
/// # }
/// ```
/// Cheap to clone (one `Arc`), and one pointer wide in what carries it.
#[derive(Debug, Clone)]
pub struct Throttle {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    limits: Limits,
    name: Arc<str>,
    priority: Priority,
    on_refusal: OnRefusal,
}

impl Throttle {
    /// Permits of limit `name` of `limits`, waited for at `priority`; refusals fail the work
    /// ([`OnRefusal::Fail`]).
    pub fn new(limits: &Limits, name: impl Into<Arc<str>>, priority: Priority) -> Self {
        let (limits, name) = (limits.clone(), name.into());
        Self { inner: Arc::new(Inner { limits, name, priority, on_refusal: OnRefusal::Fail }) }
    }

    /// Sets what the work does on a refusal.
    #[must_use]
    pub fn on_refusal(self, on_refusal: OnRefusal) -> Self {
        let Inner { limits, name, priority, .. } = &*self.inner;
        let (limits, name, priority) = (limits.clone(), name.clone(), priority.clone());
        Self { inner: Arc::new(Inner { limits, name, priority, on_refusal }) }
    }

    /// The limit's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The policy on a refusal.
    pub fn refusal_policy(&self) -> OnRefusal {
        self.inner.on_refusal
    }

    /// Waits for one permit, applying the refusal policy.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, like [`Limits::acquire`].
    ///
    /// # Errors
    ///
    /// The limit's refusal, under [`OnRefusal::Fail`] only.
    pub async fn acquire(&self) -> Result<Permit, LimitError> {
        self.with_policy(|| self.acquire_once()).await
    }

    /// Waits for one permit, then takes up to `want - 1` more that are free right now (a batch
    /// that may run with fewer), applying the refusal policy.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: permits taken so far are returned if the future is dropped.
    ///
    /// # Errors
    ///
    /// As for [`acquire`](Self::acquire).
    pub async fn acquire_up_to(&self, want: usize) -> Result<Vec<Permit>, LimitError> {
        self.with_policy(|| self.acquire_up_to_once(want)).await
    }

    /// One attempt at [`acquire`](Self::acquire), whatever the policy.
    pub(crate) async fn acquire_once(&self) -> Result<Permit, LimitError> {
        let Inner { limits, name, priority, .. } = &*self.inner;
        limits.acquire(name, priority.clone()).await
    }

    /// One attempt at [`acquire_up_to`](Self::acquire_up_to), whatever the policy.
    pub(crate) async fn acquire_up_to_once(&self, want: usize) -> Result<Vec<Permit>, LimitError> {
        let mut permits = vec![self.acquire_once().await?];
        while permits.len() < want {
            let Inner { limits, name, priority, .. } = &*self.inner;
            match limits.try_acquire(name, priority.clone()).await {
                Ok(permit) => permits.push(permit),
                Err(TryAcquireError::Limit(err)) => return Err(err),
                Err(_) => break,
            }
        }
        Ok(permits)
    }

    async fn with_policy<T, F, Fut>(&self, attempt: F) -> Result<T, LimitError>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<T, LimitError>>,
    {
        let mut pause = match self.inner.on_refusal {
            OnRefusal::Fail => return attempt().await,
            OnRefusal::Retry { first, .. } => first,
        };
        loop {
            if let Ok(answer) = attempt().await {
                return Ok(answer);
            }
            tokio::time::sleep(pause).await;
            if let OnRefusal::Retry { max, .. } = self.inner.on_refusal {
                pause = (pause * 2).min(max);
            }
        }
    }
}
