//! The async shell: `LaneSet`, `Lane`, and the task that drives each run through its life.
//!
//! # Implementation details
//!
//! Every admitted run is driven by one spawned task (`drive`), which polls the job itself, so a
//! run costs one task. The lane's pure core (`state.rs`) sits behind one `std::sync::Mutex` per
//! lane, never held across an await. A run's [`RunSignal`] carries the grant and the
//! cancellation between the lane, the caller's handle and the job.
//!
//! # Invariants
//!
//! 1. Exactly one place ends a run: the end of `drive`, which gives its ownership back after the
//!    finalizer and cleanup. Every path through `drive` reaches it, because every callback is
//!    panic-contained and bounded by a timeout, and a job that ignores cancellation is dropped
//!    (after poisoning the set) rather than awaited forever.
//! 2. The execution slot is given back before the terminal audit and the finalizer.
//! 3. `shut_done` is set only after every lane's core was shut *under its lock*, so an admission
//!    that won a lane lock before the shut has already counted itself in `owned`: `drained`
//!    cannot resolve under its feet.

use std::fmt;
use std::future::{Future, poll_fn};
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::{Instant, Sleep, sleep_until, timeout};

use super::audit::{Audit, AuditEvent, AuditKind};
use super::config::{LaneLimits, LaneSetBuilder};
use super::error::{
    AdmissionError, AdmissionErrorKind, PanicError, PoisonError, Reason, RunFailure, Stage,
    TimeoutError,
};
use super::metrics::LaneMetrics;
use super::run::{Cleanup, Finalize, Job, Participation, Run, RunContext, RunHandle, RunId};
use super::signal::{Decision, RunSignal};
use super::snapshot::{LaneSetSnapshot, LaneSnapshot, SetState};
use super::state::{Admitted, LaneCore, Shut};
use crate::BoxError;
use crate::config::ConfigError;
use crate::limit::{Permit, Throttle};
use crate::observe::{Observe, Snapshot};
use crate::util::{CatchUnwind, Panicked, call_contained, lock};

const OPEN: u8 = 0;
const CLOSED: u8 = 1;
const POISONED: u8 = 2;

struct LaneShared {
    name: Arc<str>,
    limits: LaneLimits,
    core: Mutex<LaneCore<Arc<RunSignal>>>,
    /// Woken (one waiter per run that ends, all on shut) for callers waiting for room.
    room: Notify,
    /// Callers waiting for room: a run that ends touches `room` only if there are any (the
    /// common case, nobody waiting, costs one load).
    waiting: AtomicUsize,
    metrics: LaneMetrics,
}

impl LaneShared {
    /// Publishes the lane's gauges (called under the lane lock, after a change).
    fn publish(&self, core: &LaneCore<Arc<RunSignal>>) {
        self.metrics.executing.set(core.executing() as f64);
        self.metrics.queued.set(core.queued() as f64);
    }
}

struct SetShared {
    lanes: Box<[LaneShared]>,
    /// `OPEN`, `CLOSED` or `POISONED`; only ever increases.
    state: AtomicU8,
    /// Every lane was shut (see invariant 3).
    shut_done: AtomicBool,
    /// Runs owned across all lanes.
    owned: AtomicUsize,
    drained: Notify,
    poisoned_by: OnceLock<RunId>,
    next_run_id: AtomicU64,
    audit_timeout: Duration,
    finalization_timeout: Duration,
    worker_drain_timeout: Duration,
    audit: Option<Arc<dyn Audit>>,
}

/// A set of named run lanes with shared lifecycle bounds. Cheap to clone: clones share the lanes.
///
/// See the [module documentation](super) for ordering, overflow, cancellation and shutdown.
#[derive(Clone)]
pub struct LaneSet {
    shared: Arc<SetShared>,
}

/// One lane of a [`LaneSet`], for admitting without a name lookup. Cheap to clone.
#[derive(Clone)]
pub struct Lane {
    shared: Arc<SetShared>,
    index: usize,
}

impl LaneSet {
    /// Starts configuring a set.
    pub fn builder() -> LaneSetBuilder {
        LaneSetBuilder::default()
    }

    pub(crate) fn from_builder(builder: LaneSetBuilder) -> Result<Self, ConfigError> {
        crate::observe::describe_once();
        let set_name = builder.metrics_name();
        let lanes = builder
            .lanes
            .into_iter()
            .map(|(name, limits)| LaneShared {
                metrics: LaneMetrics::new(&set_name, &name),
                name: name.into(),
                limits,
                core: Mutex::new(LaneCore::new(limits)),
                room: Notify::new(),
                waiting: AtomicUsize::new(0),
            })
            .collect();
        let shared = Arc::new(SetShared {
            lanes,
            state: AtomicU8::new(OPEN),
            shut_done: AtomicBool::new(false),
            owned: AtomicUsize::new(0),
            drained: Notify::new(),
            poisoned_by: OnceLock::new(),
            next_run_id: AtomicU64::new(0),
            // Validated present by the builder.
            audit_timeout: builder.audit_timeout.unwrap_or_default(),
            finalization_timeout: builder.finalization_timeout.unwrap_or_default(),
            worker_drain_timeout: builder.worker_drain_timeout.unwrap_or_default(),
            audit: builder.audit,
        });
        if let Some((registry, name)) = builder.registry {
            let source: Arc<dyn Observe> = shared.clone();
            registry.register_weak(name, Arc::downgrade(&source))?;
        }
        Ok(Self { shared })
    }

