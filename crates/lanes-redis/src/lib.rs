//! Distributed limits for [`lanes`] on Redis: a [`LimitBackend`] whose limits are shared by
//! every process that points at the same Redis.
//!
//! [`RedisLimits`] keeps the semantics of the in-process backend — the same wait order (highest
//! priority level first, weighted round-robin over fairness keys, arrival order within a key, no
//! barging), a semaphore and a GCRA token bucket per limit, idempotent acquire by ticket,
//! release that withdraws a waiting ticket, a bounded waiting room — and adds what a fleet
//! needs:
//!
//! - **One round trip per operation.** Each acquire, release and renewal is one atomic Lua
//!   script. The Redis server's clock (`TIME`) is the only clock, so clients with skewed clocks
//!   agree. Every key of a limit shares one hash tag (`{namespace:limit}`): one Redis Cluster
//!   slot.
//! - **Leases and fencing.** Every permit is a lease of `lease` (default 3 s), renewed in the
//!   background while it is held. A holder that crashes, or is cut off, loses its permits when
//!   their leases end — not before, so a limit holds across failover. Every grant carries a
//!   fencing token, strictly increasing per limit: hand it to the downstream so it can refuse a
//!   stale holder. A renewal that comes too late is refused with
//!   [`LimitError::LeaseExpired`].
//! - **Pushed waiters.** A release, an expiry or a redefinition tells only the client whose
//!   ticket the queue serves next (a per-client Redis channel), not every waiter. That client
//!   asks once, for one of its tickets; the script grants whichever of the client's tickets is
//!   next and says which ([`answer`]), so a client's traffic is O(limits), not O(waiters). A
//!   waiter answered "retry after" (the bucket is empty) sleeps until then; the first waiter of
//!   a client also wakes when the earliest lease of the limit can lapse, so a crashed holder's
//!   permit moves on promptly.
//! - **An outage policy** for when Redis is unreachable or slow ([`OutagePolicy`]).
//!
//! # Outages
//!
//! Every Redis call is bounded by `op_timeout` (default 500 ms). When a call fails for lack of
//! Redis:
//!
//! - [`OutagePolicy::FailClosed`] (the default): the acquire fails with
//!   [`LimitError::Backend`]; nobody runs without a permit.
//! - [`OutagePolicy::FailOpen`]: the acquire is granted without a permit (fencing token 0);
//!   counted in [`RedisStats::open_grants`].
//! - [`OutagePolicy::LocalShare`]`(fraction)`: the acquire goes to an in-process limit with that
//!   share of the spec (`concurrent`, `per_second` and `burst` scaled down, at least 1), so a
//!   fleet of `1 / fraction` processes stays near the global limit. The spec must be known to
//!   this client: limits it defined, or read once (the client reads a limit's spec the first
//!   time it acquires it under this policy).
//!
//! Permits held when Redis goes away stay with their holders: renewals fail, so on the server
//! their leases end `lease` after the last renewal and the permits return to the pool (a Redis
//! that restarted empty has forgotten them already). When Redis is back, renewals of lapsed
//! permits are refused — the holder's fencing token is stale, which is what fencing is for —
//! and they are counted in [`RedisStats::lost_leases`]. Releases that could not reach Redis are
//! retried in the background. A limit a restarted Redis no longer knows is defined again from
//! the spec this client gave it. Tickets that fell back to the local share stay local until
//! released; new acquires go to Redis again as soon as it answers.
//!
//! # Example
//!
//! ```no_run
//! use lanes::{LimitSpec, Limits, Priority};
//! use lanes_redis::RedisLimits;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let backend = RedisLimits::builder("redis://127.0.0.1:6379").namespace("checkout").build().await?;
//! let limits = Limits::with_backend(backend);
//! limits.define("payments-api", LimitSpec::concurrent(10).per_second(100.0)).await?;
//!
//! let permit = limits.acquire("payments-api", Priority::default().key("tenant-42")).await?;
//! // Pass permit.fencing_token() to the downstream so it can refuse a stale holder.
//! drop(permit);
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]

pub mod answer;

/// The workspace README's examples (which use this crate as well as `lanes`), compiled and run
/// as doctests.
#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use lanes::limit::{
    BackendError, Grant, LimitBackend, LimitError, LimitInfo, LimitSpec, LocalLimits, LostLeases,
    Released,
};
use lanes::{Answer, BoxFuture, Priority};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{RedisError, Script, Value};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use answer::ScriptAnswer;

const SCRIPT: &str = include_str!("limits.lua");

/// Tickets carry their client in the bits above this shift (and stay below 2^53, Lua's exact
/// integers).
const CLIENT_SHIFT: u32 = 32;
const CLIENT_BITS: u32 = 21;

/// How long a waiter that is not its client's first waiter on a limit sleeps before asking on
/// its own: a safety net only (the first waiter asks for the client, and a grant wakes its
/// ticket).
const SAFETY_REASK: Duration = Duration::from_secs(10);

/// How long a client's first waiter on a limit sleeps before asking anyway, for the client's
/// waiters: a safety net for a lost notification.
const FIRST_REASK: Duration = Duration::from_secs(1);

/// What a client does when Redis cannot answer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OutagePolicy {
    /// Acquires fail with [`LimitError::Backend`] (the default).
    FailClosed,
    /// Acquires are granted without a permit.
    FailOpen,
    /// Acquires fall back to an in-process limit with this share (in `(0, 1]`) of the spec.
    LocalShare(f64),
}

/// Builds a [`RedisLimits`].
#[derive(Debug, Clone)]
pub struct RedisLimitsBuilder {
    url: String,
    namespace: String,
    lease: Duration,
    max_waiters: usize,
    outage: OutagePolicy,
    op_timeout: Duration,
    auto_renew: bool,
    max_lease: Option<Duration>,
    queue_grace: Duration,
}

impl RedisLimitsBuilder {
    /// The longest lease any client of the namespace uses (default: this client's lease). After
    /// Redis lost its state, no permit is granted until this long after the loss was seen, so
    /// every lease that could still be believed held has ended first.
    pub fn max_lease(mut self, max_lease: Duration) -> Self {
        self.max_lease = Some(max_lease);
        self
    }

    /// How long a client may go unheard before its queued tickets are dropped from the queues
    /// (default 2 s; the client touches its limits well within it while it lives).
    pub fn queue_grace(mut self, grace: Duration) -> Self {
        self.queue_grace = grace;
        self
    }

