//! `lanes serve`: limits over HTTP, with leases per client, a JSON snapshot, Prometheus
//! metrics, an OpenAPI description and a live dashboard.
//!
//! The limits live in an embedded in-process backend, or — with a Redis URL — in
//! [`RedisLimits`](lanes_redis::RedisLimits), so several servers share them. Clients are
//! sessions, which the server keeps only to know who owns which ticket and which clients are
//! alive: each ticket is its creator's, and another client acting on it is refused (409). The
//! protocol itself — the first ask, the long-poll (a call of `lanes::limit::drive`), leases and
//! their renewal — is the backend's, written once in `lanes::limit`. A queued ticket nobody asks
//! about for the queue grace (no long-poll on it in flight) is withdrawn; permits end with their
//! leases unless renewed (`POST /v1/clients/{client}/renew`).

mod api;
mod auth;
mod error;
mod listen;
mod openapi;
mod sessions;

pub use auth::{MIN_TOKEN_LEN, Role, Token};

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use lanes::channel::{Channel, ChannelConfig, Channels, ConsumerOptions, Overflow};
use lanes::limit::{LimitBackend, LocalLimits};
use lanes::{BoxError, Registry};
use lanes_remote::wire::MAX_NAME;
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Deserialize;
use tokio::sync::watch;
use tokio::time::Instant;

use error::ApiError;
use sessions::Sessions;

/// The API, as OpenAPI 3.1, derived from the handlers and the wire types (also checked in as
/// `crates/lanes-server/openapi.json`, and served at `/openapi.json`).
pub fn openapi_document() -> &'static str {
    openapi::document()
}

pub(crate) const DASHBOARD: &str = include_str!("dashboard.html");

/// How `lanes serve` runs.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// The address to listen on (port 0 picks a free port).
    pub listen: SocketAddr,
    /// Share limits through this Redis instead of keeping them in process.
    pub redis: Option<String>,
    /// The Redis namespace of the limits.
    pub namespace: String,
    /// Limits to define at start, by name.
    pub limits: BTreeMap<String, lanes::LimitSpec>,
    /// The longest an acquire long-polls (`wait_ms` is capped to it).
    pub max_wait: Duration,
    /// The lease of a permit whose acquire did not say (`lease_ms`).
    pub default_lease_ms: u64,
    /// The most bytes of a request body (413 beyond).
    pub max_body: usize,
    /// The most bytes of a request's head (431 `headers_too_large` beyond; a head past twice
    /// this, or past 8 KiB if that is more, or of more than 100 fields, is refused by the HTTP
    /// layer with an empty 431).
    pub max_header_bytes: usize,
    /// How long a long-poll sleeps before asking the backend again when nothing wakes it.
    pub reask: Duration,
    /// The most tickets waiting per limit (429 beyond).
    pub max_waiters: usize,
    /// How long a queued ticket nobody asks about (no long-poll on it in flight) keeps its place.
    pub queue_grace: Duration,
    /// The longest lease a client may ask for (and, on Redis, how long grants wait after Redis
    /// lost its state: every lease that could still be believed held has ended by then).
    pub max_lease: Duration,
    /// The API tokens accepted. Empty: no authentication, allowed only on a loopback address
    /// unless `insecure_no_auth`.
    pub tokens: Vec<Token>,
    /// Run without tokens on a non-loopback address (anyone who reaches the port may act).
    pub insecure_no_auth: bool,
    /// The `Host` names accepted (DNS-rebinding guard; `*` accepts any). Empty: on a loopback
    /// address, `localhost` and the loopback addresses; elsewhere, any.
    pub allowed_hosts: Vec<String>,
    /// The most limits (429 `too_many_limits` beyond). On Redis, the namespace's: every server
    /// sharing it counts the limits all of them defined.
    pub max_limits: usize,
    /// The most clients with a session (429 `too_many_clients` beyond).
    pub max_clients: usize,
    /// Serve HTTPS with this certificate chain and key.
    pub tls: Option<TlsFiles>,
    /// The most open connections (beyond, a connection is answered 503
    /// `too_many_connections` and closed).
    pub max_connections: usize,
    /// How long a connection may take to send a request's headers, counted from when it
    /// opened or finished its last response: a slow or idle connection is closed after it.
    pub header_timeout: Duration,
    /// How long a request's body may take to arrive (408 `body_timeout` beyond).
    pub body_timeout: Duration,
    /// How long a stop waits for open requests to finish before dropping their connections.
    pub shutdown_timeout: Duration,
}

