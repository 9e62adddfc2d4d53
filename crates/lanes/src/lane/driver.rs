//! The task that drives each admitted run through its life: the wait for a slot (and first for
//! its permit, if it names a limit), the start audit, the job, the terminal audit, the
//! finalizer and the cleanup. The handles and the lanes' shared state are in `handle.rs`.
//!
//! # Invariants
//!
//! 1. Exactly one place ends a run: the end of `drive`, which gives its ownership back after the
//!    finalizer and cleanup. Every path through `drive` reaches it, because every callback is
//!    panic-contained and bounded by a timeout, and a job that ignores cancellation is dropped
//!    (after poisoning the set) rather than awaited forever.
//! 2. The execution slot is given back before the terminal audit and the finalizer.
//! 3. A drive dropped before its run ended (its runtime shut down under it, dropping its task
//!    or the parked run that was to get one) ends the run in its ticket's drop instead:
//!    it gives back what the run holds in its lane (its place in the queue, or its slot, as
//!    [`Progress`] says), and its ownership, counted failed with [`Reason::Canceled`]. Its
//!    finalizer and cleanup do not run: there is no runtime left to run them on.
//! 4. A run is driven on the runtime it was admitted on, its *home* (its signal's
//!    [`home`](RunSignal::home)): a blocking or timed run's task is spawned there at admission,
//!    and a parked run is started there when its slot comes. A run that gives its slot back
//!    carries the parked run it granted in its own task only if both share a home; any other
//!    is spawned on its home's handle ([`Runtimes`]), and one whose home has shut down ends
//!    there (invariant 3). So a runtime that shuts down ends its own runs and no other's.

use std::cell::RefCell;
use std::future::{Future, poll_fn};
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::{Instant, Sleep, sleep_until, timeout};

use super::audit::{Audit, AuditEvent, AuditKind};
use super::core::{Admitted, Shut};
use super::error::{PanicError, PoisonError, Reason, RunFailure, Stage, TimeoutError};
use super::handle::SetShared;
use super::run::{Cleanup, Finalize, Job, Participation, RunContext, RunId, Timeout};
use super::signal::{Decision, RunSignal};
use crate::limit::{Permit, Throttle};
use crate::util::{CatchUnwind, Panicked, call_contained};
use crate::{BoxError, BoxFuture};

/// An admitted run, on its way to its driver task, without its job and finalizer.
///
/// `drive`'s future owns it for the run's whole life and borrows it (`drive` returns an
/// `async` block, which keeps its captures once, where an async fn would copy its arguments
/// into locals), so the run's data lives there once.
///
/// Its timeouts are whole words ([`Timeout`]), not `Option<Duration>`s: a ticket is moved into
/// the run's boxed future right after it is written, and a `None` duration is a 4-byte write
/// that such a move reads back as part of a wider load.
pub(super) struct Ticket {
    pub(super) shared: Arc<SetShared>,
    pub(super) info: TicketInfo,
    pub(super) start: Start,
    /// The run's signal, taken when the run ends: a ticket dropped with it ends the run
    /// (invariant 3). (Taken, not flagged: the run's task carries it on, see `Next::spent`.)
    signal: Option<Arc<RunSignal>>,
    pub(super) queue_timeout: Timeout,
    pub(super) execution_timeout: Timeout,
    pub(super) limit: Option<Throttle>,
    /// What the run holds in its lane, kept up to date by its drive (invariant 3).
    pub(super) holds: Progress,
}

/// What a run holds in its lane: what its end gives back if its drive is dropped before the
/// run ends (invariant 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Holds {
    /// Nothing: not admitted to a slot yet, or out of the queue, or its slot given back.
    Nothing,
    /// A place in the queue (or a grant on its way there, or a shut's decision).
    Queued(u64),
    /// A place among the runs waiting for their limit's permit.
    Limited(u64),
    /// An execution slot.
    Slot(usize),
}

/// [`Holds`] in one word (the kind in the top two bits), written only by the drive's polls and
/// read by its drop, which the task's ownership orders after them: `Relaxed`, a plain store.
pub(super) struct Progress(AtomicU64);

impl Progress {
    const KIND: u32 = 62;
    const VALUE: u64 = (1 << Self::KIND) - 1;

    pub(super) fn new(holds: Holds) -> Self {
        Self(AtomicU64::new(Self::word(holds)))
    }

    #[inline(always)]
    fn word(holds: Holds) -> u64 {
        let (kind, value) = match holds {
            Holds::Nothing => (0, 0),
            Holds::Queued(seq) => (1, seq),
            Holds::Limited(seq) => (2, seq),
            Holds::Slot(slot) => (3, slot as u64),
        };
        debug_assert!(value <= Self::VALUE, "a queue position or slot fits in 62 bits");
        kind << Self::KIND | value & Self::VALUE
    }

    #[inline(always)]
    pub(super) fn set(&self, holds: Holds) {
        self.0.store(Self::word(holds), Ordering::Relaxed);
    }

    fn get(&self) -> Holds {
        let word = self.0.load(Ordering::Relaxed);
        let value = word & Self::VALUE;
        match word >> Self::KIND {
            0 => Holds::Nothing,
            1 => Holds::Queued(value),
            2 => Holds::Limited(value),
            _ => Holds::Slot(value as usize),
        }
    }
}

