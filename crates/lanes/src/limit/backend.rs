//! The backend trait: the whole ticket protocol that a store of limits (in process, Redis, a
//! `lanes serve` over HTTP) provides to the [`Limits`](super::Limits) facade and to the server.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::config::LimitSpec;
use super::core::{Grant, Released};
use super::error::LimitError;
use super::priority::Priority;
use super::share::{ShareLease, SharePolicy, ShareRequest};
use super::snapshot::LimitInfo;
use crate::BoxFuture;

/// A backend's answer about a ticket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "answer", rename_all = "snake_case")]
pub enum Answer {
    /// The ticket holds a permit.
    Granted(Grant),
    /// The ticket waits (or, to a try, the limit is busy and nothing was queued);
    /// [`LimitBackend::wait`] resolves when that may have changed.
    Queued,
    /// The ticket is served next but the bucket is empty: ask again after this long.
    RetryAfter(Duration),
    /// The ticket neither waits nor holds: it was released, withdrawn, or its lease ended.
    /// Nothing queues it again.
    Finished,
}

/// A store's answer to a refresh of a client's share of a limit (leased capacity; see
/// [`LimitBackend::refresh_share`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShareReply {
    /// The limit is not leased (or this backend does not lease capacity): every acquire asks
    /// the store.
    Exact,
    /// The refresh was overtaken by a later one of the same client: nothing to apply.
    Stale,
    /// The client's share until the lease ends.
    Leased(ShareLease),
}

impl ShareReply {
    /// The lease to apply: `Some` for a share, `None` for a stale refresh (nothing to apply);
    /// an error naming limit `name` for one that is not leased.
    ///
    /// # Errors
    ///
    /// [`LimitError::Backend`] for [`ShareReply::Exact`].
    pub fn into_lease(self, name: &str) -> Result<Option<ShareLease>, LimitError> {
        match self {
            Self::Leased(lease) => Ok(Some(lease)),
            Self::Stale => Ok(None),
            Self::Exact => Err(LimitError::backend(format!("limit {name} is not defined leased"))),
        }
    }
}

