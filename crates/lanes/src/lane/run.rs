//! A run: a job, a finalizer, an optional cleanup and per-run timeouts; its context and handle.

use std::fmt;
use std::future::{Future, Ready, ready};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;

use super::error::{Reason, RunFailure, Stage};
use super::signal::RunSignal;
use crate::limit::{Limits, Priority, Throttle};
use crate::{BoxError, BoxFuture};

/// Identifies an admitted run. Unique within its [`LaneSet`](super::LaneSet) and increasing in
/// admission order within a lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RunId(u64);

impl RunId {
    pub(crate) fn new(id: u64) -> Self {
        Self(id)
    }

    /// The numeric id.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "run {}", self.0)
    }
}

/// How the caller takes part in a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Participation {
    /// The caller awaits the run's [`RunHandle`]; dropping the handle cancels the run.
    Blocking,
    /// The run was spawned; only its finalizer sees the outcome.
    Background,
}

/// What a run's finalizer receives: the job's value, or why the run failed.
pub type Outcome<T> = Result<T, RunFailure>;

/// The async work of a run. Implemented for every `FnOnce(RunContext) -> impl Future<Output =
/// Result<T, E>>` with `E: Into<BoxError>`.
pub trait Job: Send + 'static {
    /// The job's value.
    type Output: Send + 'static;
    /// The job's error.
    type Error: Into<BoxError> + Send + 'static;
    /// The job's future.
    type Future: Future<Output = Result<Self::Output, Self::Error>> + Send + 'static;

    /// Starts the job. Called once the run holds an execution slot.
    fn start(self, cx: RunContext) -> Self::Future;
}

impl<F, Fut, T, E> Job for F
where
    F: FnOnce(RunContext) -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, E>> + Send + 'static,
    T: Send + 'static,
    E: Into<BoxError> + Send + 'static,
{
    type Output = T;
    type Error = E;
    type Future = Fut;

    fn start(self, cx: RunContext) -> Fut {
        self(cx)
    }
}

/// Receives a run's [`Outcome`] exactly once. Implemented for every `FnOnce(Outcome<T>) -> impl
/// Future<Output = Result<U, E>>` with `E: Into<BoxError>`; `U` is what a blocking caller
/// receives.
pub trait Finalize<T>: Send + 'static {
    /// What a blocking caller receives on success.
    type Output: Send + 'static;
    /// The finalizer's error.
    type Error: Into<BoxError> + Send + 'static;
    /// The finalizer's future.
    type Future: Future<Output = Result<Self::Output, Self::Error>> + Send + 'static;

    /// Consumes the outcome.
    fn finalize(self, outcome: Outcome<T>) -> Self::Future;
}

impl<F, Fut, T, U, E> Finalize<T> for F
where
    F: FnOnce(Outcome<T>) -> Fut + Send + 'static,
    Fut: Future<Output = Result<U, E>> + Send + 'static,
    U: Send + 'static,
    E: Into<BoxError> + Send + 'static,
{
    type Output = U;
    type Error = E;
    type Future = Fut;

    fn finalize(self, outcome: Outcome<T>) -> Fut {
        self(outcome)
    }
}

/// The default finalizer: hands the outcome to the caller unchanged.
#[derive(Debug, Clone, Copy, Default)]
pub struct Passthrough;

impl<T: Send + 'static> Finalize<T> for Passthrough {
    type Output = T;
    type Error = RunFailure;
    type Future = Ready<Outcome<T>>;

    fn finalize(self, outcome: Outcome<T>) -> Self::Future {
        ready(outcome)
    }
}

/// A run's cleanup, behind a thin pointer: one word in the callbacks an admitted run's drive
/// moves around, a null word written whole when there is none. As a (two-word)
/// `Box<dyn FnOnce>`, its `None` wrote only the data pointer, and a move that read it back as
/// part of a 16-byte load stalled on store forwarding, as the [`Timeout`]s did (when it sat in
/// [`Run`] itself, a refusal's move of the run did). A cleanup costs one more allocation for
/// it.
pub(crate) type Cleanup = Box<CleanupFn>;

/// What [`Cleanup`] points to.
type CleanupFn = Box<dyn FnOnce() -> BoxFuture<'static, Result<(), BoxError>> + Send>;

