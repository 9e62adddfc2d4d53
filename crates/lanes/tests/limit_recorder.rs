//! A `metrics` recorder that panics never costs a limit its capacity. A limit's calls into the
//! recorder are not contained (the lane's are: `tests/lane_runtime.rs`), so the panic reaches
//! the caller; but a permit (or a guard for it) exists before it is counted granted, it is
//! given back before it is
//! counted off `held`, and a wait leaves the limit's line before it is counted off `waiters`.
//! So whatever the recorder does, every permit goes back and no wait stays in line. A keyed
//! limit's calls are contained (many are made between a permit taken and the handle that
//! gives it back): its callers never see the panic.

mod common;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Duration;

use lanes::{KeyedLimit, Limit, LimitSpec, Limits, Priority};
use tokio::task::JoinHandle;

use common::Breaking;

/// A recorder whose limit counters and gauges of a permit's life (a limit's and a keyed
/// limit's) all panic while `breaking` is switched on.
fn recorder(breaking: &Breaking) -> common::Named {
    let counters = ["lanes_limit_acquired_total", "lanes_limit_keyed_acquired_total"];
    let gauges = [
        "lanes_limit_held",
        "lanes_limit_waiters",
        "lanes_limit_keyed_held",
        "lanes_limit_keyed_waiters",
        "lanes_limit_keyed_keys",
    ];
    breaking.recorder(&counters, &gauges)
}

/// Runs `test` with a limit `"l"` of one permit whose metrics go to a recorder that panics
/// while the given switch is on, on a `current_thread` runtime (so that the limit's handles,
/// resolved at their first use, are resolved with this recorder).
fn with_breaking_recorder<F: Future<Output = ()>>(test: impl FnOnce(Limits, Breaking) -> F) {
    let breaking = Breaking::default();
    let recorder = recorder(&breaking);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let limits = Limits::new();
            limits.define("l", LimitSpec::concurrent(1)).await.unwrap();
            // Resolves the handles, with the recorder working.
            drop(limits.limit("l").acquire().await.unwrap());
            test(limits, breaking).await;
        });
    });
}

/// `fut`'s output, or a failure if it takes ten seconds: a permit lost makes a wait hang.
async fn within<T>(fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), fut).await.expect("hung: a permit was lost")
}

/// The limit has its one permit free and nobody in its line: taken and given back.
async fn assert_whole(limits: &Limits) {
    let info = limits.info("l").await.unwrap().unwrap();
    assert_eq!((info.in_use, info.waiting), (0, 0), "{info:?}");
    let permit = limits.limit("l").try_acquire().await.expect("the permit is free");
    drop(permit);
}

/// How a waiter asks for the permit: three state machines.
#[derive(Clone, Copy, Debug)]
enum Way {
    /// `acquire()` on the handle.
    Handle,
    /// `acquire` by name.
    Name,
    /// By name with a deadline (one far off).
    Deadline,
}

const WAYS: [Way; 3] = [Way::Handle, Way::Name, Way::Deadline];

/// The limit's permit, held, and a task waiting for it in the line, asking `way`.
async fn held_and_awaited(limits: &Limits, way: Way) -> (lanes::Permit, JoinHandle<()>) {
    let holder = limits.limit("l").acquire().await.unwrap();
    (holder, waiter(limits, way).await)
}

