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
//! 5. At most one worker is woken for work any worker may take (`searching`): until it has
//!    looked, more such work wakes nobody, and when it takes an item it wakes the next idle
//!    worker if ready work remains. A burst of submits wakes workers one after the other as
//!    they find work, instead of all of them at once to contend for the lock.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};
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
use crate::util::{
    CatchPanic, PanicPayload, SpinGuard, SpinLock, WaitKey, WaitList, call_contained,
    drop_contained, lock, spin_lock,
};

/// An item with the time it was accepted, if wait timing is on (for the queue-wait
/// histogram).
pub(crate) struct Queued<T> {
    pub(crate) item: T,
    pub(crate) at: Stamp,
}

/// When an item was accepted: nanoseconds since the pool's epoch, or none (wait timing off).
/// A whole word: an `Option<Instant>`'s `None` is a 4-byte write of its nanos niche, read back
/// inside the wider loads that move an item, which stalls store forwarding.
#[derive(Clone, Copy)]
pub(crate) struct Stamp(u64);

impl Stamp {
    const NONE: Self = Self(u64::MAX);

    fn now(epoch: Instant) -> Self {
        match crate::observe::timing_start() {
            None => Self::NONE,
            Some(now) => {
                let nanos = now.saturating_duration_since(epoch).as_nanos();
                Self(u64::try_from(nanos).unwrap_or(u64::MAX - 1).min(u64::MAX - 1))
            }
        }
    }

    fn get(self, epoch: Instant) -> Option<Instant> {
        (self.0 != u64::MAX).then(|| epoch + std::time::Duration::from_nanos(self.0))
    }
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
    /// Keys with work now, queued or running (per-key mode; idle keys kept for their return are
    /// not counted).
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
///
/// Every call is contained ([`call_contained`]), each group of calls in one: a recorder's
/// panic unwound through a worker's loop would end the worker with an item taken (dropped
/// unprocessed, or processed and never counted), its key never done, and the pool's stop
/// waiting for it for good; one unwound through a submit would tell its caller that an item
/// the pool queued was not.
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
    /// A worker was woken for work any worker may take and has not looked yet (invariant 5).
    searching: bool,
    live: usize,
    stats: PoolStats,
    /// Producers in `submit_wait` refused because the pool was full, first come first served:
    /// each item a worker takes hands its room to the first of them (`handed`).
    blocked: WaitList,
    /// Rooms of the total bound handed to producers taken off `blocked` and not yet used: a
    /// submit that does not wait counts them taken, so it cannot take a room before the
    /// producer it was handed to. Each is used by that producer's item, passed to the next
    /// producer in `blocked`, or given back (0 once the pool no longer accepts).
    handed: usize,
    /// Producers refused because their key's queue was full (or no key could be added): any
    /// item taken may be the room they need, so a take wakes them all.
    key_blocked: WaitList,
}

/// Which list a waiting producer is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Blocked {
    Full,
    Key,
}

/// A producer's place while `submit_wait` waits: once its list woke it (it is no longer there),
/// it is its turn; taken off the list of producers refused for a full pool while the pool
/// accepts, it holds a room handed to it (`State::handed`).
#[derive(Debug, Default)]
pub(crate) struct PoolWaiter {
    at: Option<(Blocked, WaitKey)>,
}

/// What a waiting offer did.
pub(crate) enum Offered<T> {
    Done(Result<(), SubmitError<T>>),
    /// Queued as a waiter: poll again when woken.
    Waiting(T),
}

/// What every pool facade needs from an engine, whatever its scheduler and process function.
pub(crate) trait Core<T>: Send + Sync {
    fn submit(&self, item: T) -> Result<(), SubmitError<T>> {
        self.offer(item, true)
    }
    /// Submits; a refusal moves the `rejected` counter only if `count` (a blocking submit's
    /// retries are not refusals).
    fn offer(&self, item: T, count: bool) -> Result<(), SubmitError<T>>;
    /// Counts a refusal decided before the engine saw the item (completion tracking's).
    fn reject(&self);
    /// Submits, or queues the producer (FIFO) to be woken when room may have appeared or the
    /// pool stopped accepting.
    fn offer_waiting(&self, item: T, waiter: &mut PoolWaiter, waker: &Waker) -> Offered<T>;
    /// A waiting producer went away: it leaves its list, passing a room handed to it on.
    fn cancel_wait(&self, waiter: &mut PoolWaiter);
    fn begin_stop(&self);
    fn abort(&self) -> AbortReport;
    fn finished(&self) -> &Notify;
    fn is_finished(&self) -> bool;
    fn stats(&self) -> PoolStats;
    fn phase(&self) -> Phase;
}

