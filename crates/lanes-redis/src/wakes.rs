//! Wake-ups decided under the client's state lock, made once it is let go.
//!
//! A waiting acquire sleeps on its ticket's `Notify`, and notifying it runs the waiter's
//! `Waker`: the caller's code, which may call back into this client (a waker that drops a
//! permit of the same client, or asks it anything that takes the lock). The bookkeeping
//! ([`ClientLimit`](crate::tickets::ClientLimit)) decides whom to wake while the state's lock
//! is held, so it only [`defer`]s the wake; the lock's guard ([`StateGuard`]) makes every wake
//! deferred under it after it lets the lock go.
//!
//! The deferred wakes are kept per thread: whoever holds the lock is on this thread, and the
//! guard is not `Send`. A guard takes only the wakes deferred since it was made, so a guard
//! made while another is held (a second client's state) leaves the first one's wakes to it.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::rc::Rc;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

use crate::lock;
use crate::tickets::State;

thread_local! {
    static DEFERRED: RefCell<Vec<Arc<Notify>>> = const { RefCell::new(Vec::new()) };
}

/// Wakes `notify`'s waiter when the innermost [`Wakes`] of this thread drops.
pub(crate) fn defer(notify: Arc<Notify>) {
    DEFERRED.with_borrow_mut(|deferred| deferred.push(notify));
}

/// While it lives, the wakes [`defer`]red on this thread wait; when it drops, it makes them.
pub(crate) struct Wakes {
    /// How many wakes were deferred before this one was made: not this one's to make.
    mark: usize,
    /// The deferred wakes are this thread's.
    _here: PhantomData<Rc<()>>,
}

impl Wakes {
    pub(crate) fn begin() -> Self {
        Self { mark: DEFERRED.with_borrow(Vec::len), _here: PhantomData }
    }
}

impl Drop for Wakes {
    /// Notifies each waiter deferred since `begin`, each contained: a waker that panics leaves
    /// none of the others unwoken. The first panic is raised again once all are woken, unless
    /// the thread is unwinding already.
    fn drop(&mut self) {
        let due = DEFERRED.with_borrow_mut(|deferred| {
            if deferred.len() > self.mark { deferred.split_off(self.mark) } else { Vec::new() }
        });
        let mut panicked = None;
        for notify in due {
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| notify.notify_one())) {
                panicked.get_or_insert(payload);
            }
        }
        if let Some(payload) = panicked
            && !std::thread::panicking()
        {
            std::panic::resume_unwind(payload);
        }
    }
}

/// The client's state, locked. Dropping it lets the lock go, then makes the wakes deferred
/// under it (also while a panic unwinds).
pub(crate) struct StateGuard<'a> {
    // Declared first: dropped (unlocked) before `wakes` makes the wakes.
    state: MutexGuard<'a, State>,
    _wakes: Wakes,
}

impl<'a> StateGuard<'a> {
    pub(crate) fn lock(state: &'a Mutex<State>) -> Self {
        let wakes = Wakes::begin();
        Self { state: lock(state), _wakes: wakes }
    }
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

#[cfg(test)]
mod tests {
    use std::future::Future;

    use super::*;

    fn woken(notify: &Notify) -> bool {
        let pending = notify.notified();
        futures_util::pin_mut!(pending);
        pending.as_mut().enable()
    }

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
        state: Arc<Mutex<State>>,
        unlocked: Mutex<Option<bool>>,
        panics: bool,
    }

    impl std::task::Wake for Probe {
        fn wake(self: Arc<Self>) {
            *lock(&self.unlocked) = Some(self.state.try_lock().is_ok());
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
        let state = Arc::new(Mutex::new(State::default()));
        let probe = |panics| {
            Arc::new(Probe { state: Arc::clone(&state), unlocked: Mutex::new(None), panics })
        };
        let (first, second) = (probe(true), probe(false));
        let (a, b) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        let (_a, _b) = (wait_on(&a, &first), wait_on(&b, &second));
        let made = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let _guard = StateGuard::lock(&state);
            defer(Arc::clone(&a));
            defer(Arc::clone(&b));
        }));
        assert!(made.is_err(), "the first waker's panic is raised again");
        assert_eq!(*lock(&first.unlocked), Some(true), "woken after the lock was let go");
        assert_eq!(*lock(&second.unlocked), Some(true), "the next waiter is woken all the same");
        assert!(DEFERRED.with_borrow(Vec::is_empty));
    }
}