/// The most connections `--max-connections` may allow.
const MAX_CONNECTIONS: usize = 1 << 24;

/// The PEM files of `lanes serve --tls-cert --tls-key`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The certificate chain.
    pub cert: PathBuf,
    /// The private key.
    pub key: PathBuf,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 7878)),
            redis: None,
            namespace: "lanes".to_owned(),
            limits: BTreeMap::new(),
            max_wait: Duration::from_secs(30),
            default_lease_ms: 10_000,
            max_body: 64 * 1024,
            max_header_bytes: 16 * 1024,
            reask: Duration::from_secs(1),
            max_waiters: lanes::LimitTable::DEFAULT_MAX_WAITERS,
            queue_grace: Duration::from_secs(2),
            max_lease: Duration::from_secs(60),
            tokens: Vec::new(),
            insecure_no_auth: false,
            allowed_hosts: Vec::new(),
            max_limits: 10_000,
            max_clients: 100_000,
            tls: None,
            max_connections: 1024,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(10),
            shutdown_timeout: Duration::from_secs(10),
        }
    }
}

impl ServeOptions {
    /// Checks the operational bounds.
    ///
    /// # Errors
    ///
    /// A message naming the setting that is out of range.
    pub fn validate(&self) -> Result<(), BoxError> {
        if self.queue_grace < Duration::from_millis(100) {
            return Err("queue grace: at least 100 ms".into());
        }
        if self.max_lease < Duration::from_millis(100) {
            return Err("max lease: at least 100 ms".into());
        }
        if Duration::from_millis(self.default_lease_ms) > self.max_lease {
            return Err("the default lease is longer than the max lease".into());
        }
        // Every acquire that names no lease would be refused (400, for a field it never sent).
        if self.default_lease_ms < 100 {
            return Err("default lease: at least 100 ms".into());
        }
        if self.max_body < 1024 {
            return Err("max body: at least 1024 bytes".into());
        }
        // Past tokio's semaphore (the connection count), the listener could not start.
        if self.max_connections > MAX_CONNECTIONS {
            return Err(format!("max connections: at most {MAX_CONNECTIONS}").into());
        }
        for name in self.limits.keys() {
            // As a PUT checks it: a name the API cannot address could never be used.
            if name.is_empty() || name.len() > MAX_NAME || name.chars().any(char::is_control) {
                return Err(format!(
                    "limit {name:?}: a limit name is 1 to {MAX_NAME} bytes without control \
                     characters"
                )
                .into());
            }
        }
        if self.limits.len() > self.max_limits {
            return Err(format!(
                "{} limits defined, more than max limits ({})",
                self.limits.len(),
                self.max_limits
            )
            .into());
        }
        for (i, token) in self.tokens.iter().enumerate() {
            token.validate(i + 1)?;
        }
        if self.max_limits == 0 || self.max_clients == 0 || self.max_connections == 0 {
            return Err("max limits, max clients and max connections: at least 1".into());
        }
        if self.max_header_bytes < 1024 {
            return Err("max header bytes: at least 1024".into());
        }
        for (name, timeout) in [
            ("header timeout", self.header_timeout),
            ("body timeout", self.body_timeout),
            ("shutdown timeout", self.shutdown_timeout),
        ] {
            if timeout < Duration::from_millis(100) {
                return Err(format!("{name}: at least 100 ms").into());
            }
        }
        if self.tokens.is_empty() && !self.listen.ip().is_loopback() && !self.insecure_no_auth {
            return Err(format!(
                "refusing to listen on {} without API tokens: anyone who reaches it could define, \
                 delete and hold every limit. Give tokens (lanes.toml [[tokens]], --tokens-file, \
                 or LANES_TOKENS), listen on a loopback address, or pass --insecure-no-auth",
                self.listen
            )
            .into());
        }
        Ok(())
    }