impl Start {
    /// What a run that starts here holds in its lane.
    pub(super) fn holds(&self) -> Holds {
        match *self {
            Start::Executing { slot } => Holds::Slot(slot),
            Start::Queued { seq, .. } => Holds::Queued(seq),
            Start::Limited { seq, .. } => Holds::Limited(seq),
        }
    }
}

impl Drop for Ticket {
    /// A ticket dropped before its run ended (its drive was): the run ends here (invariant 3).
    #[inline(always)]
    fn drop(&mut self) {
        if self.signal.is_some() {
            self.abandon();
        }
    }
}

/// An admitted run, split into what `drive` borrows and what it consumes.
pub(super) type Admission<J, F> = (Ticket, Callbacks<J, F>);

/// What `drive` consumes besides the ticket.
pub(super) struct Callbacks<J, F> {
    pub(super) job: J,
    pub(super) finalizer: F,
    pub(super) cleanup: Option<Cleanup>,
}

/// Where an admitted run starts.
pub(super) enum Start {
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

/// A queued background run without a deadline, waiting as data in its signal instead of as a
/// task ([`RunSignal::park`]): its drive, built at admission and not yet polled. The lane's
/// decision starts it on its home (invariant 4): a grant made by a run of the same home that
/// gives its slot back hands it to that run's task ([`Next`]), anything else spawns a task for
/// it there.
pub(super) struct Parked(pub(super) Step);

/// Where a parked run is started.
enum At {
    /// The current runtime: its home, where what starts it runs.
    Current,
    /// Its home's handle, from elsewhere.
    Home(tokio::runtime::Handle),
    /// Nowhere: its home is gone. It is dropped, as that runtime would have dropped its task.
    Gone,
}

thread_local! {
    /// Parked runs this thread is to start, while it starts one ([`Parked::start`]).
    static STARTING: RefCell<Option<Vec<(Parked, At)>>> = const { RefCell::new(None) };
}

/// Tokio's id of `runtime`, as a number a signal keeps in an atomic: the id's `Hash` writes the
/// one non-zero `u64` it is (tokio numbers its runtimes from a process-wide counter, so no two
/// runtimes of a process share one, though its docs promise that only among running ones), and
/// that `u64` is the number. Its value is checked against the id's `Display` in a unit test.
pub(super) fn runtime_key(runtime: &tokio::runtime::Handle) -> u64 {
    struct Key(u64);
    impl std::hash::Hasher for Key {
        fn write(&mut self, bytes: &[u8]) {
            for byte in bytes {
                self.0 = self.0.rotate_left(8) ^ u64::from(*byte);
            }
        }
        fn write_u64(&mut self, n: u64) {
            self.0 = self.0.rotate_left(29) ^ n;
        }
        fn finish(&self) -> u64 {
            self.0
        }
    }
    let mut key = Key(0);
    std::hash::Hash::hash(&runtime.id(), &mut key);
    key.0
}

/// Whether `runtime` has not shut down: one that has drops a task spawned on it at once.
fn is_running(runtime: &tokio::runtime::Handle) -> bool {
    let probe = runtime.spawn(std::future::pending::<()>());
    let running = !probe.is_finished();
    probe.abort();
    running
}

/// The runtimes a set's runs were admitted on, by [`runtime_key`]: the handles a queued run
/// is started on when what grants it its slot runs elsewhere (invariant 4). The handle of a
/// runtime that has shut down is kept until a new runtime is noted (with the runtime's shared
/// state it holds): a set that outlives its last runtime keeps that one's.
#[derive(Debug, Default)]
pub(super) struct Runtimes {
    /// The runtime of the last admission that noted one: a set used by one runtime notes it
    /// once, and every other admission reads this alone.
    last: AtomicU64,
    /// Every runtime noted and not found shut down when a new one was noted.
    known: std::sync::Mutex<Vec<(u64, tokio::runtime::Handle)>>,
}

impl Runtimes {
    /// Notes `runtime`, numbered `key`, as one the set's runs are admitted on; before the run
    /// is published, so that whoever grants it finds the handle.
    #[inline]
    pub(super) fn note(&self, key: u64, runtime: &tokio::runtime::Handle) {
        if self.last.load(Ordering::Relaxed) != key {
            self.note_new(key, runtime);
        }
    }

    #[cold]
    fn note_new(&self, key: u64, runtime: &tokio::runtime::Handle) {
        let mut known = crate::util::lock(&self.known);
        let mut gone = Vec::new();
        if !known.iter().any(|(noted, _)| *noted == key) {
            // The handles of runtimes that have shut down go (after the lock): their runs
            // ended with them, and one granted later is dropped where it is (`At::Gone`).
            let live;
            (live, gone) =
                std::mem::take(&mut *known).into_iter().partition(|(_, handle)| is_running(handle));
            *known = live;
            known.push((key, runtime.clone()));
        }
        // Under the lock: whoever reads it and looks the handle up takes the lock after.
        self.last.store(key, Ordering::Relaxed);
        drop(known);
        drop(gone);
    }

    /// Where a run of home `key` is started from a thread whose runtime may not be it.
    fn at(&self, key: u64) -> At {
        let known = crate::util::lock(&self.known);
        match known.iter().find(|(noted, _)| *noted == key) {
            Some((_, handle)) => At::Home(handle.clone()),
            None => At::Gone,
        }
    }
}

/// Where the parked runs a grant starts go, each to its home (invariant 4). `here` is the
/// runtime this thread runs, if known: a run of it is started here, and carried in the
/// releasing run's task if the grant is a release (`carry`). Any other run is spawned on its
/// home's handle, found in `runtimes`.
#[derive(Clone, Copy)]
pub(super) struct Starts<'a> {
    pub(super) here: Option<u64>,
    pub(super) carry: bool,
    pub(super) runtimes: &'a Runtimes,
}

