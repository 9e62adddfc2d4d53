//! Wake-ups decided under the client's state lock, made once it is let go.
//!
//! A waiting acquire sleeps on its ticket's `Notify`, and notifying it runs the waiter's
//! `Waker`: the caller's code, which may call back into this client (a waker that drops a
//! permit of the same client, or asks it anything that takes the lock). The bookkeeping
//! ([`ClientLimit`](crate::tickets::ClientLimit)) decides whom to wake while the state's lock
//! is held, so it only [`defer`]s the wake; the lock's guard ([`StateGuard`]), the only way to
//! the state ([`StateLock`]), makes every wake deferred under it after it lets the lock go.
//!
//! The deferred wakes are kept per thread, since the lock is taken and let go on one thread
//! (the guard is not `Send`). A guard makes only the wakes deferred since it was made, so a
//! guard made while another is held (a second client's state) leaves the first one's wakes to
//! it. A wake deferred where no guard is held is made at once: no lock of the client is held.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::rc::Rc;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

use crate::lock;
use crate::tickets::State;

/// This thread's deferred wakes, and how many [`Wakes`] scopes are open on it.
#[derive(Default)]
struct Deferred {
    wakes: Vec<Arc<Notify>>,
    scopes: usize,
}

thread_local! {
    static DEFERRED: RefCell<Deferred> = RefCell::default();
}

/// Wakes `notify`'s waiter when the innermost [`Wakes`] of this thread drops, or at once when
/// none is open (or the thread's locals are gone: the thread is ending).
pub(crate) fn defer(notify: Arc<Notify>) {
    let mut now = Some(notify);
    let _ = DEFERRED.try_with(|deferred| {
        let mut deferred = deferred.borrow_mut();
        if deferred.scopes > 0 {
            deferred.wakes.extend(now.take());
        }
    });
    if let Some(notify) = now {
        notify.notify_one();
    }
}

/// While it lives, the wakes [`defer`]red on this thread wait; when it drops, it makes them.
pub(crate) struct Wakes {
    /// How many wakes were deferred before this one was made: not this one's to make.
    /// `None` when the thread's locals are gone (nothing is deferred then).
    mark: Option<usize>,
    /// The deferred wakes are this thread's.
    _here: PhantomData<Rc<()>>,
}

impl Wakes {
    pub(crate) fn begin() -> Self {
        let mark = DEFERRED
            .try_with(|deferred| {
                let mut deferred = deferred.borrow_mut();
                deferred.scopes += 1;
                deferred.wakes.len()
            })
            .ok();
        Self { mark, _here: PhantomData }
    }
}

impl Drop for Wakes {
    /// Notifies each waiter deferred since `begin`, each contained: a waker that panics leaves
    /// none of the others unwoken, and its panic (reported by the panic hook) is not raised
    /// again. It is another task's, and whoever let the lock go is often one of the client's
    /// own background tasks (the pushed grants' listener, the lease keeper), which must go on.
    fn drop(&mut self) {
        let Some(mark) = self.mark else { return };
        let due = DEFERRED
            .try_with(|deferred| {
                let mut deferred = deferred.borrow_mut();
                deferred.scopes -= 1;
                debug_assert!(deferred.wakes.len() >= mark, "wake scopes dropped out of order");
                let mark = mark.min(deferred.wakes.len());
                deferred.wakes.split_off(mark)
            })
            .unwrap_or_default();
        for notify in due {
            let _ = catch_unwind(AssertUnwindSafe(|| notify.notify_one()));
        }
    }
}

/// The client's state behind its lock, reached only through a [`StateGuard`].
#[derive(Default)]
pub(crate) struct StateLock(Mutex<State>);

impl StateLock {
    /// An empty state, whose releases waiting for Redis are `orphans`.
    pub(crate) fn new(orphans: super::tickets::Orphans) -> Self {
        Self(Mutex::new(State { orphans, ..State::default() }))
    }

