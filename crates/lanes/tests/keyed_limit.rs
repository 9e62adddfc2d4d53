//! `KeyedLimit` through its public API: per-key rate and concurrency, the key's line, cancel
//! safety, deadlines, the waiting room, forgetting idle keys, and real threads hammering it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lanes::limit::{KeyedLimit, KeyedLimitInfo};
use lanes::{ConfigRule, LimitSpec, Registry};
use tokio::time::Instant;

fn keyed(spec: LimitSpec) -> KeyedLimit {
    KeyedLimit::new("test", spec).expect("valid spec")
}

#[tokio::test(start_paused = true)]
async fn each_key_has_its_own_bucket_and_a_refusal_says_when_to_come_back() {
    let limit = keyed(LimitSpec::rate(2.0).burst(2));
    assert!(limit.check("a").is_ok());
    assert!(limit.check("a").is_ok());
    let refused = limit.check("a").unwrap_err();
    assert!(refused.is_rate_limited());
    assert_eq!(refused.retry_after(), Some(Duration::from_millis(500)));
    assert!(limit.check("b").is_ok(), "another key is another limit");
    tokio::time::advance(Duration::from_millis(499)).await;
    assert!(limit.check("a").is_err());
    tokio::time::advance(Duration::from_millis(1)).await;
    assert!(limit.check("a").is_ok());
    let info = limit.info();
    assert_eq!((info.acquired_total, info.refused_total), (4, 2));
}

#[tokio::test(start_paused = true)]
async fn a_key_holds_at_most_its_concurrency_and_returns_permits_when_dropped() {
    let limit = keyed(LimitSpec::concurrent(2));
    let a1 = limit.try_acquire("a").unwrap();
    let _a2 = limit.try_acquire("a").unwrap();
    assert!(limit.try_acquire("a").unwrap_err().is_busy());
    assert!(limit.check("a").unwrap_err().is_busy(), "a check needs a free permit");
    let _b = limit.try_acquire("b").unwrap();
    assert_eq!(a1.key(), "a");
    assert_eq!(limit.info().held, 3);
    drop(a1);
    assert!(limit.try_acquire("a").is_ok());
}

#[tokio::test(start_paused = true)]
async fn callers_of_a_busy_key_are_served_in_arrival_order_and_nobody_overtakes_them() {
    let limit = keyed(LimitSpec::concurrent(1));
    let held = limit.try_acquire("k").unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..5 {
        let (limit, order) = (limit.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            let permit = limit.acquire("k").await.expect("a permit");
            order.lock().unwrap().push(i);
            tokio::time::sleep(Duration::from_millis(10)).await;
            drop(permit);
        }));
        tokio::task::yield_now().await;
    }
    assert_eq!(limit.info().waiting, 5);
    drop(held);
    // Handed to the first in line: a try cannot take it, even before the first one runs.
    assert!(limit.try_acquire("k").unwrap_err().is_busy());
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), [0, 1, 2, 3, 4]);
    let info = limit.info();
    assert_eq!((info.held, info.waiting, info.acquired_total), (0, 0, 6));
}

#[tokio::test(start_paused = true)]
async fn a_caller_dropped_in_line_leaves_it_and_one_dropped_after_its_turn_passes_it_on() {
    let limit = keyed(LimitSpec::concurrent(1));
    let held = limit.try_acquire("k").unwrap();
    // Two callers join the line; the first is handed the permit, then dropped unpolled.
    let mut first = Box::pin(limit.acquire("k"));
    let mut second = Box::pin(limit.acquire("k"));
    let third = tokio::spawn({
        let limit = limit.clone();
        async move { limit.acquire("k").await.map(drop) }
    });
    assert!(futures_poll(&mut first).is_none());
    assert!(futures_poll(&mut second).is_none());
    tokio::task::yield_now().await;
    assert_eq!(limit.info().waiting, 3);
    // The second leaves before its turn.
    drop(second);
    assert_eq!(limit.info().waiting, 2);
    drop(held);
    // The first was handed the permit; dropped without taking it, it passes it on.
    drop(first);
    tokio::time::timeout(Duration::from_secs(1), third)
        .await
        .expect("the third got the permit the first passed on")
        .unwrap()
        .unwrap();
    let info = limit.info();
    assert_eq!((info.held, info.waiting), (0, 0));
    assert!(limit.try_acquire("k").is_ok());
}

