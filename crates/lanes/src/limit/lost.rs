//! The permits a remote backend knows it lost, and the waiters of that news: one book for every
//! backend that implements [`LimitBackend::lease_lost`](super::LimitBackend::lease_lost) and
//! [`LimitBackend::lost`](super::LimitBackend::lost).

use std::collections::HashSet;
use std::sync::Mutex;

use tokio::sync::Notify;

use crate::util::lock;

/// Permits known lost, by `(limit, ticket)`, until their holder releases them.
///
/// ```
/// use lanes::limit::LostLeases;
///
/// let lost = LostLeases::default();
/// lost.mark("db", 7);
/// assert!(lost.is_lost("db", 7));
/// lost.forget("db", 7); // released: nobody asks any more
/// assert!(!lost.is_lost("db", 7));
/// ```
#[derive(Debug, Default)]
pub struct LostLeases {
    lost: Mutex<HashSet<(String, u64)>>,
    changed: Notify,
}

impl LostLeases {
    /// Records the permit of `ticket` as lost and wakes whoever awaits it.
    pub fn mark(&self, limit: &str, ticket: u64) {
        lock(&self.lost).insert((limit.to_owned(), ticket));
        self.changed.notify_waiters();
    }

    /// Forgets a released permit (its holder no longer asks).
    pub fn forget(&self, limit: &str, ticket: u64) {
        lock(&self.lost).remove(&(limit.to_owned(), ticket));
    }

    /// Every ticket whose permit is known lost and not yet released, on any limit (its holder
    /// may still use the ticket's number).
    pub fn tickets(&self) -> Vec<u64> {
        lock(&self.lost).iter().map(|(_, ticket)| *ticket).collect()
    }

    /// Whether the permit of `ticket` is known lost.
    pub fn is_lost(&self, limit: &str, ticket: u64) -> bool {
        lock(&self.lost).contains(&(limit.to_owned(), ticket))
    }

    /// Resolves once the permit of `ticket` is known lost.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future changes nothing.
    pub async fn wait(&self, limit: &str, ticket: u64) {
        loop {
            // Created before the look, so a loss recorded in between still wakes it.
            let changed = self.changed.notified();
            if self.is_lost(limit, ticket) {
                return;
            }
            changed.await;
        }
    }
}
