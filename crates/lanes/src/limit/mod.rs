//! Limits: named concurrency + rate limits with a fair, prioritized wait queue.
//!
//! A limit ([`LimitSpec`]) allows at most `concurrent` permits at once and, optionally, at most
//! `burst + per_second × t` grants in any window of length `t`. A [`Permit`] is taken before the
//! work runs and returned when it is dropped. Waiters are ordered by [`Priority`].
//!
//! The rules live in two pure state machines that take time as an argument and do no I/O:
//! [`WaitQueue`] (who is served next) and [`LimitTable`] (a semaphore and a token bucket per
//! limit in front of one wait queue). [`Limits`] is the async facade; it keeps the table in
//! process or uses any [`LimitBackend`].
//!
//! # Ordering
//!
//! - The highest [`Priority::level`] is served first. Levels are strict: a busy higher level
//!   can starve lower ones.
//! - Within a level, fairness keys take turns by weighted round-robin: a key takes up to its
//!   weight in grants per turn, then the next key in the rotation (a key that was idle joins
//!   the end of it). One key's backlog cannot starve the others.
//! - Within a key, arrival order. The default priority is plain arrival order.
//! - No barging: only the ticket the queue serves next may be granted, even when a later
//!   ticket arrives while the head waits for a token.
//! - A waiter keeps the priority it first asked with.
//!
//! # Overflow
//!
//! Waiting is bounded: a limit accepts at most a configured number of waiters
//! ([`LimitTable::DEFAULT_MAX_WAITERS`] by default); one more acquire fails at once with
//! [`LimitError::TooManyWaiters`], and nothing is queued. `try_acquire` never queues, so it
//! never needs the waiting room: it answers [`TryAcquireError::Busy`] or
//! [`TryAcquireError::RateLimited`] with the time until the bucket has a token.
//!
//! # The ticket protocol
//!
//! Every backend speaks it ([`LimitBackend`]): a ticket is queued by its first ask only; later
//! looks (`check`) never queue it, so a ticket released or withdrawn while its waiter was
//! between two looks is finished ([`Answer::Finished`]) and nothing ever queues it again.
//! Leases, their renewal and their expiry live in the backend (the table in process, the script
//! on Redis). Every wait — [`Limits::acquire`], `acquire_timeout`, `acquire_until`, the
//! [`Limit`] handle, the HTTP long-poll of `lanes serve` — is a call of the one acquire future
//! ([`drive`]).
//!
//! # Fencing
//!
//! Fencing tokens strictly increase per limit name for the life of the backend's data, across a
//! removal and a new definition too: a downstream that remembers the highest token it has seen
//! can refuse every older holder.
//!
//! # Cancel safety
//!
//! Dropping a waiting acquire withdraws its ticket; if a permit was granted on its behalf
//! meanwhile, the permit is returned. No permit leaks.
//!
//! # Wake-ups
//!
//! A release wakes only the waiter(s) it lets in. Only the queue head ever waits for the bucket
//! to refill, so a limit needs one timer, not one per waiter.
//!
//! # Redefinition
//!
//! Redefining a limit takes effect for the next grants. Shrinking `concurrent` never revokes a
//! held permit; it only delays the next grants.

mod acquire;
mod backend;
mod cell;
mod config;
#[cfg(feature = "conformance")]
#[cfg_attr(docsrs, doc(cfg(feature = "conformance")))]
pub mod conformance;
mod core;
mod error;
mod handle;
#[cfg(feature = "http")]
mod http;
mod keyed;
#[cfg(feature = "tower")]
mod layer;
mod local;
mod lost;
mod metrics;
mod priority;
pub mod share;
mod snapshot;
mod throttle;
mod waiters;

pub use self::core::{Acquire, Grant, LimitTable, Next, Released};
pub use acquire::{REASK, drive};
pub use backend::{Answer, LimitBackend, ShareReply};
pub use config::LimitSpec;
pub use error::{AcquireError, BackendError, LimitError, SpecError, TryAcquireError};
pub use handle::{AcquireFuture, Limit, Limits, LimitsBuilder, Permit};
#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub use http::{HttpLimitLayer, HttpLimitService};
pub use keyed::{KeyedLimit, KeyedLimitBuilder, KeyedLimitInfo, KeyedPermit};
#[cfg(feature = "tower")]
#[cfg_attr(docsrs, doc(cfg(feature = "tower")))]
pub use layer::{DefaultPriority, LimitLayer, LimitService, Overloaded, PriorityOf, WhenBusy};
pub use local::LocalLimits;
pub use lost::LostLeases;
pub use priority::Priority;
pub use snapshot::{KeyInfo, LimitInfo, ShareInfo};
pub use throttle::{OnRefusal, Throttle};
pub use waiters::WaitQueue;
