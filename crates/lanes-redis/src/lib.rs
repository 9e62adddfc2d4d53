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
//!   slot. A dropped permit rides: its release goes ahead of the client's next call on the
//!   limit, in the same script call, so a task that releases and asks again makes one round
//!   trip, and a waiter is handed the permit before the asker queues (with no call to ride, a
//!   task sends it at once; up to 64 releases ride one call). On a limit where the client's
//!   last ask was queued, the permits go back in a call of their own just before the next
//!   acquire: a waiter's grant is pushed when that call ends, not after the asker's queueing.
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
//! - **Redis Cluster** ([`RedisLimits::cluster_builder`]): each limit lives in one slot, so
//!   limits spread over the primaries, and a failover (a replica promoted, possibly without the
//!   last writes) holds the limits it moved for one longest lease, as after a Redis that lost
//!   its state (see [Outages](#outages)).
//!
//! # Outages
//!
//! Every Redis call is bounded by `op_timeout` (default 500 ms). A call that fails for lack of
//! Redis has the client connect anew in the background. On one Redis (not a cluster), while
//! that attempt fails, calls fail at once instead of waiting out their timeout (and ask for
//! another attempt, at most every 250 ms): an outage costs an acquire the wait only until the
//! client knows Redis is away, and for a moment after it is back, until the client has
//! connected again, acquires still follow the policy. When a call fails for lack of Redis:
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
//! A permit whose lease ends without a renewal — Redis unreachable, or too slow — is reported
//! lost to its holder ([`lanes::Permit::lost`], [`lanes::Permit::lease_lost`]) at that moment.
//! The end is counted from when the grant or the last successful renewal was *asked for*, less
//! 2%, so the holder knows no later than Redis reclaims the permit and grants it to someone
//! else: a holder cut off from Redis (or from one primary of a cluster) stops believing it
//! holds before anyone else can. When Redis is back, renewals of lapsed permits are refused —
//! the holder's fencing token is stale, which is what fencing is for. Both are counted in
//! [`RedisStats::lost_leases`], once per permit. Releases that could not reach Redis are
//! retried in the background. A limit a restarted Redis no longer knows is defined again from
//! the spec this client gave it or read, holding its grants for the longest lease (a limit
//! gone while Redis kept its state, removed by another client, is defined again only by a
//! client that defined it itself; to one that only read it, it is unknown); one a restarted
//! Redis still knows (from a snapshot or an append-only file, which may lag) holds them the
//! same way, from the server's start (the first call after the restart finds it), and its
//! fencing tokens go on past the clock. A limit made new on a Redis that began serving less than the longest lease ago is
//! held until then too (a client that never knew the old epoch defines it anew, and nothing
//! tells a new Redis from an emptied one): a fresh Redis grants nothing on a new limit in its
//! first lease, and up to a second more (its uptime counts whole seconds, and may read a
//! second more than the time it has served). Tickets that fell back to the local share stay local until
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
mod builder;
mod conn;
mod lease;
mod leased;
mod outage;
mod push;
#[cfg(test)]
mod tests;
mod tickets;
mod wakes;
mod wire;

pub use builder::RedisLimitsBuilder;

/// `url` to show (in logs, errors, a banner): a password in it is replaced by `***`.
///
/// ```
/// assert_eq!(
///     lanes_redis::redacted("redis://default:s3cret@10.0.0.5:6379/0"),
///     "redis://default:***@10.0.0.5:6379/0"
/// );
/// assert_eq!(lanes_redis::redacted("redis://10.0.0.5"), "redis://10.0.0.5");
/// assert_eq!(lanes_redis::redacted("redis://u:p/a#ss@h:6379"), "redis://u:***@h:6379");
/// ```
pub fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_owned() };
    // The last '@' before the host: a password may hold '/', '?' or '#' unencoded.
    let Some((userinfo, host_and_path)) = rest.rsplit_once('@') else { return url.to_owned() };
    let user = match userinfo.split_once(':') {
        Some((user, _password)) => format!("{user}:***"),
        None => "***".to_owned(),
    };
    format!("{scheme}://{user}@{host_and_path}")
}
pub use outage::OutagePolicy;

use conn::{Conn, Live, Target};
use lease::{ensure_epoch, maintain, watch_leases};
use push::subscribe;
use tickets::{ClientLimit, Delivered, Place, WaitPlan};
use wakes::{StateGuard, StateLock};
use wire::{
    Arg, Ask, CallError, Library, NO_ARGS, Reply, error_tag, int, parse_grant, parse_held, text,
};

