//! The audit hook: started / completed / failed events of every owned run.

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::error::{Reason, Stage};
use super::run::{Participation, RunId};
use crate::{BoxError, BoxFuture};

/// What happened to a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum AuditKind {
    /// The run holds an execution slot; its job starts once this event is recorded.
    Started,
    /// The job succeeded. Recorded before the finalizer runs.
    Completed,
    /// The run failed. Recorded before the finalizer runs.
    Failed {
        /// Where it failed.
        stage: Stage,
        /// Why it failed.
        reason: Reason,
    },
}

/// One audit event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditEvent {
    /// The run.
    pub run_id: RunId,
    /// Its lane.
    pub lane: Arc<str>,
    /// Blocking or background.
    pub participation: Participation,
    /// What happened.
    pub kind: AuditKind,
}

/// Records audit events. Each call is bounded by the set's `audit_timeout`.
///
/// - A failed or timed-out `Started` fails the run at [`Stage::Start`] with [`Reason::Audit`];
///   its job never runs and no terminal event is recorded.
/// - A failed `Completed` turns the success into a failure at [`Stage::Terminal`].
/// - A failed `Failed` is attached to the run's failure.
///
/// Implemented for every `Fn(AuditEvent) -> impl Future<Output = Result<(), E>>`.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use lanes::{AuditEvent, LaneLimits, LaneSet};
///
/// let lanes = LaneSet::builder()
///     .lane("work", LaneLimits::new(1, 1))
///     .audit_timeout(Duration::from_secs(1))
///     .finalization_timeout(Duration::from_secs(1))
///     .worker_drain_timeout(Duration::from_secs(1))
///     .audit(|event: AuditEvent| async move {
///         println!("{} {:?}", event.run_id, event.kind);
///         Ok::<_, std::io::Error>(())
///     })
///     .build()?;
/// # drop(lanes);
/// # Ok::<(), lanes::ConfigError>(())
/// ```
pub trait Audit: Send + Sync + 'static {
    /// Records one event.
    fn record(&self, event: AuditEvent) -> BoxFuture<'static, Result<(), BoxError>>;
}

impl<F, Fut, E> Audit for F
where
    F: Fn(AuditEvent) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), E>> + Send + 'static,
    E: Into<BoxError> + 'static,
{
    fn record(&self, event: AuditEvent) -> BoxFuture<'static, Result<(), BoxError>> {
        let fut = self(event);
        Box::pin(async move { fut.await.map_err(Into::into) })
    }
}

impl fmt::Debug for dyn Audit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Audit")
    }
}