/// Polls a future once with a no-op waker.
fn futures_poll<F: std::future::Future + Unpin>(future: &mut F) -> Option<F::Output> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match std::pin::Pin::new(future).poll(&mut cx) {
        std::task::Poll::Ready(out) => Some(out),
        std::task::Poll::Pending => None,
    }
}

#[tokio::test(start_paused = true)]
async fn a_deadline_ends_a_wait_in_line_and_refuses_at_once_a_token_that_would_come_too_late() {
    let limit = keyed(LimitSpec::concurrent(1));
    let held = limit.try_acquire("k").unwrap();
    let started = Instant::now();
    let err = limit.acquire_timeout("k", Duration::from_millis(50)).await.unwrap_err();
    assert!(err.is_timeout());
    assert_eq!(started.elapsed(), Duration::from_millis(50));
    drop(held);
    assert_eq!(limit.info().timed_out_total, 1);
    assert!(limit.try_acquire("k").is_ok(), "the timed-out caller left the line");

    let held = limit.try_acquire("k").unwrap();
    let deadline = Instant::now() + Duration::from_millis(30);
    let err = limit.acquire_until("k", deadline).await.unwrap_err();
    assert_eq!(err, lanes::AcquireError::Timeout(Duration::from_millis(30)));
    assert_eq!(Instant::now(), deadline);
    drop(held);
    assert_eq!(limit.info().timed_out_total, 2);

    let rate = keyed(LimitSpec::rate(1.0).burst(1));
    rate.check("k").unwrap();
    let started = Instant::now();
    let err = rate.acquire_timeout("k", Duration::from_millis(500)).await.unwrap_err();
    assert!(err.is_timeout());
    assert_eq!(started.elapsed(), Duration::ZERO, "refused at once");
    // Nothing was spent: the next token is still due one second after the first.
    tokio::time::advance(Duration::from_secs(1)).await;
    assert!(rate.check("k").is_ok());
}

#[tokio::test(start_paused = true)]
async fn rate_waits_are_served_in_reservation_order_one_interval_apart() {
    let limit = keyed(LimitSpec::rate(10.0).burst(1));
    let started = Instant::now();
    let grants = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..4 {
        let (limit, grants) = (limit.clone(), grants.clone());
        tasks.push(tokio::spawn(async move {
            let _permit = limit.acquire("k").await.unwrap();
            grants.lock().unwrap().push((i, started.elapsed()));
        }));
        tokio::task::yield_now().await;
    }
    for task in tasks {
        task.await.unwrap();
    }
    let grants = grants.lock().unwrap().clone();
    let at: Vec<_> = grants.iter().map(|(_, at)| at.as_millis()).collect();
    assert_eq!(at, [0, 100, 200, 300]);
    assert_eq!(grants.iter().map(|(i, _)| *i).collect::<Vec<_>>(), [0, 1, 2, 3]);
    assert_eq!(limit.info().waiting, 0);
}

