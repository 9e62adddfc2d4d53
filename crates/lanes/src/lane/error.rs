//! Errors of run lanes: admission (no run id, no finalizer) and run failures (owned runs).

use std::borrow::Cow;
use std::error::Error;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sync_wrapper::SyncWrapper;

use super::run::{Participation, RunId};
use crate::BoxError;

/// Why an admission was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum AdmissionErrorKind {
    /// The lane owns `concurrent + queued` runs already.
    Full,
    /// The set was closed.
    Closed,
    /// The set was poisoned by a job that ignored cancellation.
    Poisoned,
    /// The set has no lane of that name.
    UnknownLane,
}

impl AdmissionErrorKind {
    /// The lowercase name used in snapshots and messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Full => "full",
            Self::Closed => "closed",
            Self::Poisoned => "poisoned",
            Self::UnknownLane => "unknown lane",
        }
    }
}

/// A run was not admitted. Nothing was started: there is no [`RunId`], no finalizer call and no
/// audit event. The run is handed back.
///
/// The error is `Send + Sync` whenever the run is `Send` (the run is only reachable by value),
/// so `?` converts it into a [`BoxError`].
pub struct AdmissionError<R> {
    kind: AdmissionErrorKind,
    /// A configured lane's interned name, or the unknown name asked for.
    lane: Cow<'static, str>,
    participation: Participation,
    run: SyncWrapper<R>,
}

impl<R> AdmissionError<R> {
    pub(crate) fn new(
        kind: AdmissionErrorKind,
        lane: impl Into<Cow<'static, str>>,
        participation: Participation,
        run: R,
    ) -> Self {
        Self { kind, lane: lane.into(), participation, run: SyncWrapper::new(run) }
    }

    /// Why the run was refused.
    pub fn kind(&self) -> AdmissionErrorKind {
        self.kind
    }

    /// The lane that refused it.
    pub fn lane(&self) -> &str {
        &self.lane
    }

    /// How the caller asked to participate.
    pub fn participation(&self) -> Participation {
        self.participation
    }

    /// The lane was full.
    pub fn is_full(&self) -> bool {
        self.kind == AdmissionErrorKind::Full
    }

    /// The set was closed.
    pub fn is_closed(&self) -> bool {
        self.kind == AdmissionErrorKind::Closed
    }

    /// The set was poisoned.
    pub fn is_poisoned(&self) -> bool {
        self.kind == AdmissionErrorKind::Poisoned
    }

    /// Gives the refused run back.
    pub fn into_run(self) -> R {
        self.run.into_inner()
    }

    /// Gives the refused run back: the name every refusal in the crate uses
    /// ([`into_run`](Self::into_run) by another name).
    pub fn into_inner(self) -> R {
        self.into_run()
    }

    /// Drops the run, keeping the rest of the error (for example to box it).
    pub fn without_run(self) -> AdmissionError<()> {
        AdmissionError {
            kind: self.kind,
            lane: self.lane,
            participation: self.participation,
            run: SyncWrapper::new(()),
        }
    }
}

impl<R> fmt::Debug for AdmissionError<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdmissionError")
            .field("kind", &self.kind)
            .field("lane", &self.lane)
            .field("participation", &self.participation)
            .finish_non_exhaustive()
    }
}

impl<R> fmt::Display for AdmissionError<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "lane {:?} refused a run: {}", self.lane, self.kind.as_str())
    }
}

impl<R> Error for AdmissionError<R> {}

/// Where in its life a run failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Stage {
    /// Waiting for an execution slot.
    Queue,
    /// Recording the `started` audit event, before the job.
    Start,
    /// Running the job.
    Execution,
    /// Recording the terminal audit event.
    Terminal,
    /// Running the finalizer.
    Finalization,
    /// Running the run's cleanup.
    Cleanup,
}

impl Stage {
    /// The lowercase name used in snapshots and messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queue => "queue",
            Self::Start => "start",
            Self::Execution => "execution",
            Self::Terminal => "terminal",
            Self::Finalization => "finalization",
            Self::Cleanup => "cleanup",
        }
    }
}

