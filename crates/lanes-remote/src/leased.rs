//! Leased capacity over HTTP: a limit defined leased on the server is served from this
//! client's own share of it, with no request per acquire. The client half is
//! `lanes::limit::share`'s ([`LocalShare`], [`keep_share`]); this client is its
//! [`ShareSource`], refreshing through `POST /v1/limits/{name}/share`, and the server
//! keeps the ledger in its store (Redis; a server on its embedded backend answers every limit
//! `exact`, and acquires go through the server as always).
//!
//! Whether a limit is leased is learned at its first acquire here: one refresh asking for
//! nothing. The answer `exact` is kept for [`EXACT_FOR`], then asked again, so a limit
//! redefined leased is found; a failed probe (an unknown limit, an older server, no server)
//! is asked again after a tenth of that. A ticket first asked through the server stays there
//! until it is finished, whatever the limit's mode becomes meanwhile.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use lanes::BoxFuture;
use lanes::limit::ShareReply;
use lanes::limit::share::{
    Demand, LocalShare, ShareLease, SharePolicy, ShareRequest, ShareSource, keep_share,
};
use lanes::limit::{LimitError, LimitSpec};
use reqwest::StatusCode;
use tokio::time::Instant;

use crate::RemoteLimits;
use crate::client::{Inner, answer, encode, failure, lock, transport};
use crate::wire;

/// How long a limit found `exact` is taken to stay so.
pub const EXACT_FOR: Duration = Duration::from_secs(30);

/// This client's leased limits, and the limits it found exact.
pub(crate) struct Shares {
    /// This instance of the client, apart from others with the same client id.
    instance: u64,
    leased: RwLock<HashMap<String, Arc<LocalShare>>>,
    /// Limits found exact, and when.
    exact: std::sync::Mutex<ExactNames>,
    keepers: std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl Shares {
    pub(crate) fn new(instance: u64) -> Self {
        Self {
            instance,
            leased: RwLock::default(),
            exact: std::sync::Mutex::new(ExactNames::default()),
            keepers: std::sync::Mutex::default(),
        }
    }
}

/// The limits found exact, and when: each is asked again after [`EXACT_FOR`]. Bounded: the
/// names found longer ago than that are dropped whenever the map has doubled since the last
/// sweep, so limits probed once (per-tenant names, say) do not pile up.
#[derive(Debug)]
struct ExactNames {
    found: HashMap<String, Instant>,
    /// The size at which the next sweep happens.
    sweep_at: usize,
}

impl Default for ExactNames {
    fn default() -> Self {
        Self { found: HashMap::new(), sweep_at: 1_024 }
    }
}

impl ExactNames {
    /// Whether `name` was found exact less than [`EXACT_FOR`] ago.
    fn fresh(&self, name: &str) -> bool {
        self.found.get(name).is_some_and(|at| at.elapsed() < EXACT_FOR)
    }

    /// Records `name` as found exact `at`.
    fn found(&mut self, name: &str, at: Instant) {
        if self.found.len() >= self.sweep_at {
            self.found.retain(|_, at| at.elapsed() < EXACT_FOR);
            self.sweep_at = (self.found.len() * 2).max(1_024);
        }
        self.found.insert(name.to_owned(), at);
    }

    fn forget(&mut self, name: &str) {
        self.found.remove(name);
    }
}

impl Drop for Shares {
    fn drop(&mut self) {
        for keeper in lock(&self.keepers).drain(..) {
            keeper.abort();
        }
    }
}

impl Inner {
    /// The share of `name`, if this client serves it leased.
    pub(crate) fn share_of(&self, name: &str) -> Option<Arc<LocalShare>> {
        self.shares.leased.read().unwrap_or_else(PoisonError::into_inner).get(name).cloned()
    }

    /// The share that answers for `ticket` of `name`: `None` for a limit not served leased,
    /// for a ticket first asked through the server (it stays there until finished), and for a
    /// new ticket of a share out of touch with the server.
    pub(crate) fn share_for(&self, name: &str, ticket: u64) -> Option<Arc<LocalShare>> {
        let share = self.share_of(name)?;
        if share.holds(ticket) {
            return Some(share);
        }
        let through_server = self.asked_through_server(name, ticket);
        (!through_server && share.serves(ticket)).then_some(share)
    }

    /// One refresh of `name`'s share, as `request`.
    async fn refresh_once(
        &self,
        name: &str,
        request: &ShareRequest,
    ) -> Result<ShareReply, LimitError> {
        let url = format!("{}/v1/limits/{}/share", self.base, encode(name));
        let lease_ms = u64::try_from(self.lease.as_millis()).unwrap_or(u64::MAX);
        let body =
            wire::ShareRefresh::new(&self.client, self.shares.instance, Some(lease_ms), request);
        let response =
            self.request(reqwest::Method::POST, url).json(&body).send().await.map_err(transport)?;
        if response.status() != StatusCode::OK {
            return Err(failure(name, response, false).await);
        }
        let reply: wire::ShareAnswer = answer(response).await?;
        reply.to_reply().ok_or_else(|| {
            LimitError::backend(format!("lanes serve: unknown share mode {:?}", reply.mode))
        })
    }