/// A task that waits for the limit's permit, asking `way`, once it is in the limit's line.
async fn waiter(limits: &Limits, way: Way) -> JoinHandle<()> {
    let waiting = limits.clone();
    let task = tokio::spawn(async move {
        let permit = match way {
            Way::Handle => waiting.limit("l").acquire().await.map_err(|e| e.to_string()),
            Way::Name => waiting.acquire("l", Priority::default()).await.map_err(|e| e.to_string()),
            Way::Deadline => {
                let within = Duration::from_secs(60);
                let acquired = waiting.acquire_timeout("l", Priority::default(), within).await;
                acquired.map_err(|e| e.to_string())
            }
        };
        drop(permit.unwrap());
    });
    within(async {
        while limits.info("l").await.unwrap().unwrap().waiting == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    task
}

/// A permit whose grant the recorder fails to count is given back: the caller sees the
/// panic, and the limit keeps its permit. (Before, the count came before the permit was
/// made, and the limit's only permit was lost for good.)
#[test]
fn a_permit_the_recorder_fails_to_count_is_given_back() {
    with_breaking_recorder(|limits, breaking| async move {
        breaking.switch(true);
        let limit: Limit = limits.limit("l");
        let taken = tokio::spawn(async move { drop(limit.acquire().await) });
        assert!(
            within(taken).await.unwrap_err().is_panic(),
            "the recorder's panic reaches the caller"
        );
        breaking.switch(false);
        assert!(breaking.panics() >= 1);
        assert_whole(&limits).await;
    });
}

/// A permit dropped while the recorder panics goes back before the panic: `held` is counted
/// after the release.
#[test]
fn a_permit_dropped_as_the_recorder_panics_goes_back() {
    with_breaking_recorder(|limits, breaking| async move {
        let permit = limits.limit("l").acquire().await.unwrap();
        breaking.switch(true);
        assert!(catch_unwind(AssertUnwindSafe(|| drop(permit))).is_err());
        breaking.switch(false);
        assert_whole(&limits).await;
    });
}

/// A permit handed to a caller in the limit's line, while every count panics: the release
/// that hands it over panics after the hand-over, and the waiter, whose grant the recorder
/// fails to count, gives it back as its panic unwinds. Each way of waiting (`Way`).
#[test]
fn a_permit_handed_over_in_line_as_the_recorder_panics_goes_back() {
    for way in WAYS {
        with_breaking_recorder(|limits, breaking| async move {
            let (holder, waiter) = held_and_awaited(&limits, way).await;
            breaking.switch(true);
            assert!(catch_unwind(AssertUnwindSafe(|| drop(holder))).is_err());
            assert!(within(waiter).await.unwrap_err().is_panic(), "the waiter's count panicked");
            breaking.switch(false);
            assert!(breaking.panics() >= 2, "the release's and the grant's counts");
            assert_whole(&limits).await;
        });
    }
}

/// A wait dropped while the `waiters` gauge panics leaves the line first: the permit given
/// back later goes to the limit, not to a wait that is gone. (Before, the gauge came first,
/// and the dropped wait stayed in line and took the permit for good.)
#[test]
fn a_wait_dropped_as_the_recorder_panics_leaves_the_line() {
    for way in WAYS {
        with_breaking_recorder(|limits, breaking| async move {
            let (holder, waiter) = held_and_awaited(&limits, way).await;
            breaking.switch(true);
            waiter.abort();
            assert!(within(waiter).await.is_err(), "the wait was dropped");
            breaking.switch(false);
            assert_eq!(breaking.panics(), 1, "its drop's count of `waiters` panicked");
            drop(holder);
            assert_whole(&limits).await;
        });
    }
}

/// A keyed limit whose every count panics keeps working, and loses no permit: a permit taken
/// at once, one waited for in the key's line and handed over, and a wait dropped from the
/// line. (Before its calls were contained, the count of a permit taken came before the permit
/// that gives it back existed, and the key's only permit was lost for good; a wait that left
/// the line counted itself off under the shard's lock before it left.)
#[test]
fn a_keyed_limit_loses_nothing_to_a_panicking_recorder() {
    let breaking = Breaking::default();
    let recorder = recorder(&breaking);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let limit: Arc<KeyedLimit> = metrics::with_local_recorder(&recorder, || {
        Arc::new(KeyedLimit::new("keyed", LimitSpec::concurrent(1)).unwrap())
    });
    runtime.block_on(async {
        breaking.switch(true);
        let first = limit.try_acquire("k").expect("the key's permit");
        assert!(limit.try_acquire("k").is_err(), "held");
        drop(first);
        // Handed over in line.
        let holder = limit.try_acquire("k").expect("given back");
        let waiting = limit.clone();
        let waiter = tokio::spawn(async move { drop(waiting.acquire("k").await.unwrap()) });
        within(async {
            while limit.info().waiting == 0 {
                tokio::task::yield_now().await;
            }
        })
        .await;
        drop(holder);
        within(waiter).await.expect("the waiter got the permit");
        // Dropped from the line.
        let holder = limit.try_acquire("k").expect("given back");
        let waiting = limit.clone();
        let waiter = tokio::spawn(async move { drop(waiting.acquire("k").await.unwrap()) });
        within(async {
            while limit.info().waiting == 0 {
                tokio::task::yield_now().await;
            }
        })
        .await;
        waiter.abort();
        assert!(within(waiter).await.unwrap_err().is_cancelled());
        drop(holder);
        breaking.switch(false);
        assert!(breaking.panics() >= 8, "every count panicked: {}", breaking.panics());
        let info = limit.info();
        assert_eq!((info.held, info.waiting), (0, 0), "{info:?}");
        drop(limit.try_acquire("k").expect("the key's permit is free"));
    });
}

/// A permit held by code that panics (not the recorder) is counted off `held` as the panic
/// unwinds through its drop: the drop's call is contained then, not skipped, so the gauge
/// reads the limit right. (Skipped, it read one permit held for good.)
#[test]
fn a_permit_dropped_by_a_panic_elsewhere_is_counted_off() {
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let limits = Limits::new();
            limits.define("l", LimitSpec::concurrent(1)).await.unwrap();
            let permit = limits.limit("l").acquire().await.unwrap();
            let panicked = catch_unwind(AssertUnwindSafe(move || {
                let _held = permit;
                panic!("the caller's own panic");
            }));
            assert!(panicked.is_err());
            assert_whole(&limits).await;
        });
    });
    let held =
        snapshotter.snapshot().into_vec().into_iter().find_map(|(key, _, _, value)| {
            (key.key().name() == "lanes_limit_held").then_some(value)
        });
    let held = match held {
        Some(metrics_util::debugging::DebugValue::Gauge(held)) => held.into_inner(),
        other => panic!("the held gauge: {other:?}"),
    };
    assert_eq!(held, 0.0, "every permit counted off");
}

