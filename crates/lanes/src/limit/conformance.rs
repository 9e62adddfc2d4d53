//! The conformance suite every [`LimitBackend`] must pass (feature `conformance`).
//!
//! Written once, generic over the backend, and run by each backend's own tests: the in-process
//! backend here, Redis in `lanes-redis`, and `lanes-remote`'s HTTP client against real
//! `lanes serve` processes (in `lanes-server`'s tests, which can run the binary). Scenarios use
//! real time (short waits) so they also run against backends whose clock is a server's, and
//! each uses its own limit names (`prefix`), so a shared store can host them.
//!
//! Every check panics with a message naming the scenario, as a test assertion does.
//!
//! ```
//! use std::sync::Arc;
//! use lanes::limit::{LocalLimits, conformance};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! conformance::run_all("local", |max_waiters| Arc::new(LocalLimits::with_max_waiters(max_waiters))).await;
//! # }
//! ```

use std::sync::Arc;
use std::time::Duration;

use tokio::time::{Instant, sleep, timeout};

use super::backend::{Answer, LimitBackend};
use super::config::LimitSpec;
use super::error::LimitError;
use super::handle::Limits;
use super::priority::Priority;

/// Runs every scenario against backends made by `make(max_waiters)`; `prefix` namespaces the
/// limits they define.
pub async fn run_all<F>(prefix: &str, make: F)
where
    F: Fn(usize) -> Arc<dyn LimitBackend>,
{
    specs_are_validated(&*make(100), prefix).await;
    define_info_list_remove(&*make(100), prefix).await;
    acquire_is_idempotent_with_first_ask_priority(&*make(100), prefix).await;
    no_barging_and_release_withdraws(&*make(100), prefix).await;
    levels_then_fair_keys_then_arrival(&*make(100), prefix).await;
    the_waiting_room_is_bounded(&*make(2), prefix).await;
    the_bucket_answers_retry_after(&*make(100), prefix).await;
    redefinition_never_revokes(&*make(100), prefix).await;
    waiters_are_pushed_on_release(make(100), prefix).await;
    cancelled_waiters_leave_nothing_behind(make(100), prefix).await;
    finished_tickets_are_never_queued_again(&*make(100), prefix).await;
    a_try_never_queues(&*make(1), prefix).await;
    leases_end_and_renewals_say_what_was_lost(&*make(100), prefix).await;
    a_held_rate_limit_keeps_granting(make(100), prefix).await;
    fencing_survives_remove_and_define(&*make(100), prefix).await;
}

fn name(prefix: &str, scenario: &str) -> String {
    format!("{prefix}:{scenario}")
}

async fn ask(b: &dyn LimitBackend, limit: &str, ticket: u64, p: &Priority) -> Answer {
    b.acquire(limit, ticket, p, None)
        .await
        .unwrap_or_else(|e| panic!("acquire {limit}/{ticket}: {e}"))
}

fn granted(answer: Answer) -> bool {
    matches!(answer, Answer::Granted(_))
}

/// Invalid specs are refused with the field named.
pub async fn specs_are_validated(b: &dyn LimitBackend, prefix: &str) {
    let limit = name(prefix, "specs");
    for (spec, field) in [
        (LimitSpec::concurrent(0), "concurrent"),
        (LimitSpec::concurrent(1).per_second(0.0), "per_second"),
        (LimitSpec::concurrent(1).per_second(2.0).burst(0), "burst"),
    ] {
        match b.define(&limit, spec).await {
            Err(LimitError::InvalidSpec(err)) => assert_eq!(err.field(), field, "specs: {spec:?}"),
            other => panic!("specs: {spec:?} gave {other:?}"),
        }
    }
}

/// Define, redefine, info, list and remove (refused while held).
pub async fn define_info_list_remove(b: &dyn LimitBackend, prefix: &str) {
    let limit = name(prefix, "crud");
    b.define(&limit, LimitSpec::concurrent(2)).await.expect("define");
    b.define(&limit, LimitSpec::concurrent(3).per_second(50.0)).await.expect("redefine");
    let info = b.info(&limit).await.expect("info").expect("crud: defined");
    assert_eq!(info.spec, LimitSpec::concurrent(3).per_second(50.0), "crud: spec");
    assert_eq!((info.in_use, info.waiting), (0, 0), "crud: idle");
    let listed = b.list().await.expect("list");
    assert!(listed.iter().any(|i| i.name == limit), "crud: listed");
    let ticket = b.ticket();
    assert!(granted(ask(b, &limit, ticket, &Priority::default()).await), "crud: first grant");
    assert!(matches!(b.remove(&limit).await, Err(LimitError::InUse(_))), "crud: remove while held");
    b.release(&limit, ticket).await.expect("release");
    b.remove(&limit).await.expect("remove");
    assert!(b.info(&limit).await.expect("info").is_none(), "crud: removed");
    let err = b.acquire(&limit, b.ticket(), &Priority::default(), None).await.unwrap_err();
    assert!(err.is_unknown_limit(), "crud: unknown limit, got {err}");
}

