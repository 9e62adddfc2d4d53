//! This client's bookkeeping of its tickets, per limit.

// The crate root's private types and imports: this module is one of its impl blocks.
use super::*;

#[derive(Default)]
pub(crate) struct State {
    pub(crate) limits: HashMap<String, ClientLimit>,
    /// Specs this client defined or read, for the local share and for redefinition.
    pub(crate) specs: HashMap<String, LimitSpec>,
    /// Releases that could not reach Redis, retried in the background.
    pub(crate) orphans: Vec<(String, u64)>,
}

/// This client's tickets on one limit.
#[derive(Default)]
pub(crate) struct ClientLimit {
    /// Tickets queued on the server, each with its waker. The first is the client's asker.
    pub(crate) waiting: BTreeMap<u64, Arc<Notify>>,
    /// Waiting tickets whose last answer was "retry after".
    pub(crate) retrying: HashSet<u64>,
    /// Tickets the server granted while another ticket asked, not yet claimed.
    pub(crate) granted: HashMap<u64, Grant>,
    /// Permits held on the server; renewed in the background unless `external`.
    pub(crate) held: BTreeSet<u64>,
    /// Tickets asked with their own lease: their holder renews them (the server's clients).
    pub(crate) external: HashSet<u64>,
    /// The priority of each waiting ticket's first ask, to queue it again if Redis lost it.
    pub(crate) priorities: HashMap<u64, Priority>,
    /// Tickets granted without a permit (fail-open).
    pub(crate) open: HashSet<u64>,
    /// Tickets living in the local share.
    pub(crate) local: HashSet<u64>,
    /// When the earliest lease of the limit can lapse (server's answer, in local time).
    pub(crate) next_expiry: Option<Instant>,
}

impl ClientLimit {
    pub(crate) fn wake_first(&self) {
        if let Some(notify) = self.waiting.values().next() {
            notify.notify_one();
        }
    }

    pub(crate) fn forget(&mut self, ticket: u64) {
        let was_first = self.waiting.keys().next() == Some(&ticket);
        self.waiting.remove(&ticket);
        self.retrying.remove(&ticket);
        self.priorities.remove(&ticket);
        if was_first {
            self.wake_first();
        }
    }
}