/// A unit of work for a lane: a job plus a finalizer that receives its outcome exactly once.
///
/// The finalizer runs after the job's execution slot was released, in a task independent of the
/// caller (dropping the caller's handle does not stop it), bounded by the set's
/// `finalization_timeout`. What it returns on success is what a blocking caller receives; on
/// failure the caller receives the same [`RunFailure`] the finalizer saw.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use lanes::Run;
///
/// let run = Run::new(|cx| async move {
///     tokio::select! {
///         _ = cx.cancelled() => Err("cancelled".into()),
///         _ = tokio::time::sleep(Duration::from_millis(5)) => Ok(7),
///     }
/// })
/// .finalizer(|outcome| async move {
///     // Commit the result somewhere; the caller gets what this returns.
///     outcome.map(|n| n * 2)
/// })
/// .queue_timeout(Duration::from_secs(1))
/// .execution_timeout(Duration::from_secs(5));
/// # drop(run);
/// ```
#[must_use = "a run does nothing until it is given to a lane"]
// Laid out in this order, the two timeouts first and the rarely set options next, so that a
// run built with the defaults is written as a 16-byte half of all ones and a zero word: the
// pieces a move of the run reads it back in. A full lane's refusal moves the run into its
// error, inlined into the caller that built it; a 16-byte load across two narrower stores
// cannot take its data from the store buffer and waits for both to reach the cache: 3.8 of
// the 8.9 ns such a refusal took on an AMD EPYC host (BENCHMARKS.md, suite 2, stop 56). A run
// dropped unadmitted drops its fields in this order: its limit before its job and finalizer.
#[repr(C)]
pub struct Run<J, F = Passthrough> {
    pub(crate) queue_timeout: Timeout,
    pub(crate) execution_timeout: Timeout,
    pub(crate) extras: Option<Box<Extras>>,
    pub(crate) job: J,
    pub(crate) finalizer: F,
}

/// A run's cleanup and limit, boxed together: most runs set neither, and a run without them
/// holds one null word, which its drop tests once. As two words of their own, a refused run's
/// drop (at the caller, with the error) tested both out of line: 18 of the 77 instructions of
/// a refusal (BENCHMARKS.md, suite 2, stops 61 and 63). A run that sets either costs one
/// allocation for both.
#[derive(Default)]
pub(crate) struct Extras {
    pub(crate) cleanup: Option<Cleanup>,
    pub(crate) limit: Option<Throttle>,
}

impl<J, F> Run<J, F> {
    /// The limit the run takes a permit of before its slot, if any.
    pub(crate) fn limited_by(&self) -> Option<&Throttle> {
        self.extras.as_ref().and_then(|extras| extras.limit.as_ref())
    }

    /// The cleanup and the limit, taken apart.
    pub(crate) fn take_extras(extras: Option<Box<Extras>>) -> (Option<Cleanup>, Option<Throttle>) {
        match extras {
            Some(extras) => {
                let Extras { cleanup, limit } = *extras;
                (cleanup, limit)
            }
            None => (None, None),
        }
    }
}

/// An optional timeout, as one 8-byte word of nanoseconds (`u64::MAX`: none; longer timeouts,
/// past 584 years, are that long). An `Option<Duration>`'s `None` is a 4-byte write that moving
/// the run (into a refusal, say) reads back as part of an 8-byte load, which stalls store
/// forwarding: two of them cost the refusal path a third of its time.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Timeout(u64);

impl Timeout {
    pub(crate) const NONE: Self = Self(u64::MAX);

    fn new(timeout: Duration) -> Self {
        Self(u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX).min(u64::MAX - 1))
    }

    pub(crate) fn get(self) -> Option<Duration> {
        (self != Self::NONE).then_some(Duration::from_nanos(self.0))
    }
}

impl fmt::Debug for Timeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.get().fmt(f)
    }
}

impl<J> Run<J> {
    /// A run of `job` whose outcome goes to the caller unchanged ([`Passthrough`]). The job
    /// fails with a [`BoxError`], so the common closure needs no annotation and `?` converts
    /// any error; [`typed`](Self::typed) keeps a job's own error type.
    ///
    /// ```
    /// use lanes::Run;
    ///
    /// let run = Run::new(|_cx| async { Ok(42) });
    /// let parsed = Run::new(|_cx| async { Ok("7".parse::<u32>()?) });
    /// # drop((run, parsed));
    /// ```
    pub fn new<Fut, T>(job: J) -> Self
    where
        J: FnOnce(RunContext) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, BoxError>> + Send + 'static,
        T: Send + 'static,
    {
        Self::typed(job)
    }

