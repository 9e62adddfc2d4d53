//! Bounded, fair, observable, durable work admission for tokio services.
//!
//! `lanes` decides how much work a service accepts, in what order it runs, what happens on
//! overload and shutdown, and reports all of it through one [`Registry`].
//!
//! | module | primitive | what it bounds |
//! |---|---|---|
//! | [`lane`] | [`LaneSet`], [`Lane`] | owned runs: `concurrent` execution slots + `queued` waiting slots, strict FIFO, finalizer exactly once |
//! | [`limit`] | [`Limits`], [`LimitSpec`], [`Permit`] | permits held at once and granted per second, waiters ordered by [`Priority`] |
//! | [`pool`] | [`Dispatcher`], [`KeyedPool`] | items queued and in flight; per-key order |
//! | [`channel`] | [`Channel`], [`Channels`] | records queued per channel and across dynamic channels; overflow blocks, drops or spills |
//! | [`spill`] | [`SpillQueue`] | unacknowledged bytes on disk; survives crashes |
//! | [`observe`] | [`Registry`], [`Snapshot`], [`Observe`] | nothing: it reports what the others hold, as serde JSON and `metrics` series |
//!
//! # The contract every primitive keeps
//!
//! - **Lifecycle.** A main handle is stopped and observed with the same verbs, the
//!   [`Lifecycle`] trait: `close` (stop admitting; admitted work still ends), `is_closed`,
//!   `drained` (everything admitted reached its one recorded terminal state), `abort` (end
//!   admitted work now, each item still recorded), `snapshot` (what the [`Registry`] stores).
//!   [`LaneSet`], [`Dispatcher`], [`KeyedPool`], [`Channel`] and [`SpillQueue`] implement it
//!   (a spill queue's records outlive it on disk: drained means durable). [`Channels`] closes
//!   by name and by owner, and [`Limits`], a handle on a store other processes share, has no
//!   lifecycle of its own: its permits are the work's.
//! - **Builders.** Configuration is validated when it is built, all at once, and refused with a
//!   [`ConfigError`] that names the field and the [`ConfigRule`] it broke; nothing configured
//!   fails later at run time. Every builder takes `.registry(&registry, name)`
//!   ([`LaneSetBuilder`], the pools' builders, [`LimitsBuilder`], [`ChannelsBuilder`],
//!   [`ChannelConfig`], [`SpillOptions`]): the handle is reported under that name once built,
//!   a name already taken refuses the build before anything starts, and the name is also the
//!   metrics label unless the handle is given its own.
//! - **Refusals.** Every bound has a typed error, and an error that refuses a value hands it
//!   back with `into_inner` (a run lane's also as `into_run`, a channel's as `into_record`).
//! - **Permits.** Work that runs under a limit (a run, a pool's item, a consumer's batch)
//!   takes its permits through one [`limit::Throttle`], whose refusal policy
//!   ([`limit::OnRefusal`]) is explicit, and waits for them holding nothing else of its
//!   primitive: a run waits for its permit without an execution slot.
//! - **Metrics.** Every series is `lanes_<primitive>_<quantity>`: counters end in `_total`,
//!   durations are `_seconds` histograms, gauges have no suffix, and every series carries the
//!   label naming its primitive. The whole table, with help text, is
//!   [`observe::METRICS`]; wait-time histograms are behind [`observe::set_wait_timing`].
//! - **Layers.** [`config`], [`observe`] and [`Lifecycle`] are the ground floor: they know no
//!   primitive, and the primitives' modules form no cycle. Every primitive's folder has the
//!   same files: `core.rs` (the pure state machine: time is an argument, no I/O, no locks),
//!   `handle.rs` (the async shell: locks, wakers, tasks, metrics), `config.rs`, `error.rs` and
//!   `snapshot.rs`, plus files only where a seam is real. `scripts/deps.py` checks all three
//!   rules in CI.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use lanes::{LaneLimits, LaneSet, Run};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let lanes = LaneSet::builder()
//!     .lane("interactive", LaneLimits::new(2, 8))
//!     .lane("batch", LaneLimits::new(1, 100))
//!     .audit_timeout(Duration::from_secs(1))
//!     .finalization_timeout(Duration::from_secs(1))
//!     .worker_drain_timeout(Duration::from_secs(5))
//!     .build()?;
//!
//! // Blocking participation: the caller awaits the outcome.
//! let answer = lanes
//!     .run("interactive", Run::new(|_cx| async { Ok(42) }))?
//!     .await?;
//! assert_eq!(answer, 42);
//!
//! // Background participation: the finalizer receives the outcome.
//! lanes.spawn(
//!     "batch",
//!     Run::new(|_cx| async { Ok("indexed") })
//!         .finalizer(|outcome| async move { outcome.map(|_| ()) }),
//! )?;
//!
//! lanes.close();
//! lanes.drained().await;
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![doc(test(attr(deny(warnings))))]

pub mod channel;
pub mod config;
pub mod lane;
mod lifecycle;
pub mod limit;
pub mod observe;
pub mod pool;
pub mod spill;

mod util;

// Every primitive's main handles at the root; the rest of each primitive's types stay in its
// module (`lanes::channel::Batch`, `lanes::pool::SubmitError`, ...).
pub use channel::{
    Channel, ChannelConfig, ChannelError, Channels, ChannelsBuilder, Consumer, ConsumerOptions,
    Overflow,
};
pub use config::{ConfigError, ConfigRule};
pub use lane::{
    AdmissionError, AdmissionErrorKind, Audit, AuditEvent, AuditKind, Lane, LaneLimits, LaneSet,
    LaneSetBuilder, LaneSetSnapshot, LaneSnapshot, MAX_QUEUED, Outcome, Participation, Reason, Run,
    RunContext, RunFailure, RunHandle, RunId, Stage,
};
pub use lifecycle::Lifecycle;
pub use limit::{
    Acquire, AcquireError, AcquireFuture, Answer, KeyedLimit, KeyedPermit, Limit, LimitBackend,
    LimitError, LimitInfo, LimitSpec, LimitTable, Limits, LimitsBuilder, Permit, Priority,
    TryAcquireError, WaitQueue,
};
pub use observe::{Observe, Registry, Snapshot};
pub use pool::{Dispatcher, KeyedPool, SubmitError};
pub use spill::{DurableQueue, SpillError, SpillOptions, SpillQueue, SpillReader, SyncPolicy};

/// A type-erased error, as returned by jobs, finalizers, audit hooks and cleanups.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A boxed, sendable future, as returned by [`Audit`] hooks and [`LimitBackend`]s.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;
