//! The engine shared by the pools: a scheduler under one lock, a fixed set of worker tasks, the
//! stop/abort lifecycle, counters, metrics and panic containment.
//!
//! # Invariants
//!
//! 1. Accept/stop handoff is atomic: `submit` pushes under the same lock that `stop` uses to
//!    leave `Running`, so every accepted item is in the scheduler before stopping starts, and
//!    workers only exit once the scheduler has nothing for them.
//! 2. At most `workers` items are in flight: each worker processes one item at a time.
//! 3. Counters reconcile under the lock: `submitted == completed + failed + panicked + dropped +
//!    inflight + queued`.
//! 4. An idle worker is woken only by whoever takes it off the idle list, with `notify_one`,
//!    which keeps a permit if the worker has not started waiting yet: no lost wake-ups.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics::{Counter, Gauge, Histogram};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use super::core::{Refused, Scheduler, Wake};
use super::error::{AbortReport, StopTimeout, SubmitError};
use crate::BoxError;
use crate::limit::Throttle;
use crate::util::{CatchPanic, PanicPayload, call_contained, drop_contained, lock};

/// An item with the time it was accepted (for the queue-wait histogram).
pub(crate) struct Queued<T> {
    pub(crate) item: T,
    pub(crate) at: Instant,
}

/// Where a pool is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Accepting and processing.
    Running,
    /// Refusing new items, draining accepted ones.
    Stopping,
    /// Drained: every accepted item was processed.
    Stopped,
    /// Aborted: queued items were discarded, in-flight ones cancelled.
    Aborted,
}

/// Counters and gauges of a pool.
///
/// Reconciles: `submitted == completed + failed + panicked + dropped + inflight + queued`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PoolStats {
    /// Items accepted.
    pub submitted: u64,
    /// Items refused at submit (full, key full, too many keys, stopped, tracking).
    pub rejected: u64,
    /// Items processed successfully.
    pub completed: u64,
    /// Items whose processing returned an error (or whose limit refused them).
    pub failed: u64,
    /// Items whose processing panicked.
    pub panicked: u64,
    /// Accepted items discarded or cancelled by an abort.
    pub dropped: u64,
    /// Items being processed now.
    pub inflight: usize,
    /// Items waiting now.
    pub queued: usize,
    /// Keys tracked now (per-key mode).
    pub keys: usize,
    /// Worker tasks (or shards).
    pub workers: usize,
}

/// Callbacks of a pool.
pub(crate) struct Hooks<T> {
    pub(crate) on_error: Option<Box<dyn Fn(BoxError) + Send + Sync>>,
    #[allow(clippy::type_complexity, reason = "a clone function and a callback, used together")]
    pub(crate) on_panic:
        Option<(Box<dyn Fn(&T) -> T + Send + Sync>, Box<dyn Fn(T, PanicPayload) + Send + Sync>)>,
}

impl<T> Default for Hooks<T> {
    fn default() -> Self {
        Self { on_error: None, on_panic: None }
    }
}

/// The pool's metrics handles, labelled `pool=<name>`, resolved once at build.
struct PoolMetrics {
    submitted: Counter,
    rejected: Counter,
    completed: Counter,
    failed: Counter,
    panicked: Counter,
    dropped: Counter,
    inflight: Gauge,
    queued: Gauge,
    queue_wait: Histogram,
    processing: Histogram,
}

impl PoolMetrics {
    fn new(name: &str) -> Self {
        crate::observe::describe_once();
        let labels = [("pool", name.to_owned())];
        Self {
            submitted: metrics::counter!("lanes_pool_submitted_total", &labels),
            rejected: metrics::counter!("lanes_pool_rejected_total", &labels),
            completed: metrics::counter!("lanes_pool_completed_total", &labels),
            failed: metrics::counter!("lanes_pool_failed_total", &labels),
            panicked: metrics::counter!("lanes_pool_panicked_total", &labels),
            dropped: metrics::counter!("lanes_pool_dropped_total", &labels),
            inflight: metrics::gauge!("lanes_pool_inflight", &labels),
            queued: metrics::gauge!("lanes_pool_queued", &labels),
            queue_wait: metrics::histogram!("lanes_pool_queue_wait_seconds", &labels),
            processing: metrics::histogram!("lanes_pool_processing_seconds", &labels),
        }
    }
}

struct State<S> {
    sched: S,
    phase: Phase,
    idle: Vec<usize>,
    live: usize,
    stats: PoolStats,
}