impl Parked {
    /// Spawns a task for it on the current runtime; with none, the run is dropped, as a task
    /// of that runtime would have been, and ends (invariant 3).
    ///
    /// A runtime that shuts down drops a task spawned on it at once: the run ends in its drop,
    /// and gives its slot to the next parked run, which is started here again. Started one
    /// after the other ([`after`](Self::after)), not each inside the last one's drop, a long
    /// queue ends without growing the stack.
    // Out of line: the rare path of the grants and ends that carry parked runs.
    #[inline(never)]
    pub(super) fn start(self) {
        self.start_at(At::Current);
    }

    /// Starts it on its home `home` from a thread whose runtime may not be it, the handle
    /// found in `runtimes` (the set's).
    pub(super) fn start_home(self, home: u64, runtimes: &Runtimes) {
        self.start_at(runtimes.at(home));
    }

    fn start_at(self, at: At) {
        let mut run = Some((self, at));
        let queued = STARTING.try_with(|starting| {
            if let Some(later) = &mut *starting.borrow_mut() {
                later.extend(run.take());
            }
        });
        if let Some((run, at)) = run {
            match queued {
                Ok(()) => Self::after(|| run.spawn(at)),
                // This thread's locals are gone (it is exiting): started here and now.
                Err(_) => run.spawn(at),
            }
        }
    }

    /// Runs `f`, and then starts the parked runs started meanwhile on this thread, one after
    /// another, the runs those start included; or only runs `f` if this thread is already
    /// starting runs, which starts them.
    fn after<R>(f: impl FnOnce() -> R) -> R {
        let outermost = STARTING
            .try_with(|starting| {
                let mut starting = starting.borrow_mut();
                let idle = starting.is_none();
                if idle {
                    *starting = Some(Vec::new());
                }
                idle
            })
            .unwrap_or(false);
        if !outermost {
            return f();
        }
        // Clears the list however this ends; the runs still in it are dropped (and end).
        struct Started;
        impl Drop for Started {
            fn drop(&mut self) {
                drop(STARTING.try_with(|starting| starting.borrow_mut().take()));
            }
        }
        let _started = Started;
        let value = f();
        while let Some((run, at)) = STARTING.with_borrow_mut(|s| s.as_mut().and_then(Vec::pop)) {
            run.spawn(at);
        }
        value
    }

    /// Spawns its task `at` its home, or drops it if it has none.
    fn spawn(self, at: At) {
        let runtime = match at {
            At::Current => tokio::runtime::Handle::try_current().ok(),
            At::Home(runtime) => Some(runtime),
            At::Gone => None,
        };
        match runtime {
            Some(runtime) => drop(runtime.spawn(work(self.0))),
            // As a runtime drops a task: a panic in the drop (a job's capture) is caught there
            // and goes no further, so a close that fails parked runs goes on to the rest. The
            // run ends in the drop all the same (its ticket's drop runs as the panic unwinds).
            None => drop(call_contained(move || drop(self))),
        }
    }
}

/// One background run's drive, boxed so that runs of any type chain in one task.
pub(super) type Step = Pin<Box<dyn Future<Output = Next> + Send>>;

/// The task of background runs: it drives its first run, then every parked run that a run of
/// this task granted its slot to, one after the other, as a worker drains a queue. A chain of
/// runs whose jobs never wait still yields to the scheduler when the task's budget is spent.
pub(super) async fn work(mut step: Step) {
    loop {
        let mut next = (&mut step).await;
        if next.run.is_none() {
            next.bury(step);
            return;
        }
        // Carried across the yield: if this task is dropped there, `Next`'s drop spawns it.
        tokio::task::coop::consume_budget().await;
        let following = next.run.take().expect("checked before the yield").0;
        next.bury(std::mem::replace(&mut step, following));
    }
}

/// The parked run that a finishing run granted its execution slot to, carried by the
/// finishing run's task: started in that task once the run ends, unless the run must wait
/// first (an audit, finalizer or cleanup that does not finish on its first poll), in which
/// case it is spawned then, so that it never waits for the end of another run.
#[derive(Default)]
pub(super) struct Next {
    run: Option<Parked>,
    /// The ended run's signal: a background run's task leaves the spent drive in it (see
    /// `bury`); a blocking run's drive drops it in its last poll.
    spent: Option<Arc<RunSignal>>,
}

impl Next {
    /// Carries `run`, of home `home`, if it shares the carrier's; a second one (never, when one
    /// slot was freed) gets its own task; a run of another home is started there.
    pub(super) fn push(&mut self, run: Parked, home: u64, starts: Starts<'_>) {
        if starts.here != Some(home) {
            return run.start_home(home, starts.runtimes);
        }
        if !starts.carry {
            return run.start();
        }
        match self.run {
            None => self.run = Some(run),
            Some(_) => run.start(),
        }
    }

    /// Grants each `(slot, signal)`, as [`push_granted`](Self::push_granted) does, every latch
    /// first: a parked run started may end at once (on a runtime that has shut down), and its
    /// end must not find a grant still to be told by this thread.
    pub(super) fn push_all_granted(
        &mut self,
        grants: impl Iterator<Item = (usize, Arc<RunSignal>)>,
        starts: Starts<'_>,
    ) {
        let parked: Vec<(Parked, u64)> = grants
            .filter_map(|(slot, signal)| Some((signal.grant(slot)?, signal.home())))
            .collect();
        parked.into_iter().for_each(|(run, home)| self.push(run, home, starts));
    }

