//! The tower layer for HTTP services (feature `http`): a refusal is answered as an HTTP
//! response instead of an error, so the service's error stays the inner one — `Infallible` for
//! axum, whose `Router::layer` then takes it as it is.

use std::fmt;
use std::task::{Context, Poll};

use tower_layer::Layer;
use tower_service::Service;

use super::layer::{LimitLayer, LimitService, PriorityOf, Refused};
use crate::BoxFuture;

/// [`LimitLayer`] for HTTP services: a request refused under [`WhenBusy::Reject`] (or one
/// that found the waiting room full, or a keyed limit full of keys in use) is answered
/// `429 Too Many Requests` with `Retry-After`, one the limit refuses otherwise (an unknown
/// limit, a backend down) `503 Service Unavailable`; both with a JSON body
/// `{"error", "limit"}`.
///
/// [`WhenBusy::Reject`]: super::WhenBusy::Reject
///
/// # Examples
///
/// Per-tenant fairness in front of an axum handler; at most 8 requests run at once, and a
/// tenant's requests take turns with the others':
///
/// ```
/// use axum::{Router, http::Request, routing::get};
/// use lanes::limit::{LimitLayer, WhenBusy};
/// use lanes::{LimitSpec, Limits, Priority};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lanes::LimitError> {
/// let limits = Limits::new();
/// limits.define("api", LimitSpec::concurrent(8)).await?;
/// let tenant = |req: &Request<axum::body::Body>| {
///     let tenant = req.headers().get("x-tenant").and_then(|v| v.to_str().ok());
///     Priority::default().key(tenant.unwrap_or("anonymous"))
/// };
/// let app: Router = Router::new()
///     .route("/", get(|| async { "hello" }))
///     .layer(LimitLayer::new(&limits, "api").priority(tenant).when_busy(WhenBusy::Wait).http());
/// # drop(app);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct HttpLimitLayer<P> {
    layer: LimitLayer<P>,
}

impl<P> LimitLayer<P> {
    /// The same limit for an HTTP service, answering refusals as responses (see
    /// [`HttpLimitLayer`]).
    pub fn http(self) -> HttpLimitLayer<P> {
        HttpLimitLayer { layer: self }
    }
}

impl<P> fmt::Debug for HttpLimitLayer<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("HttpLimitLayer").field(&self.layer).finish()
    }
}

impl<S, P: Clone> Layer<S> for HttpLimitLayer<P> {
    type Service = HttpLimitService<S, P>;

    fn layer(&self, inner: S) -> Self::Service {
        HttpLimitService { service: self.layer.layer(inner) }
    }
}

/// The service made by [`HttpLimitLayer`].
#[derive(Clone)]
pub struct HttpLimitService<S, P> {
    service: LimitService<S, P>,
}

impl<S, P> fmt::Debug for HttpLimitService<S, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("HttpLimitService").field(&self.service).finish()
    }
}

impl<S, P, B, R> Service<http::Request<B>> for HttpLimitService<S, P>
where
    S: Service<http::Request<B>, Response = http::Response<R>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    P: PriorityOf<http::Request<B>>,
    B: Send + 'static,
    R: From<String> + Send + 'static,
{
    type Response = http::Response<R>;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<http::Response<R>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.service.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let admit = self.service.admit(self.service.priority.priority_of(&req));
        // The ready service goes into the future; a fresh clone stays for the next poll_ready.
        let clone = self.service.inner.clone();
        let mut inner = std::mem::replace(&mut self.service.inner, clone);
        Box::pin(async move {
            match admit.await {
                Ok(permit) => {
                    let response = inner.call(req).await;
                    drop(permit);
                    response
                }
                Err(refused) => Ok(refusal(&refused)),
            }
        })
    }
}

/// The response a refusal stands for.
fn refusal<R: From<String>>(refused: &Refused) -> http::Response<R> {
    let (status, error, limit, retry_after) = match refused {
        Refused::Overloaded(overloaded) => (
            http::StatusCode::TOO_MANY_REQUESTS,
            overloaded.to_string(),
            Some(overloaded.limit().to_owned()),
            // Whole seconds, at least 1.
            Some(
                overloaded.retry_after().map_or(1, |after| after.as_millis().div_ceil(1000).max(1)),
            ),
        ),
        Refused::Limit(err) => (http::StatusCode::SERVICE_UNAVAILABLE, err.to_string(), None, None),
    };
    let body = serde_json::json!({ "error": error, "limit": limit }).to_string();
    let mut response = http::Response::new(R::from(body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
    if let Some(seconds) = retry_after {
        headers.insert(http::header::RETRY_AFTER, http::HeaderValue::from(seconds as u64));
    }
    response
}