    /// The lane called `name`.
    pub fn lane(&self, name: &str) -> Option<Lane> {
        self.shared.index_of(name).map(|index| Lane { shared: self.shared.clone(), index })
    }

    /// The lanes' names, in configuration order.
    pub fn lane_names(&self) -> impl Iterator<Item = &str> {
        self.shared.lanes.iter().map(|lane| &*lane.name)
    }

    /// Admits `run` into lane `lane` with blocking participation: the returned handle resolves
    /// to the run's result once its finalizer and cleanup have finished.
    ///
    /// Admission never waits: the run is queued or starts at once, or is refused
    /// ([`run_wait`](LaneSet::run_wait) waits for room instead).
    ///
    /// # Errors
    ///
    /// [`AdmissionError`] (handing the run back) if the lane is full, the set is closed or
    /// poisoned, or there is no such lane. A refused run gets no id and its finalizer is not
    /// called.
    ///
    /// # Panics
    ///
    /// If called outside a tokio runtime.
    pub fn run<J, F>(
        &self,
        lane: &str,
        run: Run<J, F>,
    ) -> Result<RunHandle<F::Output>, AdmissionError<Run<J, F>>>
    where
        J: Job,
        F: Finalize<J::Output>,
    {
        match self.shared.index_of(lane) {
            Some(index) => admit_blocking(&self.shared, index, run, true),
            None => Err(unknown_lane(lane, Participation::Blocking, run)),
        }
    }

    /// Admits `run` into lane `lane` with background participation: the run is spawned and only
    /// its finalizer sees the outcome.
    ///
    /// # Errors
    ///
    /// As for [`run`](LaneSet::run).
    ///
    /// # Panics
    ///
    /// If called outside a tokio runtime.
    pub fn spawn<J, F>(
        &self,
        lane: &str,
        run: Run<J, F>,
    ) -> Result<RunId, AdmissionError<Run<J, F>>>
    where
        J: Job,
        F: Finalize<J::Output>,
    {
        match self.shared.index_of(lane) {
            Some(index) => admit_background(&self.shared, index, run, true),
            None => Err(unknown_lane(lane, Participation::Background, run)),
        }
    }

    /// As [`run`](LaneSet::run), but a full lane is waited on until it has room or `deadline`
    /// passes (`None`: no deadline), like tokio's `Sender::send` where `run` is `try_send`.
    /// Callers waiting on one lane are admitted in the order they started waiting.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it resolves drops the run unadmitted; its room goes to the
    /// next waiter.
    ///
    /// # Errors
    ///
    /// As for [`run`](LaneSet::run); [`AdmissionErrorKind::Full`] only once `deadline` passed.
    ///
    /// # Panics
    ///
    /// If called outside a tokio runtime.
    pub fn run_wait<J, F>(
        &self,
        lane: &str,
        run: Run<J, F>,
        deadline: Option<Instant>,
    ) -> impl Future<Output = Result<RunHandle<F::Output>, AdmissionError<Run<J, F>>>> + 'static
    where
        J: Job,
        F: Finalize<J::Output>,
    {
        // The future owns what it needs (not `lane`): it can be spawned.
        let found = self.shared.index_of(lane).ok_or_else(|| Arc::<str>::from(lane));
        let shared = self.shared.clone();
        async move {
            match found {
                Ok(index) => wait_for_room(&shared, index, run, deadline, admit_blocking).await,
                Err(name) => Err(unknown_lane(&name, Participation::Blocking, run)),
            }
        }
    }

    /// As [`spawn`](LaneSet::spawn), but a full lane is waited on until it has room or
    /// `deadline` passes; as [`run_wait`](LaneSet::run_wait).
    ///
    /// # Errors
    ///
    /// As for [`run_wait`](LaneSet::run_wait).
    ///
    /// # Panics
    ///
    /// If called outside a tokio runtime.
    pub fn spawn_wait<J, F>(
        &self,
        lane: &str,
        run: Run<J, F>,
        deadline: Option<Instant>,
    ) -> impl Future<Output = Result<RunId, AdmissionError<Run<J, F>>>> + 'static
    where
        J: Job,
        F: Finalize<J::Output>,
    {
        let found = self.shared.index_of(lane).ok_or_else(|| Arc::<str>::from(lane));
        let shared = self.shared.clone();
        async move {
            match found {
                Ok(index) => wait_for_room(&shared, index, run, deadline, admit_background).await,
                Err(name) => Err(unknown_lane(&name, Participation::Background, run)),
            }
        }
    }

    /// Stops admission on every lane at once, fails queued runs with [`Reason::Closed`] through
    /// their finalizers, and asks executing jobs to stop. Does not wait: join
    /// [`drained`](LaneSet::drained). Idempotent.
    pub fn close(&self) {
        self.shared.shut(Shut::Closed);
    }

