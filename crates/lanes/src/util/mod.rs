//! Small shared helpers: panic containment for futures and callbacks, the FIFO list of
//! waiting tasks every primitive's blocked callers queue in, and a per-thread tally for counts
//! added on hot paths.

mod tally;
mod wait_list;

use std::collections::HashMap;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

pub(crate) use tally::Tally;
pub(crate) use wait_list::{WaitKey, WaitList};

/// The one copy of `name` kept for the life of the process: names that identify configured
/// things (lanes) are interned so that a refusal or a job's context can name them without a
/// reference count. Only configured names come here, never names a caller passes to look
/// something up, so the table grows with the configuration, not with traffic.
pub(crate) fn intern(name: &str) -> &'static str {
    static NAMES: Mutex<Option<std::collections::HashSet<&'static str>>> = Mutex::new(None);
    let mut names = lock(&NAMES);
    let names = names.get_or_insert_with(Default::default);
    match names.get(name) {
        Some(interned) => interned,
        None => {
            let interned: &'static str = Box::leak(name.into());
            names.insert(interned);
            interned
        }
    }
}

/// A value on cache lines of its own (128 bytes: a line and its adjacent-line prefetch), so that
/// a field one thread writes often does not slow another thread's access to its neighbours.
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct Padded<T>(pub(crate) T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

/// Whether waking `a` does what waking `b` does: [`Waker::will_wake`], or the same data with a
/// vtable of the same functions. `will_wake` compares the vtables' addresses, and a runtime
/// can hand out one waker under two copies of its vtable (tokio's `block_on` waker: the one a
/// poll borrows and its clones differ), which would make every comparison fail and every kept
/// waker a fresh clone.
#[inline]
pub(crate) fn same_waker(a: &Waker, b: &Waker) -> bool {
    a.will_wake(b) || (a.data() == b.data() && a.vtable() == b.vtable())
}

/// Keeps `waker` in `slot`, cloning it only when the slot holds none or another one.
#[inline]
pub(crate) fn keep_waker(slot: &mut Option<Waker>, waker: &Waker) {
    match slot {
        Some(current) if same_waker(current, waker) => {}
        _ => *slot = Some(waker.clone()),
    }
}

/// A panic was caught. The payload is dropped on the spot: it can carry user data, so it never
/// reaches an error message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Panicked;

/// Drops a panic payload without letting a panicking `Drop` escape.
fn discard(payload: Box<dyn std::any::Any + Send>) {
    let _ = catch_unwind(AssertUnwindSafe(move || drop(payload)));
}

/// Calls `f`, turning a panic into [`Panicked`].
pub(crate) fn call_contained<R>(f: impl FnOnce() -> R) -> Result<R, Panicked> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        discard(payload);
        Panicked
    })
}

/// A `metrics` handle whose calls into the recorder cannot unwind into the caller: a
/// recorder that panics (user code) is contained, its panic reported by the panic hook, and
/// the metric misses that update. For primitives whose calls sit under a lock or between a
/// change and what completes it (a run lane, a keyed limit, a channel), where a panic unwound
/// from the call would leave capacity held, a waiter stranded or records unsettled. (A pool
/// contains its calls in groups with [`call_contained`].) Without a recorder the handle is a
/// no-op; the containment costs about 6 instructions a call.
pub(crate) struct Contained<H>(pub(crate) H);

impl Contained<metrics::Counter> {
    #[inline]
    pub(crate) fn increment(&self, value: u64) {
        let _ = call_contained(|| self.0.increment(value));
    }
}

impl Contained<metrics::Gauge> {
    #[inline]
    pub(crate) fn increment(&self, value: f64) {
        let _ = call_contained(|| self.0.increment(value));
    }

    #[inline]
    pub(crate) fn decrement(&self, value: f64) {
        let _ = call_contained(|| self.0.decrement(value));
    }
}

impl Contained<metrics::Histogram> {
    #[inline]
    pub(crate) fn record(&self, value: f64) {
        let _ = call_contained(|| self.0.record(value));
    }
}

pin_project_lite::pin_project! {
    /// Polls `inner`, turning a panic into [`Panicked`]. After a panic the inner future is never
    /// polled again. Dropped, it drops `inner` in place with a panicking `Drop` contained: a
    /// future abandoned before its end (a run's job at the drain timeout, a callback past its
    /// limit) is pinned in its caller's frame, and its panic would unwind through the caller.
    #[derive(Debug)]
    pub(crate) struct CatchUnwind<F> {
        #[pin]
        inner: Option<F>,
        panicked: bool,
    }

    impl<F> PinnedDrop for CatchUnwind<F> {
        fn drop(this: Pin<&mut Self>) {
            let mut inner = this.project().inner;
            if inner.is_some() {
                let _ = call_contained(move || inner.set(None));
            }
        }
    }
}