/// Asking again for a granted ticket answers `Granted` with the same fencing token; a waiter
/// keeps its first priority.
pub async fn acquire_is_idempotent_with_first_ask_priority(b: &dyn LimitBackend, prefix: &str) {
    let limit = name(prefix, "idempotent");
    b.define(&limit, LimitSpec::concurrent(1)).await.expect("define");
    let (t1, t2, t3) = (b.ticket(), b.ticket(), b.ticket());
    let first = ask(b, &limit, t1, &Priority::default()).await;
    assert!(granted(first), "idempotent: t1");
    assert_eq!(ask(b, &limit, t1, &Priority::level(7)).await, first, "idempotent: same grant");
    assert_eq!(ask(b, &limit, t2, &Priority::default()).await, Answer::Queued);
    assert_eq!(ask(b, &limit, t3, &Priority::level(1)).await, Answer::Queued);
    // t2 asks again at a higher level: it keeps level 0, so t3 stays ahead.
    assert_eq!(ask(b, &limit, t2, &Priority::level(9)).await, Answer::Queued);
    b.release(&limit, t1).await.expect("release");
    assert_eq!(
        ask(b, &limit, t2, &Priority::level(9)).await,
        Answer::Queued,
        "idempotent: t3 first"
    );
    let third = ask(b, &limit, t3, &Priority::level(1)).await;
    let (Answer::Granted(a), Answer::Granted(c)) = (first, third) else {
        panic!("idempotent: t3 should be granted, got {third:?}");
    };
    assert!(c.fencing_token > a.fencing_token, "idempotent: fencing tokens grow");
    b.release(&limit, t3).await.expect("release");
    b.release(&limit, t2).await.expect("release");
}

/// Only the ticket the queue serves next is granted; releasing a waiting ticket withdraws it;
/// releasing an unknown ticket changes nothing.
pub async fn no_barging_and_release_withdraws(b: &dyn LimitBackend, prefix: &str) {
    let limit = name(prefix, "barging");
    b.define(&limit, LimitSpec::concurrent(1)).await.expect("define");
    let p = Priority::default();
    let (t1, t2, t3) = (b.ticket(), b.ticket(), b.ticket());
    assert!(granted(ask(b, &limit, t1, &p).await));
    assert_eq!(ask(b, &limit, t2, &p).await, Answer::Queued);
    assert_eq!(ask(b, &limit, t3, &p).await, Answer::Queued);
    b.release(&limit, t1).await.expect("release");
    assert_eq!(ask(b, &limit, t3, &p).await, Answer::Queued, "barging: t3 may not pass t2");
    b.release(&limit, t2).await.expect("withdraw t2");
    assert!(granted(ask(b, &limit, t3, &p).await), "barging: t3 is next once t2 withdrew");
    b.release(&limit, b.ticket()).await.expect("unknown release is a no-op");
    let info = b.info(&limit).await.expect("info").expect("defined");
    assert_eq!((info.in_use, info.waiting), (1, 0), "barging: state");
    b.release(&limit, t3).await.expect("release");
}

/// Highest level first; weighted turns between keys; arrival order within a key.
pub async fn levels_then_fair_keys_then_arrival(b: &dyn LimitBackend, prefix: &str) {
    let limit = name(prefix, "order");
    b.define(&limit, LimitSpec::concurrent(1)).await.expect("define");
    let holder = b.ticket();
    assert!(granted(ask(b, &limit, holder, &Priority::default()).await));
    let mut waiting = Vec::new();
    let plan = [
        ("a1", Priority::default().key("a").weight(2)),
        ("a2", Priority::default().key("a").weight(2)),
        ("a3", Priority::default().key("a").weight(2)),
        ("b1", Priority::default().key("b")),
        ("b2", Priority::default().key("b")),
        ("hi", Priority::level(3)),
    ];
    for (label, priority) in plan {
        let ticket = b.ticket();
        assert_eq!(ask(b, &limit, ticket, &priority).await, Answer::Queued, "order: {label}");
        waiting.push((label, ticket, priority));
    }
    let mut served = Vec::new();
    let mut held = holder;
    while !waiting.is_empty() {
        b.release(&limit, held).await.expect("release");
        let mut next = None;
        for (i, (label, ticket, priority)) in waiting.iter().enumerate() {
            if granted(ask(b, &limit, *ticket, priority).await) {
                next = Some((i, *label, *ticket));
                break;
            }
        }
        let (i, label, ticket) = next.expect("order: someone is served next");
        served.push(label);
        held = ticket;
        waiting.remove(i);
    }
    b.release(&limit, held).await.expect("release");
    assert_eq!(served, ["hi", "a1", "a2", "b1", "a3", "b2"], "order");
}

