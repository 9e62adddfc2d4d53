//! A Redis that is killed (SIGKILL) and comes back empty, and clients that die or wait with a
//! deadline: issue 11's reproductions 3, 4, 5 and 7 on Redis, and a 64-task hammer through a
//! kill and an empty restart. Each test runs its own `redis-server` on an ephemeral port.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use common::DedicatedRedis;
use lanes::{LimitBackend, LimitSpec, Limits, Priority};
use lanes_redis::RedisLimits;
use tokio::time::{Instant, sleep, timeout};

const LEASE: Duration = Duration::from_millis(600);

async fn client(redis: &DedicatedRedis) -> RedisLimits {
    RedisLimits::builder(redis.url())
        .namespace("restart")
        .op_timeout(Duration::from_millis(200))
        .lease(LEASE)
        .build()
        .await
        .expect("the dedicated redis-server answers")
}

/// A client like [`client`]'s that renews nothing (its permits lapse after `LEASE`).
async fn quiet(redis: &DedicatedRedis) -> RedisLimits {
    RedisLimits::builder(redis.url())
        .namespace("restart")
        .op_timeout(Duration::from_millis(200))
        .lease(LEASE)
        .auto_renew(false)
        .build()
        .await
        .unwrap()
}

/// A permit of "db" at `priority`, asked again until granted (within 10 s): while Redis
/// is away or comes back, an ask may fail for want of Redis (or of the limit, before a client
/// that knows it defines it again).
async fn granted_when_back(limits: &Limits, priority: Priority) -> lanes::Permit {
    timeout(Duration::from_secs(10), async {
        loop {
            match limits.acquire("db", priority.clone()).await {
                Ok(permit) => return permit,
                Err(err) => {
                    assert!(err.is_backend() || err.is_unknown_limit(), "{err}");
                    sleep(Duration::from_millis(20)).await;
                }
            }
        }
    })
    .await
    .expect("grants resume")
}

/// Reproduction 3: A and B hold both permits; Redis restarts empty. Before, C was granted at
/// once with A's fencing token while A still renewed. Now A and B learn their permits are lost
/// before anyone else is granted, grants wait for the hold (the longest lease), and tokens keep
/// growing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_restart_never_hands_one_permit_to_two_holders() {
    let mut redis = DedicatedRedis::start();
    let (a, b, c) = (client(&redis).await, client(&redis).await, client(&redis).await);
    let (la, lb, lc) = (Limits::with_backend(a), Limits::with_backend(b), Limits::with_backend(c));
    la.define("db", LimitSpec::concurrent(2)).await.unwrap();
    let pa = la.acquire("db", Priority::default()).await.unwrap();
    let pb = lb.acquire("db", Priority::default()).await.unwrap();
    redis.stop();
    redis.restart();
    let back = Instant::now();
    let granted = granted_when_back(&lc, Priority::default()).await;
    let at = back.elapsed();
    assert!(pa.lease_lost() && pb.lease_lost(), "both old holders know before C is granted");
    assert!(at >= LEASE - Duration::from_millis(100), "the hold kept grants back: {at:?}");
    assert!(at <= LEASE + Duration::from_secs(1), "grants resume within the lease + 1 s: {at:?}");
    assert!(granted.fencing_token() > pa.fencing_token().max(pb.fencing_token()));
    timeout(Duration::from_secs(1), pa.lost()).await.expect("lost() resolves");
}

/// Review finding (stop 75): the same, but the client that comes after the restart defines the
/// limit first (as an application does at start): the define made it anew, free to grant at
/// once, while A and B, cut off, still believed they held both permits. A limit made new on a
/// server that began serving less than the longest lease ago is held as after a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_define_after_an_empty_restart_holds_grants_too() {
    let mut redis = DedicatedRedis::start();
    let (a, b) = (client(&redis).await, client(&redis).await);
    let (la, lb) = (Limits::with_backend(a), Limits::with_backend(b));
    la.define("db", LimitSpec::concurrent(2)).await.unwrap();
    // Past the first lease of the server's life, as its uptime tells (whole seconds, which may
    // read up to a second more than the time served, so the start is taken a second later):
    // a limit defined now is not held.
    sleep(Duration::from_millis(2_100)).await;
    la.define("other", LimitSpec::concurrent(1)).await.unwrap();
    let quick = Instant::now();
    drop(la.acquire("other", Priority::default()).await.unwrap());
    assert!(quick.elapsed() < LEASE / 2, "a server up for a lease holds nothing new");
    let _pa = la.acquire("db", Priority::default()).await.unwrap();
    let _pb = lb.acquire("db", Priority::default()).await.unwrap();
    redis.stop();
    redis.restart();
    let back = Instant::now();
    let lc = Limits::with_backend(client(&redis).await);
    lc.define("db", LimitSpec::concurrent(2)).await.unwrap();
    let _granted = granted_when_back(&lc, Priority::default()).await;
    let at = back.elapsed();
    assert!(at >= LEASE - Duration::from_millis(100), "the hold kept grants back: {at:?}");
    assert!(at <= LEASE + Duration::from_secs(1), "grants resume within the lease + 1 s: {at:?}");
}