    /// Resolves once the set is closed or poisoned and every owned run has been fully finalized
    /// (terminal audit, finalizer, cleanup). On an open set it waits for the close.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn drained(&self) {
        let shared = &self.shared;
        loop {
            let mut notified = pin!(shared.drained.notified());
            notified.as_mut().enable();
            if shared.is_drained() {
                return;
            }
            notified.await;
        }
    }

    /// Whether the set was closed (or poisoned).
    pub fn is_closed(&self) -> bool {
        self.shared.state.load(Ordering::Acquire) != OPEN
    }

    /// Whether the set was poisoned.
    pub fn is_poisoned(&self) -> bool {
        self.shared.state.load(Ordering::Acquire) == POISONED
    }

    /// The set and every lane, as they are now.
    pub fn snapshot(&self) -> LaneSetSnapshot {
        self.shared.snapshot()
    }
}

impl fmt::Debug for LaneSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LaneSet")
            .field("lanes", &self.lane_names().collect::<Vec<_>>())
            .field("state", &self.shared.set_state())
            .field("owned", &self.shared.owned.load(Ordering::Relaxed))
            .finish()
    }
}

impl Lane {
    /// The lane's name.
    pub fn name(&self) -> &str {
        &self.shared.lanes[self.index].name
    }

    /// The lane's bounds.
    pub fn limits(&self) -> LaneLimits {
        self.shared.lanes[self.index].limits
    }

    /// Like [`LaneSet::run`], on this lane.
    ///
    /// # Errors
    ///
    /// As for [`LaneSet::run`].
    ///
    /// # Panics
    ///
    /// If called outside a tokio runtime.
    pub fn run<J, F>(
        &self,
        run: Run<J, F>,
    ) -> Result<RunHandle<F::Output>, AdmissionError<Run<J, F>>>
    where
        J: Job,
        F: Finalize<J::Output>,
    {
        admit_blocking(&self.shared, self.index, run, true)
    }

    /// Like [`LaneSet::spawn`], on this lane.
    ///
    /// # Errors
    ///
    /// As for [`LaneSet::run`].
    ///
    /// # Panics
    ///
    /// If called outside a tokio runtime.
    pub fn spawn<J, F>(&self, run: Run<J, F>) -> Result<RunId, AdmissionError<Run<J, F>>>
    where
        J: Job,
        F: Finalize<J::Output>,
    {
        admit_background(&self.shared, self.index, run, true)
    }

    /// The lane, as it is now.
    pub fn snapshot(&self) -> LaneSnapshot {
        self.shared.lane_snapshot(self.index)
    }
}

impl fmt::Debug for Lane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lane").field("name", &self.name()).field("limits", &self.limits()).finish()
    }
}

fn unknown_lane<R>(lane: &str, participation: Participation, run: R) -> AdmissionError<R> {
    AdmissionError::new(AdmissionErrorKind::UnknownLane, lane.into(), participation, run)
}

/// Counts a caller waiting for room until dropped.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One of the admission functions ([`admit_blocking`], [`admit_background`]).
type AdmitFn<J, F, R> =
    fn(&Arc<SetShared>, usize, Run<J, F>, bool) -> Result<R, AdmissionError<Run<J, F>>>;

/// Admits `run` with `admit` once lane `index` has room, or refuses it `Full` at `deadline`.
/// The waiter registers for the lane's wake-up before each try, so a run ending between the
/// try and the wait is not missed; a full lane is counted once, when the wait gives up.
async fn wait_for_room<J, F, R>(
    shared: &Arc<SetShared>,
    index: usize,
    mut run: Run<J, F>,
    deadline: Option<Instant>,
    admit: AdmitFn<J, F, R>,
) -> Result<R, AdmissionError<Run<J, F>>> {
    let lane = &shared.lanes[index];
    lane.waiting.fetch_add(1, Ordering::SeqCst);
    // Uncounted however the wait ends (admitted, refused, dropped).
    let _waiting = Waiting(&lane.waiting);
    loop {
        let room = lane.room.notified();
        tokio::pin!(room);
        room.as_mut().enable();
        let refused = match admit(shared, index, run, false) {
            Err(refused) if refused.kind() == AdmissionErrorKind::Full => refused,
            other => return other,
        };
        let timed_out = match deadline {
            None => {
                room.await;
                false
            }
            Some(deadline) => tokio::select! {
                () = &mut room => false,
                () = tokio::time::sleep_until(deadline) => true,
            },
        };
        if timed_out {
            lock(&lane.core).count_rejected(AdmissionErrorKind::Full);
            lane.metrics.rejected.increment(1);
            lane.metrics.timed_out.increment(1);
            return Err(refused);
        }
        run = refused.into_run();
    }
}