/// What every pool facade needs from an engine, whatever its scheduler and process function.
pub(crate) trait Core<T>: Send + Sync {
    fn submit(&self, item: T) -> Result<(), SubmitError<T>> {
        self.offer(item, true)
    }
    /// Submits; a refusal moves the `rejected` counter only if `count` (a blocking submit's
    /// retries are not refusals).
    fn offer(&self, item: T, count: bool) -> Result<(), SubmitError<T>>;
    /// Notified whenever room may have appeared (while a producer is parked) or the pool
    /// stopped accepting.
    fn space(&self) -> &Notify;
    /// Producers parked for room; `space` is only notified while this is above zero.
    fn parked(&self) -> &AtomicUsize;
    fn begin_stop(&self);
    fn abort(&self) -> AbortReport;
    fn finished(&self) -> &Notify;
    fn is_finished(&self) -> bool;
    fn stats(&self) -> PoolStats;
    fn phase(&self) -> Phase;
}

pub(crate) struct Engine<T, S, P> {
    state: Mutex<State<S>>,
    wake: Box<[Notify]>,
    space: Notify,
    /// Producers parked in `submit_wait`: workers only notify `space` when some wait.
    parked: AtomicUsize,
    finished: Notify,
    tasks: Mutex<Vec<AbortHandle>>,
    process: P,
    hooks: Hooks<T>,
    limit: Option<Throttle>,
    metrics: PoolMetrics,
}

impl<T, S, P> fmt::Debug for Engine<T, S, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine").finish_non_exhaustive()
    }
}

/// How a pool processes an item: with the index of the worker (or shard) that runs it.
pub(crate) trait Process<T>: Send + Sync + 'static {
    type Future: Future<Output = Result<(), BoxError>> + Send + 'static;
    fn call(&self, worker: usize, item: T) -> Self::Future;
}

impl<T, S, P> Engine<T, S, P>
where
    T: Send + 'static,
    S: Scheduler<Queued<T>>,
    P: Process<T>,
{
    /// Builds the engine and spawns its `workers` tasks on the current runtime.
    pub(crate) fn start(
        sched: S,
        workers: usize,
        process: P,
        hooks: Hooks<T>,
        limit: Option<Throttle>,
        name: &str,
    ) -> Arc<Self> {
        let engine = Arc::new(Self {
            state: Mutex::new(State {
                sched,
                phase: Phase::Running,
                idle: Vec::with_capacity(workers),
                live: workers,
                stats: PoolStats { workers, ..PoolStats::default() },
            }),
            wake: (0..workers).map(|_| Notify::new()).collect(),
            space: Notify::new(),
            parked: AtomicUsize::new(0),
            finished: Notify::new(),
            tasks: Mutex::new(Vec::with_capacity(workers)),
            process,
            hooks,
            limit,
            metrics: PoolMetrics::new(name),
        });
        let handles: Vec<AbortHandle> = (0..workers)
            .map(|worker| tokio::spawn(engine.clone().work(worker)).abort_handle())
            .collect();
        *lock(&engine.tasks) = handles;
        engine
    }

    fn wake_for(&self, state: &mut State<S>, wake: Wake) -> Option<usize> {
        match wake {
            Wake::None => None,
            Wake::Any => state.idle.pop(),
            Wake::Worker(worker) => {
                let position = state.idle.iter().position(|w| *w == worker)?;
                Some(state.idle.swap_remove(position))
            }
        }
    }

    /// One worker: take an item, process it, report it; park when there is nothing to take.
    /// Reporting an item and taking the next share one critical section.
    async fn work(self: Arc<Self>, worker: usize) {
        let mut finished: Option<(S::Slot, Outcome)> = None;
        loop {
            let taken = {
                let mut state = lock(&self.state);
                if state.phase == Phase::Aborted {
                    // The abort counted an item in flight as dropped.
                    return;
                }
                if let Some((slot, outcome)) = finished.take() {
                    self.record(&mut state, outcome);
                    // The worker takes the next item itself: a key made ready again needs no
                    // extra wake.
                    let _ = state.sched.done(slot);
                    state.stats.keys = state.sched.keys();
                }
                match state.sched.pop(worker) {
                    Some(taken) => {
                        state.stats.inflight += 1;
                        state.stats.queued = state.sched.queued();
                        Some(taken)
                    }
                    None if state.phase == Phase::Running => {
                        state.idle.push(worker);
                        None
                    }
                    None => {
                        state.live -= 1;
                        if state.live == 0 {
                            state.phase = Phase::Stopped;
                            self.finished.notify_waiters();
                        }
                        return;
                    }
                }
            };
            let Some((slot, queued)) = taken else {
                self.wake[worker].notified().await;
                continue;
            };
            if self.parked.load(Ordering::SeqCst) > 0 {
                self.space.notify_waiters();
            }
            self.metrics.queued.decrement(1.0);
            self.metrics.inflight.increment(1.0);
            let outcome = self.run(worker, queued).await;
            finished = Some((slot, outcome));
        }
    }

    fn record(&self, state: &mut State<S>, outcome: Outcome) {
        state.stats.inflight -= 1;
        self.metrics.inflight.decrement(1.0);
        match outcome {
            Outcome::Completed => {
                state.stats.completed += 1;
                self.metrics.completed.increment(1);
            }
            Outcome::Failed => {
                state.stats.failed += 1;
                self.metrics.failed.increment(1);
            }
            Outcome::Panicked => {
                state.stats.panicked += 1;
                self.metrics.panicked.increment(1);
            }
        }
    }

    /// Processes one item: its limit's permit first, then the process function, panics
    /// contained.
    async fn run(&self, worker: usize, queued: Queued<T>) -> Outcome {
        let started = Instant::now();
        self.metrics.queue_wait.record(started.saturating_duration_since(queued.at));
        let item = queued.item;
        let _permit = match &self.limit {
            None => None,
            Some(limit) => match limit.acquire().await {
                Ok(permit) => Some(permit),
                Err(err) => {
                    self.report_error(Box::new(err));
                    drop_contained(item);
                    return Outcome::Failed;
                }
            },
        };
        let kept = self.hooks.on_panic.as_ref().map(|(clone, _)| clone(&item));
        let outcome = match call_contained(|| self.process.call(worker, item)) {
            Err(_) => Err(Box::new("process panicked before returning a future") as PanicPayload),
            Ok(fut) => CatchPanic::new(fut).await,
        };
        self.metrics.processing.record(started.elapsed());
        match outcome {
            Ok(Ok(())) => {
                drop_contained(kept);
                Outcome::Completed
            }
            Ok(Err(err)) => {
                drop_contained(kept);
                self.report_error(err);
                Outcome::Failed
            }
            Err(payload) => {
                match (&self.hooks.on_panic, kept) {
                    (Some((_, on_panic)), Some(item)) => {
                        let _ = call_contained(|| on_panic(item, payload));
                    }
                    (_, kept) => {
                        drop_contained(kept);
                        drop_contained(payload);
                    }
                }
                Outcome::Panicked
            }
        }
    }

    fn report_error(&self, err: BoxError) {
        match &self.hooks.on_error {
            Some(on_error) => {
                let _ = call_contained(|| on_error(err));
            }
            None => drop_contained(err),
        }
    }
}

