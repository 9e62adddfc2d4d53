//! A keyed limit: one [`LimitSpec`] applied to every key on its own (a tenant, a client
//! address, a downstream host), each key's state made on first use and forgotten once idle.
//! See [`KeyedLimit`].

use std::borrow::Borrow;
use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasher, Hash};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use foldhash::fast::{FixedState, RandomState};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::config::{LimitSpec, gcra};
use super::core::LimitTable;
use super::error::{AcquireError, LimitError, TryAcquireError};
use crate::config::{ConfigError, ConfigRule};
use crate::observe::{Observe, Registration, Registry, Snapshot};
use crate::util::{Contained, Padded, WaitKey, WaitList, lock};

/// The fewest keys a shard keeps before it first looks for idle ones.
const MIN_SWEEP: usize = 64;

/// A shard at its cap of keys looks for idle ones again after this long at the latest (and
/// after a quarter of its cap in new keys at the cap): keys that went idle in a quiet spell
/// make room within it.
const CAP_SWEEP_GAP: u64 = 100_000_000;

/// Under `max_keys`, the fewest keys a shard keeps: its part of the cap (`max / shards`). Keys
/// spread unevenly over shards; with parts this large the first refusal comes about 5% before
/// the cap (at 1 key a part it came at about a tenth of it).
const SHARD_KEYS_MIN: usize = 1024;

/// A [`LimitSpec`] applied to each key on its own, in process: a rate limit per client
/// address, a concurrency limit per tenant, without defining a limit per key.
///
/// `check` and `try_acquire` answer at once; `acquire` waits, FIFO per key. Cheap to clone:
/// clones share the keys. Where [`Limits`](super::Limits) holds named limits (defined and
/// removed on purpose, with fencing tokens, priorities and fair queues, and shareable across
/// processes), a keyed limit is for keys that come and go with traffic: about a hundred bytes
/// per key, and memory that follows the keys in use rather than every key ever seen.
///
/// # Per key
///
/// A key holds GCRA's theoretical arrival time (its rate), the permits held (its concurrency)
/// and, while callers wait for a permit of that key, their line (FIFO; nobody overtakes it).
/// A key whose permits are all returned, whose line is empty and whose bucket is full again
/// answers exactly as a key never seen: it is *idle* (a key with a rate stays in use until its
/// bucket has refilled: at most `burst` tokens' time). A key an operation leaves idle is not
/// kept at all. A shard forgets its idle keys whenever its count of keys has doubled since it
/// last looked (and [`KeyedLimit::forget_idle`] does it on demand), so a shard keeps at most
/// about twice the keys in use at its last look, and no fewer than 64 before it looks, never
/// every key ever seen. For a hard bound whatever the traffic (a flood of new client
/// addresses, each key in use while its bucket refills), [`max_keys`] caps the keys kept and
/// refuses a new key past it with a typed error; and a key can have a spec of its own
/// ([`spec_for`]: a paying tenant's higher rate).
///
/// The key type's `Hash`, `Eq`, `Clone` (`ToOwned` for a borrowed key) and `Drop` run while
/// the key's shard is locked, so they should be quick, and must not call back into the same
/// limit (that call never returns). [`spec_for`] runs without the lock; so does the `metrics`
/// recorder.
///
/// [`max_keys`]: KeyedLimitBuilder::max_keys
/// [`spec_for`]: KeyedLimitBuilder::spec_for
///
/// # Waiting
///
/// [`acquire`](KeyedLimit::acquire) first takes one of the key's `concurrent` permits, in the
/// key's line if all are held: a returned permit goes to the first in line. Then, with a rate,
/// it reserves the key's next token and sleeps until the token is due: tokens go out in the
/// order they were reserved, and a wait dropped while it sleeps returns its permit but not its
/// token (a rate is never exceeded, at worst under-used). A deadline that a token would miss
/// is refused at once, with nothing spent. At most `max_waiters` callers wait per key, in line
/// or for their token.
///
/// # Examples
///
/// ```
/// use lanes::LimitSpec;
/// use lanes::limit::KeyedLimit;
///
/// // Each client address: 2 requests a second (a burst of 2), 1 upload at a time.
/// let per_client = KeyedLimit::<String>::new("per-client", LimitSpec::concurrent(1).per_second(2.0))?;
///
/// assert!(per_client.check("10.0.0.7").is_ok());
/// let upload = per_client.try_acquire("10.0.0.7")?;
/// assert!(per_client.try_acquire("10.0.0.7").unwrap_err().is_busy()); // one at a time
/// assert!(per_client.try_acquire("10.0.0.8").is_ok()); // another key is another limit
/// drop(upload);
/// assert!(per_client.check("10.0.0.7").unwrap_err().is_rate_limited()); // 2 tokens spent
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct KeyedLimit<K = String> {
    shared: Arc<Shared<K>>,
}

impl<K> Clone for KeyedLimit<K> {
    fn clone(&self) -> Self {
        Self { shared: Arc::clone(&self.shared) }
    }
}

impl<K> fmt::Debug for KeyedLimit<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyedLimit")
            .field("name", &self.shared.name)
            .field("spec", &self.shared.spec)
            .finish_non_exhaustive()
    }
}

struct Shared<K> {
    name: Arc<str>,
    spec: LimitSpec,
    rules: Rules,
    max_waiters: usize,
    /// Time zero of every key's theoretical arrival time (tokio's clock, so paused time in
    /// tests moves it).
    origin: Instant,
    /// Whether any key can have a rate (the limit's spec has one, or `spec_for` may give a key
    /// one). Without, no key's answer depends on the time, and the clock is read only to time
    /// a full shard's quiet spell (see [`now`](Self::now)).
    timed: bool,
    /// Picks a key's shard; the shards' maps hash with seeds of their own, so that the keys
    /// of one shard do not share their low bits in its map.
    pick: FixedState,
    shards: Box<[Padded<Mutex<Shard<K>>>]>,
    /// The most keys a shard keeps (`max_keys` split over the shards); `usize::MAX` for none.
    shard_cap: usize,
    /// `max_keys` as configured, for the error.
    max_keys: Option<usize>,
    /// A key's own spec, asked when its state is made.
    spec_for: Option<SpecFor<K>>,
    metrics: KeyedMetrics,
}

/// A key's own spec, if it differs from the limit's.
type SpecFor<K> = Box<dyn Fn(&K) -> Option<LimitSpec> + Send + Sync>;

/// The spec as the arithmetic uses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Rules {
    concurrent: u32,
    /// Nanoseconds between tokens at the sustained rate; 0 without a rate.
    interval: u64,
    /// How far ahead of now the theoretical arrival time may run: the burst less one token.
    tolerance: u64,
}

