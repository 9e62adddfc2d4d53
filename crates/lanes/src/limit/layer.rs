//! A tower [`Layer`] that puts a limit in front of any [`Service`] (feature `tower`).

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use tower_layer::Layer;
use tower_service::Service;

use super::error::TryAcquireError;
use super::handle::{Limits, Permit};
use super::keyed::{KeyedLimit, KeyedPermit};
use super::priority::Priority;
use crate::{BoxError, BoxFuture};

/// What a [`LimitService`] does when no permit is free.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WhenBusy {
    /// Wait in the limit's fair queue (the default).
    #[default]
    Wait,
    /// Fail the request at once with [`Overloaded`].
    Reject,
}

/// Takes a permit of a limit for every request, at a priority extracted from the request, and
/// holds it until the response is ready.
///
/// The limit is a named limit of a [`Limits`] ([`new`](LimitLayer::new)), or a
/// [`KeyedLimit`] ([`keyed`](LimitLayer::keyed)): then the priority's fairness key picks the
/// request's key (a client address, a tenant), so each key has a limit of its own — the
/// per-client rate limiting of `tower_governor`, with waiting and memory that follows the
/// keys in use.
///
/// # Examples
///
/// ```
/// use lanes::limit::{LimitLayer, WhenBusy};
/// use lanes::{Limits, Priority};
///
/// let limits = Limits::new();
/// let layer = LimitLayer::new(&limits, "backend")
///     .priority(|req: &String| Priority::default().key(req.clone()))
///     .when_busy(WhenBusy::Reject);
/// # let _ = layer;
/// ```
pub struct LimitLayer<P = DefaultPriority> {
    target: Target,
    priority: P,
    when_busy: WhenBusy,
}

/// The limit a [`LimitLayer`] takes its permits of.
#[derive(Clone)]
enum Target {
    Named { limits: Limits, name: Arc<str> },
    Keyed(KeyedLimit),
}

impl Target {
    fn name(&self) -> &str {
        match self {
            Self::Named { name, .. } => name,
            Self::Keyed(keyed) => keyed.name(),
        }
    }
}

/// What a request holds while it runs: kept only to be dropped with the response.
#[allow(dead_code, reason = "held for its drop, which returns the permit")]
pub(super) enum Held {
    Named(Permit),
    Keyed(KeyedPermit),
}

/// Every request at the default priority.
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultPriority;

/// How a [`LimitService`] orders a request.
pub trait PriorityOf<Req> {
    /// The request's priority.
    fn priority_of(&self, req: &Req) -> Priority;
}

impl<Req> PriorityOf<Req> for DefaultPriority {
    fn priority_of(&self, _req: &Req) -> Priority {
        Priority::default()
    }
}

impl<Req, F: Fn(&Req) -> Priority> PriorityOf<Req> for F {
    fn priority_of(&self, req: &Req) -> Priority {
        self(req)
    }
}

impl LimitLayer {
    /// Limits requests with limit `name` of `limits`, waiting at the default priority.
    pub fn new(limits: &Limits, name: impl Into<Arc<str>>) -> Self {
        Self {
            target: Target::Named { limits: limits.clone(), name: name.into() },
            priority: DefaultPriority,
            when_busy: WhenBusy::Wait,
        }
    }

    /// Limits requests with `keyed`, a key per request: the fairness key of the priority
    /// [`priority`](LimitLayer::priority) extracts (requests without one share the empty key
    /// `""`). Levels and weights do not apply: each key is served in arrival order.
    ///
    /// ```
    /// use axum::{Router, http::Request, routing::get};
    /// use lanes::limit::{KeyedLimit, LimitLayer, WhenBusy};
    /// use lanes::{LimitSpec, Priority};
    ///
    /// // Each client address: 10 requests a second, a burst of 20; past it, 429 with Retry-After.
    /// let per_client: KeyedLimit = KeyedLimit::new("per-client", LimitSpec::rate(10.0).burst(20))?;
    /// let client = |req: &Request<axum::body::Body>| {
    ///     let addr = req.headers().get("x-forwarded-for").and_then(|v| v.to_str().ok());
    ///     Priority::default().key(addr.unwrap_or("unknown"))
    /// };
    /// let app: Router = Router::new()
    ///     .route("/", get(|| async { "hello" }))
    ///     .layer(LimitLayer::keyed(&per_client).priority(client).when_busy(WhenBusy::Reject).http());
    /// # drop(app);
    /// # Ok::<(), lanes::ConfigError>(())
    /// ```
    pub fn keyed(keyed: &KeyedLimit) -> Self {
        Self {
            target: Target::Keyed(keyed.clone()),
            priority: DefaultPriority,
            when_busy: WhenBusy::Wait,
        }
    }
}

impl<P> LimitLayer<P> {
    /// Orders requests by `priority(&request)`.
    pub fn priority<Q>(self, priority: Q) -> LimitLayer<Q> {
        LimitLayer { target: self.target, priority, when_busy: self.when_busy }
    }

    /// What to do when no permit is free.
    #[must_use]
    pub fn when_busy(mut self, when_busy: WhenBusy) -> Self {
        self.when_busy = when_busy;
        self
    }
}