    /// Keys and channels are prefixed with `namespace` (default `"lanes"`): clients that share
    /// a namespace share its limits.
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = namespace.into();
        self
    }

    /// How long a permit lasts without a renewal (default 3 s, at least 100 ms).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The most tickets waiting per limit (default 100,000).
    pub fn max_waiters(mut self, max_waiters: usize) -> Self {
        self.max_waiters = max_waiters;
        self
    }

    /// What to do when Redis cannot answer (default [`OutagePolicy::FailClosed`]).
    pub fn outage(mut self, policy: OutagePolicy) -> Self {
        self.outage = policy;
        self
    }

    /// The longest any Redis call may take (default 500 ms).
    pub fn op_timeout(mut self, timeout: Duration) -> Self {
        self.op_timeout = timeout;
        self
    }

    /// Whether held permits are renewed in the background (default true). Without it, hold a
    /// permit for less than the lease or call [`RedisLimits::renew`].
    pub fn auto_renew(mut self, auto_renew: bool) -> Self {
        self.auto_renew = auto_renew;
        self
    }

    /// Connects, takes a client id, subscribes to the client's channel and starts the renewal
    /// task. Call inside a tokio runtime.
    ///
    /// # Errors
    ///
    /// [`LimitError::Backend`] if Redis cannot be reached or the options are invalid.
    pub async fn build(self) -> Result<RedisLimits, LimitError> {
        if self.lease < Duration::from_millis(100) {
            return Err(LimitError::backend("the lease must be at least 100 ms"));
        }
        if let OutagePolicy::LocalShare(share) = self.outage
            && !(share > 0.0 && share <= 1.0)
        {
            return Err(LimitError::backend("a local share must be in (0, 1]"));
        }
        if self.op_timeout.is_zero() {
            return Err(LimitError::backend("the op timeout must be longer than zero"));
        }
        if self.queue_grace < Duration::from_millis(500) {
            return Err(LimitError::backend("the queue grace must be at least 500 ms"));
        }
        let max_lease = self.max_lease.unwrap_or(self.lease).max(self.lease);
        let client = redis::Client::open(self.url.as_str()).map_err(backend)?;
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(self.op_timeout))
            .set_connection_timeout(Some(self.op_timeout))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500));
        let mut conn = tokio::time::timeout(
            self.op_timeout * 4,
            ConnectionManager::new_with_config(client.clone(), config),
        )
        .await
        .map_err(|_| LimitError::backend(format!("redis at {} did not answer", self.url)))?
        .map_err(backend)?;
        let ns = &self.namespace;
        let id: u64 = redis::cmd("INCR")
            .arg(format!("lanes:{{{ns}}}:clients"))
            .query_async(&mut conn)
            .await
            .map_err(backend)?;
        let client_id = id % (1 << CLIENT_BITS);
        let epoch =
            ensure_epoch(&mut conn, &format!("lanes:{{{ns}}}:epoch")).await.map_err(backend)?;
        let inner = Arc::new(Inner {
            conn,
            script: Script::new(SCRIPT),
            namespace: self.namespace.clone(),
            channel_prefix: format!("lanes:{ns}:client:"),
            client: client_id,
            next_ticket: AtomicU64::new(1),
            lease: self.lease,
            max_waiters: self.max_waiters,
            outage: self.outage,
            op_timeout: self.op_timeout,
            max_lease,
            queue_grace: self.queue_grace,
            epoch: Mutex::new(None),
            lost: LostLeases::default(),
            state: Mutex::new(State::default()),
            local: Arc::new(LocalLimits::with_max_waiters(self.max_waiters)),
            stats: Stats::default(),
            tasks: Mutex::new(Vec::new()),
        });
        *lock(&inner.epoch) = Some(epoch);
        let (subscribed_tx, subscribed) = tokio::sync::oneshot::channel();
        let subscriber = tokio::spawn(subscribe(client, Arc::downgrade(&inner), subscribed_tx));
        let renewer = tokio::spawn(maintain(Arc::downgrade(&inner), self.auto_renew));
        lock(&inner.tasks).extend([subscriber, renewer]);
        // Waiters are pushed: be listening before the first acquire.
        let _ = tokio::time::timeout(self.op_timeout * 4, subscribed).await;
        Ok(RedisLimits { inner })
    }
}

/// A [`LimitBackend`] on Redis. See the [crate docs](crate).
#[derive(Clone)]
pub struct RedisLimits {
    inner: Arc<Inner>,
}

/// Counters of one client.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisStats {
    /// Redis calls that failed for lack of Redis.
    pub outages: u64,
    /// Acquires granted without a permit under [`OutagePolicy::FailOpen`].
    pub open_grants: u64,
    /// Acquires sent to the local share under [`OutagePolicy::LocalShare`].
    pub local_acquires: u64,
    /// Held permits whose renewal was refused because their lease had ended.
    pub lost_leases: u64,
    /// Notifications received (each one lets the client's first waiter of a limit ask).
    pub notifications: u64,
    /// Limits defined again after Redis forgot them.
    pub redefinitions: u64,
    /// Script calls made (acquires, releases, renewals, infos, definitions).
    pub calls: u64,
}

#[derive(Default)]
struct Stats {
    outages: AtomicU64,
    open_grants: AtomicU64,
    local_acquires: AtomicU64,
    lost_leases: AtomicU64,
    notifications: AtomicU64,
    redefinitions: AtomicU64,
    calls: AtomicU64,
}

struct Inner {
    conn: ConnectionManager,
    script: Script,
    namespace: String,
    channel_prefix: String,
    client: u64,
    next_ticket: AtomicU64,
    lease: Duration,
    max_waiters: usize,
    outage: OutagePolicy,
    op_timeout: Duration,
    max_lease: Duration,
    queue_grace: Duration,
    /// The namespace's epoch as this client last saw it: a different or missing one means
    /// Redis lost its state.
    epoch: Mutex<Option<String>>,
    /// Permits known lost (lease refused, or Redis lost its state), until released.
    lost: LostLeases,
    state: Mutex<State>,
    local: Arc<LocalLimits>,
    stats: Stats,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for task in lock(&self.tasks).drain(..) {
            task.abort();
        }
    }
}

