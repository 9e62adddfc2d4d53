//! The in-process backend: a [`LimitTable`] under a mutex, the wakers of its waiters, and a
//! clock.
//!
//! # Implementation details
//!
//! A waiter's future asks the table with its ticket on every poll and, unless granted, leaves
//! its waker under its ticket. Every change that can grant (a release, a withdrawal, a
//! redefinition) *pumps* the limit: it grants the queue head(s) on their waiters' behalf and
//! wakes exactly those waiters; if the head is only waiting for the bucket, it wakes the head,
//! which sleeps until the refill. Only the head ever sleeps on a refill, so a limit has one
//! timer, not one per waiter.

use std::fmt;
use std::future::poll_fn;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};
use std::time::Duration;

use tokio::time::{Instant, Sleep, sleep_until};

use super::backend::{Answer, LimitBackend};
use super::priority::Priority;
use super::spec::LimitSpec;
use super::table::{Acquire, Grant, LimitError, LimitInfo, LimitTable, Next};
use crate::BoxFuture;
use crate::util::FastMap;
use crate::util::lock;

#[derive(Debug)]
struct Inner {
    table: LimitTable,
    /// Waiters' wakers by ticket (tickets are unique per backend). Only looked up, never
    /// iterated, so the map's order cannot leak into answers.
    wakers: FastMap<u64, Waker>,
}

/// Limits held in this process. Reachable directly through [`Limits::new`](super::Limits::new)
/// and as a [`LimitBackend`].
pub struct LocalLimits {
    inner: Mutex<Inner>,
    origin: Instant,
    tickets: AtomicU64,
}

impl fmt::Debug for LocalLimits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalLimits").field("limits", &self.infos()).finish()
    }
}

impl Default for LocalLimits {
    fn default() -> Self {
        Self::new()
    }
}

impl LocalLimits {
    /// An empty backend allowing [`LimitTable::DEFAULT_MAX_WAITERS`] waiters per limit.
    pub fn new() -> Self {
        Self::with_max_waiters(LimitTable::DEFAULT_MAX_WAITERS)
    }

    /// An empty backend allowing `max_waiters` waiters per limit.
    pub fn with_max_waiters(max_waiters: usize) -> Self {
        Self {
            inner: Mutex::new(Inner {
                table: LimitTable::with_max_waiters(max_waiters),
                wakers: FastMap::default(),
            }),
            origin: Instant::now(),
            tickets: AtomicU64::new(1),
        }
    }

    fn now(&self) -> Duration {
        Instant::now().saturating_duration_since(self.origin)
    }

