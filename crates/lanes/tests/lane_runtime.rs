//! Run lanes that outlive the runtime their runs were admitted on: a runtime that shuts down
//! drops its tasks, and with them the runs they drove. Each such run ends in that drop, counted
//! failed `Canceled` without its finalizer (there is no runtime left to run it on), and gives
//! back its slot and room, so that the set keeps its full capacity on the next runtime.

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lanes::{
    BoxError, LaneLimits, LaneSet, LimitSpec, Limits, Outcome, Priority, Reason, Run, RunContext,
    RunHandle,
};
use tokio::runtime::{Builder, Runtime};
use tokio::sync::Barrier;

use common::Breaking;

fn current_thread() -> Runtime {
    Builder::new_current_thread().enable_all().build().unwrap()
}

fn two_workers() -> Runtime {
    Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// A job that runs until its runtime drops it: it ignores cancellation.
type Forever = fn(RunContext) -> std::future::Pending<Result<u32, BoxError>>;

fn forever() -> Run<Forever> {
    Run::new((|_cx| std::future::pending()) as Forever)
}

/// Every run the set owned has ended, and each was counted once: completed or failed.
fn assert_quiescent(set: &LaneSet) {
    let snapshot = set.snapshot();
    assert_eq!(snapshot.owned, 0, "{snapshot:?}");
    for lane in &snapshot.lanes {
        assert_eq!((lane.executing, lane.queued, lane.owned), (0, 0, 0), "{lane:?}");
        assert_eq!(lane.completed + lane.failed.total(), lane.admitted, "{lane:?}");
    }
}

/// Admits `width` blocking runs on `runtime` that can only finish together (each waits for
/// all of them), so the lane must have `width` free slots; then closes the set, which drains.
fn runs_at_full_width(runtime: &Runtime, set: &LaneSet, lane: &str, width: usize) {
    runtime.block_on(async {
        let barrier = Arc::new(Barrier::new(width));
        let handles: Vec<RunHandle<u32>> = (0..width)
            .map(|_| {
                let barrier = barrier.clone();
                let run = Run::new(move |_cx| async move {
                    barrier.wait().await;
                    Ok(7)
                });
                set.run(lane, run).expect("a free slot")
            })
            .collect();
        for handle in handles {
            let done = tokio::time::timeout(Duration::from_secs(10), handle).await;
            assert_eq!(done.expect("every slot is free").unwrap(), 7);
        }
        set.close();
        let drained = tokio::time::timeout(Duration::from_secs(10), set.drained()).await;
        assert!(drained.is_ok(), "the set drains: {:?}", set.snapshot());
    });
}

/// A runtime dropped with runs in every stage: executing, in a finalizer, queued as data (ten
/// thousand of them, ended one after another as each frees its slot to the next), queued with
/// a task (a deadline, a blocking caller), waiting for a limit's permit, and a caller waiting
/// for room. Every one ends in the drop, counted canceled; no finalizer starts; the blocking
/// caller's handle, polled on the next runtime, says canceled; and the next runtime gets the
/// lane's whole width.
#[test]
fn runs_dropped_with_their_runtime_end_and_give_their_rooms_back() {
    const QUEUED: usize = 10_000;
    let set = common::one_lane("a", LaneLimits::new(2, QUEUED)).build().unwrap();
    let limits = Limits::new();
    let finalized = Arc::new(AtomicUsize::new(0));
    let first = current_thread();
    let (blocked, waiting, taken) = first.block_on(async {
        limits.define("one", LimitSpec::concurrent(1)).await.unwrap();
        // Held until the runtime is gone: the limited run below waits for it.
        let taken = limits.acquire("one", Priority::default()).await.unwrap();
        // Slot 1: a job that never ends, with a caller.
        let executing = set.run("a", forever()).unwrap();
        // Slot 2: a job that ends at once, then a finalizer that never does.
        let counted = finalized.clone();
        let stuck = Run::new(|_cx| async { Ok(1) }).finalizer(move |_outcome| {
            counted.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<Result<u32, BoxError>>()
        });
        set.spawn("a", stuck).unwrap();
        tokio::task::yield_now().await;
        // The queue: runs waiting as data, one with a deadline, one with a caller, one for
        // its permit (held above).
        let counting = |run: Run<Forever>| {
            let counted = finalized.clone();
            run.finalizer(move |_outcome: Outcome<u32>| {
                counted.fetch_add(1, Ordering::SeqCst);
                async { Ok::<_, BoxError>(()) }
            })
        };
        for _ in 0..QUEUED - 3 {
            set.spawn("a", counting(forever())).unwrap();
        }
        set.spawn("a", counting(forever()).queue_timeout(Duration::from_secs(3600))).unwrap();
        let queued = set.run("a", forever()).unwrap();
        set.spawn("a", counting(forever().limit(&limits, "one", Priority::default()))).unwrap();
        // The lane is full: a caller waits for room.
        let waiting = tokio::spawn(set.run_wait("a", forever(), None));
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        let lane = &set.snapshot().lanes[0];
        assert_eq!((lane.executing, lane.owned), (2, QUEUED + 2), "{lane:?}");
        assert_eq!(finalized.load(Ordering::SeqCst), 1, "the stuck finalizer started");
        (vec![executing, queued], waiting, taken)
    });
    drop(first);
    drop(taken);
    assert_quiescent(&set);
    let lane = &set.snapshot().lanes[0];
    assert_eq!(lane.failed.canceled, (QUEUED + 2) as u64, "{lane:?}");
    assert_eq!(finalized.load(Ordering::SeqCst), 1, "no finalizer started in the drop");

    let next = current_thread();
    next.block_on(async {
        for handle in blocked {
            let failure = handle.await.expect_err("the runtime dropped the run");
            assert_eq!(failure.reason(), Reason::Canceled);
        }
        assert!(waiting.await.is_err(), "the waiting caller's task was dropped unadmitted");
    });
    runs_at_full_width(&next, &set, "a", 2);
    assert_quiescent(&set);
}

/// Spawns on lane `a` a run that never ends and whose finalizer counts a `Closed` failure.
fn spawn_counting_closed(set: &LaneSet, closed: &Arc<AtomicUsize>) {
    let closed = closed.clone();
    let run = forever().finalizer(move |outcome: Outcome<u32>| {
        if outcome.is_err_and(|failure| failure.reason() == Reason::Closed) {
            closed.fetch_add(1, Ordering::SeqCst);
        }
        async { Ok::<_, BoxError>(()) }
    });
    set.spawn("a", run).unwrap();
}

/// Parked runs admitted on a second runtime, after the first one the set was used on shut
/// down, are failed by a close on the second runtime through their finalizers, there, their
/// home: whether the first one dropped runs as it shut down (`abandoned`) or had ended them all.
fn close_after_the_first_runtime_is_gone(abandoned: bool) {
    let set = common::one_lane("a", LaneLimits::new(1, 8)).build().unwrap();
    let first = current_thread();
    first.block_on(async {
        for _ in 0..2 {
            // The second waits as data.
            let admitted = match abandoned {
                true => set.spawn("a", forever()).is_ok(),
                false => set.spawn("a", Run::new(|_cx| async { Ok(1) })).is_ok(),
            };
            assert!(admitted);
        }
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    });
    drop(first);
    assert_quiescent(&set);

    let closed = Arc::new(AtomicUsize::new(0));
    let second = current_thread();
    second.block_on(async {
        let busy = Run::new(|cx| async move { Ok(cx.cancelled().await as u32) });
        set.spawn("a", busy).unwrap();
        for _ in 0..3 {
            spawn_counting_closed(&set, &closed);
        }
        tokio::task::yield_now().await;
        set.close();
        let drained = tokio::time::timeout(Duration::from_secs(10), set.drained()).await;
        assert!(drained.is_ok(), "the set drains: {:?}", set.snapshot());
    });
    assert_eq!(closed.load(Ordering::SeqCst), 3, "each parked run was finalized as closed");
    assert_quiescent(&set);
}

#[test]
fn a_close_after_the_first_runtime_dropped_runs_finalizes_parked_runs() {
    close_after_the_first_runtime_is_gone(true);
}

#[test]
fn a_close_after_the_first_runtime_ended_finalizes_parked_runs() {
    close_after_the_first_runtime_is_gone(false);
}

/// A close from outside any runtime, once one of the set's runtimes is gone: the parked runs of
/// that runtime have nowhere to run and end canceled (no hang, nothing left owned), while those
/// of a runtime that lives on are finalized `Closed` there, their home.
#[test]
fn a_close_from_no_runtime_ends_the_parked_runs_of_a_runtime_that_is_gone() {
    let set = common::one_lane("a", LaneLimits::new(1, 8)).build().unwrap();
    let (first, second) = (current_thread(), current_thread());
    let closed = Arc::new(AtomicUsize::new(0));
    second.block_on(async {
        let busy = Run::new(|cx| async move { Ok(cx.cancelled().await as u32) });
        set.spawn("a", busy).unwrap();
        tokio::task::yield_now().await;
    });
    // Parked on the first runtime, which is then dropped.
    first.block_on(async {
        for _ in 0..3 {
            set.spawn("a", forever()).unwrap();
        }
    });
    drop(first);
    second.block_on(async {
        for _ in 0..2 {
            spawn_counting_closed(&set, &closed);
        }
    });
    set.close();
    let lane = &set.snapshot().lanes[0];
    assert_eq!((lane.owned, lane.queued, lane.failed.canceled), (3, 0, 3), "{lane:?}");
    second.block_on(async {
        let drained = tokio::time::timeout(Duration::from_secs(10), set.drained()).await;
        assert!(drained.is_ok(), "the set drains: {:?}", set.snapshot());
    });
    assert_eq!(closed.load(Ordering::SeqCst), 2, "the live runtime's parked runs, finalized");
    assert_quiescent(&set);
}

/// Runtimes of two workers, each shut down at a random moment under a random mix of runs
/// (blocking and background, jobs that end, wait or never end, finalizers that hang, queue
/// deadlines, dropped handles, callers waiting for room). After each, at quiescence, every run
/// the set admitted ended exactly once (completed or failed), no finalizer started twice, and
/// nothing is left owned; after all of them the lane still runs at its full width.
#[test]
fn a_set_outliving_runtimes_shut_down_at_random_loses_no_room() {
    const WIDTH: usize = 3;
    let set = common::one_lane("a", LaneLimits::new(WIDTH, 64)).build().unwrap();
    let finalized: Arc<Mutex<HashSet<u64>>> = Arc::default();
    let twice = Arc::new(AtomicUsize::new(0));
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    for round in 0..40 {
        let runtime = two_workers();
        let mut draw = || common::xorshift(&mut seed);
        let (admissions, pause) = (draw() % 120, draw() % 3);
        let choices: Vec<u64> = (0..admissions).map(|_| draw()).collect();
        let kept = runtime.block_on(async {
            let mut kept = Vec::new();
            for choice in choices {
                let job = move |cx: RunContext| async move {
                    match choice % 4 {
                        0 => {}
                        1 => tokio::task::yield_now().await,
                        2 => drop(cx.cancelled().await),
                        _ => std::future::pending::<()>().await,
                    }
                    Ok::<_, BoxError>(cx.run_id().get())
                };
                let hangs = (choice >> 8) % 8 == 0;
                let (finalized, twice) = (finalized.clone(), twice.clone());
                let run = Run::new(job).finalizer(move |outcome: Outcome<u64>| {
                    let id = match &outcome {
                        Ok(id) => *id,
                        Err(failure) => failure.run_id().get(),
                    };
                    if !finalized.lock().unwrap().insert(id) {
                        twice.fetch_add(1, Ordering::SeqCst);
                    }
                    async move {
                        if hangs {
                            std::future::pending::<()>().await;
                        }
                        Ok::<_, BoxError>(id)
                    }
                });
                let run = match (choice >> 12) % 4 {
                    0 => run.queue_timeout(Duration::from_millis((choice >> 16) % 5)),
                    _ => run,
                };
                match (choice >> 20) % 4 {
                    0 => {
                        if let Ok(handle) = set.run("a", run) {
                            kept.push(handle);
                        }
                    }
                    1 => drop(set.run("a", run)),
                    2 => drop(tokio::spawn(set.run_wait("a", run, None))),
                    _ => drop(set.spawn("a", run)),
                }
                if (choice >> 24) % 8 == 0 {
                    tokio::task::yield_now().await;
                }
            }
            tokio::time::sleep(Duration::from_millis(pause)).await;
            kept
        });
        // Handles held until the runtime is gone, so that only its drop cancels their runs.
        drop(runtime);
        drop(kept);
        let snapshot = set.snapshot();
        assert_eq!(snapshot.owned, 0, "round {round}: {snapshot:?}");
        assert_quiescent(&set);
    }
    assert_eq!(twice.load(Ordering::SeqCst), 0, "a finalizer started twice");
    let lane = &set.snapshot().lanes[0];
    assert!(lane.failed.canceled > 0, "some runs were dropped with their runtime: {lane:?}");
    assert!(lane.completed > 0, "some runs ended before: {lane:?}");
    runs_at_full_width(&two_workers(), &set, "a", WIDTH);
    assert_quiescent(&set);
}

/// A set of one lane, "a", of one slot and room for four, whose metrics go to `recorder`.
fn one_slot_recording_to(recorder: &common::Named) -> LaneSet {
    metrics::with_local_recorder(recorder, || {
        common::one_lane("a", LaneLimits::new(1, 4)).build().unwrap()
    })
}

/// Runs admitted into a lane of one slot: one into the free slot, held until `release` gets
/// a permit; one into the queue behind it (a blocking run: under the lane's lock); one as data
/// (a background run without limit or deadline, while the slot is taken: into the inbox),
/// which counts itself in `ran`. Each admission must succeed; then the first is let go, and
/// every run must complete.
async fn admit_past_a_panicking_recorder(set: &LaneSet) {
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let ran = Arc::new(AtomicUsize::new(0));
    let held = release.clone();
    let holder = set
        .run("a", Run::new(move |_cx| async move { Ok(held.acquire().await.is_ok() as u32) }))
        .expect("admitted into the free slot");
    tokio::task::yield_now().await;
    let queued = set.run("a", Run::new(|_cx| async { Ok(2) })).expect("admitted into the queue");
    let counted = ran.clone();
    set.spawn(
        "a",
        Run::new(move |_cx| async move { Ok(counted.fetch_add(1, Ordering::SeqCst) as u32) }),
    )
    .expect("admitted into the inbox");
    release.add_permits(1);
    let ended = async { (holder.await, queued.await) };
    let (holder, queued) = tokio::time::timeout(Duration::from_secs(10), ended).await.unwrap();
    assert_eq!((holder.unwrap(), queued.unwrap()), (1, 2));
    let drained = async {
        while set.snapshot().owned > 0 {
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), drained).await.expect("the runs end");
    assert_eq!(ran.load(Ordering::SeqCst), 1, "the run admitted as data ran");
    let lane = &set.snapshot().lanes[0];
    assert_eq!((lane.admitted, lane.completed), (3, 3), "{lane:?}");
}

/// A metrics recorder that panics never unwinds through a lane (`lane::metrics` contains each
/// call): with the `admitted` counter panicking on every call, an admission into the free
/// slot, one into the queue and one into the inbox all succeed, and every run completes.
/// (Before stop 66 the panic unwound out of the admission: the first two runs ended
/// canceled, and the third stayed owned for good, holding its room and, once granted, the
/// lane's only slot.)
#[test]
fn a_counter_that_panics_on_admission_loses_no_run() {
    let breaking = Breaking::default();
    let set = one_slot_recording_to(&breaking.recorder(&["lanes_lane_admitted_total"], &[]));
    let runtime = current_thread();
    breaking.switch(true);
    runtime.block_on(admit_past_a_panicking_recorder(&set));
    breaking.switch(false);
    assert_eq!(breaking.panics(), 3, "each admission's count panicked");
    runs_at_full_width(&runtime, &set, "a", 1);
    assert_quiescent(&set);
}

/// The same with the lane's gauges panicking on every call: the lane moves them as its runs
/// move, after its lock (the first as the run into the free slot is admitted, before its
/// ticket), and the inbox's admission moves `queued` after the inbox's. (Before stop 66 such a
/// panic left the run admitted into the free slot owned for good, holding the lane's only
/// slot.) Once the recorder stops panicking, the gauges read the lane again at its next move.
#[test]
fn a_gauge_that_panics_under_the_lanes_lock_loses_no_run() {
    let breaking = Breaking::default();
    let gauges = ["lanes_lane_executing", "lanes_lane_queued"];
    let set = one_slot_recording_to(&breaking.recorder(&[], &gauges));
    let runtime = current_thread();
    breaking.switch(true);
    runtime.block_on(admit_past_a_panicking_recorder(&set));
    runs_at_full_width(&runtime, &set, "a", 1);
    breaking.switch(false);
    // The admission into the free slot, the moves of `queued` and the slot freed at the end.
    assert!(breaking.panics() >= 4, "the gauges panicked");
    assert_quiescent(&set);
}

/// A tracing subscriber whose events panic (a layer written carelessly); spans do nothing.
/// (Here, not in `tests/tracing.rs`: a dispatcher set up while that file's tests count spans
/// can make one of them miss a span, as tracing rebuilds its callsites' interest.)
struct PanicsOnEvent;

impl tracing::Subscriber for PanicsOnEvent {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, _: &tracing::Event<'_>) {
        panic!("the subscriber panics");
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// A subscriber whose `enabled` panics (a filter written carelessly).
struct PanicsWhenAsked;

impl tracing::Subscriber for PanicsWhenAsked {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        panic!("the subscriber's filter panics");
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, _: &tracing::Event<'_>) {}
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// Review finding (stop 79, second look): the inbox path's event was contained, but the test of
/// whether it was wanted ran the subscriber's `enabled` outside the containment, with the run
/// owned and its ticket not made yet. A filter that panics there is contained too.
#[test]
fn a_subscriber_whose_filter_panics_as_a_run_is_inboxed_leaves_nothing_owned() {
    let set = common::one_lane("a", LaneLimits::new(1, 4)).build().unwrap();
    let runtime = current_thread();
    runtime.block_on(async {
        let gate = Arc::new(tokio::sync::Notify::new());
        let open = gate.clone();
        set.spawn(
            "a",
            Run::new(move |_cx| async move {
                open.notified().await;
                Ok::<_, BoxError>(1u32)
            }),
        )
        .unwrap();
        tokio::task::yield_now().await;
        let inboxed = Run::new(|_cx| async { Ok::<_, BoxError>(2u32) });
        let admitted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            tracing::subscriber::with_default(PanicsWhenAsked, || set.spawn("a", inboxed))
        }));
        // The filter is asked elsewhere on the way too (its panic may reach the caller there):
        // what matters is that no run is left owned with nothing to end it.
        drop(admitted);
        gate.notify_one();
        set.close();
        let drained = tokio::time::timeout(Duration::from_secs(5), set.drained()).await;
        assert!(drained.is_ok(), "drained");
    });
    assert_quiescent(&set);
}