pub(crate) struct Engine<T, S, P> {
    state: SpinLock<State<S>>,
    wake: Box<[Notify]>,
    finished: Notify,
    tasks: Mutex<Vec<AbortHandle>>,
    /// Worker tasks not yet gone (an aborted one goes when tokio drops it, which may be after
    /// `abort` returned: an item it was processing holds its permit until then).
    tasks_alive: AtomicUsize,
    process: P,
    hooks: Hooks<T>,
    limit: Option<Throttle>,
    metrics: PoolMetrics,
    /// What the accept times of queued items count from.
    epoch: Instant,
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
    /// The engine drops `item` without calling [`call`](Self::call): its limit refused it a
    /// permit, or its copy for `on_panic` panicked.
    fn skipped(&self, _item: &T) {}
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
            state: SpinLock::new(State {
                sched,
                phase: Phase::Running,
                idle: Vec::with_capacity(workers),
                searching: false,
                live: workers,
                stats: PoolStats { workers, ..PoolStats::default() },
                blocked: WaitList::default(),
                handed: 0,
                key_blocked: WaitList::default(),
            }),
            wake: (0..workers).map(|_| Notify::new()).collect(),
            finished: Notify::new(),
            tasks: Mutex::new(Vec::with_capacity(workers)),
            tasks_alive: AtomicUsize::new(workers),
            process,
            hooks,
            limit,
            metrics: PoolMetrics::new(name),
            epoch: Instant::now(),
        });
        let handles: Vec<AbortHandle> = (0..workers)
            .map(|worker| {
                let work = Box::pin(engine.clone().work(worker));
                tokio::spawn(Worker { work: Some(work), engine: engine.clone() }).abort_handle()
            })
            .collect();
        *lock(&engine.tasks) = handles;
        engine
    }

    /// Under the lock: queues `item`, or hands it back with why not. Answers the idle worker
    /// to wake.
    fn push_locked(&self, state: &mut State<S>, item: T) -> Result<Option<usize>, (Refused, T)> {
        match state.sched.push(Queued { item, at: Stamp::now(self.epoch) }) {
            Ok(wake) => {
                state.stats.submitted += 1;
                state.stats.queued = state.sched.queued();
                state.stats.keys = state.sched.keys();
                Ok(self.wake_for(state, wake))
            }
            Err((refused, queued)) => Err((refused, queued.item)),
        }
    }

    /// After a push, outside the lock.
    fn pushed(&self, worker: Option<usize>) {
        if let Some(worker) = worker {
            self.wake[worker].notify_one();
        }
        // Contained: the item is queued, and its submitter must learn that it was.
        let _ = call_contained(|| {
            self.metrics.submitted.increment(1);
            self.metrics.queued.increment(1.0);
        });
    }

    /// Refuses `item`: the pool no longer accepts (counted rejected).
    fn stopped(&self, mut state: SpinGuard<'_, State<S>>, item: T) -> SubmitError<T> {
        state.stats.rejected += 1;
        drop(state);
        let _ = call_contained(|| self.metrics.rejected.increment(1));
        SubmitError::Stopped(item)
    }

    /// Every waiting producer, out of both lists (the pool stopped accepting: rooms handed to
    /// producers are given back).
    fn all_producers(state: &mut State<S>) -> Vec<Waker> {
        Self::set_handed(state, 0);
        let mut wakers = Vec::new();
        let n = state.blocked.len();
        state.blocked.pop_into(n, &mut wakers);
        let n = state.key_blocked.len();
        state.key_blocked.pop_into(n, &mut wakers);
        wakers
    }

    /// Hands a free room to the first producer refused for a full pool, if any: its waker.
    fn hand_room(state: &mut State<S>) -> Option<Waker> {
        let first = state.blocked.pop()?;
        Self::set_handed(state, state.handed + 1);
        Some(first)
    }

    /// A room handed to a producer is used by its item, or about to be passed on.
    fn room_used(state: &mut State<S>) {
        Self::set_handed(state, state.handed - 1);
    }

    /// The rooms handed to producers are now `handed`: the scheduler counts them taken.
    fn set_handed(state: &mut State<S>, handed: usize) {
        state.handed = handed;
        state.sched.reserve(handed);
    }

    fn wake_for(&self, state: &mut State<S>, wake: Wake) -> Option<usize> {
        match wake {
            Wake::None => None,
            Wake::Any if state.searching => None,
            Wake::Any => {
                let worker = state.idle.pop();
                state.searching = worker.is_some();
                worker
            }
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
        // The finished item's `on_error` or `on_panic`, called once its outcome is recorded: an
        // abort that came first counted the item dropped, and then it is not called (one
        // terminal state an item).
        let mut report: Option<Report<T>> = None;
        let mut producers = Vec::new();
        // Woken from idle (possibly as the searcher, invariant 5).
        let mut woken = false;
        loop {
            let mut next_worker = None;
            // The outcome recorded under the lock, counted in the metrics after it (the
            // recorder is user code, which may call into this pool).
            let mut counted = None;
            let mut ends = false;
            let taken = {
                // Submits and the other workers hold the lock for a push or a pop at a time:
                // a `SpinLock`, waited for awake (stop 48, two workers, `fixed pool 10000`:
                // 4.8-9.9 M/s with std's sleeping wait, 12.1-13.6 M/s with a spinning wait on
                // std's mutex; BENCHMARKS.md, suite 8).
                let mut state = spin_lock(&self.state);
                if state.phase == Phase::Aborted {
                    // The abort counted an item in flight as dropped.
                    drop(state);
                    drop_contained(report);
                    return;
                }
                if let Some((slot, outcome)) = finished.take() {
                    self.record(&mut state, outcome);
                    counted = Some(outcome);
                    // The worker takes the next item itself: a key made ready again needs no
                    // extra wake.
                    let _ = state.sched.done(slot);
                    state.stats.keys = state.sched.keys();
                }
                if woken {
                    // This worker looks now: the next work for any worker wakes another.
                    state.searching = false;
                }
                let taken = state.sched.pop(worker);
                if taken.is_some() && state.sched.has_ready() {
                    next_worker = self.wake_for(&mut state, Wake::Any);
                }
                // Room appeared: the first producer refused for a full pool is handed the room
                // of the item taken; those refused for their key all look again (an item taken
                // or finished may be theirs).
                if taken.is_some()
                    && !state.blocked.is_empty()
                    && let Some(first) = Self::hand_room(&mut state)
                {
                    producers.push(first);
                }
                if !state.key_blocked.is_empty() {
                    let n = state.key_blocked.len();
                    state.key_blocked.pop_into(n, &mut producers);
                }
                match taken {
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
                        ends = true;
                        None
                    }
                }
            };
            if let Some(outcome) = counted {
                self.count(outcome);
                if let Some(report) = report.take() {
                    self.report(report);
                }
            }
            if ends {
                // Out of the pool only once its outcome is counted: the pool is stopped when
                // the last worker is, so a caller of `stop` finds every outcome counted.
                let last = {
                    let mut state = spin_lock(&self.state);
                    // An abort since counted every worker out (and notifies itself).
                    if state.phase == Phase::Aborted {
                        return;
                    }
                    state.live -= 1;
                    if state.live == 0 {
                        state.phase = Phase::Stopped;
                    }
                    state.live == 0
                };
                if last {
                    self.finished.notify_waiters();
                }
                return;
            }
            if let Some(next) = next_worker {
                self.wake[next].notify_one();
            }
            for producer in producers.drain(..) {
                producer.wake();
            }
            let Some((slot, queued)) = taken else {
                self.wake[worker].notified().await;
                woken = true;
                continue;
            };
            woken = false;
            let _ = call_contained(|| {
                self.metrics.queued.decrement(1.0);
                self.metrics.inflight.increment(1.0);
            });
            let (outcome, reported) = self.run(worker, queued).await;
            finished = Some((slot, outcome));
            report = reported;
        }
    }

    /// Records a finished item's outcome in the pool's stats (under its lock).
    fn record(&self, state: &mut State<S>, outcome: Outcome) {
        state.stats.inflight -= 1;
        match outcome {
            Outcome::Completed => state.stats.completed += 1,
            Outcome::Failed => state.stats.failed += 1,
            Outcome::Panicked => state.stats.panicked += 1,
        }
    }

    /// Counts a finished item's outcome in the metrics (after the lock).
    fn count(&self, outcome: Outcome) {
        let counted = match outcome {
            Outcome::Completed => &self.metrics.completed,
            Outcome::Failed => &self.metrics.failed,
            Outcome::Panicked => &self.metrics.panicked,
        };
        let _ = call_contained(|| {
            self.metrics.inflight.decrement(1.0);
            counted.increment(1);
        });
    }

    /// Processes one item: its limit's permit first, then the process function, panics
    /// contained.
    async fn run(&self, worker: usize, queued: Queued<T>) -> (Outcome, Option<Report<T>>) {
        // The clock is read only if wait timing is on (it was a tenth of an item's cost).
        let started = crate::observe::timing_start();
        if let (Some(started), Some(at)) = (started, queued.at.get(self.epoch)) {
            let waited = started.saturating_duration_since(at);
            let _ = call_contained(|| self.metrics.queue_wait.record(waited));
        }
        let item = queued.item;
        // The limit's acquire and the permit's drop call its `metrics` recorder, which is
        // not contained (`limit::metrics`): a panic there would end this worker.
        let permit = match &self.limit {
            None => None,
            Some(limit) => match CatchPanic::new(limit.acquire()).await {
                Ok(Ok(permit)) => Some(permit),
                Ok(Err(err)) => {
                    self.skip(&item);
                    drop_contained(item);
                    return (Outcome::Failed, Some(Report::Error(Box::new(err))));
                }
                Err(payload) => {
                    drop_contained(payload);
                    self.skip(&item);
                    drop_contained(item);
                    let err = "the pool's limit panicked as a permit was acquired".into();
                    return (Outcome::Failed, Some(Report::Error(err)));
                }
            },
        };
        // The copy `on_panic` gets is made by the item's `Clone`, user code: a panic there is
        // the item's panic (`on_panic` gets the item itself), and the item is not processed.
        let kept = match &self.hooks.on_panic {
            None => None,
            Some((clone, _)) => {
                match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| clone(&item))) {
                    Ok(kept) => Some(kept),
                    Err(payload) => {
                        drop_contained(permit);
                        self.skip(&item);
                        return (Outcome::Panicked, Some(Report::Panic(item, payload)));
                    }
                }
            }
        };
        let outcome = match call_contained(|| self.process.call(worker, item)) {
            Err(_) => Err(Box::new("process panicked before returning a future") as PanicPayload),
            Ok(fut) => CatchPanic::new(fut).await,
        };
        drop_contained(permit);
        if let Some(started) = started {
            let _ = call_contained(|| self.metrics.processing.record(started.elapsed()));
        }
        match outcome {
            Ok(Ok(())) => {
                drop_contained(kept);
                (Outcome::Completed, None)
            }
            Ok(Err(err)) => {
                drop_contained(kept);
                (Outcome::Failed, Some(Report::Error(err)))
            }
            Err(payload) => match kept {
                Some(item) => (Outcome::Panicked, Some(Report::Panic(item, payload))),
                None => {
                    drop_contained(payload);
                    (Outcome::Panicked, None)
                }
            },
        }
    }

    /// Tells the process function that `item` is dropped unprocessed (user code, contained).
    fn skip(&self, item: &T) {
        let _ = call_contained(|| self.process.skipped(item));
    }

    /// Calls the hook of a finished item's failure (recorded already), or drops what it holds.
    fn report(&self, report: Report<T>) {
        match (report, &self.hooks.on_error, &self.hooks.on_panic) {
            (Report::Error(err), Some(on_error), _) => {
                let _ = call_contained(|| on_error(err));
            }
            (Report::Panic(item, payload), _, Some((_, on_panic))) => {
                let _ = call_contained(|| on_panic(item, payload));
            }
            (report, ..) => drop_contained(report),
        }
    }
}

