//! The backend trait: what a store of limits (in process, Redis, a `lanes serve` over HTTP)
//! provides to the [`Limits`](super::Limits) facade.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::priority::Priority;
use super::spec::LimitSpec;
use super::table::{Grant, LimitError, LimitInfo};
use crate::BoxFuture;

/// A backend's answer to an acquire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "answer", rename_all = "snake_case")]
pub enum Answer {
    /// The ticket holds a permit.
    Granted(Grant),
    /// The ticket waits; [`LimitBackend::wait`] resolves when that may have changed.
    Queued,
    /// The ticket is served next but the bucket is empty: ask again after this long.
    RetryAfter(Duration),
}

/// A store of limits with the semantics of [`LimitTable`](super::LimitTable): tickets, first-ask
/// priority, idempotent acquire, no barging, release withdraws a waiting ticket.
///
/// Time belongs to the backend (its own clock, or the Redis server's), so every client of one
/// backend agrees on it. Every backend passes the same conformance suite
/// (`lanes::limit::conformance`, feature `conformance`).
///
/// The methods return boxed futures so the trait is object safe; the in-process backend is also
/// reachable without boxing through [`Limits::new`](super::Limits::new).
pub trait LimitBackend: Send + Sync + fmt::Debug + 'static {
    /// A ticket never handed out before by this backend (in this process).
    fn ticket(&self) -> u64;

    /// Defines or redefines a limit.
    fn define<'a>(
        &'a self,
        name: &'a str,
        spec: LimitSpec,
    ) -> BoxFuture<'a, Result<(), LimitError>>;

    /// Removes a limit (refused while permits are held or tickets wait).
    fn remove<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), LimitError>>;

    /// Asks for the permit of `ticket`; the first ask queues it at `priority`. Idempotent.
    fn acquire<'a>(
        &'a self,
        name: &'a str,
        ticket: u64,
        priority: &'a Priority,
    ) -> BoxFuture<'a, Result<Answer, LimitError>>;

    /// Resolves when the answer for `ticket` may have changed (a release, a refill, an expiry),
    /// or after `at_most`. Waiters are pushed, not polled: a backend wakes the ticket the queue
    /// serves next, not every waiter.
    fn wait<'a>(&'a self, name: &'a str, ticket: u64, at_most: Duration) -> BoxFuture<'a, ()>;

    /// Returns the permit of `ticket`, or withdraws it from the queue; unknown tickets are a
    /// no-op.
    fn release<'a>(&'a self, name: &'a str, ticket: u64) -> BoxFuture<'a, Result<(), LimitError>>;

    /// The state of one limit, `None` if it is not defined.
    fn info<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<LimitInfo>, LimitError>>;

    /// Every limit, in name order.
    fn list(&self) -> BoxFuture<'_, Result<Vec<LimitInfo>, LimitError>>;
}