/// Runs their runtime drops end in that drop (a ticket's `abandon`), counted canceled, and
/// their event comes after: a subscriber that panics on it leaves no run owned. (Before stop 66
/// the event came first, and the panic left both runs owned for good.)
#[test]
fn a_subscriber_that_panics_as_a_dropped_run_ends_leaves_nothing_owned() {
    let set = common::one_lane("a", LaneLimits::new(1, 4)).build().unwrap();
    let runtime = current_thread();
    runtime.block_on(async {
        for _ in 0..2 {
            set.spawn("a", forever()).unwrap();
        }
        tokio::task::yield_now().await;
    });
    tracing::subscriber::with_default(PanicsOnEvent, || drop(runtime));
    let lane = &set.snapshot().lanes[0];
    assert_eq!((lane.owned, lane.failed.canceled), (0, 2), "{lane:?}");
}

/// Review finding (stop 79): a background run admitted into a busy lane's inbox (no limit, no
/// queue timeout) was owned before its ticket was made, and the subscriber's `admitted` event
/// came in between: a panic there left the run in the inbox with nothing to end it. Its grant
/// then started nothing and kept the lane's one slot for good, and the set never drained. That
/// event is contained now: the run goes on. On the locked path the ticket is made before the
/// event, and the panic ends the run, canceled, its finalizer not called (the spawn answered a
/// panic, not a handle); the ticket's own event, in that unwinding, is contained (a second
/// panic there aborted the process).
#[test]
fn a_subscriber_that_panics_as_a_run_is_inboxed_leaves_nothing_owned() {
    let set = common::one_lane("a", LaneLimits::new(1, 4)).build().unwrap();
    let runtime = current_thread();
    runtime.block_on(async {
        // The locked path first (the lane is idle): the same panic ends that run too.
        let admitted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            tracing::subscriber::with_default(PanicsOnEvent, || {
                set.spawn("a", Run::new(|_cx| async { Ok::<_, BoxError>(0u32) }))
            })
        }));
        assert!(admitted.is_err(), "the subscriber panicked");
        let gate = Arc::new(tokio::sync::Notify::new());
        let open = gate.clone();
        let busy = Run::new(move |_cx| async move {
            open.notified().await;
            Ok::<_, BoxError>(1u32)
        });
        set.spawn("a", busy).unwrap();
        // The slot is taken: the next background run goes to the inbox.
        tokio::task::yield_now().await;
        let finalized = Arc::new(AtomicUsize::new(0));
        let counted = finalized.clone();
        let inboxed = Run::new(|_cx| async { Ok::<_, BoxError>(2u32) }).finalizer(
            move |_outcome: Outcome<u32>| {
                counted.fetch_add(1, Ordering::SeqCst);
                async { Ok::<_, BoxError>(()) }
            },
        );
        let admitted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            tracing::subscriber::with_default(PanicsOnEvent, || set.spawn("a", inboxed))
        }));
        assert!(admitted.is_ok_and(|admitted| admitted.is_ok()), "its event is contained");
        gate.notify_one();
        // The lane's slot comes back, and the next run takes it.
        let next = set.run("a", Run::new(|_cx| async { Ok::<_, BoxError>(3u32) })).unwrap();
        let next = tokio::time::timeout(Duration::from_secs(5), next).await;
        assert_eq!(next.expect("the lane's slot came back").unwrap(), 3);
        set.close();
        let drained = tokio::time::timeout(Duration::from_secs(5), set.drained()).await;
        assert!(drained.is_ok(), "drained");
        assert_eq!(finalized.load(Ordering::SeqCst), 1, "finalized once");
    });
    assert_quiescent(&set);
    let lane = &set.snapshot().lanes[0];
    assert_eq!((lane.completed, lane.failed.canceled), (3, 1), "{lane:?}");
}

