//! `KeyedPool`: items with equal keys run one at a time in submit order; different keys run in
//! parallel.

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use super::config::Common;
use super::core::{PerKey, Sharded};
use super::error::{AbortReport, StopTimeout, SubmitError};
use super::fnv::PoolKey;
use super::handle::{self, Core, Engine, Indexed, Phase, PoolStats, Queued};
use super::snapshot::{PoolKind, PoolSnapshot, Reporter};
use crate::BoxError;
use crate::config::ConfigError;
use crate::config::{require, runtime};
use crate::limit::{Limits, Priority, Throttle};
use crate::observe::{Registration, Registry};
use crate::util::PanicPayload;

/// How a [`KeyedPool`] maps keys to workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyedMode {
    /// Per-key FIFO queues scheduled onto `workers` tasks (the default): at most one item per
    /// key in flight, at most `workers` overall; a slow key holds one worker and never delays a
    /// different key.
    PerKey,
    /// The seed's design: `shards` tasks, each with its own queue; a key always goes to shard
    /// `fnv1a64(key bytes) % shards`. Keys that share a shard also share its head-of-line
    /// blocking.
    Hashed,
}

/// A pool where items with equal keys run one at a time, in submit order, and different keys
/// run in parallel.
///
/// # Ordering
///
/// Items of one key are processed one after the other in the order they were accepted. Keys
/// take turns for workers in the order they got work (per-key mode).
///
/// # Overflow
///
/// `submit` never waits. Per-key mode refuses with [`SubmitError::KeyFull`] when the item's
/// key has `key_queue_size` items queued (at most 2^32 - 1), [`SubmitError::Full`] when
/// `queue_size` items are queued in all, and [`SubmitError::TooManyKeys`] when `max_keys` keys
/// are tracked. Hashed mode refuses with [`SubmitError::KeyFull`] when the item's shard has
/// `queue_size` items queued. Every refusal hands the item back and moves the `rejected`
/// counter.
///
/// # Memory
///
/// A key with nothing queued and nothing running is idle. The 16,384 most recently idle keys
/// are kept, so a key that comes back costs no allocation; older idle keys are forgotten, and
/// the tables shrink as they empty: after a burst of a million distinct keys, memory returns to
/// a baseline of about 16,384 keys' entries. [`PoolStats::keys`](super::PoolStats) counts the
/// keys with work, not the idle ones; `max_keys` bounds the keys with work.
///
/// # Shutdown
///
/// As for [`Dispatcher`](super::Dispatcher): `stop` drains every accepted item, `abort`
/// discards and cancels, and dropping the pool closes it (accepted items are still processed,
/// then its workers end).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use lanes::pool::KeyedPool;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let pool = KeyedPool::builder()
///     .workers(8)
///     .queue_size(1_000)
///     .key_of(|update: &(String, u64)| update.0.clone())
///     .build(|_worker, (_entity, _version): (String, u64)| async move {
///         // apply updates of one entity in order
///         Ok::<_, std::io::Error>(())
///     })?;
/// pool.submit(("order-7".to_owned(), 1))?;
/// pool.submit(("order-7".to_owned(), 2))?; // runs after version 1
/// pool.stop(Duration::from_secs(5)).await?;
/// # Ok(())
/// # }
/// ```
pub struct KeyedPool<T> {
    core: Arc<dyn Core<T>>,
    mode: KeyedMode,
    reporter: Arc<Reporter<T>>,
}

/// Closes: the accepted items are processed, then the workers end. Without it, a pool dropped
/// unstopped kept its workers (and what they hold) parked for the life of the runtime.
impl<T> Drop for KeyedPool<T> {
    fn drop(&mut self) {
        self.core.begin_stop();
    }
}

