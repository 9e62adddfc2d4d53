//! The one acquire future: every way to wait for a permit — [`Limits::acquire`],
//! [`acquire_timeout`](Limits::acquire_timeout), [`acquire_until`](Limits::acquire_until), the
//! per-limit [`Limit`](super::Limit) handle, and the HTTP long-poll of `lanes serve` — is a call
//! of [`drive`] (or, in process, of its lock-level twin in `local.rs`, `Wait`, which waits in
//! the limit's line instead of the table while only default-priority callers wait there).
//!
//! # Invariants
//!
//! 1. A ticket is queued once, by its first ask; every later look is a `check`, which never
//!    queues. So a ticket released or withdrawn while its waiter is between two looks is
//!    finished: the waiter learns [`Answer::Finished`] and nothing queues it again.
//! 2. An owned ticket (the facade's) is withdrawn when its future is dropped or its deadline
//!    passes; a permit granted on its behalf meanwhile is returned. A ticket the caller keeps
//!    (the server's, owned by an HTTP client) outlives the call.
//! 3. The waiter sleeps on the backend's push, bounded by the refill time the backend names, by
//!    the deadline, and by a safety re-ask period for lost notifications.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::backend::{Answer, LimitBackend};
use super::error::LimitError;
use super::priority::Priority;

/// How long a waiter without a deadline sleeps on its backend's push before it looks again
/// anyway; each backend may bound it further with its own safety re-ask.
pub const REASK: Duration = Duration::from_secs(60);

/// Waits on `backend` for the permit of `ticket` of limit `name`, until it is granted, it is
/// finished, or `deadline` passes. With `first: Some(priority)` the first look queues the
/// ticket at that priority; with `None` the ticket was queued before and is only looked at.
///
/// Answers [`Answer::Granted`], [`Answer::Finished`] (released or withdrawn meanwhile), or —
/// at the deadline — the last answer while waiting ([`Answer::Queued`] or
/// [`Answer::RetryAfter`]). The ticket is left as it is: use the [`Limits`](super::Limits)
/// facade for a ticket that is withdrawn when its waiter goes.
///
/// # Cancel safety
///
/// Dropping the future leaves the ticket queued (invariant 2): its owner releases it.
///
/// # Errors
///
/// What the backend answers: an unknown limit, a full waiting room, an outage.
pub async fn drive(
    backend: &dyn LimitBackend,
    name: &str,
    ticket: u64,
    first: Option<&Priority>,
    lease: Option<Duration>,
    deadline: Option<Instant>,
) -> Result<Answer, LimitError> {
    let mut answer = match first {
        Some(priority) => backend.acquire(name, ticket, priority, lease).await?,
        None => backend.check(name, ticket, lease).await?,
    };
    loop {
        let retry = match answer {
            Answer::Granted(_) | Answer::Finished => return Ok(answer),
            // Backends push, and keep their own safety re-asks for lost notifications: sleep
            // on the push up to the deadline, or `REASK` at most without one.
            Answer::Queued => deadline.map_or(REASK, |_| Duration::MAX),
            Answer::RetryAfter(after) => after,
        };
        let nap = match deadline {
            Some(deadline) => {
                let now = Instant::now();
                if now >= deadline {
                    return Ok(answer);
                }
                retry.min(deadline - now)
            }
            None => retry,
        };
        backend.wait(name, ticket, nap).await;
        answer = backend.check(name, ticket, lease).await?;
    }
}

/// Withdraws the ticket of an owned acquire that did not end in a permit (invariant 2), in the
/// background.
pub(crate) struct Withdraw {
    pub(crate) backend: Arc<dyn LimitBackend>,
    pub(crate) name: Arc<str>,
    pub(crate) ticket: u64,
    pub(crate) armed: bool,
}

impl Drop for Withdraw {
    fn drop(&mut self) {
        if self.armed {
            release_in_background(self.backend.clone(), self.name.clone(), self.ticket);
        }
    }
}

pub(crate) fn release_in_background(backend: Arc<dyn LimitBackend>, name: Arc<str>, ticket: u64) {
    // A permit (or a waiting ticket) the backend holds locally goes back at once, runtime or not.
    if backend.release_local(&name, ticket) {
        return;
    }
    // Outside a runtime nothing can run the release; a leased backend reclaims the permit when
    // its lease expires.
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move {
            let _ = backend.release(&name, ticket).await;
        });
    }
}
