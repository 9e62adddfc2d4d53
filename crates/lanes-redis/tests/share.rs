//! Leased capacity's ledger run in Redis (`RedisLimits::refresh_share`, the `lease` operation
//! of limits.lua) against the pure core it ports (`lanes::limit::share::Ledger`): random
//! refreshes by six clients with random demands at random priority levels, both policies; the
//! shares Redis gives are the ones the core gives, refresh after refresh. Plus what only the
//! store can show: a silent client's share comes free when its lease ends, a restarted Redis
//! gives no share for the longest lease, and the blocks of fencing tokens never overlap.

mod common;

use std::time::Duration;

use lanes::limit::LimitSpec;
use lanes::limit::share::{Demand, Ledger, SharePolicy};
use lanes_redis::RedisLimits;
use proptest::prelude::*;
use tokio::time::sleep;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

async fn clients(ns: &str, n: usize, lease: Duration) -> Vec<RedisLimits> {
    let mut clients = Vec::new();
    for _ in 0..n {
        clients.push(common::builder(ns).lease(lease).build().await.unwrap_or_else(|e| {
            panic!("Redis is not reachable at {} ({e}); set REDIS_URL", common::redis_url())
        }));
    }
    clients
}

/// Defines "leased" in leased mode from a client that then goes away: the clients under test
/// call `refresh_share` themselves, and nobody refreshes in the background. (The definer's own
/// first refresh leaves an entry that wants nothing and reserves nothing.)
async fn define_leased(ns: &str, capacity: u32, policy: SharePolicy) {
    let definer = common::builder(ns).build().await.unwrap();
    definer.define_leased("leased", LimitSpec::concurrent(capacity), policy).await.unwrap();
    sleep(Duration::from_millis(20)).await;
}

fn step() -> impl Strategy<Value = (usize, Vec<(u8, u32)>, u32)> {
    (0usize..6, prop::collection::vec((0u8..3, 0u32..30), 0..3), 0u32..=100)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn redis_gives_the_shares_the_core_gives(
        capacity in 1u32..60,
        proportional in any::<bool>(),
        steps in prop::collection::vec(step(), 1..40),
    ) {
        let policy = if proportional { SharePolicy::Proportional } else { SharePolicy::MaxMinFair };
        runtime().block_on(async {
            let ns = common::unique_ns("share");
            let _cleanup = common::Cleanup::on(common::Target::Single, &ns);
            // Leases far longer than the test: the sequence alone decides the shares.
            let clients = clients(&ns, 6, Duration::from_secs(600)).await;
            define_leased(&ns, capacity, policy).await;
            let mut ledger = Ledger::new(capacity, policy, u64::MAX / 4);
            for (now, (k, levels, held_pct)) in steps.into_iter().enumerate() {
                let id = clients[k].ledger_id();
                let demand = levels.iter().fold(Demand::none(), |d, (level, n)| d.at(*level, *n));
                let reserved = ledger.clients(now as u64).find(|c| c.client == id).map_or(0, |c| c.reserved);
                let held = reserved * held_pct / 100;
                let expected = ledger.refresh(id, demand.clone(), held, now as u64).share;
                let got = clients[k].refresh_share("leased", &demand, held, policy, 0).await.unwrap();
                assert_eq!(got.share, expected, "step {now}: client {k} {demand:?} held {held}");
            }
        });
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_clients_share_comes_free_when_its_lease_ends() {
    let ns = common::unique_ns("share-silent");
    let _cleanup = common::Cleanup::on(common::Target::Single, &ns);
    let lease = Duration::from_millis(300);
    let clients = clients(&ns, 2, lease).await;
    define_leased(&ns, 10, SharePolicy::MaxMinFair).await;
    let wants = Demand::of(10);
    let first =
        clients[0].refresh_share("leased", &wants, 0, SharePolicy::MaxMinFair, 4).await.unwrap();
    assert_eq!(first.share, 10);
    let second =
        clients[1].refresh_share("leased", &wants, 0, SharePolicy::MaxMinFair, 4).await.unwrap();
    assert_eq!(second.share, 0, "everything is reserved for the first client");
    assert!(second.tokens.start >= first.tokens.end, "{first:?} then {second:?}");
    assert_eq!(
        (first.tokens.end - first.tokens.start, second.tokens.end - second.tokens.start),
        (4, 4)
    );
    // The first client goes silent: after its lease, its share is free.
    sleep(lease + Duration::from_millis(50)).await;
    let later =
        clients[1].refresh_share("leased", &wants, 0, SharePolicy::MaxMinFair, 0).await.unwrap();
    assert_eq!(later.share, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_redis_gives_no_share_for_the_longest_lease() {
    let mut redis = common::DedicatedRedis::start();
    let lease = Duration::from_millis(400);
    let client = RedisLimits::builder(redis.url())
        .namespace("share-restart")
        .lease(lease)
        .op_timeout(Duration::from_millis(200))
        .build()
        .await
        .unwrap();
    // Past the server's first lease, as its uptime tells (whole seconds, which may read up to
    // a second more than the time served, so the start is taken a second later): a limit made
    // new in it is held, as one an empty restart may have forgotten.
    sleep(Duration::from_millis(2_100)).await;
    // The definer stays: after the restart it defines the limit again, with the hold.
    let definer = RedisLimits::builder(redis.url())
        .namespace("share-restart")
        .lease(lease)
        .op_timeout(Duration::from_millis(200))
        .build()
        .await
        .unwrap();
    definer
        .define_leased("leased", LimitSpec::concurrent(4), SharePolicy::MaxMinFair)
        .await
        .unwrap();
    let wants = Demand::of(4);
    assert_eq!(
        client.refresh_share("leased", &wants, 0, SharePolicy::MaxMinFair, 0).await.unwrap().share,
        4
    );
    redis.stop();
    redis.restart();
    // The definer sees the loss and defines the limit again with a hold of the longest lease.
    let mut shares = Vec::new();
    let started = tokio::time::Instant::now();
    while started.elapsed() < lease * 3 {
        if let Ok(lease) =
            client.refresh_share("leased", &wants, 0, SharePolicy::MaxMinFair, 0).await
        {
            shares.push((started.elapsed(), lease.share));
        }
        sleep(Duration::from_millis(20)).await;
    }
    let first_given = shares.iter().find(|(_, share)| *share > 0).expect("shares are given again");
    assert!(
        first_given.0 >= lease - Duration::from_millis(100),
        "given after {:?}: {shares:?}",
        first_given.0
    );
}
