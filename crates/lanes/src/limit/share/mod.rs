//! Leased capacity, the pure part: how a limit's capacity is apportioned among the clients that
//! serve it locally, each from a share it holds for a lease.
//!
//! A fleet that asks a store for every permit pays a round trip per acquire and makes the
//! store see every acquire of every instance. With leased capacity each client holds a *share*
//! of a limit (a number of permits) for a lease, states its *demand* at each refresh (its
//! holders plus its waiters, per priority level), and serves acquires from its share with no
//! round trip. This module decides the shares; it does no I/O and reads no clock (times are
//! milliseconds the caller passes), so a store can run it and a test can replay it.
//!
//! - [`apportion`]: the target shares for a set of demands. Priority levels first (capacity
//!   goes to the demand at the highest level before any lower level gets some), then within a
//!   level [`SharePolicy::MaxMinFair`] (water-filling: nobody gets more than an unsatisfied
//!   client, give or take one permit) or [`SharePolicy::Proportional`] (shares in proportion to
//!   demand, largest remainders first). Deterministic: the order of the demands does not matter.
//! - [`Ledger`]: the shares actually given, moved to the targets at each client's refresh
//!   without ever committing more than the capacity. A client's share is the most permits it
//!   may have out; what the ledger *reserves* for it is its share or what it says it holds,
//!   whichever is larger, because a client cannot take back permits it has handed out. So a
//!   share cut below what its client holds takes effect at once for new permits, and the
//!   capacity comes free for others only as the client's holders release (its next refresh
//!   reports it). A share grows only into capacity nobody has reserved. A client that stops
//!   refreshing loses its reservation when its lease ends (its permits end with the lease
//!   too). A ledger that starts after a restart gives no share for one lease, because shares
//!   given before the restart may still be in use.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

mod client;

pub use client::{
    LocalShare, RateDemand, RateLease, ShareLease, ShareRequest, ShareSource, keep_share,
    lease_end, level_of,
};

/// How capacity is shared among the clients of one priority level whose demand exceeds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SharePolicy {
    /// Max-min fair (the default): every client gets its demand or an equal part of what is
    /// left, whichever is smaller; what small demands leave goes to the larger ones.
    #[default]
    MaxMinFair,
    /// In proportion to demand (rounded down, the remainders handed out largest first).
    Proportional,
}

impl SharePolicy {
    /// The policy's name on the wire (as serde writes it): `max_min_fair` or `proportional`.
    pub fn name(self) -> &'static str {
        match self {
            Self::MaxMinFair => "max_min_fair",
            Self::Proportional => "proportional",
        }
    }

    /// The policy named `name` (see [`name`](Self::name)).
    pub fn from_name(name: &str) -> Option<Self> {
        [Self::MaxMinFair, Self::Proportional].into_iter().find(|p| p.name() == name)
    }
}

/// What one client wants of a limit: permits per priority level (its holders and its waiters
/// at that level). Higher levels are served first.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Demand {
    levels: BTreeMap<u8, u32>,
}

impl Demand {
    /// No demand.
    pub fn none() -> Self {
        Self::default()
    }

    /// `permits` at the default level (0).
    pub fn of(permits: u32) -> Self {
        Self::none().at(0, permits)
    }

    /// Adds `permits` at `level`.
    #[must_use]
    pub fn at(mut self, level: u8, permits: u32) -> Self {
        if permits > 0 {
            let entry = self.levels.entry(level).or_insert(0);
            *entry = entry.saturating_add(permits);
        }
        self
    }

    /// The permits wanted in all.
    pub fn total(&self) -> u32 {
        self.levels.values().fold(0u32, |sum, n| sum.saturating_add(*n))
    }

    /// The permits wanted at `level`.
    pub fn level(&self, level: u8) -> u32 {
        self.levels.get(&level).copied().unwrap_or(0)
    }

    /// The levels with demand, highest first.
    pub fn levels(&self) -> impl Iterator<Item = (u8, u32)> + '_ {
        self.levels.iter().rev().map(|(level, permits)| (*level, *permits))
    }
}