/// Why an owned run failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Reason {
    /// The caller dropped its [`RunHandle`](super::RunHandle).
    Canceled,
    /// The queue timeout or the execution timeout elapsed.
    Timeout,
    /// The set was closed.
    Closed,
    /// The set was poisoned (by this run or another one).
    Poisoned,
    /// The job returned an error.
    Job,
    /// The job panicked.
    Panic,
    /// An audit call failed or timed out.
    Audit,
    /// The finalizer failed, panicked or timed out on a successful run.
    Finalizer,
    /// The cleanup failed, panicked or timed out on an otherwise successful run.
    Cleanup,
    /// The run's limit refused it (unknown limit, too many waiters, backend failure).
    Limit,
}

impl Reason {
    /// The lowercase name used in snapshots and messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Canceled => "canceled",
            Self::Timeout => "timeout",
            Self::Closed => "closed",
            Self::Poisoned => "poisoned",
            Self::Job => "job",
            Self::Panic => "panic",
            Self::Audit => "audit",
            Self::Finalizer => "finalizer",
            Self::Cleanup => "cleanup",
            Self::Limit => "limit",
        }
    }
}

/// A callback (job, finalizer, audit hook, cleanup) panicked. The panic payload was discarded
/// unread: it can carry user data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PanicError {
    stage: Stage,
}

impl PanicError {
    pub(crate) fn new(stage: Stage) -> Self {
        Self { stage }
    }

    /// The stage whose callback panicked.
    pub fn stage(&self) -> Stage {
        self.stage
    }
}

impl fmt::Display for PanicError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "callback panicked during {}", self.stage.as_str())
    }
}

impl Error for PanicError {}

/// A bounded step did not finish in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimeoutError {
    stage: Stage,
    after: Duration,
}

impl TimeoutError {
    pub(crate) fn new(stage: Stage, after: Duration) -> Self {
        Self { stage, after }
    }

    /// The stage that timed out.
    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// The bound that elapsed.
    pub fn after(&self) -> Duration {
        self.after
    }
}

impl fmt::Display for TimeoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} timed out after {:?}", self.stage.as_str(), self.after)
    }
}

impl Error for TimeoutError {}

/// The set was poisoned: run `by` ignored cancellation for longer than `worker_drain_timeout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoisonError {
    by: RunId,
}

impl PoisonError {
    pub(crate) fn new(by: RunId) -> Self {
        Self { by }
    }

    /// The run whose job ignored cancellation.
    pub fn by(&self) -> RunId {
        self.by
    }
}

impl fmt::Display for PoisonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "lane set poisoned: {} ignored cancellation", self.by)
    }
}

impl Error for PoisonError {}

/// A secondary failure (terminal audit, finalizer, cleanup) attached to a run's primary failure.
///
/// Its [`source`](Error::source) is the next attached failure if there is one, else its own
/// cause; [`cause`](AttachedError::cause) always gives its own cause.
#[derive(Clone)]
pub struct AttachedError {
    stage: Stage,
    cause: Arc<dyn Error + Send + Sync>,
    next: Option<Box<AttachedError>>,
}

impl AttachedError {
    /// The stage that failed: [`Stage::Terminal`], [`Stage::Finalization`] or [`Stage::Cleanup`].
    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// What went wrong.
    pub fn cause(&self) -> &(dyn Error + Send + Sync + 'static) {
        &*self.cause
    }
}

impl fmt::Debug for AttachedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AttachedError")
            .field("stage", &self.stage)
            .field("cause", &self.cause)
            .field("next", &self.next)
            .finish()
    }
}

impl fmt::Display for AttachedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} also failed", self.stage.as_str())
    }
}

impl Error for AttachedError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        match &self.next {
            Some(next) => Some(&**next),
            None => Some(&*self.cause),
        }
    }
}

struct FailureInner {
    run_id: RunId,
    lane: Arc<str>,
    participation: Participation,
    stage: Stage,
    reason: Reason,
    cause: Option<BoxError>,
}