    /// Whether a request's `Host` header names this server (the DNS-rebinding guard).
    pub(crate) fn host_allowed(&self, host: &str) -> bool {
        if host.is_empty() {
            return true;
        }
        // The name without its port (an IPv6 literal keeps its brackets).
        let name = match host.rsplit_once(':') {
            Some((name, port)) if !name.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => {
                name
            }
            _ => host,
        };
        if !self.allowed_hosts.is_empty() {
            return self
                .allowed_hosts
                .iter()
                .any(|allowed| allowed == "*" || allowed.eq_ignore_ascii_case(name));
        }
        if !self.listen.ip().is_loopback() {
            return true;
        }
        let ip = self.listen.ip().to_string();
        name.eq_ignore_ascii_case("localhost")
            || name == "127.0.0.1"
            || name == "[::1]"
            || name == ip
            || name.trim_start_matches('[').trim_end_matches(']') == ip
    }

    pub(crate) fn backend_name(&self) -> &'static str {
        if self.redis.is_some() { "redis" } else { "embedded" }
    }

    /// Reads tokens from a file of `[[tokens]]` tables (`role`, `token`, `clients`, `name`),
    /// the same form as in `lanes.toml`.
    ///
    /// # Errors
    ///
    /// The file cannot be read or is not a list of tokens (the message names the file).
    pub fn tokens_from_file(path: &PathBuf) -> Result<Vec<Token>, BoxError> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct File {
            tokens: Vec<Token>,
        }
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read tokens file {}: {e}", path.display()))?;
        let file: File = toml::from_str(&text).map_err(|e| toml_error(path, &text, &e))?;
        Ok(file.tokens)
    }

    /// Reads a `lanes.toml`: `[limits.NAME]` tables with `concurrent`, `per_second`, `burst`;
    /// `[[tokens]]` tables; and every [`Settings`] key.
    ///
    /// # Errors
    ///
    /// The file cannot be read or is not a valid configuration (the message names the key).
    pub fn from_file(path: &PathBuf) -> Result<Self, BoxError> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct LimitFile {
            concurrent: u32,
            per_second: Option<f64>,
            burst: Option<u32>,
        }
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let in_file = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
        let mut table: toml::Table =
            toml::from_str(&text).map_err(|e| toml_error(path, &text, &e))?;
        let limits: BTreeMap<String, LimitFile> = match table.remove("limits") {
            Some(limits) => limits.try_into().map_err(|e| in_file(&format!("limits: {e}")))?,
            None => BTreeMap::new(),
        };
        let tokens: Vec<Token> = match table.remove("tokens") {
            Some(tokens) => tokens.try_into().map_err(|e| in_file(&format!("tokens: {e}")))?,
            None => Vec::new(),
        };
        let settings: Settings = toml::Value::Table(table).try_into().map_err(|e| in_file(&e))?;
        let mut options = Self { tokens, ..Self::default() };
        options.apply(settings)?;
        for (name, limit) in limits {
            let mut spec = lanes::LimitSpec::concurrent(limit.concurrent);
            if let Some(rate) = limit.per_second {
                spec = spec.per_second(rate);
            }
            if let Some(burst) = limit.burst {
                spec = spec.burst(burst);
            }
            spec.validate().map_err(|e| format!("{}: limits.{name}: {e}", path.display()))?;
            options.limits.insert(name, spec);
        }
        Ok(options)
    }
}

