//! The ground floor of observation, shared by every primitive: the [`Registry`] every handle
//! reports into, the [`Observe`] trait any handle or adapter implements to be reported, the
//! [`Snapshot`] it produces, and the table of [metric names](METRICS). Nothing here knows a
//! primitive: each primitive module implements [`Observe`] for its own state and adds a typed
//! accessor to [`Snapshot`] for its own section.

mod names;
mod registry;
mod timing;

pub(crate) use names::describe_once;
pub use names::{METRICS, MetricKind, MetricName, describe_metrics};
pub(crate) use registry::Registration;
pub use registry::{Observe, Registry, SECTIONS, Snapshot};
pub(crate) use timing::start as timing_start;
pub use timing::{set_wait_timing, wait_timing};