/// The workspace README's examples (which use this crate as well as `lanes`), compiled and run
/// as doctests.
#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use lanes::limit::ShareReply;
use lanes::limit::share::{Demand, LocalShare, SharePolicy, ShareRequest};
pub use lanes::limit::share::{RateLease, ShareLease};
use lanes::limit::{
    BackendError, Grant, LimitBackend, LimitError, LimitInfo, LimitSpec, LocalLimits, LostLeases,
    Released, ShareInfo,
};
use lanes::{Answer, BoxFuture, Priority};
use redis::aio::ConnectionManagerConfig;
use redis::{RedisError, Value};
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
    /// Releases waiting for Redis to answer them (now): see
    /// [`RedisLimitsBuilder::max_pending_releases`].
    pub pending_releases: u64,
    /// Releases given up over that bound, since the client was built.
    pub abandoned_releases: u64,
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
    conn: Conn,
    /// Whether `conn` is a cluster's: the script then watches which node serves each limit.
    cluster: bool,
    library: Library,
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
    /// The most limits this client lets the namespace hold when it defines a new one.
    max_limits: usize,
    /// Whether this client renews its permits itself (the builder's `auto_renew`).
    auto_renew: bool,
    /// The namespace's epoch as this client last saw it: a different or missing one means
    /// Redis lost its state.
    epoch: Mutex<Option<String>>,
    /// Whether the maintenance loop's look at the epoch is under way.
    looking: std::sync::atomic::AtomicBool,
    /// The tickets in use at the last look, once the numbers have come round (see
    /// `may_reuse`).
    reuse: Mutex<Reuse>,
    /// Held by the recovery from a lost state (`detect_loss`): one at a time.
    recovering: tokio::sync::Mutex<outage::Recovery>,
    /// Permits known lost (lease refused, or Redis lost its state), until released.
    lost: LostLeases,
    state: StateLock,
    local: Arc<LocalLimits>,
    stats: Stats,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    /// This client itself, for the tasks it starts later (a leased limit's refresher).
    me: std::sync::OnceLock<Weak<Inner>>,
    /// The runtime the client was built on, where its background tasks run: a permit
    /// dropped elsewhere (another runtime, or none) still has its release sent.
    runtime: tokio::runtime::Handle,
    /// Limits this client serves from its share (leased capacity).
    leased: std::sync::RwLock<HashMap<String, Arc<LocalShare>>>,
    /// This client's identity in leased ledgers (random, below 2^53), and the number of its
    /// last refresh.
    ledger_id: u64,
    share_seq: AtomicU64,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for task in lock(&self.tasks).drain(..) {
            task.abort();
        }
    }
}

/// The tickets in use at the start of stretch `stretch` of draws (2^20 draws each; see
/// `Inner::may_reuse`), not yet drawn again.
#[derive(Default)]
struct Reuse {
    stretch: u64,
    live: std::collections::HashSet<u64>,
}

/// Draws in one stretch, as a shift: the tickets in use are taken again at each stretch's
/// start, once the numbers have come round.
const REUSE_STRETCH: u32 = 20;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Inner {
    /// Whether `ticket`, the `drawn`th (past the first 2^32: the numbers came round), may be
    /// used. One still in use may not: Redis would answer an ask with it as the same ask, and
    /// grant its holder's permit to a second holder. Nor may 0 (never drawn the first time
    /// round).
    ///
    /// The tickets in use are taken at a round's first draw and again every 2^20 draws, and
    /// each draw between is one lookup: every later draw of the round is newer than they are.
    /// Taking them again settles a ticket that was between two places at the last look (a
    /// try whose answer travels, a permit on its way to being reported lost): only one whose
    /// number comes within the next 2^20 draws could be missed, and only at that instant.
    fn may_reuse(&self, drawn: u64, ticket: u64) -> bool {
        if ticket & ((1 << CLIENT_SHIFT) - 1) == 0 {
            return false;
        }
        let stretch = drawn >> REUSE_STRETCH;
        let mut reuse = lock(&self.reuse);
        if stretch < reuse.stretch {
            // Drawn before the last look, and late: against the tickets in use now.
            return !self.tickets_in_use().contains(&ticket);
        }
        if stretch > reuse.stretch {
            *reuse = Reuse { stretch, live: self.tickets_in_use() };
        }
        !reuse.live.remove(&ticket)
    }

    /// Every ticket this client may still use, or Redis may still hold for it: its
    /// bookkeeping's (with releases not yet sent), its permits known lost and not yet released,
    /// and its shares' (leased limits).
    fn tickets_in_use(&self) -> std::collections::HashSet<u64> {
        let mut live = self.lock_state().tickets_in_use();
        live.extend(self.lost.tickets());
        let shares: Vec<_> =
            self.leased.read().unwrap_or_else(PoisonError::into_inner).values().cloned().collect();
        for share in shares {
            live.extend(share.tickets());
        }
        live
    }

    /// The client's bookkeeping, locked. Waiters it wakes are woken after the lock
    /// ([`wakes`]): their wakers are the caller's code, which may call back into this client.
    fn lock_state(&self) -> StateGuard<'_> {
        self.state.lock()
    }
}

/// The ledger id of a client named `client`: 53 bits of its SHA-1 (Lua's numbers are
/// doubles). Finding another name with the same id (to refresh as another client's share)
/// takes about 2^53 hashes: the ids a limit's snapshot shows give nothing away.
fn ledger_id_of(client: &str) -> u64 {
    let digest = sha1_smol::Sha1::from(client.as_bytes()).digest().bytes();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    (u64::from_be_bytes(first) & ((1 << 53) - 1)).max(1)
}

/// A demand as the `lease` operation reads it: "level:n,level:n".
fn demand_text(demand: &Demand) -> String {
    let levels: Vec<String> = demand.levels().map(|(level, n)| format!("{level}:{n}")).collect();
    levels.join(",")
}

fn backend<E: std::error::Error + Send + Sync + 'static>(err: E) -> LimitError {
    LimitError::Backend(BackendError::with_source(format!("redis: {err}"), err))
}

impl Inner {
    fn base(&self, name: &str) -> String {
        // Built by hand: on every call, and `format!` costs several times more.
        let mut base = String::with_capacity(self.namespace.len() + name.len() + 3);
        base.push('{');
        base.push_str(&self.namespace);
        base.push(':');
        base.push_str(name);
        base.push('}');
        base
    }

