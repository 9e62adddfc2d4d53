//! [`RemoteLimits`]: a [`LimitBackend`] over the HTTP API of `lanes serve`.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use lanes::limit::{Grant, LimitBackend, LimitError, LimitInfo, LimitSpec};
use lanes::{Answer, BoxFuture, Priority};
use serde::Deserialize;
use serde_json::{Value, json};

/// A client of a `lanes serve`: use a shared server exactly like a local
/// [`Limits`](lanes::Limits).
///
/// Every permit is a lease of `lease` (default 10 s) on the server, renewed in the background
/// (one request for all of the client's permits, every third of a lease) while this client
/// lives. Waiting is a long-poll: the server answers as soon as the ticket is granted.
///
/// # Example
///
/// ```no_run
/// use lanes::{LimitSpec, Limits, Priority};
/// use lanes_server::RemoteLimits;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let limits = Limits::with_backend(RemoteLimits::new("http://127.0.0.1:7878")?);
/// limits.define("payments-api", LimitSpec::concurrent(10)).await?;
/// let permit = limits.acquire("payments-api", Priority::default()).await?;
/// # drop(permit);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RemoteLimits {
    inner: Arc<Inner>,
}

struct Inner {
    base: String,
    http: reqwest::Client,
    client: String,
    tickets: AtomicU64,
    lease: Duration,
    /// Grants a long-poll received, for the acquire that follows it.
    granted: Mutex<HashMap<(String, u64), Grant>>,
    renewer: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(task) = lock(&self.renewer).take() {
            task.abort();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn transport(err: reqwest::Error) -> LimitError {
    LimitError::Backend(format!("lanes serve: {err}"))
}

#[derive(Deserialize)]
struct AcquireReply {
    granted: bool,
    #[serde(default)]
    fencing_token: u64,
    #[serde(default)]
    retry_after_ms: u64,
    #[serde(default)]
    reason: String,
}

#[derive(Deserialize)]
struct LimitReply {
    name: String,
    concurrent: u32,
    per_second: Option<f64>,
    burst: u32,
    in_use: u32,
    waiting: usize,
    max_in_use: u32,
    granted_total: u64,
}

impl LimitReply {
    fn info(self) -> LimitInfo {
        let spec = LimitSpec {
            concurrent: self.concurrent,
            per_second: self.per_second,
            burst: self.burst,
        };
        LimitInfo::new(
            self.name,
            spec,
            self.in_use,
            self.waiting,
            self.granted_total,
            self.max_in_use,
        )
    }
}

/// Turns an error response into the `LimitError` it stands for.
async fn failure(name: &str, response: reqwest::Response) -> LimitError {
    let status = response.status();
    let body: Value = response.json().await.unwrap_or(Value::Null);
    let message = body["error"].as_str().unwrap_or("").to_owned();
    match status.as_u16() {
        404 => LimitError::UnknownLimit(name.to_owned()),
        409 => LimitError::InUse(name.to_owned()),
        429 => LimitError::TooManyWaiters { limit: name.to_owned(), max: 0 },
        code => LimitError::Backend(format!("lanes serve: {code} {message}")),
    }
}

impl RemoteLimits {
    /// A client of the server at `base` (`http://host:port`), with a generated client id and a
    /// 10 s lease. Call inside a tokio runtime (the renewal task starts here).
    ///
    /// # Errors
    ///
    /// [`LimitError::Backend`] if the HTTP client cannot be built.
    pub fn new(base: impl Into<String>) -> Result<Self, LimitError> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let client = format!(
            "rust-{}-{nanos:x}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        Self::with_client(base, client, Duration::from_secs(10))
    }

    /// A client with its own id and lease.
    ///
    /// # Errors
    ///
    /// [`LimitError::Backend`] if the HTTP client cannot be built.
    pub fn with_client(
        base: impl Into<String>,
        client: impl Into<String>,
        lease: Duration,
    ) -> Result<Self, LimitError> {
        let http =
            reqwest::Client::builder().pool_max_idle_per_host(64).build().map_err(transport)?;
        let inner = Arc::new(Inner {
            base: base.into().trim_end_matches('/').to_owned(),
            http,
            client: client.into(),
            tickets: AtomicU64::new(1),
            lease,
            granted: Mutex::new(HashMap::new()),
            renewer: Mutex::new(None),
        });
        let task = tokio::spawn(renew(Arc::downgrade(&inner)));
        *lock(&inner.renewer) = Some(task);
        Ok(Self { inner })
    }

    /// The client id the server knows this client by.
    pub fn client_id(&self) -> &str {
        &self.inner.client
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.inner.base)
    }

    fn limit_url(&self, name: &str, tail: &str) -> String {
        let mut encoded = String::new();
        for byte in name.bytes() {
            if byte.is_ascii_alphanumeric() || b"-_.~".contains(&byte) {
                encoded.push(char::from(byte));
            } else {
                encoded.push_str(&format!("%{byte:02X}"));
            }
        }
        self.url(&format!("/v1/limits/{encoded}{tail}"))
    }

    /// Sends `request`; a non-success status becomes the `LimitError` it stands for.
    async fn send(
        &self,
        name: &str,
        request: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, LimitError> {
        let response = request.send().await.map_err(transport)?;
        if !response.status().is_success() {
            return Err(failure(name, response).await);
        }
        Ok(response)
    }

    async fn ask(
        &self,
        name: &str,
        ticket: u64,
        priority: &Priority,
        wait: Duration,
    ) -> Result<AcquireReply, LimitError> {
        let body = json!({
            "client": self.inner.client,
            "ticket": ticket,
            "priority": {
                "level": priority.level,
                "key": priority.fairness_key.as_deref(),
                "weight": priority.fairness_weight.max(1),
            },
            "lease_ms": self.inner.lease.as_millis() as u64,
            "wait_ms": wait.as_millis() as u64,
        });
        let request = self.inner.http.post(self.limit_url(name, "/acquire")).json(&body);
        self.send(name, request).await?.json().await.map_err(transport)
    }
}

/// Renews every lease of the client, every third of a lease.
async fn renew(inner: Weak<Inner>) {
    let period = match inner.upgrade() {
        Some(inner) => inner.lease / 3,
        None => return,
    };
    let mut tick = tokio::time::interval(period);
    loop {
        tick.tick().await;
        let Some(inner) = inner.upgrade() else { return };
        let url = format!("{}/v1/clients/{}/renew", inner.base, inner.client);
        // A 404 means no session (nothing held or waiting): nothing to renew.
        let _ = inner.http.post(url).send().await;
    }
}

impl fmt::Debug for RemoteLimits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteLimits")
            .field("server", &self.inner.base)
            .field("client", &self.inner.client)
            .field("lease", &self.inner.lease)
            .finish()
    }
}