impl Rules {
    fn new(spec: &LimitSpec) -> Self {
        let interval = spec.interval_nanos();
        let tolerance = interval.saturating_mul(u64::from(spec.burst.saturating_sub(1)));
        Self { concurrent: spec.concurrent, interval, tolerance }
    }
}

struct Shard<K> {
    keys: HashMap<K, KeyState, RandomState>,
    /// Look for idle keys when `keys` reaches this many.
    sweep_at: usize,
    /// New keys to meet at the cap before looking for idle keys again: a look costs the whole
    /// shard, so a flood of new keys pays for one per quarter of the cap.
    cap_countdown: usize,
    /// When the shard last looked for idle keys at its cap (nanoseconds since the origin).
    cap_swept_at: u64,
    counts: Counts,
}

/// Permits held and callers waiting over a shard's keys, and what it counted.
#[derive(Debug, Default)]
struct Counts {
    held: u64,
    waiting: u64,
    acquired: u64,
    refused: u64,
    timed_out: u64,
    /// The last stamp of every line dropped in this shard: a new line's stamps start after
    /// it, so a caller's place in a dropped line never matches a place in a new one.
    stamps: u64,
}

/// One key's state. Pure: every method takes the time it acts at. 24 bytes: what most keys
/// never need is behind one pointer.
#[derive(Debug, Default)]
struct KeyState {
    /// GCRA's theoretical arrival time, nanoseconds since the limit's origin.
    tat: u64,
    held: u32,
    /// Made while callers wait for the key, or for a key with a spec of its own.
    more: Option<Box<More>>,
}

/// What a key keeps only while callers wait for it, or when it has a spec of its own.
#[derive(Debug)]
struct More {
    /// Callers waiting for a permit, in arrival order.
    line: WaitList,
    /// Callers holding a permit of this key while they sleep until their token is due.
    sleeping: u32,
    /// The key's own spec, where [`KeyedLimitBuilder::spec_for`] gave it one.
    own: Option<Rules>,
}

/// Why a key gave no permit now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// Every permit is held, or others wait ahead.
    Busy,
    /// The bucket is empty until this time (nanoseconds since the origin).
    Rate(u64),
}

impl KeyState {
    /// The rules this key follows: its own, or the limit's.
    fn rules(&self, limit: &Rules) -> Rules {
        self.more.as_ref().and_then(|more| more.own).unwrap_or(*limit)
    }

    fn in_line(&self) -> usize {
        self.more.as_ref().map_or(0, |more| more.line.len())
    }

    fn waiting(&self) -> usize {
        self.more.as_ref().map_or(0, |more| more.line.len() + more.sleeping as usize)
    }

    /// What the key keeps beyond its counts, made if need be (a new line's stamps start
    /// after `stamps`).
    fn more(&mut self, stamps: u64) -> &mut More {
        self.more.get_or_insert_with(|| {
            Box::new(More { line: WaitList::after(stamps), sleeping: 0, own: None })
        })
    }

    /// Whether a permit is free and nobody waits ahead for one.
    fn has_room(&self, rules: &Rules) -> bool {
        self.held < rules.concurrent && self.in_line() == 0
    }

    /// A permit and a token at `now` (the permit kept if `hold`, else returned at once), or
    /// why not. Nothing changes on a refusal.
    fn take(&mut self, rules: &Rules, now: u64, hold: bool) -> Result<(), Refusal> {
        if !self.has_room(rules) {
            return Err(Refusal::Busy);
        }
        if rules.interval != 0 {
            self.tat =
                gcra(self.tat, now, rules.interval, rules.tolerance).map_err(Refusal::Rate)?;
        }
        self.held += u32::from(hold);
        Ok(())
    }

    /// When the next token is due (`now` at the earliest).
    fn due(&self, rules: &Rules, now: u64) -> u64 {
        if rules.interval == 0 {
            return now;
        }
        gcra(self.tat, now, rules.interval, rules.tolerance).err().unwrap_or(now)
    }

    /// Spends the next token, due at [`due`](Self::due).
    fn reserve(&mut self, rules: &Rules, now: u64) {
        if rules.interval != 0 {
            self.tat = self.tat.max(now).saturating_add(rules.interval);
        }
    }

    /// Returns a permit: to the first caller in line (whose waker is returned: the permit is
    /// now its), or to the key.
    fn release(&mut self) -> Option<Waker> {
        if let Some(waker) = self.more.as_mut().and_then(|more| more.line.pop()) {
            return Some(waker);
        }
        debug_assert!(self.held > 0, "a release without a permit");
        self.held = self.held.saturating_sub(1);
        None
    }

    /// Drops what the key keeps beyond its counts once nothing is left in it (the line's
    /// stamps go on in `stamps`).
    fn tidy(&mut self, stamps: &mut u64) {
        let unused =
            |more: &mut Box<More>| more.line.is_empty() && more.sleeping == 0 && more.own.is_none();
        if let Some(more) = self.more.take_if(unused) {
            *stamps = (*stamps).max(more.line.stamps());
        }
    }

    /// Whether the key answers as a key never seen: nothing held, nobody waiting, the bucket
    /// full (a theoretical arrival time not after `now` counts as `now`).
    fn idle(&self, now: u64) -> bool {
        self.held == 0 && self.waiting() == 0 && self.tat <= now
    }
}

impl<K: Hash + Eq> Shard<K> {
    fn new() -> Self {
        Self {
            keys: HashMap::with_hasher(RandomState::default()),
            sweep_at: MIN_SWEEP,
            cap_countdown: 0,
            cap_swept_at: 0,
            counts: Counts::default(),
        }
    }

    /// Forgets the idle keys; returns how many.
    fn sweep(&mut self, now: u64) -> usize {
        let before = self.keys.len();
        let stamps = &mut self.counts.stamps;
        self.keys.retain(|_, state| {
            let idle = state.idle(now);
            // Its line's stamps go on, as when a line is dropped (see `KeyState::tidy`).
            if idle && let Some(more) = &state.more {
                *stamps = (*stamps).max(more.line.stamps());
            }
            !idle
        });
        let kept = self.keys.len();
        if self.keys.capacity() > 4 * kept.max(MIN_SWEEP) {
            self.keys.shrink_to(2 * kept.max(MIN_SWEEP));
        }
        self.sweep_at = (2 * kept).max(MIN_SWEEP);
        before - kept
    }
}