    /// The share of `name` if it is leased: learned by a refresh asking for nothing, unless
    /// the limit was found exact less than [`EXACT_FOR`] ago. Errors (an unknown limit, a
    /// server that does not answer) are left to the request that follows.
    pub(crate) async fn leased(self: &Arc<Self>, name: &str) -> Option<Arc<LocalShare>> {
        if let Some(share) = self.share_of(name) {
            return Some(share);
        }
        if lock(&self.shares.exact).fresh(name) {
            return None;
        }
        let probe = ShareRequest::new(Demand::none(), 0, SharePolicy::default(), 0);
        match self.refresh_once(name, &probe).await {
            Ok(ShareReply::Exact) => {
                lock(&self.shares.exact).found(name, Instant::now());
                None
            }
            Ok(ShareReply::Leased(_) | ShareReply::Stale) => Some(self.serve_leased(name)),
            Err(_) => {
                // An unknown limit, a server without the endpoint, or no server: asked again
                // after a tenth of `EXACT_FOR`, not before every acquire.
                let retry = Instant::now().checked_sub(EXACT_FOR - EXACT_FOR / 10);
                lock(&self.shares.exact).found(name, retry.unwrap_or_else(Instant::now));
                None
            }
        }
    }

    /// Starts serving `name` from a share, if this client does not already.
    fn serve_leased(self: &Arc<Self>, name: &str) -> Arc<LocalShare> {
        let mut map = self.shares.leased.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(share) = map.get(name) {
            return share.clone();
        }
        // The policy is the limit's own (the store applies it); this one is not sent.
        let share = Arc::new(LocalShare::new(SharePolicy::default()));
        map.insert(name.to_owned(), share.clone());
        drop(map);
        let keeper = tokio::spawn(keep_share(Arc::downgrade(self), name.to_owned(), share.clone()));
        lock(&self.shares.keepers).push(keeper);
        share
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
        Box::pin(async move { self.refresh_once(name, &request).await?.into_lease(name) })
    }

    fn lost(&self, name: &str, ticket: u64) {
        self.lost.mark(name, ticket);
    }

    fn retired(&self, name: &str, share: &Arc<LocalShare>) {
        let mut leased = self.shares.leased.write().unwrap_or_else(PoisonError::into_inner);
        if leased.get(name).is_some_and(|served| Arc::ptr_eq(served, share)) {
            leased.remove(name);
        }
        drop(leased);
        // Its keeper ends: the handles of ended keepers go too.
        lock(&self.shares.keepers).retain(|keeper| !keeper.is_finished());
    }
}

impl RemoteLimits {
    /// Defines `name` in leased mode on the server (a server on Redis): every client serves
    /// it from a share of its `concurrent` permits (and of its rate) that it holds for a
    /// lease, refreshed every third of one, with no request per acquire; shares follow each
    /// client's demand by `policy` and never add up to more than the limit. See
    /// `RedisLimits::define_leased` for the rules, and [`lanes::limit::share`].
    ///
    /// # Errors
    ///
    /// As for [`LimitBackend::define`](lanes::limit::LimitBackend::define); a
    /// [`LimitError::Backend`] from a server that does not lease capacity (its embedded
    /// backend).
    pub async fn define_leased(
        &self,
        name: &str,
        spec: LimitSpec,
        policy: SharePolicy,
    ) -> Result<(), LimitError> {
        spec.validate()?;
        let mut body = wire::Spec::from(spec);
        body.mode = Some("leased".to_owned());
        body.policy = Some(policy.name().to_owned());
        let request = self.inner.request(reqwest::Method::PUT, self.limit_url(name, ""));
        self.send(name, request.json(&body)).await?;
        lock(&self.inner.shares.exact).forget(name);
        Ok(())
    }

    /// This client's share of leased limit `name` now: the most permits it may have out, and
    /// how many it has out; `None` for a limit it does not serve leased.
    pub fn share(&self, name: &str) -> Option<(u32, u32)> {
        self.inner.share_of(name).map(|share| share.share())
    }

    /// This client's part of leased limit `name`'s rate now, in grants per second; `None` for
    /// a limit it does not serve leased, or one without a rate.
    pub fn rate_share(&self, name: &str) -> Option<f64> {
        self.inner.share_of(name).and_then(|share| share.rate_share())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Review finding (stop 73): every limit name probed was kept for good.
    #[tokio::test(start_paused = true)]
    async fn names_found_exact_long_ago_do_not_pile_up() {
        let mut exact = ExactNames::default();
        for n in 0..1_000 {
            exact.found(&format!("tenant-{n}"), Instant::now());
        }
        assert!(exact.fresh("tenant-7"));
        tokio::time::advance(EXACT_FOR).await;
        assert!(!exact.fresh("tenant-7"), "asked again after EXACT_FOR");
        for n in 0..100_000 {
            exact.found(&format!("later-{n}"), Instant::now());
            if n % 1_000 == 0 {
                tokio::time::advance(EXACT_FOR).await;
            }
        }
        assert!(exact.found.len() <= 2_048, "{} names kept", exact.found.len());
        assert!(exact.fresh("later-99999"));
    }
}
