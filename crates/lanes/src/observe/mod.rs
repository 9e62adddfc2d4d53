//! The ground floor of observation, shared by every primitive: the [`Registry`] every handle
//! reports into, the [`Observe`] trait any handle or adapter implements to be reported, the
//! [`Snapshot`] it produces, and the table of [metric names](METRICS). Nothing here knows a
//! primitive: each primitive module implements [`Observe`] for its own state and adds a typed
//! accessor to [`Snapshot`] for its own section.
//!
//! # A recorder that calls back
//!
//! The `metrics` recorder is the application's code. The primitives count, set and record
//! after letting go of their own locks, so a recorder may call back into what it counts (read
//! a snapshot, check a limit, emit into a channel) without a deadlock, and may build primitives
//! from the help text it is given (`describe_*`, once per process, under no lock). A
//! [`Channels`](crate::channel::Channels) registry builds a new channel, which resolves its
//! handles (`register_*`), before it takes its map's lock; if another caller (the recorder
//! among them) names that channel meanwhile, the one built is dropped and its handles were
//! registered for nothing. What still runs under a lock is a limit's resolving of its
//! handles, once, on its first use, inside a `OnceLock`: a recorder should not use that limit
//! from `register_*`.

mod names;
mod registry;
mod timing;

pub(crate) use names::describe_once;
pub use names::{METRICS, MetricKind, MetricName, describe_metrics};
pub(crate) use registry::Registration;
pub use registry::{Observe, Registry, SECTIONS, Snapshot};
pub(crate) use timing::start as timing_start;
pub use timing::{set_wait_timing, wait_timing};
