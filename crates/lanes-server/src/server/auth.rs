//! Who may do what: API tokens with a role, sent as `Authorization: Bearer`, compared in
//! constant time; and the browser guards (JSON bodies only, no foreign `Origin`, allowed
//! `Host` names against DNS rebinding).
//!
//! | role | may |
//! |---|---|
//! | `read` | `GET` anything: limits, snapshot, metrics, the OpenAPI document |
//! | `client` | what `read` may, and acquire, release and renew as the client ids it is bound to |
//! | `admin` | everything: define and delete limits, and act as any client |
//!
//! `/`, `/healthz` and `/readyz` need no token: the dashboard page holds no data (it asks for a
//! token and sends it with its own requests), and probes must not need secrets.

use std::fmt;
use std::sync::Arc;

use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use subtle::ConstantTimeEq;

use super::App;
use super::error::ApiError;

/// What a token allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Read-only: limits, snapshot, metrics.
    Read,
    /// Acquire, release and renew as the bound client ids; and read.
    Client,
    /// Everything.
    Admin,
}

impl std::str::FromStr for Role {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "read" => Ok(Self::Read),
            "client" => Ok(Self::Client),
            "admin" => Ok(Self::Admin),
            other => Err(format!("unknown role {other:?} (admin, client or read)")),
        }
    }
}

/// One API token. `Debug` never shows the secret.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Token {
    /// What it allows.
    pub role: Role,
    /// The secret (at least 16 bytes).
    pub token: String,
    /// For `client` tokens: the client ids it may act as. `worker-1` also covers the ids
    /// `worker-1~N` a `RemoteLimits` client uses for tickets with their own lease; `worker-*`
    /// covers every id starting with `worker-`. Empty for a `client` token: none.
    #[serde(default)]
    pub clients: Vec<String>,
    /// A name for the access log (default: the role and the token's position).
    #[serde(default)]
    pub name: Option<String>,
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Token")
            .field("role", &self.role)
            .field("token", &"<redacted>")
            .field("clients", &self.clients)
            .field("name", &self.name)
            .finish()
    }
}

/// The shortest secret accepted.
pub const MIN_TOKEN_LEN: usize = 16;

impl Token {
    /// Parses the `LANES_TOKENS` form: entries separated by whitespace, each
    /// `role:secret` or `client:secret:id1,id2`.
    ///
    /// # Errors
    ///
    /// A message naming the entry (by position, never by its secret).
    pub fn parse_list(text: &str) -> Result<Vec<Self>, String> {
        text.split_whitespace()
            .enumerate()
            .map(|(i, entry)| {
                let mut parts = entry.splitn(3, ':');
                let role = parts.next().unwrap_or_default();
                // Not echoed: an entry without its role starts with its secret.
                let role: Role = role.parse().map_err(|_| {
                    format!("token {}: unknown role (admin, client or read, as role:secret)", i + 1)
                })?;
                let token = parts
                    .next()
                    .filter(|t| !t.is_empty())
                    .ok_or_else(|| format!("token {}: expected role:secret", i + 1))?;
                let clients = parts
                    .next()
                    .map(|ids| {
                        ids.split(',').filter(|c| !c.is_empty()).map(str::to_owned).collect()
                    })
                    .unwrap_or_default();
                Ok(Self { role, token: token.to_owned(), clients, name: None })
            })
            .collect()
    }

    /// Checks the token's shape.
    ///
    /// # Errors
    ///
    /// A message naming what is wrong (never the secret).
    pub fn validate(&self, position: usize) -> Result<(), String> {
        let label = self.name.clone().unwrap_or_else(|| format!("token {position}"));
        if self.token.len() < MIN_TOKEN_LEN || self.token.chars().any(|c| c.is_whitespace()) {
            return Err(format!(
                "{label}: a token is at least {MIN_TOKEN_LEN} bytes without whitespace"
            ));
        }
        if self.role != Role::Client && !self.clients.is_empty() {
            return Err(format!("{label}: only client tokens are bound to client ids"));
        }
        if self.role == Role::Client && self.clients.is_empty() {
            return Err(format!("{label}: a client token names the client ids it may act as"));
        }
        Ok(())
    }
}

/// Who sent a request.
#[derive(Debug, Clone)]
pub(crate) struct Principal {
    role: Role,
    clients: Arc<[String]>,
    /// For the access log.
    pub(crate) name: Arc<str>,
}

