//! Leased capacity on Redis: the client half ([`LocalShare`], [`keep_share`]) is
//! `lanes::limit::share`'s; this client is its [`ShareSource`], whose refreshes run the `lease`
//! operation on the limit's ledger in Redis.

// The crate root's private types and imports: this module is one of its impl blocks.
use super::*;

use lanes::limit::share::{LocalShare, ShareRequest, ShareSource, keep_share};

impl Inner {
    /// Starts serving `name` leased, if this client does not already.
    pub(crate) fn serve_leased(&self, name: &str, policy: SharePolicy) -> Arc<LocalShare> {
        let mut map = self.leased.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(leased) = map.get(name) {
            return leased.clone();
        }
        let leased = Arc::new(LocalShare::new(policy));
        map.insert(name.to_owned(), leased.clone());
        drop(map);
        let me = self.me.get().cloned().unwrap_or_default();
        // On the client's runtime, as its other tasks: the first use may run on a runtime
        // that ends sooner, and the share would lapse unreported with it.
        let task = self.runtime.spawn(keep_share(me, name.to_owned(), leased.clone()));
        lock(&self.tasks).push(task);
        leased
    }

    /// The leased limit `name`, if this client serves it leased.
    pub(crate) fn leased(&self, name: &str) -> Option<Arc<LocalShare>> {
        // A read lock of its own: the hot path of a leased limit touches no other state.
        self.leased.read().unwrap_or_else(PoisonError::into_inner).get(name).cloned()
    }

    /// The share that answers for `ticket` of `name`: `None` for a limit not leased, and for a
    /// new ticket of a share out of touch with Redis (it lapsed unrefreshed), which goes the
    /// exact path and so follows the outage policy.
    /// A ticket first asked on the exact path (during an outage) stays there until finished.
    pub(crate) fn serving(&self, name: &str, ticket: u64) -> Option<Arc<LocalShare>> {
        let share = self.leased(name)?;
        if share.holds(ticket) {
            return Some(share);
        }
        let exact = self.lock_state().limits.get(name).is_some_and(|limit| limit.knows(ticket));
        (!exact && share.serves(ticket)).then_some(share)
    }

    /// [`serving`](Self::serving) for a ticket's first ask: a new ticket, unknown to the exact
    /// path (the hot path of a leased limit takes no lock of the client's).
    pub(crate) fn serving_first(&self, name: &str, ticket: u64) -> Option<Arc<LocalShare>> {
        self.leased(name).filter(|share| share.serves(ticket))
    }
}

/// A leased limit's answer to an ask; a first ask finds the line bounded by `max_waiters`, as
/// on the exact path. A grant asked with a `lease` is held for that long unrenewed (see
/// [`Inner::share_lease`]).
pub(crate) fn answer(
    inner: &Inner,
    leased: &LocalShare,
    name: &str,
    ticket: u64,
    ask: &Ask,
    lease: Option<Duration>,
) -> Result<Answer, LimitError> {
    let answer = match ask {
        Ask::First(priority) => leased
            .answer_within(ticket, Some(priority), false, inner.max_waiters)
            .map_err(|max| LimitError::TooManyWaiters { limit: name.to_owned(), max })?,
        Ask::Check => leased.answer(ticket, None, true),
        Ask::Try => leased.answer(ticket, None, false),
    };
    if let (Answer::Granted(_), Some(lease)) = (&answer, inner.share_lease(lease)) {
        // Asking again for a held permit starts its lease again, as on the exact path.
        leased.lease(ticket, lease);
    }
    Ok(answer)
}

impl Inner {
    /// The lease a share enforces on a permit asked with `lease`: none when this client renews
    /// its permits itself ([`auto_renew`](crate::RedisLimitsBuilder::auto_renew)), which it
    /// does for a share's by refreshing the share (the share ends with the process); else the
    /// one asked for, renewed by [`RedisLimits::renew`] or ended unrenewed, as on the exact
    /// path.
    pub(crate) fn share_lease(&self, lease: Option<Duration>) -> Option<Duration> {
        lease.filter(|_| !self.auto_renew)
    }
}

impl ShareSource for Inner {
    fn lease(&self) -> Duration {
        self.lease
    }

    fn refresh<'a>(
        &'a self,
        name: &'a str,
        request: ShareRequest,
    ) -> BoxFuture<'a, Result<Option<ShareLease>, LimitError>> {
        Box::pin(async move {
            self.refresh_share(name, self.ledger_id, request, self.lease).await?.into_lease(name)
        })
    }

    fn lost(&self, name: &str, ticket: u64) {
        self.mark_lost(name, ticket);
    }

    fn serves(&self, name: &str, share: &Arc<LocalShare>) -> bool {
        self.leased(name).is_some_and(|served| Arc::ptr_eq(&served, share))
    }

    fn retired(&self, name: &str, share: &Arc<LocalShare>) {
        let mut leased = self.leased.write().unwrap_or_else(PoisonError::into_inner);
        if leased.get(name).is_some_and(|served| Arc::ptr_eq(served, share)) {
            leased.remove(name);
        }
    }
}