/// The operational settings of `lanes serve`: each is a flag (`--max-limits`), a `LANES_*`
/// environment variable (`LANES_MAX_LIMITS`) and a `lanes.toml` key (`max_limits`). Unset
/// ones keep the [`ServeOptions`] default.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// The address to listen on [default: 127.0.0.1:7878].
    #[arg(long, env = "LANES_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Keep limits in this Redis (`redis://host:port`) so several servers share them
    /// [default: in this process].
    #[arg(long, env = "LANES_REDIS")]
    pub redis: Option<String>,
    /// The Redis namespace of the limits [default: lanes].
    #[arg(long, env = "LANES_NAMESPACE")]
    pub namespace: Option<String>,
    /// A file of API tokens (`[[tokens]]` tables: `role`, `token`, `clients`, `name`). Tokens
    /// are never given on the command line; `LANES_TOKENS` holds them as `role:secret` or
    /// `client:secret:id1,id2` entries separated by spaces.
    #[arg(long, env = "LANES_TOKENS_FILE")]
    pub tokens_file: Option<PathBuf>,
    /// Serve without tokens on a non-loopback address: anyone who reaches it may define,
    /// delete and hold every limit.
    #[arg(long, env = "LANES_INSECURE_NO_AUTH", num_args = 0..=1, default_missing_value = "true")]
    pub insecure_no_auth: Option<bool>,
    /// The `Host` names accepted, comma-separated (`*`: any) [default: on loopback,
    /// localhost and the loopback addresses; elsewhere, any].
    #[arg(long, env = "LANES_ALLOWED_HOSTS", value_delimiter = ',')]
    pub allowed_hosts: Option<Vec<String>>,
    /// The most limits [default: 10000] (on Redis, in the whole namespace).
    #[arg(long, env = "LANES_MAX_LIMITS")]
    pub max_limits: Option<usize>,
    /// The most clients with a session [default: 100000].
    #[arg(long, env = "LANES_MAX_CLIENTS")]
    pub max_clients: Option<usize>,
    /// The most tickets waiting per limit (more are refused with 429) [default: 100000].
    #[arg(long, env = "LANES_MAX_WAITERS")]
    pub max_waiters: Option<usize>,
    /// The longest an acquire long-polls [default: 30000].
    #[arg(long, env = "LANES_MAX_WAIT_MS")]
    pub max_wait_ms: Option<u64>,
    /// The lease of a permit whose acquire names none [default: 10000].
    #[arg(long, env = "LANES_DEFAULT_LEASE_MS")]
    pub default_lease_ms: Option<u64>,
    /// The longest lease a client may ask for; after Redis loses its state, grants wait this
    /// long, and a limit made new on a Redis up less than this waits the rest of it
    /// [default: 60000].
    #[arg(long, env = "LANES_MAX_LEASE_MS")]
    pub max_lease_ms: Option<u64>,
    /// How long a queued ticket nobody asks about keeps its place [default: 2000].
    #[arg(long, env = "LANES_QUEUE_GRACE_MS")]
    pub queue_grace_ms: Option<u64>,
    /// The most bytes of a request body [default: 65536].
    #[arg(long, env = "LANES_MAX_BODY")]
    pub max_body: Option<usize>,
    /// The most bytes of a request's head [default: 16384].
    #[arg(long, env = "LANES_MAX_HEADER_BYTES")]
    pub max_header_bytes: Option<usize>,
    /// Serve HTTPS: the certificate chain (PEM), with `--tls-key`.
    #[arg(long, env = "LANES_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// Serve HTTPS: the private key (PEM), with `--tls-cert`.
    #[arg(long, env = "LANES_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// The most open connections [default: 1024].
    #[arg(long, env = "LANES_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// How long a connection may take to send a request's headers, from when it opened or
    /// answered its last request; also closes idle keep-alive connections [default: 10000].
    #[arg(long, env = "LANES_HEADER_TIMEOUT_MS")]
    pub header_timeout_ms: Option<u64>,
    /// How long a request's body may take to arrive [default: 10000].
    #[arg(long, env = "LANES_BODY_TIMEOUT_MS")]
    pub body_timeout_ms: Option<u64>,
    /// How long a stop waits for open requests before dropping them [default: 10000].
    #[arg(long, env = "LANES_SHUTDOWN_TIMEOUT_MS")]
    pub shutdown_timeout_ms: Option<u64>,
}