#[derive(Default)]
struct State {
    limits: HashMap<String, ClientLimit>,
    /// Specs this client defined or read, for the local share and for redefinition.
    specs: HashMap<String, LimitSpec>,
    /// Releases that could not reach Redis, retried in the background.
    orphans: Vec<(String, u64)>,
}

/// This client's tickets on one limit.
#[derive(Default)]
struct ClientLimit {
    /// Tickets queued on the server, each with its waker. The first is the client's asker.
    waiting: BTreeMap<u64, Arc<Notify>>,
    /// Waiting tickets whose last answer was "retry after".
    retrying: HashSet<u64>,
    /// Tickets the server granted while another ticket asked, not yet claimed.
    granted: HashMap<u64, Grant>,
    /// Permits held on the server; renewed in the background unless `external`.
    held: BTreeSet<u64>,
    /// Tickets asked with their own lease: their holder renews them (the server's clients).
    external: HashSet<u64>,
    /// The priority of each waiting ticket's first ask, to queue it again if Redis lost it.
    priorities: HashMap<u64, Priority>,
    /// Tickets granted without a permit (fail-open).
    open: HashSet<u64>,
    /// Tickets living in the local share.
    local: HashSet<u64>,
    /// When the earliest lease of the limit can lapse (server's answer, in local time).
    next_expiry: Option<Instant>,
}

impl ClientLimit {
    fn wake_first(&self) {
        if let Some(notify) = self.waiting.values().next() {
            notify.notify_one();
        }
    }

    fn forget(&mut self, ticket: u64) {
        let was_first = self.waiting.keys().next() == Some(&ticket);
        self.waiting.remove(&ticket);
        self.retrying.remove(&ticket);
        self.priorities.remove(&ticket);
        if was_first {
            self.wake_first();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn backend<E: std::error::Error + Send + Sync + 'static>(err: E) -> LimitError {
    LimitError::Backend(BackendError::with_source(format!("redis: {err}"), err))
}

/// A failed Redis call: for lack of Redis (the outage policy applies) or another error.
enum CallError {
    Outage(String),
    Other(LimitError),
}

impl From<CallError> for LimitError {
    fn from(err: CallError) -> Self {
        match err {
            CallError::Outage(message) => {
                LimitError::backend(format!("redis unreachable: {message}"))
            }
            CallError::Other(err) => err,
        }
    }
}

fn is_outage(err: &RedisError) -> bool {
    err.is_io_error()
        || err.is_timeout()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
        || err.is_unrecoverable_error()
}

/// Which ask of a ticket.
#[derive(Clone)]
enum Ask {
    /// The first ask: queues the ticket at this priority unless granted.
    First(Priority),
    /// A later look: never queues.
    Check,
    /// Granted at once or nothing.
    Try,
}

/// What the acquire script said.
enum Reply {
    Answer(ScriptAnswer, Option<Grant>, Option<Duration>),
    Unknown,
    TooManyWaiters,
    Finished,
}

fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(n) => Some(n.to_string()),
        _ => None,
    }
}

fn int(value: &Value) -> Option<i64> {
    match value {
        Value::Int(n) => Some(*n),
        other => text(other)?.parse().ok(),
    }
}

fn error_tag(value: &Value) -> Option<String> {
    match value {
        Value::Array(items) if items.len() == 1 => text(&items[0]),
        _ => None,
    }
}

fn parse_grant(fence: &Value, expires: &Value) -> Option<Grant> {
    let fencing_token = u64::try_from(int(fence)?).ok()?;
    let expires_us = u64::try_from(int(expires)?).ok()?;
    Some(Grant { fencing_token, expires_at: Some(Duration::from_micros(expires_us)) })
}

impl Inner {
    fn base(&self, name: &str) -> String {
        format!("{{{}:{name}}}", self.namespace)
    }

    async fn call(&self, name: &str, op: &str, args: &[String]) -> Result<Value, CallError> {
        self.call_leased(name, op, self.lease, args).await
    }