/// The family's `metrics` handles, labelled by its name. Called after the shard's lock (the
/// recorder is user code, which may call into this limit), and contained ([`Contained`]): many
/// calls are made after a permit is taken and before the [`KeyedPermit`] that gives it back
/// exists, or as a wait leaves the key's line; a recorder's panic unwound from there would
/// leave the permit held, or the line stalled, for good.
struct KeyedMetrics {
    acquired: Contained<metrics::Counter>,
    refused: Contained<metrics::Counter>,
    timed_out: Contained<metrics::Counter>,
    held: Contained<metrics::Gauge>,
    waiters: Contained<metrics::Gauge>,
    keys: Contained<metrics::Gauge>,
}

impl KeyedMetrics {
    fn new(name: &str) -> Self {
        let labels = [("limit", name.to_owned())];
        Self {
            acquired: Contained(metrics::counter!("lanes_limit_keyed_acquired_total", &labels)),
            refused: Contained(metrics::counter!("lanes_limit_keyed_refused_total", &labels)),
            timed_out: Contained(metrics::counter!("lanes_limit_keyed_timed_out_total", &labels)),
            held: Contained(metrics::gauge!("lanes_limit_keyed_held", &labels)),
            waiters: Contained(metrics::gauge!("lanes_limit_keyed_waiters", &labels)),
            keys: Contained(metrics::gauge!("lanes_limit_keyed_keys", &labels)),
        }
    }
}

/// What a keyed limit reports: its spec and its totals over every key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct KeyedLimitInfo {
    /// The limit's name.
    pub name: String,
    /// The limit's spec: each key's, unless [`KeyedLimitBuilder::spec_for`] gave it its own.
    pub spec: LimitSpec,
    /// Keys kept now (in use, or idle and not yet forgotten).
    pub keys: usize,
    /// Permits held now, over every key.
    pub held: u64,
    /// Callers waiting now, over every key: for a permit, or for their token.
    pub waiting: u64,
    /// Permits granted (and checks passed) since the limit was made.
    pub acquired_total: u64,
    /// Checks and tries refused, acquires that found the waiting room full, and new keys
    /// refused (past `max_keys`, or with an invalid own spec).
    pub refused_total: u64,
    /// Acquires that gave up at their deadline.
    pub timed_out_total: u64,
}

impl Snapshot {
    /// The keyed limit registered as `name`.
    pub fn keyed_limit(&self, name: &str) -> Option<KeyedLimitInfo> {
        self.get("keyed_limits", name)
    }
}

/// Builds a [`KeyedLimit`] with options beyond [`KeyedLimit::new`].
pub struct KeyedLimitBuilder<K> {
    name: String,
    spec: LimitSpec,
    max_waiters: usize,
    max_keys: Option<usize>,
    spec_for: Option<SpecFor<K>>,
    registry: Option<Registration>,
    key: std::marker::PhantomData<fn() -> K>,
}

impl<K> fmt::Debug for KeyedLimitBuilder<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyedLimitBuilder")
            .field("name", &self.name)
            .field("spec", &self.spec)
            .field("max_waiters", &self.max_waiters)
            .field("max_keys", &self.max_keys)
            .field("spec_for", &self.spec_for.as_ref().map(|_| "fn"))
            .field("registry", &self.registry)
            .finish()
    }
}

impl<K: Hash + Eq + Send + Sync + 'static> KeyedLimitBuilder<K> {
    /// At most `max_waiters` callers wait per key, in line or for their token; the next is
    /// refused with [`LimitError::TooManyWaiters`]. Default: as for a named limit,
    /// [`LimitTable::DEFAULT_MAX_WAITERS`].
    #[must_use]
    pub fn max_waiters(mut self, max_waiters: usize) -> Self {
        self.max_waiters = max_waiters;
        self
    }

    /// At most `max_keys` keys kept at once: exactly, under 2,048; a larger cap is split evenly
    /// over the limit's shards (each keeps at least 1,024 keys), so a new key may be refused a
    /// little before the whole limit keeps `max_keys` (keys hash unevenly: about 5% short). A new key that
    /// finds its shard full of keys in use is refused with [`LimitError::TooManyKeys`] (for
    /// `check` and `try_acquire`, inside [`TryAcquireError::Limit`]); keys already kept are
    /// served as before. A full shard looks for idle keys again after a quarter of its share
    /// in new keys, or 100 ms, whichever comes first: a flood of new keys pays for a look
    /// over many refusals, and keys that went idle in a quiet spell make room within 100 ms.
    /// Default: no cap, the keys kept follow the keys in use.
    #[must_use]
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = Some(max_keys);
        self
    }

    /// A key's own spec, where it differs from the limit's (a paying tenant's higher rate):
    /// asked when the key's state is made, that is on its first use and again after it was
    /// forgotten, so it should answer the same for a key every time. `None` keeps the
    /// limit's spec. A spec that breaks a rule refuses the key's operations with
    /// [`LimitError::InvalidSpec`]. It is called without the limit's locks, so it may take
    /// its time or look at this limit; a clone of the limit captured in it would keep the
    /// limit alive for good (a cycle), so capture what it needs instead.
    ///
    /// ```
    /// use lanes::{KeyedLimit, LimitSpec};
    ///
    /// let per_tenant: KeyedLimit = KeyedLimit::builder("per-tenant", LimitSpec::concurrent(1))
    ///     .spec_for(|tenant: &String| tenant.starts_with("gold-").then(|| LimitSpec::concurrent(10)))
    ///     .build()?;
    /// let _a = per_tenant.try_acquire("gold-acme")?;
    /// let _b = per_tenant.try_acquire("gold-acme")?;
    /// let _c = per_tenant.try_acquire("free-bob")?;
    /// assert!(per_tenant.try_acquire("free-bob").unwrap_err().is_busy());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn spec_for(
        mut self,
        spec_for: impl Fn(&K) -> Option<LimitSpec> + Send + Sync + 'static,
    ) -> Self {
        self.spec_for = Some(Box::new(spec_for));
        self
    }

    /// Reports the limit in `registry` under `name` ([`Snapshot::keyed_limit`]).
    #[must_use]
    pub fn registry(mut self, registry: &Registry, name: impl Into<String>) -> Self {
        self.registry = Some(Registration::new(registry, name));
        self
    }

    /// Builds the limit.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`]: a spec field that breaks its rule (`keyed_limit.concurrent` or
    /// `keyed_limit.burst` of 0: [`ConfigRule::Zero`]; `keyed_limit.per_second` not finite
    /// and above zero: [`ConfigRule::Positive`]), `max_waiters` or `max_keys` of 0, a
    /// registry name already taken.
    pub fn build(self) -> Result<KeyedLimit<K>, ConfigError> {
        if let Err(err) = self.spec.validate() {
            let rule = match err.field() {
                "per_second" => ConfigRule::Positive,
                _ => ConfigRule::Zero,
            };
            return Err(ConfigError::new(format!("keyed_limit.{}", err.field()), rule));
        }
        if self.max_waiters == 0 {
            return Err(ConfigError::new("keyed_limit.max_waiters", ConfigRule::Zero));
        }
        if self.max_keys == Some(0) {
            return Err(ConfigError::new("keyed_limit.max_keys", ConfigRule::Zero));
        }
        if let Some(registration) = &self.registry {
            registration.check()?;
        }
        let mut shards = std::thread::available_parallelism()
            .map_or(4, std::num::NonZeroUsize::get)
            .saturating_mul(4)
            .next_power_of_two()
            .min(256);
        if let Some(max) = self.max_keys {
            // Each shard keeps its part of `max`: split thinner than `SHARD_KEYS_MIN` a shard,
            // keys that hash unevenly were refused well before `max` (on 16 cores, 64 shards
            // of one key each for `max_keys(100)`: about the tenth key refused). A cap under
            // twice that is one shard's, exact.
            shards = shards.min(1 << (max / SHARD_KEYS_MIN).max(1).ilog2());
        }
        let rules = Rules::new(&self.spec);
        let shared = Arc::new(Shared {
            name: Arc::from(self.name.as_str()),
            spec: self.spec,
            rules,
            max_waiters: self.max_waiters,
            origin: Instant::now(),
            timed: rules.interval != 0 || self.spec_for.is_some(),
            pick: FixedState::with_seed(0x6c61_6e65_735f_6b79),
            shards: (0..shards).map(|_| Padded(Mutex::new(Shard::new()))).collect(),
            shard_cap: self.max_keys.map_or(usize::MAX, |max| max / shards),
            max_keys: self.max_keys,
            spec_for: self.spec_for,
            metrics: KeyedMetrics::new(&self.name),
        });
        if let Some(registration) = &self.registry {
            registration.register(&shared)?;
        }
        Ok(KeyedLimit { shared })
    }
}