/// Review finding (stop 72): a restart that keeps the namespace's epoch but loses the last
/// writes (here a snapshot taken before A's grant, loaded on the restart) was not seen as a
/// loss: C was granted at once, with A's fencing token, while A still believed it held the
/// permit. A limit now records the `run_id` of the server that last wrote it; the first call
/// after a restart finds another, and holds grants for the longest lease (A's renewal is
/// refused meanwhile), and tokens go on past the clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_from_a_snapshot_that_lags_holds_grants_and_tokens_grow() {
    let mut redis = DedicatedRedis::start_with_snapshots();
    let (a, c) = (client(&redis).await, client(&redis).await);
    let (la, lc) = (Limits::with_backend(a), Limits::with_backend(c));
    la.define("db", LimitSpec::concurrent(1)).await.unwrap();
    redis.save(); // the limit, free
    let pa = la.acquire("db", Priority::default()).await.unwrap();
    redis.stop();
    redis.restart();
    let back = Instant::now();
    // C asks at once: the first call on the limit after the restart sees it.
    let granted = granted_when_back(&lc, Priority::default()).await;
    let at = back.elapsed();
    assert!(pa.lease_lost(), "A knows before C is granted");
    assert!(at >= LEASE - Duration::from_millis(100), "the hold kept grants back: {at:?}");
    assert!(
        granted.fencing_token() > pa.fencing_token(),
        "{} after {}",
        granted.fencing_token(),
        pa.fencing_token()
    );
}

/// Found by CI (stop 78; this file's lagging-snapshot test failed one run in twelve): the
/// server's uptime is the difference of two whole-second clocks. A server started at 12.99 s
/// and asked at 13.01 s reports 1 s, and the hold after the restart, taken from the start it
/// gave, ended 400 ms before it began: C was granted at once, while A, which had not yet heard,
/// still believed it held the one permit. The start is now taken as the second after the one
/// the uptime gives. (Here A's lease may have ended before the restart, the helper waiting
/// for its moment: the test holds the hold's length, from the server's start.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_late_in_a_second_holds_grants_for_the_whole_lease() {
    let mut redis = DedicatedRedis::start_with_snapshots();
    // A renews nothing: C's ask is the first call on the limit after the restart.
    let (la, lc) =
        (Limits::with_backend(quiet(&redis).await), Limits::with_backend(client(&redis).await));
    la.define("db", LimitSpec::concurrent(1)).await.unwrap();
    redis.save(); // the limit, free
    let held = la.acquire("db", Priority::default()).await.unwrap();
    redis.restart_late_in_a_second();
    // The server started at most 120 ms before this: no grant before its start + LEASE.
    let asked = Instant::now();
    let granted = granted_when_back(&lc, Priority::default()).await;
    let took = asked.elapsed();
    assert!(took >= LEASE - Duration::from_millis(150), "the hold kept grants back: {took:?}");
    assert!(granted.fencing_token() > held.fencing_token());
}

/// The same clock, when a limit is made new on a server that began serving less than the
/// longest lease ago (it may have been emptied by a restart): a limit defined right after a
/// start late in a second was free to grant at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_defined_just_after_a_start_late_in_a_second_is_held() {
    let mut redis = DedicatedRedis::start();
    redis.restart_late_in_a_second();
    // The server started at most 120 ms before this (and 20 ms after the second's end): no
    // grant before its start + LEASE. (A define that lands two seconds after the start, on a
    // slow machine, is rightly not held, and is granted past that all the same.)
    let started = Instant::now();
    let limits = Limits::with_backend(client(&redis).await);
    limits.define("db", LimitSpec::concurrent(1)).await.unwrap();
    let _granted = granted_when_back(&limits, Priority::default()).await;
    let took = started.elapsed();
    assert!(took >= LEASE - Duration::from_millis(150), "the hold kept grants back: {took:?}");
}

