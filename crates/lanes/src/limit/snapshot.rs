//! What a limit reports: [`LimitInfo`], and what a [`LimitTable`](super::LimitTable) observes of
//! each limit's waiters, for the snapshot and the dashboard: refusals, withdrawals and lease
//! expiries, and per fairness key the grants and the time grants waited. Not part of the table's
//! state: never serialized, never compared, kept across the limit's hand-offs to the in-process
//! fast path, bounded in memory.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::config::LimitSpec;
use crate::util::FastMap;

/// The most fairness keys observed per limit; the key granted longest ago makes room.
pub(crate) const MAX_KEYS: usize = 64;

/// Wait-time buckets: bucket `i` holds waits under 2^i microseconds (the last, everything).
const BUCKETS: usize = 32;

/// A limit's state, as reported by `info`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct LimitInfo {
    /// The limit's name.
    pub name: String,
    /// Its current spec.
    pub spec: LimitSpec,
    /// Permits held now.
    pub in_use: u32,
    /// Tickets waiting.
    pub waiting: usize,
    /// Permits granted since the limit was defined.
    pub granted_total: u64,
    /// The most permits ever held at once (never above the largest `concurrent` it had).
    pub max_in_use: u32,
    /// Acquires the store refused at once: tries that found no permit, and tickets that found
    /// the waiting room full (0 where the backend does not count them).
    #[serde(default)]
    pub refused_total: u64,
    /// Waiting tickets that left without a permit: timed out or cancelled.
    #[serde(default)]
    pub withdrawn_total: u64,
    /// Leased permits reclaimed because their lease ran out.
    #[serde(default)]
    pub expired_total: u64,
    /// Per fairness key: who waits, how many grants, how long grants waited (keys granted or
    /// waiting lately, at most 64; empty where the backend does not observe them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keys: Vec<KeyInfo>,
    /// How the limit is served: `None` for exact mode (every acquire decided where the limit
    /// lives), `Some("leased:maxmin")` or `Some("leased:proportional")` for leased capacity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// Under leased capacity, each client's share and demand (live leases only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shares: Vec<ShareInfo>,
}

/// One client's share of a leased limit (see [`share`](super::share)).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ShareInfo {
    /// The client, by its ledger id.
    pub client: u64,
    /// The most permits it may have out.
    pub share: u32,
    /// The capacity set aside for it (its share, or its permits out where more).
    pub reserved: u32,
    /// The permits it had out at its last refresh.
    pub held: u32,
    /// What it wanted at its last refresh (permits out and waiters).
    pub demand: u32,
    /// For a limit with a rate: its part of the rate, in grants per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_second: Option<f64>,
    /// For a limit with a rate: the rate it wanted at its last refresh, in grants per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_second_demand: Option<f64>,
}

impl ShareInfo {
    /// One client's share as a backend reports it (for backends outside this crate).
    pub fn new(client: u64, share: u32, reserved: u32, held: u32, demand: u32) -> Self {
        Self { client, share, reserved, held, demand, per_second: None, per_second_demand: None }
    }

    /// This share, with its part of the limit's rate and the rate it wanted (grants per
    /// second).
    #[must_use]
    pub fn with_rate(mut self, per_second: f64, demand: f64) -> Self {
        self.per_second = Some(per_second);
        self.per_second_demand = Some(demand);
        self
    }
}

impl LimitInfo {
    /// This info, with the limit's mode and its clients' shares (leased capacity).
    #[must_use]
    pub fn leased(mut self, mode: impl Into<String>, shares: Vec<ShareInfo>) -> Self {
        self.mode = Some(mode.into());
        self.shares = shares;
        self
    }

    /// A limit's state as a backend reports it (for backends outside this crate).
    pub fn new(
        name: impl Into<String>,
        spec: LimitSpec,
        in_use: u32,
        waiting: usize,
        granted_total: u64,
        max_in_use: u32,
    ) -> Self {
        Self {
            name: name.into(),
            spec,
            in_use,
            waiting,
            granted_total,
            max_in_use,
            refused_total: 0,
            withdrawn_total: 0,
            expired_total: 0,
            keys: Vec::new(),
            mode: None,
            shares: Vec::new(),
        }
    }
}