impl<K: Hash + Eq + Send + Sync + 'static> KeyedLimit<K> {
    /// A keyed limit named `name` (its `metrics` label) giving each key `spec`.
    ///
    /// # Errors
    ///
    /// As [`KeyedLimitBuilder::build`]: a spec field that breaks its rule.
    pub fn new(name: &str, spec: LimitSpec) -> Result<Self, ConfigError> {
        Self::builder(name, spec).build()
    }

    /// A builder, for the waiting room's size, a cap on keys, a spec per key and a registry.
    pub fn builder(name: &str, spec: LimitSpec) -> KeyedLimitBuilder<K> {
        KeyedLimitBuilder {
            name: name.to_owned(),
            spec,
            max_waiters: LimitTable::DEFAULT_MAX_WAITERS,
            max_keys: None,
            spec_for: None,
            registry: None,
            key: std::marker::PhantomData,
        }
    }

    /// The limit's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The limit's spec: each key's, unless [`KeyedLimitBuilder::spec_for`] gave it its own.
    pub fn spec(&self) -> LimitSpec {
        self.shared.spec
    }

    /// Spends a token of `key` if a permit could be granted now, and holds nothing (governor's
    /// `check_key`; a limit without a rate only looks for a free permit).
    ///
    /// # Errors
    ///
    /// [`TryAcquireError::Busy`] if every permit of the key is held or others wait for one,
    /// [`TryAcquireError::RateLimited`] (with the time to the next token) if its bucket is
    /// empty; for a new key, [`TryAcquireError::Limit`] with [`LimitError::TooManyKeys`]
    /// (past [`max_keys`](KeyedLimitBuilder::max_keys)) or [`LimitError::InvalidSpec`] (its
    /// own spec breaks a rule).
    pub fn check<Q>(&self, key: &Q) -> Result<(), TryAcquireError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        self.shared.take(key, false).map(drop)
    }

    /// A permit of `key` now, or why not; it is returned when dropped. Never waits.
    ///
    /// # Errors
    ///
    /// As [`check`](Self::check).
    pub fn try_acquire<Q>(&self, key: &Q) -> Result<KeyedPermit<K>, TryAcquireError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let hash = self.shared.take(key, true)?;
        Ok(KeyedPermit { shared: Arc::clone(&self.shared), key: key.to_owned(), hash })
    }

    /// A permit of `key`, waiting for it as long as it takes (see [Waiting](KeyedLimit#waiting)).
    /// Cancel-safe: dropped while it waits, it leaves the key's line (or passes on a permit
    /// handed to it).
    ///
    /// # Errors
    ///
    /// [`LimitError::TooManyWaiters`] if `max_waiters` callers wait for this key already; for
    /// a new key, [`LimitError::TooManyKeys`] or [`LimitError::InvalidSpec`] as for
    /// [`check`](Self::check).
    pub async fn acquire<Q>(&self, key: &Q) -> Result<KeyedPermit<K>, LimitError>
    where
        K: Borrow<Q> + Clone,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        match self.wait(key.to_owned(), None).await {
            Ok(permit) => Ok(permit),
            Err(Waited::Refused(err)) => Err(err),
            Err(Waited::Late) => unreachable!("a wait without a deadline is never late"),
        }
    }

    /// [`acquire`](Self::acquire), giving up after `timeout`.
    ///
    /// # Errors
    ///
    /// [`AcquireError::Timeout`] when no permit came in time, or at once when the key's next
    /// token would come too late (nothing is spent then); [`AcquireError::Limit`] as for
    /// [`acquire`](Self::acquire).
    pub async fn acquire_timeout<Q>(
        &self,
        key: &Q,
        timeout: Duration,
    ) -> Result<KeyedPermit<K>, AcquireError>
    where
        K: Borrow<Q> + Clone,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        // A timeout past the clock's range waits as long as it takes.
        self.wait_for(key.to_owned(), Instant::now().checked_add(timeout), timeout).await
    }

    /// [`acquire`](Self::acquire), giving up at `deadline` (tokio's clock).
    ///
    /// # Errors
    ///
    /// As for [`acquire_timeout`](Self::acquire_timeout); a timeout carries the time from the
    /// call to `deadline`.
    pub async fn acquire_until<Q>(
        &self,
        key: &Q,
        deadline: Instant,
    ) -> Result<KeyedPermit<K>, AcquireError>
    where
        K: Borrow<Q> + Clone,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let timeout = deadline.saturating_duration_since(Instant::now());
        self.wait_for(key.to_owned(), Some(deadline), timeout).await
    }

    /// [`wait`](Self::wait), its lateness told as a timeout of `timeout`.
    async fn wait_for(
        &self,
        key: K,
        deadline: Option<Instant>,
        timeout: Duration,
    ) -> Result<KeyedPermit<K>, AcquireError>
    where
        K: Clone,
    {
        match self.wait(key, deadline).await {
            Ok(permit) => Ok(permit),
            Err(Waited::Refused(err)) => Err(AcquireError::Limit(err)),
            Err(Waited::Late) => Err(AcquireError::Timeout(timeout)),
        }
    }

    /// Forgets every idle key now (the shards also do it as they grow); returns how many.
    pub fn forget_idle(&self) -> usize {
        let now = self.shared.now();
        let mut forgotten = 0;
        for shard in &self.shared.shards {
            let mut shard = lock(shard);
            forgotten += shard.sweep(now);
            shard.cap_countdown = 0;
        }
        self.shared.metrics.keys.decrement(forgotten as f64);
        forgotten
    }

    /// Keys kept now: in use, or idle and not yet forgotten.
    pub fn keys(&self) -> usize {
        self.shared.shards.iter().map(|shard| lock(shard).keys.len()).sum()
    }

    /// The limit's totals now.
    pub fn info(&self) -> KeyedLimitInfo {
        self.shared.info()
    }

    async fn wait(&self, key: K, deadline: Option<Instant>) -> Result<KeyedPermit<K>, Waited>
    where
        K: Clone,
    {
        let shared = &*self.shared;
        let hash = shared.pick.hash_one(&key);
        let mut line = InLine { shared, key: &key, hash, at: None, done: false };
        let joined = std::future::poll_fn(|cx| line.poll(cx));
        let slot = match deadline {
            None => joined.await,
            Some(at) => match tokio::time::timeout_at(at, joined).await {
                Ok(slot) => slot,
                Err(_) => {
                    // `joined` is dropped: `line` leaves the line (or passes a permit on).
                    drop(line);
                    return Err(shared.late(hash));
                }
            },
        };
        drop(line);
        slot.map_err(Waited::Refused)?;
        // The permit is ours from here: anything below that gives up returns it.
        let permit = KeyedPermit { shared: Arc::clone(&self.shared), key, hash };
        let rated = shared.rules.interval != 0 || shared.spec_for.is_some();
        let due = if rated { shared.reserve(&permit, deadline)? } else { None };
        if let Some(due) = due {
            let _asleep = Asleep { shared, key: &permit.key, hash };
            tokio::time::sleep_until(shared.at(due)).await;
        }
        lock(shared.shard(hash)).counts.acquired += 1;
        shared.metrics.acquired.increment(1);
        Ok(permit)
    }
}