/// A full waiting room refuses new tickets with a typed error and queues nothing.
pub async fn the_waiting_room_is_bounded(b: &dyn LimitBackend, prefix: &str) {
    let limit = name(prefix, "room");
    b.define(&limit, LimitSpec::concurrent(1)).await.expect("define");
    let p = Priority::default();
    let tickets: Vec<u64> = (0..4).map(|_| b.ticket()).collect();
    assert!(granted(ask(b, &limit, tickets[0], &p).await));
    assert_eq!(ask(b, &limit, tickets[1], &p).await, Answer::Queued);
    assert_eq!(ask(b, &limit, tickets[2], &p).await, Answer::Queued);
    let err = b.acquire(&limit, tickets[3], &p, None).await.unwrap_err();
    assert!(err.is_too_many_waiters(), "room: got {err}");
    let info = b.info(&limit).await.expect("info").expect("defined");
    assert_eq!(info.waiting, 2, "room: the refused ticket is not queued");
    for t in tickets {
        b.release(&limit, t).await.expect("release");
    }
}

/// The head answers `RetryAfter` when the bucket is empty; later tickets wait behind it.
pub async fn the_bucket_answers_retry_after(b: &dyn LimitBackend, prefix: &str) {
    let limit = name(prefix, "bucket");
    // A token a second: the second ask must come before the next token, and a second leaves
    // a loaded host (and a remote backend's round trips) room for that.
    b.define(&limit, LimitSpec::concurrent(10).per_second(1.0).burst(1)).await.expect("define");
    let p = Priority::default();
    let (t1, t2, t3) = (b.ticket(), b.ticket(), b.ticket());
    assert!(granted(ask(b, &limit, t1, &p).await));
    match ask(b, &limit, t2, &p).await {
        Answer::RetryAfter(after) => {
            assert!(after > Duration::ZERO && after <= Duration::from_secs(1), "bucket: {after:?}");
        }
        other => panic!("bucket: expected RetryAfter, got {other:?}"),
    }
    assert_eq!(ask(b, &limit, t3, &p).await, Answer::Queued, "bucket: no barging past the head");
    sleep(Duration::from_millis(1_050)).await;
    assert!(granted(ask(b, &limit, t2, &p).await), "bucket: refilled");
    for t in [t1, t2, t3] {
        b.release(&limit, t).await.expect("release");
    }
}

/// Shrinking `concurrent` keeps held permits and delays the next grants.
pub async fn redefinition_never_revokes(b: &dyn LimitBackend, prefix: &str) {
    let limit = name(prefix, "redefine");
    b.define(&limit, LimitSpec::concurrent(2)).await.expect("define");
    let p = Priority::default();
    let (t1, t2, t3) = (b.ticket(), b.ticket(), b.ticket());
    assert!(granted(ask(b, &limit, t1, &p).await));
    assert!(granted(ask(b, &limit, t2, &p).await));
    b.define(&limit, LimitSpec::concurrent(1)).await.expect("shrink");
    assert_eq!(b.info(&limit).await.expect("info").expect("defined").in_use, 2, "redefine: kept");
    assert_eq!(ask(b, &limit, t3, &p).await, Answer::Queued);
    b.release(&limit, t1).await.expect("release");
    assert_eq!(ask(b, &limit, t3, &p).await, Answer::Queued, "redefine: 1 held of max 1");
    b.release(&limit, t2).await.expect("release");
    assert!(granted(ask(b, &limit, t3, &p).await), "redefine: room again");
    b.release(&limit, t3).await.expect("release");
}