fn admit_blocking<J, F>(
    shared: &Arc<SetShared>,
    index: usize,
    run: Run<J, F>,
    count_full: bool,
) -> Result<RunHandle<F::Output>, AdmissionError<Run<J, F>>>
where
    J: Job,
    F: Finalize<J::Output>,
{
    let (ticket, callbacks) = shared.admit(index, Participation::Blocking, run, count_full)?;
    let (run_id, signal) = (ticket.info.run_id, ticket.signal.clone());
    let join = tokio::spawn(drive(ticket, callbacks));
    Ok(RunHandle { run_id, lane: shared.lanes[index].name.clone(), join, signal, finished: false })
}

fn admit_background<J, F>(
    shared: &Arc<SetShared>,
    index: usize,
    run: Run<J, F>,
    count_full: bool,
) -> Result<RunId, AdmissionError<Run<J, F>>>
where
    J: Job,
    F: Finalize<J::Output>,
{
    let (ticket, callbacks) = shared.admit(index, Participation::Background, run, count_full)?;
    let run_id = ticket.info.run_id;
    drop(tokio::spawn(drive(ticket, callbacks)));
    Ok(run_id)
}

/// An admitted run, on its way to its driver task, without its job and finalizer.
///
/// `drive` keeps it as its one argument for its whole life (an async fn's arguments stay in its
/// state machine), so the run's data lives there once instead of being copied into locals.
struct Ticket {
    shared: Arc<SetShared>,
    info: TicketInfo,
    start: Start,
    signal: Arc<RunSignal>,
    queue_timeout: Option<Duration>,
    execution_timeout: Option<Duration>,
    limit: Option<Throttle>,
}

/// An admitted run, split into what `drive` borrows and what it consumes.
type Admission<J, F> = (Ticket, Callbacks<J, F>);

/// What `drive` consumes besides the ticket.
struct Callbacks<J, F> {
    job: J,
    finalizer: F,
    cleanup: Option<Cleanup>,
}

/// Where an admitted run starts.
enum Start {
    /// In execution slot `slot`, granted at admission.
    Executing { slot: usize },
    /// Waiting in the queue, until the queue timeout's deadline if there is one.
    Queued {
        seq: u64,
        deadline: Option<Instant>,
        /// When it was admitted, if wait timing is on.
        since: Option<tokio::time::Instant>,
    },
    /// Waiting for its limit's permit, holding no execution slot, then for a slot.
    Limited { seq: u64, deadline: Option<Instant>, since: Option<tokio::time::Instant> },
}

impl SetShared {
    fn index_of(&self, name: &str) -> Option<usize> {
        self.lanes.iter().position(|lane| &*lane.name == name)
    }

    fn admit<J, F>(
        self: &Arc<Self>,
        index: usize,
        participation: Participation,
        run: Run<J, F>,
        count_full: bool,
    ) -> Result<Admission<J, F>, AdmissionError<Run<J, F>>> {
        let lane = &self.lanes[index];
        let admitted = {
            let mut core = lock(&lane.core);
            let admitted = core
                .admit(count_full, run.limit.is_some(), |_| Arc::new(RunSignal::new()))
                .map(|(admitted, signal)| {
                    // Counted under the lane lock (invariant 3); ids increase in admission order.
                    self.owned.fetch_add(1, Ordering::AcqRel);
                    let run_id = RunId::new(self.next_run_id.fetch_add(1, Ordering::Relaxed) + 1);
                    (admitted, signal, run_id)
                });
            if admitted.is_ok() {
                lane.publish(&core);
            }
            admitted
        };
        match admitted {
            Ok((admitted, signal, run_id)) => {
                lane.metrics.admitted.increment(1);
                let start = match admitted {
                    Admitted::Executing { slot, .. } => {
                        if crate::observe::wait_timing() {
                            lane.metrics.queue_wait.record(0.0);
                        }
                        Start::Executing { slot }
                    }
                    Admitted::Queued { seq } => Start::Queued {
                        seq,
                        // The clock is read only for runs that wait with a timeout.
                        deadline: run.queue_timeout.map(|limit| Instant::now() + limit),
                        since: crate::observe::timing_start(),
                    },
                    Admitted::Limited { seq } => Start::Limited {
                        seq,
                        deadline: run.queue_timeout.map(|limit| Instant::now() + limit),
                        since: crate::observe::timing_start(),
                    },
                };
                let info = TicketInfo { lane: index, run_id, participation };
                let Run { job, finalizer, cleanup, queue_timeout, execution_timeout, limit } = run;
                let ticket = Ticket {
                    shared: self.clone(),
                    info,
                    start,
                    signal,
                    queue_timeout,
                    execution_timeout,
                    limit,
                };
                Ok((ticket, Callbacks { job, finalizer, cleanup }))
            }
            Err(kind) => {
                if count_full && kind == AdmissionErrorKind::Full {
                    lane.metrics.rejected.increment(1);
                }
                Err(AdmissionError::new(kind, lane.name.clone(), participation, run))
            }
        }
    }

    fn is_drained(&self) -> bool {
        self.shut_done.load(Ordering::Acquire) && self.owned.load(Ordering::Acquire) == 0
    }

    fn set_state(&self) -> SetState {
        match self.state.load(Ordering::Acquire) {
            OPEN => SetState::Open,
            CLOSED => SetState::Closed,
            _ => SetState::Poisoned,
        }
    }

