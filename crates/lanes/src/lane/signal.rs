//! The per-run signal shared by a run's driver, its job context and its lane.
//!
//! Two independent one-way latches and one `Notify`:
//! - the *grant* latch moves once, under the driver slot's lock, from waiting to granted, closed
//!   or poisoned (closed and poisoned by the lane under the lane's lock; granted by the run
//!   that freed the slot, right after it decided the grant under the lane's lock);
//! - the *cancel* latch moves once from none to a reason (set by the caller's handle, the
//!   execution timeout, close or poison); the first reason wins.
//!
//! The run's driver task waits through a single slot, polled in place (no future to store). A
//! background run that waits in the queue without a deadline has no task yet: its slot holds
//! the run itself, [parked](RunSignal::park), and the move of its grant latch starts it, on its
//! home (a cancellation leaves it there for its granter: see `wake_driver`). Anyone else (a
//! job awaiting [`RunContext::cancelled`](super::RunContext::cancelled), possibly from other
//! tasks) waits on the `Notify`. Both register *before* re-reading the
//! latches, so a change between the read and the wait cannot be missed. Once a background run
//! ended, the slot holds its spent drive until the signal is reused ([`RunSignal::bury`]).

use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};

use tokio::sync::Notify;

use crate::util::{SpinLock, same_waker, spin_lock};

use super::core::Shut;
use super::driver::{Parked, Runtimes, Step};
use super::error::Reason;

const WAITING: u8 = 0;
const GRANTED: u8 = 1;
const CLOSED: u8 = 2;
const POISONED: u8 = 3;

/// The largest spent drive a signal keeps ([`RunSignal::bury`]): glibc's per-thread cache
/// holds blocks of up to 1,032 bytes, and this stays within it; a lane's kept signals (2,048
/// at most) then keep at most 2 MiB.
const BURIED_MAX: usize = 1024;

/// What the lane decided for a queued run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    Waiting,
    /// Granted execution slot `slot`.
    Granted(usize),
    Shut(Shut),
}

/// Who waits for the run's latches in its driver's place; once the run ended, what is left of
/// it.
enum Driver {
    None,
    Task(Waker),
    Parked(Parked),
    /// The spent drive of a background run that ended, freed when the signal is reset.
    Spent(Step),
}

/// A driver a latch's move took out under its taker's lock ([`RunSignal::shut_later`]), to be
/// woken once the taker released it: a parked run woken is started, and one started on a
/// runtime that has shut down ends at once, which takes its lane's lock.
#[must_use = "a driver taken out is woken, or its run never learns of the decision"]
pub(crate) struct Woken {
    driver: Driver,
    /// The run's home: a parked run is started there (driver invariant 4).
    home: u64,
}

impl Woken {
    pub(super) fn wake(self, runtimes: &Runtimes) {
        match self.driver {
            Driver::Parked(run) => run.start_home(self.home, runtimes),
            driver => driver.wake(),
        }
    }
}

impl Driver {
    /// Wakes the driver task, taken out of the slot (after its lock). A parked run is started
    /// by a grant or a shut, on its home ([`Woken::wake`], `driver::Next::push`), not here
    /// (`wake_driver` leaves it in its slot); were one to come here, it is started on the
    /// current runtime rather than lost.
    fn wake(self) {
        match self {
            Self::Task(waker) => waker.wake(),
            Self::Parked(run) => run.start(),
            Self::None | Self::Spent(_) => {}
        }
    }
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::None => "None",
            Self::Task(_) => "Task",
            Self::Parked(_) => "Parked",
            Self::Spent(_) => "Spent",
        })
    }
}

