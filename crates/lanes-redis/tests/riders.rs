//! Releases that ride: a dropped permit (or a dropped waiting acquire) goes back to Redis ahead
//! of the client's next call on the limit, in the same call, or in a call of its own when no
//! other comes first. Counted in script calls (`RedisStats::calls`) on a one-thread runtime,
//! where the order of the client's tasks is fixed; each test runs on the one Redis and on the
//! cluster, but the one that loses a call, which pauses and kills clients on a Redis of its own.

mod common;

use std::time::Duration;

use common::Target;
use lanes::{LimitBackend, LimitSpec, Limits, Priority};
use lanes_redis::RedisLimits;
use tokio::time::{sleep, timeout};

/// A client whose maintenance makes no script call during a test: no renewal is due, and no
/// touch of a limit where it waits (those go every quarter of the queue grace, and a test's
/// queued ask would otherwise count one when a tick falls inside it).
async fn quiet_client(t: Target, ns: &str) -> RedisLimits {
    common::builder_on(t, ns)
        .lease(Duration::from_secs(60))
        .queue_grace(Duration::from_secs(60))
        .build()
        .await
        .unwrap_or_else(|e| {
            panic!(
                "Redis ({t:?}) is not reachable ({e}); start it: bash scripts/services.sh --cluster"
            )
        })
}

/// Waits until `name` has `in_use` permits held and `waiting` tickets queued in Redis.
async fn settles(backend: &RedisLimits, name: &str, in_use: u32, waiting: usize) {
    let mut last = None;
    for _ in 0..200 {
        let info = backend.info(name).await.unwrap().expect("defined");
        if info.in_use == in_use && info.waiting == waiting {
            return;
        }
        last = Some((info.in_use, info.waiting));
        sleep(Duration::from_millis(10)).await;
    }
    panic!("{name}: (in use, waiting) stayed {last:?}, want ({in_use}, {waiting})");
}

/// The script calls `backend` made since `before`, read once they reach `want` (polled: the
/// calls a test waits for go out from tasks of their own, which a loaded host can run late) and
/// again 100 ms later: a count above `want` means a call too many.
async fn calls_since(backend: &RedisLimits, before: u64, want: u64) -> u64 {
    for _ in 0..500 {
        if backend.stats().calls - before >= want {
            break;
        }
        sleep(Duration::from_millis(10)).await;
    }
    sleep(Duration::from_millis(100)).await;
    backend.stats().calls - before
}

/// A task that drops its permit and asks again makes one call per cycle, not two: the
/// release rides with the next acquire. The last release, with no call after it, goes in a
/// call of its own.
async fn a_dropped_permit_rides_with_the_next_acquire(t: Target) {
    let ns = common::unique_ns("ride");
    let _cleanup = common::Cleanup::on(t, &ns);
    let backend = quiet_client(t, &ns).await;
    let limits = Limits::with_backend(backend.clone());
    limits.define("db", LimitSpec::concurrent(4)).await.unwrap();
    let before = backend.stats().calls;
    let mut tokens = Vec::new();
    for _ in 0..50 {
        let permit = limits.acquire("db", Priority::default()).await.unwrap();
        tokens.push(permit.fencing_token());
    }
    // Let the last release go on its own.
    let calls = calls_since(&backend, before, 51).await;
    assert_eq!(calls, 51, "50 acquires, each carrying the release before it, and one release");
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "every acquire was a grant: {tokens:?}");
    settles(&backend, "db", 0, 0).await;
}

/// Many permits dropped at once go back in calls of at most 64 releases each.
async fn a_burst_of_drops_goes_back_in_a_few_calls(t: Target) {
    let ns = common::unique_ns("burst");
    let _cleanup = common::Cleanup::on(t, &ns);
    let backend = quiet_client(t, &ns).await;
    let limits = Limits::with_backend(backend.clone());
    limits.define("db", LimitSpec::concurrent(1_000)).await.unwrap();
    let mut permits = Vec::new();
    for _ in 0..200 {
        permits.push(limits.acquire("db", Priority::default()).await.unwrap());
    }
    settles(&backend, "db", 200, 0).await;
    let before = backend.stats().calls;
    drop(permits);
    assert_eq!(calls_since(&backend, before, 4).await, 4, "200 releases: 64 + 64 + 64 + 8");
    settles(&backend, "db", 0, 0).await;
}