    /// Closes or poisons every lane (see invariant 3).
    fn shut(&self, why: Shut) {
        let (code, reason) = match why {
            Shut::Closed => (CLOSED, Reason::Closed),
            Shut::Poisoned => (POISONED, Reason::Poisoned),
        };
        self.state.fetch_max(code, Ordering::AcqRel);
        for lane in self.lanes.iter() {
            let mut core = lock(&lane.core);
            core.shut(
                why,
                |signal| signal.shut(why),
                |signal| {
                    signal.cancel(reason);
                },
            );
            lane.publish(&core);
        }
        self.shut_done.store(true, Ordering::Release);
        for lane in self.lanes.iter() {
            lane.room.notify_waiters();
        }
        self.drained.notify_waiters();
    }

    fn poison(&self, by: RunId) {
        let _ = self.poisoned_by.set(by);
        self.shut(Shut::Poisoned);
    }

    fn poison_error(&self) -> Option<BoxError> {
        self.poisoned_by.get().map(|by| Box::new(PoisonError::new(*by)) as BoxError)
    }

    /// Gives a run's execution slot back; the next queued run is granted.
    fn release_execution(&self, lane: usize, slot: usize) {
        let lane = &self.lanes[lane];
        let mut core = lock(&lane.core);
        core.release_execution(slot, grant);
        lane.publish(&core);
    }

    /// Gives a run's ownership back (the run is over).
    fn complete(&self, lane: usize, failure: Option<Reason>) {
        let shared = &self.lanes[lane];
        lock(&shared.core).complete(failure);
        shared.metrics.finished(failure);
        // One run's room: one waiter (a waiter that gave up passes it on). A waiter counts
        // itself (SeqCst) before its first try, which takes the lane lock after this
        // completion's: if the load below misses it, its try sees the room.
        if shared.waiting.load(Ordering::SeqCst) > 0 {
            shared.room.notify_one();
        }
        if self.owned.fetch_sub(1, Ordering::AcqRel) == 1 && self.shut_done.load(Ordering::Acquire)
        {
            self.drained.notify_waiters();
        }
    }

    fn lane_snapshot(&self, index: usize) -> LaneSnapshot {
        let lane = &self.lanes[index];
        let core = lock(&lane.core);
        let counters = core.counters();
        LaneSnapshot {
            name: lane.name.to_string(),
            limits: lane.limits,
            executing: core.executing(),
            queued: core.queued(),
            owned: core.owned(),
            admitted: counters.admitted,
            rejected: counters.rejected,
            completed: counters.completed,
            failed: counters.failed,
            max_executing: counters.max_executing,
            max_owned: counters.max_owned,
            closed: core.shut_state().is_some(),
            poisoned: core.shut_state() == Some(Shut::Poisoned),
        }
    }

    fn snapshot(&self) -> LaneSetSnapshot {
        LaneSetSnapshot {
            state: self.set_state(),
            owned: self.owned.load(Ordering::Acquire),
            lanes: (0..self.lanes.len()).map(|index| self.lane_snapshot(index)).collect(),
        }
    }
}

impl Observe for SetShared {
    fn report(&self, name: &str, snapshot: &mut Snapshot) {
        snapshot.insert("lane_sets", name, &self.snapshot());
    }
}

/// Runs a (panic-contained) callback future under a timeout, flattening every way it can fail
/// into one error.
async fn bounded<T, E, Fut>(
    stage: Stage,
    limit: Duration,
    started: Result<Fut, Panicked>,
) -> Result<T, BoxError>
where
    Fut: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    let fut = started.map_err(|Panicked| Box::new(PanicError::new(stage)) as BoxError)?;
    let mut fut = pin!(CatchUnwind::new(fut));
    // Most callbacks finish on their first poll: the timer (and its clock read) is only armed,
    // and boxed to keep the run's future small, for those that do not.
    let ended = match poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await {
        Poll::Ready(ended) => ended,
        Poll::Pending => match Box::pin(timeout(limit, fut)).await {
            Ok(ended) => ended,
            Err(_elapsed) => return Err(Box::new(TimeoutError::new(stage, limit))),
        },
    };
    match ended {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(err)) => Err(err.into()),
        Err(Panicked) => Err(Box::new(PanicError::new(stage))),
    }
}

/// The identity of a run, without its job and finalizer.
#[derive(Clone, Copy)]
struct TicketInfo {
    lane: usize,
    run_id: RunId,
    participation: Participation,
}

/// Tells a queued run it holds execution slot `slot` (called under the lane lock).
fn grant(_seq: u64, slot: usize, signal: &Arc<RunSignal>) {
    signal.grant(slot);
}

/// Where and why a run failed before its finalizer, and the cause.
type Failed = (Stage, Reason, Option<BoxError>);

impl Ticket {
    fn lane_name(&self) -> Arc<str> {
        self.shared.lanes[self.info.lane].name.clone()
    }

    fn failure(&self, stage: Stage, reason: Reason, cause: Option<BoxError>) -> RunFailure {
        let TicketInfo { run_id, participation, .. } = self.info;
        RunFailure::new(run_id, self.lane_name(), participation, stage, reason, cause)
    }