impl LimitBackend for RemoteLimits {
    fn ticket(&self) -> u64 {
        self.inner.tickets.fetch_add(1, Ordering::Relaxed)
    }

    fn define<'a>(
        &'a self,
        name: &'a str,
        spec: LimitSpec,
    ) -> BoxFuture<'a, Result<(), LimitError>> {
        Box::pin(async move {
            spec.validate()?;
            let body = json!({ "concurrent": spec.concurrent, "per_second": spec.per_second, "burst": spec.burst });
            self.send(name, self.inner.http.put(self.limit_url(name, "")).json(&body)).await?;
            Ok(())
        })
    }

    fn remove<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), LimitError>> {
        Box::pin(async move {
            self.send(name, self.inner.http.delete(self.limit_url(name, ""))).await?;
            Ok(())
        })
    }

    fn acquire<'a>(
        &'a self,
        name: &'a str,
        ticket: u64,
        priority: &'a Priority,
    ) -> BoxFuture<'a, Result<Answer, LimitError>> {
        Box::pin(async move {
            if let Some(grant) = lock(&self.inner.granted).remove(&(name.to_owned(), ticket)) {
                return Ok(Answer::Granted(grant));
            }
            let reply = self.ask(name, ticket, priority, Duration::ZERO).await?;
            Ok(if reply.granted {
                // The lease is the server's, renewed by this client: no expiry to report.
                Answer::Granted(Grant { fencing_token: reply.fencing_token, expires_at: None })
            } else if reply.reason == "rate" {
                Answer::RetryAfter(Duration::from_millis(reply.retry_after_ms))
            } else {
                Answer::Queued
            })
        })
    }

    fn wait<'a>(&'a self, name: &'a str, ticket: u64, at_most: Duration) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            // A long-poll: the server answers when the ticket is granted (or at `at_most`).
            match self.ask(name, ticket, &Priority::default(), at_most).await {
                Ok(reply) if reply.granted => {
                    let grant = Grant { fencing_token: reply.fencing_token, expires_at: None };
                    lock(&self.inner.granted).insert((name.to_owned(), ticket), grant);
                }
                Ok(_) => {}
                // The next acquire reports the failure; do not spin meanwhile.
                Err(_) => tokio::time::sleep(at_most.min(Duration::from_millis(200))).await,
            }
        })
    }

    fn release<'a>(&'a self, name: &'a str, ticket: u64) -> BoxFuture<'a, Result<(), LimitError>> {
        Box::pin(async move {
            lock(&self.inner.granted).remove(&(name.to_owned(), ticket));
            let body = json!({ "client": self.inner.client, "ticket": ticket });
            let request = self.inner.http.post(self.limit_url(name, "/release")).json(&body);
            self.send(name, request).await?;
            Ok(())
        })
    }

    fn info<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<LimitInfo>, LimitError>> {
        Box::pin(async move {
            match self.send(name, self.inner.http.get(self.limit_url(name, ""))).await {
                Ok(response) => {
                    let reply: LimitReply = response.json().await.map_err(transport)?;
                    Ok(Some(reply.info()))
                }
                Err(LimitError::UnknownLimit(_)) => Ok(None),
                Err(err) => Err(err),
            }
        })
    }

    fn list(&self) -> BoxFuture<'_, Result<Vec<LimitInfo>, LimitError>> {
        Box::pin(async move {
            #[derive(Deserialize)]
            struct List {
                limits: Vec<LimitReply>,
            }
            let response = self.send("*", self.inner.http.get(self.url("/v1/limits"))).await?;
            let list: List = response.json().await.map_err(transport)?;
            Ok(list.limits.into_iter().map(LimitReply::info).collect())
        })
    }
}