/// A task that waits for a permit of `db`, holds it 50 ms, and returns its fencing token.
fn spawn_waiter(limits: Limits) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let permit = limits.acquire("db", Priority::default()).await.unwrap();
        let token = permit.fencing_token();
        sleep(Duration::from_millis(50)).await;
        drop(permit);
        token
    })
}

/// A release riding ahead of its client's next acquire on a full limit hands the permit to the
/// waiter served next, and the asker queues behind it: one call, the release first.
async fn a_riding_release_hands_its_permit_on_before_its_client_queues(t: Target) {
    let ns = common::unique_ns("handon");
    let _cleanup = common::Cleanup::on(t, &ns);
    let (a, b) = (quiet_client(t, &ns).await, quiet_client(t, &ns).await);
    let (la, lb) = (Limits::with_backend(a.clone()), Limits::with_backend(b.clone()));
    la.define("db", LimitSpec::concurrent(1)).await.unwrap();
    let held = la.acquire("db", Priority::default()).await.unwrap();
    let first_token = held.fencing_token();
    let waiter = spawn_waiter(lb);
    settles(&a, "db", 1, 1).await;
    let before = a.stats().calls;
    drop(held);
    let again = timeout(Duration::from_secs(5), la.acquire("db", Priority::default()))
        .await
        .expect("granted after the waiter's hold")
        .unwrap();
    let waiter_token = timeout(Duration::from_secs(1), waiter).await.unwrap().unwrap();
    assert!(
        first_token < waiter_token && waiter_token < again.fencing_token(),
        "the waiter was served before the asker: {first_token}, {waiter_token}, {}",
        again.fencing_token()
    );
    // The release rode with the queued acquire; the grant after the waiter's release was
    // pushed.
    assert_eq!(a.stats().calls - before, 1, "the release and the acquire in one call");

    // Now the client's last ask was queued (the limit is busy): its next release goes first
    // in a call of its own, so the waiter's grant is pushed before the asker queues.
    let waiter = spawn_waiter(Limits::with_backend(b.clone()));
    settles(&a, "db", 1, 1).await;
    let before = a.stats().calls;
    let second = again.fencing_token();
    drop(again);
    let third = timeout(Duration::from_secs(5), la.acquire("db", Priority::default()))
        .await
        .expect("granted after the waiter's hold")
        .unwrap();
    let waiter_token = timeout(Duration::from_secs(1), waiter).await.unwrap().unwrap();
    assert!(second < waiter_token && waiter_token < third.fencing_token());
    assert_eq!(a.stats().calls - before, 2, "the release, then the acquire");
    drop(third);
    settles(&a, "db", 0, 0).await;
}

/// A waiting acquire that is dropped (here, timed out) is withdrawn ahead of its client's next
/// call: the queue never holds it and the new ticket at once.
async fn a_dropped_waiting_acquire_is_withdrawn_ahead_of_the_next_call(t: Target) {
    let ns = common::unique_ns("withdraw");
    let _cleanup = common::Cleanup::on(t, &ns);
    let (a, b) = (quiet_client(t, &ns).await, quiet_client(t, &ns).await);
    let (la, lb) = (Limits::with_backend(a.clone()), Limits::with_backend(b.clone()));
    la.define("db", LimitSpec::concurrent(1)).await.unwrap();
    let held = la.acquire("db", Priority::default()).await.unwrap();
    let timed_out = lb.acquire_timeout("db", Priority::default(), Duration::from_millis(50)).await;
    assert!(timed_out.is_err(), "the limit is full");
    // The next acquire, in the same task (as a loop of timed acquires makes it), polled once:
    // it sends its call before the task that would send the withdrawal alone gets to run.
    let before = b.stats().calls;
    let next = lb.acquire("db", Priority::default());
    tokio::pin!(next);
    assert!(timeout(Duration::ZERO, &mut next).await.is_err(), "the limit is still full");
    assert_eq!(b.stats().calls - before, 1, "the withdrawal rode with the next acquire");
    let (permit, ()) = tokio::join!(next, async {
        settles(&a, "db", 1, 1).await;
        drop(held);
    });
    drop(permit.unwrap());
    assert_eq!(calls_since(&b, before, 2).await, 2, "and the permit's release went on its own");
    settles(&a, "db", 0, 0).await;
}