    /// Records an audit event, bounded by `audit_timeout`. `Ok` without a hook; boxed with one,
    /// to keep the run's state machine small for the common case.
    async fn audit(&self, kind: AuditKind) -> Result<(), BoxError> {
        match &self.shared.audit {
            None => Ok(()),
            Some(audit) => Box::pin(self.record(audit, kind)).await,
        }
    }

    async fn record(&self, audit: &Arc<dyn Audit>, kind: AuditKind) -> Result<(), BoxError> {
        let event = AuditEvent {
            run_id: self.info.run_id,
            lane: self.lane_name(),
            participation: self.info.participation,
            kind,
        };
        let stage = match kind {
            AuditKind::Started => Stage::Start,
            _ => Stage::Terminal,
        };
        let limit = self.shared.audit_timeout;
        bounded(stage, limit, call_contained(|| audit.record(event))).await
    }
}

/// Drives one run from admission to the end of its cleanup (invariant 1).
///
/// An `async` block rather than an `async fn`: an async fn copies its arguments into locals, so
/// its state machine would hold them twice.
#[allow(clippy::manual_async_fn, reason = "an async fn would hold its arguments twice")]
fn drive<J, F>(
    t: Ticket,
    callbacks: Callbacks<J, F>,
) -> impl Future<Output = Result<F::Output, RunFailure>> + Send
where
    J: Job,
    F: Finalize<J::Output>,
{
    async move {
        let (job, finalizer, cleanup) = (callbacks.job, callbacks.finalizer, callbacks.cleanup);
        // Queue, start audit and execution; the execution slot goes back before anything else.
        let (granted, since) = match t.start {
            Start::Executing { slot } => (Ok((slot, None)), None),
            Start::Queued { seq, deadline, since } => {
                (await_grant(&t, seq, deadline).await.map(|slot| (slot, None)), since)
            }
            Start::Limited { seq, deadline, since } => {
                (await_permit(&t, seq, deadline).await, since)
            }
        };
        if let (Ok(_), Some(since)) = (&granted, since) {
            let waited = since.elapsed().as_secs_f64();
            t.shared.lanes[t.info.lane].metrics.queue_wait.record(waited);
        }
        let executed = match granted {
            Err(failed) => Err(failed),
            Ok((slot, permit)) => {
                let executed = match t.audit(AuditKind::Started).await {
                    Err(err) => Err((Stage::Start, Reason::Audit, Some(err))),
                    Ok(()) => execute(&t, job, permit).await,
                };
                t.shared.release_execution(t.info.lane, slot);
                executed
            }
        };

        // Terminal audit, before the finalizer. A run whose start audit failed gets none.
        let outcome = match executed {
            Ok(value) => match t.audit(AuditKind::Completed).await {
                Ok(()) => Ok(value),
                Err(err) => Err(t.failure(Stage::Terminal, Reason::Audit, Some(err))),
            },
            Err((stage, reason, cause)) => {
                let fail = t.failure(stage, reason, cause);
                if stage != Stage::Start
                    && let Err(err) = t.audit(AuditKind::Failed { stage, reason }).await
                {
                    fail.attach(Stage::Terminal, err);
                }
                Err(fail)
            }
        };

        // Finalizer: exactly once, independent of the caller, bounded.
        let primary = outcome.as_ref().err().cloned();
        let limit = t.shared.finalization_timeout;
        let finalized =
            bounded(Stage::Finalization, limit, call_contained(|| finalizer.finalize(outcome)))
                .await;
        let mut result = match (primary, finalized) {
            (None, Ok(value)) => Ok(value),
            (None, Err(err)) => Err(t.failure(Stage::Finalization, Reason::Finalizer, Some(err))),
            (Some(fail), Ok(_)) => Err(fail),
            (Some(fail), Err(err)) => {
                // A finalizer that passes the failure on has not failed itself.
                let same =
                    err.downcast_ref::<RunFailure>().is_some_and(|e| RunFailure::ptr_eq(e, &fail));
                if !same {
                    fail.attach(Stage::Finalization, err);
                }
                Err(fail)
            }
        };

        // Cleanup, then ownership goes back.
        if let Some(cleanup) = cleanup {
            let limit = t.shared.audit_timeout;
            if let Err(err) = bounded(Stage::Cleanup, limit, call_contained(cleanup)).await {
                match &result {
                    Err(fail) => fail.attach(Stage::Cleanup, err),
                    Ok(_) => result = Err(t.failure(Stage::Cleanup, Reason::Cleanup, Some(err))),
                }
            }
        }
        t.shared.complete(t.info.lane, result.as_ref().err().map(RunFailure::reason));
        result
    }
}