/// Review finding (stop 72, second look): the hold after a restart that kept a limit ran from
/// the limit's first call after the restart: a limit left alone for a while after the restart
/// still stalled a whole longest lease when next used, though no lost lease could be live any
/// more. It runs from the server's start now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hold_after_a_restart_runs_from_the_restart() {
    let mut redis = DedicatedRedis::start_with_snapshots();
    let (la, lc) =
        (Limits::with_backend(quiet(&redis).await), Limits::with_backend(client(&redis).await));
    la.define("db", LimitSpec::concurrent(1)).await.unwrap();
    redis.save();
    let held = la.acquire("db", Priority::default()).await.unwrap();
    redis.stop();
    redis.restart();
    // Nothing calls on the limit for longer than the longest lease, and the second by which
    // the start is taken after what the server's uptime (whole seconds) says.
    sleep(Duration::from_millis(2_100)).await;
    let asked = Instant::now();
    let granted = timeout(Duration::from_secs(5), lc.acquire("db", Priority::default()))
        .await
        .expect("granted")
        .unwrap();
    let took = asked.elapsed();
    assert!(took < Duration::from_millis(400), "no second hold: {took:?}");
    assert!(granted.fencing_token() > held.fencing_token());
}

/// Review finding (stop 72, second look): a limit created after the snapshot is gone after
/// the restart while the epoch is not. The client that defined it defined it again at once
/// with no hold (on one Redis), and was granted while its own holder still worked. It now
/// holds the grants of a limit it defines again for the longest lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_created_after_the_snapshot_is_defined_again_with_a_hold() {
    let mut redis = DedicatedRedis::start_with_snapshots();
    let limits = Limits::with_backend(client(&redis).await);
    redis.save(); // the namespace, and no limit yet
    limits.define("db", LimitSpec::concurrent(1)).await.unwrap();
    let first = limits.acquire("db", Priority::default()).await.unwrap();
    redis.stop();
    redis.restart();
    let back = Instant::now();
    let second = granted_when_back(&limits, Priority::default()).await;
    let at = back.elapsed();
    assert!(first.lease_lost(), "the first holder knows before the second is granted");
    assert!(at >= LEASE - Duration::from_millis(100), "the hold kept grants back: {at:?}");
    assert!(second.fencing_token() > first.fencing_token());
}

/// Review finding (stop 72): a renewal answered a ticket that waits in Redis as renewed. After
/// a restart (or a failover) that lost its grant, the ticket waits there again: its holder went
/// on believing it held the permit, which Redis counted in no one's use, and a waiter served
/// before the ticket was granted while it still worked. A ticket its client believes held and
/// that waits in Redis is now reported lost at its next renewal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_whose_ticket_waits_again_after_a_restart_is_lost() {
    let mut redis = DedicatedRedis::start_with_snapshots();
    let (a, b, d) = (client(&redis).await, client(&redis).await, client(&redis).await);
    let (la, lb, ld) = (Limits::with_backend(a), Limits::with_backend(b), Limits::with_backend(d));
    la.define("db", LimitSpec::concurrent(1)).await.unwrap();
    let pb = lb.acquire("db", Priority::default()).await.unwrap();
    let waiting = tokio::spawn({
        let la = la.clone();
        async move { la.acquire("db", Priority::default()).await }
    });
    timeout(Duration::from_secs(5), async {
        while la.info("db").await.unwrap().is_none_or(|info| info.waiting == 0) {
            sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("A's ticket waits");
    redis.save(); // B holds, A's ticket waits
    drop(pb);
    let pa = timeout(Duration::from_secs(5), waiting).await.unwrap().unwrap().unwrap();
    redis.stop();
    redis.restart();
    // D asks at a higher level: served before A's ticket, which waits in Redis again.
    let pd = granted_when_back(&ld, Priority::level(5)).await;
    assert!(pa.lease_lost(), "A knows its permit is lost before D is granted");
    assert!(pd.fencing_token() > pa.fencing_token());
}

/// Review finding (stop 72): client ids came from a counter in Redis that starts at 1 when
/// missing, so a client built after an empty restart took the id of one still running from
/// before: the same tickets, the same channel for pushed grants. A missing counter now starts
/// at a random place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_built_after_an_empty_restart_takes_a_new_id() {
    let mut redis = DedicatedRedis::start();
    let before = client(&redis).await;
    redis.stop();
    redis.restart();
    let after = client(&redis).await;
    let id = |ticket: u64| ticket >> 32;
    assert_ne!(id(before.ticket()), id(after.ticket()), "two clients, one id");
}

/// Reproduction 7 on Redis: tokens keep growing across a removal and across an empty restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_grow_across_remove_and_an_empty_restart() {
    let mut redis = DedicatedRedis::start();
    let limits = Limits::with_backend(client(&redis).await);
    limits.define("db", LimitSpec::concurrent(1)).await.unwrap();
    let first = limits.acquire("db", Priority::default()).await.unwrap().fencing_token();
    sleep(Duration::from_millis(50)).await; // the release lands
    limits.remove("db").await.unwrap();
    limits.define("db", LimitSpec::concurrent(1)).await.unwrap();
    let second = limits.acquire("db", Priority::default()).await.unwrap().fencing_token();
    assert!(second > first, "{first} then {second}");
    redis.stop();
    redis.restart();
    let fresh = Limits::with_backend(client(&redis).await);
    fresh.define("db", LimitSpec::concurrent(1)).await.unwrap();
    let third = fresh.acquire("db", Priority::default()).await.unwrap().fencing_token();
    assert!(third > second, "{second} then {third}");
}