/// One fairness key of a limit, as observed by the table that governs it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct KeyInfo {
    /// The fairness key (`None`: waiters that named none).
    pub key: Option<String>,
    /// Tickets of this key waiting now.
    pub waiting: usize,
    /// Permits the table granted to this key.
    pub granted: u64,
    /// The median time a grant of this key waited, in milliseconds (a bucket's upper bound:
    /// within a factor of two).
    pub wait_p50_ms: f64,
    /// The 99th percentile of that wait, in milliseconds (likewise).
    pub wait_p99_ms: f64,
}

#[derive(Debug, Clone, Default)]
struct KeyObserved {
    granted: u64,
    waits: [u64; BUCKETS],
    last: Duration,
}

impl KeyObserved {
    fn record(&mut self, waited: Duration, now: Duration) {
        self.granted += 1;
        self.last = now;
        let micros = u64::try_from(waited.as_micros()).unwrap_or(u64::MAX);
        let bucket = (u64::BITS - micros.leading_zeros()) as usize;
        self.waits[bucket.min(BUCKETS - 1)] += 1;
    }

    fn quantile(&self, q: f64) -> f64 {
        let total: u64 = self.waits.iter().sum();
        if total == 0 {
            return 0.0;
        }
        let rank = ((total as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, count) in self.waits.iter().enumerate() {
            seen += count;
            if seen >= rank {
                return if i == 0 { 0.0 } else { (1u64 << i) as f64 / 1000.0 };
            }
        }
        (1u64 << (BUCKETS - 1)) as f64 / 1000.0
    }
}

/// One limit's observations.
#[derive(Debug, Clone, Default)]
pub(crate) struct Observed {
    pub(crate) refused: u64,
    pub(crate) withdrawn: u64,
    pub(crate) expired: u64,
    /// Keyed waiters' grants (bounded, see [`MAX_KEYS`]).
    keys: BTreeMap<Option<Arc<str>>, KeyObserved>,
    /// Grants to waiters without a fairness key.
    unkeyed: KeyObserved,
    /// Waiting tickets: their key and when they were queued.
    since: FastMap<u64, (Option<Arc<str>>, Duration)>,
}

impl Observed {
    /// `ticket` of `key` was queued at `now`.
    pub(crate) fn queued(&mut self, ticket: u64, key: Option<Arc<str>>, now: Duration) {
        self.since.entry(ticket).or_insert((key, now));
    }

    /// `ticket` was granted at `now`; `key` is its key if it never queued (an immediate grant).
    pub(crate) fn granted(&mut self, ticket: u64, key: Option<&Option<Arc<str>>>, now: Duration) {
        let waited = if self.since.is_empty() { None } else { self.since.remove(&ticket) };
        let (key, waited) = match waited {
            Some((key, at)) => (key, now.saturating_sub(at)),
            // An immediate grant without a fairness key, the common case: no lookup.
            None if key.is_none_or(Option::is_none) => {
                self.unkeyed.granted += 1;
                self.unkeyed.last = now;
                self.unkeyed.waits[0] += 1;
                return;
            }
            None => (key.cloned().flatten(), Duration::ZERO),
        };
        if key.is_none() {
            self.unkeyed.record(waited, now);
            return;
        }
        if !self.keys.contains_key(&key) && self.keys.len() >= MAX_KEYS {
            let oldest = self.keys.iter().min_by_key(|(_, k)| k.last).map(|(k, _)| k.clone());
            if let Some(oldest) = oldest {
                self.keys.remove(&oldest);
            }
        }
        self.keys.entry(key).or_default().record(waited, now);
    }

    /// `ticket` left the queue without a grant (cancelled or timed out).
    pub(crate) fn withdrawn(&mut self, ticket: u64) {
        if self.since.remove(&ticket).is_some() {
            self.withdrawn += 1;
        }
    }

