//! `Dispatcher`: a bounded queue drained by a fixed number of workers, in no particular order,
//! with optional completion tracking.

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use super::completion::{CompletionSource, TrackedProcess, Tracker, Untracked};
use super::config::Common;
use super::core::Fifo;
use super::error::{AbortReport, StopTimeout, SubmitError};
use super::handle::{self, Core, Engine, Phase, PoolStats, Process, Queued, Unkeyed};
use super::snapshot::{PoolKind, PoolSnapshot, Reporter};
use crate::BoxError;
use crate::config::{ConfigError, require, runtime};
use crate::limit::{Limits, Priority, Throttle};
use crate::observe::{Registration, Registry};
use crate::util::PanicPayload;

/// A bounded work queue drained by `workers` tasks: at most `workers` items in flight, in no
/// particular order.
///
/// # Overflow
///
/// [`submit`](Dispatcher::submit) never waits: a full queue hands the item back in
/// [`SubmitError::Full`] and the `rejected` counter moves.
/// [`submit_wait`](Dispatcher::submit_wait) waits for room instead.
///
/// # Shutdown
///
/// [`stop`](Dispatcher::stop) refuses new items at once (handing them back in
/// [`SubmitError::Stopped`], including to producers parked in `submit_wait`) and waits for
/// every accepted item to be processed. A stop that times out keeps draining; a later stop can
/// observe the end. Every `submit` that returned `Ok` is processed before `stop` returns `Ok`.
/// [`abort`](Dispatcher::abort) discards queued items and cancels in-flight ones, counting both.
/// Dropping the dispatcher closes it: accepted items are still processed, then its workers end
/// (and completion tracking ends once no tracked item is left).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use lanes::pool::Dispatcher;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let dispatcher = Dispatcher::builder()
///     .workers(4)
///     .queue_size(100)
///     .build(|_n: u64| async move {
///         // process the item
///         Ok::<_, std::io::Error>(())
///     })?;
/// for n in 0..10 {
///     dispatcher.submit(n)?;
/// }
/// dispatcher.stop(Duration::from_secs(5)).await?;
/// assert_eq!(dispatcher.stats().completed, 10);
/// # Ok(())
/// # }
/// ```
pub struct Dispatcher<T> {
    core: Arc<dyn Core<T>>,
    tracker: Option<Arc<Tracker<T>>>,
    reporter: Arc<Reporter<T>>,
}