/// The target share of each client, in the order of `demands` (`(client, demand)` pairs, each
/// client once). The shares add up to `min(capacity, total demand)`; nobody gets more than it
/// wants; the demand at a higher level is met before any at a lower level; within a level,
/// `policy` decides.
pub fn apportion(capacity: u32, demands: &[(u64, Demand)], policy: SharePolicy) -> Vec<u32> {
    let mut shares = vec![0u32; demands.len()];
    let mut left = capacity;
    let mut levels: Vec<u8> =
        demands.iter().flat_map(|(_, demand)| demand.levels.keys().copied()).collect();
    levels.sort_unstable_by(|a, b| b.cmp(a));
    levels.dedup();
    for level in levels {
        if left == 0 {
            break;
        }
        let wants: Vec<(u64, u32, usize)> = demands
            .iter()
            .enumerate()
            .filter_map(|(i, (client, demand))| {
                let want = demand.level(level);
                (want > 0).then_some((*client, want, i))
            })
            .collect();
        let given = match policy {
            SharePolicy::MaxMinFair => max_min(left, &wants),
            SharePolicy::Proportional => proportional(left, &wants),
        };
        for ((_, _, i), give) in wants.iter().zip(given) {
            shares[*i] += give;
            left -= give;
        }
    }
    shares
}

/// Water-filling: in increasing order of want (ties by client), each gets its want or an equal
/// part of what is left. Returns the gifts in the order of `wants`.
fn max_min(capacity: u32, wants: &[(u64, u32, usize)]) -> Vec<u32> {
    let mut order: Vec<usize> = (0..wants.len()).collect();
    order.sort_unstable_by_key(|&k| (wants[k].1, wants[k].0));
    let mut given = vec![0u32; wants.len()];
    let mut left = capacity;
    for (done, &k) in order.iter().enumerate() {
        let remaining = u32::try_from(order.len() - done).unwrap_or(u32::MAX);
        let give = wants[k].1.min(left / remaining);
        given[k] = give;
        left -= give;
    }
    // What the rounding left: one more each to the unsatisfied, largest want first.
    for &k in order.iter().rev() {
        if left == 0 {
            break;
        }
        if given[k] < wants[k].1 {
            given[k] += 1;
            left -= 1;
        }
    }
    given
}

/// Shares in proportion to want (rounded down, remainders largest first, ties by client).
fn proportional(capacity: u32, wants: &[(u64, u32, usize)]) -> Vec<u32> {
    let total: u64 = wants.iter().map(|w| u64::from(w.1)).sum();
    if total <= u64::from(capacity) {
        return wants.iter().map(|w| w.1).collect();
    }
    let exact: Vec<(u32, u64)> = wants
        .iter()
        .map(|w| {
            let scaled = u64::from(capacity) * u64::from(w.1);
            (u32::try_from(scaled / total).unwrap_or(u32::MAX), scaled % total)
        })
        .collect();
    let mut given: Vec<u32> = exact.iter().map(|e| e.0).collect();
    let mut left = capacity - given.iter().sum::<u32>();
    let mut order: Vec<usize> = (0..wants.len()).collect();
    order.sort_unstable_by(|&a, &b| exact[b].1.cmp(&exact[a].1).then(wants[a].0.cmp(&wants[b].0)));
    for k in order {
        if left == 0 {
            break;
        }
        if given[k] < wants[k].1 {
            given[k] += 1;
            left -= 1;
        }
    }
    given
}

/// One client's entry in a [`Ledger`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientShare {
    /// The client.
    pub client: u64,
    /// The most permits it may have out (handed to local holders) until its lease ends.
    pub share: u32,
    /// The capacity set aside for it: `max(share, held)`.
    pub reserved: u32,
    /// What it said it wants at its last refresh.
    pub demand: Demand,
    /// Permits it said it held (handed out to local holders) at its last refresh.
    pub held: u32,
    /// When its lease ends (ms, the ledger's clock).
    pub expires: u64,
}

/// The answer to a refresh: the client's share until `expires`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// The permits the client may hand out (its local holders included).
    pub share: u32,
    /// When the lease ends (ms, the ledger's clock): without a refresh by then, the client
    /// stops handing out permits from it.
    pub expires: u64,
}