impl ServeOptions {
    /// Applies the settings that are set (a tokens file adds its tokens).
    ///
    /// # Errors
    ///
    /// The tokens file cannot be read.
    pub fn apply(&mut self, settings: Settings) -> Result<(), BoxError> {
        let ms = Duration::from_millis;
        let Settings {
            listen,
            redis,
            namespace,
            tokens_file,
            insecure_no_auth,
            allowed_hosts,
            max_limits,
            max_clients,
            max_waiters,
            max_wait_ms,
            default_lease_ms,
            max_lease_ms,
            queue_grace_ms,
            max_body,
            max_header_bytes,
            tls_cert,
            tls_key,
            max_connections,
            header_timeout_ms,
            body_timeout_ms,
            shutdown_timeout_ms,
        } = settings;
        self.listen = listen.unwrap_or(self.listen);
        self.redis = redis.or(self.redis.take());
        self.namespace = namespace.unwrap_or(std::mem::take(&mut self.namespace));
        if let Some(path) = tokens_file {
            self.tokens.extend(Self::tokens_from_file(&path)?);
        }
        self.insecure_no_auth = insecure_no_auth.unwrap_or(self.insecure_no_auth);
        self.allowed_hosts = allowed_hosts.unwrap_or(std::mem::take(&mut self.allowed_hosts));
        self.max_limits = max_limits.unwrap_or(self.max_limits);
        self.max_clients = max_clients.unwrap_or(self.max_clients);
        self.max_waiters = max_waiters.unwrap_or(self.max_waiters);
        self.max_wait = max_wait_ms.map_or(self.max_wait, ms);
        self.default_lease_ms = default_lease_ms.unwrap_or(self.default_lease_ms);
        self.max_lease = max_lease_ms.map_or(self.max_lease, ms);
        self.queue_grace = queue_grace_ms.map_or(self.queue_grace, ms);
        self.max_body = max_body.unwrap_or(self.max_body);
        self.max_header_bytes = max_header_bytes.unwrap_or(self.max_header_bytes);
        match (tls_cert, tls_key) {
            (Some(cert), Some(key)) => self.tls = Some(TlsFiles { cert, key }),
            (None, None) => {}
            _ => return Err("TLS needs both a certificate (tls_cert) and a key (tls_key)".into()),
        }
        self.max_connections = max_connections.unwrap_or(self.max_connections);
        self.header_timeout = header_timeout_ms.map_or(self.header_timeout, ms);
        self.body_timeout = body_timeout_ms.map_or(self.body_timeout, ms);
        self.shutdown_timeout = shutdown_timeout_ms.map_or(self.shutdown_timeout, ms);
        Ok(())
    }
}

/// The server's shared state.
pub(crate) struct App {
    backend: Arc<dyn LimitBackend>,
    sessions: Mutex<Sessions>,
    registry: Registry,
    prometheus: PrometheusHandle,
    events: Channel<&'static str>,
    shutdown: watch::Receiver<bool>,
    options: ServeOptions,
    tokens: auth::Tokens,
}