#[derive(Debug)]
pub(crate) struct RunSignal {
    grant: AtomicU8,
    /// The execution slot, valid once `grant` is `GRANTED`.
    slot: AtomicUsize,
    cancel: AtomicU8,
    /// The driver task's waker, or the parked run whose driver is not spawned yet, or the
    /// spent drive of the run that ended ([`bury`](Self::bury)). Held for a value's swap (or a
    /// waker's comparison and clone, a park's look at the latches, or a move of the grant latch,
    /// [`decide`](Self::decide)); a queued run takes it to park, the run that grants it a slot
    /// to take it out, and its task to bury its drive, once each per run on the lane's hot
    /// path. So a `SpinLock`, released with a plain store where
    /// std's mutex releases with a second locked instruction. Stop 52, AMD host: cachegrind,
    /// `fixed lane 8 30` minus `10`, 1,970 → 1,915 instructions a run; paired against the
    /// hand-rolled lane (alternating builds), one thread 1.23–1.25× → 1.30–1.34×, two workers
    /// medians 1.075× → 1.115× over six processes each.
    driver: SpinLock<Driver>,
    /// Whether the driver task ever left its waker in `driver`: written and read by the
    /// driver task alone, so that a run that never waited forgets no waker under the lock.
    registered: AtomicBool,
    /// Other waiters: only ever wait for cancellation.
    notify: Notify,
    /// The runtime the run was admitted on, its home (driver invariant 4), as
    /// [`driver::runtime_key`](super::driver::runtime_key) numbers it: written by the admission
    /// before the signal is published under a lane's or an inbox's lock, read by whoever
    /// grants the run a slot after taking that lock.
    home: AtomicU64,
}

// As std's mutex is, which the driver slot's lock was: a panic under the lock leaves the slot
// whole (each critical section stores one value, or none), and nothing relied on poisoning.
// Without these, the spin lock's cell would make a run's context and handle unwind-unsafe
// (`tests/lane.rs`, `a_runs_context_and_handle_are_unwind_safe`).
impl std::panic::UnwindSafe for RunSignal {}
impl std::panic::RefUnwindSafe for RunSignal {}

