//! The per-run signal shared by a run's driver, its job context and its lane.
//!
//! Two independent one-way latches and one `Notify`:
//! - the *grant* latch moves once from waiting to granted, closed or poisoned (set by the lane,
//!   under the lane lock);
//! - the *cancel* latch moves once from none to a reason (set by the caller's handle, the
//!   execution timeout, close or poison); the first reason wins.
//!
//! Waiters register with the `Notify` *before* reading the latches, so a change between the
//! read and the wait cannot be missed.

use std::pin::pin;
use std::sync::atomic::{AtomicU8, Ordering};

use tokio::sync::Notify;

use super::error::Reason;
use super::state::Shut;

const WAITING: u8 = 0;
const GRANTED: u8 = 1;
const CLOSED: u8 = 2;
const POISONED: u8 = 3;

/// What the lane decided for a queued run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Grant {
    Waiting,
    Granted,
    Shut(Shut),
}

#[derive(Debug)]
pub(crate) struct RunSignal {
    grant: AtomicU8,
    cancel: AtomicU8,
    notify: Notify,
}

impl RunSignal {
    pub(crate) fn new() -> Self {
        Self {
            grant: AtomicU8::new(WAITING),
            cancel: AtomicU8::new(0),
            notify: Notify::new(),
        }
    }

    pub(crate) fn grant(&self) {
        self.set_grant(GRANTED);
    }

    pub(crate) fn shut(&self, why: Shut) {
        self.set_grant(match why {
            Shut::Closed => CLOSED,
            Shut::Poisoned => POISONED,
        });
    }

    fn set_grant(&self, value: u8) {
        if self
            .grant
            .compare_exchange(WAITING, value, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.notify.notify_waiters();
        }
    }

    pub(crate) fn grant_state(&self) -> Grant {
        match self.grant.load(Ordering::Acquire) {
            WAITING => Grant::Waiting,
            GRANTED => Grant::Granted,
            CLOSED => Grant::Shut(Shut::Closed),
            _ => Grant::Shut(Shut::Poisoned),
        }
    }

    /// Requests cancellation; the first reason wins. Returns whether this call set it.
    pub(crate) fn cancel(&self, reason: Reason) -> bool {
        let code = encode(reason);
        let first = self
            .cancel
            .compare_exchange(0, code, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if first {
            self.notify.notify_waiters();
        }
        first
    }

    pub(crate) fn cancel_reason(&self) -> Option<Reason> {
        decode(self.cancel.load(Ordering::Acquire))
    }

    /// Waits until `ready` returns `Some`, re-checking on every notification.
    pub(crate) async fn wait_for<T>(&self, mut ready: impl FnMut(&Self) -> Option<T>) -> T {
        loop {
            let mut notified = pin!(self.notify.notified());
            notified.as_mut().enable();
            if let Some(value) = ready(self) {
                return value;
            }
            notified.await;
        }
    }

    pub(crate) async fn cancelled(&self) -> Reason {
        self.wait_for(Self::cancel_reason).await
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