impl App {
    fn sessions(&self) -> MutexGuard<'_, Sessions> {
        self.sessions.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A running server.
#[derive(Debug)]
pub struct Server {
    /// The address it listens on.
    pub addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    done: tokio::task::JoinHandle<Result<(), std::io::Error>>,
}

impl Server {
    /// Starts serving; returns once the listener is bound.
    ///
    /// # Errors
    ///
    /// The address cannot be bound, Redis cannot be reached, or a configured limit is invalid.
    pub async fn start(options: ServeOptions) -> Result<Self, BoxError> {
        options.validate()?;
        let tls = match &options.tls {
            Some(files) => Some(listen::tls_acceptor(&files.cert, &files.key)?),
            None => None,
        };
        let backend: Arc<dyn LimitBackend> = match &options.redis {
            // Leases are the clients' (each acquire names one; renewals come over HTTP), so the
            // Redis client renews nothing on its own.
            Some(url) => Arc::new(
                lanes_redis::RedisLimits::builder(url.clone())
                    .namespace(options.namespace.clone())
                    .max_waiters(options.max_waiters)
                    .max_limits(options.max_limits)
                    .max_lease(options.max_lease)
                    .auto_renew(false)
                    .build()
                    .await?,
            ),
            None => Arc::new(
                LocalLimits::with_max_waiters(options.max_waiters)
                    .with_max_limits(options.max_limits),
            ),
        };
        for (name, spec) in &options.limits {
            backend.define(name, *spec).await?;
        }
        let registry = Registry::new();
        let channels = Channels::new();
        let events = channels
            .configure("events", ChannelConfig::new(4096).overflow(Overflow::DropOldest))?;
        // The events channel is the server's plumbing (it feeds `/metrics`), not the user's:
        // it is not registered, so the snapshot and the dashboard do not show it.
        let (shutdown, shutdown_rx) = watch::channel(false);
        let app = Arc::new(App {
            backend,
            sessions: Mutex::new(Sessions::new(options.max_clients, options.max_lease)),
            registry,
            prometheus: crate::embed::prometheus(),
            events: events.clone(),
            shutdown: shutdown_rx.clone(),
            options: options.clone(),
            tokens: auth::Tokens::new(&options.tokens),
        });
        tokio::spawn(count_events(events, channels));
        tokio::spawn(sweep(Arc::downgrade(&app)));
        let app_for_stop = app.clone();
        let router = router(app);
        let listener = tokio::net::TcpListener::bind(options.listen)
            .await
            .map_err(|e| format!("cannot listen on {}: {e}", options.listen))?;
        let addr = listener.local_addr()?;
        let transport = listen::Transport {
            tls,
            max_connections: options.max_connections,
            header_timeout: options.header_timeout,
            shutdown_timeout: options.shutdown_timeout,
            max_header_bytes: options.max_header_bytes,
        };
        let done = tokio::spawn(async move {
            listen::serve(listener, router, transport, shutdown_rx).await;
            // A clean stop withdraws every queued ticket, so no dead client is served later.
            let queued = app_for_stop.sessions().drain_queued();
            for lapsed in queued {
                let _ = app_for_stop.backend.release(&lapsed.limit, lapsed.backend).await;
            }
            Ok(())
        });
        Ok(Self { addr, shutdown, done })
    }

