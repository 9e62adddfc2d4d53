//! A waiter whose waker calls back into the Redis client that wakes it. The client decides
//! whom to wake under its state's lock; a wake made there ran the waker under the lock, and a
//! waker that takes it again (here: a release of a permit it does not hold, which goes to the
//! client's bookkeeping) deadlocked the client for good. Each scenario runs on the shared
//! Redis, on a thread of its own with a deadline (`common::ends_in_time`); each hung until its
//! deadline before the wakes moved after the lock.

mod common;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Wake, Waker};
use std::time::Duration;

use lanes::{LimitBackend, LimitSpec, Limits, Priority};
use lanes_redis::RedisLimits;
use tokio::time::{Instant, sleep};

/// A waker that calls into `client` before it wakes the task (`next`).
struct CallsBack {
    next: Waker,
    client: RedisLimits,
    calls: Arc<AtomicUsize>,
}

impl Wake for CallsBack {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // Any call that takes the client's state lock: the release of a permit of a limit
        // it never acquired, which finds nothing to release.
        assert!(!self.client.release_local("never-acquired", 1));
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.next.wake_by_ref();
    }
}

/// `future`, polled with a [`CallsBack`] waker on `client`.
fn calling_back<F: Future>(
    client: RedisLimits,
    calls: Arc<AtomicUsize>,
    future: F,
) -> impl Future<Output = F::Output> {
    let mut future = Box::pin(future);
    std::future::poll_fn(move |cx| {
        let waker = Waker::from(Arc::new(CallsBack {
            next: cx.waker().clone(),
            client: client.clone(),
            calls: Arc::clone(&calls),
        }));
        future.as_mut().poll(&mut Context::from_waker(&waker))
    })
}

/// Until `limits` counts `n` waiting on `name` (at most 10 s).
async fn until_waiting(limits: &Limits, name: &str, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if limits.info(name).await.unwrap().is_some_and(|info| info.waiting == n) {
            return;
        }
        sleep(Duration::from_millis(10)).await;
    }
    panic!("{n} never waited on {name}");
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// Three waiters of one client on a limit another client holds. The holder's release pushes a
/// grant to the first waiter (woken from the bookkeeping), whose ask had made it the client's
/// asker: the next waiter is woken to ask in its place, and so on down the line.
#[test]
fn waiters_whose_wakers_call_back_are_granted_in_turn() {
    common::ends_in_time("a pushed grant to a waker that calls back", || {
        runtime().block_on(async {
            let ns = common::unique_ns("reentrant-push");
            let _cleanup = common::Cleanup::on(common::Target::Single, &ns);
            let holder = Limits::with_backend(common::client(&ns).await);
            let client = common::client(&ns).await;
            let waiters = Limits::with_backend(client.clone());
            holder.define("db", LimitSpec::concurrent(1)).await.unwrap();
            let held = holder.acquire("db", Priority::default()).await.unwrap();
            let calls = Arc::new(AtomicUsize::new(0));
            let granted = Arc::new(AtomicUsize::new(0));
            let tasks: Vec<_> = (0..3)
                .map(|_| {
                    let (limits, granted) = (waiters.clone(), Arc::clone(&granted));
                    tokio::spawn(calling_back(client.clone(), Arc::clone(&calls), async move {
                        let permit = limits.acquire("db", Priority::default()).await.unwrap();
                        granted.fetch_add(1, Ordering::SeqCst);
                        sleep(Duration::from_millis(5)).await;
                        drop(permit);
                    }))
                })
                .collect();
            until_waiting(&holder, "db", 3).await;
            drop(held);
            for task in tasks {
                task.await.unwrap();
            }
            assert_eq!(granted.load(Ordering::SeqCst), 3);
            assert!(client.stats().notifications > 0, "the grants came through the pushes");
            assert!(calls.load(Ordering::SeqCst) > 0, "the waiters' wakers were called");
        });
    });
}

/// Redis loses the namespace's state while a client's tickets wait: the client finds out,
/// defines its limits again and wakes every waiter to ask anew (from the bookkeeping).
#[test]
fn waiters_whose_wakers_call_back_are_woken_when_redis_loses_its_state() {
    common::ends_in_time("a lost state waking wakers that call back", || {
        runtime().block_on(async {
            let ns = common::unique_ns("reentrant-lost");
            let _cleanup = common::Cleanup::on(common::Target::Single, &ns);
            let lease = Duration::from_secs(1);
            let client = common::builder(&ns).lease(lease).max_lease(lease).build().await.unwrap();
            let limits = Limits::with_backend(client.clone());
            limits.define("db", LimitSpec::concurrent(1)).await.unwrap();
            let held = limits.acquire("db", Priority::default()).await.unwrap();
            let calls = Arc::new(AtomicUsize::new(0));
            let tasks: Vec<_> = (0..2)
                .map(|_| {
                    let limits = limits.clone();
                    tokio::spawn(calling_back(client.clone(), Arc::clone(&calls), async move {
                        limits.acquire("db", Priority::default()).await.map(drop)
                    }))
                })
                .collect();
            until_waiting(&limits, "db", 2).await;
            common::cleanup(&ns).await;
            // The holder's permit went with the state: both waiters are granted in turn
            // once the limit comes back (held for the longest lease).
            let granted = tasks.into_iter().map(|task| async { task.await.unwrap() });
            for answer in futures_util::future::join_all(granted).await {
                answer.unwrap();
            }
            drop(held);
            assert!(client.stats().redefinitions > 0, "the client found the state lost");
            assert!(calls.load(Ordering::SeqCst) > 0, "the waiters' wakers were called");
        });
    });
}
