//! Run lanes: bounded owned-run scheduling with strict FIFO grants and a finalizer that is
//! called exactly once.
//!
//! A [`LaneSet`] holds named lanes. Each lane has `concurrent` execution slots and `queued`
//! waiting slots ([`LaneLimits`]); lanes never borrow each other's capacity. A [`Run`] is a job
//! plus a finalizer: the job runs once it holds an execution slot, the finalizer receives its
//! [`Outcome`] exactly once, whatever happens.
//!
//! A caller takes part in one of two ways:
//! - **blocking** ([`LaneSet::run`]): it awaits the returned [`RunHandle`] and receives what the
//!   finalizer returned, or the same [`RunFailure`] the finalizer saw;
//! - **background** ([`LaneSet::spawn`]): it gets the [`RunId`] back and only the finalizer sees
//!   the outcome.
//!
//! # Ownership
//!
//! An admitted run *owns* a slot of its lane from admission until its finalizer and cleanup
//! have finished, so at most `concurrent + queued` runs are owned at once: a slow finalizer
//! cannot let unbounded new work in. The *execution* slot is given back earlier, as soon as the
//! job ends and before the finalizer runs, so the next queued run can start meanwhile.
//!
//! # Ordering
//!
//! Execution slots are granted in strict FIFO order per lane: a run admitted later never starts
//! before one admitted earlier that is still waiting. A run that names a limit
//! ([`Run::limit`]) first waits for its permit without holding a slot, and joins the FIFO when
//! the permit is granted, so slots go in the order runs became ready and a busy limit never
//! stops the rest of the lane. Queue wait (including the wait for a permit) does not count
//! against the execution timeout, whose clock starts at grant.
//!
//! # Overflow
//!
//! Admission never waits. It is all-or-nothing: a run is either owned (it gets a [`RunId`] and
//! its finalizer will be called) or refused with an [`AdmissionError`] — [`Full`], [`Closed`] or
//! [`Poisoned`] — that hands the run back, with no id, no finalizer call and no audit event. The
//! lane's `rejected` counter for that reason moves.
//!
//! A caller that would rather wait for room uses [`LaneSet::run_wait`] or
//! [`LaneSet::spawn_wait`] (like tokio's `Sender::send` where `run` is `try_send`). Waiting
//! callers get rooms in the order they began waiting: a run that ends while any wait hands its
//! room to the one that has waited longest, so an admission that does not wait finds the lane
//! full until every waiter has a room. (A room that comes free just as the first callers begin
//! waiting goes to whichever caller tries for it first.)
//!
//! [`Full`]: AdmissionErrorKind::Full
//! [`Closed`]: AdmissionErrorKind::Closed
//! [`Poisoned`]: AdmissionErrorKind::Poisoned
//!
//! # Failures
//!
//! A run that fails while waiting is a *queue failure* ([`Stage::Queue`]) with reason
//! [`Canceled`](Reason::Canceled), [`Timeout`](Reason::Timeout), [`Closed`](Reason::Closed) or
//! [`Poisoned`](Reason::Poisoned); its job never ran. A run that fails later carries the
//! [`Stage`] and [`Reason`] of the failure. Every [`RunFailure`] names its run, lane and
//! participation. Secondary failures (terminal audit, finalizer, cleanup) are attached to the
//! primary failure and reachable through `source()`; they never replace it. Panics in any
//! callback are contained and reported as [`PanicError`]; their payloads never appear in a
//! message. The application's `metrics` recorder is called after the lane's locks, so it may
//! call into the set (a snapshot, say). A panic in it is contained too and fails no run: the
//! panic hook reports it and the metric misses that update (a gauge's move is made again at
//! its next change). The metrics of a limit a run names are the limit's, and are not
//! contained.
//!
//! # Cancel safety
//!
//! Dropping a [`RunHandle`] cancels its run: a queued run fails with [`Reason::Canceled`] at
//! [`Stage::Queue`]; an executing job sees [`RunContext::cancelled`] resolve. The finalizer still
//! runs exactly once, in the task that drives the run.
//!
//! # Tasks
//!
//! A run that starts at once, or has a caller waiting, a queue timeout or a limit, is driven by a
//! task of its own. A queued background run without a queue timeout holds no task while it waits:
//! the run that gives it its slot drives it next, in the same task if both were admitted on the
//! same runtime (or spawns it the moment its own terminal audit, finalizer or cleanup has to
//! wait; a run of another runtime is spawned there at once). A busy lane used by one runtime
//! thus runs on about one task per execution slot; such a task yields to the scheduler between
//! runs when its budget is spent. The
//! queued run therefore starts once those callbacks have returned from their first poll: one that
//! does long synchronous work before its first `.await` delays it, and callbacks, like jobs, must
//! not block the thread.
//!
//! The runtime needs its time driver (`Builder::enable_time`, or `enable_all`, as
//! `#[tokio::main]` and `#[tokio::test]` give): the queue, execution, audit, finalization and
//! drain timeouts are tokio timers. On a runtime without one, tokio panics where a run first
//! needs a timer, and that run ends unfinalized, as in a runtime's shutdown (below).
//!
//! # Shutdown
//!
//! [`LaneSet::close`] refuses new admission at once, fails every queued run with
//! [`Reason::Closed`] through its finalizer, and asks every executing job to stop.
//! [`LaneSet::drained`] resolves once every owned run is fully finalized.
//!
//! A cancelled job must return within the set's `worker_drain_timeout`. One that does not
//! *poisons* the set: every lane refuses admission with [`Poisoned`], queued runs fail with
//! [`Reason::Poisoned`], executing jobs are asked to stop, and the stuck job's future is dropped,
//! so its late result is never seen. Poison is permanent for the set.
//!
//! Jobs must not block the thread: a job that never yields cannot be timed out or cancelled.
//! Move blocking work to `tokio::task::spawn_blocking`.
//!
//! Close the set and await [`drained`](LaneSet::drained) before shutting the runtime down: a
//! runtime that shuts down drops its tasks, and the runs they drive end there, unfinalized. Such
//! a run (queued, executing, or in its finalizer) ends in that drop: counted failed with
//! [`Reason::Canceled`], its finalizer, cleanup and terminal audit not run (nothing is left to
//! run them on), and its execution slot and room given back, so that a set that outlives the
//! runtime (shared by several, or kept across a restart) keeps its whole capacity on the next
//! one and still drains. A blocking caller polling its [`RunHandle`] from another runtime gets
//! that [`Reason::Canceled`] failure.
//!
//! A set used by several runtimes at once keeps each run on the runtime it was admitted on: a
//! queued run is started there when its slot comes, whichever runtime's run gave the slot back,
//! so a runtime that shuts down ends its own runs and no other's. (So a run granted its slot
//! holds it until its runtime polls it: a runtime whose thread is blocked delays its own runs
//! and the slots they hold.) A close starts the queued runs it fails on their own runtimes
//! too, wherever it is called from; those of a runtime that has shut down are dropped as it
//! drops a task, and end canceled (a panic in that drop, a job's capture, is caught, and the
//! close goes on).

mod audit;
mod config;
mod core;
mod driver;
mod error;
mod handle;
mod metrics;
mod run;
mod signal;
mod snapshot;

pub use crate::config::{ConfigError, ConfigRule};
pub use audit::{Audit, AuditEvent, AuditKind};
pub use config::{LaneLimits, LaneSetBuilder, MAX_QUEUED};
pub use error::{
    AdmissionError, AdmissionErrorKind, AttachedError, PanicError, PoisonError, Reason, RunFailure,
    Stage, TimeoutError,
};
pub use handle::{Lane, LaneSet};
pub use run::{
    Finalize, Job, Outcome, Participation, Passthrough, Run, RunContext, RunHandle, RunId,
};
pub use snapshot::{FailedCounts, LaneSetSnapshot, LaneSnapshot, RejectedCounts, SetState};