enum Outcome {
    Completed,
    Failed,
    Panicked,
}

impl<T, S, P> Core<T> for Engine<T, S, P>
where
    T: Send + 'static,
    S: Scheduler<Queued<T>>,
    P: Process<T>,
{
    fn offer(&self, item: T, count: bool) -> Result<(), SubmitError<T>> {
        let mut state = lock(&self.state);
        if state.phase != Phase::Running {
            state.stats.rejected += 1;
            drop(state);
            self.metrics.rejected.increment(1);
            return Err(SubmitError::Stopped(item));
        }
        match state.sched.push(Queued { item, at: Instant::now() }) {
            Ok(wake) => {
                state.stats.submitted += 1;
                state.stats.queued = state.sched.queued();
                state.stats.keys = state.sched.keys();
                let worker = self.wake_for(&mut state, wake);
                drop(state);
                if let Some(worker) = worker {
                    self.wake[worker].notify_one();
                }
                self.metrics.submitted.increment(1);
                self.metrics.queued.increment(1.0);
                Ok(())
            }
            Err((refused, queued)) => {
                if count {
                    state.stats.rejected += 1;
                }
                drop(state);
                if count {
                    self.metrics.rejected.increment(1);
                }
                Err(match refused {
                    Refused::Full => SubmitError::Full(queued.item),
                    Refused::KeyFull => SubmitError::KeyFull(queued.item),
                    Refused::TooManyKeys => SubmitError::TooManyKeys(queued.item),
                })
            }
        }
    }

    fn space(&self) -> &Notify {
        &self.space
    }

    fn parked(&self) -> &AtomicUsize {
        &self.parked
    }

    fn begin_stop(&self) {
        let idle = {
            let mut state = lock(&self.state);
            if state.phase != Phase::Running {
                return;
            }
            state.phase = Phase::Stopping;
            std::mem::take(&mut state.idle)
        };
        for worker in idle {
            self.wake[worker].notify_one();
        }
        self.space.notify_waiters();
    }

    fn abort(&self) -> AbortReport {
        let (discarded, report) = {
            let mut state = lock(&self.state);
            if matches!(state.phase, Phase::Aborted | Phase::Stopped) {
                return AbortReport::default();
            }
            state.phase = Phase::Aborted;
            let discarded = state.sched.drain();
            let report = AbortReport {
                discarded: discarded.len() as u64,
                cancelled: state.stats.inflight as u64,
            };
            state.stats.dropped += report.discarded + report.cancelled;
            state.stats.inflight = 0;
            state.stats.queued = 0;
            state.stats.keys = state.sched.keys();
            state.live = 0;
            state.idle.clear();
            (discarded, report)
        };
        for task in lock(&self.tasks).drain(..) {
            task.abort();
        }
        self.metrics.dropped.increment(report.discarded + report.cancelled);
        self.metrics.queued.decrement(report.discarded as f64);
        self.metrics.inflight.decrement(report.cancelled as f64);
        drop_contained(discarded);
        self.space.notify_waiters();
        self.finished.notify_waiters();
        report
    }

    fn finished(&self) -> &Notify {
        &self.finished
    }

    fn is_finished(&self) -> bool {
        matches!(lock(&self.state).phase, Phase::Stopped | Phase::Aborted)
    }

    fn stats(&self) -> PoolStats {
        lock(&self.state).stats
    }

    fn phase(&self) -> Phase {
        lock(&self.state).phase
    }
}