#[tokio::test(start_paused = true)]
async fn a_wait_dropped_while_it_sleeps_returns_its_permit_but_not_its_token() {
    let limit = keyed(LimitSpec::concurrent(1).per_second(1.0));
    limit.check("k").unwrap();
    let sleeper = tokio::spawn({
        let limit = limit.clone();
        async move { limit.acquire("k").await.map(drop) }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(limit.info().waiting, 1);
    assert!(limit.try_acquire("k").unwrap_err().is_busy(), "the sleeper holds the permit");
    sleeper.abort();
    let _ = sleeper.await;
    let info = limit.info();
    assert_eq!((info.held, info.waiting), (0, 0));
    // Its token was spent: the next is due two seconds after the first, not one.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert!(limit.check("k").unwrap_err().is_rate_limited());
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert!(limit.check("k").is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_full_waiting_room_refuses_with_a_typed_error() {
    let limit: KeyedLimit =
        KeyedLimit::builder("room", LimitSpec::concurrent(1)).max_waiters(2).build().unwrap();
    let _held = limit.try_acquire("k").unwrap();
    let mut waiting = Vec::new();
    for _ in 0..2 {
        let limit = limit.clone();
        waiting.push(tokio::spawn(async move { limit.acquire("k").await.map(drop) }));
    }
    tokio::task::yield_now().await;
    let err = limit.acquire("k").await.unwrap_err();
    assert!(err.is_too_many_waiters(), "{err}");
    assert!(limit.try_acquire("other").is_ok(), "the room is per key");
    assert_eq!(limit.info().refused_total, 1);
}

#[tokio::test(start_paused = true)]
async fn callers_asleep_for_their_token_count_against_the_waiting_room() {
    let limit: KeyedLimit = KeyedLimit::builder("rate-room", LimitSpec::rate(1.0).burst(1))
        .max_waiters(2)
        .build()
        .unwrap();
    limit.check("k").unwrap();
    let mut asleep = Vec::new();
    for _ in 0..2 {
        let limit = limit.clone();
        asleep.push(tokio::spawn(async move { limit.acquire("k").await.map(drop) }));
    }
    tokio::task::yield_now().await;
    assert_eq!(limit.info().waiting, 2);
    let err = limit.acquire("k").await.unwrap_err();
    assert!(err.is_too_many_waiters(), "{err}");
    let started = Instant::now();
    for task in asleep {
        task.await.unwrap().unwrap();
    }
    assert_eq!(started.elapsed(), Duration::from_secs(2), "the refused caller spent nothing");
    let info = limit.info();
    assert_eq!((info.acquired_total, info.refused_total, info.waiting, info.held), (3, 1, 0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_key_an_operation_leaves_idle_is_not_kept() {
    let limit = keyed(LimitSpec::concurrent(3));
    limit.check("only-looked-at").unwrap();
    assert_eq!(limit.keys(), 0);
    drop(limit.try_acquire("held-once").unwrap());
    assert_eq!(limit.keys(), 1, "kept until a sweep");
    assert_eq!(limit.forget_idle(), 1);
}

#[tokio::test(start_paused = true)]
async fn idle_keys_are_forgotten_as_the_shards_grow_and_keys_in_use_never_are() {
    let limit = keyed(LimitSpec::concurrent(1).per_second(1.0));
    let held: Vec<_> = (0..10).map(|i| limit.try_acquire(&format!("held-{i}")).unwrap()).collect();
    for i in 0..100_000 {
        limit.check(&format!("once-{i}")).unwrap();
        if i % 1_000 == 0 {
            // Time passes: earlier keys' buckets fill up again and they become idle.
            tokio::time::advance(Duration::from_secs(2)).await;
        }
    }
    let kept = limit.keys();
    assert!(kept < 20_000, "{kept} keys kept after 100,000 distinct keys");
    // The held keys survived every sweep: their permits are still counted, and refused.
    for i in 0..10 {
        assert!(limit.try_acquire(&format!("held-{i}")).unwrap_err().is_busy());
    }
    drop(held);
    tokio::time::advance(Duration::from_secs(2)).await;
    limit.forget_idle();
    assert_eq!(limit.keys(), 0);
    let info = limit.info();
    assert_eq!((info.keys, info.held), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_key_whose_bucket_is_not_full_is_never_forgotten() {
    let limit = keyed(LimitSpec::rate(1.0).burst(1));
    limit.check("hot").unwrap();
    // Enough new keys to make every shard look for idle ones, several times over.
    for i in 0..20_000 {
        let _ = limit.check(&format!("other-{i}"));
    }
    assert!(limit.forget_idle() == 0, "no bucket has refilled yet");
    assert!(limit.check("hot").unwrap_err().is_rate_limited(), "forgotten, it would pass");
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(limit.forget_idle(), 20_001);
    assert!(limit.check("hot").is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_cap_on_keys_refuses_new_keys_while_those_kept_are_in_use_and_serves_the_kept_ones() {
    let limit: KeyedLimit =
        KeyedLimit::builder("capped", LimitSpec::rate(1.0).burst(1)).max_keys(64).build().unwrap();
    let mut kept = Vec::new();
    let mut refused = 0;
    for i in 0..1_000 {
        let key = format!("client-{i}");
        match limit.check(&key) {
            Ok(()) => kept.push(key),
            Err(err) => {
                assert!(
                    matches!(&err, lanes::TryAcquireError::Limit(e) if e.is_too_many_keys()),
                    "{err}"
                );
                refused += 1;
            }
        }
    }
    assert!(limit.keys() <= 64 && kept.len() == limit.keys(), "{} kept", limit.keys());
    assert_eq!(kept.len(), 64, "a cap under 2,048 keys is exact");
    assert_eq!(refused, 1_000 - kept.len());
    // A kept key is still served, and still limited.
    assert!(limit.check(&kept[0]).unwrap_err().is_rate_limited());
    assert_eq!(limit.info().refused_total, refused as u64 + 1);
    // An acquire of a new key at the cap is refused too, and counted once.
    let before = limit.info().refused_total;
    let refused_keys = (0..200).filter_map(|i| {
        let key = format!("waiter-{i}");
        futures_poll(&mut Box::pin(limit.acquire(&key)))
    });
    assert!(refused_keys.map(|answer| answer.unwrap_err()).all(|err| err.is_too_many_keys()));
    assert_eq!(limit.info().refused_total - before, 200);
    // Once their buckets refill, the kept keys are idle: a single new key after the quiet
    // spell gets in at once, and then as many as the room holds.
    tokio::time::advance(Duration::from_secs(1)).await;
    assert!(limit.check("after-quiet").is_ok());
    let newcomers = (0..1_000).filter(|i| limit.check(&format!("later-{i}")).is_ok()).count();
    assert_eq!(newcomers + 1, kept.len(), "the same room again");
    assert!(limit.keys() <= 64);
}

#[tokio::test(start_paused = true)]
async fn a_full_shard_looks_for_idle_keys_again_after_a_quiet_spell() {
    let limit: KeyedLimit =
        KeyedLimit::builder("quiet", LimitSpec::rate(1.0)).max_keys(800).build().unwrap();
    // A flood: every shard full, and many new keys refused after it.
    let refused = (0..3_000).filter(|i| limit.check(&format!("flood-{i}")).is_err()).count();
    assert!(refused >= 2_000, "{refused} refused");
    // The flood's keys go idle; the next new keys get in at once, whatever each shard's
    // count of refusals before its next look.
    tokio::time::advance(Duration::from_millis(1_000)).await;
    for i in 0..40 {
        assert!(
            limit.check(&format!("after-{i}")).is_ok(),
            "key {i} refused after the quiet spell"
        );
    }
}

/// The same for a limit whose keys have no rate (it reads no clock for their answers): the
/// quiet spell is still timed, and keys whose permits came back make room after it.
#[tokio::test(start_paused = true)]
async fn a_full_shard_of_a_limit_without_a_rate_looks_again_after_a_quiet_spell() {
    let limit: KeyedLimit =
        KeyedLimit::builder("quiet", LimitSpec::concurrent(1)).max_keys(800).build().unwrap();
    // A flood of held permits: every shard full, and many new keys refused after it.
    let mut held = Vec::new();
    let mut refused = 0;
    for i in 0..3_000 {
        match limit.try_acquire(&format!("flood-{i}")) {
            Ok(permit) => held.push(permit),
            Err(_) => refused += 1,
        }
    }
    assert!(refused >= 2_000, "{refused} refused");
    // The permits come back and the keys go idle; after the quiet spell the next new keys
    // get in at once, whatever each shard's count of refusals before its next look.
    drop(held);
    tokio::time::advance(Duration::from_millis(1_000)).await;
    for i in 0..40 {
        assert!(
            limit.try_acquire(&format!("after-{i}")).is_ok(),
            "key {i} refused after the quiet spell"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_cap_smaller_than_the_shards_is_still_a_cap() {
    for max in [1, 3, 5] {
        let limit: KeyedLimit =
            KeyedLimit::builder("small", LimitSpec::rate(1.0)).max_keys(max).build().unwrap();
        let kept = (0..100).filter(|i| limit.check(&format!("k{i}")).is_ok()).count();
        assert!(kept == max && limit.keys() == kept, "max {max}: {kept} kept");
    }
}

/// Review finding (stop 79): the cap was split over as many shards as the host's cores made
/// (four a core, up to 256), down to one key a shard: keys hash unevenly, so a new key was
/// refused long before the cap (on 16 cores, about the tenth key of `max_keys(100)`; on this
/// kind of host's 8 shards, about the thirtieth). A shard keeps at least 1,024 keys: a cap under
/// 2,048 is exact, and a larger one refuses its first new key a little before it.
#[tokio::test(start_paused = true)]
async fn a_cap_refuses_no_new_key_long_before_it_is_reached() {
    for max in [100, 2_047, 4_096, 20_000] {
        let limit: KeyedLimit =
            KeyedLimit::builder("cap", LimitSpec::rate(1.0)).max_keys(max).build().unwrap();
        let first_refused = (0..2 * max).find(|i| limit.check(&format!("k{i}")).is_err());
        let first_refused = first_refused.expect("refused past the cap");
        if max < 2_048 {
            assert_eq!(first_refused, max, "max {max}: exact");
        } else {
            assert!(first_refused * 10 >= max * 9, "max {max}: first refusal at {first_refused}");
        }
    }
}

#[tokio::test]
async fn a_keys_own_spec_may_look_at_the_limit_itself() {
    use std::sync::OnceLock;

    let me: Arc<OnceLock<KeyedLimit>> = Arc::default();
    let seen = me.clone();
    let limit: KeyedLimit = KeyedLimit::builder("looks", LimitSpec::concurrent(1))
        .spec_for(move |_key: &String| {
            // Under the shard's lock this would deadlock.
            let kept = seen.get().map_or(0, KeyedLimit::keys);
            (kept > 0).then(|| LimitSpec::concurrent(2))
        })
        .build()
        .unwrap();
    assert!(me.set(limit.clone()).is_ok());
    let checked = tokio::task::spawn_blocking(move || {
        let first = limit.try_acquire("a").unwrap();
        // A second key, made while one is kept: its own spec allows two.
        let second = (limit.try_acquire("b").unwrap(), limit.try_acquire("b").unwrap());
        drop((first, second));
    });
    tokio::time::timeout(Duration::from_secs(5), checked).await.expect("no deadlock").unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_key_can_have_a_spec_of_its_own() {
    let limit: KeyedLimit = KeyedLimit::builder("tiers", LimitSpec::concurrent(1).per_second(1.0))
        .spec_for(|tenant: &String| match tenant.split('-').next() {
            Some("gold") => Some(LimitSpec::concurrent(3).per_second(100.0).burst(5)),
            Some("broken") => Some(LimitSpec::concurrent(0)),
            _ => None,
        })
        .build()
        .unwrap();
    let gold: Vec<_> = (0..3).map(|_| limit.try_acquire("gold-acme").unwrap()).collect();
    assert!(limit.try_acquire("gold-acme").unwrap_err().is_busy());
    let free = limit.try_acquire("free-bob").unwrap();
    assert!(limit.try_acquire("free-bob").unwrap_err().is_busy());
    drop(free);
    assert!(limit.check("free-bob").unwrap_err().is_rate_limited(), "one a second");
    drop(gold);
    assert!(limit.check("gold-acme").is_ok(), "burst of 5: the fourth token");
    // A waiting acquire follows the key's own rate too.
    let started = Instant::now();
    for _ in 0..3 {
        drop(limit.acquire("gold-acme").await.unwrap());
    }
    assert_eq!(started.elapsed(), Duration::from_millis(20), "tokens 5, 6 and 7 at 100 a second");
    let err = limit.try_acquire("broken-eve").unwrap_err();
    assert!(
        matches!(err, lanes::TryAcquireError::Limit(lanes::LimitError::InvalidSpec(_))),
        "{err}"
    );
    assert!(limit.acquire("broken-eve").await.is_err());
}

#[test]
fn a_bad_spec_or_waiting_room_is_a_config_error_naming_its_field() {
    let err = KeyedLimit::<String>::new("x", LimitSpec::concurrent(0)).unwrap_err();
    assert_eq!((err.field(), err.rule()), ("keyed_limit.concurrent", ConfigRule::Zero));
    let err = KeyedLimit::<String>::new("x", LimitSpec::rate(f64::NAN)).unwrap_err();
    assert_eq!((err.field(), err.rule()), ("keyed_limit.per_second", ConfigRule::Positive));
    let err = KeyedLimit::<String>::builder("x", LimitSpec::concurrent(1))
        .max_waiters(0)
        .build()
        .unwrap_err();
    assert_eq!(err.field(), "keyed_limit.max_waiters");
    let err = KeyedLimit::<String>::builder("x", LimitSpec::concurrent(1))
        .max_keys(0)
        .build()
        .unwrap_err();
    assert_eq!((err.field(), err.rule()), ("keyed_limit.max_keys", ConfigRule::Zero));
}

#[tokio::test]
async fn a_registered_keyed_limit_reports_its_totals() {
    let registry = Registry::new();
    let limit: KeyedLimit<u64> = KeyedLimit::builder("per-user", LimitSpec::concurrent(3))
        .registry(&registry, "per-user")
        .build()
        .unwrap();
    let _permit = limit.try_acquire(&7).unwrap();
    limit.check(&8).unwrap();
    let info: KeyedLimitInfo = registry.snapshot().keyed_limit("per-user").unwrap();
    // Key 8's check left it idle: only the held key is kept.
    assert_eq!((info.keys, info.held, info.acquired_total), (1, 1, 2));
    assert!(
        KeyedLimit::<u64>::builder("again", LimitSpec::concurrent(1))
            .registry(&registry, "per-user")
            .build()
            .is_err()
    );
}

/// Real threads: tasks acquire, try, check, time out and get cancelled on a few keys of
/// concurrency 2, with and without a rate; no key is ever held more than twice, a key with a
/// rate never grants more than its burst plus its rate over the run, and at quiescence
/// nothing is held or waiting, and every key is forgotten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_threads_never_exceed_a_keys_concurrency_and_leave_nothing_behind() {
    for spec in [LimitSpec::concurrent(2), LimitSpec::concurrent(2).per_second(20_000.0).burst(4)] {
        hammer(spec).await;
    }
}

async fn hammer(spec: LimitSpec) {
    let limit = keyed(spec);
    let holders: Arc<HashMap<u32, AtomicU32>> =
        Arc::new((0..4).map(|k| (k, AtomicU32::new(0))).collect());
    let grants: Arc<HashMap<u32, AtomicU32>> =
        Arc::new((0..4).map(|k| (k, AtomicU32::new(0))).collect());
    let started = std::time::Instant::now();
    let mut tasks = Vec::new();
    for task in 0..16u64 {
        let (limit, holders, grants) = (limit.clone(), holders.clone(), grants.clone());
        tasks.push(tokio::spawn(async move {
            let mut seed = task.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            let mut next = move || {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed
            };
            for _ in 0..300 {
                let key = (next() % 4) as u32;
                let name = format!("k{key}");
                let permit = match next() % 4 {
                    0 => limit.try_acquire(&name).ok(),
                    1 => {
                        limit.acquire_timeout(&name, Duration::from_micros(next() % 300)).await.ok()
                    }
                    2 => {
                        // Cancelled at a random point of its wait.
                        let wait = limit.acquire(&name);
                        tokio::time::timeout(Duration::from_micros(next() % 200), wait)
                            .await
                            .ok()
                            .map(|permit| permit.expect("the waiting room is large"))
                    }
                    _ => Some(limit.acquire(&name).await.expect("a permit")),
                };
                if let Some(permit) = permit {
                    grants[&key].fetch_add(1, Ordering::SeqCst);
                    let now = holders[&key].fetch_add(1, Ordering::SeqCst) + 1;
                    assert!(now <= 2, "key {key} held {now} times");
                    if next() % 2 == 0 {
                        tokio::task::yield_now().await;
                    }
                    holders[&key].fetch_sub(1, Ordering::SeqCst);
                    drop(permit);
                }
                if limit.check(&name).is_ok() {
                    grants[&key].fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let elapsed = started.elapsed().as_secs_f64();
    if let Some(rate) = spec.per_second {
        for (key, granted) in grants.iter() {
            let granted = f64::from(granted.load(Ordering::SeqCst));
            let allowed = f64::from(spec.burst) + rate * elapsed + 1.0;
            assert!(granted <= allowed, "key {key}: {granted} grants, at most {allowed}");
        }
    }
    let info = limit.info();
    assert_eq!((info.held, info.waiting), (0, 0), "{info:?}");
    tokio::time::sleep(Duration::from_millis(1)).await;
    limit.forget_idle();
    assert_eq!(limit.keys(), 0);
    for key in 0..4 {
        let name = format!("k{key}");
        let (a, b) = (limit.try_acquire(&name).unwrap(), limit.try_acquire(&name).unwrap());
        assert!(limit.try_acquire(&name).is_err());
        drop((a, b));
    }
}