impl Principal {
    /// Anyone, on a server running without tokens.
    fn open() -> Self {
        Self { role: Role::Admin, clients: Arc::from(Vec::new()), name: Arc::from("-") }
    }

    /// Refuses unless this principal may act as `client`.
    pub(crate) fn act_as(&self, client: &str) -> Result<(), ApiError> {
        let bound = |pattern: &String| match pattern.strip_suffix('*') {
            Some(prefix) => client.starts_with(prefix),
            None => {
                client == pattern
                    || client.strip_prefix(pattern.as_str()).is_some_and(|t| t.starts_with('~'))
            }
        };
        if self.role == Role::Admin || self.clients.iter().any(bound) {
            return Ok(());
        }
        Err(ApiError::new(
            StatusCode::FORBIDDEN,
            format!("this token may not act as client {client:?}"),
        )
        .code("forbidden"))
    }
}

/// The tokens a server accepts.
#[derive(Debug, Default)]
pub(crate) struct Tokens {
    tokens: Vec<(Token, Principal)>,
}

impl Tokens {
    pub(crate) fn new(tokens: &[Token]) -> Self {
        let tokens = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let name = t.name.clone().unwrap_or_else(|| format!("{:?}#{}", t.role, i + 1));
                let principal = Principal {
                    role: t.role,
                    clients: Arc::from(t.clients.clone()),
                    name: Arc::from(name.to_lowercase()),
                };
                (t.clone(), principal)
            })
            .collect();
        Self { tokens }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The principal a presented secret belongs to. Every token is compared, each in constant
    /// time, whatever matched: the time taken does not depend on the secret's contents.
    fn find(&self, presented: &[u8]) -> Option<Principal> {
        let mut found = None;
        for (token, principal) in &self.tokens {
            let equal: bool = token.token.as_bytes().ct_eq(presented).into();
            if equal && found.is_none() {
                found = Some(principal.clone());
            }
        }
        found
    }
}

/// The role a request needs, from its method and route; `None`: none (public).
fn needs(method: &Method, route: &str) -> Option<Role> {
    match route {
        "/" | "/healthz" | "/readyz" => None,
        _ if *method == Method::GET || *method == Method::HEAD => Some(Role::Read),
        "/v1/limits/{name}/acquire"
        | "/v1/limits/{name}/release"
        | "/v1/limits/{name}/share"
        | "/v1/clients/{client}/renew" => Some(Role::Client),
        _ => Some(Role::Admin),
    }
}

/// Authenticates and authorizes a request, and applies the browser guards; puts the
/// [`Principal`] in the request's extensions for the handlers.
pub(crate) async fn guard(
    State(app): State<Arc<App>>,
    mut request: Request,
    next: Next,
) -> Response {
    if let Err(refused) = browser_guard(&app, request.method(), request.headers()) {
        return refused.into_response();
    }
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let principal = if app.tokens.is_empty() {
        Principal::open()
    } else {
        match needs(request.method(), &route) {
            None => Principal::open_read(),
            Some(role) => match authenticate(&app.tokens, request.headers(), role) {
                Ok(principal) => principal,
                Err(refused) => return *refused,
            },
        }
    };
    request.extensions_mut().insert(principal.clone());
    let mut response = next.run(request).await;
    response.extensions_mut().insert(principal);
    response
}

impl Principal {
    /// A request to a public path: may do nothing that needs a role.
    fn open_read() -> Self {
        Self { role: Role::Read, clients: Arc::from(Vec::new()), name: Arc::from("-") }
    }
}

fn authenticate(
    tokens: &Tokens,
    headers: &HeaderMap,
    role: Role,
) -> Result<Principal, Box<Response>> {
    let unauthorized = |message: &str| {
        let mut response =
            ApiError::new(StatusCode::UNAUTHORIZED, message).code("unauthorized").into_response();
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
        Box::new(response)
    };
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return Err(unauthorized("an API token is required (Authorization: Bearer TOKEN)"));
    };
    let presented = value
        .as_bytes()
        .strip_prefix(b"Bearer ")
        .ok_or_else(|| unauthorized("the Authorization header must be `Bearer TOKEN`"))?;
    let principal =
        tokens.find(presented.trim_ascii()).ok_or_else(|| unauthorized("unknown token"))?;
    if principal.role < role {
        let message =
            format!("this token's role ({:?}) may not do this (needs {:?})", principal.role, role)
                .to_lowercase();
        let refused = ApiError::new(StatusCode::FORBIDDEN, message).code("forbidden");
        return Err(Box::new(refused.into_response()));
    }
    Ok(principal)
}