/// A value whose drop panics: a job's capture written carelessly.
struct PanicsOnDrop;

impl Drop for PanicsOnDrop {
    fn drop(&mut self) {
        panic!("a job's capture panics in its drop");
    }
}

/// A close from outside any runtime starts the parked runs it fails on their runtime, and one
/// that is gone drops them, as it drops a task spawned on it: a job whose drop panics there is
/// caught, and the close goes on to the runs after it and to the lanes after its own. (Before
/// stop 65, such runs were dropped in place, the panic left the close from that point, the
/// later lanes were never shut and the set never drained.)
#[test]
fn a_parked_runs_drop_that_panics_in_a_close_does_not_stop_the_close() {
    let limits = LaneLimits::new(1, 8);
    let set = common::one_lane("a", limits).lane("b", limits).build().unwrap();
    let (first, second) = (current_thread(), current_thread());
    second.block_on(async {
        for lane in ["a", "b"] {
            let busy = Run::new(|cx| async move { Ok(cx.cancelled().await as u32) });
            set.spawn(lane, busy).unwrap();
        }
        tokio::task::yield_now().await;
    });
    // Parked on the first runtime, which is then dropped.
    first.block_on(async {
        for lane in ["a", "b"] {
            let careless = PanicsOnDrop;
            let run = Run::new(move |_cx| async move {
                drop(careless);
                Ok(2)
            });
            set.spawn(lane, run).unwrap();
            set.spawn(lane, forever()).unwrap();
        }
    });
    drop(first);
    let closed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| set.close()));
    assert!(closed.is_ok(), "the close caught the job's panic, as a runtime would have");
    for lane in &set.snapshot().lanes {
        assert_eq!((lane.owned, lane.queued, lane.failed.canceled), (1, 0, 2), "{lane:?}");
    }
    second.block_on(async {
        let drained = tokio::time::timeout(Duration::from_secs(10), set.drained()).await;
        assert!(drained.is_ok(), "the set drains: {:?}", set.snapshot());
    });
    assert_quiescent(&set);
}