impl<T: Send + 'static> Dispatcher<T> {
    /// Starts configuring a dispatcher.
    pub fn builder() -> DispatcherBuilder<T> {
        DispatcherBuilder::new()
    }

    /// Enqueues `item` without waiting.
    ///
    /// # Errors
    ///
    /// Hands the item back: [`SubmitError::Full`], [`SubmitError::Stopped`], and with
    /// completion tracking [`SubmitError::DuplicateKey`] (an item with the same key is in
    /// flight) or [`SubmitError::TrackingFull`].
    pub fn submit(&self, item: T) -> Result<(), SubmitError<T>> {
        let Some(tracker) = &self.tracker else {
            return self.core.submit(item);
        };
        self.submit_tracked(tracker, item, |core, item| core.submit(item))
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
        crate::util::block_on("Dispatcher::blocking_submit", self.submit_wait(item))
    }

    /// Enqueues `item`, waiting for room.
    ///
    /// Producers waiting for room are served first come first served: each item a worker
    /// takes hands its room to the one that has waited longest, and a
    /// [`submit`](Self::submit) that does not wait cannot take it first.
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
    /// [`SubmitError::Stopped`] once the dispatcher stops accepting (a producer parked here is
    /// released at once), or the tracking errors of [`submit`](Self::submit).
    pub async fn submit_wait(&self, item: T) -> Result<(), SubmitError<T>> {
        let Some(tracker) = &self.tracker else {
            return handle::submit_wait(&*self.core, item).await;
        };
        // Registered before waiting, so a completion written while the producer waits for
        // room still matches; forgotten if the item is not enqueued, refused or dropped while
        // it waits (the guard).
        if self.is_closed() {
            // Refused as stopped (and counted) before tracking is asked.
            return self.core.submit(item);
        }
        let key = (tracker.key_of)(&item);
        let item = self.register(tracker, &key, item)?;
        let mut registered = Registered { tracker, key: Some(key) };
        let submitted = handle::submit_wait(&*self.core, item).await;
        if submitted.is_ok() {
            registered.key = None;
        }
        submitted
    }

    fn submit_tracked(
        &self,
        tracker: &Tracker<T>,
        item: T,
        submit: impl FnOnce(&dyn Core<T>, T) -> Result<(), SubmitError<T>>,
    ) -> Result<(), SubmitError<T>> {
        if self.is_closed() {
            // Refused as stopped (and counted) before tracking is asked.
            return self.core.submit(item);
        }
        let key = (tracker.key_of)(&item);
        let item = self.register(tracker, &key, item)?;
        let submitted = submit(&*self.core, item);
        if submitted.is_err() {
            tracker.left(&key, false);
        }
        submitted
    }

    /// Registers a clone of `item` under `key` (before it is enqueued), handing the item back.
    /// A refusal is counted rejected.
    fn register(&self, tracker: &Tracker<T>, key: &str, item: T) -> Result<T, SubmitError<T>> {
        let refused = match tracker.track(key.to_owned(), (tracker.clone_item)(&item)) {
            Ok(()) => return Ok(item),
            Err(Untracked::Duplicate) => SubmitError::DuplicateKey(item),
            Err(Untracked::Full) => SubmitError::TrackingFull(item),
        };
        self.core.reject();
        Err(refused)
    }

    /// Stops accepting and waits up to `timeout` for every accepted item to be processed, then
    /// stops completion tracking: an `on_complete` under way runs to its end, within what is
    /// left of `timeout` (then it is cut short), and items still waiting for their signal are
    /// no longer tracked ([`tracked`](Self::tracked) says 0). Idempotent; safe to call again
    /// after a timeout.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future stops the waiting only: the dispatcher keeps draining.
    ///
    /// # Errors
    ///
    /// [`StopTimeout`] if items are still queued or in flight after `timeout`; draining goes
    /// on.
    pub async fn stop(&self, timeout: Duration) -> Result<(), StopTimeout> {
        let started = tokio::time::Instant::now();
        self.core.begin_stop();
        handle::wait_finished(&*self.core, timeout).await?;
        if let Some(tracker) = &self.tracker {
            tracker.stop_watching();
            let left = timeout.saturating_sub(started.elapsed());
            if tokio::time::timeout(left, tracker.watch_ended()).await.is_err() {
                tracker.abort_watching();
            }
            tracker.untrack_all();
        }
        Ok(())
    }

    /// Stops at once without draining: queued items are discarded, in-flight ones cancelled;
    /// both are counted as `dropped`. Completion tracking ends at once too (an `on_complete`
    /// under way is cut short), and no item is tracked after.
    pub fn abort(&self) -> AbortReport {
        let report = self.core.abort();
        if let Some(tracker) = &self.tracker {
            tracker.abort_watching();
            tracker.untrack_all();
        }
        report
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
    /// they held), then stops completion tracking, as [`stop`](Self::stop) does.
    /// Waits forever on a pool nobody closes.
    pub async fn drained(&self) {
        handle::wait_drained(&*self.core).await;
        // The second half of `stop`, once drained.
        if let Some(tracker) = &self.tracker {
            tracker.stop_watching();
            tracker.watch_ended().await;
            tracker.untrack_all();
        }
    }

    /// Its kind, phase, counters and completion tracking now: what the registry stores.
    pub fn snapshot(&self) -> PoolSnapshot {
        self.reporter.snapshot()
    }

    /// The counters, as they are now.
    pub fn stats(&self) -> PoolStats {
        self.core.stats()
    }

    /// Where the dispatcher is in its life.
    pub fn phase(&self) -> Phase {
        self.core.phase()
    }

    /// Items waiting for their completion signal (0 without completion tracking).
    pub fn tracked(&self) -> usize {
        self.tracker.as_ref().map_or(0, |t| t.tracked())
    }
}

impl<T> fmt::Debug for Dispatcher<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dispatcher")
            .field("stats", &self.core.stats())
            .field("phase", &self.core.phase())
            .finish_non_exhaustive()
    }
}

/// Configures a [`Dispatcher`]. `workers` and `queue_size` are required.
#[must_use = "a builder does nothing until `build` is called"]
pub struct DispatcherBuilder<T> {
    workers: Option<usize>,
    queue_size: Option<usize>,
    common: Common<T>,
    _item: PhantomData<fn(T)>,
}