    async fn call_leased(
        &self,
        name: &str,
        op: &str,
        lease: Duration,
        args: &[String],
    ) -> Result<Value, CallError> {
        let mut invocation = self.script.key(self.base(name));
        invocation
            .arg(op)
            .arg(&self.channel_prefix)
            .arg(lease.as_millis() as u64)
            .arg(self.queue_grace.as_millis() as u64)
            .arg(self.client);
        for arg in args {
            invocation.arg(arg);
        }
        let mut conn = self.conn.clone();
        self.stats.calls.fetch_add(1, Ordering::Relaxed);
        let result =
            tokio::time::timeout(self.op_timeout, invocation.invoke_async(&mut conn)).await;
        match result {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(err)) if is_outage(&err) => {
                self.stats.outages.fetch_add(1, Ordering::Relaxed);
                Err(CallError::Outage(err.to_string()))
            }
            Ok(Err(err)) => Err(CallError::Other(backend(err))),
            Err(_) => {
                self.stats.outages.fetch_add(1, Ordering::Relaxed);
                Err(CallError::Outage(format!("no answer within {:?}", self.op_timeout)))
            }
        }
    }

    async fn command<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T, CallError> {
        let mut conn = self.conn.clone();
        match tokio::time::timeout(self.op_timeout, cmd.query_async(&mut conn)).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(err)) if is_outage(&err) => Err(CallError::Outage(err.to_string())),
            Ok(Err(err)) => Err(CallError::Other(backend(err))),
            Err(_) => Err(CallError::Outage(format!("no answer within {:?}", self.op_timeout))),
        }
    }

    fn registry_key(&self) -> String {
        format!("lanes:{{{}}}:limits", self.namespace)
    }

    async fn define(&self, name: &str, spec: LimitSpec) -> Result<(), CallError> {
        self.define_held(name, spec, Duration::ZERO).await
    }

    /// Defines `name`; with a `hold`, no grant happens before `hold` from now (after Redis lost
    /// its state).
    async fn define_held(
        &self,
        name: &str,
        spec: LimitSpec,
        hold: Duration,
    ) -> Result<(), CallError> {
        let interval = spec.per_second.map_or(0, |rate| (1e6 / rate).ceil().max(1.0) as u64);
        let rate = spec.per_second.map_or_else(String::new, |rate| rate.to_string());
        let args = [
            spec.concurrent.to_string(),
            interval.to_string(),
            spec.burst.to_string(),
            rate,
            hold.as_millis().to_string(),
        ];
        self.call(name, "define", &args).await?;
        self.command::<()>(redis::cmd("SADD").arg(self.registry_key()).arg(name)).await?;
        lock(&self.state).specs.insert(name.to_owned(), spec);
        Ok(())
    }

    /// One script ask about `ticket`: the first ask (`Some(priority)`, may queue), a check
    /// (`None`, never queues), or a try.
    async fn ask_remote(
        &self,
        name: &str,
        ticket: u64,
        ask: &Ask,
        lease: Duration,
    ) -> Result<Reply, CallError> {
        let (op, args) = match ask {
            Ask::First(priority) => {
                let keytok = match &priority.fairness_key {
                    None => "_".to_owned(),
                    Some(key) => format!("k{key}"),
                };
                let args = vec![
                    ticket.to_string(),
                    priority.level.to_string(),
                    keytok,
                    priority.fairness_weight.max(1).to_string(),
                    self.max_waiters.to_string(),
                ];
                ("acquire", args)
            }
            Ask::Check => ("check", vec![ticket.to_string()]),
            Ask::Try => ("try", vec![ticket.to_string()]),
        };
        let value = self.call_leased(name, op, lease, &args).await?;
        let bad = || CallError::Other(LimitError::backend(format!("redis: odd answer {value:?}")));
        match error_tag(&value).as_deref() {
            Some("unknown") => return Ok(Reply::Unknown),
            Some("waiters") => return Ok(Reply::TooManyWaiters),
            Some("finished") => return Ok(Reply::Finished),
            _ => {}
        }
        let Value::Array(items) = &value else { return Err(bad()) };
        let hex = items.first().and_then(text).ok_or_else(bad)?;
        let answer = answer::decode_hex(ticket, &hex)
            .map_err(|e| CallError::Other(LimitError::backend(format!("redis: {e}"))))?;
        Ok(match answer {
            ScriptAnswer::Granted | ScriptAnswer::GrantedOther(_) => {
                let grant = match (items.get(1), items.get(2)) {
                    (Some(fence), Some(expires)) => parse_grant(fence, expires),
                    _ => None,
                };
                Reply::Answer(answer, Some(grant.ok_or_else(bad)?), None)
            }
            ScriptAnswer::Queued => {
                let hint = items.get(1).and_then(int).and_then(|ms| u64::try_from(ms).ok());
                Reply::Answer(answer, None, hint.map(Duration::from_millis))
            }
            ScriptAnswer::RetryAfter(_) => Reply::Answer(answer, None, None),
        })
    }

    /// Applies an answer to this client's bookkeeping.
    fn apply(
        &self,
        name: &str,
        ticket: u64,
        answer: ScriptAnswer,
        grant: Option<Grant>,
        hint: Option<Duration>,
    ) -> Answer {
        let mut state = lock(&self.state);
        let limit = state.limits.entry(name.to_owned()).or_default();
        if let Some(pushed) = limit.granted.remove(&ticket) {
            // Granted on its behalf (and pushed) while the answer travelled.
            limit.forget(ticket);
            return Answer::Granted(pushed);
        }
        match answer {
            ScriptAnswer::Granted => {
                limit.forget(ticket);
                limit.held.insert(ticket);
                Answer::Granted(grant.expect("parsed with the answer"))
            }
            ScriptAnswer::GrantedOther(other) => {
                limit.waiting.entry(ticket).or_default();
                match limit.waiting.get(&other).cloned() {
                    _ if limit.held.contains(&other) => {}
                    Some(notify) => {
                        limit.granted.insert(other, grant.expect("parsed with the answer"));
                        limit.held.insert(other);
                        notify.notify_one();
                    }
                    None => {
                        // Its acquire was dropped meanwhile: hand the permit back.
                        state.orphans.push((name.to_owned(), other));
                    }
                }
                Answer::Queued
            }
            ScriptAnswer::Queued => {
                limit.waiting.entry(ticket).or_default();
                limit.retrying.remove(&ticket);
                limit.next_expiry = hint.map(|after| Instant::now() + after);
                Answer::Queued
            }
            ScriptAnswer::RetryAfter(after) => {
                limit.waiting.entry(ticket).or_default();
                limit.retrying.insert(ticket);
                Answer::RetryAfter(after)
            }
        }
    }

    /// The first ask (`Ask::First`), a check, or a try for `ticket`, with this client's
    /// bookkeeping, the outage policy, and recovery from a Redis that lost its state.
    async fn acquire(
        &self,
        name: &str,
        ticket: u64,
        ask: Ask,
        lease: Option<Duration>,
    ) -> Result<Answer, LimitError> {
        let local = {
            let mut state = lock(&self.state);
            let limit = state.limits.entry(name.to_owned()).or_default();
            if let Some(grant) = limit.granted.remove(&ticket) {
                limit.forget(ticket);
                return Ok(Answer::Granted(grant));
            }
            if limit.open.contains(&ticket) {
                return Ok(Answer::Granted(Grant { fencing_token: 0, expires_at: None }));
            }
            let local = limit.local.contains(&ticket);
            if !local && let Ask::First(priority) = &ask {
                // Known before the call: a grant pushed while the call travels finds its waiter.
                // (A check never adds a waiter: a ticket this client finished stays finished.)
                limit.waiting.entry(ticket).or_default();
                limit.priorities.insert(ticket, priority.clone());
                if lease.is_some() {
                    limit.external.insert(ticket);
                }
            }
            local
        };
        if local {
            return match &ask {
                Ask::First(priority) => self.local.acquire(name, ticket, priority, lease).await,
                Ask::Check => self.local.check(name, ticket, lease).await,
                Ask::Try => self.local.try_acquire(name, ticket, lease).await,
            };
        }
        if matches!(self.outage, OutagePolicy::LocalShare(_))
            && !lock(&self.state).specs.contains_key(name)
        {
            // Learn the spec while Redis answers; an outage now is handled below.
            let _ = self.info(name).await;
        }
        let lease_or_own = lease.unwrap_or(self.lease);
        let mut ask = ask;
        for attempt in 0..3 {
            match self.ask_remote(name, ticket, &ask, lease_or_own).await {
                Ok(Reply::Answer(answer, grant, hint)) => {
                    if matches!(ask, Ask::Try) && !matches!(answer, ScriptAnswer::Granted) {
                        // A try leaves nothing behind, here either.
                        lock(&self.state).limits.entry(name.to_owned()).or_default().forget(ticket);
                        return Ok(match answer {
                            ScriptAnswer::RetryAfter(after) => Answer::RetryAfter(after),
                            _ => Answer::Queued,
                        });
                    }
                    if matches!(ask, Ask::Try) && lease.is_some() {
                        lock(&self.state)
                            .limits
                            .entry(name.to_owned())
                            .or_default()
                            .external
                            .insert(ticket);
                    }
                    return Ok(self.apply(name, ticket, answer, grant, hint));
                }
                Ok(Reply::TooManyWaiters) => {
                    lock(&self.state).limits.entry(name.to_owned()).or_default().forget(ticket);
                    return Err(LimitError::TooManyWaiters {
                        limit: name.to_owned(),
                        max: self.max_waiters,
                    });
                }
                Ok(Reply::Finished) => {
                    let priority = {
                        let mut state = lock(&self.state);
                        let limit = state.limits.entry(name.to_owned()).or_default();
                        let waiting = limit.waiting.contains_key(&ticket);
                        let priority = limit.priorities.get(&ticket).cloned();
                        if limit.held.remove(&ticket) {
                            limit.external.remove(&ticket);
                            drop(state);
                            self.mark_lost(name, ticket);
                            return Ok(Answer::Finished);
                        }
                        if !waiting {
                            limit.forget(ticket);
                            return Ok(Answer::Finished);
                        }
                        priority
                    };
                    // This client never withdrew it: Redis lost the ticket. Learn whether it
                    // lost everything (then the limits come back with a hold), and queue the
                    // ticket again with the priority of its first ask.
                    let _ = self.detect_loss().await;
                    match priority {
                        Some(priority) if attempt < 2 => {
                            lock(&self.state)
                                .limits
                                .entry(name.to_owned())
                                .or_default()
                                .waiting
                                .entry(ticket)
                                .or_default();
                            ask = Ask::First(priority);
                        }
                        _ => {
                            lock(&self.state)
                                .limits
                                .entry(name.to_owned())
                                .or_default()
                                .forget(ticket);
                            return Ok(Answer::Finished);
                        }
                    }
                }
                Ok(Reply::Unknown) => {
                    let known = lock(&self.state).specs.contains_key(name);
                    if !known || attempt == 2 {
                        lock(&self.state).limits.entry(name.to_owned()).or_default().forget(ticket);
                        return Err(LimitError::UnknownLimit(name.to_owned()));
                    }
                    match self.detect_loss().await {
                        // Redis lost its state: the limits this client knows are back (held).
                        Ok(true) => {}
                        Ok(false) => {
                            // Removed by another client: this one forgets it too, unless it
                            // defined it itself (then define it again, as before).
                            let spec = lock(&self.state).specs.get(name).copied();
                            if let Some(spec) = spec {
                                self.stats.redefinitions.fetch_add(1, Ordering::Relaxed);
                                if let Err(err) = self.define(name, spec).await {
                                    return self.outage_for(name, ticket, ask, lease, err).await;
                                }
                            }
                        }
                        Err(err) => return self.outage_for(name, ticket, ask, lease, err).await,
                    }
                }
                Err(err) => return self.outage_for(name, ticket, ask, lease, err).await,
            }
        }
        Err(LimitError::UnknownLimit(name.to_owned()))
    }

    async fn outage_for(
        &self,
        name: &str,
        ticket: u64,
        ask: Ask,
        lease: Option<Duration>,
        err: CallError,
    ) -> Result<Answer, LimitError> {
        let priority = match ask {
            Ask::First(priority) => priority,
            _ => Priority::default(),
        };
        self.on_outage(name, ticket, &priority, lease, err).await
    }

    /// Records a permit as lost and wakes whoever awaits it.
    fn mark_lost(&self, name: &str, ticket: u64) {
        self.stats.lost_leases.fetch_add(1, Ordering::Relaxed);
        self.lost.mark(name, ticket);
    }

    /// Compares the namespace's epoch with the one this client knows. On a difference (or a
    /// missing epoch) Redis lost its state: every limit this client knows is defined again with
    /// a hold of `max_lease`, every permit it held is reported lost, and its waiters ask again
    /// (their tickets are queued anew). Answers whether a loss was found.
    async fn detect_loss(&self) -> Result<bool, CallError> {
        let key = self.epoch_key();
        let seen: Option<String> = self.command(redis::cmd("GET").arg(&key)).await?;
        let known = lock(&self.epoch).clone();
        if seen.is_some() && seen == known {
            return Ok(false);
        }
        let mut conn = self.conn.clone();
        let fresh = tokio::time::timeout(self.op_timeout, ensure_epoch(&mut conn, &key))
            .await
            .map_err(|_| CallError::Outage("no answer".into()))?
            .map_err(|e| CallError::Outage(e.to_string()))?;
        {
            let mut epoch = lock(&self.epoch);
            if epoch.as_ref() == Some(&fresh) {
                return Ok(false); // another task of this client handled it
            }
            *epoch = Some(fresh);
        }
        let specs: Vec<(String, LimitSpec)> =
            lock(&self.state).specs.iter().map(|(n, s)| (n.clone(), *s)).collect();
        for (name, spec) in specs {
            self.stats.redefinitions.fetch_add(1, Ordering::Relaxed);
            self.define_held(&name, spec, self.max_lease).await?;
        }
        let held: Vec<(String, u64)> = {
            let mut state = lock(&self.state);
            let mut held = Vec::new();
            for (name, limit) in &mut state.limits {
                for ticket in std::mem::take(&mut limit.held) {
                    limit.external.remove(&ticket);
                    held.push((name.clone(), ticket));
                }
                limit.wake_first();
                for notify in limit.waiting.values() {
                    notify.notify_one();
                }
            }
            held
        };
        for (name, ticket) in held {
            self.mark_lost(&name, ticket);
        }
        Ok(true)
    }

    fn epoch_key(&self) -> String {
        format!("lanes:{{{}}}:epoch", self.namespace)
    }

    async fn on_outage(
        &self,
        name: &str,
        ticket: u64,
        priority: &Priority,
        lease: Option<Duration>,
        err: CallError,
    ) -> Result<Answer, LimitError> {
        let message = match err {
            CallError::Other(err) => return Err(err),
            CallError::Outage(message) => message,
        };
        // The ticket may be queued on the server: withdraw it once Redis is back.
        let queued_remotely = {
            let mut state = lock(&self.state);
            state.limits.entry(name.to_owned()).or_default().waiting.contains_key(&ticket)
        };
        match self.outage {
            OutagePolicy::FailClosed => {
                Err(LimitError::backend(format!("redis unreachable: {message}")))
            }
            OutagePolicy::FailOpen => {
                self.stats.open_grants.fetch_add(1, Ordering::Relaxed);
                let mut state = lock(&self.state);
                if queued_remotely {
                    state.orphans.push((name.to_owned(), ticket));
                }
                let limit = state.limits.entry(name.to_owned()).or_default();
                limit.forget(ticket);
                limit.open.insert(ticket);
                Ok(Answer::Granted(Grant { fencing_token: 0, expires_at: None }))
            }
            OutagePolicy::LocalShare(share) => {
                let Some(spec) = lock(&self.state).specs.get(name).copied() else {
                    return Err(LimitError::backend(format!(
                        "redis unreachable ({message}) and the spec of {name:?} is unknown to this client"
                    )));
                };
                if self.local.info(name).await?.is_none() {
                    self.local.define(name, scaled(spec, share)).await?;
                }
                self.stats.local_acquires.fetch_add(1, Ordering::Relaxed);
                {
                    let mut state = lock(&self.state);
                    if queued_remotely {
                        state.orphans.push((name.to_owned(), ticket));
                    }
                    let limit = state.limits.entry(name.to_owned()).or_default();
                    limit.forget(ticket);
                    limit.local.insert(ticket);
                }
                self.local.acquire(name, ticket, priority, lease).await
            }
        }
    }

    async fn release(&self, name: &str, ticket: u64) -> Result<Released, LimitError> {
        self.lost.forget(name, ticket);
        let place = {
            let mut state = lock(&self.state);
            let limit = state.limits.entry(name.to_owned()).or_default();
            limit.forget(ticket);
            limit.granted.remove(&ticket);
            limit.held.remove(&ticket);
            limit.external.remove(&ticket);
            if limit.open.remove(&ticket) {
                Place::Open
            } else if limit.local.remove(&ticket) {
                Place::Local
            } else {
                Place::Remote
            }
        };
        match place {
            Place::Open => Ok(Released::Permit),
            Place::Local => self.local.release(name, ticket).await,
            Place::Remote => match self.call(name, "release", &[ticket.to_string()]).await {
                Ok(value) => Ok(match int(&value) {
                    Some(1) => Released::Permit,
                    Some(2) => Released::Withdrawn,
                    _ => Released::Unknown,
                }),
                Err(CallError::Outage(_)) => {
                    lock(&self.state).orphans.push((name.to_owned(), ticket));
                    Ok(Released::Unknown)
                }
                Err(CallError::Other(err)) => Err(err),
            },
        }
    }

    async fn wait(&self, name: &str, ticket: u64, at_most: Duration) {
        let plan = {
            let mut state = lock(&self.state);
            let limit = state.limits.entry(name.to_owned()).or_default();
            if limit.granted.contains_key(&ticket) || limit.open.contains(&ticket) {
                return;
            }
            if limit.local.contains(&ticket) {
                None
            } else {
                let first = limit.waiting.keys().next() == Some(&ticket);
                let notify = limit.waiting.entry(ticket).or_default().clone();
                let sleep = if limit.retrying.contains(&ticket) {
                    at_most
                } else if first || limit.waiting.len() == 1 {
                    let until_expiry = limit.next_expiry.map(|at| {
                        at.saturating_duration_since(Instant::now()) + Duration::from_millis(2)
                    });
                    until_expiry.map_or(at_most, |d| d.min(at_most)).min(FIRST_REASK)
                } else {
                    SAFETY_REASK.min(at_most)
                };
                Some((notify, sleep))
            }
        };
        let Some((notify, sleep)) = plan else {
            return self.local.wait(name, ticket, at_most).await;
        };
        tokio::select! {
            () = notify.notified() => {}
            () = tokio::time::sleep(sleep) => {}
        }
    }

    async fn info(&self, name: &str) -> Result<Option<LimitInfo>, LimitError> {
        let value = self.call(name, "info", &[]).await?;
        if error_tag(&value).as_deref() == Some("unknown") {
            return Ok(None);
        }
        let bad = || LimitError::backend(format!("redis: odd info {value:?}"));
        let Value::Array(items) = &value else { return Err(bad()) };
        let field = |i: usize| items.get(i).and_then(int).ok_or_else(bad);
        let rate = items.get(1).and_then(text).ok_or_else(bad)?;
        let spec = LimitSpec {
            concurrent: u32::try_from(field(0)?).map_err(|_| bad())?,
            per_second: if rate.is_empty() { None } else { Some(rate.parse().map_err(|_| bad())?) },
            burst: u32::try_from(field(2)?).map_err(|_| bad())?,
        };
        lock(&self.state).specs.insert(name.to_owned(), spec);
        Ok(Some(LimitInfo::new(
            name,
            spec,
            u32::try_from(field(3)?).map_err(|_| bad())?,
            usize::try_from(field(4)?).map_err(|_| bad())?,
            u64::try_from(field(5)?).map_err(|_| bad())?,
            u32::try_from(field(6)?).map_err(|_| bad())?,
        )))
    }

    /// Renews every held permit of `name`; returns the tickets whose lease had ended.
    async fn renew_all(
        &self,
        name: &str,
        tickets: Vec<u64>,
        lease: Duration,
    ) -> Result<Vec<u64>, CallError> {
        let args: Vec<String> = tickets.iter().map(u64::to_string).collect();
        let value = self.call_leased(name, "renew", lease, &args).await?;
        let refused: Vec<u64> = if error_tag(&value).as_deref() == Some("unknown") {
            // Redis no longer knows the limit (it restarted empty): nothing is held there.
            tickets
        } else {
            let Value::Array(items) = value else {
                return Err(CallError::Other(LimitError::backend("redis: odd renewal")));
            };
            items.iter().filter_map(|v| text(v)?.parse().ok()).collect()
        };
        if !refused.is_empty() {
            let mut lost = Vec::new();
            {
                let mut state = lock(&self.state);
                if let Some(limit) = state.limits.get_mut(name) {
                    for ticket in &refused {
                        if limit.held.remove(ticket) {
                            limit.external.remove(ticket);
                            lost.push(*ticket);
                        }
                    }
                }
            }
            for ticket in lost {
                self.mark_lost(name, ticket);
            }
        }
        Ok(refused)
    }
}