impl<T: Send + 'static> KeyedPool<T> {
    /// Starts configuring a keyed pool.
    pub fn builder() -> KeyedPoolBuilder<T, NoKey> {
        KeyedPoolBuilder {
            mode: KeyedMode::PerKey,
            workers: None,
            queue_size: None,
            key_queue_size: None,
            max_keys: None,
            key_of: NoKey,
            common: Common::default(),
            _item: PhantomData,
        }
    }

    /// Enqueues `item` without waiting.
    ///
    /// # Errors
    ///
    /// Hands the item back: [`SubmitError::KeyFull`], [`SubmitError::Full`],
    /// [`SubmitError::TooManyKeys`] or [`SubmitError::Stopped`].
    pub fn submit(&self, item: T) -> Result<(), SubmitError<T>> {
        self.core.submit(item)
    }

    /// Enqueues `item` from a thread outside the runtime, blocking it until there is room: the
    /// synchronous form of [`submit_wait`](Self::submit_wait), as tokio's `blocking_send` is of
    /// `send`.
    ///
    /// # Errors
    ///
    /// As for [`submit_wait`](Self::submit_wait).
    ///
    /// # Panics
    ///
    /// Inside a tokio runtime (use `submit_wait` there).
    pub fn blocking_submit(&self, item: T) -> Result<(), SubmitError<T>> {
        crate::util::block_on("KeyedPool::blocking_submit", self.submit_wait(item))
    }

    /// Enqueues `item`, waiting for room.
    ///
    /// Producers waiting for room in the pool are served first come first served: each item a
    /// worker takes hands its room to the one that has waited longest, and a
    /// [`submit`](Self::submit) that does not wait cannot take it first. A producer waiting
    /// for its key's queue (or for a key to be tracked) looks again whenever an item is taken
    /// or finished.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it resolves drops the item without enqueuing it; a room
    /// handed to it goes to the next waiting producer. A room handed to a future that is kept
    /// but not polled (a branch of a `select!` loop busy elsewhere, say) stays taken until it
    /// is polled or dropped: a `submit` meanwhile may be refused `Full` with fewer than
    /// `queue_size` items queued.
    ///
    /// # Errors
    ///
    /// [`SubmitError::Stopped`] once the pool stops accepting; a producer parked here is
    /// released at once.
    pub async fn submit_wait(&self, item: T) -> Result<(), SubmitError<T>> {
        handle::submit_wait(&*self.core, item).await
    }

    /// Stops accepting and waits up to `timeout` for every accepted item to be processed.
    /// Idempotent; safe to call again after a timeout.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future stops the waiting only: the pool keeps draining.
    ///
    /// # Errors
    ///
    /// [`StopTimeout`] if items remain after `timeout`; draining goes on.
    pub async fn stop(&self, timeout: Duration) -> Result<(), StopTimeout> {
        self.core.begin_stop();
        handle::wait_finished(&*self.core, timeout).await
    }

    /// Stops at once without draining: queued items are discarded, in-flight ones cancelled;
    /// both are counted as `dropped`.
    pub fn abort(&self) -> AbortReport {
        self.core.abort()
    }

    /// Stops accepting (later submits fail with [`SubmitError::Stopped`]); accepted items are
    /// still processed. The first half of [`stop`](Self::stop), without the wait.
    pub fn close(&self) {
        self.core.begin_stop();
    }

    /// Whether it stopped accepting (closed, stopped or aborted).
    pub fn is_closed(&self) -> bool {
        self.core.phase() != Phase::Running
    }

    /// Resolves once it is closed and every accepted item reached its end (processed, failed,
    /// panicked or dropped; after an abort, once the cancelled items are gone, with the permits
    /// they held). Waits forever on a pool nobody closes.
    pub async fn drained(&self) {
        handle::wait_drained(&*self.core).await;
    }

    /// Its kind, phase and counters now: what the registry stores.
    pub fn snapshot(&self) -> PoolSnapshot {
        self.reporter.snapshot()
    }

    /// The counters, as they are now (`keys` is the number of tracked keys).
    pub fn stats(&self) -> PoolStats {
        self.core.stats()
    }

    /// Where the pool is in its life.
    pub fn phase(&self) -> Phase {
        self.core.phase()
    }

    /// Per-key or hashed.
    pub fn mode(&self) -> KeyedMode {
        self.mode
    }
}