    /// Grants `slot` to the run of `signal`: a parked one is carried (or started on its home,
    /// [`push`](Self::push)), one with a task of its own is woken. Inline: on every run's
    /// release (`release_execution`); out of line it cost 25 instructions a run (cachegrind,
    /// `fixed lane 8 4` minus `2`), a choice the compiler made or not as unrelated code moved
    /// (stop 79: a change in `abandon`, which is cold, moved it out of line), so it is forced.
    #[inline(always)]
    pub(super) fn push_granted(&mut self, signal: &RunSignal, slot: usize, starts: Starts<'_>) {
        if let Some(run) = signal.grant(slot) {
            self.push(run, signal.home(), starts);
        }
    }

    /// Spawns the carried run, if any: its carrier is about to wait.
    fn spawn(&mut self) {
        if let Some(run) = self.run.take() {
            run.start();
        }
    }

    /// Leaves the ended run's spent drive in its signal, to be freed when the lane reuses the
    /// signal for a run it admits, on the admitting thread ([`RunSignal::bury`]).
    fn bury(&mut self, step: Step) {
        match self.spent.take() {
            Some(signal) => signal.bury(step),
            None => drop(step),
        }
    }
}

impl Drop for Next {
    /// A carried run was granted its slot and owns it: if its carrier is dropped first (its
    /// task unwinds from a panic outside the contained callbacks, or is dropped), it gets a
    /// task of its own instead of being lost with the slot.
    fn drop(&mut self) {
        self.spawn();
    }
}

/// How a run ended, and the parked run it granted its slot to (with the run's signal).
pub(super) type Ended<T> = (Result<T, RunFailure>, Next);

/// What a run's task does with its end: a background run's result was the finalizer's, and
/// its task goes on with the run it granted its slot to.
pub(super) fn background<T>((result, next): Ended<T>) -> Next {
    if let Err(failure) = &result {
        unseen(failure);
    }
    // Dropped first, while `next` is a local: a result that panics on drop unwinds through
    // here, and a local is dropped on the way (so it starts its run), while a value already
    // moved out to be returned would be leaked (rust-lang/rust#47949).
    drop(result);
    next
}

/// Logs (`warn`) a background run's failure that its finalizer never saw: one that failed a
/// run that had succeeded (its finalizer or cleanup), or one attached after the finalizer ran
/// (its own error, a cleanup's). Nothing awaits a background run, so it would reach nobody.
/// A failure the finalizer saw is the finalizer's to report.
#[cold]
fn unseen(failure: &RunFailure) {
    let late = |stage: Stage| matches!(stage, Stage::Finalization | Stage::Cleanup);
    if !late(failure.stage()) && !failure.attached().any(|a| late(a.stage())) {
        return;
    }
    // Formatted in the event: its causes' `Display` and `Debug` are user code.
    let _ = call_contained(|| {
        tracing::warn!(
            run = %failure.run_id(),
            lane = failure.lane(),
            failure = ?failure,
            "a background run failed where nobody saw it"
        );
    });
}

/// What a run's task does with its end: a blocking run's task answers its handle, so the run
/// it granted its slot to gets a task of its own.
pub(super) fn blocking<T>((result, mut next): Ended<T>) -> Result<T, RunFailure> {
    next.spawn();
    result
}