#[cfg(test)]
thread_local! {
    /// Signals made on this thread (a test's admissions), to tell a reuse from a new one.
    pub(super) static MADE: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl RunSignal {
    pub(crate) fn new() -> Self {
        #[cfg(test)]
        MADE.with(|made| made.set(made.get() + 1));
        Self {
            grant: AtomicU8::new(WAITING),
            slot: AtomicUsize::new(0),
            cancel: AtomicU8::new(0),
            driver: SpinLock::new(Driver::None),
            registered: AtomicBool::new(false),
            notify: Notify::new(),
            home: AtomicU64::new(0),
        }
    }

    /// The runtime its run was admitted on ([`home`](Self::home)).
    pub(super) fn home(&self) -> u64 {
        self.home.load(Ordering::Relaxed)
    }

    /// Notes the runtime its run is admitted on, before the signal is published.
    pub(super) fn set_home(&self, home: u64) {
        self.home.store(home, Ordering::Relaxed);
    }

    /// Makes a signal of an ended run as good as new, for the next run (see
    /// `handle::LaneState`): it is only reached through `Arc::get_mut`, so nobody else holds it.
    pub(super) fn reset(&mut self) {
        *self.grant.get_mut() = WAITING;
        *self.slot.get_mut() = 0;
        *self.cancel.get_mut() = 0;
        *self.registered.get_mut() = false;
        self.notify = Notify::new();
        // The ended run's spent drive, if its task left it here, is freed here, on the admitting
        // thread, under the admission's lock: it holds nothing (its run ended, and its span
        // closed then, see `driver::InSpan`), so dropping it is the allocator's free, cheap while
        // glibc's per-thread cache has room for the block (a full cache takes the block's arena
        // lock here). Freed after the lock instead, the plumbing cost a refusal 10 instructions
        // and about a fifth of its speed (`fixed reject`).
        if let Driver::Spent(step) = std::mem::replace(self.driver.get_mut(), Driver::None) {
            drop(step);
        }
    }

    /// Whether a driver (a task's waker or a parked run) waits on the latches.
    #[cfg(test)]
    pub(super) fn has_driver(&self) -> bool {
        matches!(*spin_lock(&self.driver), Driver::Task(_) | Driver::Parked(_))
    }

    /// Whether the ended run's spent drive waits here to be freed.
    #[cfg(test)]
    pub(super) fn holds_spent(&self) -> bool {
        matches!(*spin_lock(&self.driver), Driver::Spent(_))
    }

    /// The run's driver waits on the latches no more (its job ended): drops the waker it left.
    /// Called by the driver task, which alone leaves a waker there: a driver that never waited
    /// left none (a parked run's slot was emptied when it was started), and takes no lock.
    pub(super) fn forget_driver(&self) {
        if !self.registered.load(Ordering::Relaxed) {
            debug_assert!(!matches!(*spin_lock(&self.driver), Driver::Parked(_)), "not parked");
            return;
        }
        self.registered.store(false, Ordering::Relaxed);
        let driver = std::mem::replace(&mut *spin_lock(&self.driver), Driver::None);
        debug_assert!(!matches!(driver, Driver::Parked(_)), "an executed run is not parked");
        drop(driver);
    }

    /// Grants execution slot `slot`: wakes the driver task, or hands a parked run back to the
    /// caller to start.
    pub(super) fn grant(&self, slot: usize) -> Option<Parked> {
        match self.decide(GRANTED, slot)? {
            Driver::Task(waker) => {
                waker.wake();
                None
            }
            Driver::Parked(run) => Some(run),
            Driver::None | Driver::Spent(_) => None,
        }
    }

    /// Fails the run for a shut, under its lane's lock: answers what to wake once the caller
    /// let go of it.
    pub(crate) fn shut_later(&self, why: Shut) -> Option<Woken> {
        let value = match why {
            Shut::Closed => CLOSED,
            Shut::Poisoned => POISONED,
        };
        let home = self.home();
        self.decide(value, 0).map(|driver| Woken { driver, home })
    }

    /// Moves the grant latch from waiting to `value` (and stores `slot`, published by the
    /// latch's release), and takes out whoever waits on it; `None` if the latch had moved.
    /// Decided under the driver slot's lock, which every move of the latch takes (the slot
    /// had to be emptied anyway), rather than by a compare-and-swap before it: one locked
    /// instruction a grant instead of two.
    fn decide(&self, value: u8, slot: usize) -> Option<Driver> {
        let mut driver = spin_lock(&self.driver);
        // Relaxed: the latch only moves under this lock (or in `reset`, through `&mut`).
        if self.grant.load(Ordering::Relaxed) != WAITING {
            return None;
        }
        self.slot.store(slot, Ordering::Relaxed);
        self.grant.store(value, Ordering::Release);
        Some(std::mem::replace(&mut *driver, Driver::None))
    }

    fn wake_driver(&self) {
        // Taken out under the lock and woken after it. A parked run is left where it is: one
        // is cancelled only when a shut finds it granted a slot and not yet told (its granter
        // is between the lane's lock and the latch), and the granter takes it out and starts
        // it on its home (driver invariant 4), where it reads the cancellation. Started here,
        // it would run on the cancelling thread's runtime, or, with none, end at once and take
        // the lane's lock the shut holds.
        let driver = {
            let mut slot = spin_lock(&self.driver);
            if matches!(*slot, Driver::Parked(_)) {
                return;
            }
            std::mem::replace(&mut *slot, Driver::None)
        };
        driver.wake();
    }

    /// Keeps `step`, the spent drive of the background run that ended, until the lane reuses
    /// this signal for a run it admits, which frees it ([`reset`](Self::reset)): the thread
    /// that frees the block is then the one that allocates the next drive. Freed by the worker
    /// that ran it, glibc's malloc gave the block back to the admitting thread's arena under
    /// that arena's lock, which the admitting thread's allocations take too: on two workers
    /// malloc, free and the futex waits and wakes of that lock were a quarter of the lane's
    /// samples (BENCHMARKS.md, suite 2, stop 54). A drive larger than [`BURIED_MAX`] is freed
    /// at once, so that the kept signals keep little memory; so is one whose signal holds
    /// anything else (a queue-failed run's waker), and a signal that is not kept is dropped
    /// with its spent drive.
    pub(super) fn bury(&self, step: Step) {
        if size_of_val(&*step) > BURIED_MAX {
            return;
        }
        let mut driver = spin_lock(&self.driver);
        if matches!(*driver, Driver::None) {
            *driver = Driver::Spent(step);
        } else {
            drop(driver);
            drop(step);
        }
    }

    /// Parks a queued run until either latch changes, when `run` is started (its driver
    /// spawned, and it reads the latches on its first poll). Started at once if a latch changed
    /// already: the grant latch moves under the slot's lock, the cancel latch is set before the
    /// slot is emptied, and both are read here under that lock, so one of the two sides sees
    /// the other.
    pub(super) fn park(&self, run: Parked) {
        let mut driver = spin_lock(&self.driver);
        let decided =
            self.grant.load(Ordering::Acquire) != WAITING || self.cancel_reason().is_some();
        if decided {
            drop(driver);
            run.start();
        } else {
            *driver = Driver::Parked(run);
        }
    }

    pub(crate) fn grant_state(&self) -> Decision {
        match self.grant.load(Ordering::Acquire) {
            WAITING => Decision::Waiting,
            GRANTED => Decision::Granted(self.slot.load(Ordering::Relaxed)),
            CLOSED => Decision::Shut(Shut::Closed),
            _ => Decision::Shut(Shut::Poisoned),
        }
    }

    /// Requests cancellation; the first reason wins. Returns whether this call set it.
    pub(crate) fn cancel(&self, reason: Reason) -> bool {
        let code = encode(reason);
        let first =
            self.cancel.compare_exchange(0, code, Ordering::AcqRel, Ordering::Acquire).is_ok();
        if first {
            self.wake_driver();
            self.notify.notify_waiters();
        }
        first
    }

    #[inline]
    pub(crate) fn cancel_reason(&self) -> Option<Reason> {
        decode(self.cancel.load(Ordering::Acquire))
    }

    /// For the driver task: `Ready` once `ready` returns `Some`, else registers the task to be
    /// woken on the next change of either latch.
    pub(crate) fn poll_driver<T>(
        &self,
        cx: &mut Context<'_>,
        ready: impl Fn(&Self) -> Option<T>,
    ) -> Poll<T> {
        if let Some(value) = ready(self) {
            return Poll::Ready(value);
        }
        {
            let mut slot = spin_lock(&self.driver);
            debug_assert!(!matches!(*slot, Driver::Parked(_)), "a parked run has no driver");
            match &*slot {
                Driver::Task(waker) if same_waker(waker, cx.waker()) => {}
                _ => *slot = Driver::Task(cx.waker().clone()),
            }
            self.registered.store(true, Ordering::Relaxed);
        }
        // Re-read: a latch set before the registration did not see this waker.
        ready(self).map_or(Poll::Pending, Poll::Ready)
    }

    /// For anyone but the driver: resolves on cancellation.
    pub(crate) async fn cancelled(&self) -> Reason {
        loop {
            let mut notified = pin!(self.notify.notified());
            notified.as_mut().enable();
            if let Some(reason) = self.cancel_reason() {
                return reason;
            }
            notified.await;
        }
    }
}

fn encode(reason: Reason) -> u8 {
    match reason {
        Reason::Canceled => 1,
        Reason::Timeout => 2,
        Reason::Closed => 3,
        _ => 4,
    }
}

fn decode(code: u8) -> Option<Reason> {
    match code {
        0 => None,
        1 => Some(Reason::Canceled),
        2 => Some(Reason::Timeout),
        3 => Some(Reason::Closed),
        _ => Some(Reason::Poisoned),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lane::driver::Next;

    /// A parked run that a cancellation reaches (a shut that found it granted its slot and not
    /// yet told: its granter is between the lane's lock and the latch) is left where it waits,
    /// for the grant to take out and start on its home. Started by the cancellation instead,
    /// it ran on the cancelling thread's runtime, or, with none (as here), ended at once, which
    /// takes the lane's lock the shut holds.
    #[test]
    fn a_cancellation_leaves_a_parked_run_to_its_grant() {
        let signal = RunSignal::new();
        signal.park(Parked(Box::pin(async { Next::default() })));
        assert!(signal.cancel(Reason::Closed));
        assert!(signal.has_driver(), "the parked run waits for its grant");
        assert!(signal.grant(0).is_some(), "the grant takes the parked run out");
        assert!(!signal.has_driver());
    }
}