/// Browser guards: a state-changing request carries JSON (a cross-site form cannot send it
/// without a preflight), an `Origin` must be the server's own, and `Host` must be allowed.
fn browser_guard(app: &App, method: &Method, headers: &HeaderMap) -> Result<(), ApiError> {
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok()).unwrap_or("");
    if !app.options.host_allowed(host) {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            format!("host {host:?} is not allowed (--allowed-hosts)"),
        )
        .code("host_not_allowed"));
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("");
        let scheme = if app.options.tls.is_some() { "https" } else { "http" };
        if origin != format!("{scheme}://{host}") {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                format!("cross-origin requests are refused (origin {origin:?})"),
            )
            .code("cross_origin"));
        }
    }
    if *method == Method::POST || *method == Method::PUT {
        let json = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
        if !json {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "a request that changes state must be Content-Type: application/json",
            )
            .code("unsupported_media_type"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn principal(clients: &[&str]) -> Principal {
        Principal {
            role: Role::Client,
            clients: clients.iter().map(|c| (*c).to_owned()).collect::<Vec<_>>().into(),
            name: Arc::from("t"),
        }
    }

    #[test]
    fn a_client_token_acts_only_as_its_ids_and_their_ticket_ids() {
        let p = principal(&["worker-1", "batch-*"]);
        assert!(p.act_as("worker-1").is_ok());
        assert!(p.act_as("worker-1~42").is_ok());
        assert!(p.act_as("batch-7").is_ok());
        assert!(p.act_as("worker-10").is_err());
        assert!(p.act_as("worker-").is_err());
        assert!(p.act_as("other").is_err());
    }

    #[test]
    fn tokens_parse_from_the_environment_form_and_validate() {
        let tokens = Token::parse_list(
            "admin:aaaaaaaaaaaaaaaa client:bbbbbbbbbbbbbbbb:w1,w2 read:cccccccccccccccc",
        )
        .unwrap();
        assert_eq!(tokens.len(), 3);
        assert_eq!(tokens[1].clients, ["w1", "w2"]);
        assert!(tokens.iter().enumerate().all(|(i, t)| t.validate(i + 1).is_ok()));
        assert!(Token::parse_list("root:x").unwrap_err().contains("unknown role"));
        // Review finding (stop 73): an entry without its role had its secret echoed.
        let err = Token::parse_list("S3cretTokenValue12345").unwrap_err();
        assert!(err.contains("unknown role") && !err.contains("S3cret"), "{err}");
        assert!(Token::parse_list("admin:").is_err());
        let short = &Token::parse_list("read:short").unwrap()[0];
        assert!(short.validate(1).unwrap_err().contains("at least 16"));
        let unbound = &Token::parse_list("client:bbbbbbbbbbbbbbbb").unwrap()[0];
        assert!(unbound.validate(1).is_err());
        assert!(!format!("{:?}", tokens[0]).contains("aaaa"));
    }

    #[test]
    fn every_token_is_compared_and_the_right_one_found() {
        let tokens = Tokens::new(
            &Token::parse_list("admin:aaaaaaaaaaaaaaaa read:cccccccccccccccc").unwrap(),
        );
        assert_eq!(tokens.find(b"cccccccccccccccc").map(|p| p.role), Some(Role::Read));
        assert!(tokens.find(b"cccccccccccccccd").is_none());
        assert!(tokens.find(b"").is_none());
    }

    #[test]
    fn routes_need_the_least_role_that_may_use_them() {
        assert_eq!(needs(&Method::GET, "/v1/snapshot"), Some(Role::Read));
        assert_eq!(needs(&Method::POST, "/v1/limits/{name}/acquire"), Some(Role::Client));
        assert_eq!(needs(&Method::POST, "/v1/limits/{name}/share"), Some(Role::Client));
        assert_eq!(needs(&Method::PUT, "/v1/limits/{name}"), Some(Role::Admin));
        assert_eq!(needs(&Method::DELETE, "/v1/limits/{name}"), Some(Role::Admin));
        assert_eq!(needs(&Method::GET, "/healthz"), None);
        assert_eq!(needs(&Method::POST, "unmatched"), Some(Role::Admin));
    }
}
