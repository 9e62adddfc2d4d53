//! Pools: a bounded [`Dispatcher`] (unordered) and a [`KeyedPool`] (per-key order, cross-key
//! parallelism), with completion tracking for the dispatcher.
//!
//! Both run a fixed set of worker tasks over a pure scheduler (FIFO, hashed shards, or per-key
//! queues) and share one lifecycle:
//!
//! # Ordering
//!
//! - Dispatcher: none beyond "accepted items are started in submit order".
//! - Keyed pool: items with equal keys are processed one at a time, in submit order; different
//!   keys in parallel. See [`KeyedMode`] for per-key and hashed-shards scheduling.
//!
//! # Overflow
//!
//! `submit` never waits; a refusal hands the item back ([`SubmitError`]) and moves the
//! `rejected` counter. `submit_wait` waits for room instead.
//!
//! # Cancel safety
//!
//! Dropping a `submit_wait` future drops its item without enqueuing it. Dropping a `stop`
//! future only stops waiting: draining goes on.
//!
//! # Shutdown
//!
//! `stop(timeout)` refuses new items at once — producers parked in `submit_wait` get
//! [`SubmitError::Stopped`] — and waits for every accepted item to be processed. The handoff
//! is atomic: every `submit` that returned `Ok` is processed before `stop` returns `Ok`. A stop
//! that times out returns [`StopTimeout`] and keeps draining; a later stop can observe the end.
//! `abort()` discards queued items and cancels in-flight ones, counting both as `dropped`.
//!
//! # Failures
//!
//! A process function that returns an error counts as `failed` and goes to `on_error`; one
//! that panics is contained, counts as `panicked` and goes to `on_panic` with the item; the
//! pool keeps serving. Counters reconcile: `submitted == completed + failed + panicked +
//! dropped + inflight + queued`.
//!
//! # Metrics
//!
//! Through the `metrics` facade, labelled `pool=<name>`: `lanes_pool_{submitted, rejected,
//! completed, failed, panicked, dropped}_total`, gauges `lanes_pool_inflight` and
//! `lanes_pool_queued`, and two histograms, `lanes_pool_queue_wait_seconds` and
//! `lanes_pool_processing_seconds`.

mod completion;
mod config;
mod core;
mod dispatcher;
mod error;
mod fnv;
mod handle;
mod keyed;
mod snapshot;

pub use completion::{CompletionSnapshot, CompletionSource, CompletionStream};
pub use dispatcher::{Dispatcher, DispatcherBuilder, TrackedDispatcherBuilder};
pub use error::{AbortReport, StopTimeout, SubmitError};
pub use fnv::{PoolKey, fnv1a64};
pub use handle::{Phase, PoolStats};
pub use keyed::{KeyedMode, KeyedPool, KeyedPoolBuilder, NoKey};
pub use snapshot::{PoolKind, PoolSnapshot};