    /// A run of `job` that fails with its own error type `E` (the finalizer and a blocking
    /// caller see it as the failure's cause, downcastable to `E`).
    ///
    /// ```
    /// use lanes::Run;
    ///
    /// let run = Run::typed(|_cx| async { Ok::<_, std::io::Error>(42) });
    /// # drop(run);
    /// ```
    pub fn typed<Fut, T, E>(job: J) -> Self
    where
        J: FnOnce(RunContext) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Send + 'static,
        E: Into<BoxError> + Send + 'static,
    {
        Self {
            job,
            finalizer: Passthrough,
            queue_timeout: Timeout::NONE,
            execution_timeout: Timeout::NONE,
            extras: None,
        }
    }
}

impl<J: Job, F> Run<J, F> {
    /// Sets the finalizer: it receives the run's [`Outcome`] exactly once, and what it returns
    /// on success is what a blocking caller receives.
    pub fn finalizer<G, Fut, U, E>(self, finalizer: G) -> Run<J, G>
    where
        G: FnOnce(Outcome<J::Output>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<U, E>> + Send + 'static,
        U: Send + 'static,
        E: Into<BoxError> + Send + 'static,
    {
        self.with_finalizer(finalizer)
    }

    /// Sets a finalizer given as a [`Finalize`] implementation.
    pub fn with_finalizer<G: Finalize<J::Output>>(self, finalizer: G) -> Run<J, G> {
        Run {
            job: self.job,
            finalizer,
            queue_timeout: self.queue_timeout,
            execution_timeout: self.execution_timeout,
            extras: self.extras,
        }
    }

    /// A last step after the finalizer, bounded by the set's `audit_timeout`. The run owns its
    /// lane slot until the cleanup has finished; a cleanup failure is attached to the run's
    /// failure (or becomes it, on an otherwise successful run).
    pub fn cleanup<C, Fut, E>(mut self, cleanup: C) -> Self
    where
        C: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: Into<BoxError> + 'static,
    {
        let cleanup: CleanupFn = Box::new(move || {
            let fut = cleanup();
            Box::pin(async move { fut.await.map_err(Into::into) })
        });
        self.extras.get_or_insert_default().cleanup = Some(Box::new(cleanup));
        self
    }

    /// Fails the run with [`Reason::Timeout`] at [`Stage::Queue`] if it waits longer than
    /// `timeout` for an execution slot.
    pub fn queue_timeout(mut self, timeout: Duration) -> Self {
        self.queue_timeout = Timeout::new(timeout);
        self
    }

    /// Cancels the job with [`Reason::Timeout`] if it runs longer than `timeout`. The clock
    /// starts at grant: neither the queue wait nor the wait for the run's limit counts (both
    /// are bounded by the [queue timeout](Self::queue_timeout)).
    pub fn execution_timeout(mut self, timeout: Duration) -> Self {
        self.execution_timeout = Timeout::new(timeout);
        self
    }

    /// Takes a permit of limit `name` at `priority` before the run asks for an execution slot;
    /// the permit is returned when the job ends, before the finalizer.
    ///
    /// The wait for the permit holds no execution slot, so a lane whose runs wait on a busy
    /// limit still runs everything else (the *fusee rule*). The run waits for its permit in
    /// the limit's order (priority, fairness key, arrival), then for a slot in the lane's order:
    /// slots go to runs in the order they became *ready*, which is admission for a run without
    /// a limit and the grant of its permit for a run with one. It holds its permit while it
    /// waits for a slot, which only ever waits on jobs that are running.
    ///
    /// Both waits are the run's queue stage: bounded by the [queue
    /// timeout](Self::queue_timeout), cancelled by close or a dropped handle, and a refusal of the
    /// limit (an unknown limit, too many waiters) fails the run at [`Stage::Queue`] with
    /// [`Reason::Limit`]. The run counts as queued in the lane's snapshot meanwhile.
    ///
    /// A refusal fails the run; [`throttle`](Self::throttle) takes a [`Throttle`] with another
    /// [refusal policy](crate::limit::OnRefusal).
    pub fn limit(self, limits: &Limits, name: impl Into<Arc<str>>, priority: Priority) -> Self {
        self.throttle(Throttle::new(limits, name, priority))
    }

    /// Like [`limit`](Self::limit), with the limit, priority and refusal policy of `throttle`.
    pub fn throttle(mut self, throttle: Throttle) -> Self {
        self.extras.get_or_insert_default().limit = Some(throttle);
        self
    }
}

impl<J, F> fmt::Debug for Run<J, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Run")
            .field("queue_timeout", &self.queue_timeout)
            .field("execution_timeout", &self.execution_timeout)
            .field("cleanup", &self.extras.as_ref().is_some_and(|e| e.cleanup.is_some()))
            .field("limit", &self.limited_by().map(Throttle::name))
            .finish_non_exhaustive()
    }
}