/// Why an owned run did not succeed.
///
/// Cheap to clone: the finalizer and the caller hold the *same* failure
/// ([`RunFailure::ptr_eq`]). Secondary failures that happen after the finalizer saw it (the
/// finalizer's own error, a cleanup error) are attached to the caller's, never replacing it;
/// the finalizer's copy keeps the attachments it was given (so a finalizer's error that holds
/// that copy, as `?` into an error of its own does, never makes the failure contain itself).
///
/// Messages are constant and content-free: no job output, no panic payload, no cause text.
/// Read the cause with [`cause`](RunFailure::cause) or through [`source`](Error::source).
///
/// # Source chain
///
/// `source()` yields the attached failures in the order they happened (terminal audit,
/// finalizer, cleanup), then the last one's cause; with nothing attached it yields the primary
/// cause.
#[derive(Clone)]
pub struct RunFailure {
    inner: Arc<FailureInner>,
    /// This copy's secondary failures, oldest first: a copy's own, not shared through `inner`.
    attached: Option<Box<AttachedError>>,
}

impl RunFailure {
    pub(crate) fn new(
        run_id: RunId,
        lane: Arc<str>,
        participation: Participation,
        stage: Stage,
        reason: Reason,
        cause: Option<BoxError>,
    ) -> Self {
        Self {
            inner: Arc::new(FailureInner { run_id, lane, participation, stage, reason, cause }),
            attached: None,
        }
    }

    /// Attaches a secondary failure at the end of this copy's chain.
    pub(crate) fn attach(&mut self, stage: Stage, cause: BoxError) {
        let mut slot = &mut self.attached;
        while let Some(existing) = slot {
            slot = &mut existing.next;
        }
        *slot = Some(Box::new(AttachedError { stage, cause: Arc::from(cause), next: None }));
    }

    /// The failed run.
    pub fn run_id(&self) -> RunId {
        self.inner.run_id
    }

    /// The lane the run was owned by.
    pub fn lane(&self) -> &str {
        &self.inner.lane
    }

    /// Blocking (the caller awaited) or background (spawned).
    pub fn participation(&self) -> Participation {
        self.inner.participation
    }

    /// Where the run failed.
    pub fn stage(&self) -> Stage {
        self.inner.stage
    }

    /// Why the run failed.
    pub fn reason(&self) -> Reason {
        self.inner.reason
    }

    /// The run failed while waiting for an execution slot; its job never ran.
    pub fn is_queue_failure(&self) -> bool {
        self.inner.stage == Stage::Queue
    }

    /// The queue timeout or the execution timeout elapsed.
    pub fn is_timeout(&self) -> bool {
        self.inner.reason == Reason::Timeout
    }

    /// The primary cause: the job's error, a [`PanicError`], a [`TimeoutError`], a
    /// [`PoisonError`], or the failing audit / finalizer / cleanup error.
    pub fn cause(&self) -> Option<&(dyn Error + Send + Sync + 'static)> {
        self.inner.cause.as_deref()
    }

    /// The secondary failures attached so far, in the order they happened.
    pub fn attached(&self) -> impl Iterator<Item = &AttachedError> {
        std::iter::successors(self.attached.as_deref(), |a| a.next.as_deref())
    }

    /// The attached failure of `stage`, if any.
    pub fn attached_at(&self, stage: Stage) -> Option<&AttachedError> {
        self.attached().find(|a| a.stage == stage)
    }

    /// Whether two failures are the same one (the finalizer's and the caller's always are).
    pub fn ptr_eq(a: &Self, b: &Self) -> bool {
        Arc::ptr_eq(&a.inner, &b.inner)
    }
}

impl fmt::Debug for RunFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RunFailure")
            .field("run_id", &self.inner.run_id)
            .field("lane", &self.inner.lane)
            .field("participation", &self.inner.participation)
            .field("stage", &self.inner.stage)
            .field("reason", &self.inner.reason)
            .field("cause", &self.inner.cause)
            .field("attached", &self.attached)
            .finish()
    }
}

impl fmt::Display for RunFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} on lane {:?} failed in {}: {}",
            self.inner.run_id,
            self.inner.lane,
            self.inner.stage.as_str(),
            self.inner.reason.as_str()
        )
    }
}

impl Error for RunFailure {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        match &self.attached {
            Some(attached) => Some(&**attached),
            None => self.inner.cause.as_deref().map(|c| c as &(dyn Error + 'static)),
        }
    }
}