    /// Stops accepting, answers in-flight long-polls (as not granted yet), and waits for the
    /// connections to finish.
    ///
    /// # Errors
    ///
    /// The server failed.
    pub async fn shutdown(self) -> Result<(), BoxError> {
        let _ = self.shutdown.send(true);
        self.done.await??;
        Ok(())
    }
}

/// The router of the API.
pub(crate) fn router(app: Arc<App>) -> Router {
    let max_body = app.options.max_body;
    Router::new()
        .route("/", get(api::dashboard))
        .route("/healthz", get(api::healthz))
        .route("/readyz", get(api::readyz))
        .route("/openapi.json", get(api::openapi))
        .route("/metrics", get(api::metrics))
        .route("/v1/snapshot", get(api::snapshot))
        .route("/v1/limits", get(api::list))
        .route("/v1/limits/{name}", get(api::get).put(api::define).delete(api::remove))
        .route("/v1/limits/{name}/acquire", post(api::acquire))
        .route("/v1/limits/{name}/release", post(api::release))
        .route("/v1/limits/{name}/share", post(api::share))
        .route("/v1/clients/{client}/renew", post(api::renew))
        .fallback(api::not_found)
        // Innermost: a body is read only for a request its token allows.
        .layer(middleware::from_fn_with_state(app.clone(), body_within_timeout))
        .layer(middleware::from_fn_with_state(app.clone(), auth::guard))
        .layer(middleware::from_fn_with_state(app.clone(), guard))
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(app)
}

/// Refuses oversized headers, counts requests by route and status, logs them, and turns any error response without a JSON body (a method
/// not allowed, say) into one.
async fn guard(
    axum::extract::State(app): axum::extract::State<Arc<App>>,
    request: Request,
    next: Next,
) -> Response {
    // The whole head: the request line (method, target, version) and the header fields.
    let target = request.uri().path_and_query().map_or(0, |target| target.as_str().len());
    let line = request.method().as_str().len() + target + " HTTP/1.1\r\n".len() + 1;
    let header_bytes: usize =
        line + request.headers().iter().map(|(k, v)| k.as_str().len() + v.len() + 4).sum::<usize>();
    if header_bytes > app.options.max_header_bytes {
        return ApiError::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            format!(
                "the request head is larger than {} bytes (--max-header-bytes)",
                app.options.max_header_bytes
            ),
        )
        .code("headers_too_large")
        .into_response();
    }
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let (method, path) = (request.method().clone(), request.uri().path().to_owned());
    let started = std::time::Instant::now();
    let response = next.run(request).await;
    let status = response.status();
    let client = response.extensions().get::<auth::Principal>().map_or("-", |p| &*p.name);
    tracing::info!(
        target: "lanes::access",
        %method,
        path,
        status = status.as_u16(),
        latency_us = started.elapsed().as_micros() as u64,
        client,
        "request"
    );
    metrics::counter!(
        "lanes_http_requests_total",
        "route" => route,
        "status" => status.as_u16().to_string()
    )
    .increment(1);
    let is_json = response
        .headers()
        .get("content-type")
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if (status.is_client_error() || status.is_server_error()) && !is_json {
        return ApiError::new(status, status.canonical_reason().unwrap_or("error")).into_response();
    }
    response
}

/// Reads the body within the body timeout and `--max-body`, after the request's token was
/// checked, and only for the requests that take one (each needs a role): a request nobody may
/// make, or one to a public path, holds no buffer and no wait for its body.
async fn body_within_timeout(
    axum::extract::State(app): axum::extract::State<Arc<App>>,
    request: Request,
    next: Next,
) -> Response {
    let route = request.extensions().get::<axum::extract::MatchedPath>().map(|p| p.as_str());
    let takes_body = matches!(
        (request.method().as_str(), route),
        ("PUT", Some("/v1/limits/{name}"))
            | (
                "POST",
                Some(
                    "/v1/limits/{name}/acquire"
                        | "/v1/limits/{name}/release"
                        | "/v1/limits/{name}/share"
                        | "/v1/clients/{client}/renew"
                )
            )
    );
    if !takes_body {
        let (parts, _unread) = request.into_parts();
        return next.run(Request::from_parts(parts, axum::body::Body::empty())).await;
    }
    match read_body(&app.options, request).await {
        Ok(request) => next.run(request).await,
        Err(refused) => refused.into_response(),
    }
}

/// Reads a request's body whole within the body timeout (a client trickling its body cannot
/// hold a handler), bounded by the body limit.
async fn read_body(options: &ServeOptions, request: Request) -> Result<Request, ApiError> {
    let (parts, body) = request.into_parts();
    let read = axum::body::to_bytes(body, options.max_body);
    match tokio::time::timeout(options.body_timeout, read).await {
        Ok(Ok(bytes)) => Ok(Request::from_parts(parts, axum::body::Body::from(bytes))),
        Ok(Err(err)) => {
            let too_large =
                std::iter::successors(Some(&err as &(dyn std::error::Error + 'static)), |e| {
                    e.source()
                })
                .any(|e| e.to_string().contains("length limit"));
            Err(if too_large {
                ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("the body is larger than {} bytes (--max-body)", options.max_body),
                )
                .code("body_too_large")
            } else {
                ApiError::new(StatusCode::BAD_REQUEST, format!("the body could not be read: {err}"))
            })
        }
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the body did not arrive within {} ms (--body-timeout-ms)",
                options.body_timeout.as_millis()
            ),
        )
        .code("body_timeout")),
    }
}