impl<T: Send + 'static> DispatcherBuilder<T> {
    fn new() -> Self {
        Self { workers: None, queue_size: None, common: Common::default(), _item: PhantomData }
    }

    /// Worker tasks: items in flight at most. At least 1.
    pub fn workers(mut self, workers: usize) -> Self {
        self.workers = Some(workers);
        self
    }

    /// Items that may wait. At least 1.
    pub fn queue_size(mut self, queue_size: usize) -> Self {
        self.queue_size = Some(queue_size);
        self
    }

    /// The name of the dispatcher in metrics (`pool` label); defaults to the registry name.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.common.name = Some(name.into());
        self
    }

    /// Reports the dispatcher in `registry` under `name`.
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

    /// Called with the error of every item whose processing failed (and of every refused
    /// permit, and of every failed `on_complete`).
    pub fn on_error(mut self, on_error: impl Fn(BoxError) + Send + Sync + 'static) -> Self {
        self.common.on_error(on_error);
        self
    }

    /// Called with the item and the panic payload of every item whose processing panicked.
    /// Keeps a clone of each item while it is processed; an item whose `Clone` panics is not
    /// processed, and this is called with it and that panic.
    pub fn on_panic(mut self, on_panic: impl Fn(T, PanicPayload) + Send + Sync + 'static) -> Self
    where
        T: Clone,
    {
        self.common.on_panic(on_panic);
        self
    }

    /// Tracks completion signals from `source`: every item is registered under `key_of(&item)`
    /// before it is enqueued, and `on_complete` runs once when a signal for its key arrives.
    ///
    /// A key is taken from its registration until its signal has come *and* its item has left
    /// the dispatcher; another item of the key is refused [`SubmitError::DuplicateKey`]
    /// meanwhile. An item that is processed waits for its signal; one that fails, panics, is
    /// refused its limit's permit or is aborted is forgotten at once (it was not handed on, so
    /// no signal is to come; a late one counts as `untracked` and fires nothing), and its
    /// failure goes to `on_error` or `on_panic` as usual. `key_of` must be pure: it is called
    /// again when the item leaves.
    pub fn completion<K, C, Fut, E>(
        self,
        source: impl CompletionSource,
        key_of: K,
        on_complete: C,
    ) -> TrackedDispatcherBuilder<T>
    where
        T: Clone,
        K: Fn(&T) -> String + Send + Sync + 'static,
        C: Fn(T) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: Into<BoxError> + 'static,
    {
        let on_error = self.common.on_error.clone();
        let make: MakeTracker<T> = Box::new(move |max, on_watch_error| {
            let (key_of, clone_item) = (Box::new(key_of), Box::new(T::clone));
            Tracker::new(max, key_of, clone_item, on_complete, on_watch_error, on_error)
        });
        TrackedDispatcherBuilder {
            inner: self,
            source: Arc::new(source),
            make,
            max_tracked: 10_000,
            on_watch_error: None,
        }
    }

    fn validate(&self) -> Result<(usize, usize), ConfigError> {
        let workers = require(self.workers, "workers")?;
        let queue_size = require(self.queue_size, "queue_size")?;
        runtime()?;
        self.common.check_registry()?;
        Ok((workers, queue_size))
    }

    /// Builds the dispatcher and starts its workers. `process` is called once per item.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`]: `workers` or `queue_size` missing or zero, no tokio runtime, or a
    /// registry name already taken.
    pub fn build<P, Fut, E>(self, process: P) -> Result<Dispatcher<T>, ConfigError>
    where
        P: Fn(T) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: Into<BoxError> + 'static,
    {
        self.finish(Unkeyed(process), None)
    }

    fn finish(
        self,
        process: impl Process<T>,
        tracker: Option<Arc<Tracker<T>>>,
    ) -> Result<Dispatcher<T>, ConfigError> {
        let (workers, queue_size) = self.validate()?;
        let label = self.common.label();
        let Common { registry, limit, hooks, .. } = self.common;
        let sched: Fifo<Queued<T>> = Fifo::new(queue_size);
        let core: Arc<dyn Core<T>> = Engine::start(sched, workers, process, hooks, limit, &label);
        let reporter = Arc::new(Reporter {
            kind: PoolKind::Dispatcher,
            core: core.clone(),
            tracker: tracker.clone(),
        });
        if let Some(registration) = registry
            && let Err(err) = registration.register(&reporter)
        {
            core.abort();
            return Err(err);
        }
        Ok(Dispatcher { core, tracker, reporter })
    }
}

