//! The HTTP API's bodies and handlers.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use lanes::channel::Emitted;
use lanes::{Answer, LimitInfo, LimitSpec, Priority};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::time::Instant;

use super::App;
use super::error::{ApiError, JsonBody};

/// The longest a limit name may be.
const MAX_NAME: usize = 200;
/// The longest a client id may be.
const MAX_CLIENT: usize = 200;
/// Lease bounds.
const MIN_LEASE: Duration = Duration::from_millis(100);
const MAX_LEASE: Duration = Duration::from_secs(600);

pub(crate) fn check_name(name: &str) -> Result<(), ApiError> {
    if name.is_empty() || name.len() > MAX_NAME || name.chars().any(char::is_control) {
        return Err(ApiError::field(
            "name",
            format!("a limit name is 1 to {MAX_NAME} bytes without control characters"),
        ));
    }
    Ok(())
}

fn check_client(client: &str) -> Result<(), ApiError> {
    if client.is_empty() || client.len() > MAX_CLIENT || client.chars().any(char::is_control) {
        return Err(ApiError::field(
            "client",
            format!("a client id is 1 to {MAX_CLIENT} bytes without control characters"),
        ));
    }
    Ok(())
}

/// `PUT /v1/limits/{name}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SpecBody {
    concurrent: u32,
    #[serde(default)]
    per_second: Option<f64>,
    #[serde(default)]
    burst: Option<u32>,
}

impl SpecBody {
    pub(crate) fn spec(&self) -> LimitSpec {
        let mut spec = LimitSpec::concurrent(self.concurrent);
        if let Some(rate) = self.per_second {
            spec = spec.per_second(rate);
        }
        if let Some(burst) = self.burst {
            spec = spec.burst(burst);
        }
        spec
    }
}

/// A limit as the API reports it.
#[derive(Debug, Serialize)]
pub(crate) struct LimitBody {
    name: String,
    concurrent: u32,
    per_second: Option<f64>,
    burst: u32,
    in_use: u32,
    waiting: usize,
    max_in_use: u32,
    granted_total: u64,
}

impl From<LimitInfo> for LimitBody {
    fn from(info: LimitInfo) -> Self {
        Self {
            name: info.name,
            concurrent: info.spec.concurrent,
            per_second: info.spec.per_second,
            burst: info.spec.burst,
            in_use: info.in_use,
            waiting: info.waiting,
            max_in_use: info.max_in_use,
            granted_total: info.granted_total,
        }
    }
}

pub(crate) async fn define(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
    JsonBody(body): JsonBody<SpecBody>,
) -> Result<Response, ApiError> {
    check_name(&name)?;
    let spec = body.spec();
    spec.validate().map_err(|e| ApiError::field(e.field(), e.to_string()))?;
    app.backend.define(&name, spec).await.map_err(|e| ApiError::limit(&name, &e))?;
    let info = app.backend.info(&name).await.map_err(|e| ApiError::limit(&name, &e))?;
    Ok(Json(info.map(LimitBody::from)).into_response())
}

pub(crate) async fn list(State(app): State<Arc<App>>) -> Result<Response, ApiError> {
    let infos = app.backend.list().await.map_err(|e| ApiError::limit("*", &e))?;
    let limits: Vec<LimitBody> = infos.into_iter().map(LimitBody::from).collect();
    Ok(Json(json!({ "limits": limits })).into_response())
}

pub(crate) async fn get(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    check_name(&name)?;
    match app.backend.info(&name).await.map_err(|e| ApiError::limit(&name, &e))? {
        Some(info) => Ok(Json(LimitBody::from(info)).into_response()),
        None => Err(ApiError::limit(&name, &lanes::LimitError::UnknownLimit(name.clone()))),
    }
}

pub(crate) async fn remove(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    check_name(&name)?;
    app.backend.remove(&name).await.map_err(|e| ApiError::limit(&name, &e))?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// A waiter's priority.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PriorityBody {
    #[serde(default)]
    level: i32,
    #[serde(default)]
    key: Option<String>,
    #[serde(default = "one")]
    weight: u32,
}

fn one() -> u32 {
    1
}

/// `POST /v1/limits/{name}/acquire`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AcquireBody {
    client: String,
    #[serde(default)]
    ticket: Option<u64>,
    #[serde(default)]
    priority: Option<PriorityBody>,
    #[serde(default)]
    lease_ms: Option<u64>,
    #[serde(default)]
    wait_ms: Option<u64>,
}

/// Ends a request of a client in its session, however the handler ends (a dropped long-poll
/// included).
struct InFlight {
    app: Arc<App>,
    client: String,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.app.sessions().end(&self.client, Instant::now());
    }
}