    /// The state, locked; the wakes deferred meanwhile are made when the guard drops.
    pub(crate) fn lock(&self) -> StateGuard<'_> {
        let wakes = Wakes::begin();
        StateGuard { state: lock(&self.0), _wakes: wakes }
    }
}

/// The client's state, locked. Dropping it lets the lock go, then makes the wakes deferred
/// under it (also while a panic unwinds).
pub(crate) struct StateGuard<'a> {
    // Declared first: dropped (unlocked) before `_wakes` makes the wakes.
    state: MutexGuard<'a, State>,
    _wakes: Wakes,
}

impl std::ops::Deref for StateGuard<'_> {
    type Target = State;

    fn deref(&self) -> &State {
        &self.state
    }
}

impl std::ops::DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.state
    }
}

/// Whether `notify` was woken: its next `notified()` completes at once (which takes the wake).
#[cfg(test)]
pub(crate) fn woken(notify: &Notify) -> bool {
    let pending = notify.notified();
    futures_util::pin_mut!(pending);
    pending.as_mut().enable()
}

#[cfg(test)]
mod tests {
    use std::future::Future;

    use super::*;

    #[test]
    fn a_deferred_wake_is_made_when_its_scope_ends_not_before() {
        let notify = Arc::new(Notify::new());
        let wakes = Wakes::begin();
        defer(Arc::clone(&notify));
        assert!(!woken(&notify), "deferred: nobody woken yet");
        drop(wakes);
        assert!(woken(&notify));
    }

    #[test]
    fn a_wake_outside_any_scope_is_made_at_once() {
        let notify = Arc::new(Notify::new());
        defer(Arc::clone(&notify));
        assert!(woken(&notify));
    }

    #[test]
    fn an_inner_scope_makes_only_its_own_wakes() {
        let (outer, inner) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        let outer_wakes = Wakes::begin();
        defer(Arc::clone(&outer));
        let inner_wakes = Wakes::begin();
        defer(Arc::clone(&inner));
        drop(inner_wakes);
        assert!(woken(&inner));
        assert!(!woken(&outer), "the outer scope's wake waits for it");
        drop(outer_wakes);
        assert!(woken(&outer));
    }

    /// A waker that records, when woken, whether the state was unlocked, and panics if told.
    struct Probe {
        state: Arc<StateLock>,
        unlocked: Mutex<Option<bool>>,
        panics: bool,
    }

    impl std::task::Wake for Probe {
        fn wake(self: Arc<Self>) {
            *lock(&self.unlocked) = Some(self.state.0.try_lock().is_ok());
            assert!(!self.panics, "a waker that panics");
        }
    }

    /// Polls `notify`'s `notified()` once with `probe`'s waker: it waits, registered.
    fn wait_on(notify: &Notify, probe: &Arc<Probe>) -> impl Sized {
        let mut pending = Box::pin(notify.notified());
        let waker = std::task::Waker::from(Arc::clone(probe));
        let mut cx = std::task::Context::from_waker(&waker);
        assert!(pending.as_mut().poll(&mut cx).is_pending());
        pending
    }

    #[test]
    fn the_state_is_unlocked_when_the_wakes_run_and_a_panicking_waker_strands_none() {
        let state = Arc::new(StateLock::default());
        let probe = |panics| {
            Arc::new(Probe { state: Arc::clone(&state), unlocked: Mutex::new(None), panics })
        };
        let (first, second) = (probe(true), probe(false));
        let (a, b) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        let (_a, _b) = (wait_on(&a, &first), wait_on(&b, &second));
        let made = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let _guard = state.lock();
            defer(Arc::clone(&a));
            defer(Arc::clone(&b));
        }));
        assert!(made.is_ok(), "the waker's panic stays with the waker");
        assert_eq!(*lock(&first.unlocked), Some(true), "woken after the lock was let go");
        assert_eq!(*lock(&second.unlocked), Some(true), "the next waiter is woken all the same");
        DEFERRED.with_borrow(|deferred| assert!(deferred.wakes.is_empty() && deferred.scopes == 0));
    }
}