/// Waits in the queue until granted (answering the execution slot), or fails with the stage and
/// reason of the queue failure.
async fn await_grant(t: &Ticket, seq: u64, deadline: Option<Instant>) -> Result<usize, Failed> {
    enum Woke {
        Decided(Decision),
        Cancelled(Reason),
    }
    let signal = &t.signal;
    let mut deadline = Deadline::new(deadline);
    let woke = poll_fn(|cx| {
        let decided = signal.poll_driver(cx, |s| match s.grant_state() {
            Decision::Waiting => s.cancel_reason().map(Woke::Cancelled),
            decided => Some(Woke::Decided(decided)),
        });
        if decided.is_ready() {
            return decided;
        }
        deadline.poll_elapsed(cx).map(|()| Woke::Cancelled(Reason::Timeout))
    })
    .await;
    let shut_failure = |why: Shut| match why {
        Shut::Closed => Err((Stage::Queue, Reason::Closed, None)),
        Shut::Poisoned => Err((Stage::Queue, Reason::Poisoned, t.shared.poison_error())),
    };
    let reason = match woke {
        Woke::Decided(Decision::Granted(slot)) => return Ok(slot),
        Woke::Decided(Decision::Shut(why)) => return shut_failure(why),
        Woke::Decided(Decision::Waiting) => unreachable!("only decisions wake the queue wait"),
        Woke::Cancelled(reason) => reason,
    };
    let cause = match (reason, t.queue_timeout) {
        (Reason::Timeout, Some(limit)) => {
            Some(Box::new(TimeoutError::new(Stage::Queue, limit)) as BoxError)
        }
        _ => None,
    };
    // Leave the queue, unless the lane decided first: the grant latch is only set under the
    // lane lock, so it is final while we hold it.
    let lane = &t.shared.lanes[t.info.lane];
    let mut core = lock(&lane.core);
    if core.withdraw(seq) {
        lane.publish(&core);
        return Err((Stage::Queue, reason, cause));
    }
    match signal.grant_state() {
        Decision::Shut(why) => shut_failure(why),
        // Granted at the same time: give the slot back, the job never started.
        Decision::Granted(slot) => {
            core.release_execution(slot, grant);
            lane.publish(&core);
            Err((Stage::Queue, reason, cause))
        }
        Decision::Waiting => unreachable!("a run out of the queue was granted or shut"),
    }
}

/// Waits for the run's permit holding no execution slot (the fusee rule: a run that waits on a
/// limit holds nothing a runnable job could use), then for a slot in readiness order, holding
/// the permit. Fails like a queued run: at [`Stage::Queue`], on close, cancellation, the queue
/// timeout, or a refusal of the limit ([`Reason::Limit`]).
async fn await_permit(
    t: &Ticket,
    seq: u64,
    deadline: Option<Instant>,
) -> Result<(usize, Option<Permit>), Failed> {
    enum Woke {
        Permit(Result<Permit, crate::limit::LimitError>),
        Shut(Shut),
        Cancelled(Reason),
    }
    let limit = t.limit.as_ref().expect("a limited run names a limit");
    let lane = &t.shared.lanes[t.info.lane];
    let shut_failure = |why: Shut| match why {
        Shut::Closed => Err((Stage::Queue, Reason::Closed, None)),
        Shut::Poisoned => Err((Stage::Queue, Reason::Poisoned, t.shared.poison_error())),
    };
    let woke = {
        // Boxed: most runs name no limit, and their state machine stays small.
        let mut acquire = Box::pin(limit.acquire());
        let signal = &t.signal;
        let mut timer = Deadline::new(deadline);
        poll_fn(|cx| {
            if let Poll::Ready(acquired) = acquire.as_mut().poll(cx) {
                return Poll::Ready(Woke::Permit(acquired));
            }
            let stopped = signal.poll_driver(cx, |s| match s.grant_state() {
                Decision::Shut(why) => Some(Woke::Shut(why)),
                _ => s.cancel_reason().map(Woke::Cancelled),
            });
            if stopped.is_ready() {
                return stopped;
            }
            timer.poll_elapsed(cx).map(|()| Woke::Cancelled(Reason::Timeout))
        })
        .await
        // The acquire future is dropped here: an unfinished wait withdraws its ticket.
    };
    let (reason, cause) = match woke {
        Woke::Permit(Ok(permit)) => {
            let ready = {
                let mut core = lock(&lane.core);
                let ready = core.ready(seq);
                lane.publish(&core);
                ready
            };
            return match ready {
                Some(Admitted::Executing { slot, .. }) => Ok((slot, Some(permit))),
                Some(Admitted::Queued { seq }) => {
                    await_grant(t, seq, deadline).await.map(|slot| (slot, Some(permit)))
                }
                Some(Admitted::Limited { .. }) => unreachable!("a ready run is not limited"),
                // Detached by a shut while the permit was being granted.
                None => match t.signal.grant_state() {
                    Decision::Shut(why) => shut_failure(why),
                    _ => unreachable!("only a shut detaches a limited run"),
                },
            };
        }
        Woke::Permit(Err(err)) => (Reason::Limit, Some(Box::new(err) as BoxError)),
        Woke::Shut(why) => return shut_failure(why),
        Woke::Cancelled(reason) => {
            let cause = match (reason, t.queue_timeout) {
                (Reason::Timeout, Some(limit)) => {
                    Some(Box::new(TimeoutError::new(Stage::Queue, limit)) as BoxError)
                }
                _ => None,
            };
            (reason, cause)
        }
    };
    let mut core = lock(&lane.core);
    if core.withdraw_limited(seq) {
        lane.publish(&core);
        return Err((Stage::Queue, reason, cause));
    }
    match t.signal.grant_state() {
        Decision::Shut(why) => shut_failure(why),
        _ => unreachable!("only a shut detaches a limited run"),
    }
}