/// What a finished item's hook is to be told.
enum Report<T> {
    /// Its processing (or its limit) failed: for `on_error`.
    Error(BoxError),
    /// Its processing panicked: the item's copy and the payload, for `on_panic`.
    Panic(T, PanicPayload),
}

#[derive(Clone, Copy)]
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
        // Awake, as the workers wait (`work`).
        let mut state = spin_lock(&self.state);
        if state.phase != Phase::Running {
            return Err(self.stopped(state, item));
        }
        match self.push_locked(&mut state, item) {
            Ok(worker) => {
                drop(state);
                self.pushed(worker);
                Ok(())
            }
            Err((refused, item)) => {
                if count {
                    state.stats.rejected += 1;
                }
                drop(state);
                if count {
                    let _ = call_contained(|| self.metrics.rejected.increment(1));
                }
                Err(refusal(refused, item))
            }
        }
    }

    fn reject(&self) {
        spin_lock(&self.state).stats.rejected += 1;
        let _ = call_contained(|| self.metrics.rejected.increment(1));
    }

    fn offer_waiting(&self, item: T, waiter: &mut PoolWaiter, waker: &Waker) -> Offered<T> {
        let mut state = spin_lock(&self.state);
        // Still queued: not its turn (unless the pool stopped). Gone from its list: its turn.
        let mut turn = None;
        if let Some((list, key)) = waiter.at.take() {
            let running = state.phase == Phase::Running;
            let queue = match list {
                Blocked::Full => &mut state.blocked,
                Blocked::Key => &mut state.key_blocked,
            };
            if queue.refresh(key, waker) {
                if running {
                    waiter.at = Some((list, key));
                    return Offered::Waiting(item);
                }
                queue.remove(key);
            } else {
                turn = Some(list);
            }
        }
        if state.phase != Phase::Running {
            return Offered::Done(Err(self.stopped(state, item)));
        }
        // Taken off `blocked` while the pool accepts: it holds a room handed to it (a stop
        // answers the others first, above). Its item uses it, or it goes on.
        let holds = turn == Some(Blocked::Full);
        if holds {
            Self::room_used(&mut state);
        }
        let pushed = if holds {
            // The push runs the user's key function and `Hash`: if either panics, the room goes
            // to the next producer (under this lock, before a submit could take it), not back.
            let pushing = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.push_locked(&mut state, item)
            }));
            match pushing {
                Ok(pushed) => pushed,
                Err(panic) => {
                    let next = Self::hand_room(&mut state);
                    drop(state);
                    next.into_iter().for_each(Waker::wake);
                    std::panic::resume_unwind(panic)
                }
            }
        } else {
            self.push_locked(&mut state, item)
        };
        match pushed {
            Ok(worker) => {
                drop(state);
                self.pushed(worker);
                Offered::Done(Ok(()))
            }
            Err((refused, item)) => {
                let mut passed = None;
                waiter.at = Some(match refused {
                    // Not with a room handed to it: the rooms handed are counted taken.
                    Refused::Full => (Blocked::Full, state.blocked.push(waker)),
                    Refused::KeyFull | Refused::TooManyKeys => {
                        // A room it cannot use goes to the next producer.
                        if holds {
                            passed = Self::hand_room(&mut state);
                        }
                        (Blocked::Key, state.key_blocked.push(waker))
                    }
                });
                drop(state);
                if let Some(next) = passed {
                    next.wake();
                }
                Offered::Waiting(item)
            }
        }
    }

    fn cancel_wait(&self, waiter: &mut PoolWaiter) {
        let Some((list, key)) = waiter.at.take() else { return };
        let passed = {
            let mut state = spin_lock(&self.state);
            match list {
                // Taken off the list while the pool accepts: the room handed to it goes to the
                // next producer, or back.
                Blocked::Full if !state.blocked.remove(key) && state.phase == Phase::Running => {
                    Self::room_used(&mut state);
                    Self::hand_room(&mut state)
                }
                Blocked::Full => None,
                Blocked::Key => {
                    state.key_blocked.remove(key);
                    None
                }
            }
        };
        if let Some(next) = passed {
            next.wake();
        }
    }

    fn begin_stop(&self) {
        let idle = {
            let mut state = spin_lock(&self.state);
            if state.phase != Phase::Running {
                return;
            }
            state.phase = Phase::Stopping;
            (std::mem::take(&mut state.idle), Self::all_producers(&mut state))
        };
        let (idle, producers) = idle;
        for worker in idle {
            self.wake[worker].notify_one();
        }
        for producer in producers {
            producer.wake();
        }
    }

    fn abort(&self) -> AbortReport {
        let (discarded, report, producers) = {
            let mut state = spin_lock(&self.state);
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
            // Nothing queued, nothing runs on: the keys still marked running in the scheduler
            // are of items the abort counted dropped, whose workers never report their end.
            state.stats.keys = 0;
            state.live = 0;
            state.idle.clear();
            (discarded, report, Self::all_producers(&mut state))
        };

        for task in lock(&self.tasks).drain(..) {
            task.abort();
        }
        // Contained: the discarded items, the producers and the stop's waiters come after.
        let _ = call_contained(|| {
            self.metrics.dropped.increment(report.discarded + report.cancelled);
            self.metrics.queued.decrement(report.discarded as f64);
            self.metrics.inflight.decrement(report.cancelled as f64);
        });
        drop_contained(discarded);
        for producer in producers {
            producer.wake();
        }
        self.finished.notify_waiters();
        report
    }

    fn finished(&self) -> &Notify {
        &self.finished
    }

    fn is_finished(&self) -> bool {
        match spin_lock(&self.state).phase {
            Phase::Stopped => true,
            // Once every cancelled item is gone, with what it held.
            Phase::Aborted => self.tasks_alive.load(Ordering::Acquire) == 0,
            _ => false,
        }
    }

    fn stats(&self) -> PoolStats {
        spin_lock(&self.state).stats
    }

    fn phase(&self) -> Phase {
        spin_lock(&self.state).phase
    }
}