enum Place {
    Open,
    Local,
    Remote,
}

fn scaled(spec: LimitSpec, share: f64) -> LimitSpec {
    let scale = |n: u32| ((f64::from(n) * share).floor() as u32).max(1);
    LimitSpec {
        concurrent: scale(spec.concurrent),
        per_second: spec.per_second.map(|rate| rate * share),
        burst: scale(spec.burst),
    }
}

/// Listens on the client's channel; wakes the first waiter of each limit it names. Reconnects
/// after a failure and then wakes every first waiter (notifications may have been missed).
async fn subscribe(
    client: redis::Client,
    inner: Weak<Inner>,
    subscribed: tokio::sync::oneshot::Sender<()>,
) {
    let mut subscribed = Some(subscribed);
    let mut backoff = Duration::from_millis(50);
    loop {
        let Some(strong) = inner.upgrade() else { return };
        let channel = format!("{}{}", strong.channel_prefix, strong.client);
        let prefix = format!("{}:", strong.namespace);
        drop(strong);
        let pubsub = async {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, RedisError>(pubsub)
        };
        let mut pubsub = match tokio::time::timeout(Duration::from_secs(2), pubsub).await {
            Ok(Ok(pubsub)) => pubsub,
            _ => {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        backoff = Duration::from_millis(50);
        if let Some(done) = subscribed.take() {
            let _ = done.send(());
        }
        if let Some(strong) = inner.upgrade() {
            for limit in lock(&strong.state).limits.values() {
                limit.wake_first();
            }
        }
        let mut messages = pubsub.on_message();
        while let Some(message) = messages.next().await {
            let Some(strong) = inner.upgrade() else { return };
            let Ok(payload) = message.get_payload::<String>() else { continue };
            strong.stats.notifications.fetch_add(1, Ordering::Relaxed);
            if let Some((name, ticket)) = strong.pushed(&prefix, &payload) {
                // Granted to a waiter that is gone: hand the permit back now.
                if let Err(CallError::Outage(_)) =
                    strong.call(&name, "release", &[ticket.to_string()]).await
                {
                    lock(&strong.state).orphans.push((name, ticket));
                }
            }
        }
    }
}

/// A pushed grant: `ticket|fence|expires|namespace:limit`.
fn parse_push(payload: &str) -> Option<(u64, Grant, &str)> {
    let mut parts = payload.splitn(4, '|');
    let ticket = parts.next()?.parse().ok()?;
    let fencing_token = parts.next()?.parse().ok()?;
    let expires: u64 = parts.next()?.parse().ok()?;
    let name = parts.next()?;
    Some((ticket, Grant { fencing_token, expires_at: Some(Duration::from_micros(expires)) }, name))
}

impl Inner {
    /// A message on the client's channel: a grant made on behalf of one of its waiters, or a
    /// wake-up for the client's first waiter of a limit.
    /// Returns a permit to hand back if its waiter is gone.
    fn pushed(&self, prefix: &str, payload: &str) -> Option<(String, u64)> {
        let mut state = lock(&self.state);
        match parse_push(payload) {
            Some((ticket, grant, qualified)) => {
                let name = qualified.strip_prefix(prefix)?;
                let limit = state.limits.entry(name.to_owned()).or_default();
                if limit.held.contains(&ticket) {
                    // Its own acquire's answer got here first: nothing new.
                    return None;
                }
                let notify = limit.waiting.get(&ticket).cloned();
                let Some(notify) = notify else {
                    // Its waiter is gone (released or dropped).
                    return Some((name.to_owned(), ticket));
                };
                limit.granted.insert(ticket, grant);
                limit.held.insert(ticket);
                notify.notify_one();
                None
            }
            None => {
                let name = payload.strip_prefix(prefix)?;
                if let Some(limit) = state.limits.get(name) {
                    limit.wake_first();
                }
                None
            }
        }
    }
}

/// Every quarter of a second (or third of a lease, if shorter): checks the namespace's epoch
/// (so a Redis that lost its state is seen within one tick), retries releases that could not
/// reach Redis, tells the limits where this client waits that it is alive, and — every third of
/// a lease — renews the permits it holds for itself.
async fn maintain(inner: Weak<Inner>, auto_renew: bool) {
    let (period, renew_every) = match inner.upgrade() {
        Some(inner) => ((inner.lease / 3).min(Duration::from_millis(250)), inner.lease / 3),
        None => return,
    };
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut renewed = Instant::now();
    let mut touched = Instant::now();
    loop {
        tick.tick().await;
        let Some(inner) = inner.upgrade() else { return };
        let _ = inner.detect_loss().await;
        let orphans = std::mem::take(&mut lock(&inner.state).orphans);
        for (name, ticket) in orphans {
            if let Err(CallError::Outage(_)) =
                inner.call(&name, "release", &[ticket.to_string()]).await
            {
                lock(&inner.state).orphans.push((name, ticket));
            }
        }
        if touched.elapsed() >= inner.queue_grace / 4 {
            touched = Instant::now();
            let waiting: Vec<String> = lock(&inner.state)
                .limits
                .iter()
                .filter(|(_, limit)| !limit.waiting.is_empty())
                .map(|(name, _)| name.clone())
                .collect();
            for name in waiting {
                let _ = inner.call(&name, "touch", &[]).await;
            }
        }
        if !auto_renew || renewed.elapsed() < renew_every {
            continue;
        }
        renewed = Instant::now();
        let held: Vec<(String, Vec<u64>)> = lock(&inner.state)
            .limits
            .iter()
            .map(|(name, limit)| {
                let own: Vec<u64> =
                    limit.held.iter().copied().filter(|t| !limit.external.contains(t)).collect();
                (name.clone(), own)
            })
            .filter(|(_, own)| !own.is_empty())
            .collect();
        for (name, tickets) in held {
            let _ = inner.renew_all(&name, tickets, inner.lease).await;
        }
    }
}

/// Reads the namespace's epoch, creating a fresh random one if Redis has none.
async fn ensure_epoch(conn: &mut ConnectionManager, key: &str) -> Result<String, RedisError> {
    let fresh = {
        use std::hash::BuildHasher;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        format!("{:016x}", std::collections::hash_map::RandomState::new().hash_one(nanos))
    };
    let _: Option<String> =
        redis::cmd("SET").arg(key).arg(&fresh).arg("NX").query_async(conn).await?;
    let epoch: Option<String> = redis::cmd("GET").arg(key).query_async(conn).await?;
    Ok(epoch.unwrap_or(fresh))
}

impl RedisLimits {
    /// A builder for a client of the Redis at `url` (`redis://host:port/db`).
    pub fn builder(url: impl Into<String>) -> RedisLimitsBuilder {
        RedisLimitsBuilder {
            url: url.into(),
            namespace: "lanes".into(),
            lease: Duration::from_secs(3),
            max_waiters: lanes::LimitTable::DEFAULT_MAX_WAITERS,
            outage: OutagePolicy::FailClosed,
            op_timeout: Duration::from_millis(500),
            auto_renew: true,
            max_lease: None,
            queue_grace: Duration::from_secs(2),
        }
    }

    /// This client's id (the high bits of its tickets).
    pub fn client_id(&self) -> u64 {
        self.inner.client
    }

    /// The lease of every permit.
    pub fn lease(&self) -> Duration {
        self.inner.lease
    }

    /// Renews the permit of `ticket` now.
    ///
    /// # Errors
    ///
    /// [`LimitError::LeaseExpired`] if its lease had ended (the permit was reclaimed),
    /// [`LimitError::Backend`] if Redis cannot answer.
    pub async fn renew(&self, name: &str, ticket: u64) -> Result<(), LimitError> {
        match self.inner.renew_all(name, vec![ticket], self.inner.lease).await {
            Ok(refused) if refused.is_empty() => Ok(()),
            Ok(_) => Err(LimitError::LeaseExpired { limit: name.to_owned(), ticket }),
            Err(err) => Err(err.into()),
        }
    }

    /// This client's counters.
    pub fn stats(&self) -> RedisStats {
        let s = &self.inner.stats;
        RedisStats {
            outages: s.outages.load(Ordering::Relaxed),
            open_grants: s.open_grants.load(Ordering::Relaxed),
            local_acquires: s.local_acquires.load(Ordering::Relaxed),
            lost_leases: s.lost_leases.load(Ordering::Relaxed),
            notifications: s.notifications.load(Ordering::Relaxed),
            redefinitions: s.redefinitions.load(Ordering::Relaxed),
            calls: s.calls.load(Ordering::Relaxed),
        }
    }
}

impl fmt::Debug for RedisLimits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLimits")
            .field("namespace", &self.inner.namespace)
            .field("client", &self.inner.client)
            .field("lease", &self.inner.lease)
            .field("outage", &self.inner.outage)
            .finish()
    }
}

