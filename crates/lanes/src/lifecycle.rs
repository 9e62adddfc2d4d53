//! The lifecycle every primitive's main handle follows, as a trait, so that code can stop and
//! observe any of them the same way (see the contract at the top of the crate's docs).

use serde::Serialize;

use crate::BoxFuture;

/// The verbs a primitive's main handle shares: close, drain, abort, look.
///
/// | verb | meaning |
/// |---|---|
/// | [`close`](Self::close) | stop admitting: later admissions fail with the primitive's typed "closed" error; what was admitted still reaches its end |
/// | [`is_closed`](Self::is_closed) | whether it stopped admitting |
/// | [`drained`](Self::drained) | resolves once closed and everything admitted reached its one recorded terminal state |
/// | [`abort`](Self::abort) | close and end admitted work now: queued work fails or is dropped (and counted so), running work is cancelled |
/// | [`snapshot`](Self::snapshot) | the state now, the same value the [`Registry`](crate::Registry) stores |
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use lanes::{Dispatcher, LaneLimits, LaneSet, Lifecycle};
///
/// /// Stops any primitive and reports what it ended with.
/// async fn shut_down<P: Lifecycle>(primitive: &P) -> String {
///     primitive.close();
///     assert!(primitive.is_closed());
///     primitive.drained().await;
///     serde_json::to_string(&primitive.snapshot()).unwrap()
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lanes::ConfigError> {
/// let lanes = LaneSet::builder()
///     .lane("work", LaneLimits::new(1, 4))
///     .audit_timeout(Duration::from_secs(1))
///     .finalization_timeout(Duration::from_secs(1))
///     .worker_drain_timeout(Duration::from_secs(1))
///     .build()?;
/// let pool = Dispatcher::builder()
///     .workers(2)
///     .queue_size(8)
///     .build(|_n: u32| async { Ok::<_, std::io::Error>(()) })?;
/// assert!(shut_down(&lanes).await.contains("\"closed\""));
/// assert!(shut_down(&pool).await.contains("\"stopped\""));
/// # Ok(())
/// # }
/// ```
pub trait Lifecycle {
    /// What [`snapshot`](Self::snapshot) answers.
    type Snapshot: Serialize;

    /// Stops admitting; admitted work still reaches its end. Closing twice does nothing.
    fn close(&self);

    /// Whether it stopped admitting (closed or aborted).
    fn is_closed(&self) -> bool;

    /// Resolves once closed and everything admitted reached its terminal state. Waits
    /// forever if nobody closes it.
    fn drained(&self) -> BoxFuture<'_, ()>;

    /// Closes and ends admitted work now; every item still ends in one recorded state.
    fn abort(&self);

    /// The state now, as the registry stores it.
    fn snapshot(&self) -> Self::Snapshot;
}
