//! Leased capacity's pure core (`lanes::limit::share`), property-tested: the apportioning never
//! gives more than the capacity or than anyone wants, wastes nothing, serves higher levels first,
//! is max-min fair (or proportional), does not depend on the order of the demands; and the
//! ledger of shares actually held never adds up to more than the capacity, never takes back
//! what a client handed out, and reaches the new targets within a few refreshes of a demand
//! change.

use lanes::limit::share::{Demand, Ledger, SharePolicy, apportion};
use proptest::prelude::*;

fn demands() -> impl Strategy<Value = Vec<(u64, Demand)>> {
    prop::collection::vec(prop::collection::vec((0u8..3, 0u32..40), 0..3), 0..12).prop_map(
        |clients| {
            clients
                .into_iter()
                .enumerate()
                .map(|(i, levels)| {
                    let demand = levels
                        .into_iter()
                        .fold(Demand::none(), |demand, (level, n)| demand.at(level, n));
                    (i as u64 * 7 + 3, demand)
                })
                .collect()
        },
    )
}

fn policy() -> impl Strategy<Value = SharePolicy> {
    prop_oneof![Just(SharePolicy::MaxMinFair), Just(SharePolicy::Proportional)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    #[test]
    fn shares_are_bounded_and_waste_nothing(capacity in 0u32..200, demands in demands(), policy in policy()) {
        let shares = apportion(capacity, &demands, policy);
        let total: u32 = demands.iter().map(|(_, d)| d.total()).sum();
        prop_assert_eq!(shares.iter().sum::<u32>(), capacity.min(total));
        for ((_, demand), share) in demands.iter().zip(&shares) {
            prop_assert!(*share <= demand.total());
        }
    }

    #[test]
    fn higher_levels_are_met_first(capacity in 0u32..200, demands in demands(), policy in policy()) {
        let shares = apportion(capacity, &demands, policy);
        for level in 0..3u8 {
            // Demand strictly above `level`, and what is given to demand at or below it.
            let above: u32 = demands
                .iter()
                .map(|(_, d)| d.levels().filter(|(l, _)| *l > level).map(|(_, n)| n).sum::<u32>())
                .sum();
            if above >= capacity {
                for ((_, demand), share) in demands.iter().zip(&shares) {
                    let own_above: u32 = demand.levels().filter(|(l, _)| *l > level).map(|(_, n)| n).sum();
                    prop_assert!(*share <= own_above, "level {}: {:?} got {}", level, demand, share);
                }
            }
        }
    }

    #[test]
    fn max_min_gives_nobody_more_than_an_unsatisfied_client(capacity in 0u32..200, wants in prop::collection::vec(0u32..60, 1..12)) {
        let demands: Vec<(u64, Demand)> = wants.iter().enumerate().map(|(i, w)| (i as u64, Demand::of(*w))).collect();
        let shares = apportion(capacity, &demands, SharePolicy::MaxMinFair);
        for (i, share) in shares.iter().enumerate() {
            if *share < wants[i] {
                for other in &shares {
                    prop_assert!(*other <= share + 1, "{:?} -> {:?}", wants, shares);
                }
            }
        }
    }

    #[test]
    fn proportional_is_within_one_of_exact(capacity in 0u32..200, wants in prop::collection::vec(0u32..60, 1..12)) {
        let demands: Vec<(u64, Demand)> = wants.iter().enumerate().map(|(i, w)| (i as u64, Demand::of(*w))).collect();
        let shares = apportion(capacity, &demands, SharePolicy::Proportional);
        let total: u32 = wants.iter().sum();
        if total > capacity {
            for (want, share) in wants.iter().zip(&shares) {
                let exact = f64::from(capacity) * f64::from(*want) / f64::from(total);
                prop_assert!((f64::from(*share) - exact).abs() < 1.0, "{:?} -> {:?}", wants, shares);
            }
        }
    }

    #[test]
    fn the_order_of_the_demands_does_not_matter(capacity in 0u32..200, demands in demands(), policy in policy(), seed in any::<u64>()) {
        let shares = apportion(capacity, &demands, policy);
        let mut shuffled: Vec<usize> = (0..demands.len()).collect();
        let mut state = seed | 1;
        for i in (1..shuffled.len()).rev() {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            shuffled.swap(i, (state % (i as u64 + 1)) as usize);
        }
        let reordered: Vec<(u64, Demand)> = shuffled.iter().map(|&i| demands[i].clone()).collect();
        let again = apportion(capacity, &reordered, policy);
        for (k, &i) in shuffled.iter().enumerate() {
            prop_assert_eq!(again[k], shares[i]);
        }
    }

    /// Random refreshes (random demands, clients holding anything up to what was reserved for
    /// them, some going silent): what is reserved for live leases never adds up to more than
    /// the capacity, and a client's reservation always covers what it holds.
    #[test]
    fn the_ledger_never_overcommits(capacity in 1u32..100, steps in prop::collection::vec((0u64..8, 0u32..60, 0u32..=100, 1u64..400), 1..200)) {
        let mut ledger = Ledger::new(capacity, SharePolicy::MaxMinFair, 1_000);
        let mut now = 0u64;
        for (client, want, held_pct, dt) in steps {
            now += dt;
            // A client holds at most what the ledger reserved for it (nothing once its lease ended).
            let reserved = ledger.clients(now).find(|c| c.client == client).map_or(0, |c| c.reserved);
            let held = reserved * held_pct / 100;
            let lease = ledger.refresh(client, Demand::of(want), held, now);
            let entry = ledger.clients(now).find(|c| c.client == client).unwrap().clone();
            prop_assert!(entry.reserved >= held && entry.reserved >= lease.share);
            prop_assert!(ledger.allocated(now) <= capacity, "{} > {}", ledger.allocated(now), capacity);
        }
    }

    /// After a demand change, with holders that turn over (each refresh, a client has out what
    /// it wants, up to its last share), every share reaches its new target within three rounds
    /// of refreshes once every client has reported the change (the round in which they report
    /// it computes targets from a mix of old and new demands).
    #[test]
    fn shares_reach_new_targets_within_three_refreshes_of_the_change(capacity in 1u32..100, before in prop::collection::vec(0u32..60, 1..10), after in prop::collection::vec(0u32..60, 1..10)) {
        let n = before.len().min(after.len());
        let mut ledger = Ledger::new(capacity, SharePolicy::MaxMinFair, 10_000);
        let mut now = 0;
        let mut shares = vec![0u32; n];
        for _ in 0..3 {
            for i in 0..n {
                now += 1;
                shares[i] = ledger.refresh(i as u64, Demand::of(before[i]), shares[i].min(before[i]), now).share;
            }
        }
        let demands: Vec<(u64, Demand)> = (0..n).map(|i| (i as u64, Demand::of(after[i]))).collect();
        let targets = apportion(capacity, &demands, SharePolicy::MaxMinFair);
        // The round in which each client reports its new demand, then three more.
        for _ in 0..4 {
            for i in 0..n {
                now += 1;
                // Its holders turn over: it has out what it wants, up to its last share.
                let held = shares[i].min(after[i]);
                shares[i] = ledger.refresh(i as u64, Demand::of(after[i]), held, now).share;
            }
        }
        prop_assert_eq!(&shares, &targets, "demands {:?} -> {:?}", before, after);
    }
}
