//! Outage policies against a dedicated `redis-server` (on an ephemeral port, so the shared
//! Redis of the other tests is never disturbed) that the tests kill and restart.

mod common;

use std::time::Duration;

use common::DedicatedRedis;
use lanes::{LimitSpec, Limits, Priority};
use lanes_redis::{OutagePolicy, RedisLimits};
use tokio::time::{Instant, sleep, timeout};

async fn client(redis: &DedicatedRedis, policy: OutagePolicy) -> RedisLimits {
    RedisLimits::builder(redis.url())
        .namespace("outage")
        .op_timeout(Duration::from_millis(200))
        .lease(Duration::from_millis(300))
        .outage(policy)
        .build()
        .await
        .expect("the dedicated redis-server answers")
}

/// Retries `acquire` until Redis answers again (the connection manager reconnects).
async fn acquire_when_back(limits: &Limits, name: &str) -> lanes::Permit {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match limits.acquire(name, Priority::default()).await {
            Ok(permit) => return permit,
            Err(err) if Instant::now() < deadline => {
                assert!(err.is_backend(), "{err}");
                sleep(Duration::from_millis(50)).await;
            }
            Err(err) => panic!("redis did not come back: {err}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_refuses_within_a_bounded_time_and_resumes() {
    let mut redis = DedicatedRedis::start();
    let backend = client(&redis, OutagePolicy::FailClosed).await;
    let limits = Limits::with_backend(backend.clone());
    limits.define("db", LimitSpec::concurrent(1)).await.unwrap();
    let held = limits.acquire("db", Priority::default()).await.unwrap();
    let waiter = tokio::spawn({
        let limits = limits.clone();
        async move { limits.acquire("db", Priority::default()).await.map(|_| ()) }
    });
    sleep(Duration::from_millis(100)).await;
    redis.stop();
    let asked = Instant::now();
    let err = limits.acquire("db", Priority::default()).await.unwrap_err();
    assert!(err.is_backend(), "{err}");
    assert!(asked.elapsed() < Duration::from_secs(1), "bounded: {:?}", asked.elapsed());
    // A waiter learns of the outage at its next ask (within the re-ask period).
    let waited =
        timeout(Duration::from_secs(3), waiter).await.expect("the waiter gives up").unwrap();
    assert!(waited.unwrap_err().is_backend());
    drop(held);

    redis.restart();
    // The restarted Redis forgot everything: the client defines its limit again.
    let permit = acquire_when_back(&limits, "db").await;
    assert!(permit.fencing_token() >= 1);
    assert!(backend.stats().redefinitions >= 1, "{:?}", backend.stats());
    assert!(backend.stats().outages >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_grants_without_a_permit() {
    let mut redis = DedicatedRedis::start();
    let backend = client(&redis, OutagePolicy::FailOpen).await;
    let limits = Limits::with_backend(backend.clone());
    limits.define("db", LimitSpec::concurrent(1)).await.unwrap();
    redis.stop();
    let mut permits = Vec::new();
    for _ in 0..3 {
        let permit = limits.acquire("db", Priority::default()).await.unwrap();
        assert_eq!(permit.fencing_token(), 0, "no real permit behind it");
        permits.push(permit);
    }
    assert_eq!(backend.stats().open_grants, 3);
    drop(permits);
    redis.restart();
    let permit = acquire_when_back(&limits, "db").await;
    assert!(permit.fencing_token() >= 1, "real permits again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_share_falls_back_to_a_share_of_the_spec() {
    let mut redis = DedicatedRedis::start();
    let backend = client(&redis, OutagePolicy::LocalShare(0.5)).await;
    let limits = Limits::with_backend(backend.clone());
    limits.define("db", LimitSpec::concurrent(4)).await.unwrap();
    redis.stop();
    let first = limits.acquire("db", Priority::default()).await.unwrap();
    let second = limits.acquire("db", Priority::default()).await.unwrap();
    // Half of 4: a third waits.
    let third = limits.acquire_timeout("db", Priority::default(), Duration::from_millis(200)).await;
    assert!(third.unwrap_err().is_timeout());
    drop(first);
    let third = limits.acquire_timeout("db", Priority::default(), Duration::from_secs(1)).await;
    assert!(third.is_ok(), "a local permit came back");
    let local = backend.stats().local_acquires;
    assert!(local >= 3, "{:?}", backend.stats());
    drop((second, third));

    redis.restart();
    let _remote = acquire_when_back(&limits, "db").await;
    let stats = backend.stats();
    assert!(stats.redefinitions >= 1, "back on Redis: {stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_held_through_an_outage_are_reported_lost_when_redis_forgot_them() {
    let mut redis = DedicatedRedis::start();
    let backend = client(&redis, OutagePolicy::FailClosed).await;
    let limits = Limits::with_backend(backend.clone());
    limits.define("db", LimitSpec::concurrent(1)).await.unwrap();
    let held = limits.acquire("db", Priority::default()).await.unwrap();
    let stopped = Instant::now();
    redis.stop();
    // Its lease ends without a renewal: the holder is told then, Redis or not.
    timeout(Duration::from_secs(5), held.lost()).await.expect("the lost lease is reported");
    let told = stopped.elapsed();
    assert!(told <= backend.lease() + Duration::from_millis(100), "told after {told:?}");
    assert!(held.lease_lost() && backend.stats().lost_leases == 1, "{:?}", backend.stats());
    redis.restart();
    // Once Redis answers, a renewal is refused: the restarted Redis has no record of it.
    let deadline = Instant::now() + Duration::from_secs(5);
    let err = loop {
        let err = backend.renew("db", held.ticket()).await.unwrap_err();
        if !err.is_backend() {
            break err;
        }
        assert!(Instant::now() < deadline, "Redis answers again: {err}");
        sleep(Duration::from_millis(50)).await;
    };
    assert!(err.is_lease_expired(), "{err}");
}