/// Reproduction 4: three waiters with a 1 s deadline were answered after 1, 10 and 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_on_redis_honour_their_deadline() {
    let redis = DedicatedRedis::start();
    let limits = Limits::with_backend(client(&redis).await);
    limits.define("db", LimitSpec::concurrent(1)).await.unwrap();
    let _held = limits.acquire("db", Priority::default()).await.unwrap();
    let mut waiters = Vec::new();
    for _ in 0..3 {
        let limits = limits.clone();
        waiters.push(tokio::spawn(async move {
            let start = Instant::now();
            let err = limits
                .acquire_timeout("db", Priority::default(), Duration::from_secs(1))
                .await
                .unwrap_err();
            assert!(err.is_timeout(), "{err}");
            start.elapsed()
        }));
    }
    for waiter in waiters {
        let took = waiter.await.unwrap();
        // The deadline, plus a round trip the waiter may have in flight and a loaded runner's
        // late timer; without the deadline a waiter would wait for ever (the permit is held).
        assert!(took <= Duration::from_millis(1_500), "answered after {took:?}");
    }
}

/// Reproduction 5: a client that dies with tickets queued. Before, each was granted in turn for
/// a lease; now they are dropped once the client is silent past the queue grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_clients_queued_tickets_go_within_the_grace() {
    let redis = DedicatedRedis::start();
    let holder = Limits::with_backend(client(&redis).await);
    holder.define("db", LimitSpec::concurrent(1)).await.unwrap();
    let held = holder.acquire("db", Priority::default()).await.unwrap();
    let dead = client(&redis).await;
    for _ in 0..20 {
        let ticket = dead.ticket();
        dead.acquire("db", ticket, &Priority::default(), None).await.unwrap();
    }
    drop(dead); // dies: no release, no more signs of life
    let waiter = Limits::with_backend(client(&redis).await);
    let asking = tokio::spawn(async move {
        let permit = waiter.acquire("db", Priority::default()).await.unwrap();
        (Instant::now(), permit)
    });
    sleep(Duration::from_millis(50)).await;
    let released = Instant::now();
    drop(held);
    let (granted, _permit) = timeout(Duration::from_secs(10), asking).await.unwrap().unwrap();
    let took = granted - released;
    // Twenty leases would be 12 s; the grace (2 s) plus one lease bounds it now.
    assert!(took <= Duration::from_secs(2) + LEASE + Duration::from_millis(500), "{took:?}");
}