    pub(crate) fn next_ticket(&self) -> u64 {
        self.tickets.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn define_now(&self, name: &str, spec: LimitSpec) -> Result<(), LimitError> {
        let mut inner = lock(&self.inner);
        inner.table.define(name, spec)?;
        // A larger spec may let waiters in.
        Self::pump(&mut inner, name, self.now());
        Ok(())
    }

    pub(crate) fn remove_now(&self, name: &str) -> Result<(), LimitError> {
        let mut inner = lock(&self.inner);
        inner.table.remove(name, self.now())?;
        Ok(())
    }

    /// Asks once; registers `waker` unless granted.
    fn ask(
        &self,
        name: &str,
        ticket: u64,
        priority: &Priority,
        waker: &Waker,
    ) -> Result<(Acquire, Arc<str>), LimitError> {
        let mut inner = lock(&self.inner);
        let answer = inner.table.acquire(name, ticket, priority, self.now())?;
        match answer {
            Acquire::Granted(_) => {
                if !inner.wakers.is_empty() {
                    inner.wakers.remove(&ticket);
                }
            }
            Acquire::Queued | Acquire::RetryAt(_) => match inner.wakers.get_mut(&ticket) {
                Some(existing) if existing.will_wake(waker) => {}
                Some(existing) => existing.clone_from(waker),
                None => {
                    inner.wakers.insert(ticket, waker.clone());
                }
            },
        }
        let name = inner.table.name(name).unwrap_or_else(|| Arc::from(name));
        Ok((answer, name))
    }

    /// Waits for the permit of a fresh ticket. Cancel safe: dropping the future withdraws the
    /// ticket (or returns a permit granted on its behalf meanwhile).
    pub(crate) async fn acquire_local(
        self: &Arc<Self>,
        name: &str,
        priority: &Priority,
    ) -> Result<(Arc<str>, u64, Grant), LimitError> {
        let ticket = self.next_ticket();
        let mut withdraw = Withdraw { local: self, name, ticket, armed: true };
        let mut refill: Option<Pin<Box<Sleep>>> = None;
        let granted = poll_fn(|cx| {
            loop {
                let (answer, interned) = match self.ask(name, ticket, priority, cx.waker()) {
                    Ok(answered) => answered,
                    Err(err) => return Poll::Ready(Err(err)),
                };
                match answer {
                    Acquire::Granted(grant) => return Poll::Ready(Ok((interned, ticket, grant))),
                    Acquire::Queued => {
                        refill = None;
                        return Poll::Pending;
                    }
                    Acquire::RetryAt(at) => {
                        let deadline = self.origin + at;
                        match &mut refill {
                            Some(sleep) if sleep.deadline() == deadline => {}
                            Some(sleep) => sleep.as_mut().reset(deadline),
                            None => refill = Some(Box::pin(sleep_until(deadline))),
                        }
                        let sleep = refill.as_mut().expect("armed above");
                        if sleep.as_mut().poll(cx).is_pending() {
                            return Poll::Pending;
                        }
                        // The bucket has refilled: ask again.
                    }
                }
            }
        })
        .await;
        withdraw.armed = granted.is_err();
        granted
    }

    /// Answers once without waiting: granted, or withdrawn.
    pub(crate) fn try_acquire_local(
        &self,
        name: &str,
        priority: &Priority,
    ) -> Result<Option<(Arc<str>, u64, Grant)>, LimitError> {
        let ticket = self.next_ticket();
        let mut inner = lock(&self.inner);
        let now = self.now();
        match inner.table.acquire(name, ticket, priority, now)? {
            Acquire::Granted(grant) => {
                let name = inner.table.name(name).unwrap_or_else(|| Arc::from(name));
                Ok(Some((name, ticket, grant)))
            }
            Acquire::Queued | Acquire::RetryAt(_) => {
                inner.table.release(name, ticket, now)?;
                // Queuing and withdrawing a ticket that was never served changes nothing for
                // the others, except that a refill sleeper may have to re-arm.
                Self::pump(&mut inner, name, now);
                Ok(None)
            }
        }
    }

    /// Returns a permit or withdraws a ticket, then lets the next waiters in.
    pub(crate) fn release_now(&self, name: &str, ticket: u64) {
        let mut inner = lock(&self.inner);
        let now = self.now();
        if !inner.wakers.is_empty() {
            inner.wakers.remove(&ticket);
        }
        if inner.table.release(name, ticket, now).is_ok() {
            Self::pump(&mut inner, name, now);
        }
    }

    /// Grants the queue head(s) on their waiters' behalf and wakes them; wakes a head that waits
    /// for a refill so it (re)arms the limit's one timer.
    fn pump(inner: &mut Inner, name: &str, now: Duration) {
        if inner.wakers.is_empty() {
            // Nobody waits in this backend: nothing to grant on anyone's behalf.
            return;
        }
        while let Ok(Some((ticket, _))) = inner.table.grant_next(name, now, None) {
            if let Some(waker) = inner.wakers.remove(&ticket) {
                waker.wake();
            }
        }
        if let Ok(Some(Next::At(ticket, _))) = inner.table.next(name, now)
            && let Some(waker) = inner.wakers.remove(&ticket)
        {
            waker.wake();
        }
    }

    pub(crate) fn info_now(&self, name: &str) -> Option<LimitInfo> {
        lock(&self.inner).table.info(name)
    }

    pub(crate) fn infos(&self) -> Vec<LimitInfo> {
        lock(&self.inner).table.infos()
    }

    pub(crate) fn answer(
        &self,
        name: &str,
        ticket: u64,
        priority: &Priority,
    ) -> Result<Answer, LimitError> {
        let mut inner = lock(&self.inner);
        let now = self.now();
        Ok(match inner.table.acquire(name, ticket, priority, now)? {
            Acquire::Granted(grant) => Answer::Granted(grant),
            Acquire::Queued => Answer::Queued,
            Acquire::RetryAt(at) => Answer::RetryAfter(at.saturating_sub(now)),
        })
    }

    /// Resolves when the answer for `ticket` may have changed (it was granted on its behalf, it
    /// is the head and not blocked by held permits, it no longer waits), or after `at_most`.
    pub(crate) async fn wait_now(&self, name: &str, ticket: u64, at_most: Duration) {
        let sleep = tokio::time::sleep(at_most);
        tokio::pin!(sleep);
        poll_fn(|cx| {
            if sleep.as_mut().poll(cx).is_ready() {
                return Poll::Ready(());
            }
            let mut inner = lock(&self.inner);
            let now = self.now();
            // Served next and not blocked by held permits: asking again answers something new.
            let head_can_move = matches!(
                inner.table.next(name, now),
                Ok(Some(Next::Ready(head) | Next::At(head, _))) if head == ticket
            );
            if !inner.table.is_waiting(name, ticket) || head_can_move {
                return Poll::Ready(());
            }
            match inner.wakers.get_mut(&ticket) {
                Some(existing) => existing.clone_from(cx.waker()),
                None => {
                    inner.wakers.insert(ticket, cx.waker().clone());
                }
            }
            Poll::Pending
        })
        .await;
    }
}

/// Withdraws a waiting ticket (or returns a permit granted on its behalf) when an acquire is
/// dropped before it finished.
struct Withdraw<'a> {
    local: &'a LocalLimits,
    name: &'a str,
    ticket: u64,
    armed: bool,
}

impl Drop for Withdraw<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.local.release_now(self.name, self.ticket);
        }
    }
}

impl LimitBackend for LocalLimits {
    fn ticket(&self) -> u64 {
        self.next_ticket()
    }

    fn define<'a>(
        &'a self,
        name: &'a str,
        spec: LimitSpec,
    ) -> BoxFuture<'a, Result<(), LimitError>> {
        Box::pin(std::future::ready(self.define_now(name, spec)))
    }

    fn remove<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), LimitError>> {
        Box::pin(std::future::ready(self.remove_now(name)))
    }

    fn acquire<'a>(
        &'a self,
        name: &'a str,
        ticket: u64,
        priority: &'a Priority,
    ) -> BoxFuture<'a, Result<Answer, LimitError>> {
        Box::pin(std::future::ready(self.answer(name, ticket, priority)))
    }

    fn wait<'a>(&'a self, name: &'a str, ticket: u64, at_most: Duration) -> BoxFuture<'a, ()> {
        Box::pin(self.wait_now(name, ticket, at_most))
    }

    fn release<'a>(&'a self, name: &'a str, ticket: u64) -> BoxFuture<'a, Result<(), LimitError>> {
        self.release_now(name, ticket);
        Box::pin(std::future::ready(Ok(())))
    }

    fn info<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<LimitInfo>, LimitError>> {
        Box::pin(std::future::ready(Ok(self.info_now(name))))
    }

    fn list(&self) -> BoxFuture<'_, Result<Vec<LimitInfo>, LimitError>> {
        Box::pin(std::future::ready(Ok(self.infos())))
    }
}