/// Withdraws the queued tickets of clients gone silent past the queue grace, and forgets the
/// permits whose leases ended in the backend (asked about once past the lease the server last
/// granted or renewed them with, or once their client went silent).
async fn sweep(app: std::sync::Weak<App>) {
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut probed = Instant::now();
    loop {
        tick.tick().await;
        let Some(app) = app.upgrade() else { return };
        let now = Instant::now();
        let (withdraw, probe) = app.sessions().sweep(now, app.options.queue_grace);
        for lapsed in withdraw {
            let _ = app.backend.release(&lapsed.limit, lapsed.backend).await;
            app.event("waiter_withdrawn");
        }
        if now.duration_since(probed) < Duration::from_secs(1) {
            continue;
        }
        probed = now;
        for lapsed in probe {
            let only = Some(lapsed.backend);
            match app.backend.check(&lapsed.limit, lapsed.backend, None).await {
                // A deleted limit's permits are finished too (renew answers them lost alike).
                // (The backend ends a lease run out, a permit of a leased limit's share too.)
                Ok(lanes::Answer::Finished) | Err(lanes::LimitError::UnknownLimit(_)) => {}
                _ => continue,
            }
            let finished = Some(Instant::now());
            let _ =
                app.sessions().forget(&lapsed.client, &lapsed.limit, lapsed.ticket, only, finished);
            app.event("lease_expired");
        }
    }
}

/// Turns the events channel into Prometheus counters (`lanes_server_events_total{kind}`).
async fn count_events(events: Channel<&'static str>, _channels: Channels) {
    let Ok(mut consumer) = events
        .consumer(ConsumerOptions::new().batch_max(256).batch_flush(Duration::from_millis(100)))
    else {
        return;
    };
    drop(events);
    while let Some(batch) = consumer.next_batch().await {
        let mut counts: BTreeMap<&'static str, u64> = BTreeMap::new();
        for kind in batch.iter() {
            *counts.entry(kind).or_default() += 1;
        }
        for (kind, n) in counts {
            metrics::counter!("lanes_server_events_total", "kind" => kind).increment(n);
        }
        let _ = batch.ack().await;
    }
}

/// Runs `lanes serve` until SIGINT or SIGTERM; prints the address and dashboard URL first.
///
/// # Errors
///
/// As for [`Server::start`].
pub async fn run(options: ServeOptions) -> Result<(), BoxError> {
    let server = Server::start(options.clone()).await?;
    let scheme = if options.tls.is_some() { "https" } else { "http" };
    println!("lanes serve: listening on {scheme}://{}", server.addr);
    if options.tokens.is_empty() {
        println!(
            "  auth        none: anyone who can reach {} may define, delete and hold limits",
            server.addr
        );
    } else {
        println!("  auth        {} API token(s), Authorization: Bearer", options.tokens.len());
    }
    println!("  dashboard   {scheme}://{}/", server.addr);
    println!("  API         {scheme}://{}/openapi.json", server.addr);
    let store = options.redis.as_deref().map(lanes_redis::redacted);
    println!("  limits in   {}", store.as_deref().unwrap_or("this process (embedded)"));
    shutdown_signal().await;
    println!("lanes serve: shutting down");
    server.shutdown().await
}

/// A TOML file's error, by line and column, without the source line the parser quotes (it
/// may hold a token's secret).
pub(crate) fn toml_error(path: &std::path::Path, text: &str, err: &toml::de::Error) -> String {
    let place = err.span().map(|span| {
        let before = &text[..span.start.min(text.len())];
        let line = before.matches('\n').count() + 1;
        let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        format!(", line {line}, column {column}")
    });
    format!("{}{}: {}", path.display(), place.unwrap_or_default(), err.message())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        let terminated = async {
            match term.as_mut() {
                Some(term) => {
                    term.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = ctrl_c => {}
            () = terminated => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