impl<F> CatchUnwind<F> {
    pub(crate) fn new(inner: F) -> Self {
        Self { inner: Some(inner), panicked: false }
    }
}

impl<F: Future> Future for CatchUnwind<F> {
    type Output = Result<F::Output, Panicked>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let Some(inner) = this.inner.as_pin_mut().filter(|_| !*this.panicked) else {
            return Poll::Ready(Err(Panicked));
        };
        match call_contained(move || inner.poll(cx)) {
            Ok(Poll::Ready(value)) => Poll::Ready(Ok(value)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(Panicked) => {
                *this.panicked = true;
                Poll::Ready(Err(Panicked))
            }
        }
    }
}

/// Locks a mutex whose critical sections never panic; a poisoned lock is still consistent.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The lock of a channel's state, a run lane's core, a run's signal and a pool's engine (`spin`'s
/// spin mutex): taken with one compare-and-swap and released with a plain store. std's mutex is
/// released with a swap, to learn whether a sleeper must be woken: a second locked instruction per
/// record on a channel's path, which waits for the record's copy into the buffer to leave the store
/// buffer. On the Xeon host of stop 49 the producer's lock and unlock took three quarters of its
/// samples; with this lock the one-thread channel went from 0.91–0.97× kanal to 1.13–1.20× with
/// `u64` records, and from 0.72× and 0.86× to 0.86× and 1.04× with 256-byte ones, at capacities 64
/// and 1,024 (paired rounds).
///
/// Nobody sleeps on it in the kernel: a waiter spins briefly, then yields its core until the lock
/// is free ([`spin_lock`]). That suits a lock held for a push, a take or a count (a ring's growth
/// at most) on the hot paths, and taken mostly by a runtime's workers (about as many threads as
/// cores). It is never held across an await (`clippy.toml` makes holding its guard across one a
/// lint error: the guard is `Send`, so the compiler would not refuse it). Some paths do more under
/// it: a channel with a shared budget takes the budget's lock and wakes its waiters; a lane's
/// `shut` wakes or starts each of its runs; a pool runs the user's key function and the key's
/// `Hash`, `Eq`, `Clone` and `Drop` on each keyed submit (documented at `key_of`), and compacts its
/// key table as keys go idle. It is not re-entrant (neither is std's): code run under it must not
/// take it again. A lane's `shut` takes each run's signal under the lane's core; nothing takes a
/// lane's core under a signal. It does not poison: a panic while holding it releases it, and the
/// critical sections leave their cores consistent (as with [`lock`]).
pub(crate) type SpinLock<T> = spin::mutex::SpinMutex<T>;

/// A held [`SpinLock`].
pub(crate) type SpinGuard<'a, T> = spin::mutex::SpinMutexGuard<'a, T>;

/// Takes a [`SpinLock`]: at once if it is free, else after spinning a while ([`SPIN_BUDGET`]),
/// then yielding the core between tries for as long as it is held. (std's mutex spins for up
/// to 100 rounds, then sleeps in the kernel, and its owner's unlock must then wake it with a
/// system call; stops 47 and 48 measured a wait like this one's against it, BENCHMARKS.md.)
#[inline(always)]
pub(crate) fn spin_lock<T>(lock: &SpinLock<T>) -> SpinGuard<'_, T> {
    lock.try_lock().unwrap_or_else(|| spin_contended(lock))
}

/// The pauses (`spin_loop`) a waiter for a [`SpinLock`] spends before it starts yielding its
/// core. Its holder is usually running on another core and done within a push or a take, so
/// a wait that yields early pays a system call per look while the lock is about to come free.
/// Stop 50, two workers, `fixed pool 1 100` (one key: the submitter and one worker take the
/// lock for every item), one process per reading: stop 49's 28 pauses (looks after rounds of
/// 4, 8 and 16) read 10.7-11.0 M/s in four processes of five (17.1 in one), an eighth of the
/// samples in `sched_yield`; 252 pauses 14.4-15.6 M/s; this budget 15.6-21.2 M/s in six
/// processes.
const SPIN_BUDGET: u32 = 1024;

/// The most pauses between two looks at the lock. Each look reads the lock's line, which the
/// holder must then take back to release it: looking every 16 pauses with the same budget
/// read 9.5-12.2 M/s in the runs above.
const SPIN_ROUND: u32 = 64;

