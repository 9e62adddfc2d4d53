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
use std::future::{Future, pending};
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::{Instant, sleep_until, timeout};

use super::audit::{Audit, AuditEvent, AuditKind};
use super::config::{ConfigError, LaneLimits, LaneSetBuilder};
use super::error::{
    AdmissionError, AdmissionErrorKind, PanicError, PoisonError, Reason, RunFailure, Stage,
    TimeoutError,
};
use super::run::{Finalize, Job, Participation, Run, RunContext, RunHandle, RunId};
use super::signal::{Grant, RunSignal};
use super::snapshot::{LaneSetSnapshot, LaneSnapshot, SetState};
use super::state::{Admitted, LaneCore, Shut};
use crate::BoxError;
use crate::registry::{Snapshot, Source};
use crate::util::{CatchUnwind, Panicked, call_contained, lock};

const OPEN: u8 = 0;
const CLOSED: u8 = 1;
const POISONED: u8 = 2;

struct LaneShared {
    name: Arc<str>,
    limits: LaneLimits,
    core: Mutex<LaneCore<Arc<RunSignal>>>,
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
        let lanes = builder
            .lanes
            .into_iter()
            .map(|(name, limits)| LaneShared {
                name: name.into(),
                limits,
                core: Mutex::new(LaneCore::new(limits)),
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
            let source: Arc<dyn Source> = shared.clone();
            registry.register(name, Arc::downgrade(&source))?;
        }
        Ok(Self { shared })
    }

    /// The lane called `name`.
    pub fn lane(&self, name: &str) -> Option<Lane> {
        self.shared.index_of(name).map(|index| Lane {
            shared: self.shared.clone(),
            index,
        })
    }

    /// The lanes' names, in configuration order.
    pub fn lane_names(&self) -> impl Iterator<Item = &str> {
        self.shared.lanes.iter().map(|lane| &*lane.name)
    }

    /// Admits `run` into lane `lane` with blocking participation: the returned handle resolves
    /// to the run's result once its finalizer and cleanup have finished.
    ///
    /// Admission never waits: the run is queued or starts at once, or is refused.
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
            Some(index) => admit_blocking(&self.shared, index, run),
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
            Some(index) => admit_background(&self.shared, index, run),
            None => Err(unknown_lane(lane, Participation::Background, run)),
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
        admit_blocking(&self.shared, self.index, run)
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
        admit_background(&self.shared, self.index, run)
    }

    /// The lane, as it is now.
    pub fn snapshot(&self) -> LaneSnapshot {
        self.shared.lane_snapshot(self.index)
    }
}

impl fmt::Debug for Lane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lane")
            .field("name", &self.name())
            .field("limits", &self.limits())
            .finish()
    }
}

fn unknown_lane<R>(lane: &str, participation: Participation, run: R) -> AdmissionError<R> {
    AdmissionError::new(AdmissionErrorKind::UnknownLane, lane, participation, run)
}

fn admit_blocking<J, F>(
    shared: &Arc<SetShared>,
    index: usize,
    run: Run<J, F>,
) -> Result<RunHandle<F::Output>, AdmissionError<Run<J, F>>>
where
    J: Job,
    F: Finalize<J::Output>,
{
    let ticket = shared.admit(index, Participation::Blocking, run)?;
    let (run_id, signal) = (ticket.run_id, ticket.signal.clone());
    let join = tokio::spawn(drive(shared.clone(), ticket));
    Ok(RunHandle {
        run_id,
        lane: shared.lanes[index].name.clone(),
        join,
        signal,
        finished: false,
    })
}

fn admit_background<J, F>(
    shared: &Arc<SetShared>,
    index: usize,
    run: Run<J, F>,
) -> Result<RunId, AdmissionError<Run<J, F>>>
where
    J: Job,
    F: Finalize<J::Output>,
{
    let ticket = shared.admit(index, Participation::Background, run)?;
    let run_id = ticket.run_id;
    drop(tokio::spawn(drive(shared.clone(), ticket)));
    Ok(run_id)
}

/// An admitted run, on its way to its driver task.
struct Ticket<J, F> {
    lane: usize,
    seq: u64,
    run_id: RunId,
    participation: Participation,
    /// `None` if the run was granted at admission, else when it started waiting.
    queued_since: Option<Instant>,
    signal: Arc<RunSignal>,
    run: Run<J, F>,
}