/// Two runtimes share a set at once, and one of them shuts down while its run holds the lane's
/// only slot: the queued runs of the other one, which lives on, run there and complete. None is
/// started on the runtime that is shutting down, where it would end at once, canceled.
/// With `dying_queues_first`, a run of the dying runtime waits as data ahead of the survivor's.
fn queued_runs_of_a_live_runtime_outlast_another_runtimes_shutdown(dying_queues_first: bool) {
    const QUEUED: usize = 50;
    let set = common::one_lane("a", LaneLimits::new(1, QUEUED + 2)).build().unwrap();
    let (survivor, dying) = (current_thread(), current_thread());
    let completed = Arc::new(AtomicUsize::new(0));
    let park_on = |runtime: &Runtime| {
        runtime.block_on(async {
            for _ in 0..QUEUED {
                let completed = completed.clone();
                let run =
                    Run::new(|_cx| async { Ok(1) }).finalizer(move |outcome: Outcome<u32>| {
                        if outcome.is_ok() {
                            completed.fetch_add(1, Ordering::SeqCst);
                        }
                        async { Ok::<_, BoxError>(()) }
                    });
                set.spawn("a", run).unwrap();
            }
        });
    };
    // The dying runtime's run takes the slot, so that every run after it waits as data.
    dying.block_on(async {
        set.spawn("a", forever()).unwrap();
        tokio::task::yield_now().await;
    });
    if dying_queues_first {
        dying.block_on(async { set.spawn("a", Run::new(|_cx| async { Ok(1) })).unwrap() });
    }
    park_on(&survivor);
    drop(dying);
    survivor.block_on(async {
        let all = async {
            while completed.load(Ordering::SeqCst) < QUEUED {
                tokio::task::yield_now().await;
            }
        };
        let done = tokio::time::timeout(Duration::from_secs(10), all).await;
        assert!(done.is_ok(), "the survivor's runs completed: {:?}", set.snapshot());
    });
    let lane = &set.snapshot().lanes[0];
    let canceled = if dying_queues_first { 2 } else { 1 };
    assert_eq!((lane.completed, lane.failed.canceled), (QUEUED as u64, canceled), "{lane:?}");
    assert_quiescent(&set);
}