impl<P: Clone> Clone for LimitLayer<P> {
    fn clone(&self) -> Self {
        Self {
            target: self.target.clone(),
            priority: self.priority.clone(),
            when_busy: self.when_busy,
        }
    }
}

impl<P> fmt::Debug for LimitLayer<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LimitLayer")
            .field("limit", &self.target.name())
            .field("keyed", &matches!(self.target, Target::Keyed(_)))
            .field("when_busy", &self.when_busy)
            .finish_non_exhaustive()
    }
}

impl<S, P: Clone> Layer<S> for LimitLayer<P> {
    type Service = LimitService<S, P>;

    fn layer(&self, inner: S) -> Self::Service {
        LimitService {
            inner,
            target: self.target.clone(),
            priority: self.priority.clone(),
            when_busy: self.when_busy,
        }
    }
}

/// The service made by [`LimitLayer`]. Its errors are boxed: the inner service's, a
/// [`LimitError`](super::LimitError), or [`Overloaded`].
pub struct LimitService<S, P = DefaultPriority> {
    pub(super) inner: S,
    target: Target,
    pub(super) priority: P,
    when_busy: WhenBusy,
}

/// Why a request got no permit.
pub(super) enum Refused {
    /// No free permit under [`WhenBusy::Reject`], a full waiting room, a keyed limit full of
    /// keys.
    Overloaded(Overloaded),
    /// The limit refused otherwise (unknown limit, invalid spec, backend failure).
    Limit(super::LimitError),
}

impl From<Refused> for BoxError {
    fn from(refused: Refused) -> Self {
        match refused {
            Refused::Overloaded(overloaded) => overloaded.into(),
            Refused::Limit(err) => err.into(),
        }
    }
}

impl<S, P> LimitService<S, P> {
    /// Takes this request's permit, as the service's [`WhenBusy`] says; the future owns what
    /// it needs.
    pub(super) fn admit(
        &self,
        priority: Priority,
    ) -> impl std::future::Future<Output = Result<Held, Refused>> + Send + 'static {
        let (target, when_busy) = (self.target.clone(), self.when_busy);
        async move {
            let key =
                |priority: &Priority| priority.fairness_key.as_deref().unwrap_or("").to_owned();
            let answer = match (&target, when_busy) {
                (Target::Named { limits, name }, WhenBusy::Wait) => {
                    limits.acquire(name, priority).await.map(Held::Named).map_err(Into::into)
                }
                (Target::Keyed(keyed), WhenBusy::Wait) => {
                    keyed.acquire(&key(&priority)).await.map(Held::Keyed).map_err(Into::into)
                }
                (Target::Named { limits, name }, WhenBusy::Reject) => {
                    limits.try_acquire(name, priority).await.map(Held::Named)
                }
                (Target::Keyed(keyed), WhenBusy::Reject) => {
                    keyed.try_acquire(&key(&priority)).map(Held::Keyed)
                }
            };
            answer.map_err(|err| {
                let limit = Arc::from(target.name());
                match err {
                    // A full waiting room, or a keyed limit full of keys in use: overload,
                    // as a busy limit is.
                    TryAcquireError::Limit(err)
                        if err.is_too_many_waiters() || err.is_too_many_keys() =>
                    {
                        Refused::Overloaded(Overloaded { limit, retry_after: None })
                    }
                    TryAcquireError::Limit(err) => Refused::Limit(err),
                    TryAcquireError::RateLimited(after) => {
                        Refused::Overloaded(Overloaded { limit, retry_after: Some(after) })
                    }
                    TryAcquireError::Busy => {
                        Refused::Overloaded(Overloaded { limit, retry_after: None })
                    }
                }
            })
        }
    }
}

impl<S: Clone, P: Clone> Clone for LimitService<S, P> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            target: self.target.clone(),
            priority: self.priority.clone(),
            when_busy: self.when_busy,
        }
    }
}

impl<S, P> fmt::Debug for LimitService<S, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LimitService")
            .field("limit", &self.target.name())
            .field("when_busy", &self.when_busy)
            .finish_non_exhaustive()
    }
}

impl<S, P, Req> Service<Req> for LimitService<S, P>
where
    S: Service<Req> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    P: PriorityOf<Req>,
    Req: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<S::Response, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let admit = self.admit(self.priority.priority_of(&req));
        // The ready service goes into the future; a fresh clone stays for the next poll_ready.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            let permit = admit.await?;
            let response = inner.call(req).await.map_err(Into::into);
            drop(permit);
            response
        })
    }
}

/// A [`LimitService`] set to [`WhenBusy::Reject`] found no free permit; or, in either mode,
/// the limit's waiting room was full, or a keyed limit kept its maximum of keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overloaded {
    limit: Arc<str>,
    retry_after: Option<std::time::Duration>,
}

impl Overloaded {
    /// The limit that had no free permit.
    pub fn limit(&self) -> &str {
        &self.limit
    }

    /// For a rate limit with an empty bucket: when it has a token again (`None`: every permit
    /// is held; try after a release).
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        self.retry_after
    }
}

impl fmt::Display for Overloaded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "limit {:?} has no free permit", self.limit)
    }
}

impl std::error::Error for Overloaded {}