impl SetShared {
    fn index_of(&self, name: &str) -> Option<usize> {
        self.lanes.iter().position(|lane| &*lane.name == name)
    }

    fn admit<J, F>(
        &self,
        index: usize,
        participation: Participation,
        run: Run<J, F>,
    ) -> Result<Ticket<J, F>, AdmissionError<Run<J, F>>> {
        let lane = &self.lanes[index];
        let admitted = {
            let mut core = lock(&lane.core);
            core.admit(|_| Arc::new(RunSignal::new()))
                .map(|(admitted, signal)| {
                    // Counted under the lane lock (invariant 3); ids increase in admission order.
                    self.owned.fetch_add(1, Ordering::AcqRel);
                    let run_id = RunId::new(self.next_run_id.fetch_add(1, Ordering::Relaxed) + 1);
                    (admitted, signal, run_id)
                })
        };
        match admitted {
            Ok((admitted, signal, run_id)) => {
                let (seq, queued_since) = match admitted {
                    Admitted::Executing(seq) => (seq, None),
                    Admitted::Queued(seq) => (seq, Some(Instant::now())),
                };
                Ok(Ticket {
                    lane: index,
                    seq,
                    run_id,
                    participation,
                    queued_since,
                    signal,
                    run,
                })
            }
            Err(kind) => Err(AdmissionError::new(kind, &lane.name, participation, run)),
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
        }
        self.shut_done.store(true, Ordering::Release);
        self.drained.notify_waiters();
    }

    fn poison(&self, by: RunId) {
        let _ = self.poisoned_by.set(by);
        self.shut(Shut::Poisoned);
    }

    fn poison_error(&self) -> Option<BoxError> {
        self.poisoned_by
            .get()
            .map(|by| Box::new(PoisonError::new(*by)) as BoxError)
    }

    /// Gives a run's execution slot back; the next queued run is granted.
    fn release_execution(&self, lane: usize, seq: u64) {
        lock(&self.lanes[lane].core).release_execution(seq, |_, signal| signal.grant());
    }

    /// Gives a run's ownership back (the run is over).
    fn complete(&self, lane: usize, failure: Option<Reason>) {
        lock(&self.lanes[lane].core).complete(failure);
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
            lanes: (0..self.lanes.len())
                .map(|index| self.lane_snapshot(index))
                .collect(),
        }
    }

    /// Records an audit event, bounded by `audit_timeout`. `Ok` without a hook.
    async fn audit(&self, ticket: &TicketInfo, kind: AuditKind) -> Result<(), BoxError> {
        let Some(audit) = &self.audit else {
            return Ok(());
        };
        let event = AuditEvent {
            run_id: ticket.run_id,
            lane: self.lanes[ticket.lane].name.clone(),
            participation: ticket.participation,
            kind,
        };
        let stage = match kind {
            AuditKind::Started => Stage::Start,
            _ => Stage::Terminal,
        };
        bounded(
            stage,
            self.audit_timeout,
            call_contained(|| audit.record(event)),
        )
        .await
    }
}