pub(crate) async fn acquire(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
    JsonBody(body): JsonBody<AcquireBody>,
) -> Result<Response, ApiError> {
    check_name(&name)?;
    check_client(&body.client)?;
    let lease = Duration::from_millis(body.lease_ms.unwrap_or(app.options.default_lease_ms));
    if !(MIN_LEASE..=MAX_LEASE).contains(&lease) {
        return Err(ApiError::field(
            "lease_ms",
            format!("a lease is {} to {} ms", MIN_LEASE.as_millis(), MAX_LEASE.as_millis()),
        ));
    }
    let priority = match &body.priority {
        None => Priority::default(),
        Some(p) => {
            if p.key.as_ref().is_some_and(|k| k.len() > MAX_NAME) {
                return Err(ApiError::field("priority.key", "a fairness key is at most 200 bytes"));
            }
            if p.weight == 0 {
                return Err(ApiError::field("priority.weight", "a weight is at least 1"));
            }
            let mut priority = Priority::level(p.level).weight(p.weight);
            if let Some(key) = &p.key {
                priority = priority.key(key.as_str());
            }
            priority
        }
    };
    // Long-polls are bounded by the server's maximum.
    let wait = Duration::from_millis(body.wait_ms.unwrap_or(0)).min(app.options.max_wait);
    let now = Instant::now();
    let (ticket, backend_ticket) = {
        let backend = app.backend.clone();
        app.sessions().begin(&body.client, &name, body.ticket, lease, now, || backend.ticket())
    };
    let _in_flight = InFlight { app: app.clone(), client: body.client.clone() };
    let deadline = now + wait;
    let mut shutdown = app.shutdown.clone();
    loop {
        let answer = match app.backend.acquire(&name, backend_ticket, &priority).await {
            Ok(answer) => answer,
            Err(err) => {
                app.sessions().forget(&body.client, &name, ticket);
                return Err(ApiError::limit(&name, &err));
            }
        };
        let retry = match answer {
            Answer::Granted(grant) => {
                let now = Instant::now();
                let expires = app.sessions().granted(&body.client, &name, ticket, lease, now);
                app.event("granted");
                return Ok(Json(json!({
                    "granted": true,
                    "ticket": ticket,
                    "fencing_token": grant.fencing_token,
                    "lease_expires_in_ms": expires.saturating_duration_since(now).as_millis() as u64,
                }))
                .into_response());
            }
            Answer::Queued => None,
            Answer::RetryAfter(after) => Some(after),
        };
        let now = Instant::now();
        if now >= deadline || *shutdown.borrow() {
            app.event("queued");
            let (reason, retry_after) = match retry {
                Some(after) => ("rate", after),
                None => ("queued", app.options.reask.min(wait.max(Duration::from_millis(100)))),
            };
            return Ok((
                StatusCode::ACCEPTED,
                Json(json!({
                    "granted": false,
                    "ticket": ticket,
                    "retry_after_ms": retry_after.as_millis() as u64,
                    "reason": reason,
                })),
            )
                .into_response());
        }
        let nap = (deadline - now).min(retry.unwrap_or(app.options.reask));
        tokio::select! {
            () = app.backend.wait(&name, backend_ticket, nap) => {}
            _ = shutdown.changed() => {}
        }
    }
}

/// `POST /v1/limits/{name}/release`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ReleaseBody {
    client: String,
    ticket: u64,
}

pub(crate) async fn release(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
    JsonBody(body): JsonBody<ReleaseBody>,
) -> Result<Response, ApiError> {
    check_name(&name)?;
    check_client(&body.client)?;
    let known = app.sessions().forget(&body.client, &name, body.ticket);
    if let Some(backend_ticket) = known {
        app.backend.release(&name, backend_ticket).await.map_err(|e| ApiError::limit(&name, &e))?;
        app.event("released");
    }
    Ok(Json(json!({ "released": known.is_some() })).into_response())
}

pub(crate) async fn renew(
    State(app): State<Arc<App>>,
    Path(client): Path<String>,
) -> Result<Response, ApiError> {
    check_client(&client)?;
    match app.sessions().renew(&client, Instant::now()) {
        Some(renewed) => Ok(Json(json!({ "renewed": renewed })).into_response()),
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("unknown client {client:?} (never seen, or its session lapsed)"),
        )),
    }
}

pub(crate) async fn snapshot(State(app): State<Arc<App>>) -> Result<Response, ApiError> {
    let mut snapshot = app.registry.snapshot();
    let limits = app.backend.list().await.map_err(|e| ApiError::limit("*", &e))?;
    snapshot.limits.insert("server".to_owned(), limits);
    let mut value = serde_json::to_value(&snapshot)
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("snapshot: {e}")))?;
    value["server"] = json!({
        "clients": app.sessions().clients(),
        "backend": app.options.backend_name(),
    });
    Ok(Json(value).into_response())
}

pub(crate) async fn metrics(State(app): State<Arc<App>>) -> Response {
    if let Ok(infos) = app.backend.list().await {
        for info in infos {
            let labels = [("limit", info.name.clone())];
            metrics::gauge!("lanes_limit_in_use", &labels).set(f64::from(info.in_use));
            metrics::gauge!("lanes_limit_waiting", &labels).set(info.waiting as f64);
            metrics::gauge!("lanes_limit_concurrent", &labels).set(f64::from(info.spec.concurrent));
            metrics::gauge!("lanes_limit_max_in_use", &labels).set(f64::from(info.max_in_use));
            metrics::counter!("lanes_limit_granted_total", &labels).absolute(info.granted_total);
        }
    }
    metrics::gauge!("lanes_server_clients").set(app.sessions().clients() as f64);
    let body = app.prometheus.render();
    ([("content-type", "text/plain; version=0.0.4")], body).into_response()
}

pub(crate) async fn openapi() -> Response {
    ([("content-type", "application/json")], super::OPENAPI).into_response()
}

pub(crate) async fn dashboard() -> Response {
    ([("content-type", "text/html; charset=utf-8")], super::DASHBOARD).into_response()
}

pub(crate) async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "no such endpoint")
}

impl App {
    /// Records an API event on the server's events channel (dropped when it is full).
    pub(crate) fn event(&self, kind: &'static str) {
        // A full channel drops its oldest event: counting may lag, never block the API.
        let _: Result<Emitted<_>, _> = self.events.try_emit(kind);
    }
}