/// [`spin_lock`]'s wait. A try is made only once the lock looks free, so that waiters read
/// the lock's line rather than take it from its holder. Looks come after rounds of 4, 8, 16
/// and 32 pauses, then every 64 until [`SPIN_BUDGET`] is spent; then the waiter yields its core
/// between looks (a holder that was preempted needs it when there are more threads than cores).
#[cold]
#[inline(never)]
fn spin_contended<T>(lock: &SpinLock<T>) -> SpinGuard<'_, T> {
    let (mut spun, mut round) = (0u32, 4u32);
    loop {
        if spun < SPIN_BUDGET {
            for _ in 0..round {
                std::hint::spin_loop();
            }
            spun += round;
            // The last round ends the budget exactly (`spun` never passes it).
            round = (round * 2).min(SPIN_ROUND).min(SPIN_BUDGET - spun);
        } else {
            std::thread::yield_now();
        }
        if !lock.is_locked()
            && let Some(guard) = lock.try_lock()
        {
            return guard;
        }
    }
}

/// A hash map with a fast, per-map-seeded hasher (keys can come from clients). Never iterate
/// it where the order could reach an answer.
pub(crate) type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// A panic payload, kept for a caller that asked for it (a pool's `on_panic`).
pub(crate) type PanicPayload = Box<dyn std::any::Any + Send>;

pin_project_lite::pin_project! {
    /// Polls `inner`, turning a panic into its payload. After a panic the inner future is never
    /// polled again.
    #[derive(Debug)]
    pub(crate) struct CatchPanic<F> {
        #[pin]
        inner: F,
        done: bool,
    }
}

impl<F> CatchPanic<F> {
    pub(crate) fn new(inner: F) -> Self {
        Self { inner, done: false }
    }
}

impl<F: Future> Future for CatchPanic<F> {
    type Output = Result<F::Output, PanicPayload>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        assert!(!*this.done, "CatchPanic polled after a panic");
        let inner = this.inner;
        match catch_unwind(AssertUnwindSafe(move || inner.poll(cx))) {
            Ok(Poll::Ready(value)) => Poll::Ready(Ok(value)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(payload) => {
                *this.done = true;
                Poll::Ready(Err(payload))
            }
        }
    }
}

/// Drops a value (a panic payload, an item) without letting a panicking `Drop` escape.
pub(crate) fn drop_contained<T>(value: T) {
    let _ = catch_unwind(AssertUnwindSafe(move || drop(value)));
}

/// Runs `future` to completion on this thread, parking it between wake-ups: for the
/// synchronous (`blocking_*`) counterparts of async calls, from threads outside the runtime.
///
/// # Panics
///
/// Inside a tokio runtime (a blocked worker could never be woken); use the async call there.
pub(crate) fn block_on<F: std::future::Future>(what: &str, future: F) -> F::Output {
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};

    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.unpark();
        }
    }

    assert!(
        tokio::runtime::Handle::try_current().is_err(),
        "{what} blocks its thread: call it outside the tokio runtime (or use the async form)"
    );
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut context = Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    loop {
        if let Poll::Ready(output) = future.as_mut().poll(&mut context) {
            return output;
        }
        std::thread::park();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::task::{Wake, Waker};
    use std::time::Duration;

    use super::{SpinLock, same_waker, spin_lock};

    struct Flag;

    impl Wake for Flag {
        fn wake(self: Arc<Self>) {}
    }

    #[test]
    fn a_waker_and_its_clone_are_the_same_and_another_waker_is_not() {
        let one = Waker::from(Arc::new(Flag));
        let other = Waker::from(Arc::new(Flag));
        assert!(same_waker(&one, &one.clone()));
        assert!(!same_waker(&one, &other));
        assert!(!same_waker(&one, Waker::noop()));
    }

    /// The spin lock is had at once when free, and only after its owner lets go when held (for
    /// longer than its spins); every increment of four threads counts.
    #[test]
    fn spin_lock_gets_a_free_lock_and_waits_out_a_held_one() {
        let lock = Arc::new(SpinLock::new(0u64));
        *spin_lock(&lock) += 1;
        // Held here while another thread waits for it: it gets it only once released.
        let held = spin_lock(&lock);
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let waiter = {
            let lock = Arc::clone(&lock);
            std::thread::spawn(move || {
                *spin_lock(&lock) += 1;
                done_tx.send(()).unwrap();
            })
        };
        assert!(done_rx.recv_timeout(Duration::from_millis(50)).is_err(), "taken while held");
        drop(held);
        done_rx.recv_timeout(Duration::from_secs(10)).expect("taken once released");
        waiter.join().unwrap();
        // Many threads at once: no increment is lost.
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let lock = Arc::clone(&lock);
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        *spin_lock(&lock) += 1;
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        assert_eq!(*spin_lock(&lock), 40_002);
    }
}