impl<T> fmt::Debug for DispatcherBuilder<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DispatcherBuilder")
            .field("workers", &self.workers)
            .field("queue_size", &self.queue_size)
            .finish_non_exhaustive()
    }
}

/// A key registered for tracking by a waiting submit: forgotten when dropped while set (the
/// item was refused, or the submit's future dropped while it waited).
struct Registered<'a, T: Send + 'static> {
    tracker: &'a Tracker<T>,
    key: Option<String>,
}

impl<T: Send + 'static> Drop for Registered<'_, T> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            self.tracker.left(&key, false);
        }
    }
}

type MakeTracker<T> =
    Box<dyn FnOnce(usize, Option<Box<dyn Fn(BoxError) + Send + Sync>>) -> Tracker<T> + Send>;

/// Configures a [`Dispatcher`] with completion tracking; see
/// [`DispatcherBuilder::completion`].
#[must_use = "a builder does nothing until `build` is called"]
pub struct TrackedDispatcherBuilder<T> {
    inner: DispatcherBuilder<T>,
    source: Arc<dyn CompletionSource>,
    make: MakeTracker<T>,
    max_tracked: usize,
    on_watch_error: Option<Box<dyn Fn(BoxError) + Send + Sync>>,
}

impl<T: Send + 'static> TrackedDispatcherBuilder<T> {
    /// Keys that may be registered at once (default 10,000): items waiting for their
    /// completion signal, and items signalled but still in the dispatcher. One more is refused
    /// with [`SubmitError::TrackingFull`]. At least 1.
    pub fn max_tracked(mut self, max_tracked: usize) -> Self {
        self.max_tracked = max_tracked;
        self
    }

    /// Called whenever the completion watch breaks (it is re-established with back-off); the
    /// break also shows in the snapshot.
    pub fn on_watch_error(
        mut self,
        on_watch_error: impl Fn(BoxError) + Send + Sync + 'static,
    ) -> Self {
        self.on_watch_error = Some(Box::new(on_watch_error));
        self
    }

    /// Establishes the completion watch, then builds the dispatcher and starts its workers: a
    /// signal written after this returns is never missed.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] as for [`DispatcherBuilder::build`] (and `max_tracked` of zero), or
    /// the source's error if the watch cannot be established.
    pub async fn build<P, Fut, E>(self, process: P) -> Result<Dispatcher<T>, BoxError>
    where
        P: Fn(T) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: Into<BoxError> + 'static,
    {
        let max = require(Some(self.max_tracked), "max_tracked")?;
        self.inner.validate()?;
        let first = self.source.watch().await?;
        let tracker = Arc::new((self.make)(max, self.on_watch_error));
        tracker.spawn_watcher(self.source, first);
        let process = TrackedProcess::new(Unkeyed(process), tracker.clone());
        let built = self.inner.finish(process, Some(tracker.clone()));
        if built.is_err() {
            tracker.abort_watching();
        }
        Ok(built?)
    }
}

impl<T> fmt::Debug for TrackedDispatcherBuilder<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TrackedDispatcherBuilder")
            .field("inner", &self.inner)
            .field("max_tracked", &self.max_tracked)
            .finish_non_exhaustive()
    }
}

/// Closes: the accepted items are processed, then the workers end. Without it, a dispatcher
/// dropped unstopped kept its workers (and what they hold) parked for the life of the runtime.
impl<T> Drop for Dispatcher<T> {
    fn drop(&mut self) {
        self.core.begin_stop();
        if let Some(tracker) = &self.tracker {
            tracker.orphan();
        }
    }
}

impl<T: Send + 'static> crate::Lifecycle for Dispatcher<T> {
    type Snapshot = PoolSnapshot;

    fn close(&self) {
        Dispatcher::close(self);
    }

    fn is_closed(&self) -> bool {
        Dispatcher::is_closed(self)
    }

    fn drained(&self) -> crate::BoxFuture<'_, ()> {
        Box::pin(Dispatcher::drained(self))
    }

    fn abort(&self) {
        Dispatcher::abort(self);
    }

    fn snapshot(&self) -> PoolSnapshot {
        Dispatcher::snapshot(self)
    }
}