/// Runs a (panic-contained) callback future under a timeout, flattening every way it can fail
/// into one error.
async fn bounded<T, E, Fut>(
    stage: Stage,
    limit: Duration,
    started: Result<Fut, Panicked>,
    next: &mut Next,
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
        Poll::Pending => match {
            next.spawn();
            Box::pin(timeout(limit, fut))
        }
        .await
        {
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
pub(super) struct TicketInfo {
    pub(super) lane: usize,
    pub(super) run_id: RunId,
    pub(super) participation: Participation,
}

/// Where and why a run failed before its finalizer, and the cause.
type Failed = (Stage, Reason, Option<BoxError>);

impl Ticket {
    /// Ends a run whose drive was dropped before the run ended (invariant 3): gives back what
    /// it holds in its lane, and its ownership, counted failed with [`Reason::Canceled`].
    #[cold]
    fn abandon(&mut self) {
        let lane = &self.shared.lanes[self.info.lane];
        let waiting = match self.holds.get() {
            Holds::Nothing => None,
            Holds::Slot(slot) => {
                self.release(slot);
                None
            }
            waits => Some(waits),
        };
        // A waiting run: granted its slot or failed by a shut (the latch says), or still in
        // line, where it is withdrawn from; or taken out of line by a grant whose latch is on
        // its way (set just after its granter's lock).
        if let Some(waits) = waiting {
            // Looked for in line and not found: the latch is on its way.
            let mut missed = false;
            loop {
                match self.signal().grant_state() {
                    Decision::Granted(slot) => break self.release(slot),
                    Decision::Shut(_) => break,
                    Decision::Waiting if missed => std::thread::yield_now(),
                    Decision::Waiting => {
                        if lane.withdraw(waits, self.signal()) {
                            break;
                        }
                        missed = true;
                    }
                }
            }
        }
        self.signal = None;
        self.shared.complete(self.info.lane, Some(Reason::Canceled));
        // After the run is over: a subscriber that panics here leaves nothing owned. Contained:
        // a ticket may be dropped by an unwinding panic (a subscriber's own, at the run's
        // admission), where a second panic out of this drop would abort the process.
        let _ = crate::util::call_contained(|| self.tell_abandoned());
    }

    /// The event of an abandoned run (out of line, as `abandon` is cold).
    #[inline(never)]
    fn tell_abandoned(&self) {
        tracing::debug!(
            lane = %self.lane_name(),
            run = self.info.run_id.get(),
            "dropped before it ended (its runtime shut down): canceled, not finalized"
        );
    }

    pub(super) fn new(
        shared: Arc<SetShared>,
        info: TicketInfo,
        start: Start,
        signal: Arc<RunSignal>,
        (queue_timeout, execution_timeout): (Timeout, Timeout),
        limit: Option<Throttle>,
    ) -> Self {
        let holds = Progress::new(start.holds());
        let signal = Some(signal);
        Self { shared, info, start, signal, queue_timeout, execution_timeout, limit, holds }
    }

    /// The run's signal, until it ends.
    #[inline(always)]
    pub(super) fn signal(&self) -> &Arc<RunSignal> {
        self.signal.as_ref().expect("a run's signal is kept until it ends")
    }

    /// Gives execution slot `slot` back, as a run does after its job: to the next queued run.
    fn release(&self, slot: usize) {
        self.signal().forget_driver();
        // No task carries what it grants: a ticket dropped unfinished may be dropped on any
        // runtime's thread (one spawning it on its shut-down home, say).
        drop(self.shared.release_execution(self.info.lane, slot, None));
    }

    fn lane_name(&self) -> Arc<str> {
        self.shared.lanes[self.info.lane].name.clone()
    }

    fn failure(&self, stage: Stage, reason: Reason, cause: Option<BoxError>) -> RunFailure {
        let TicketInfo { run_id, participation, .. } = self.info;
        RunFailure::new(run_id, self.lane_name(), participation, stage, reason, cause)
    }

    /// Records an audit event, bounded by `audit_timeout`. `Ok` at once without a hook, with
    /// no future set up; boxed with one, to keep the run's state machine small for the common
    /// case.
    fn audit<'a>(&'a self, kind: AuditKind, next: &'a mut Next) -> Audited<'a> {
        Audited(self.shared.audit.as_ref().map(|audit| {
            Box::pin(self.record(audit, kind, next)) as BoxFuture<'a, Result<(), BoxError>>
        }))
    }

    async fn record(
        &self,
        audit: &Arc<dyn Audit>,
        kind: AuditKind,
        next: &mut Next,
    ) -> Result<(), BoxError> {
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
        bounded(stage, limit, call_contained(|| audit.record(event)), next).await
    }
}

/// An audit record in progress ([`Ticket::audit`]): none without a hook.
#[must_use = "an audit records nothing unless awaited"]
struct Audited<'a>(Option<BoxFuture<'a, Result<(), BoxError>>>);

impl Future for Audited<'_> {
    type Output = Result<(), BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.0 {
            None => Poll::Ready(Ok(())),
            Some(record) => record.as_mut().poll(cx),
        }
    }
}