#[test]
fn queued_runs_of_a_live_runtime_outlast_another_runtimes_shutdown_alone() {
    queued_runs_of_a_live_runtime_outlast_another_runtimes_shutdown(false);
}

#[test]
fn queued_runs_of_a_live_runtime_outlast_another_runtimes_shutdown_behind_its_queued_run() {
    queued_runs_of_a_live_runtime_outlast_another_runtimes_shutdown(true);
}

/// Two runtimes of one worker each share a set at once, admitting in a random order, and one
/// is dropped at a random moment while its runs (some of which never end) hold slots and
/// queue places. Every run of the runtime that lives on completes, whatever runtime freed the
/// slot it got; only the dropped runtime's runs end canceled; nothing is left owned.
#[test]
fn runs_of_a_runtime_that_lives_on_never_end_with_another_runtimes_shutdown() {
    const WIDTH: usize = 2;
    let set = common::one_lane("a", LaneLimits::new(WIDTH, 1_000)).build().unwrap();
    let one_worker = || Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    // Jobs that ran on a runtime other than the one they were admitted on.
    let strays = Arc::new(AtomicUsize::new(0));
    // A job that checks it runs on `home`, then ends or (`forever`) waits until dropped.
    let homed = |home: tokio::runtime::Id, yields: u64, forever: bool| {
        let strays = strays.clone();
        Run::new(move |_cx| async move {
            if tokio::runtime::Handle::current().id() != home {
                strays.fetch_add(1, Ordering::SeqCst);
            }
            for _ in 0..yields {
                tokio::task::yield_now().await;
            }
            if forever {
                std::future::pending::<()>().await;
            }
            Ok::<_, BoxError>(1)
        })
    };
    for round in 0..20 {
        let (survivor, dying) = (one_worker(), one_worker());
        let ok = Arc::new(AtomicUsize::new(0));
        let failed = Arc::new(Mutex::new(Vec::new()));
        let mut draw = || common::xorshift(&mut seed);
        let (admissions, drop_at) = (40 + draw() % 80, draw() % 40);
        let mut survivors = 0;
        let mut dying = Some(dying);
        for n in 0..admissions {
            if n == drop_at {
                drop(dying.take());
            }
            let choice = draw();
            match &dying {
                Some(runtime) if choice % 2 == 0 => {
                    let _entered = runtime.enter();
                    let run = homed(runtime.handle().id(), 0, (choice >> 4) % 3 == 0);
                    assert!(set.spawn("a", run).is_ok());
                }
                _ => {
                    let _entered = survivor.enter();
                    let (ok, failed) = (ok.clone(), failed.clone());
                    let run = homed(survivor.handle().id(), (choice >> 8) % 3, false).finalizer(
                        move |outcome: Outcome<u32>| {
                            match outcome {
                                Ok(_) => drop(ok.fetch_add(1, Ordering::SeqCst)),
                                Err(failure) => failed.lock().unwrap().push(failure.reason()),
                            }
                            async { Ok::<_, BoxError>(()) }
                        },
                    );
                    assert!(set.spawn("a", run).is_ok());
                    survivors += 1;
                }
            }
        }
        drop(dying);
        survivor.block_on(async {
            let all = async {
                while ok.load(Ordering::SeqCst) + failed.lock().unwrap().len() < survivors {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            };
            let done = tokio::time::timeout(Duration::from_secs(10), all).await;
            assert!(done.is_ok(), "round {round}: the survivor's runs ended: {:?}", set.snapshot());
        });
        let failed = failed.lock().unwrap().clone();
        assert!(failed.is_empty(), "round {round}: survivor's runs failed: {failed:?}");
        assert_eq!(ok.load(Ordering::SeqCst), survivors, "round {round}");
        drop(survivor);
        assert_quiescent(&set);
    }
    assert_eq!(strays.load(Ordering::SeqCst), 0, "a job ran off the runtime it was admitted on");
    runs_at_full_width(&current_thread(), &set, "a", WIDTH);
}

/// Queued runs of a runtime that has shut down, granted their slot later by a run of a runtime
/// that lives on, end canceled: each is started on its own runtime, which drops it, and the
/// slot it frees goes on to the next. None runs on the live runtime in its place, not even one
/// granted by a dead runtime's run that ended inside the live runtime's thread. With `pruned`,
/// a third runtime (dropped at once) admits a run after the first shut down, which forgets the
/// first one's handle: its runs are then dropped where they are granted, with the same end.
fn queued_runs_of_a_runtime_that_is_gone_end_when_their_slot_comes(pruned: bool) {
    let set = common::one_lane("a", LaneLimits::new(1, 8)).build().unwrap();
    let (gone, live) = (current_thread(), current_thread());
    let live_runs = Arc::new(AtomicUsize::new(0));
    gone.block_on(async {
        set.spawn("a", forever()).unwrap();
        tokio::task::yield_now().await;
        set.spawn("a", forever()).unwrap();
    });
    live.block_on(async {
        let counted = live_runs.clone();
        let run = Run::new(|_cx| async { Ok(1) }).finalizer(move |outcome: Outcome<u32>| {
            assert!(outcome.is_ok(), "the live runtime's run completes");
            counted.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, BoxError>(()) }
        });
        set.spawn("a", run).unwrap();
    });
    gone.block_on(async {
        for _ in 0..2 {
            set.spawn("a", forever()).unwrap();
        }
    });
    drop(gone);
    if pruned {
        // Its run waits as data behind the first runtime's, and ends when granted, its
        // runtime being gone by then.
        let third = current_thread();
        third.block_on(async { set.spawn("a", forever()).unwrap() });
    }
    live.block_on(async {
        let all = async {
            while live_runs.load(Ordering::SeqCst) < 1 || set.snapshot().owned > 0 {
                tokio::task::yield_now().await;
            }
        };
        let done = tokio::time::timeout(Duration::from_secs(10), all).await;
        assert!(done.is_ok(), "every run ended: {:?}", set.snapshot());
    });
    let lane = &set.snapshot().lanes[0];
    assert_eq!((lane.completed, lane.failed.canceled), (1, 4 + u64::from(pruned)), "{lane:?}");
    assert_quiescent(&set);
}