/// The shares of one limit's capacity actually held by its clients (see the module docs).
#[derive(Debug, Clone)]
pub struct Ledger {
    capacity: u32,
    policy: SharePolicy,
    lease_ms: u64,
    hold_until: u64,
    clients: BTreeMap<u64, ClientShare>,
    /// The targets of the live clients, until a demand or the set of clients changes.
    targets: Option<BTreeMap<u64, u32>>,
}

impl Ledger {
    /// A ledger of `capacity` permits, with leases of `lease_ms`.
    pub fn new(capacity: u32, policy: SharePolicy, lease_ms: u64) -> Self {
        Self { capacity, policy, lease_ms, hold_until: 0, clients: BTreeMap::new(), targets: None }
    }

    /// A ledger that (re)starts at `now` without knowing what was handed out before: it hands
    /// out nothing until one lease has passed, by when every share given before has ended.
    pub fn restarted(capacity: u32, policy: SharePolicy, lease_ms: u64, now: u64) -> Self {
        Self { hold_until: now.saturating_add(lease_ms), ..Self::new(capacity, policy, lease_ms) }
    }

    /// The capacity apportioned.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Changes the capacity. Shares above the new targets shrink as their clients refresh
    /// (and as far as their holders allow), so for a while they may add up to more than a
    /// lowered capacity; nothing grows until they add up to less.
    pub fn set_capacity(&mut self, capacity: u32) {
        self.capacity = capacity;
        self.targets = None;
    }

    /// The capacity reserved for live leases at `now` (shares, or what their clients hold
    /// where that is more).
    pub fn allocated(&self, now: u64) -> u32 {
        self.clients.values().filter(|c| c.expires > now).map(|c| c.reserved).sum()
    }

    /// Every client with a live lease at `now`, by client id.
    pub fn clients(&self, now: u64) -> impl Iterator<Item = &ClientShare> {
        self.clients.values().filter(move |c| c.expires > now)
    }

    /// The target shares of the clients with a live lease at `now`, by client id.
    pub fn targets(&self, now: u64) -> Vec<(u64, u32)> {
        let live: Vec<(u64, Demand)> =
            self.clients(now).map(|c| (c.client, c.demand.clone())).collect();
        let targets = apportion(self.capacity, &live, self.policy);
        live.iter().map(|(client, _)| *client).zip(targets).collect()
    }

    /// `client`'s target, from the targets of the current clients (computed again only when a
    /// demand or the set of clients changed since).
    fn target_of(&mut self, client: u64, now: u64) -> u32 {
        if self.targets.is_none() {
            self.targets = Some(self.targets(now).into_iter().collect());
        }
        self.targets.as_ref().and_then(|t| t.get(&client).copied()).unwrap_or(0)
    }

    /// Client `client` refreshes at `now`: it wants `demand` and has `held` permits out with
    /// local holders (never more than what was reserved for it: its last share, or what it
    /// held then). Its share becomes its target, or as much of it as capacity nobody else has
    /// reserved allows; its reservation, the larger of its share and `held`.
    pub fn refresh(&mut self, client: u64, demand: Demand, held: u32, now: u64) -> Lease {
        let before = self.clients.len();
        self.clients.retain(|_, c| c.expires > now);
        if self.clients.len() != before || !self.clients.contains_key(&client) {
            self.targets = None;
        }
        let expires = now.saturating_add(self.lease_ms);
        let entry = self.clients.entry(client).or_insert_with(|| ClientShare {
            client,
            share: 0,
            reserved: 0,
            demand: Demand::none(),
            held: 0,
            expires,
        });
        if entry.demand != demand {
            entry.demand = demand;
            self.targets = None;
        }
        entry.held = held;
        entry.expires = expires;
        let share = if now < self.hold_until {
            0
        } else {
            let target = self.target_of(client, now);
            let others: u32 =
                self.clients.values().filter(|c| c.client != client).map(|c| c.reserved).sum();
            target.min(self.capacity.saturating_sub(others))
        };
        let entry = self.clients.get_mut(&client).expect("inserted above");
        entry.share = share;
        entry.reserved = share.max(held);
        Lease { share, expires }
    }