impl Source for SetShared {
    fn report(&self, name: &str, snapshot: &mut Snapshot) {
        snapshot.lane_sets.insert(name.to_owned(), self.snapshot());
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
    match timeout(limit, CatchUnwind::new(fut)).await {
        Ok(Ok(Ok(value))) => Ok(value),
        Ok(Ok(Err(err))) => Err(err.into()),
        Ok(Err(Panicked)) => Err(Box::new(PanicError::new(stage))),
        Err(_elapsed) => Err(Box::new(TimeoutError::new(stage, limit))),
    }
}

/// The identity of a run, without its job and finalizer.
#[derive(Clone, Copy)]
struct TicketInfo {
    lane: usize,
    seq: u64,
    run_id: RunId,
    participation: Participation,
}

/// Where and why a run failed before its finalizer, and the cause.
type Failed = (Stage, Reason, Option<BoxError>);

/// Drives one run from admission to the end of its cleanup (invariant 1).
async fn drive<J, F>(shared: Arc<SetShared>, ticket: Ticket<J, F>) -> Result<F::Output, RunFailure>
where
    J: Job,
    F: Finalize<J::Output>,
{
    let Ticket {
        lane,
        seq,
        run_id,
        participation,
        queued_since,
        signal,
        run,
    } = ticket;
    let info = TicketInfo {
        lane,
        seq,
        run_id,
        participation,
    };
    let Run {
        job,
        finalizer,
        cleanup,
        queue_timeout,
        execution_timeout,
    } = run;
    let lane_name = shared.lanes[lane].name.clone();
    let failure = |stage, reason, cause| {
        RunFailure::new(
            run_id,
            lane_name.clone(),
            participation,
            stage,
            reason,
            cause,
        )
    };

    // Queue, start audit and execution; the execution slot goes back before anything else.
    let executed = match queued_since {
        None => Ok(()),
        Some(since) => await_grant(&shared, info, &signal, since, queue_timeout).await,
    };
    let executed = match executed {
        Err(failed) => Err(failed),
        Ok(()) => {
            let executed = match shared.audit(&info, AuditKind::Started).await {
                Err(err) => Err((Stage::Start, Reason::Audit, Some(err))),
                Ok(()) => {
                    let queue_wait = queued_since.map_or(Duration::ZERO, |since| since.elapsed());
                    let cx = RunContext {
                        run_id,
                        lane: lane_name.clone(),
                        participation,
                        queue_wait,
                        signal: signal.clone(),
                    };
                    execute(&shared, info, &signal, job, cx, execution_timeout).await
                }
            };
            shared.release_execution(lane, seq);
            executed
        }
    };

    // Terminal audit, before the finalizer. A run whose start audit failed gets none.
    let outcome = match executed {
        Ok(value) => match shared.audit(&info, AuditKind::Completed).await {
            Ok(()) => Ok(value),
            Err(err) => Err(failure(Stage::Terminal, Reason::Audit, Some(err))),
        },
        Err((stage, reason, cause)) => {
            let fail = failure(stage, reason, cause);
            if stage != Stage::Start {
                let kind = AuditKind::Failed { stage, reason };
                if let Err(err) = shared.audit(&info, kind).await {
                    fail.attach(Stage::Terminal, err);
                }
            }
            Err(fail)
        }
    };

    // Finalizer: exactly once, independent of the caller, bounded.
    let primary_failure = outcome.as_ref().err().cloned();
    let finalized = bounded(
        Stage::Finalization,
        shared.finalization_timeout,
        call_contained(|| finalizer.finalize(outcome)),
    )
    .await;
    let mut result = match (primary_failure, finalized) {
        (None, Ok(value)) => Ok(value),
        (None, Err(err)) => Err(failure(Stage::Finalization, Reason::Finalizer, Some(err))),
        (Some(fail), Ok(_)) => Err(fail),
        (Some(fail), Err(err)) => {
            // A finalizer that passes the failure on has not failed itself.
            let same = err
                .downcast_ref::<RunFailure>()
                .is_some_and(|e| RunFailure::ptr_eq(e, &fail));
            if !same {
                fail.attach(Stage::Finalization, err);
            }
            Err(fail)
        }
    };

    // Cleanup, then ownership goes back.
    let cleaned = match cleanup {
        Some(cleanup) => {
            bounded(
                Stage::Cleanup,
                shared.audit_timeout,
                call_contained(cleanup),
            )
            .await
        }
        None => Ok(()),
    };
    if let Err(err) = cleaned {
        match &result {
            Err(fail) => fail.attach(Stage::Cleanup, err),
            Ok(_) => result = Err(failure(Stage::Cleanup, Reason::Cleanup, Some(err))),
        }
    }
    shared.complete(lane, result.as_ref().err().map(RunFailure::reason));
    result
}

/// Waits in the queue until granted, or fails with the stage/reason of the queue failure.
async fn await_grant(
    shared: &SetShared,
    info: TicketInfo,
    signal: &RunSignal,
    since: Instant,
    queue_timeout: Option<Duration>,
) -> Result<(), Failed> {
    enum Woke {
        Decided(Grant),
        Cancelled(Reason),
    }
    let deadline = queue_timeout.map(|limit| since + limit);
    let woke = tokio::select! {
        biased;
        woke = signal.wait_for(|s| match s.grant_state() {
            Grant::Waiting => s.cancel_reason().map(Woke::Cancelled),
            decided => Some(Woke::Decided(decided)),
        }) => woke,
        () = sleep_or_pending(deadline) => Woke::Cancelled(Reason::Timeout),
    };
    let shut_failure = |why: Shut| match why {
        Shut::Closed => Err((Stage::Queue, Reason::Closed, None)),
        Shut::Poisoned => Err((Stage::Queue, Reason::Poisoned, shared.poison_error())),
    };
    let reason = match woke {
        Woke::Decided(Grant::Granted) => return Ok(()),
        Woke::Decided(Grant::Shut(why)) => return shut_failure(why),
        Woke::Decided(Grant::Waiting) => unreachable!("wait_for only returns decisions"),
        Woke::Cancelled(reason) => reason,
    };
    let cause = match (reason, queue_timeout) {
        (Reason::Timeout, Some(limit)) => {
            Some(Box::new(TimeoutError::new(Stage::Queue, limit)) as BoxError)
        }
        _ => None,
    };
    // Leave the queue, unless the lane decided first: the grant latch is only set under the
    // lane lock, so it is final while we hold it.
    let mut core = lock(&shared.lanes[info.lane].core);
    if core.withdraw(info.seq) {
        return Err((Stage::Queue, reason, cause));
    }
    match signal.grant_state() {
        Grant::Shut(why) => shut_failure(why),
        // Granted at the same time: give the slot back, the job never started.
        _ => {
            core.release_execution(info.seq, |_, next| next.grant());
            Err((Stage::Queue, reason, cause))
        }
    }
}

/// Runs the job until it ends, or until it is cancelled and then ends within the drain timeout.
/// A job that outlives the drain timeout poisons the set and is dropped.
async fn execute<J: Job>(
    shared: &SetShared,
    info: TicketInfo,
    signal: &RunSignal,
    job: J,
    cx: RunContext,
    execution_timeout: Option<Duration>,
) -> Result<J::Output, Failed> {
    let panicked = || {
        Err((
            Stage::Execution,
            Reason::Panic,
            Some(Box::new(PanicError::new(Stage::Execution)) as BoxError),
        ))
    };
    let Ok(fut) = call_contained(|| job.start(cx)) else {
        return panicked();
    };
    let mut fut = pin!(CatchUnwind::new(fut));
    let deadline = execution_timeout.map(|limit| Instant::now() + limit);
    let (reason, ended) = tokio::select! {
        biased;
        ended = &mut fut => match signal.cancel_reason() {
            None => return match ended {
                Ok(Ok(value)) => Ok(value),
                Ok(Err(err)) => Err((Stage::Execution, Reason::Job, Some(err.into()))),
                Err(Panicked) => panicked(),
            },
            // A job that ends because it was cancelled, even successfully, did not succeed.
            Some(reason) => (reason, Some(ended)),
        },
        reason = signal.cancelled() => (reason, None),
        () = sleep_or_pending(deadline) => {
            signal.cancel(Reason::Timeout);
            (signal.cancel_reason().unwrap_or(Reason::Timeout), None)
        }
    };
    // Cancelled: the job gets `worker_drain_timeout` to notice. Whatever it returns now, the run
    // failed with the cancellation's reason.
    let ended = match ended {
        Some(ended) => ended,
        None => match timeout(shared.worker_drain_timeout, &mut fut).await {
            Ok(ended) => ended,
            Err(_elapsed) => {
                shared.poison(info.run_id);
                let cause = Box::new(PoisonError::new(info.run_id));
                return Err((Stage::Execution, Reason::Poisoned, Some(cause)));
            }
        },
    };
    let cause = match (reason, execution_timeout) {
        (Reason::Timeout, Some(limit)) => {
            Some(Box::new(TimeoutError::new(Stage::Execution, limit)) as BoxError)
        }
        (Reason::Poisoned, _) => shared.poison_error(),
        _ => match ended {
            Ok(Err(err)) => Some(err.into()),
            Err(Panicked) => Some(Box::new(PanicError::new(Stage::Execution)) as BoxError),
            Ok(Ok(_)) => None,
        },
    };
    Err((Stage::Execution, reason, cause))
}

async fn sleep_or_pending(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => sleep_until(deadline).await,
        None => pending().await,
    }
}