/// Drives one run from admission to the end of its cleanup (invariant 1).
///
/// An `async` block rather than an `async fn`: an async fn copies its arguments into locals, so
/// its state machine would hold them twice.
///
/// `end` receives the run's result and the parked run it granted its slot to: [`background`]
/// or [`blocking`] (a function, so that no wrapping future stores this one twice).
#[allow(clippy::manual_async_fn, reason = "an async fn would hold its arguments twice")]
// Always inlined, with `in_box`: see there.
#[inline(always)]
pub(super) fn drive<J, F, O>(
    mut t: Ticket,
    callbacks: Callbacks<J, F>,
    end: fn(Ended<F::Output>) -> O,
) -> impl Future<Output = O> + Send
where
    J: Job,
    F: Finalize<J::Output>,
    O: Send,
{
    // One span per run, from admission to the end of its cleanup: the grant, the job, the
    // finalizer and the cleanup are its events. Its fields are evaluated only if it is enabled.
    let span = tracing::debug_span!(
        "lanes.run",
        lane = %t.lane_name(),
        run = t.info.run_id.get(),
        participation = ?t.info.participation,
    );
    // Taken apart here, not in the block: the block keeps its captures for its whole life, and
    // fields moved out of one there would take room twice.
    let Callbacks { job, finalizer, cleanup } = callbacks;
    let run = async move {
        // Mentioned first, so captured first: a drive dropped before its run ends (invariant 3)
        // drops them before its ticket, whose drop ends the run, as when it took them apart.
        let _ = (&job, &finalizer, &cleanup);
        // The run this one gives its execution slot to, if it was parked (see `Next`).
        let mut next = Next::default();
        // Queue, start audit and execution; the execution slot goes back before anything else.
        // The grant's answer lives in a block of its own, which ends before the awaits that
        // follow: a local taken apart keeps its room until its scope ends.
        let executed = 'executed: {
            let (slot, permit) = {
                let (granted, since) = match t.start {
                    Start::Executing { slot } => (Ok((slot, None)), None),
                    Start::Queued { seq, deadline, since } => match t.signal().grant_state() {
                        // A parked run starts once granted: no wait to set up. One a shut
                        // cancelled between its grant and its start (`RunSignal::wake_driver`)
                        // starts all the same, as a run the shut found executing, and reads the
                        // cancellation there.
                        Decision::Granted(slot) => {
                            (granted(&t, slot).map(|slot| (slot, None)), since)
                        }
                        _ => (await_grant(&t, seq, deadline).await.map(|slot| (slot, None)), since),
                    },
                    // Boxed: most runs name no limit, and their state machine stays small.
                    Start::Limited { seq, deadline, since } => {
                        (Box::pin(await_permit(&t, seq, deadline)).await, since)
                    }
                };
                t.holds.set(match &granted {
                    Ok((slot, _)) => Holds::Slot(*slot),
                    Err(_) => Holds::Nothing,
                });
                if let (Ok(_), Some(since)) = (&granted, since) {
                    let waited = since.elapsed().as_secs_f64();
                    t.shared.lanes[t.info.lane].metrics.queue_wait.record(waited);
                }
                match granted {
                    Ok(granted) => granted,
                    Err(failed) => break 'executed Err(failed),
                }
            };
            tracing::debug!(slot, permit = permit.is_some(), "granted");
            let executed = match t.audit(AuditKind::Started, &mut next).await {
                Err(err) => Err((Stage::Start, Reason::Audit, Some(err))),
                Ok(()) => {
                    let started = crate::observe::timing_start();
                    let executed = execute(&t, job, permit).await;
                    if let Some(started) = started {
                        let ran = started.elapsed().as_secs_f64();
                        t.shared.lanes[t.info.lane].metrics.run.record(ran);
                    }
                    executed
                }
            };
            // The run waits on its signal no more: its task's waker goes now, outside any
            // lock, rather than with the signal (which the lane may keep for a later run).
            t.signal().forget_driver();
            // Before the release: should anything unwind out of it after the slot went to
            // the next run, the ticket's drop must not give it back again.
            t.holds.set(Holds::Nothing);
            next = t.shared.release_execution(t.info.lane, slot, Some(t.signal().home()));
            match &executed {
                Ok(_) => tracing::debug!("job ended"),
                Err((stage, reason, _)) => {
                    tracing::debug!(stage = stage.as_str(), reason = reason.as_str(), "job failed");
                }
            }
            executed
        };

        // Terminal audit, before the finalizer. A run whose start audit failed gets none.
        let outcome = match executed {
            Ok(value) => match t.audit(AuditKind::Completed, &mut next).await {
                Ok(()) => Ok(value),
                Err(err) => Err(t.failure(Stage::Terminal, Reason::Audit, Some(err))),
            },
            Err((stage, reason, cause)) => {
                let mut fail = t.failure(stage, reason, cause);
                if stage != Stage::Start
                    && let Err(err) = t.audit(AuditKind::Failed { stage, reason }, &mut next).await
                {
                    fail.attach(Stage::Terminal, err);
                }
                Err(fail)
            }
        };

        // Finalizer: exactly once, independent of the caller, bounded.
        // Cloned only on failure: `Option::cloned` of a run that succeeded was a call of its
        // own, out of line (15 instructions a run, cachegrind, `fixed lane 8 4` minus `2`).
        let primary = match &outcome {
            Ok(_) => None,
            Err(fail) => Some(fail.clone()),
        };
        let limit = t.shared.finalization_timeout;
        let finalize = call_contained(|| finalizer.finalize(outcome));
        let finalized = bounded(Stage::Finalization, limit, finalize, &mut next).await;
        let mut result = match (primary, finalized) {
            (None, Ok(value)) => Ok(value),
            (None, Err(err)) => Err(t.failure(Stage::Finalization, Reason::Finalizer, Some(err))),
            (Some(fail), Ok(_)) => Err(fail),
            (Some(mut fail), Err(err)) => {
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
            let cleaned = bounded(Stage::Cleanup, limit, call_contained(*cleanup), &mut next).await;
            if let Err(err) = cleaned {
                match &mut result {
                    Err(fail) => fail.attach(Stage::Cleanup, err),
                    Ok(_) => result = Err(t.failure(Stage::Cleanup, Reason::Cleanup, Some(err))),
                }
            }
        }
        let failure = result.as_ref().err().map(RunFailure::reason);
        tracing::debug!(outcome = failure.map_or("ok", Reason::as_str), "finalized");
        // Taken first: the run has ended, and if `complete` unwinds, it is not ended again in
        // the ticket's drop. A background run's task leaves the spent drive in it (see `work`).
        next.spent = t.signal.take();
        t.shared.complete(t.info.lane, failure);
        end((result, next))
    };
    InSpan { span, inner: Some(run) }
}

/// `make`'s value, boxed: allocated first, then written into the allocation. `Box::pin(drive(..))`
/// built a run's drive on the stack, allocated, and copied all of it (544 bytes for a small
/// job) into the allocation, whose writes the next locked instruction then waited for; built
/// after the allocation by the inlined `drive`, most of it is written in place (cachegrind,
/// `fixed lane 8 30` minus `10`: 1,922 -> 1,864 instructions a run; BENCHMARKS.md, suite 2,
/// stop 55).
#[inline(always)]
pub(super) fn in_box<T>(make: impl FnOnce() -> T) -> Pin<Box<T>> {
    let slot = Box::new_uninit();
    Box::into_pin(Box::write(slot, make()))
}