#[test]
fn queued_runs_of_a_runtime_that_is_gone_end_when_their_slot_comes_on_its_handle() {
    queued_runs_of_a_runtime_that_is_gone_end_when_their_slot_comes(false);
}

#[test]
fn queued_runs_of_a_runtime_that_is_gone_end_when_their_slot_comes_after_it_is_forgotten() {
    queued_runs_of_a_runtime_that_is_gone_end_when_their_slot_comes(true);
}

/// Notes, as it is dropped, how many of lane `a`'s runs had failed canceled.
struct Probe {
    set: LaneSet,
    seen: Arc<Mutex<Option<u64>>>,
}

impl Drop for Probe {
    fn drop(&mut self) {
        let canceled = self.set.snapshot().lanes[0].failed.canceled;
        *self.seen.lock().unwrap() = Some(canceled);
    }
}

/// A run dropped with its runtime lets go of its job before it is counted over: whatever the
/// job holds is gone by the time the run's end can be seen (a drive drops its callbacks before
/// the ticket that ends the run, driver invariant 3).
#[test]
fn a_run_dropped_with_its_runtime_drops_its_job_before_it_ends() {
    let set = common::one_lane("a", LaneLimits::new(1, 4)).build().unwrap();
    let second = current_thread();
    // The slot, held by a run of another runtime, which stays.
    let holder = {
        let _entered = second.enter();
        set.run("a", forever()).unwrap()
    };
    let seen = Arc::new(Mutex::new(None));
    let first = current_thread();
    first.block_on(async {
        let probe = Probe { set: set.clone(), seen: seen.clone() };
        let job = move |_cx: RunContext| {
            let _probe = &probe;
            async { Ok::<u32, BoxError>(1) }
        };
        // A deadline: it waits for its slot in a task of its own, which the runtime drops.
        set.spawn("a", Run::new(job).queue_timeout(Duration::from_secs(3600))).unwrap();
        tokio::task::yield_now().await;
    });
    drop(first);
    assert_eq!(*seen.lock().unwrap(), Some(0), "the job went before its run was counted over");
    let lane = &set.snapshot().lanes[0];
    assert_eq!((lane.failed.canceled, lane.owned), (1, 1), "{lane:?}");
    drop((holder, second));
    assert_quiescent(&set);
}