impl<T> fmt::Debug for KeyedPool<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyedPool")
            .field("mode", &self.mode)
            .field("stats", &self.core.stats())
            .finish_non_exhaustive()
    }
}

/// The key function is not set yet: [`KeyedPoolBuilder::key_of`] is required.
#[derive(Debug, Clone, Copy)]
pub struct NoKey;

/// Configures a [`KeyedPool`]. `workers` (or `hashed_shards`), `queue_size` and `key_of` are
/// required.
#[must_use = "a builder does nothing until `build` is called"]
pub struct KeyedPoolBuilder<T, F> {
    mode: KeyedMode,
    workers: Option<usize>,
    queue_size: Option<usize>,
    key_queue_size: Option<usize>,
    max_keys: Option<usize>,
    key_of: F,
    common: Common<T>,
    _item: PhantomData<fn(T)>,
}

impl<T: Send + 'static, F> KeyedPoolBuilder<T, F> {
    /// Per-key mode with `workers` tasks: items in flight at most. At least 1.
    pub fn workers(mut self, workers: usize) -> Self {
        self.mode = KeyedMode::PerKey;
        self.workers = Some(workers);
        self
    }

    /// Hashed mode with `shards` tasks, one queue each. At least 1.
    pub fn hashed_shards(mut self, shards: usize) -> Self {
        self.mode = KeyedMode::Hashed;
        self.workers = Some(shards);
        self
    }

    /// Per-key mode: items queued in all. Hashed mode: items queued per shard. At least 1.
    pub fn queue_size(mut self, queue_size: usize) -> Self {
        self.queue_size = Some(queue_size);
        self
    }

    /// Per-key mode: items queued per key (default: `queue_size`). At least 1; a bound above
    /// 2^32 - 1 counts as 2^32 - 1.
    pub fn key_queue_size(mut self, key_queue_size: usize) -> Self {
        self.key_queue_size = Some(key_queue_size);
        self
    }

    /// Per-key mode: keys tracked at once, queued or running (default: `queue_size + workers`).
    /// At least 1.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = Some(max_keys);
        self
    }

    /// The key of an item.
    ///
    /// `key_of` and the key's `Hash`, `Eq`, `Clone`, [`PoolKey::key_bytes`] and `Drop` run
    /// while the pool's lock is held (a spin lock: other submits and the workers wait for it
    /// awake), so they should be quick, and must not call back into the same pool (a submit or
    /// `stats()` from in there never returns). A panic in one of them during a submit reaches
    /// the submitter, and the item is not taken; a panic in the `Drop` of a key the pool
    /// forgets (an idle key past those kept, or at an abort) is contained.
    pub fn key_of<K, G>(self, key_of: G) -> KeyedPoolBuilder<T, G>
    where
        K: PoolKey,
        G: Fn(&T) -> K + Send + Sync + 'static,
    {
        KeyedPoolBuilder {
            mode: self.mode,
            workers: self.workers,
            queue_size: self.queue_size,
            key_queue_size: self.key_queue_size,
            max_keys: self.max_keys,
            key_of,
            common: self.common,
            _item: PhantomData,
        }
    }

    /// The name of the pool in metrics (`pool` label); defaults to the registry name.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.common.name = Some(name.into());
        self
    }

    /// Reports the pool in `registry` under `name`.
    pub fn registry(mut self, registry: &Registry, name: impl Into<String>) -> Self {
        self.common.registry = Some(Registration::new(registry, name));
        self
    }

    /// Every item takes a permit of limit `name` before it is processed, in the worker that
    /// took it (a pool's workers are its concurrency, and per-key order needs the item in
    /// hand). A refusal fails the item; [`throttle`](Self::throttle) takes another
    /// [refusal policy](crate::limit::OnRefusal). The permit covers the process function: it is
    /// given back when that ends, before the item's outcome is reported. A panic while the
    /// permit is acquired (the limit's `metrics` recorder's) fails the item, whatever the policy.
    pub fn limit(self, limits: &Limits, name: impl Into<Arc<str>>, priority: Priority) -> Self {
        self.throttle(Throttle::new(limits, name, priority))
    }

    /// Like [`limit`](Self::limit), with the limit, priority and refusal policy of `throttle`.
    pub fn throttle(mut self, throttle: Throttle) -> Self {
        self.common.throttle(throttle);
        self
    }

    /// Called with the error of every item whose processing failed.
    pub fn on_error(mut self, on_error: impl Fn(BoxError) + Send + Sync + 'static) -> Self {
        self.common.on_error(on_error);
        self
    }

    /// Called with the item and the panic payload of every item whose processing panicked; the
    /// key's next items still run. Keeps a clone of each item while it is processed; an item
    /// whose `Clone` panics is not processed, and this is called with it and that panic.
    pub fn on_panic(mut self, on_panic: impl Fn(T, PanicPayload) + Send + Sync + 'static) -> Self
    where
        T: Clone,
    {
        self.common.on_panic(on_panic);
        self
    }
}