    /// The key of the set of the namespace's limit names, which `list` reads and
    /// `max_limits` counts.
    fn registry_key(&self) -> String {
        format!("lanes:{{{}}}:limits", self.namespace)
    }

    async fn define(&self, name: &str, spec: LimitSpec) -> Result<(), CallError> {
        // Registered within `max_limits` first, so that no limit is made past it.
        if self.register(name).await? < 0 {
            return Err(CallError::Other(LimitError::TooManyLimits { max: self.max_limits }));
        }
        self.define_script(name, spec, Duration::ZERO).await?;
        // And again: a removal of the name between the two calls (the limit redefined here
        // made again after it) took it out of the names, and others may have taken its place.
        if self.register(name).await? < 0 {
            let _ = self.call(name, "remove", NO_ARGS).await;
            return Err(CallError::Other(LimitError::TooManyLimits { max: self.max_limits }));
        }
        let mut state = self.lock_state();
        state.specs.insert(name.to_owned(), spec);
        state.defined.insert(name.to_owned());
        Ok(())
    }

    /// Registers `name` among the namespace's limits unless they are `max_limits` already:
    /// 1 registered now, 0 registered before, -1 refused (one call to the library's register
    /// function, loaded again if Redis lost it).
    async fn register(&self, name: &str) -> Result<i64, CallError> {
        let mut fcall = redis::cmd("FCALL");
        fcall
            .arg(format!("{}_register", self.library.name))
            .arg(1)
            .arg(self.registry_key())
            .arg(name)
            .arg(self.max_limits);
        let mut result = self.command(&fcall).await;
        if let Err(CallError::Other(err)) = &result
            && err.to_string().contains("Function not found")
        {
            match self.command::<String>(&self.library.load()).await {
                Err(CallError::Other(err)) if wire::already_loaded(&err) => {}
                Err(err) => return Err(err),
                Ok(_) => {}
            }
            result = self.command(&fcall).await;
        }
        result
    }

    /// Defines `name` again after Redis lost it, whatever the count of limits: no grant
    /// happens before `hold` from now.
    async fn define_held(
        &self,
        name: &str,
        spec: LimitSpec,
        hold: Duration,
    ) -> Result<(), CallError> {
        self.define_script(name, spec, hold).await?;
        self.command::<()>(redis::cmd("SADD").arg(self.registry_key()).arg(name)).await?;
        self.lock_state().specs.insert(name.to_owned(), spec);
        Ok(())
    }