/// Through the facade: a waiter is let in promptly when the holder releases (pushed, not found
/// by polling on a long period).
pub async fn waiters_are_pushed_on_release(b: Arc<dyn LimitBackend>, prefix: &str) {
    let limit = name(prefix, "push");
    let limits = Limits::from_backend(b);
    limits.define(&limit, LimitSpec::concurrent(1)).await.expect("define");
    let held = limits.acquire(&limit, Priority::default()).await.expect("first");
    let waiter = tokio::spawn({
        let (limits, limit) = (limits.clone(), limit.clone());
        async move {
            let permit = limits.acquire(&limit, Priority::default()).await.expect("second");
            (Instant::now(), permit.fencing_token())
        }
    });
    sleep(Duration::from_millis(50)).await;
    assert!(!waiter.is_finished(), "push: the waiter must wait");
    let released_at = Instant::now();
    drop(held);
    let (granted_at, _) =
        timeout(Duration::from_secs(5), waiter).await.expect("push: woken").expect("task");
    // Under the facade's 1 s safety re-ask (with a loaded runner's slack): the release woke
    // the waiter.
    assert!(
        granted_at - released_at < Duration::from_millis(800),
        "push: took {:?}",
        granted_at - released_at
    );
}

/// Through the facade: dropped acquires (aborted tasks, timeouts) leave no ticket or permit.
pub async fn cancelled_waiters_leave_nothing_behind(b: Arc<dyn LimitBackend>, prefix: &str) {
    let limit = name(prefix, "cancel");
    let limits = Limits::from_backend(b);
    limits.define(&limit, LimitSpec::concurrent(1)).await.expect("define");
    let held = limits.acquire(&limit, Priority::default()).await.expect("first");
    let mut tasks = Vec::new();
    for _ in 0..5 {
        let (limits, limit) = (limits.clone(), limit.clone());
        tasks.push(tokio::spawn(async move { limits.acquire(&limit, Priority::default()).await }));
    }
    let timed_out = limits
        .acquire_timeout(&limit, Priority::default(), Duration::from_millis(100))
        .await
        .unwrap_err();
    assert!(timed_out.is_timeout(), "cancel: {timed_out}");
    for task in &tasks {
        task.abort();
    }
    for task in tasks {
        let _ = task.await;
    }
    drop(held);
    // Releases of non-local backends travel in the background: wait for them to land.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let info = limits.info(&limit).await.expect("info").expect("defined");
        if (info.in_use, info.waiting) == (0, 0) {
            break;
        }
        assert!(Instant::now() < deadline, "cancel: left behind {info:?}");
        sleep(Duration::from_millis(20)).await;
    }
    let again = limits.try_acquire(&limit, Priority::default()).await;
    assert!(again.is_ok(), "cancel: the permit is free: {again:?}");
}

/// A ticket released or withdrawn while its waiter is between two looks is finished: a later
/// look answers `Finished` and leaves nothing queued (the seam where permits leaked).
pub async fn finished_tickets_are_never_queued_again(b: &dyn LimitBackend, prefix: &str) {
    let limit = name(prefix, "finished");
    b.define(&limit, LimitSpec::concurrent(1)).await.expect("define");
    let p = Priority::default();
    let (holder, waiter) = (b.ticket(), b.ticket());
    assert!(granted(ask(b, &limit, holder, &p).await), "finished: first");
    assert_eq!(ask(b, &limit, waiter, &p).await, Answer::Queued, "finished: second waits");
    b.release(&limit, waiter).await.expect("withdraw");
    let look = b.check(&limit, waiter, None).await.expect("check");
    assert_eq!(look, Answer::Finished, "finished: a withdrawn ticket is finished");
    b.release(&limit, holder).await.expect("release");
    assert_eq!(b.check(&limit, holder, None).await.expect("check"), Answer::Finished);
    let info = b.info(&limit).await.expect("info").expect("defined");
    assert_eq!((info.in_use, info.waiting), (0, 0), "finished: nothing left: {info:?}");
    b.remove(&limit).await.expect("remove");
}

/// A try grants or answers busy / retry-after, never queues, and never needs the waiting room.
pub async fn a_try_never_queues(b: &dyn LimitBackend, prefix: &str) {
    let limit = name(prefix, "try");
    b.define(&limit, LimitSpec::concurrent(1).per_second(1.0).burst(1)).await.expect("define");
    let p = Priority::default();
    let holder = b.ticket();
    assert!(granted(ask(b, &limit, holder, &p).await), "try: first");
    // The waiting room (of one) fills up.
    let waiter = b.ticket();
    assert_eq!(ask(b, &limit, waiter, &p).await, Answer::Queued, "try: waiter");
    let tried = b.try_acquire(&limit, b.ticket(), None).await.expect("a try never overflows");
    assert_eq!(tried, Answer::Queued, "try: busy");
    b.release(&limit, waiter).await.expect("withdraw");
    b.release(&limit, holder).await.expect("release");
    // The bucket is empty now: the try says when to come back.
    match b.try_acquire(&limit, b.ticket(), None).await.expect("try") {
        Answer::RetryAfter(after) => assert!(after <= Duration::from_secs(1), "try: {after:?}"),
        other => panic!("try: expected retry-after, got {other:?}"),
    }
    let info = b.info(&limit).await.expect("info").expect("defined");
    assert_eq!((info.in_use, info.waiting), (0, 0), "try: nothing left: {info:?}");
}

