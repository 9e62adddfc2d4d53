//! API errors: a status and a JSON body naming what was wrong. Never a panic, never a 500 for
//! the client's input.

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use lanes::LimitError;
use lanes_remote::wire::ErrorBody;
use serde::de::DeserializeOwned;

/// An API error: a status and its body.
#[derive(Debug)]
pub(crate) struct ApiError {
    status: StatusCode,
    body: ErrorBody,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, error: impl Into<String>) -> Self {
        Self { status, body: ErrorBody::new(error) }
    }

    /// Gives the error its stable `code`.
    pub(crate) fn code(mut self, code: &str) -> Self {
        self.body.code = Some(code.to_owned());
        self
    }

    /// Names the limit concerned.
    fn with_limit(mut self, limit: &str) -> Self {
        self.body.limit = Some(limit.to_owned());
        self
    }

    /// Names the ticket concerned.
    fn with_ticket(mut self, ticket: u64) -> Self {
        self.body.ticket = Some(ticket);
        self
    }

    /// A 400 naming the offending field.
    pub(crate) fn field(field: impl Into<String>, error: impl Into<String>) -> Self {
        let mut err = Self::new(StatusCode::BAD_REQUEST, error);
        err.body.field = Some(field.into());
        err
    }

    pub(crate) fn limit(name: &str, err: &LimitError) -> Self {
        let status = match err {
            LimitError::UnknownLimit(_) => StatusCode::NOT_FOUND,
            LimitError::InvalidSpec(spec) => {
                return Self::field(spec.field(), err.to_string());
            }
            LimitError::TooManyWaiters { .. } | LimitError::TooManyKeys { .. } => {
                StatusCode::TOO_MANY_REQUESTS
            }
            // A new limit past `--max-limits` (the backend counts, for every server of a
            // namespace on Redis).
            LimitError::TooManyLimits { max } => {
                return Self::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    format!(
                        "at most {max} limits may be defined (--max-limits; on Redis, in the \
                         whole namespace)"
                    ),
                )
                .code("too_many_limits");
            }
            LimitError::InUse(_) => StatusCode::CONFLICT,
            LimitError::LeaseExpired { .. } => StatusCode::GONE,
            // The backend (Redis) could not answer: the service is unavailable, not broken.
            _ => StatusCode::SERVICE_UNAVAILABLE,
        };
        let answer = Self::new(status, err.to_string()).with_limit(name);
        match err {
            LimitError::TooManyWaiters { .. } => answer.code("too_many_waiters"),
            _ => answer,
        }
    }
}

impl ApiError {
    /// A ticket another client owns: 409 naming it.
    pub(crate) fn not_yours(limit: &str, ticket: u64) -> Self {
        Self::new(
            StatusCode::CONFLICT,
            format!("ticket {ticket} of limit {limit:?} belongs to another client"),
        )
        .with_limit(limit)
        .with_ticket(ticket)
    }

    /// A ticket that neither waits nor holds any more: 410 naming it.
    pub(crate) fn finished(limit: &str, ticket: u64) -> Self {
        Self::new(
            StatusCode::GONE,
            format!(
                "ticket {ticket} of limit {limit:?} is finished (released, withdrawn, or its lease ended)"
            ),
        )
        .with_limit(limit)
        .with_ticket(ticket)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        // Every 429 carries a `Retry-After` (the API promises it): a refusal for too many
        // waiters, limits or clients knows no better time than a second.
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            return (self.status, [("retry-after", "1")], Json(self.body)).into_response();
        }
        (self.status, Json(self.body)).into_response()
    }
}

/// A JSON body whose errors name the field (`serde_path_to_error`), as a 400; an oversized
/// body is a 413.
#[derive(Debug)]
pub(crate) struct JsonBody<T>(pub(crate) T);

impl<S: Send + Sync, T: DeserializeOwned> axum::extract::FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| match rejection {
            BytesRejection::FailedToBufferBody(err)
                if err.status() == StatusCode::PAYLOAD_TOO_LARGE =>
            {
                ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "the request body is too large")
            }
            other => ApiError::new(other.status(), other.body_text()),
        })?;
        let body: &[u8] = if bytes.is_empty() { b"{}" } else { &bytes };
        let mut de = serde_json::Deserializer::from_slice(body);
        let value = serde_path_to_error::deserialize(&mut de).map_err(|err| {
            let path = err.path().to_string();
            let field = if path == "." || path == "?" { "body".to_owned() } else { path };
            ApiError::field(field, err.into_inner().to_string())
        })?;
        de.end().map_err(|err| ApiError::field("body", err.to_string()))?;
        Ok(Self(value))
    }
}