impl LimitBackend for RedisLimits {
    fn ticket(&self) -> u64 {
        let n = self.inner.next_ticket.fetch_add(1, Ordering::Relaxed) % (1 << CLIENT_SHIFT);
        (self.inner.client << CLIENT_SHIFT) | n
    }

    fn define<'a>(
        &'a self,
        name: &'a str,
        spec: LimitSpec,
    ) -> BoxFuture<'a, Result<(), LimitError>> {
        Box::pin(async move {
            spec.validate()?;
            Ok(self.inner.define(name, spec).await?)
        })
    }

    fn remove<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), LimitError>> {
        Box::pin(async move {
            let value = self.inner.call(name, "remove", &[]).await?;
            match error_tag(&value).as_deref() {
                Some("unknown") => return Err(LimitError::UnknownLimit(name.to_owned())),
                Some("in_use") => return Err(LimitError::InUse(name.to_owned())),
                _ => {}
            }
            let _ = self
                .inner
                .command::<()>(redis::cmd("SREM").arg(self.inner.registry_key()).arg(name))
                .await;
            let mut state = lock(&self.inner.state);
            state.specs.remove(name);
            state.limits.remove(name);
            Ok(())
        })
    }

    fn acquire<'a>(
        &'a self,
        name: &'a str,
        ticket: u64,
        priority: &'a Priority,
        lease: Option<Duration>,
    ) -> BoxFuture<'a, Result<Answer, LimitError>> {
        Box::pin(self.inner.acquire(name, ticket, Ask::First(priority.clone()), lease))
    }

    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        ticket: u64,
        lease: Option<Duration>,
    ) -> BoxFuture<'a, Result<Answer, LimitError>> {
        Box::pin(self.inner.acquire(name, ticket, Ask::Try, lease))
    }

    fn check<'a>(
        &'a self,
        name: &'a str,
        ticket: u64,
        lease: Option<Duration>,
    ) -> BoxFuture<'a, Result<Answer, LimitError>> {
        Box::pin(self.inner.acquire(name, ticket, Ask::Check, lease))
    }

    fn wait<'a>(&'a self, name: &'a str, ticket: u64, at_most: Duration) -> BoxFuture<'a, ()> {
        Box::pin(self.inner.wait(name, ticket, at_most))
    }

    fn release<'a>(
        &'a self,
        name: &'a str,
        ticket: u64,
    ) -> BoxFuture<'a, Result<Released, LimitError>> {
        Box::pin(self.inner.release(name, ticket))
    }

    fn renew<'a>(
        &'a self,
        name: &'a str,
        tickets: &'a [u64],
        lease: Duration,
    ) -> BoxFuture<'a, Result<Vec<u64>, LimitError>> {
        Box::pin(async move { Ok(self.inner.renew_all(name, tickets.to_vec(), lease).await?) })
    }

    fn lease_lost(&self, name: &str, ticket: u64) -> bool {
        self.inner.lost.is_lost(name, ticket)
    }

    fn lost<'a>(&'a self, name: &'a str, ticket: u64) -> BoxFuture<'a, ()> {
        Box::pin(self.inner.lost.wait(name, ticket))
    }

    fn info<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<LimitInfo>, LimitError>> {
        Box::pin(self.inner.info(name))
    }

    fn list(&self) -> BoxFuture<'_, Result<Vec<LimitInfo>, LimitError>> {
        Box::pin(async move {
            let mut names: Vec<String> =
                self.inner.command(redis::cmd("SMEMBERS").arg(self.inner.registry_key())).await?;
            names.sort();
            let mut infos = Vec::with_capacity(names.len());
            for name in names {
                if let Some(info) = self.inner.info(&name).await? {
                    infos.push(info);
                }
            }
            Ok(infos)
        })
    }
}