/// A worker task: its work, and the count of live tasks, which it leaves once the work is gone
/// (run to its end, or dropped by an abort, with the item it was processing and its permit).
struct Worker<W, T, S, P> {
    work: Option<Pin<Box<W>>>,
    engine: Arc<Engine<T, S, P>>,
}

impl<W: Future<Output = ()>, T, S, P> Future for Worker<W, T, S, P> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let Some(work) = this.work.as_mut() else { return Poll::Ready(()) };
        let done = work.as_mut().poll(cx);
        if done.is_ready() {
            this.work = None;
        }
        done
    }
}

impl<W, T, S, P> Drop for Worker<W, T, S, P> {
    fn drop(&mut self) {
        // The work first: what it holds goes before the pool may be found drained.
        drop_contained(self.work.take());
        if self.engine.tasks_alive.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.engine.finished.notify_waiters();
        }
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

/// Submits, waiting for room in line with the other waiting producers (first come first
/// served); gives the item back only when the pool stops accepting.
///
/// Cancel safe: dropped while it waits, the item is dropped unqueued and a room handed to it
/// goes to the next producer.
pub(crate) async fn submit_wait<T>(core: &dyn Core<T>, item: T) -> Result<(), SubmitError<T>> {
    struct Guard<'a, T> {
        core: &'a dyn Core<T>,
        waiter: PoolWaiter,
    }
    impl<T> Drop for Guard<'_, T> {
        fn drop(&mut self) {
            self.core.cancel_wait(&mut self.waiter);
        }
    }
    let mut guard = Guard { core, waiter: PoolWaiter::default() };
    let mut item = Some(item);
    std::future::poll_fn(|cx| {
        let pending = item.take().expect("polled after completion");
        match guard.core.offer_waiting(pending, &mut guard.waiter, cx.waker()) {
            Offered::Done(result) => Poll::Ready(result),
            Offered::Waiting(back) => {
                item = Some(back);
                Poll::Pending
            }
        }
    })
    .await
}

/// The error of a refused item.
fn refusal<T>(refused: Refused, item: T) -> SubmitError<T> {
    match refused {
        Refused::Full => SubmitError::Full(item),
        Refused::KeyFull => SubmitError::KeyFull(item),
        Refused::TooManyKeys => SubmitError::TooManyKeys(item),
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