/// Why a wait ended without a permit.
enum Waited {
    Refused(LimitError),
    /// Its deadline came first, or its token would come after it.
    Late,
}

/// What making a key did to its shard's keys, counted in the metrics as it drops, after the
/// shard's lock: every call into the recorder is made without it, as the recorder is user
/// code, which may call into this limit.
struct KeysMoved<'a> {
    metrics: &'a KeyedMetrics,
    /// Idle keys the shard forgot first.
    forgotten: usize,
    /// The key was kept.
    made: bool,
    /// The key was refused (the shard at its cap).
    refused: bool,
}

impl<'a> KeysMoved<'a> {
    #[inline]
    fn new(metrics: &'a KeyedMetrics) -> Self {
        Self { metrics, forgotten: 0, made: false, refused: false }
    }
}

impl Drop for KeysMoved<'_> {
    #[inline]
    fn drop(&mut self) {
        if self.forgotten > 0 {
            self.metrics.keys.decrement(self.forgotten as f64);
        }
        if self.made {
            self.metrics.keys.increment(1.0);
        }
        if self.refused {
            self.metrics.refused.increment(1);
        }
    }
}

impl<K> Shared<K> {
    /// The time the keys' arithmetic uses, in nanoseconds since `origin`; 0 for a limit whose
    /// keys have no rate. A key without a rate neither spends tokens nor waits for one, and
    /// its theoretical arrival time stays 0, so it is idle (or not) at any time: the clock's
    /// read, more than half of a check of a concurrency per tenant, is skipped. (A full
    /// shard's quiet spell is timed on the [`clock`](Self::clock) all the same.)
    #[inline]
    fn now(&self) -> u64 {
        if !self.timed {
            return 0;
        }
        self.clock()
    }

    /// The clock, in nanoseconds since `origin`.
    fn clock(&self) -> u64 {
        u64::try_from(Instant::now().saturating_duration_since(self.origin).as_nanos())
            .unwrap_or(u64::MAX)
    }

    fn at(&self, nanos: u64) -> Instant {
        self.origin + Duration::from_nanos(nanos)
    }

    /// The shard of a key whose hash (by `pick`) is `hash`.
    #[inline]
    fn shard(&self, hash: u64) -> &Mutex<Shard<K>> {
        // The high bits: a hash's low bits also pick its bucket in the map.
        &self.shards[(hash >> 40) as usize & (self.shards.len() - 1)]
    }

    fn too_many(&self) -> LimitError {
        LimitError::TooManyWaiters { limit: self.name.to_string(), max: self.max_waiters }
    }

    /// Counts a wait that gave up at its deadline.
    fn late(&self, hash: u64) -> Waited {
        lock(self.shard(hash)).counts.timed_out += 1;
        self.metrics.timed_out.increment(1);
        Waited::Late
    }
}