    /// The library's `define` of `name`; with a `hold`, no grant happens before `hold` from
    /// now.
    async fn define_script(
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
            // On a cluster, the hold after the limit is found on another node (a failover).
            if self.cluster { self.max_lease.as_millis().to_string() } else { "0".to_owned() },
            self.lock_state().modes.get(name).cloned().unwrap_or_default(),
            // The hold after the server restarted (it may have lost the last writes).
            self.max_lease.as_millis().to_string(),
        ];
        let answer = self.call(name, "define", &args).await?;
        if matches!(&answer, redis::Value::BulkString(bytes) if bytes == b"in_use")
            || matches!(&answer, redis::Value::SimpleString(text) if text == "in_use")
        {
            return Err(CallError::Other(LimitError::InUse(name.to_owned())));
        }
        Ok(())
    }

    /// One script ask about `ticket`: the first ask (`Some(priority)`, may queue), a check
    /// (`None`, never queues), or a try. `fresh`: no call about the ticket was made before, so
    /// Redis cannot hold it, and the script need not look.
    async fn ask_remote(
        &self,
        name: &str,
        ticket: u64,
        ask: &Ask,
        fresh: bool,
        lease: Duration,
    ) -> Result<Reply, CallError> {
        // Written straight into the command: no `String` per argument.
        let keyed;
        let keytok = match ask {
            Ask::First(Priority { fairness_key: Some(key), .. }) => {
                keyed = format!("k{key}");
                keyed.as_str()
            }
            _ => "_",
        };
        let value = match ask {
            Ask::First(priority) => {
                let args = [
                    Arg::Int(ticket),
                    Arg::Signed(i64::from(priority.level)),
                    Arg::Text(keytok),
                    Arg::Int(u64::from(priority.fairness_weight.max(1))),
                    Arg::Int(self.max_waiters as u64),
                    Arg::Text(if fresh { "new" } else { "" }),
                ];
                self.call_leased(name, "acquire", lease, &args).await?
            }
            Ask::Check => self.call_leased(name, "check", lease, &[Arg::Int(ticket)]).await?,
            Ask::Try => self.call_leased(name, "try", lease, &[Arg::Int(ticket)]).await?,
        };
        let bad = || CallError::Other(LimitError::backend(format!("redis: odd answer {value:?}")));
        if let Value::BulkString(held) = &value {
            // Granted to this ticket: the answer is the grant alone.
            let grant = parse_held(held).ok_or_else(bad)?;
            return Ok(Reply::Answer(ScriptAnswer::Granted, Some(grant), None));
        }
        match error_tag(&value).as_deref() {
            Some("unknown") => return Ok(Reply::Unknown),
            Some("waiters") => return Ok(Reply::TooManyWaiters),
            Some("finished") => return Ok(Reply::Finished),
            Some("leased:maxmin") => return Ok(Reply::Leased(SharePolicy::MaxMinFair)),
            Some("leased:proportional") => return Ok(Reply::Leased(SharePolicy::Proportional)),
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

    /// The store's half of leased capacity (see [`RedisLimits::refresh_share`]): a refresh of
    /// ledger client `client`'s share of `name` for `lease`.
    pub(crate) async fn refresh_share(
        &self,
        name: &str,
        client: u64,
        ask: ShareRequest,
        lease: Duration,
    ) -> Result<ShareReply, LimitError> {
        let policy = match ask.policy {
            SharePolicy::MaxMinFair => "maxmin",
            SharePolicy::Proportional => "proportional",
        };
        let mut args = vec![
            client.to_string(),
            ask.held.to_string(),
            demand_text(&ask.demand),
            policy.to_owned(),
            ask.tokens.to_string(),
            ask.seq.to_string(),
            ask.last_token.to_string(),
            if ask.believes_held { "1" } else { "0" }.to_owned(),
        ];
        if let Some(rate) = &ask.rate {
            args.push(rate.held.to_string());
            args.push(demand_text(&rate.demand));
        }
        let value = self.call_leased(name, "lease", lease, &args).await?;
        match error_tag(&value).as_deref() {
            Some("unknown") => return Err(LimitError::UnknownLimit(name.to_owned())),
            Some("exact") => return Ok(ShareReply::Exact),
            // Overtaken by a later refresh of this client: nothing to apply.
            Some("stale") => return Ok(ShareReply::Stale),
            _ => {}
        }
        let bad = || LimitError::backend(format!("redis: odd lease answer {value:?}"));
        let Value::Array(items) = &value else { return Err(bad()) };
        let field = |i: usize| items.get(i).and_then(int).and_then(|n| u64::try_from(n).ok());
        let (share, expires, first, count, lapsed) = (
            field(0).ok_or_else(bad)?,
            field(1).ok_or_else(bad)?,
            field(2).ok_or_else(bad)?,
            field(3).ok_or_else(bad)?,
            field(4).ok_or_else(bad)?,
        );
        // A rate share of -1: the limit has no rate, or none was asked for.
        let lease = ShareLease::new(
            u32::try_from(share).map_err(|_| bad())?,
            Duration::from_micros(expires),
            first..first + count,
        )
        .lapsed(lapsed == 1);
        Ok(ShareReply::Leased(match (field(5), field(6), field(7)) {
            (Some(share), Some(limit), Some(burst)) if ask.rate.is_some() => lease
                .with_rate(RateLease::new(share, limit, u32::try_from(burst).map_err(|_| bad())?)),
            _ => lease,
        }))
    }

    /// When a lease asked for at `sent` may end on the server, in local time: at the end of
    /// `lease` counted from the ask (the server counts from a later moment), less 2% for clocks
    /// that run at slightly different rates.
    fn lease_end(&self, sent: Instant, lease: Duration) -> Instant {
        sent + lease - lease / 50
    }

    /// Applies an answer to a call sent at `sent` to this client's bookkeeping.
    fn apply(
        &self,
        name: &str,
        ticket: u64,
        (answer, grant, hint): (ScriptAnswer, Option<Grant>, Option<Duration>),
        sent: Instant,
        lease: Duration,
    ) -> Answer {
        let mut state = self.lock_state();
        let limit = state.limits.entry(name.to_owned()).or_default();
        // A grant made for another ticket of this client is recorded whatever happened to
        // this one (even if its own grant was pushed meanwhile): nobody else would renew it.
        let mut gone = None;
        if let ScriptAnswer::GrantedOther(other) = answer {
            let grant = grant.expect("parsed with the answer");
            // The other ticket's lease is this client's (only its own tickets are asked for
            // together).
            let until = self.lease_end(sent, self.lease);
            if limit.deliver(other, grant, until) == Delivered::Gone {
                // Its acquire was dropped meanwhile: hand the permit back.
                gone = Some(other);
            }
        }
        let claimed = limit.claim(ticket);
        limit.busy = !matches!(answer, ScriptAnswer::Granted);
        let answer = match (claimed, answer) {
            // Granted on its behalf (and pushed) while the answer travelled.
            (Some(pushed), _) => Answer::Granted(pushed),
            (None, ScriptAnswer::Granted) => {
                limit.hold(ticket, false, self.lease_end(sent, lease));
                Answer::Granted(grant.expect("parsed with the answer"))
            }
            (None, ScriptAnswer::GrantedOther(_)) => {
                limit.queued(ticket, false);
                Answer::Queued
            }
            (None, ScriptAnswer::Queued) => {
                limit.queued(ticket, false);
                limit.expires_in(hint);
                Answer::Queued
            }
            (None, ScriptAnswer::RetryAfter(after)) => {
                limit.queued(ticket, true);
                Answer::RetryAfter(after)
            }
        };
        if let Some(other) = gone {
            state.orphans.push(name, other);
        }
        answer
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
        if let Some(leased) = self.serving(name, ticket) {
            return leased::answer(self, &leased, name, ticket, &ask, lease);
        }
        let (local, mut new) = {
            let mut state = self.lock_state();
            let limit = state.limits.entry(name.to_owned()).or_default();
            if let Some(grant) = limit.claim(ticket) {
                return Ok(Answer::Granted(grant));
            }
            if limit.is_open(ticket) {
                return Ok(Answer::Granted(Grant { fencing_token: 0, expires_at: None }));
            }
            let local = limit.is_local(ticket);
            let mut new = false;
            if !local && let Ask::First(priority) = &ask {
                // Known before the call: a grant pushed while the call travels finds its waiter.
                // (A check never adds a waiter: a ticket this client finished stays finished.)
                new = limit.ask(ticket, priority.clone(), lease.is_some());
            }
            (local, new)
        };
        if local {
            return match &ask {
                Ask::First(priority) => self.local.acquire(name, ticket, priority, lease).await,
                Ask::Check => self.local.check(name, ticket, lease).await,
                Ask::Try => self.local.try_acquire(name, ticket, lease).await,
            };
        }
        if matches!(self.outage, OutagePolicy::LocalShare(_))
            && !self.lock_state().specs.contains_key(name)
        {
            // Learn the spec while Redis answers; an outage now is handled below.
            let _ = self.info(name).await;
        }
        let lease_or_own = lease.unwrap_or(self.lease);
        let mut ask = ask;
        for attempt in 0..3 {
            let sent = Instant::now();
            // Only the first call about a ticket may say so: a later one may follow a call
            // whose answer was lost, and Redis may hold the ticket then.
            let fresh = std::mem::take(&mut new);
            match self.ask_remote(name, ticket, &ask, fresh, lease_or_own).await {
                Ok(Reply::Answer(answer, grant, hint)) => {
                    if matches!(ask, Ask::Try) && !matches!(answer, ScriptAnswer::Granted) {
                        // A try leaves nothing behind, here either.
                        self.lock_state().limits.entry(name.to_owned()).or_default().forget(ticket);
                        return Ok(match answer {
                            ScriptAnswer::RetryAfter(after) => Answer::RetryAfter(after),
                            _ => Answer::Queued,
                        });
                    }
                    if matches!(ask, Ask::Try) && lease.is_some() {
                        // Granted to a try with its own lease: its holder renews it.
                        self.lock_state().limits.entry(name.to_owned()).or_default().hold(
                            ticket,
                            true,
                            self.lease_end(sent, lease_or_own),
                        );
                    }
                    let answer = (answer, grant, hint);
                    return Ok(self.apply(name, ticket, answer, sent, lease_or_own));
                }
                Ok(Reply::TooManyWaiters) => {
                    self.lock_state().limits.entry(name.to_owned()).or_default().forget(ticket);
                    return Err(LimitError::TooManyWaiters {
                        limit: name.to_owned(),
                        max: self.max_waiters,
                    });
                }
                Ok(Reply::Finished) => {
                    let priority = {
                        let mut state = self.lock_state();
                        let limit = state.limits.entry(name.to_owned()).or_default();
                        let waiting = limit.is_waiting(ticket);
                        let priority = limit.priority(ticket);
                        if limit.lose(ticket) {
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
                            self.lock_state()
                                .limits
                                .entry(name.to_owned())
                                .or_default()
                                .queued(ticket, false);
                            ask = Ask::First(priority);
                        }
                        _ => {
                            self.lock_state()
                                .limits
                                .entry(name.to_owned())
                                .or_default()
                                .forget(ticket);
                            return Ok(Answer::Finished);
                        }
                    }
                }
                Ok(Reply::Leased(policy)) => {
                    // Defined leased (by another client): served from this client's share.
                    self.lock_state().limits.entry(name.to_owned()).or_default().forget(ticket);
                    let leased = self.serve_leased(name, policy);
                    leased.store_answered();
                    return leased::answer(self, &leased, name, ticket, &ask, lease);
                }
                Ok(Reply::Unknown) => {
                    let known = self.lock_state().specs.contains_key(name);
                    if !known || attempt == 2 {
                        self.lock_state().limits.entry(name.to_owned()).or_default().forget(ticket);
                        return Err(LimitError::UnknownLimit(name.to_owned()));
                    }
                    match self.detect_loss().await {
                        // Redis lost its state: the limits this client knows are back (held).
                        Ok(true) => {}
                        Ok(false) => {
                            // Removed by another client: this one forgets it too, unless it
                            // defined it itself (then define it again, as before). It may
                            // instead have been lost with the last writes (created just before
                            // a failover, or a restart from a snapshot that lags: the epoch
                            // kept), with grants whose holders still work: its grants wait a
                            // lease. (A removal needs no holders: there, only a delay.)
                            let spec = {
                                let mut state = self.lock_state();
                                match state.defined.contains(name) {
                                    true => state.specs.get(name).copied(),
                                    false => {
                                        // Read only: gone for this client too.
                                        state.specs.remove(name);
                                        state
                                            .limits
                                            .entry(name.to_owned())
                                            .or_default()
                                            .forget(ticket);
                                        None
                                    }
                                }
                            };
                            let Some(spec) = spec else {
                                return Err(LimitError::UnknownLimit(name.to_owned()));
                            };
                            self.stats.redefinitions.fetch_add(1, Ordering::Relaxed);
                            if let Err(err) = self.define_held(name, spec, self.max_lease).await {
                                return self.outage_for(name, ticket, ask, lease, err).await;
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

    async fn release(&self, name: &str, ticket: u64) -> Result<Released, LimitError> {
        if let Some(leased) = self.serving(name, ticket) {
            let released = leased.release(ticket);
            if released != Released::Unknown {
                return Ok(released);
            }
        }
        self.lost.forget(name, ticket);
        let place = {
            let mut state = self.lock_state();
            state.limits.entry(name.to_owned()).or_default().release(ticket)
        };
        match place {
            Place::Open => Ok(Released::Permit),
            Place::Local => self.local.release(name, ticket).await,
            Place::Remote => match self.call(name, "release", &[Arg::Int(ticket)]).await {
                Ok(value) => Ok(match int(&value) {
                    Some(1) => Released::Permit,
                    Some(2) => Released::Withdrawn,
                    _ => Released::Unknown,
                }),
                Err(CallError::Outage(_)) => {
                    self.lock_state().orphans.push(name, ticket);
                    Ok(Released::Unknown)
                }
                Err(CallError::Other(err)) => Err(err),
            },
        }
    }

    /// A dropped permit (or waiting ticket) of `name`: its release rides ahead of this
    /// client's next call on the limit, so that a task that drops a permit and asks again
    /// makes one call, with the release first (a waiter gets the permit before the asker is
    /// queued). If no call comes first, a task started now on the client's runtime sends it,
    /// and the maintenance loop sends any left waiting (that task may never run: its runtime
    /// may be shutting down). `false` when it cannot ride: a ticket served without Redis.
    fn ride(&self, name: &str, ticket: u64) -> bool {
        let Some(me) = self.me.get().and_then(Weak::upgrade) else { return false };
        let first = {
            let mut state = self.lock_state();
            match state.limits.get_mut(name).and_then(|limit| limit.ride(ticket)) {
                Some(first) => first,
                None => return false,
            }
        };
        self.lost.forget(name, ticket);
        if first {
            let name = name.to_owned();
            self.runtime.spawn(async move { me.flush_riders(&name).await });
        }
        true
    }

    async fn wait(&self, name: &str, ticket: u64, at_most: Duration) {
        if let Some(leased) = self.serving(name, ticket) {
            return leased.wait(ticket, at_most).await;
        }
        let plan =
            self.lock_state().limits.entry(name.to_owned()).or_default().plan_wait(ticket, at_most);
        match plan {
            WaitPlan::Ready => {}
            WaitPlan::Local => self.local.wait(name, ticket, at_most).await,
            WaitPlan::Remote(notify, sleep) => {
                tokio::select! {
                    () = notify.notified() => {}
                    () = tokio::time::sleep(sleep) => {}
                }
            }
        }
    }

    async fn info(&self, name: &str) -> Result<Option<LimitInfo>, LimitError> {
        let value = self.call(name, "info", NO_ARGS).await?;
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
        self.lock_state().specs.insert(name.to_owned(), spec);
        let info = LimitInfo::new(
            name,
            spec,
            u32::try_from(field(3)?).map_err(|_| bad())?,
            usize::try_from(field(4)?).map_err(|_| bad())?,
            u64::try_from(field(5)?).map_err(|_| bad())?,
            u32::try_from(field(6)?).map_err(|_| bad())?,
        );
        let mode = items.get(7).and_then(text).unwrap_or_default();
        if mode.is_empty() {
            return Ok(Some(info));
        }
        // Each ledger's entries: "client|share|reserved|held|demand".
        let entries = |i: usize| -> Vec<[u64; 5]> {
            let Some(Value::Array(entries)) = items.get(i) else { return Vec::new() };
            entries
                .iter()
                .filter_map(text)
                .filter_map(|entry| {
                    let n: Vec<u64> = entry.split('|').filter_map(|f| f.parse().ok()).collect();
                    n.try_into().ok()
                })
                .collect()
        };
        let narrow = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
        let mut shares: Vec<ShareInfo> = entries(8)
            .into_iter()
            .map(|[client, share, reserved, held, demand]| {
                ShareInfo::new(
                    client,
                    narrow(share),
                    narrow(reserved),
                    narrow(held),
                    narrow(demand),
                )
            })
            .collect();
        // The rate ledger, in thousandths of a grant per second.
        for [client, share, _, _, demand] in entries(9) {
            let milli = |v: u64| v as f64 / 1000.0;
            match shares.iter_mut().find(|s| s.client == client) {
                Some(info) => *info = info.clone().with_rate(milli(share), milli(demand)),
                None => shares.push(
                    ShareInfo::new(client, 0, 0, 0, 0).with_rate(milli(share), milli(demand)),
                ),
            }
        }
        shares.sort_by_key(|s| s.client);
        Ok(Some(info.leased(mode, shares)))
    }
}

impl RedisLimits {
    /// A builder for a client of the Redis at `url` (`redis://host:port/db`).
    pub fn builder(url: impl Into<String>) -> RedisLimitsBuilder {
        Self::builder_for(Target::Single(url.into()))
    }

    /// A builder for a client of the Redis Cluster that `nodes` belong to
    /// (`redis://host:port` each; one reachable node is enough to start, the rest are
    /// discovered). Give several, ideally every primary: a connection that stops answering is
    /// made again from these addresses, so one that survives must be among them.
    ///
    /// Each limit lives in one slot (its keys share a hash tag), so limits spread over the
    /// cluster's primaries. When a primary fails and its replica is promoted, the replica may
    /// lack the last writes (Redis replicates asynchronously): the first call that reaches a
    /// limit on a node other than the one that last served it holds the limit's grants for
    /// `max_lease`, as after a Redis that lost its state, and moves its fencing tokens past
    /// any that may have been handed out. Holders whose grants were lost are told so at their
    /// next renewal, within that hold. A resharding that moves a limit's slot holds it too.
    pub fn cluster_builder<I, S>(nodes: I) -> RedisLimitsBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self::builder_for(Target::Cluster(nodes.into_iter().map(Into::into).collect()))
    }

    fn builder_for(target: Target) -> RedisLimitsBuilder {
        RedisLimitsBuilder {
            target,
            namespace: "lanes".into(),
            lease: Duration::from_secs(3),
            max_waiters: lanes::LimitTable::DEFAULT_MAX_WAITERS,
            outage: OutagePolicy::FailClosed,
            op_timeout: Duration::from_millis(500),
            auto_renew: true,
            max_lease: None,
            queue_grace: Duration::from_secs(2),
            max_limits: usize::MAX,
            max_pending_releases: tickets::DEFAULT_MAX_PENDING_RELEASES,
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

    /// Refreshes this client's share of limit `name` under leased capacity: the refresh of
    /// [`lanes::limit::share::Ledger`], run in Redis on the limit's own ledger (the limit's
    /// `concurrent` is the capacity apportioned). `demand` is what this client wants (its
    /// holders and waiters, per priority level), `held` the permits it has out now; `tokens`
    /// asks for a block of that many fencing tokens for the grants it makes from its share.
    /// The share lasts this client's lease. A limit defined with
    /// [`define_leased`](Self::define_leased) is refreshed this way in the background: do not
    /// call this for a limit this client serves leased (its reservation would follow this
    /// call's `held`, not the permits actually out, and the background refreshes would be
    /// numbered behind it). `policy` is not used: the limit's own policy, set at its
    /// definition, applies.
    ///
    /// # Errors
    ///
    /// [`LimitError::UnknownLimit`] if `name` is not defined, [`LimitError::Backend`] if Redis
    /// cannot answer.
    pub async fn refresh_share(
        &self,
        name: &str,
        demand: &Demand,
        held: u32,
        policy: SharePolicy,
        tokens: u64,
    ) -> Result<ShareLease, LimitError> {
        let mut ask = ShareRequest::new(demand.clone(), held, policy, tokens);
        // Calls of one client are numbered in order: none of them is stale.
        ask.seq = self.inner.share_seq.fetch_add(1, Ordering::Relaxed) + 1;
        let inner = &self.inner;
        let reply = inner.refresh_share(name, inner.ledger_id, ask, inner.lease).await?;
        reply
            .into_lease(name)?
            .ok_or_else(|| LimitError::backend("redis: a later refresh overtook this one"))
    }

    /// This client's identity in the ledgers of leased limits: random per client (not the id
    /// its tickets carry, which a Redis that lost its state may hand out again).
    pub fn ledger_id(&self) -> u64 {
        self.inner.ledger_id
    }

    /// Defines `name` in leased mode: every client of the namespace serves it from a share of
    /// its `concurrent` permits (and of its rate, if it has one) that it holds for a lease and
    /// refreshes every third of one, with no round trip per acquire. Shares follow each
    /// client's demand (`policy`); they never add up to more than `concurrent`, nor to more
    /// than the rate. A client's demand for the rate is the rate its acquires arrived at since
    /// its last refresh plus its waiters (to be served within a refresh interval); it grants
    /// at most its part of the rate (GCRA, with the burst in proportion to its part, at least
    /// one, and a grant up to 2 ms late keeps that time), so the fleet grants at most the
    /// rate, the burst and two grants per client in any window. A rate share is
    /// counted in thousandths of a grant per second: up to about 4.29 million grants a second
    /// per level of demand. A permit handed out from a share is reported
    /// lost if the share lapses unrefreshed. Fencing tokens come from blocks reserved in
    /// Redis: unique across the fleet, increasing within each client, but not across clients
    /// (a client granting from an older block hands out lower tokens than another did before,
    /// as when a dead client's capacity moves to it): a downstream cannot refuse older holders
    /// by the highest token seen, as it can for an exact limit. A client states its
    /// demand by priority level (a share goes first to clients with high-level waiters) and
    /// serves its own waiters highest level first, fairness keys taking turns within a level
    /// in proportion to their weights, first come first served within a key (keys take turns
    /// within each client's line, not across clients, whose shares follow their demand by
    /// level).
    ///
    /// An exact limit becomes leased only while nobody holds or waits for it: its holders and
    /// waiters would come on top of the shares. A leased limit is removed once no client's
    /// share held a permit at its last refresh (a permit granted since is reported lost when
    /// its share ends); each client's keeper of it then retires.
    ///
    /// # Errors
    ///
    /// As for [`LimitBackend::define`]; [`LimitError::InUse`] for an exact limit that is held
    /// or waited for.
    pub async fn define_leased(
        &self,
        name: &str,
        spec: LimitSpec,
        policy: SharePolicy,
    ) -> Result<(), LimitError> {
        spec.validate()?;
        let mode = match policy {
            SharePolicy::MaxMinFair => "leased:maxmin",
            SharePolicy::Proportional => "leased:proportional",
        };
        let before = self.inner.lock_state().modes.insert(name.to_owned(), mode.to_owned());
        if let Err(err) = self.inner.define(name, spec).await {
            // Refused (an exact limit still held or waited for, or a new one past
            // `max_limits`): it stays as it was here too.
            if matches!(
                err,
                CallError::Other(LimitError::InUse(_) | LimitError::TooManyLimits { .. })
            ) {
                let mut state = self.inner.lock_state();
                match before {
                    Some(before) => state.modes.insert(name.to_owned(), before),
                    None => state.modes.remove(name),
                };
            }
            return Err(err.into());
        }
        self.inner.serve_leased(name, policy);
        Ok(())
    }

    /// This client's share of leased limit `name` now: the most permits it may have out, and
    /// how many it has out; `None` for a limit it does not serve leased.
    pub fn share(&self, name: &str) -> Option<(u32, u32)> {
        self.inner.leased(name).map(|leased| leased.share())
    }

    /// This client's part of leased limit `name`'s rate now, in grants per second; `None` for
    /// a limit it does not serve leased, or one without a rate (as far as its last refresh
    /// said).
    pub fn rate_share(&self, name: &str) -> Option<f64> {
        self.inner.leased(name).and_then(|leased| leased.rate_share())
    }

    /// This client's counters.
    pub fn stats(&self) -> RedisStats {
        let s = &self.inner.stats;
        let (pending_releases, abandoned_releases) = {
            let state = self.inner.lock_state();
            (state.orphans.len() as u64, state.orphans.abandoned())
        };
        RedisStats {
            pending_releases,
            abandoned_releases,
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
        loop {
            let drawn = self.inner.next_ticket.fetch_add(1, Ordering::Relaxed);
            let ticket = (self.inner.client << CLIENT_SHIFT) | (drawn % (1 << CLIENT_SHIFT));
            if drawn < 1 << CLIENT_SHIFT || self.inner.may_reuse(drawn, ticket) {
                return ticket;
            }
        }
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
            // This client's own share knows its holders and waiters now; Redis learns of them
            // at the next refresh.
            if self.inner.leased(name).is_some_and(|share| !share.is_idle()) {
                return Err(LimitError::InUse(name.to_owned()));
            }
            let value = self.inner.call(name, "remove", NO_ARGS).await?;
            match error_tag(&value).as_deref() {
                Some("unknown") => {
                    // A name registered by a define that then failed counts towards
                    // `max_limits` until it is defined or removed.
                    let _ = self
                        .inner
                        .command::<()>(redis::cmd("SREM").arg(self.inner.registry_key()).arg(name))
                        .await;
                    return Err(LimitError::UnknownLimit(name.to_owned()));
                }
                Some("in_use") => return Err(LimitError::InUse(name.to_owned())),
                _ => {}
            }
            let _ = self
                .inner
                .command::<()>(redis::cmd("SREM").arg(self.inner.registry_key()).arg(name))
                .await;
            let mut state = self.inner.lock_state();
            state.specs.remove(name);
            state.defined.remove(name);
            state.limits.remove(name);
            // Not leased any more: a later define makes an exact limit (its keeper retires
            // once it finds the limit gone).
            state.modes.remove(name);
            drop(state);
            self.inner.leased.write().unwrap_or_else(PoisonError::into_inner).remove(name);
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
        // A leased limit answers from its share at once: no future of the remote path.
        if let Some(leased) = self.inner.serving_first(name, ticket) {
            let answer = leased
                .answer_within(ticket, Some(priority), false, self.inner.max_waiters)
                .map_err(|max| LimitError::TooManyWaiters { limit: name.to_owned(), max });
            if let (Ok(Answer::Granted(_)), Some(lease)) = (&answer, self.inner.share_lease(lease))
            {
                leased.lease(ticket, lease);
            }
            return Box::pin(std::future::ready(answer));
        }
        Box::pin(self.inner.acquire(name, ticket, Ask::First(priority.clone()), lease))
    }

    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        ticket: u64,
        lease: Option<Duration>,
    ) -> BoxFuture<'a, Result<Answer, LimitError>> {
        if let Some(leased) = self.inner.serving_first(name, ticket) {
            return Box::pin(std::future::ready(leased::answer(
                &self.inner,
                &leased,
                name,
                ticket,
                &Ask::Try,
                lease,
            )));
        }
        Box::pin(self.inner.acquire(name, ticket, Ask::Try, lease))
    }

    fn check<'a>(
        &'a self,
        name: &'a str,
        ticket: u64,
        lease: Option<Duration>,
    ) -> BoxFuture<'a, Result<Answer, LimitError>> {
        if let Some(leased) = self.inner.serving(name, ticket) {
            return Box::pin(std::future::ready(leased::answer(
                &self.inner,
                &leased,
                name,
                ticket,
                &Ask::Check,
                lease,
            )));
        }
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

    fn release_local(&self, name: &str, ticket: u64) -> bool {
        // A permit (or waiter) of the share goes back to it; one granted in exact mode goes
        // back to Redis, and so does one reported lost (it left the share then; its lost mark
        // goes there): ahead of this client's next call on the limit.
        self.inner.leased(name).is_some_and(|leased| {
            leased.knows(ticket) && leased.release(ticket) != Released::Unknown
        }) || self.inner.ride(name, ticket)
    }

    fn lease_lost(&self, name: &str, ticket: u64) -> bool {
        self.inner.lost.is_lost(name, ticket)
    }

    fn define_leased<'a>(
        &'a self,
        name: &'a str,
        spec: LimitSpec,
        policy: SharePolicy,
    ) -> BoxFuture<'a, Result<(), LimitError>> {
        Box::pin(RedisLimits::define_leased(self, name, spec, policy))
    }

    /// A client of this client (an HTTP client of a `lanes serve` on Redis) refreshes its
    /// share: the `lease` operation for ledger client `client` (hashed to an id below 2^53,
    /// apart from every Redis client's own random one only by chance of 1 in 2^53).
    fn refresh_share<'a>(
        &'a self,
        name: &'a str,
        client: &'a str,
        request: ShareRequest,
        lease: Duration,
    ) -> BoxFuture<'a, Result<ShareReply, LimitError>> {
        let id = ledger_id_of(client);
        Box::pin(self.inner.refresh_share(name, id, request, lease))
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