pin_project_lite::pin_project! {
    /// A run's drive in its span, as `tracing`'s `Instrumented` (entered while polled, and
    /// while dropped unfinished), except that the span closes as the run ends, not when the
    /// drive's allocation is freed: a background run's spent drive is freed later, by the
    /// admission that reuses its signal (`RunSignal::bury`), and then holds nothing to drop.
    pub(super) struct InSpan<F> {
        span: tracing::Span,
        // `None` once the run ended.
        #[pin]
        inner: Option<F>,
    }

    impl<F> PinnedDrop for InSpan<F> {
        fn drop(this: Pin<&mut Self>) {
            let mut this = this.project();
            if this.inner.is_some() {
                let _entered = this.span.enter();
                this.inner.set(None);
            }
        }
    }
}

impl<F: Future> Future for InSpan<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let mut this = self.project();
        let entered = this.span.enter();
        let inner = this.inner.as_mut().as_pin_mut().expect("a run's drive polled after its end");
        let poll = inner.poll(cx);
        if poll.is_ready() {
            this.inner.set(None);
            drop(entered);
            *this.span = tracing::Span::none();
        }
        poll
    }
}

/// Waits in the queue until granted (answering the execution slot), or fails with the stage and
/// reason of the queue failure.
async fn await_grant(t: &Ticket, seq: u64, deadline: Option<Instant>) -> Result<usize, Failed> {
    enum Woke {
        Decided(Decision),
        Cancelled(Reason),
    }
    let signal = t.signal();
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
        Woke::Decided(Decision::Granted(slot)) => return granted(t, slot),
        Woke::Decided(Decision::Shut(why)) => return shut_failure(why),
        Woke::Decided(Decision::Waiting) => unreachable!("only decisions wake the queue wait"),
        Woke::Cancelled(reason) => reason,
    };
    let cause = match (reason, t.queue_timeout.get()) {
        (Reason::Timeout, Some(limit)) => {
            Some(Box::new(TimeoutError::new(Stage::Queue, limit)) as BoxError)
        }
        _ => None,
    };
    // Leave the queue, unless the lane decided first.
    {
        let lane = &t.shared.lanes[t.info.lane];
        let mut core = lane.lock_core();
        if core.withdraw(seq) {
            // Out of line before the gauges (should anything unwind): nothing held.
            t.holds.set(Holds::Nothing);
            let moves = lane.publish(&mut core);
            drop(core);
            lane.gauge(moves);
            return Err((Stage::Queue, reason, cause));
        }
    }
    // Out of the queue: shut (the latch was set under the lock), or granted a slot. A grant's
    // latch is set just after its granter's lock (`SetShared::release_execution`), so it may
    // not be set yet: wait for it, it is on its way.
    let decided = poll_fn(|cx| {
        signal.poll_driver(cx, |s| match s.grant_state() {
            Decision::Waiting => None,
            decided => Some(decided),
        })
    })
    .await;
    match decided {
        Decision::Shut(why) => shut_failure(why),
        // Granted at the same time: give the slot back, the job never started.
        Decision::Granted(slot) => {
            give_back(t, slot);
            Err((Stage::Queue, reason, cause))
        }
        Decision::Waiting => unreachable!("the wait ends on a decision"),
    }
}

/// A queued run's grant of `slot`, read: the slot, unless the run's handle was dropped before
/// the grant was read (a grant does not look at cancellation: the run that frees a slot may
/// have dropped this run's handle in the same poll). Then the slot goes back and the run fails
/// in the queue, as the handle's docs say: its job never starts. (A shut's cancellation is read
/// once executing, as for a run the shut found executing.) Inline: every queued run reads its
/// grant here, and out of line the call cost 14 instructions a run (cachegrind, `fixed lane 8
/// 4` minus `2`).
#[inline(always)]
fn granted(t: &Ticket, slot: usize) -> Result<usize, Failed> {
    if t.signal().cancel_reason() == Some(Reason::Canceled) {
        give_back(t, slot);
        return Err((Stage::Queue, Reason::Canceled, None));
    }
    Ok(slot)
}

/// Gives back the slot a queued run was granted but will not use (to the next queued run,
/// which starts when `Next` is dropped here).
#[cold]
fn give_back(t: &Ticket, slot: usize) {
    // Its waker goes first, as after a job: the lane keeps the signal for a later run.
    t.signal().forget_driver();
    t.holds.set(Holds::Nothing);
    drop(t.shared.release_execution(t.info.lane, slot, Some(t.signal().home())));
}