impl<K: Hash + Eq> Shared<K> {
    /// Returns a permit of `key`: to the first caller in its line, or to the key. With
    /// `leaving`, a caller dropped in the key's line leaves it first, and returns nothing if
    /// it was still there (it never had a permit; one handed to it goes on).
    fn release(&self, key: &K, hash: u64, leaving: Option<WaitKey>) {
        let mut guard = lock(self.shard(hash));
        let Shard { keys, counts, .. } = &mut *guard;
        let Some(state) = keys.get_mut(key) else {
            debug_assert!(false, "a key with a permit held or a caller in line is kept");
            return;
        };
        let (mut left, mut next, mut freed) = (false, None, false);
        'release: {
            if let Some(at) = leaving {
                counts.waiting -= 1;
                left = true;
                if state.more.as_mut().is_some_and(|more| more.line.remove(at)) {
                    state.tidy(&mut counts.stamps);
                    break 'release;
                }
            }
            next = state.release();
            state.tidy(&mut counts.stamps);
            if next.is_none() {
                counts.held -= 1;
                freed = true;
            }
        }
        // The counts after the lock: the recorder is user code, which may call into this
        // limit (its shard's lock is not reentrant).
        drop(guard);
        if left {
            self.metrics.waiters.decrement(1.0);
        }
        if freed {
            self.metrics.held.decrement(1.0);
        }
        if let Some(next) = next {
            next.wake();
        }
    }

    /// Spends the next token of `permit`'s key for it: `None` if it is due now, else when it
    /// is due, the caller counted as waiting until then (see [`Asleep`]). Spends nothing if
    /// the token would come after `deadline`, or if the key's waiting room is full.
    fn reserve(
        &self,
        permit: &KeyedPermit<K>,
        deadline: Option<Instant>,
    ) -> Result<Option<u64>, Waited> {
        let now = self.now();
        let mut guard = lock(self.shard(permit.hash));
        let Shard { keys, counts, .. } = &mut *guard;
        let state = keys.get_mut(&permit.key).expect("a key with a permit held is kept");
        let rules = state.rules(&self.rules);
        let due = state.due(&rules, now);
        if due <= now {
            state.reserve(&rules, now);
            return Ok(None);
        }
        // Refused without spending: dropping the permit (after the lock) returns it.
        let answer = if deadline.is_some_and(|at| self.at(due) > at) {
            counts.timed_out += 1;
            Err(Waited::Late)
        } else if state.waiting() >= self.max_waiters {
            counts.refused += 1;
            Err(Waited::Refused(self.too_many()))
        } else {
            state.reserve(&rules, now);
            state.more(counts.stamps).sleeping += 1;
            counts.waiting += 1;
            Ok(Some(due))
        };
        // Counted after the lock (the recorder is user code).
        drop(guard);
        match &answer {
            Ok(_) => self.metrics.waiters.increment(1.0),
            Err(Waited::Late) => self.metrics.timed_out.increment(1),
            Err(Waited::Refused(_)) => self.metrics.refused.increment(1),
        }
        answer
    }

    /// Runs `f` on `key`'s state under its shard's lock, making the state if the key is new
    /// (see [`make_key`](Self::make_key)). A refusal of a new key (the cap, an invalid own
    /// spec) is counted here, once.
    #[inline]
    fn with_key<Q, R>(
        &self,
        key: &Q,
        hash: u64,
        now: u64,
        f: impl FnOnce(&mut KeyState, &mut Counts) -> R,
    ) -> Result<R, LimitError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        // Declared before the guards: counted as it drops, after them, on a return or while a
        // panic (of the key type's `Hash`, `Eq` or `ToOwned`) unwinds.
        let mut moved = KeysMoved::new(&self.metrics);
        let mut guard = lock(self.shard(hash));
        let Shard { keys, counts, .. } = &mut *guard;
        if let Some(state) = keys.get_mut(key) {
            return Ok(f(state, counts));
        }
        let Some(spec_for) = &self.spec_for else {
            return self.make_key(&mut guard, key, None, now, f, &mut moved);
        };
        // The user's function runs without the shard's lock: it may be slow, or look at this
        // limit. Someone may make the key meanwhile; then theirs is used.
        drop(guard);
        let owned = key.to_owned();
        let own = match spec_for(&owned).map(|spec| spec.validate().map(|()| Rules::new(&spec))) {
            Some(Err(err)) => {
                lock(self.shard(hash)).counts.refused += 1;
                self.metrics.refused.increment(1);
                return Err(LimitError::InvalidSpec(err));
            }
            Some(Ok(rules)) if rules != self.rules => Some(rules),
            Some(Ok(_)) | None => None,
        };
        let mut guard = lock(self.shard(hash));
        let Shard { keys, counts, .. } = &mut *guard;
        if let Some(state) = keys.get_mut(key) {
            return Ok(f(state, counts));
        }
        self.make_key(&mut guard, key, Some((owned, own)), now, f, &mut moved)
    }

    /// A new key (with its own rules, where `spec_for` gave some): forgets the shard's idle
    /// keys first if it has grown enough since it last looked (or is at its cap: see
    /// [`CAP_SWEEP_GAP`]), refuses the key if the shard is still at its cap, and keeps it
    /// unless `f` left it idle. What it did to the shard's keys goes in `moved`, for the
    /// metrics its caller counts after the lock.
    #[inline(never)]
    fn make_key<Q, R>(
        &self,
        shard: &mut Shard<K>,
        key: &Q,
        made: Option<(K, Option<Rules>)>,
        now: u64,
        f: impl FnOnce(&mut KeyState, &mut Counts) -> R,
        moved: &mut KeysMoved<'_>,
    ) -> Result<R, LimitError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let len = shard.keys.len();
        let mut swept = len >= shard.sweep_at;
        if len >= self.shard_cap {
            // At the cap: look again after a quarter of the cap in new keys met here, or
            // after a quiet spell, whichever comes first. The spell is timed on the clock
            // even where the keys' time is 0 (no rate: `now`).
            let at = if self.timed { now } else { self.clock() };
            if shard.cap_countdown == 0 || at >= shard.cap_swept_at.saturating_add(CAP_SWEEP_GAP) {
                swept = true;
                shard.cap_countdown = (self.shard_cap / 4).max(1);
                shard.cap_swept_at = at;
            }
            shard.cap_countdown -= 1;
        }
        if swept {
            moved.forgotten = shard.sweep(now);
        }
        if shard.keys.len() >= self.shard_cap {
            shard.counts.refused += 1;
            moved.refused = true;
            return Err(LimitError::TooManyKeys {
                limit: self.name.to_string(),
                max: self.max_keys.unwrap_or(usize::MAX),
            });
        }
        let mut state = KeyState::default();
        let (owned, own) = made.map_or((None, None), |(owned, own)| (Some(owned), own));
        if let Some(own) = own {
            state.more(shard.counts.stamps).own = Some(own);
        }
        let answer = f(&mut state, &mut shard.counts);
        // A key the operation left idle (a check of a limit without a rate, or one whose
        // bucket refills at once) is not worth keeping.
        if !state.idle(now) {
            shard.keys.insert(owned.unwrap_or_else(|| key.to_owned()), state);
            moved.made = true;
        }
        Ok(answer)
    }

    /// `check` (`hold` false) or `try_acquire`: returns the key's hash on success.
    #[inline]
    fn take<Q>(&self, key: &Q, hold: bool) -> Result<u64, TryAcquireError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let now = self.now();
        let hash = self.pick.hash_one(key);
        let answer = self.with_key(key, hash, now, |state, counts| {
            let answer = state.take(&state.rules(&self.rules), now, hold);
            match answer {
                Ok(()) => {
                    counts.acquired += 1;
                    counts.held += u64::from(hold);
                }
                Err(_) => counts.refused += 1,
            }
            answer
        })?;
        match answer {
            Ok(()) => {
                self.metrics.acquired.increment(1);
                if hold {
                    self.metrics.held.increment(1.0);
                }
                Ok(hash)
            }
            Err(refusal) => {
                self.metrics.refused.increment(1);
                Err(match refusal {
                    Refusal::Busy => TryAcquireError::Busy,
                    Refusal::Rate(at) => {
                        TryAcquireError::RateLimited(Duration::from_nanos(at.saturating_sub(now)))
                    }
                })
            }
        }
    }

    fn info(&self) -> KeyedLimitInfo {
        let mut info = KeyedLimitInfo {
            name: self.name.to_string(),
            spec: self.spec,
            keys: 0,
            held: 0,
            waiting: 0,
            acquired_total: 0,
            refused_total: 0,
            timed_out_total: 0,
        };
        for shard in &self.shards {
            let shard = lock(shard);
            info.keys += shard.keys.len();
            info.held += shard.counts.held;
            info.waiting += shard.counts.waiting;
            info.acquired_total += shard.counts.acquired;
            info.refused_total += shard.counts.refused;
            info.timed_out_total += shard.counts.timed_out;
        }
        info
    }
}