    /// Client `client` gives its share back (it stops, gracefully).
    pub fn leave(&mut self, client: u64) {
        if self.clients.remove(&client).is_some() {
            self.targets = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flat(wants: &[u32]) -> Vec<(u64, Demand)> {
        wants.iter().enumerate().map(|(i, w)| (i as u64, Demand::of(*w))).collect()
    }

    #[test]
    fn a_policy_is_named_as_serde_writes_it() {
        for policy in [SharePolicy::MaxMinFair, SharePolicy::Proportional] {
            let json = serde_json::to_string(&policy).unwrap();
            assert_eq!(json, format!("\"{}\"", policy.name()));
            assert_eq!(SharePolicy::from_name(policy.name()), Some(policy));
        }
        assert_eq!(SharePolicy::from_name("lottery"), None);
    }

    #[test]
    fn max_min_fills_small_demands_and_splits_the_rest() {
        assert_eq!(apportion(10, &flat(&[2, 10, 10]), SharePolicy::MaxMinFair), [2, 4, 4]);
        assert_eq!(apportion(10, &flat(&[1, 2, 3]), SharePolicy::MaxMinFair), [1, 2, 3]);
        assert_eq!(apportion(10, &flat(&[10, 10, 10]), SharePolicy::MaxMinFair), [3, 3, 4]);
        assert_eq!(apportion(0, &flat(&[5]), SharePolicy::MaxMinFair), [0]);
    }

    #[test]
    fn proportional_follows_demand() {
        assert_eq!(apportion(10, &flat(&[10, 30]), SharePolicy::Proportional), [3, 7]);
        assert_eq!(apportion(100, &flat(&[10, 30]), SharePolicy::Proportional), [10, 30]);
        assert_eq!(
            apportion(3, &flat(&[1, 1, 1, 1]), SharePolicy::Proportional).iter().sum::<u32>(),
            3
        );
    }

    #[test]
    fn higher_levels_are_served_first() {
        let demands =
            vec![(1, Demand::of(10)), (2, Demand::of(2).at(5, 4)), (3, Demand::none().at(9, 3))];
        assert_eq!(apportion(8, &demands, SharePolicy::MaxMinFair), [1, 4, 3]);
        assert_eq!(apportion(5, &demands, SharePolicy::MaxMinFair), [0, 2, 3]);
    }

    #[test]
    fn a_share_is_cut_at_once_and_its_capacity_freed_as_holders_release() {
        let mut ledger = Ledger::new(10, SharePolicy::MaxMinFair, 1_000);
        assert_eq!(ledger.refresh(1, Demand::of(10), 0, 0).share, 10);
        // Client 2 arrives: its target is 5, but client 1 has all 10 reserved.
        assert_eq!(ledger.refresh(2, Demand::of(10), 0, 10).share, 0);
        // Client 1 is cut to 5 at once, but 8 are out with its holders: 8 stay reserved.
        assert_eq!(ledger.refresh(1, Demand::of(10), 8, 20).share, 5);
        assert_eq!(ledger.allocated(20), 8);
        assert_eq!(ledger.refresh(2, Demand::of(10), 0, 30).share, 2);
        // Its holders are down to its share: the rest is free.
        assert_eq!(ledger.refresh(1, Demand::of(10), 5, 40).share, 5);
        assert_eq!(ledger.refresh(2, Demand::of(10), 2, 50).share, 5);
        assert_eq!(ledger.allocated(50), 10);
    }

    #[test]
    fn a_silent_client_loses_its_share_when_its_lease_ends() {
        let mut ledger = Ledger::new(4, SharePolicy::MaxMinFair, 1_000);
        ledger.refresh(1, Demand::of(4), 0, 0);
        assert_eq!(ledger.refresh(2, Demand::of(4), 0, 999).share, 0);
        assert_eq!(ledger.refresh(2, Demand::of(4), 0, 1_000).share, 4);
    }

    #[test]
    fn a_restarted_ledger_hands_out_nothing_for_a_lease() {
        let mut ledger = Ledger::restarted(4, SharePolicy::MaxMinFair, 1_000, 5_000);
        assert_eq!(ledger.refresh(1, Demand::of(4), 0, 5_500).share, 0);
        assert_eq!(ledger.refresh(1, Demand::of(4), 0, 6_000).share, 4);
    }
}