/// A 64-task hammer over four clients; Redis is killed and restarted empty in the middle. By the
/// holders' own count there are never more than `concurrent` holders (a holder stops at once
/// when its permit is reported lost), every permit held across the restart is reported lost,
/// and grants resume within the longest lease + 1 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_and_empty_restart_mid_hammer_keeps_the_bound() {
    const CONCURRENT: i64 = 3;
    let mut redis = DedicatedRedis::start();
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(Limits::with_backend(client(&redis).await));
    }
    clients[0].define("db", LimitSpec::concurrent(CONCURRENT as u32)).await.unwrap();
    let holders = Arc::new(AtomicI64::new(0));
    let peak = Arc::new(AtomicI64::new(0));
    let lost = Arc::new(AtomicU64::new(0));
    let grants = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for i in 0..64 {
        let limits = clients[i % 4].clone();
        let (holders, peak, lost, grants, stop) =
            (holders.clone(), peak.clone(), lost.clone(), grants.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let permit = match limits
                    .acquire_timeout("db", Priority::default(), Duration::from_millis(300))
                    .await
                {
                    Ok(permit) => permit,
                    Err(_) => {
                        sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let now = holders.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(now, Ordering::SeqCst);
                grants.fetch_add(1, Ordering::Relaxed);
                // Long enough that the permits held at the kill are still held when the loss is
                // seen, even if the pause before the kill oversleeps on a loaded host: each of
                // them must be reported lost.
                tokio::select! {
                    () = sleep(Duration::from_millis(4_000)) => {}
                    () = permit.lost() => { lost.fetch_add(1, Ordering::Relaxed); }
                }
                holders.fetch_sub(1, Ordering::SeqCst);
                drop(permit);
            }
        }));
    }
    sleep(Duration::from_millis(800)).await;
    let before = grants.load(Ordering::Relaxed);
    assert!(before > 0, "the hammer runs");
    let held_at_kill = holders.load(Ordering::SeqCst);
    redis.stop();
    sleep(Duration::from_millis(200)).await;
    redis.restart();
    let back = Instant::now();
    let at_restart = grants.load(Ordering::Relaxed);
    let resumed = timeout(LEASE + Duration::from_secs(1), async {
        while grants.load(Ordering::Relaxed) <= at_restart {
            sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(resumed.is_ok(), "grants resume within the lease + 1 s of Redis coming back");
    let resumed_after = back.elapsed();
    sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }
    assert!(peak.load(Ordering::SeqCst) <= CONCURRENT, "peak {}", peak.load(Ordering::SeqCst));
    assert!(held_at_kill > 0, "permits were held at the kill");
    assert!(
        lost.load(Ordering::Relaxed) >= held_at_kill as u64,
        "every permit held across the restart is reported lost to its holder"
    );
    println!(
        "grants {} (before kill {before}), lost reported {}, resumed after {resumed_after:?}",
        grants.load(Ordering::Relaxed),
        lost.load(Ordering::Relaxed)
    );
}

/// Review finding (stop 79): a server promoted from a replica (`second_repl_offset` set, as
/// after any failover) was taken to have begun serving *now* at every call, for as long as it
/// ran: every limit made new on it waited the longest lease before its first grant, days after
/// the failover. The promotion is dated by the first call that sees it: a limit made new a
/// lease after that is granted at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_replica_holds_new_limits_only_in_the_lease_after_its_promotion() {
    // Each in a directory of its own: the sync's snapshot goes there, not to the working one.
    let primary = DedicatedRedis::start_with_snapshots();
    let replica = DedicatedRedis::start_with_snapshots();
    let info = |redis: &DedicatedRedis| {
        let client = redis::Client::open(redis.url()).unwrap();
        async move {
            let mut conn = client.get_multiplexed_async_connection().await.unwrap();
            redis::cmd("INFO").arg("replication").query_async::<String>(&mut conn).await.unwrap()
        }
    };
    let command = |redis: &DedicatedRedis, args: &[String]| {
        let client = redis::Client::open(redis.url()).unwrap();
        let args = args.to_vec();
        async move {
            let mut conn = client.get_multiplexed_async_connection().await.unwrap();
            redis::cmd(&args[0]).arg(&args[1..]).query_async::<()>(&mut conn).await.unwrap();
        }
    };
    let follow = ["REPLICAOF".to_owned(), "127.0.0.1".to_owned(), primary.port.to_string()];
    command(&replica, &follow).await;
    let synced = Instant::now() + Duration::from_secs(10);
    while !info(&replica).await.contains("master_link_status:up") {
        assert!(Instant::now() < synced, "the replica never synced");
        sleep(Duration::from_millis(50)).await;
    }
    command(&replica, &["REPLICAOF".to_owned(), "NO".to_owned(), "ONE".to_owned()]).await;
    assert!(!info(&replica).await.contains("second_repl_offset:-1"), "promoted");
    let limits = Limits::with_backend(client(&replica).await);
    // Right after the promotion a new limit is held (its writes on the old primary may be lost).
    let asked = Instant::now();
    limits.define("early", LimitSpec::concurrent(1)).await.unwrap();
    let _early = timeout(Duration::from_secs(5), limits.acquire("early", Priority::default()))
        .await
        .expect("granted within the hold")
        .unwrap();
    assert!(asked.elapsed() >= LEASE - Duration::from_millis(150), "held after the promotion");
    // A lease after it, a new limit is not, though another client started meanwhile (each
    // start loaded the library again, and with it forgot the promotion's date).
    sleep(LEASE).await;
    let limits = Limits::with_backend(client(&replica).await);
    let asked = Instant::now();
    limits.define("db", LimitSpec::concurrent(1)).await.unwrap();
    let granted = timeout(Duration::from_secs(5), limits.acquire("db", Priority::default())).await;
    assert!(granted.expect("granted").is_ok());
    let took = asked.elapsed();
    assert!(took < Duration::from_millis(400), "held a lease after the promotion: {took:?}");
}