/// What a job knows about its run: its id, its lane, and whether it should stop.
#[derive(Clone)]
pub struct RunContext {
    pub(crate) run_id: RunId,
    pub(crate) lane: &'static str,
    pub(crate) participation: Participation,
    pub(crate) signal: Arc<RunSignal>,
}

impl RunContext {
    /// The run's id.
    pub fn run_id(&self) -> RunId {
        self.run_id
    }

    /// The lane the run executes in.
    pub fn lane(&self) -> &str {
        self.lane
    }

    /// Blocking or background.
    pub fn participation(&self) -> Participation {
        self.participation
    }

    /// Whether the run was asked to stop.
    pub fn is_cancelled(&self) -> bool {
        self.signal.cancel_reason().is_some()
    }

    /// Why the run was asked to stop, if it was: [`Reason::Canceled`] (the caller dropped its
    /// handle), [`Reason::Timeout`], [`Reason::Closed`] or [`Reason::Poisoned`].
    pub fn cancel_reason(&self) -> Option<Reason> {
        self.signal.cancel_reason()
    }

    /// Resolves when the run is asked to stop, with the reason. A job should return soon after:
    /// one that keeps running past the set's `worker_drain_timeout` poisons the set.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future loses nothing.
    pub async fn cancelled(&self) -> Reason {
        self.signal.cancelled().await
    }
}

impl fmt::Debug for RunContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RunContext")
            .field("run_id", &self.run_id)
            .field("lane", &self.lane)
            .field("participation", &self.participation)
            .field("cancelled", &self.cancel_reason())
            .finish()
    }
}

/// The caller's side of a blocking run: resolves to what the finalizer returned, or to the
/// [`RunFailure`] the finalizer saw, once the finalizer and cleanup have finished.
///
/// # Cancel safety
///
/// Dropping the handle before it resolves cancels the run: a queued run fails in the queue with
/// [`Reason::Canceled`], an executing job is asked to stop. Either way the finalizer still runs
/// exactly once (unless the runtime shuts down under the run: see the
/// [module docs](crate::lane#shutdown)).
#[must_use = "dropping a RunHandle cancels the run"]
pub struct RunHandle<U> {
    pub(crate) run_id: RunId,
    pub(crate) lane: Arc<str>,
    pub(crate) join: JoinHandle<Result<U, RunFailure>>,
    pub(crate) signal: Arc<RunSignal>,
    pub(crate) finished: bool,
}

impl<U> RunHandle<U> {
    /// The run's id.
    pub fn run_id(&self) -> RunId {
        self.run_id
    }
}

impl<U> Future for RunHandle<U> {
    type Output = Result<U, RunFailure>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let joined = std::task::ready!(Pin::new(&mut this.join).poll(cx));
        this.finished = true;
        Poll::Ready(match joined {
            Ok(result) => result,
            Err(err) if err.is_panic() => std::panic::resume_unwind(err.into_panic()),
            // The runtime shut down under the run: its finalizer could not run.
            Err(_) => Err(RunFailure::new(
                this.run_id,
                this.lane.clone(),
                super::Participation::Blocking,
                Stage::Execution,
                Reason::Canceled,
                Some("the runtime shut down before the run finished".into()),
            )),
        })
    }
}

impl<U> Drop for RunHandle<U> {
    fn drop(&mut self) {
        if !self.finished {
            self.signal.cancel(Reason::Canceled);
        }
    }
}

impl<U> fmt::Debug for RunHandle<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RunHandle")
            .field("run_id", &self.run_id)
            .field("lane", &self.lane)
            .field("finished", &self.finished)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runs_optional_parts_are_whole_words() {
        // A run is moved (into a refusal, into its driver's future) right after it is built;
        // an optional part whose `None` writes part of a word stalls that move (see `Cleanup`
        // and `Timeout`). A two-word cleanup or an `Option<Duration>` fails these.
        assert_eq!(std::mem::size_of::<Option<Cleanup>>(), std::mem::size_of::<usize>());
        assert_eq!(std::mem::size_of::<Timeout>(), 8);
        assert_eq!(Timeout::NONE.get(), None);
        assert_eq!(Timeout::new(Duration::from_secs(3)).get(), Some(Duration::from_secs(3)));
    }
}