/// A release whose call never reaches Redis is not lost: the call timed out while Redis was
/// paused, and its connection was killed with the call still unread, so Redis never ran it.
/// The client retries the release in the background once Redis answers again.
#[tokio::test]
async fn a_release_whose_call_is_lost_is_retried() {
    let redis = common::DedicatedRedis::start();
    let backend = RedisLimits::builder(redis.url())
        .namespace(common::unique_ns("lost-ride"))
        .lease(Duration::from_secs(60))
        .op_timeout(Duration::from_millis(200))
        .build()
        .await
        .unwrap();
    let limits = Limits::with_backend(backend.clone());
    limits.define("db", LimitSpec::concurrent(2)).await.unwrap();
    let permit = limits.acquire("db", Priority::default()).await.unwrap();
    let admin = redis::Client::open(redis.url()).unwrap();
    let mut admin = admin.get_multiplexed_async_connection().await.unwrap();
    let (): () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(5_000)
        .arg("WRITE")
        .query_async(&mut admin)
        .await
        .unwrap();
    drop(permit);
    // The release goes in a call of its own, which Redis holds unread until it times out.
    sleep(Duration::from_millis(400)).await;
    assert!(backend.stats().outages >= 1, "the call timed out: {:?}", backend.stats());
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(killed >= 1, "the client's connection was killed");
    let (): () = redis::cmd("CLIENT").arg("UNPAUSE").query_async(&mut admin).await.unwrap();
    // Retried within a maintenance tick (a quarter of a second) of Redis answering.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        if let Ok(Some(info)) = backend.info("db").await
            && info.in_use == 0
        {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the release was lost");
        sleep(Duration::from_millis(50)).await;
    }
}

/// A permit dropped on a thread without a runtime still goes back to Redis: its release is
/// sent by a task on the client's own runtime (it used to wait for the end of its lease, and
/// the client renewed it meanwhile).
async fn a_permit_dropped_outside_a_runtime_goes_back(t: Target) {
    let ns = common::unique_ns("noruntime");
    let _cleanup = common::Cleanup::on(t, &ns);
    let backend = quiet_client(t, &ns).await;
    let limits = Limits::with_backend(backend.clone());
    limits.define("db", LimitSpec::concurrent(2)).await.unwrap();
    let permit = limits.acquire("db", Priority::default()).await.unwrap();
    settles(&backend, "db", 1, 0).await;
    std::thread::spawn(move || drop(permit)).join().unwrap();
    settles(&backend, "db", 0, 0).await;
}

/// Each test, once on the one Redis and once on the cluster, on one thread.
macro_rules! on_both {
    ($($name:ident),* $(,)?) => {
        mod single {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name(super::Target::Single).await;
                }
            )*
        }
        mod cluster {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name(super::Target::Cluster).await;
                }
            )*
        }
    };
}

on_both!(
    a_dropped_permit_rides_with_the_next_acquire,
    a_burst_of_drops_goes_back_in_a_few_calls,
    a_riding_release_hands_its_permit_on_before_its_client_queues,
    a_dropped_waiting_acquire_is_withdrawn_ahead_of_the_next_call,
    a_permit_dropped_outside_a_runtime_goes_back,
);