    /// Waiting tickets remembered.
    pub(crate) fn waiting_len(&self) -> usize {
        self.since.len()
    }

    /// Forgets waiting tickets the queue no longer holds.
    pub(crate) fn forget_unless(&mut self, still_waiting: impl Fn(u64) -> bool) {
        self.since.retain(|ticket, _| still_waiting(*ticket));
    }

    /// The per-key view, with `waiting` counted by the queue.
    pub(crate) fn keys(&self, waiting: &BTreeMap<Option<Arc<str>>, usize>) -> Vec<KeyInfo> {
        let none: Option<Arc<str>> = None;
        let mut names: Vec<&Option<Arc<str>>> = self.keys.keys().collect();
        if self.unkeyed.granted > 0 {
            names.push(&none);
        }
        names.extend(waiting.keys().filter(|k| !self.keys.contains_key(*k)));
        names.sort();
        names.dedup();
        names
            .into_iter()
            .map(|key| {
                let stats = match key {
                    None => self.unkeyed.clone(),
                    Some(_) => self.keys.get(key).cloned().unwrap_or_default(),
                };
                KeyInfo {
                    key: key.as_deref().map(str::to_owned),
                    waiting: waiting.get(key).copied().unwrap_or(0),
                    granted: stats.granted,
                    wait_p50_ms: stats.quantile(0.5),
                    wait_p99_ms: stats.quantile(0.99),
                }
            })
            .collect()
    }
}

/// One limit's observations inside its state; equal to any other (not the table's state).
#[derive(Debug, Clone, Default)]
pub(crate) struct ObservedCell(pub(crate) Observed);

impl PartialEq for ObservedCell {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// Every limit's observations; equal to any other (observations are not the table's state).
#[derive(Debug, Clone, Default)]
pub(crate) struct Observations(pub(crate) FastMap<Arc<str>, Observed>);

impl PartialEq for Observations {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl crate::observe::Snapshot {
    /// The limits registered as `name`, in limit-name order.
    pub fn limits(&self, name: &str) -> Option<Vec<LimitInfo>> {
        self.get("limits", name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(k: &str) -> Option<Arc<str>> {
        Some(Arc::from(k))
    }

    #[test]
    fn grants_and_waits_are_kept_per_key() {
        let mut o = Observed::default();
        o.granted(1, Some(&key("a")), Duration::ZERO);
        o.queued(2, key("b"), Duration::from_millis(10));
        o.granted(2, None, Duration::from_millis(30));
        o.queued(3, key("b"), Duration::from_millis(10));
        o.withdrawn(3);
        o.withdrawn(3);
        o.queued(4, key("b"), Duration::from_millis(40));
        let waiting = BTreeMap::from([(key("b"), 1)]);
        o.forget_unless(|t| t == 4);
        assert_eq!(o.waiting_len(), 1);
        let keys = o.keys(&waiting);
        assert_eq!(o.withdrawn, 1, "withdrawn once");
        assert_eq!(keys.len(), 2);
        assert_eq!(
            (keys[0].key.as_deref(), keys[0].granted, keys[0].wait_p99_ms),
            (Some("a"), 1, 0.0)
        );
        let b = &keys[1];
        assert_eq!((b.waiting, b.granted), (1, 1));
        // 20 ms waited: reported within a factor of two.
        assert!((20.0..=40.0).contains(&b.wait_p50_ms), "{b:?}");
    }

    #[test]
    fn keys_are_bounded_and_the_oldest_grant_makes_room() {
        let mut o = Observed::default();
        for i in 0..(MAX_KEYS as u64 + 10) {
            o.granted(i, Some(&key(&format!("k{i:03}"))), Duration::from_secs(i));
        }
        let keys = o.keys(&BTreeMap::new());
        assert_eq!(keys.len(), MAX_KEYS);
        assert_eq!(keys[0].key.as_deref(), Some("k010"), "the ten oldest were evicted");
    }
}
