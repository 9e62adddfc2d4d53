//! The HTTP API's bodies and handlers.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::{Extension, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use lanes::channel::Emitted;
use lanes::limit::share::SharePolicy;
use lanes::limit::{Released, ShareReply};
use lanes::{Answer, Priority};
use lanes_remote::wire::{self, MAX_CLIENT, MAX_NAME, Reason};
use serde::Serialize;
use tokio::time::Instant;

use super::App;
use super::auth::Principal;
use super::error::{ApiError, JsonBody};
use super::openapi::{Health, Ready, ServerInfo, SnapshotAnswer};
use super::sessions::{Begun, Refused};

/// The shortest lease.
const MIN_LEASE: Duration = Duration::from_millis(100);

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

/// Define or redefine a limit (never revokes held permits).
#[utoipa::path(put, path = "/v1/limits/{name}", tag = "limits", params(("name" = String, Path, description = "The limit's name (1 to 200 bytes, no control characters).")),
    request_body = wire::Spec,
    responses(
        (status = 200, description = "The limit as defined.", body = wire::Limit),
        (status = 400, description = "A field out of range (`field` names it).", body = wire::ErrorBody),
        (status = 429, description = "A new limit past `--max-limits` (`too_many_limits`); `Retry-After` 1.", body = wire::ErrorBody),
        (status = 503, description = "The backend (Redis) does not answer.", body = wire::ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn define(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
    JsonBody(body): JsonBody<wire::Spec>,
) -> Result<Response, ApiError> {
    check_name(&name)?;
    let spec = body.to_spec();
    spec.validate().map_err(|e| ApiError::field(e.field(), e.to_string()))?;
    let policy = match body.policy.as_deref() {
        None => SharePolicy::default(),
        Some(name) => SharePolicy::from_name(name)
            .ok_or_else(|| ApiError::field("policy", "a policy is max_min_fair or proportional"))?,
    };
    match body.mode.as_deref() {
        None | Some("exact") => {
            if body.policy.is_some() {
                return Err(ApiError::field("policy", "a policy is for a leased limit"));
            }
            app.backend.define(&name, spec).await
        }
        Some("leased") if app.options.redis.is_none() => {
            return Err(ApiError::field(
                "mode",
                "leased mode needs a server on Redis (--redis): the embedded backend does not \
                 lease capacity",
            ));
        }
        Some("leased") => app.backend.define_leased(&name, spec, policy).await,
        Some(_) => return Err(ApiError::field("mode", "a mode is exact or leased")),
    }
    .map_err(|e| ApiError::limit(&name, &e))?;
    let info = app.backend.info(&name).await.map_err(|e| ApiError::limit(&name, &e))?;
    Ok(Json(info.map(wire::Limit::from)).into_response())
}

/// List the limits.
#[utoipa::path(get, path = "/v1/limits", tag = "limits",
    responses(
        (status = 200, description = "Every limit, in name order.", body = wire::LimitList),
        (status = 503, description = "The backend (Redis) does not answer.", body = wire::ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn list(State(app): State<Arc<App>>) -> Result<Response, ApiError> {
    let infos = app.backend.list().await.map_err(|e| ApiError::limit("*", &e))?;
    let limits = infos.into_iter().map(wire::Limit::from).collect();
    Ok(Json(wire::LimitList { limits }).into_response())
}

/// One limit.
#[utoipa::path(get, path = "/v1/limits/{name}", tag = "limits", params(("name" = String, Path, description = "The limit's name (1 to 200 bytes, no control characters).")),
    responses(
        (status = 200, description = "The limit.", body = wire::Limit),
        (status = 400, description = "A bad name.", body = wire::ErrorBody),
        (status = 404, description = "No such limit.", body = wire::ErrorBody),
        (status = 503, description = "The backend (Redis) does not answer.", body = wire::ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn get(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    check_name(&name)?;
    match app.backend.info(&name).await.map_err(|e| ApiError::limit(&name, &e))? {
        Some(info) => Ok(Json(wire::Limit::from(info)).into_response()),
        None => Err(unknown(&name)),
    }
}

/// Remove a limit.
#[utoipa::path(delete, path = "/v1/limits/{name}", tag = "limits", params(("name" = String, Path, description = "The limit's name (1 to 200 bytes, no control characters).")),
    responses(
        (status = 204, description = "Removed."),
        (status = 400, description = "A bad name.", body = wire::ErrorBody),
        (status = 404, description = "No such limit.", body = wire::ErrorBody),
        (status = 409, description = "Permits are held.", body = wire::ErrorBody),
        (status = 503, description = "The backend (Redis) does not answer.", body = wire::ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn remove(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    check_name(&name)?;
    app.backend.remove(&name).await.map_err(|e| ApiError::limit(&name, &e))?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// The answer for limit `name`, which does not exist (404).
fn unknown(name: &str) -> ApiError {
    ApiError::limit(name, &lanes::LimitError::UnknownLimit(name.to_owned()))
}

/// Ends a request of a client in its session, however the handler ends (a dropped long-poll
/// included).
struct InFlight {
    app: Arc<App>,
    client: String,
    limit: String,
    begun: Begun,
    /// The request saw its first ask back (`Sessions::first_asked`), or made none.
    asked: bool,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        // A request that made a ticket and went away before its first ask was back (its
        // client disconnected): if the ticket was released meanwhile, the backend ticket the
        // ask may have queued has no record, and goes back here (invariant 4 of `sessions`).
        let gone = self.begun.fresh
            && !self.asked
            && !self.app.sessions().first_asked(&self.limit, self.begun);
        self.app.sessions().end(&self.client, &self.limit, self.begun, Instant::now());
        if gone && let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (app, limit, backend) = (self.app.clone(), self.limit.clone(), self.begun.backend);
            runtime.spawn(async move {
                let _ = app.backend.release(&limit, backend).await;
            });
        }
    }
}

/// The error a session's refusal stands for.
fn refusal(limit: &str, refused: Refused) -> ApiError {
    match refused {
        Refused::NotYours(ticket) => ApiError::not_yours(limit, ticket),
        Refused::Finished(ticket) => ApiError::finished(limit, ticket),
        Refused::TooManyClients(max) => ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            format!("this server keeps at most {max} clients (--max-clients)"),
        )
        .code("too_many_clients"),
    }
}

/// A not-granted answer with its `Retry-After` header (whole seconds) beside the JSON
/// `retry_after_ms`. A 429's rounds up (at least 1: nothing is waiting for the client); a
/// 202's rounds down, so that a client that comes back when told is back within the queue
/// grace (`come_back`), which a whole second may pass.
fn not_yet(status: StatusCode, body: impl Serialize, retry_after: Duration) -> Response {
    let millis = retry_after.as_millis();
    let seconds = match status {
        StatusCode::ACCEPTED => millis / 1000,
        _ => millis.div_ceil(1000).max(1),
    };
    (status, [("retry-after", seconds.to_string())], Json(body)).into_response()
}

/// Ask for a permit (long-poll up to `wait_ms`).
///
/// The first ask with a ticket queues it (with the priority of that ask); asking again with the
/// same client and ticket only looks (long-polling up to `wait_ms`) and never queues it again:
/// a granted ticket answers 200 with the same fencing token, a finished one (released,
/// withdrawn, lease ended) 410, for the longest lease after it finished (a number is used once;
/// a refused try or a first ask the backend failed leaves it free). A ticket belongs to the client that created it: another client
/// naming it gets 409. With `"queue": false` the ask is a try: granted at once or 429, leaving
/// no ticket behind. 202 and 429 carry a `Retry-After` header (seconds).
#[utoipa::path(post, path = "/v1/limits/{name}/acquire", tag = "permits", params(("name" = String, Path, description = "The limit's name (1 to 200 bytes, no control characters).")),
    request_body = wire::AcquireRequest,
    responses(
        (status = 200, description = "Granted.", body = wire::Granted),
        (status = 202, description = "Not granted within `wait_ms`; the ticket stays queued.", body = wire::NotYet),
        (status = 400, description = "A field out of range (`field` names it).", body = wire::ErrorBody),
        (status = 404, description = "No such limit.", body = wire::ErrorBody),
        (status = 409, description = "The ticket is another client's.", body = wire::ErrorBody),
        (status = 410, description = "The ticket is finished (released, withdrawn, lease ended).", body = wire::ErrorBody),
        (status = 429, description = "A refused try, too many waiters, or a new client past `--max-clients`; `Retry-After` says when to come back.", body = super::openapi::TooMany),
        (status = 503, description = "The backend (Redis) does not answer, or the server is stopping.", body = wire::ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn acquire(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
    Extension(principal): Extension<Principal>,
    JsonBody(body): JsonBody<wire::AcquireRequest>,
) -> Result<Response, ApiError> {
    check_name(&name)?;
    check_client(&body.client)?;
    principal.act_as(&body.client)?;
    let lease = lease_of(&app, body.lease_ms)?;
    let priority = match &body.priority {
        None => Priority::default(),
        Some(p) => {
            if p.key.as_ref().is_some_and(|k| k.len() > MAX_NAME) {
                return Err(ApiError::field("priority.key", "a fairness key is at most 200 bytes"));
            }
            if p.weight == 0 {
                return Err(ApiError::field("priority.weight", "a weight is at least 1"));
            }
            p.to_priority()
        }
    };
    let queue = body.queue.unwrap_or(true);
    if !queue && body.wait_ms.is_some_and(|ms| ms > 0) {
        return Err(ApiError::field("wait_ms", "a try (\"queue\": false) never waits"));
    }
    // Long-polls are bounded by the server's maximum.
    let wait = Duration::from_millis(body.wait_ms.unwrap_or(0)).min(app.options.max_wait);
    let now = Instant::now();
    let begun = {
        let backend = app.backend.clone();
        app.sessions()
            .begin(&body.client, &name, body.ticket, lease, now, || backend.ticket())
            .map_err(|refused| refusal(&name, refused))?
    };
    // A ticket keeps its first ask's lease (what it is granted, renewed and said to have).
    let (ticket, lease) = (begun.ticket, begun.lease);
    let mut in_flight = InFlight {
        app: app.clone(),
        client: body.client.clone(),
        limit: name.clone(),
        begun,
        asked: !begun.fresh,
    };
    if begun.first_ask_elsewhere {
        // Another request is making this ticket's first ask: the backend may not know the
        // ticket yet, so it is asked nothing (its answer "finished" would be wrong), and the
        // ticket stays as that ask leaves it (invariant 4 of `sessions`).
        let retry_after =
            come_back(&app, app.options.reask.min(wait.max(Duration::from_millis(100))));
        return Ok(if queue {
            app.event("queued");
            let body = wire::NotYet::new(ticket, Reason::Queued, millis(retry_after));
            not_yet(StatusCode::ACCEPTED, body, retry_after)
        } else {
            app.event("refused");
            let body = wire::TryRefused::new(Reason::Busy, millis(retry_after));
            not_yet(StatusCode::TOO_MANY_REQUESTS, body, retry_after)
        });
    }
    let outcome = if !queue && begun.fresh {
        // A try: granted now, or the ticket is forgotten at once.
        app.backend.try_acquire(&name, begun.backend, Some(lease)).await
    } else {
        // The one acquire future of `lanes::limit`, with the long-poll's deadline; the ticket
        // outlives the call (its client asks again, or releases it).
        let first = begun.fresh.then_some(&priority);
        let mut shutdown = app.shutdown.clone();
        let drive = lanes::limit::drive(
            &*app.backend,
            &name,
            begun.backend,
            first,
            Some(lease),
            Some(now + wait),
        );
        tokio::select! {
            biased;
            answer = drive => answer,
            () = async { drop(shutdown.wait_for(|stopping| *stopping).await) } => {
                app.backend.check(&name, begun.backend, Some(lease)).await
            }
        }
    };
    // The first ask is back. If the ticket was released meanwhile (or withdrawn by a stopping
    // server) before the backend knew it, what the ask left there goes back now.
    in_flight.asked = true;
    if begun.fresh && !app.sessions().first_asked(&name, begun) {
        if outcome.is_ok() {
            let _ = app.backend.release(&name, begun.backend).await;
        } else {
            // An ask that failed after it queued (a check in its wait that found the backend
            // out of reach) left the ticket there too.
            give_back_later(&app, &name, begun.backend);
        }
        return Err(ApiError::finished(&name, ticket));
    }
    // Only this backend ticket's record changes: another under the same number (released and
    // asked for again meanwhile) is not this request's to forget or mark.
    let only = Some(begun.backend);
    let answer = match outcome {
        Ok(answer) => answer,
        Err(err) => {
            if begun.fresh {
                // Forgotten here, so given back there: the ask may have queued the ticket
                // before it failed (a check in its wait that found the backend out of reach),
                // and a retry of the same ticket starts afresh. (A ticket the backend does not
                // know is released as a no-op.)
                let _ = app.sessions().forget(&body.client, &name, ticket, only, None);
                give_back_later(&app, &name, begun.backend);
            }
            return Err(ApiError::limit(&name, &err));
        }
    };
    match answer {
        Answer::Granted(grant) => {
            // Asked again for a permit it may hold already: the backend answers the grant it
            // has, whose lease it does not start again, and the answer says a whole lease.
            if !begun.fresh {
                match app.backend.renew(&name, &[begun.backend], lease).await {
                    Ok(gone) if gone.is_empty() => {}
                    Ok(_) => {
                        let _ = app.sessions().forget(
                            &body.client,
                            &name,
                            ticket,
                            only,
                            Some(Instant::now()),
                        );
                        let _ = app.backend.release(&name, begun.backend).await;
                        return Err(ApiError::finished(&name, ticket));
                    }
                    // The ticket stays as it was: its client asks again.
                    Err(err) => return Err(ApiError::limit(&name, &err)),
                }
            }
            if !app.sessions().granted(&name, ticket, begun.backend, Instant::now()) {
                // Released meanwhile: nobody would return this permit.
                let _ = app.backend.release(&name, begun.backend).await;
                return Err(ApiError::finished(&name, ticket));
            }
            app.event("granted");
            Ok(Json(wire::Granted::new(ticket, grant.fencing_token, millis(lease))).into_response())
        }
        Answer::Finished => {
            let _ = app.sessions().forget(&body.client, &name, ticket, only, Some(Instant::now()));
            Err(ApiError::finished(&name, ticket))
        }
        Answer::Queued | Answer::RetryAfter(_) if !queue => {
            let _ = app.sessions().forget(&body.client, &name, ticket, only, None);
            if !begun.fresh {
                // A try naming a ticket that was queued before: the try leaves nothing.
                app.backend
                    .release(&name, begun.backend)
                    .await
                    .map_err(|e| ApiError::limit(&name, &e))?;
            }
            app.event("refused");
            let (reason, retry_after) = match answer {
                Answer::RetryAfter(after) => (Reason::Rate, after),
                _ => (Reason::Busy, app.options.reask),
            };
            let body = wire::TryRefused::new(reason, millis(retry_after));
            Ok(not_yet(StatusCode::TOO_MANY_REQUESTS, body, retry_after))
        }
        Answer::Queued | Answer::RetryAfter(_) => {
            app.event("queued");
            let (reason, retry_after) = match answer {
                Answer::RetryAfter(after) => (Reason::Rate, after),
                _ => (Reason::Queued, app.options.reask.min(wait.max(Duration::from_millis(100)))),
            };
            let retry_after = come_back(&app, retry_after);
            let body = wire::NotYet::new(ticket, reason, millis(retry_after));
            Ok(not_yet(StatusCode::ACCEPTED, body, retry_after))
        }
    }
}

/// Releases backend ticket `backend` of `name` in the background: after a failed ask, whose
/// backend may be out of reach (its answer is not held up for another timeout).
fn give_back_later(app: &Arc<App>, name: &str, backend: u64) {
    let (app, name) = (app.clone(), name.to_owned());
    tokio::spawn(async move {
        let _ = app.backend.release(&name, backend).await;
    });
}

/// When a client whose ticket stays queued is told to ask again: `after`, but within half the
/// queue grace, past which the sweep withdraws a ticket nobody asks about (a rate's wait may be
/// longer: the client then asks again and is told again).
fn come_back(app: &App, after: Duration) -> Duration {
    after.min(app.options.queue_grace / 2)
}

/// Refresh a client's share of a leased limit (leased capacity): the client serves acquires
/// from its share with no round trip, and states here, every third of its lease, what it
/// wants and what it has out. A limit that is not leased answers `mode` `exact`.
#[utoipa::path(post, path = "/v1/limits/{name}/share", tag = "permits", params(("name" = String, Path, description = "The limit's name (1 to 200 bytes, no control characters).")),
    request_body = wire::ShareRefresh,
    responses(
        (status = 200, description = "The client's share, or the limit's mode.", body = wire::ShareAnswer),
        (status = 400, description = "A field out of range.", body = wire::ErrorBody),
        (status = 404, description = "No such limit.", body = wire::ErrorBody),
        (status = 503, description = "The backend (Redis) does not answer.", body = wire::ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn share(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
    Extension(principal): Extension<Principal>,
    JsonBody(body): JsonBody<wire::ShareRefresh>,
) -> Result<Response, ApiError> {
    check_name(&name)?;
    check_client(&body.client)?;
    principal.act_as(&body.client)?;
    let lease = lease_of(&app, body.lease_ms)?;
    // Fencing tokens are Lua numbers in Redis: exact below 2^53 only.
    if body.tokens > MAX_SHARE_TOKENS {
        return Err(ApiError::field(
            "tokens",
            format!("a block is at most {MAX_SHARE_TOKENS} fencing tokens"),
        ));
    }
    if body.last_token >= 1 << 53 {
        return Err(ApiError::field("last_token", "a fencing token is below 2^53"));
    }
    let request = body.to_request();
    let client = format!("http:{}:{}", body.client, body.instance);
    let reply = app
        .backend
        .refresh_share(&name, &client, request, lease)
        .await
        .map_err(|e| ApiError::limit(&name, &e))?;
    // "Not leased" of a limit that does not exist is a 404, on every backend (the embedded one
    // answers any name so, having no leased limits); a leased one's refreshes pay no more.
    if matches!(reply, ShareReply::Exact) {
        let info = app.backend.info(&name).await.map_err(|e| ApiError::limit(&name, &e))?;
        if info.is_none() {
            return Err(unknown(&name));
        }
    }
    Ok(Json(wire::ShareAnswer::from_reply(&reply)).into_response())
}

/// The largest block of fencing tokens a share refresh may ask for.
const MAX_SHARE_TOKENS: u64 = 1 << 24;

/// The lease asked for (`None`: the server's default), checked against the server's bounds.
fn lease_of(app: &App, lease_ms: Option<u64>) -> Result<Duration, ApiError> {
    let lease = Duration::from_millis(lease_ms.unwrap_or(app.options.default_lease_ms));
    if !(MIN_LEASE..=app.options.max_lease).contains(&lease) {
        return Err(ApiError::field(
            "lease_ms",
            format!(
                "a lease is {} to {} ms",
                MIN_LEASE.as_millis(),
                app.options.max_lease.as_millis()
            ),
        ));
    }
    Ok(lease)
}

/// Return a permit, or withdraw a queued ticket.
#[utoipa::path(post, path = "/v1/limits/{name}/release", tag = "permits", params(("name" = String, Path, description = "The limit's name (1 to 200 bytes, no control characters).")),
    request_body = wire::ReleaseRequest,
    responses(
        (status = 200, description = "Whether the ticket was known.", body = wire::ReleaseAnswer),
        (status = 400, description = "A field out of range.", body = wire::ErrorBody),
        (status = 404, description = "No such limit.", body = wire::ErrorBody),
        (status = 409, description = "The ticket is another client's.", body = wire::ErrorBody),
        (status = 503, description = "The backend (Redis) does not answer.", body = wire::ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn release(
    State(app): State<Arc<App>>,
    Path(name): Path<String>,
    Extension(principal): Extension<Principal>,
    JsonBody(body): JsonBody<wire::ReleaseRequest>,
) -> Result<Response, ApiError> {
    check_name(&name)?;
    check_client(&body.client)?;
    principal.act_as(&body.client)?;
    let known = app
        .sessions()
        .forget(&body.client, &name, body.ticket, None, Some(Instant::now()))
        .map_err(|refused| refusal(&name, refused))?;
    let released = match known {
        Some(backend_ticket) => {
            let released = app
                .backend
                .release(&name, backend_ticket)
                .await
                .map_err(|e| ApiError::limit(&name, &e))?;
            app.event("released");
            released != Released::Unknown
        }
        None => {
            // Nothing of the client's there: a limit that does not exist says so (404), as the
            // other routes of a limit do.
            let info = app.backend.info(&name).await.map_err(|e| ApiError::limit(&name, &e))?;
            if info.is_none() {
                return Err(unknown(&name));
            }
            false
        }
    };
    Ok(Json(wire::ReleaseAnswer { released }).into_response())
}

/// Renew the leases the client holds: the tickets it names, or (naming none) every one.
///
/// When the backend fails on some limits but not all, a client that sends `Prefer:
/// lanes-unrenewed` is answered 200 with the others renewed and those tickets named in
/// `unrenewed` (and `Preference-Applied: lanes-unrenewed`); any other client is answered 503,
/// as a client that does not know the field would take them for renewed.
#[utoipa::path(post, path = "/v1/clients/{client}/renew", tag = "permits",
    params(
        ("client" = String, Path, description = "The client id (1 to 200 bytes)."),
        ("Prefer" = Option<String>, Header, description = "`lanes-unrenewed`: answer 200 when some limits could not be renewed, naming their tickets in `unrenewed`."),
    ),
    request_body = wire::RenewRequest,
    responses(
        (status = 200, description = "How many leases were renewed, the lost ones, and those left unrenewed because the backend failed on their limit.", body = wire::RenewAnswer),
        (status = 400, description = "A bad client id, or too many tickets named.", body = wire::ErrorBody),
        (status = 404, description = "The client has nothing held or waiting.", body = wire::ErrorBody),
        (status = 503, description = "The backend (Redis) failed on every limit named.", body = wire::ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn renew(
    State(app): State<Arc<App>>,
    Path(client): Path<String>,
    Extension(principal): Extension<Principal>,
    headers: axum::http::HeaderMap,
    JsonBody(body): JsonBody<wire::RenewRequest>,
) -> Result<Response, ApiError> {
    let partial = headers
        .get_all(axum::http::header::HeaderName::from_static("prefer"))
        .iter()
        .any(|value| {
            value.to_str().is_ok_and(|value| {
                value.split(',').any(|p| p.trim().eq_ignore_ascii_case(wire::PREFER_UNRENEWED))
            })
        });
    check_client(&client)?;
    principal.act_as(&client)?;
    let named: Option<Vec<(String, u64)>> = match body.tickets {
        Some(tickets) if tickets.len() > wire::MAX_RENEW => {
            return Err(ApiError::field(
                "tickets",
                format!("a renewal names at most {} tickets", wire::MAX_RENEW),
            ));
        }
        Some(tickets) => Some(tickets.into_iter().map(|t| (t.limit, t.ticket)).collect()),
        None => None,
    };
    let renewing = app.sessions().tickets_of(&client, named.as_deref(), Instant::now());
    let Some(renewing) = renewing else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("unknown client {client:?} (never seen, or nothing held or waiting)"),
        ));
    };
    // One backend call per (limit, lease): the backend keeps the leases.
    let mut groups: std::collections::BTreeMap<(String, Duration), Vec<(u64, u64)>> =
        std::collections::BTreeMap::new();
    for (limit, ticket, backend, lease) in renewing.renew {
        groups.entry((limit, lease)).or_default().push((ticket, backend));
    }
    let mut renewed = 0;
    // Named, and not the client's here: lost (its lease ended and the sweep forgot it, or the
    // server restarted).
    let mut lost: Vec<wire::LostTicket> = renewing
        .unknown
        .into_iter()
        .map(|(limit, ticket)| {
            app.event("lease_lost");
            wire::LostTicket { limit, ticket }
        })
        .collect();
    // The limits at once, each on its own: on a Redis Cluster with a primary away, its limits'
    // calls wait out the timeout and fail, and the others' renewals must neither queue behind
    // them nor be given up with them (their leases would run out), nor the lost ones found
    // before the failure go untold.
    let mut renewals = tokio::task::JoinSet::new();
    for ((limit, lease), tickets) in groups {
        let (app, client) = (app.clone(), client.clone());
        renewals.spawn(async move { renew_limit(&app, &client, limit, lease, tickets).await });
    }
    let (mut unrenewed, mut failure) = (Vec::new(), None);
    let mut answered = false;
    while let Some(done) = renewals.join_next().await {
        let done = done.unwrap_or_else(|err| std::panic::resume_unwind(err.into_panic()));
        match done {
            Ok((n, gone)) => {
                answered = true;
                renewed += n;
                lost.extend(gone);
            }
            Err((limit, tickets, err)) => {
                unrenewed.extend(
                    tickets
                        .into_iter()
                        .map(|ticket| wire::TicketRef { limit: limit.clone(), ticket }),
                );
                failure.get_or_insert_with(|| ApiError::limit(&limit, &err));
            }
        }
    }
    match failure {
        // The backend failed on every limit (unavailable, as one failed call says), or on
        // some, for a client that cannot be told which.
        Some(failure) if !answered || !partial => Err(failure),
        _ => {
            let mut response = Json(wire::RenewAnswer { lost, renewed, unrenewed }).into_response();
            if partial {
                response.headers_mut().insert(
                    axum::http::header::HeaderName::from_static("preference-applied"),
                    axum::http::HeaderValue::from_static(wire::PREFER_UNRENEWED),
                );
            }
            Ok(response)
        }
    }
}

/// Renews `client`'s `tickets` (its tickets and their backend tickets) of `limit`: how many
/// were renewed and the lost ones, or the limit's tickets and the backend's error.
async fn renew_limit(
    app: &App,
    client: &str,
    limit: String,
    lease: Duration,
    tickets: Vec<(u64, u64)>,
) -> Result<(u64, Vec<wire::LostTicket>), (String, Vec<u64>, lanes::LimitError)> {
    let backends: Vec<u64> = tickets.iter().map(|(_, b)| *b).collect();
    let gone = match app.backend.renew(&limit, &backends, lease).await {
        Ok(gone) => gone,
        Err(lanes::LimitError::UnknownLimit(_)) => backends,
        Err(err) => return Err((limit, tickets.into_iter().map(|(t, _)| t).collect(), err)),
    };
    let (mut renewed, mut lost) = (0, Vec::new());
    for (ticket, backend) in tickets {
        if gone.contains(&backend) {
            // Given back as well: what the backend may still keep of it (a ticket waiting
            // again after Redis lost its grant, a permit from this server's share of a
            // leased limit, which Redis does not renew) would be held for good. Before the
            // record goes: a handler dropped in between leaves the record, which the sweep
            // finds, rather than a backend ticket nobody knows.
            let _ = app.backend.release(&limit, backend).await;
            let _ =
                app.sessions().forget(client, &limit, ticket, Some(backend), Some(Instant::now()));
            app.event("lease_lost");
            lost.push(wire::LostTicket { limit: limit.clone(), ticket });
        } else {
            renewed += 1;
        }
    }
    Ok((renewed, lost))
}

/// Whole milliseconds, saturating.
fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// Everything the server knows: the `lanes` registry snapshot, the limits under
/// `limits.server`, and the server's own figures.
#[utoipa::path(get, path = "/v1/snapshot", tag = "observe",
    responses(
        (status = 200, description = "The snapshot.", body = super::openapi::SnapshotAnswer),
        (status = 503, description = "The backend (Redis) does not answer.", body = wire::ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn snapshot(State(app): State<Arc<App>>) -> Result<Response, ApiError> {
    let mut registry = app.registry.snapshot();
    let limits = app.backend.list().await.map_err(|e| ApiError::limit("*", &e))?;
    registry.insert("limits", "server", &limits);
    let server = {
        let sessions = app.sessions();
        ServerInfo {
            clients: sessions.clients(),
            backend: app.options.backend_name(),
            client_list: sessions.list(tokio::time::Instant::now(), 200),
        }
    };
    Ok(Json(SnapshotAnswer { registry, server }).into_response())
}

/// Prometheus metrics.
#[utoipa::path(get, path = "/metrics", tag = "observe",
    responses((status = 200, description = "Prometheus text format.", content_type = "text/plain", body = String)),
    security(("bearer" = [])))]
pub(crate) async fn metrics(State(app): State<Arc<App>>) -> Response {
    use std::fmt::Write;
    // Read first: the sessions' lock is let go before the recorder (user code) is called.
    let clients = app.sessions().clients();
    metrics::gauge!("lanes_server_clients").set(clients as f64);
    let mut body = app.prometheus.render();
    if let Ok(infos) = app.backend.list().await {
        type Field = fn(&lanes::LimitInfo) -> f64;
        // The store's view of every limit; the help text is the library's table's.
        let series: [(&str, &str, Field); 5] = [
            ("lanes_limit_in_use", "gauge", |i| f64::from(i.in_use)),
            ("lanes_limit_waiting", "gauge", |i| i.waiting as f64),
            ("lanes_limit_concurrent", "gauge", |i| f64::from(i.spec.concurrent)),
            ("lanes_limit_max_in_use", "gauge", |i| f64::from(i.max_in_use)),
            ("lanes_limit_granted_total", "counter", |i| i.granted_total as f64),
        ];
        for (name, kind, value) in series {
            let help = lanes::observe::METRICS
                .iter()
                .find(|metric| metric.name == name)
                .map_or("", |metric| metric.help);
            let _ = writeln!(body, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for info in &infos {
                let label =
                    info.name.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
                let _ = writeln!(body, "{name}{{limit=\"{label}\"}} {}", value(info));
            }
        }
    }
    ([("content-type", "text/plain; version=0.0.4")], body).into_response()
}

/// Liveness: the process answers (no token needed).
#[utoipa::path(get, path = "/healthz", tag = "observe",
    responses((status = 200, description = "Alive.", body = super::openapi::Health)))]
pub(crate) async fn healthz() -> Response {
    Json(Health { status: "ok" }).into_response()
}

/// Readiness: the backend answers within a second (no token needed).
///
/// One call whatever the limits (the state of one name), so that a probe nobody authenticates
/// costs the backend as little as a health check should.
#[utoipa::path(get, path = "/readyz", tag = "observe",
    responses(
        (status = 200, description = "Ready.", body = super::openapi::Ready),
        (status = 503, description = "The backend does not answer (`not_ready`).", body = wire::ErrorBody),
    ))]
pub(crate) async fn readyz(State(app): State<Arc<App>>) -> Result<Response, ApiError> {
    // (Listing every limit cost one call per limit on Redis, and held the embedded table's
    // lock while every limit's state was gathered: a probe loop from anyone who reaches the
    // port then slowed every acquire.)
    let probe = app.backend.info("lanes.readyz");
    match tokio::time::timeout(Duration::from_secs(1), probe).await {
        Ok(Ok(_)) => {
            let ready = Ready { status: "ready", backend: app.options.backend_name() };
            Ok(Json(ready).into_response())
        }
        Ok(Err(err)) => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the backend does not answer: {err}"),
        )
        .code("not_ready")),
        Err(_) => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the backend did not answer within 1 s",
        )
        .code("not_ready")),
    }
}

/// This document.
#[utoipa::path(get, path = "/openapi.json", tag = "observe",
    responses((status = 200, description = "OpenAPI 3.1.", content_type = "application/json", body = Object)),
    security(("bearer" = [])))]
pub(crate) async fn openapi() -> Response {
    ([("content-type", "application/json")], super::openapi::document()).into_response()
}

/// The dashboard (no token needed; it asks for a read token for its own requests).
#[utoipa::path(get, path = "/", tag = "observe",
    responses((status = 200, description = "An HTML page.", content_type = "text/html", body = String)))]
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