/// Waits until the pool stopped and drained (forever if nobody stops it).
pub(crate) async fn wait_drained<T>(core: &dyn Core<T>) {
    loop {
        let mut notified = std::pin::pin!(core.finished().notified());
        notified.as_mut().enable();
        if core.is_finished() {
            return;
        }
        notified.await;
    }
}

/// Waits for the pool to drain, up to `timeout`.
pub(crate) async fn wait_finished<T>(
    core: &dyn Core<T>,
    timeout: Duration,
) -> Result<(), StopTimeout> {
    match tokio::time::timeout(timeout, wait_drained(core)).await {
        Ok(()) => Ok(()),
        Err(_) => {
            let stats = core.stats();
            Err(StopTimeout { after: timeout, queued: stats.queued, inflight: stats.inflight })
        }
    }
}

/// Submits, waiting for room; gives the item back only when the pool stops accepting.
pub(crate) async fn submit_wait<T>(core: &dyn Core<T>, mut item: T) -> Result<(), SubmitError<T>> {
    // Counted before the first try, so a worker that frees room after the try sees a parked
    // producer and notifies.
    struct Parked<'a>(&'a AtomicUsize);
    impl Drop for Parked<'_> {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
    core.parked().fetch_add(1, Ordering::SeqCst);
    let _parked = Parked(core.parked());
    loop {
        let mut room = std::pin::pin!(core.space().notified());
        room.as_mut().enable();
        match core.offer(item, false) {
            Ok(()) => return Ok(()),
            Err(
                SubmitError::Full(back)
                | SubmitError::KeyFull(back)
                | SubmitError::TooManyKeys(back),
            ) => {
                item = back;
            }
            Err(other) => return Err(other),
        }
        room.await;
    }
}

/// A process function of a dispatcher: `Fn(T) -> impl Future<Output = Result<(), E>>`.
pub(crate) struct Unkeyed<F>(pub(crate) F);

impl<T, F, Fut, E> Process<T> for Unkeyed<F>
where
    F: Fn(T) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), E>> + Send + 'static,
    E: Into<BoxError> + 'static,
{
    type Future = futures_map::MapErr<Fut>;

    fn call(&self, _worker: usize, item: T) -> Self::Future {
        futures_map::MapErr::new((self.0)(item))
    }
}

/// A process function of a keyed pool: `Fn(usize, T) -> impl Future<Output = Result<(), E>>`,
/// given the shard (hashed mode) or worker (per-key mode) index.
pub(crate) struct Indexed<F>(pub(crate) F);

impl<T, F, Fut, E> Process<T> for Indexed<F>
where
    F: Fn(usize, T) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), E>> + Send + 'static,
    E: Into<BoxError> + 'static,
{
    type Future = futures_map::MapErr<Fut>;

    fn call(&self, worker: usize, item: T) -> Self::Future {
        futures_map::MapErr::new((self.0)(worker, item))
    }
}

mod futures_map {
    use std::future::Future;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use crate::BoxError;

    pin_project_lite::pin_project! {
        /// Maps a future's error into a `BoxError` without boxing the future.
        pub(crate) struct MapErr<F> {
            #[pin]
            inner: F,
        }
    }

    impl<F> MapErr<F> {
        pub(crate) fn new(inner: F) -> Self {
            Self { inner }
        }
    }

    impl<F, E> Future for MapErr<F>
    where
        F: Future<Output = Result<(), E>>,
        E: Into<BoxError>,
    {
        type Output = Result<(), BoxError>;

        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
            self.project().inner.poll(cx).map(|r| r.map_err(Into::into))
        }
    }
}