impl<K> Drop for Shared<K> {
    fn drop(&mut self) {
        // Every permit and wait holds the limit: nothing is held or waiting by now, but the
        // keys still counted leave the gauge with it.
        let keys: usize =
            self.shards.iter_mut().map(|shard| shard.0.get_mut().map_or(0, |s| s.keys.len())).sum();
        self.metrics.keys.decrement(keys as f64);
    }
}

impl<K: Hash + Eq + Send + Sync> Observe for Shared<K> {
    fn report(&self, name: &str, snapshot: &mut Snapshot) {
        snapshot.insert("keyed_limits", name, &self.info());
    }
}

/// A caller on its way to a permit of its key: at once, or through the key's line. Dropped
/// while in line, it leaves; dropped after a permit was handed to it but before it took it,
/// it passes the permit on.
struct InLine<'a, K: Hash + Eq> {
    shared: &'a Shared<K>,
    key: &'a K,
    hash: u64,
    /// Its place in the key's line while it waits there.
    at: Option<WaitKey>,
    /// It has its permit (or was refused): nothing to undo.
    done: bool,
}

impl<K: Hash + Eq + Clone> InLine<'_, K> {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), LimitError>> {
        let shared = self.shared;
        let Some(at) = self.at else {
            return self.join(cx);
        };
        let mut guard = lock(shared.shard(self.hash));
        let Shard { keys, counts, .. } = &mut *guard;
        let state = keys.get_mut(self.key).expect("a key with a caller in line is kept");
        // A line that is gone was emptied by the release that popped this caller.
        if state.more.as_mut().is_some_and(|more| more.line.refresh(at, cx.waker())) {
            return Poll::Pending;
        }
        // Popped by a release: the permit it returned is ours.
        counts.waiting -= 1;
        drop(guard);
        self.done = true;
        shared.metrics.waiters.decrement(1.0);
        Poll::Ready(Ok(()))
    }

    /// The first poll: a permit at once, or a place at the back of the key's line.
    fn join(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), LimitError>> {
        let shared = self.shared;
        let now = shared.now();
        let answer = shared.with_key(self.key, self.hash, now, |state, counts| {
            if state.has_room(&state.rules(&shared.rules)) {
                state.held += 1;
                counts.held += 1;
                return Ok(None);
            }
            if state.waiting() >= shared.max_waiters {
                counts.refused += 1;
                return Err(shared.too_many());
            }
            counts.waiting += 1;
            let stamps = counts.stamps;
            Ok(Some(state.more(stamps).line.push(cx.waker())))
        });
        // A new key refused (the cap, its own spec invalid) is an answer like a full room,
        // counted where it was made; a full room is counted here, after the lock.
        let answer = match answer {
            Ok(Err(full)) => {
                shared.metrics.refused.increment(1);
                Err(full)
            }
            answer => answer.and_then(|answer| answer),
        };
        match answer {
            Ok(None) => {
                self.done = true;
                shared.metrics.held.increment(1.0);
                Poll::Ready(Ok(()))
            }
            Ok(Some(at)) => {
                self.at = Some(at);
                shared.metrics.waiters.increment(1.0);
                Poll::Pending
            }
            Err(err) => {
                self.done = true;
                Poll::Ready(Err(err))
            }
        }
    }
}

impl<K: Hash + Eq> Drop for InLine<'_, K> {
    fn drop(&mut self) {
        if let (false, Some(at)) = (self.done, self.at) {
            self.shared.release(self.key, self.hash, Some(at));
        }
    }
}

/// A caller asleep until its token is due: counted as waiting until it wakes or is dropped.
struct Asleep<'a, K: Hash + Eq> {
    shared: &'a Shared<K>,
    key: &'a K,
    hash: u64,
}

impl<K: Hash + Eq> Drop for Asleep<'_, K> {
    fn drop(&mut self) {
        let mut guard = lock(self.shared.shard(self.hash));
        let Shard { keys, counts, .. } = &mut *guard;
        if let Some(state) = keys.get_mut(self.key)
            && let Some(more) = &mut state.more
        {
            more.sleeping -= 1;
            state.tidy(&mut counts.stamps);
        }
        counts.waiting -= 1;
        drop(guard);
        self.shared.metrics.waiters.decrement(1.0);
    }
}

/// A permit of one key of a [`KeyedLimit`]; returned when dropped (to the first caller in the
/// key's line, if any).
#[must_use = "a permit is returned as soon as it is dropped"]
pub struct KeyedPermit<K: Hash + Eq = String> {
    shared: Arc<Shared<K>>,
    key: K,
    hash: u64,
}

impl<K: Hash + Eq> KeyedPermit<K> {
    /// The key the permit is of.
    pub fn key(&self) -> &K {
        &self.key
    }
}

impl<K: Hash + Eq + fmt::Debug> fmt::Debug for KeyedPermit<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyedPermit")
            .field("limit", &self.shared.name)
            .field("key", &self.key)
            .finish()
    }
}