/// Runs the job until it ends, or until it is cancelled and then ends within the drain timeout.
/// A job that outlives the drain timeout poisons the set and is dropped.
async fn execute<J: Job>(t: &Ticket, job: J, permit: Option<Permit>) -> Result<J::Output, Failed> {
    let panicked = || {
        let cause = Box::new(PanicError::new(Stage::Execution)) as BoxError;
        Err((Stage::Execution, Reason::Panic, Some(cause)))
    };
    // The execution clock starts at grant (the run's permit, if any, is held already).
    let mut deadline = Deadline::new(t.execution_timeout.map(|limit| Instant::now() + limit));
    // Dropped when this function returns: after the job, before the finalizer.
    let _permit = permit;
    let cx = RunContext {
        run_id: t.info.run_id,
        lane: t.lane_name(),
        participation: t.info.participation,
        signal: t.signal.clone(),
    };
    let Ok(fut) = call_contained(|| job.start(cx)) else {
        return panicked();
    };
    let mut fut = pin!(CatchUnwind::new(fut));
    let signal = &t.signal;
    enum Woke<T> {
        Ended(T),
        Cancelled(Reason),
    }
    let woke = poll_fn(|cx| {
        if let Poll::Ready(ended) = fut.as_mut().poll(cx) {
            return Poll::Ready(Woke::Ended(ended));
        }
        if let Poll::Ready(reason) = signal.poll_driver(cx, RunSignal::cancel_reason) {
            return Poll::Ready(Woke::Cancelled(reason));
        }
        deadline.poll_elapsed(cx).map(|()| {
            signal.cancel(Reason::Timeout);
            Woke::Cancelled(signal.cancel_reason().unwrap_or(Reason::Timeout))
        })
    })
    .await;
    let (reason, ended) = match woke {
        Woke::Ended(ended) => match signal.cancel_reason() {
            None => {
                return match ended {
                    Ok(Ok(value)) => Ok(value),
                    Ok(Err(err)) => Err((Stage::Execution, Reason::Job, Some(err.into()))),
                    Err(Panicked) => panicked(),
                };
            }
            // A job that ends because it was cancelled, even successfully, did not succeed.
            Some(reason) => (reason, Some(ended)),
        },
        Woke::Cancelled(reason) => (reason, None),
    };
    // Cancelled: the job gets `worker_drain_timeout` to notice. Whatever it returns now, the run
    // failed with the cancellation's reason.
    let ended = match ended {
        Some(ended) => ended,
        None => match Box::pin(timeout(t.shared.worker_drain_timeout, &mut fut)).await {
            Ok(ended) => ended,
            Err(_elapsed) => {
                t.shared.poison(t.info.run_id);
                let cause = Box::new(PoisonError::new(t.info.run_id));
                return Err((Stage::Execution, Reason::Poisoned, Some(cause)));
            }
        },
    };
    let cause = match (reason, t.execution_timeout) {
        (Reason::Timeout, Some(limit)) => {
            Some(Box::new(TimeoutError::new(Stage::Execution, limit)) as BoxError)
        }
        (Reason::Poisoned, _) => t.shared.poison_error(),
        _ => match ended {
            Ok(Err(err)) => Some(err.into()),
            Err(Panicked) => Some(Box::new(PanicError::new(Stage::Execution)) as BoxError),
            Ok(Ok(_)) => None,
        },
    };
    Err((Stage::Execution, reason, cause))
}

/// An optional deadline. Its timer is allocated only if there is one, so that runs without
/// timeouts keep a small future.
struct Deadline(Option<Pin<Box<Sleep>>>);

impl Deadline {
    fn new(at: Option<Instant>) -> Self {
        Self(at.map(|at| Box::pin(sleep_until(at))))
    }

    /// `Ready` once the deadline has passed; never without one.
    fn poll_elapsed(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        match &mut self.0 {
            Some(sleep) => sleep.as_mut().poll(cx),
            None => Poll::Pending,
        }
    }
}

/// A run lane's [`close`](LaneSet::close) already fails queued runs and cancels executing jobs,
/// so its `abort` is its `close`.
impl crate::Lifecycle for LaneSet {
    type Snapshot = LaneSetSnapshot;

    fn close(&self) {
        LaneSet::close(self);
    }

    fn is_closed(&self) -> bool {
        LaneSet::is_closed(self)
    }

    fn drained(&self) -> crate::BoxFuture<'_, ()> {
        Box::pin(LaneSet::drained(self))
    }

    fn abort(&self) {
        LaneSet::close(self);
    }

    fn snapshot(&self) -> LaneSetSnapshot {
        LaneSet::snapshot(self)
    }
}