/// A gauge that keeps its value: `lanes_limit_held` beside a panicking counter.
#[derive(Clone, Default)]
struct Level(Arc<std::sync::Mutex<f64>>);

impl metrics::GaugeFn for Level {
    fn increment(&self, value: f64) {
        *self.0.lock().unwrap() += value;
    }
    fn decrement(&self, value: f64) {
        *self.0.lock().unwrap() -= value;
    }
    fn set(&self, value: f64) {
        *self.0.lock().unwrap() = value;
    }
}

/// A fast permit counted in `held` and then refused by a panicking `acquired` counter is
/// counted off again as it is given back: the gauge reads the limit right.
#[test]
fn a_fast_permit_given_back_by_a_panic_is_counted_off() {
    let breaking = Breaking::default();
    let held = Level::default();
    let recorder = common::Named {
        counters: vec![("lanes_limit_acquired_total", breaking.counter())],
        gauges: vec![("lanes_limit_held", metrics::Gauge::from_arc(Arc::new(held.clone())))],
    };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let limits = Limits::new();
            limits.define("l", LimitSpec::concurrent(1)).await.unwrap();
            breaking.switch(true);
            let limit = limits.limit("l");
            let taken = tokio::spawn(async move { drop(limit.acquire().await) });
            assert!(within(taken).await.unwrap_err().is_panic());
            breaking.switch(false);
            assert_whole(&limits).await;
        });
    });
    assert_eq!(*held.0.lock().unwrap(), 0.0, "counted off as it was given back");
}