impl<K: Hash + Eq> Drop for KeyedPermit<K> {
    fn drop(&mut self) {
        self.shared.release(&self.key, self.hash, None);
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn rules(concurrent: u32, per_second: Option<f64>, burst: u32) -> Rules {
        Rules::new(&LimitSpec { concurrent, per_second, burst })
    }

    #[test]
    fn a_keys_state_stays_small() {
        // Memory per key (suite 6) is this, the key and the map's slot: what only waiting or
        // an own spec needs is behind one pointer.
        assert_eq!(std::mem::size_of::<KeyState>(), 24);
    }

    /// Only a limit whose keys can have a rate reads the clock for their answers: one without
    /// (a concurrency per tenant) answers at time 0, however much time passes.
    #[tokio::test(start_paused = true)]
    async fn only_a_limit_whose_keys_can_have_a_rate_reads_the_clock() {
        let timed = |limit: &KeyedLimit| limit.shared.timed;
        let concurrent: KeyedLimit = KeyedLimit::new("c", LimitSpec::concurrent(1)).unwrap();
        assert!(!timed(&concurrent));
        let rated: KeyedLimit = KeyedLimit::new("r", LimitSpec::rate(1.0)).unwrap();
        assert!(timed(&rated));
        let own: KeyedLimit = KeyedLimit::builder("o", LimitSpec::concurrent(1))
            .spec_for(|_: &String| Some(LimitSpec::rate(1.0)))
            .build()
            .unwrap();
        assert!(timed(&own), "a key's own spec may have a rate");
        // Time passes; the untimed limit's answers do not depend on it.
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(concurrent.shared.now(), 0);
        assert!(rated.shared.now() >= 5_000_000_000);
        let held = concurrent.try_acquire("a").unwrap();
        assert!(matches!(concurrent.check("a"), Err(TryAcquireError::Busy)));
        drop(held);
        assert_eq!(concurrent.forget_idle(), 1, "a key holding nothing is idle at time 0");
    }

    #[test]
    fn a_key_grants_its_burst_then_one_token_per_interval() {
        let rules = rules(u32::MAX, Some(10.0), 3);
        let mut key = KeyState::default();
        for _ in 0..3 {
            assert_eq!(key.take(&rules, 0, false), Ok(()));
        }
        assert_eq!(key.take(&rules, 0, false), Err(Refusal::Rate(100_000_000)));
        assert_eq!(key.take(&rules, 99_999_999, false), Err(Refusal::Rate(100_000_000)));
        assert_eq!(key.take(&rules, 100_000_000, false), Ok(()));
        assert!(!key.idle(100_000_000));
        assert!(key.idle(400_000_000), "the bucket is full again");
    }

    #[test]
    fn a_key_holds_at_most_its_concurrency_and_a_release_goes_to_the_line_first() {
        let rules = rules(2, None, 1);
        let mut key = KeyState::default();
        assert_eq!(key.take(&rules, 0, true), Ok(()));
        assert_eq!(key.take(&rules, 0, true), Ok(()));
        assert_eq!(key.take(&rules, 0, true), Err(Refusal::Busy));
        assert_eq!(key.take(&rules, 0, false), Err(Refusal::Busy), "a check needs room too");
        let waker = Waker::noop();
        let _first = key.more(0).line.push(waker);
        assert!(key.release().is_some(), "the first in line takes the permit");
        assert_eq!(key.held, 2, "the permit passed on, still held");
        assert!(key.release().is_none());
        assert_eq!(key.held, 1);
        assert_eq!(key.take(&rules, 0, true), Ok(()));
        assert!(!key.idle(0));
    }

    #[test]
    fn a_reserved_token_is_due_in_reservation_order() {
        let rules = rules(u32::MAX, Some(1.0), 1);
        let mut key = KeyState::default();
        assert_eq!(key.take(&rules, 0, true), Ok(()));
        let mut dues = Vec::new();
        for _ in 0..3 {
            dues.push(key.due(&rules, 0));
            key.reserve(&rules, 0);
        }
        assert_eq!(dues, [1_000_000_000, 2_000_000_000, 3_000_000_000]);
        assert_eq!(key.take(&rules, 3_000_000_000, false), Err(Refusal::Rate(4_000_000_000)));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Take { hold: bool },
        Reserve,
        Release,
        Wait(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            any::<bool>().prop_map(|hold| Op::Take { hold }),
            Just(Op::Reserve),
            Just(Op::Release),
            (0u64..3_000_000_000).prop_map(Op::Wait),
        ]
    }

    /// Applies `ops` from `now`, answering what each take said.
    fn run(
        key: &mut KeyState,
        rules: &Rules,
        mut now: u64,
        ops: &[Op],
    ) -> Vec<Result<(), Refusal>> {
        let mut answers = Vec::new();
        for op in ops {
            match op {
                Op::Take { hold } => answers.push(key.take(rules, now, *hold)),
                Op::Reserve if key.held > 0 => key.reserve(rules, now),
                Op::Release if key.held > 0 => drop(key.release()),
                Op::Wait(nanos) => now += nanos,
                Op::Reserve | Op::Release => {}
            }
        }
        answers
    }

    proptest! {
        /// Forgetting an idle key loses nothing: from the moment it is idle, it answers every
        /// sequence of operations exactly as a key never seen.
        #[test]
        fn an_idle_key_answers_as_a_new_one(
            concurrent in 1u32..4,
            per_second in prop::option::of(0.5f64..50.0),
            burst in 1u32..5,
            before in prop::collection::vec(op(), 0..40),
            after in prop::collection::vec(op(), 0..40),
        ) {
            let rules = rules(concurrent, per_second, burst);
            let mut key = KeyState::default();
            let mut now = 0;
            run(&mut key, &rules, now, &before);
            for op in &before {
                if let Op::Wait(nanos) = op {
                    now += nanos;
                }
            }
            if key.idle(now) {
                let mut fresh = KeyState::default();
                prop_assert_eq!(run(&mut key, &rules, now, &after), run(&mut fresh, &rules, now, &after));
            }
        }

        /// Over any window, a key grants at most its burst plus one token per interval.
        #[test]
        fn a_key_never_exceeds_its_rate(
            per_second in 0.5f64..50.0,
            burst in 1u32..5,
            gaps in prop::collection::vec(0u64..300_000_000, 1..200),
        ) {
            let rules = rules(u32::MAX, Some(per_second), burst);
            let mut key = KeyState::default();
            let mut now = 0;
            let mut granted = Vec::new();
            for gap in gaps {
                now += gap;
                if key.take(&rules, now, false).is_ok() {
                    granted.push(now);
                }
            }
            for (i, start) in granted.iter().enumerate() {
                let within = granted[i..].iter().take_while(|at| **at - start <= 1_000_000_000).count();
                let allowed = u64::from(burst) + 1_000_000_000 / rules.interval;
                prop_assert!(within as u64 <= allowed, "{} grants in a second, at most {}", within, allowed);
            }
        }
    }
}