/// Waits for the run's permit holding no execution slot (the fusee rule: a run that waits on a
/// limit holds nothing a runnable job could use), then for a slot in readiness order, holding
/// the permit. Fails like a queued run: at [`Stage::Queue`], on close, cancellation, the queue
/// timeout, or a refusal of the limit ([`Reason::Limit`]).
async fn await_permit(
    t: &Ticket,
    seq: u64,
    deadline: Option<Instant>,
) -> Result<(usize, Option<Box<Permit>>), Failed> {
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
        let signal = t.signal();
        let mut timer = Deadline::new(deadline);
        poll_fn(|cx| {
            // A shut or a cancellation first: a permit freed by the very poll that dropped
            // this run's handle must not start its job (the acquire, dropped, gives it back).
            let stopped = signal.poll_driver(cx, |s| match s.grant_state() {
                Decision::Shut(why) => Some(Woke::Shut(why)),
                _ => s.cancel_reason().map(Woke::Cancelled),
            });
            if stopped.is_ready() {
                return stopped;
            }
            if let Poll::Ready(acquired) = acquire.as_mut().poll(cx) {
                return Poll::Ready(Woke::Permit(acquired));
            }
            timer.poll_elapsed(cx).map(|()| Woke::Cancelled(Reason::Timeout))
        })
        .await
        // The acquire future is dropped here: an unfinished wait withdraws its ticket.
    };
    let (reason, cause) = match woke {
        Woke::Permit(Ok(permit)) => {
            let (ready, moves) = {
                // Behind the runs admitted into the inbox before it became ready.
                let mut core = lane.lock_core_exact();
                let ready = core.ready(seq);
                // Where it waits now, before the gauges (should anything unwind).
                t.holds.set(match ready {
                    Some(Admitted::Executing { slot, .. }) => Holds::Slot(slot),
                    Some(Admitted::Queued { seq }) => Holds::Queued(seq),
                    _ => Holds::Nothing,
                });
                (ready, lane.publish(&mut core))
            };
            lane.gauge(moves);
            return match ready {
                // Its handle dropped meanwhile (another thread): the slot goes back, and the
                // permit with this function's end.
                Some(Admitted::Executing { slot, .. }) => {
                    granted(t, slot).map(|slot| (slot, Some(Box::new(permit))))
                }
                Some(Admitted::Queued { seq }) => {
                    let permit = Box::new(permit);
                    await_grant(t, seq, deadline).await.map(|slot| (slot, Some(permit)))
                }
                Some(Admitted::Limited { .. }) => unreachable!("a ready run is not limited"),
                // Detached by a shut while the permit was being granted.
                None => match t.signal().grant_state() {
                    Decision::Shut(why) => shut_failure(why),
                    _ => unreachable!("only a shut detaches a limited run"),
                },
            };
        }
        Woke::Permit(Err(err)) => (Reason::Limit, Some(Box::new(err) as BoxError)),
        Woke::Shut(why) => return shut_failure(why),
        Woke::Cancelled(reason) => {
            let cause = match (reason, t.queue_timeout.get()) {
                (Reason::Timeout, Some(limit)) => {
                    Some(Box::new(TimeoutError::new(Stage::Queue, limit)) as BoxError)
                }
                _ => None,
            };
            (reason, cause)
        }
    };
    let mut core = lane.lock_core();
    if core.withdraw_limited(seq) {
        t.holds.set(Holds::Nothing);
        let moves = lane.publish(&mut core);
        drop(core);
        lane.gauge(moves);
        return Err((Stage::Queue, reason, cause));
    }
    match t.signal().grant_state() {
        Decision::Shut(why) => shut_failure(why),
        _ => unreachable!("only a shut detaches a limited run"),
    }
}

/// Runs the job until it ends, or until it is cancelled and then ends within the drain timeout.
/// A job that outlives the drain timeout poisons the set and is dropped.
///
/// The permit is boxed: most runs name no limit, and a permit inline (40 bytes) took its room
/// twice in every run's drive, in the drive and in this future (BENCHMARKS.md, suite 2).
async fn execute<J: Job>(
    t: &Ticket,
    job: J,
    permit: Option<Box<Permit>>,
) -> Result<J::Output, Failed> {
    let panicked = || {
        let cause = Box::new(PanicError::new(Stage::Execution)) as BoxError;
        Err((Stage::Execution, Reason::Panic, Some(cause)))
    };
    // The execution clock starts at grant (the run's permit, if any, is held already).
    let mut deadline = Deadline::new(t.execution_timeout.get().map(|limit| Instant::now() + limit));
    // Dropped when this function returns: after the job, before the finalizer.
    let _permit = permit;
    let cx = RunContext {
        run_id: t.info.run_id,
        lane: t.shared.lanes[t.info.lane].label,
        participation: t.info.participation,
        signal: t.signal().clone(),
    };
    let Ok(fut) = call_contained(|| job.start(cx)) else {
        return panicked();
    };
    let mut fut = pin!(CatchUnwind::new(fut));
    let signal = t.signal();
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
    let cause = match (reason, t.execution_timeout.get()) {
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

#[cfg(test)]
mod tests {
    use super::{At, Runtimes, runtime_key};

    /// Noting a new runtime forgets the ones that have shut down: a run of one of those is
    /// then dropped where it is granted (`At::Gone`), not spawned on its handle.
    #[test]
    fn a_new_runtime_noted_forgets_those_shut_down() {
        let runtimes = Runtimes::default();
        let (first, second) = (current_thread(), current_thread());
        let keys = [runtime_key(first.handle()), runtime_key(second.handle())];
        runtimes.note(keys[0], first.handle());
        runtimes.note(keys[1], second.handle());
        assert!(matches!(runtimes.at(keys[0]), At::Home(_)), "both are known");
        drop(first);
        assert!(matches!(runtimes.at(keys[0]), At::Home(_)), "kept until a new one is noted");
        let third = current_thread();
        runtimes.note(runtime_key(third.handle()), third.handle());
        assert!(matches!(runtimes.at(keys[0]), At::Gone), "the shut-down one is forgotten");
        assert!(matches!(runtimes.at(keys[1]), At::Home(_)), "the live one is kept");
    }

    fn current_thread() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().build().unwrap()
    }

    /// A runtime's key is the number tokio's id is, never 0, and a runtime made after another
    /// has gone gets a key of its own.
    #[test]
    fn a_runtime_key_is_its_id() {
        let first = current_thread();
        let key = runtime_key(first.handle());
        assert_eq!(key, first.handle().id().to_string().parse::<u64>().unwrap());
        assert_ne!(key, 0);
        drop(first);
        let second = current_thread();
        assert_ne!(runtime_key(second.handle()), key);
    }
}