/// A leased permit is reclaimed when its lease ends, lets the next waiter in, and a renewal
/// names it as lost; a renewed permit stays.
pub async fn leases_end_and_renewals_say_what_was_lost(b: &dyn LimitBackend, prefix: &str) {
    let limit = name(prefix, "lease");
    b.define(&limit, LimitSpec::concurrent(2)).await.expect("define");
    let p = Priority::default();
    // Long enough that one turn of the loop below (a renewal, a wait of 50 ms, a check) never
    // lets the renewed permit lapse, even on a loaded host.
    let lease = Duration::from_secs(1);
    let (kept, lapsing, waiter) = (b.ticket(), b.ticket(), b.ticket());
    for ticket in [kept, lapsing] {
        let answer = b.acquire(&limit, ticket, &p, Some(lease)).await.expect("acquire");
        assert!(granted(answer), "lease: grant {ticket}");
    }
    assert_eq!(b.acquire(&limit, waiter, &p, Some(lease)).await.expect("acquire"), Answer::Queued);
    let start = Instant::now();
    let mut answer = Answer::Queued;
    while start.elapsed() < Duration::from_secs(3) && !granted(answer) {
        let lost = b.renew(&limit, &[kept], lease).await.expect("renew");
        assert!(lost.is_empty(), "lease: the renewed permit stays: {lost:?}");
        b.wait(&limit, waiter, Duration::from_millis(50)).await;
        answer = b.check(&limit, waiter, Some(lease)).await.expect("check");
    }
    assert!(granted(answer), "lease: the lapsed permit let the waiter in");
    let lost = b.renew(&limit, &[kept, lapsing, waiter], lease).await.expect("renew");
    assert_eq!(lost, vec![lapsing], "lease: the lapsed permit is reported lost");
    for ticket in [kept, waiter] {
        b.release(&limit, ticket).await.expect("release");
    }
}

/// A rate-limited limit whose permits are all kept still grants at its rate (the head waits for
/// the refill even when no permit comes back).
pub async fn a_held_rate_limit_keeps_granting(b: Arc<dyn LimitBackend>, prefix: &str) {
    let limit = name(prefix, "held-rate");
    let limits = Limits::from_backend(b);
    limits
        .define(&limit, LimitSpec::concurrent(100).per_second(20.0).burst(1))
        .await
        .expect("define");
    let mut tasks = Vec::new();
    for _ in 0..5 {
        let (limits, limit) = (limits.clone(), limit.clone());
        tasks.push(tokio::spawn(async move { limits.acquire(&limit, Priority::default()).await }));
    }
    let mut permits = Vec::new();
    for task in tasks {
        let permit = timeout(Duration::from_secs(3), task)
            .await
            .expect("held-rate: every waiter is granted at the rate")
            .expect("task")
            .expect("acquire");
        permits.push(permit);
    }
    assert_eq!(permits.len(), 5);
}

/// Fencing tokens keep growing across a removal and a new definition of the same name.
pub async fn fencing_survives_remove_and_define(b: &dyn LimitBackend, prefix: &str) {
    let limit = name(prefix, "fence");
    let p = Priority::default();
    b.define(&limit, LimitSpec::concurrent(1)).await.expect("define");
    let ticket = b.ticket();
    let Answer::Granted(first) = ask(b, &limit, ticket, &p).await else { panic!("fence: grant") };
    b.release(&limit, ticket).await.expect("release");
    b.remove(&limit).await.expect("remove");
    b.define(&limit, LimitSpec::concurrent(1)).await.expect("define again");
    let ticket = b.ticket();
    let Answer::Granted(second) = ask(b, &limit, ticket, &p).await else { panic!("fence: again") };
    assert!(
        second.fencing_token > first.fencing_token,
        "fence: {} then {}",
        first.fencing_token,
        second.fencing_token
    );
    b.release(&limit, ticket).await.expect("release");
}