/// A store of limits, speaking the whole ticket protocol with the semantics of
/// [`LimitTable`](super::LimitTable): a ticket is queued by its first ask
/// ([`acquire`](Self::acquire)) at the priority of that ask, asked about afterwards with
/// [`check`](Self::check) (which never queues it again), and finished by
/// [`release`](Self::release) — returned if held, withdrawn if waiting. No barging; a bounded
/// waiting room; fencing tokens strictly increasing per limit name (a backend that serves a
/// limit from per-client shares, as `lanes-redis` does for leased limits, documents what it
/// keeps of this instead).
///
/// Leases live here too: a grant made with `lease: Some(d)` lasts `d` unless
/// [`renew`](Self::renew)ed, and a lapsed permit is reclaimed by the backend itself. With
/// `lease: None` the backend keeps the permit for as long as its holder lives (in process: until
/// released; on Redis: a lease the client renews in the background).
///
/// Time belongs to the backend (its own clock, or the Redis server's), so every client of one
/// backend agrees on it. Every backend passes the same conformance suite
/// (`lanes::limit::conformance`, feature `conformance`).
///
/// The methods return boxed futures so the trait is object safe; the in-process backend is also
/// reachable without boxing through [`Limits::new`](super::Limits::new).
pub trait LimitBackend: Send + Sync + fmt::Debug + 'static {
    /// A ticket this backend (in this process) is not using: never handed out before, or,
    /// once a backend's numbers come round, none still in use (held, waiting, or known lost
    /// and not yet released).
    fn ticket(&self) -> u64;

    /// Defines or redefines a limit.
    fn define<'a>(
        &'a self,
        name: &'a str,
        spec: LimitSpec,
    ) -> BoxFuture<'a, Result<(), LimitError>>;

    /// Removes a limit (refused while permits are held or tickets wait).
    fn remove<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), LimitError>>;

    /// The first ask for the permit of `ticket`: grants it, or queues it at `priority`.
    /// Idempotent while the ticket lives (a granted ticket answers its grant again).
    fn acquire<'a>(
        &'a self,
        name: &'a str,
        ticket: u64,
        priority: &'a Priority,
        lease: Option<Duration>,
    ) -> BoxFuture<'a, Result<Answer, LimitError>>;

    /// Grants `ticket` only if that can happen at once, and never queues it: `Granted`,
    /// `Queued` (busy; nothing left behind) or `RetryAfter` (the bucket has a token then).
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
        ticket: u64,
        lease: Option<Duration>,
    ) -> BoxFuture<'a, Result<Answer, LimitError>>;

    /// Asks again about a ticket asked before, never queuing it: granted (now, if it is served
    /// next and can be), still waiting, or [`Answer::Finished`].
    fn check<'a>(
        &'a self,
        name: &'a str,
        ticket: u64,
        lease: Option<Duration>,
    ) -> BoxFuture<'a, Result<Answer, LimitError>>;

    /// Resolves when the answer for `ticket` may have changed (a release, a refill, an expiry),
    /// or after `at_most`. Waiters are pushed, not polled: a backend wakes the ticket the queue
    /// serves next, not every waiter.
    fn wait<'a>(&'a self, name: &'a str, ticket: u64, at_most: Duration) -> BoxFuture<'a, ()>;

    /// Returns the permit of `ticket`, or withdraws it from the queue; either way the ticket is
    /// finished. An unknown ticket is a no-op ([`Released::Unknown`]).
    fn release<'a>(
        &'a self,
        name: &'a str,
        ticket: u64,
    ) -> BoxFuture<'a, Result<Released, LimitError>>;

    /// Extends the lease of every held permit among `tickets` to `lease` from now. Answers the
    /// tickets that neither hold nor wait any more — their lease ended, or the store lost them —
    /// so their holders learn that their fencing tokens are stale.
    fn renew<'a>(
        &'a self,
        name: &'a str,
        tickets: &'a [u64],
        lease: Duration,
    ) -> BoxFuture<'a, Result<Vec<u64>, LimitError>>;

    /// The state of one limit, `None` if it is not defined.
    fn info<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<LimitInfo>, LimitError>>;

    /// Every limit, in name order.
    fn list(&self) -> BoxFuture<'_, Result<Vec<LimitInfo>, LimitError>>;

    /// Takes back the permit of `ticket` (or withdraws the waiting ticket) without the
    /// caller's help, if this backend can, and says whether it did: at once, if it holds it
    /// locally (served from a leased share), or by sending the release itself (a remote
    /// backend may send it ahead of its next call on the limit, in the same round trip).
    /// `false` (the default): it goes back through [`release`](Self::release), in the
    /// background. A dropped [`Permit`](crate::limit::Permit), or a dropped acquire, asks this
    /// first.
    fn release_local(&self, _name: &str, _ticket: u64) -> bool {
        false
    }

    /// Whether the permit of `ticket` is known lost: its lease could not be renewed, or the
    /// store lost its state. A backend without leases (in process) never loses a permit.
    fn lease_lost(&self, name: &str, ticket: u64) -> bool {
        let _ = (name, ticket);
        false
    }

    /// Defines or redefines `name` in leased mode: its clients serve it from shares of its
    /// capacity that they hold for a lease (see [`share`](super::share)), apportioned by
    /// `policy`. The default: refused, for a backend that does not lease capacity.
    fn define_leased<'a>(
        &'a self,
        name: &'a str,
        spec: LimitSpec,
        policy: SharePolicy,
    ) -> BoxFuture<'a, Result<(), LimitError>> {
        let _ = (spec, policy);
        let refused = LimitError::backend(format!(
            "limit {name}: this backend does not lease capacity (leased mode needs Redis)"
        ));
        Box::pin(std::future::ready(Err(refused)))
    }

    /// Refreshes the share of limit `name` held by `client` (a client of this backend's
    /// clients, such as an HTTP client of a `lanes serve`), for `lease`. The default:
    /// [`ShareReply::Exact`], for a backend that does not lease capacity.
    fn refresh_share<'a>(
        &'a self,
        name: &'a str,
        client: &'a str,
        request: ShareRequest,
        lease: Duration,
    ) -> BoxFuture<'a, Result<ShareReply, LimitError>> {
        let _ = (name, client, request, lease);
        Box::pin(std::future::ready(Ok(ShareReply::Exact)))
    }

    /// Resolves once the permit of `ticket` is known lost (see
    /// [`lease_lost`](Self::lease_lost)); never, for a backend that cannot lose one.
    fn lost<'a>(&'a self, name: &'a str, ticket: u64) -> BoxFuture<'a, ()> {
        let _ = (name, ticket);
        Box::pin(std::future::pending())
    }
}