impl<T: Send + 'static, K: PoolKey, G: Fn(&T) -> K + Send + Sync + 'static> KeyedPoolBuilder<T, G> {
    /// Builds the pool and starts its tasks. `process` gets the index of the shard (hashed
    /// mode) or worker (per-key mode) that runs the item, and the item.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`]: `workers`/`hashed_shards` or `queue_size` missing or zero, a zero
    /// `key_queue_size` or `max_keys`, no tokio runtime, or a registry name already taken.
    pub fn build<P, Fut, E>(self, process: P) -> Result<KeyedPool<T>, ConfigError>
    where
        P: Fn(usize, T) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: Into<BoxError> + 'static,
    {
        let field = if self.mode == KeyedMode::Hashed { "hashed_shards" } else { "workers" };
        let workers = require(self.workers, field)?;
        let queue_size = require(self.queue_size, "queue_size")?;
        let key_queue_size = require(self.key_queue_size.or(Some(queue_size)), "key_queue_size")?;
        let max_keys =
            require(self.max_keys.or(Some(queue_size.saturating_add(workers))), "max_keys")?;
        runtime()?;
        self.common.check_registry()?;
        let label = self.common.label();
        let Common { registry, limit, hooks, .. } = self.common;
        let key_of = self.key_of;
        let key_of = Box::new(move |queued: &Queued<T>| key_of(&queued.item));
        let process = Indexed(process);
        let (core, kind): (Arc<dyn Core<T>>, _) = match self.mode {
            KeyedMode::PerKey => {
                let sched = PerKey::new(queue_size, key_queue_size, max_keys, key_of);
                (Engine::start(sched, workers, process, hooks, limit, &label), PoolKind::PerKey)
            }
            KeyedMode::Hashed => {
                let sched = Sharded::new(workers, queue_size, key_of);
                (Engine::start(sched, workers, process, hooks, limit, &label), PoolKind::Hashed)
            }
        };
        let reporter = Arc::new(Reporter { kind, core: core.clone(), tracker: None });
        if let Some(registration) = registry
            && let Err(err) = registration.register(&reporter)
        {
            core.abort();
            return Err(err);
        }
        Ok(KeyedPool { core, mode: self.mode, reporter })
    }
}

impl<T, F> fmt::Debug for KeyedPoolBuilder<T, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyedPoolBuilder")
            .field("mode", &self.mode)
            .field("workers", &self.workers)
            .field("queue_size", &self.queue_size)
            .field("key_queue_size", &self.key_queue_size)
            .field("max_keys", &self.max_keys)
            .finish_non_exhaustive()
    }
}

impl<T: Send + 'static> crate::Lifecycle for KeyedPool<T> {
    type Snapshot = PoolSnapshot;

    fn close(&self) {
        KeyedPool::close(self);
    }

    fn is_closed(&self) -> bool {
        KeyedPool::is_closed(self)
    }

    fn drained(&self) -> crate::BoxFuture<'_, ()> {
        Box::pin(KeyedPool::drained(self))
    }

    fn abort(&self) {
        KeyedPool::abort(self);
    }

    fn snapshot(&self) -> PoolSnapshot {
        KeyedPool::snapshot(self)
    }
}
