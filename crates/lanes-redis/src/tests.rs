//! Tests that set the client's own state (its ticket counter), on the real Redis at
//! `REDIS_URL` (default `redis://127.0.0.1:6379`).

use std::sync::atomic::Ordering;

use lanes::{LimitBackend, LimitSpec, Limits, Priority, TryAcquireError};

use super::{CLIENT_SHIFT, RedisLimits};

/// Found in review (stop 77): ticket numbers come round after 2^32 asks of one client, and a
/// number still held was drawn again. Redis took the new ask for the holder's own and granted
/// it the holder's permit: two holders of a limit of one. A number in use is now skipped.
#[tokio::test]
async fn a_ticket_still_held_is_not_drawn_again_when_the_numbers_come_round() {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    let ns = format!("t-wrap-{}-{}", std::process::id(), nanos.subsec_nanos());
    let backend = RedisLimits::builder(url.as_str()).namespace(&ns).build().await;
    let backend = backend.unwrap_or_else(|e| {
        panic!("Redis is not reachable at {url} ({e}); start it (bash scripts/services.sh)")
    });
    let limits = Limits::with_backend(backend.clone());
    limits.define("one", LimitSpec::concurrent(1)).await.unwrap();
    let held = limits.acquire("one", Priority::default()).await.unwrap();
    // The counter comes round to the number the permit above was drawn with.
    let counter = &backend.inner.next_ticket;
    let last = counter.load(Ordering::Relaxed) - 1;
    counter.store((1 << CLIENT_SHIFT) + last, Ordering::Relaxed);
    let second = limits.try_acquire("one", Priority::default()).await;
    assert!(matches!(second, Err(TryAcquireError::Busy)), "two holders of one permit: {second:?}");
    drop(second);
    // A ticket whose permit is known lost, and not yet released, is in use too: its holder may
    // still release it (review finding, stop 77).
    let lost = (backend.inner.client << CLIENT_SHIFT) | 5;
    backend.inner.lost.mark("one", lost);
    counter.store((2 << CLIENT_SHIFT) + 5, Ordering::Relaxed);
    assert_ne!(backend.ticket(), lost, "a lost permit's ticket is not drawn again");
    backend.inner.lost.forget("one", lost);
    // One that comes into use after a round's first look (a permit reported lost just then,
    // a try whose answer travelled) is found at the next look, 2^20 draws on.
    let later = (backend.inner.client << CLIENT_SHIFT) | ((1 << 20) + 7);
    backend.inner.lost.mark("one", later);
    counter.store((2 << CLIENT_SHIFT) + (1 << 20) + 7, Ordering::Relaxed);
    assert_ne!(backend.ticket(), later, "found by the stretch's look");
    backend.inner.lost.forget("one", later);
    // A draw late from a stretch before the last look is checked against the tickets in use
    // now (that look did not see this one).
    let late = (backend.inner.client << CLIENT_SHIFT) | 9;
    backend.inner.lost.mark("one", late);
    counter.store((2 << CLIENT_SHIFT) + 9, Ordering::Relaxed);
    assert_ne!(backend.ticket(), late, "a late draw is checked too");
    backend.inner.lost.forget("one", late);
    drop(held);
    // The permit is free again, for a ticket drawn after the skipped one.
    let again = limits.acquire("one", Priority::default()).await.unwrap();
    drop(again);
    drop(limits);
    drop(backend);
    cleanup(&url, &ns).await;
}

async fn cleanup(url: &str, ns: &str) {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    for pattern in [format!("{{{ns}:*"), format!("lanes:{{{ns}}}:*")] {
        let keys: Vec<String> =
            redis::cmd("KEYS").arg(&pattern).query_async(&mut conn).await.unwrap_or_default();
        for key in keys {
            let _: Result<(), _> = redis::cmd("DEL").arg(key).query_async(&mut conn).await;
        }
    }
}
