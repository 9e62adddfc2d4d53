//! Randomized stress of run lanes: thousands of runs with random durations, errors, panics,
//! timeouts, dropped callers, audits and finalizers that wait, and a close in the middle, on
//! paused time. Invariants are checked at the end: every admitted run finalized exactly once,
//! bounds never exceeded, grants FIFO per lane, the caller saw what the finalizer saw, counters
//! reconcile.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lanes::{LaneLimits, LaneSet, Run, RunFailure, RunId};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tokio::time::{Instant, sleep};

/// xorshift64*: deterministic, dependency-free.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Default)]
struct Record {
    /// Finalizer calls per run, with what the finalizer saw.
    finalized: BTreeMap<RunId, Vec<Result<RunId, RunFailure>>>,
    /// Job starts per lane, in the order the jobs were first polled, with the (paused) time.
    starts: BTreeMap<String, Vec<(RunId, Instant)>>,
    /// What blocking callers that waited to the end received.
    caller_saw: Vec<(RunId, Result<RunId, RunFailure>)>,
    admitted: BTreeMap<RunId, String>,
    rejected: usize,
}

#[derive(Clone, Copy)]
enum Ending {
    Ok,
    Error,
    Panic,
}

/// A runtime of two worker threads, for the tests that race a run's end across them.
fn two_workers() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_time().build().unwrap()
}

/// A set of these lanes, with timeouts long enough never to fire in a passing test.
fn lanes_of(lanes: &[(&str, LaneLimits)]) -> LaneSet {
    lanes
        .iter()
        .fold(LaneSet::builder(), |b, (name, l)| b.lane(*name, *l))
        .audit_timeout(Duration::from_secs(5))
        .finalization_timeout(Duration::from_secs(5))
        .worker_drain_timeout(Duration::from_secs(5))
        .build()
        .unwrap()
}

fn lanes_under_test() -> (LaneSet, Vec<(&'static str, LaneLimits)>) {
    let limits = vec![
        ("a", LaneLimits::new(2, 5)),
        ("b", LaneLimits::new(1, 3)),
        ("c", LaneLimits::new(3, 10)),
    ];
    let set = limits
        .iter()
        .fold(LaneSet::builder(), |b, (name, l)| b.lane(*name, *l))
        // Every third run's terminal audit waits: the queued run it granted its slot to must
        // not wait for it. (A start audit that waits would delay the job's start, and the
        // FIFO check below reads job starts.)
        .audit(|event: lanes::AuditEvent| async move {
            if event.kind != lanes::AuditKind::Started && event.run_id.get().is_multiple_of(3) {
                sleep(Duration::from_millis(event.run_id.get() % 7)).await;
            }
            Ok::<(), std::io::Error>(())
        })
        .audit_timeout(Duration::from_millis(50))
        .finalization_timeout(Duration::from_millis(200))
        .worker_drain_timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    (set, limits)
}

async fn stress(seed: u64, runs: usize) {
    let (set, limits) = lanes_under_test();
    let record = Arc::new(Mutex::new(Record::default()));
    let mut rng = Rng(seed);
    let close_at = runs / 2 + rng.below(runs as u64 / 4) as usize;
    let mut callers = Vec::new();
    for i in 0..runs {
        if i == close_at {
            set.close();
        }
        let (lane, _) = limits[rng.below(limits.len() as u64) as usize];
        let duration = Duration::from_millis(rng.below(40));
        let ending = match rng.below(10) {
            0 => Ending::Error,
            1 => Ending::Panic,
            _ => Ending::Ok,
        };
        let job = {
            let record = record.clone();
            move |cx: lanes::RunContext| async move {
                record
                    .lock()
                    .unwrap()
                    .starts
                    .entry(cx.lane().to_owned())
                    .or_default()
                    .push((cx.run_id(), Instant::now()));
                tokio::select! {
                    _ = cx.cancelled() => return Err(std::io::Error::other("stopped")),
                    _ = sleep(duration) => {}
                }
                match ending {
                    Ending::Ok => Ok(cx.run_id()),
                    Ending::Error => Err(std::io::Error::other("failed")),
                    Ending::Panic => panic!("job panicked"),
                }
            }
        };
        let finalizer_waits = (rng.below(4) == 0).then(|| Duration::from_millis(rng.below(20)));
        let finalizer = {
            let record = record.clone();
            move |outcome: Result<RunId, RunFailure>| async move {
                if let Some(wait) = finalizer_waits {
                    sleep(wait).await;
                }
                let id = match &outcome {
                    Ok(id) => *id,
                    Err(failure) => failure.run_id(),
                };
                record.lock().unwrap().finalized.entry(id).or_default().push(outcome.clone());
                outcome
            }
        };
        let mut run = Run::typed(job).finalizer(finalizer);
        if rng.below(5) == 0 {
            run = run.queue_timeout(Duration::from_millis(rng.below(60)));
        }
        if rng.below(5) == 0 {
            run = run.execution_timeout(Duration::from_millis(rng.below(40)));
        }
        if rng.below(2) == 0 {
            match set.spawn(lane, run) {
                Ok(id) => {
                    record.lock().unwrap().admitted.insert(id, lane.to_owned());
                }
                Err(_) => record.lock().unwrap().rejected += 1,
            }
        } else {
            match set.run(lane, run) {
                Ok(handle) => {
                    let id = handle.run_id();
                    record.lock().unwrap().admitted.insert(id, lane.to_owned());
                    let drop_after =
                        (rng.below(4) == 0).then(|| Duration::from_millis(rng.below(60)));
                    let record = record.clone();
                    callers.push(tokio::spawn(async move {
                        let result = match drop_after {
                            Some(after) => tokio::select! {
                                result = handle => result,
                                _ = sleep(after) => return,
                            },
                            None => handle.await,
                        };
                        record.lock().unwrap().caller_saw.push((id, result));
                    }));
                }
                Err(_) => record.lock().unwrap().rejected += 1,
            }
        }
        if rng.below(3) == 0 {
            sleep(Duration::from_millis(rng.below(10))).await;
        }
    }
    set.close();
    set.drained().await;
    for caller in callers {
        caller.await.unwrap();
    }

    let record = record.lock().unwrap();
    let snapshot = set.snapshot();
    assert_eq!(snapshot.owned, 0);
    // Every admitted run finalized exactly once; nothing else was finalized.
    assert!(record.admitted.len() > runs / 4, "the workload admitted too little to mean much");
    assert_eq!(
        record.finalized.keys().collect::<Vec<_>>(),
        record.admitted.keys().collect::<Vec<_>>(),
        "seed {seed}: finalized runs differ from admitted runs"
    );
    for (id, calls) in &record.finalized {
        assert_eq!(calls.len(), 1, "seed {seed}: {id} finalized {} times", calls.len());
    }
    // The caller received exactly what the finalizer saw.
    for (id, seen) in &record.caller_saw {
        match (&record.finalized[id][0], seen) {
            (Ok(a), Ok(b)) => assert_eq!(a, b),
            (Err(a), Err(b)) => assert!(RunFailure::ptr_eq(a, b), "seed {seed}: {id}"),
            (a, b) => panic!("seed {seed}: {id}: finalizer saw {a:?}, caller {b:?}"),
        }
    }
    // Bounds held, grants were FIFO, counters reconcile.
    let mut admitted_total = 0;
    for (lane, (name, limits)) in snapshot.lanes.iter().zip(&limits) {
        assert!(lane.max_executing <= limits.concurrent, "seed {seed}: {name} executing");
        assert!(lane.max_owned <= limits.capacity(), "seed {seed}: {name} owned");
        assert_eq!(lane.admitted, lane.completed + lane.failed.total(), "seed {seed}: {name}");
        let admitted_here = record.admitted.values().filter(|l| l == name).count() as u64;
        assert_eq!(lane.admitted, admitted_here);
        admitted_total += lane.admitted;
        // Grants are FIFO: a run admitted later never starts at an earlier instant. (Runs
        // granted at the same instant may be polled in any order by the runtime; with one
        // execution slot, the next grant needs the previous run to end, so order is strict.)
        let mut starts = record.starts.get(*name).cloned().unwrap_or_default();
        if limits.concurrent == 1 {
            assert!(starts.windows(2).all(|w| w[0].0 < w[1].0), "seed {seed}: {name} not FIFO");
        }
        starts.sort();
        assert!(starts.windows(2).all(|w| w[0].1 <= w[1].1), "seed {seed}: {name} not FIFO");
    }
    let rejected: u64 = snapshot.lanes.iter().map(|l| l.rejected.total()).sum();
    assert_eq!(rejected, record.rejected as u64);
    assert_eq!(admitted_total as usize, record.admitted.len());
    let failed: u64 = snapshot.lanes.iter().map(|l| l.failed.total()).sum();
    assert!(
        failed > 0 && rejected > 0,
        "seed {seed}: the workload should hit failures and overload"
    );
}

#[tokio::test(start_paused = true)]
async fn random_workloads_keep_every_invariant() {
    // The jobs panic on purpose; keep the output readable but show any other panic.
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info.payload_as_str() != Some("job panicked") {
            previous(info);
        }
    }));
    for seed in 1..=8u64 {
        stress(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15), 2_000).await;
    }
}

/// A queued run that gives up (its caller dropped its handle) while another thread grants it
/// the slot: the grant is decided under the lane lock and its latch set just after, so the run
/// may find it cannot withdraw before the latch is set. It must wait for the grant, give the
/// slot back and fail, never leave its run owned. Real threads and a real clock: the race is
/// between two cores. The queue is short, so that a run given up on is often its head.
#[test]
fn queued_runs_giving_up_while_granted_across_threads_keep_every_invariant() {
    const RUNS: u64 = 100_000;
    let runtime = two_workers();
    // Bounded as a whole: a run left owned fills the lane for good, and the producer would
    // retry forever.
    let bounded = async {
        let set = lanes_of(&[("one", LaneLimits::new(1, 4))]);
        let finalized = Arc::new(Mutex::new(BTreeMap::<RunId, usize>::new()));
        let (give_up, mut given_up) = tokio::sync::mpsc::unbounded_channel();
        // Drops every handle it gets, as soon as it gets it, on whichever thread it runs.
        let dropper = tokio::spawn(async move { while given_up.recv().await.is_some() {} });
        let producer = {
            let (set, finalized) = (set.clone(), finalized.clone());
            tokio::spawn(async move {
                let mut admitted = 0u64;
                while admitted < RUNS {
                    let finalized = finalized.clone();
                    let run = Run::typed(|cx: lanes::RunContext| {
                        std::future::ready(Ok::<RunId, std::io::Error>(cx.run_id()))
                    })
                    .finalizer(move |outcome: Result<RunId, RunFailure>| {
                        let id = match &outcome {
                            Ok(id) => *id,
                            Err(failure) => failure.run_id(),
                        };
                        *finalized.lock().unwrap().entry(id).or_default() += 1;
                        std::future::ready(outcome)
                    });
                    match set.run("one", run) {
                        Ok(handle) => {
                            admitted += 1;
                            give_up.send(handle).unwrap();
                        }
                        Err(_full) => tokio::task::yield_now().await,
                    }
                }
                admitted
            })
        };
        let admitted = producer.await.unwrap();
        dropper.await.unwrap();
        set.close();
        tokio::time::timeout(Duration::from_secs(30), set.drained())
            .await
            .expect("every admitted run ends: none was left owned");
        let snapshot = set.snapshot();
        let lane = &snapshot.lanes[0];
        assert_eq!(snapshot.owned, 0);
        assert_eq!(lane.admitted, admitted);
        assert_eq!(lane.admitted, lane.completed + lane.failed.total());
        assert!(lane.max_executing <= 1, "one slot, never two runs");
        assert!(lane.failed.canceled > 0, "the workload should give up on queued runs");
        let finalized = finalized.lock().unwrap();
        assert_eq!(finalized.len() as u64, admitted, "every admitted run was finalized");
        assert!(finalized.values().all(|calls| *calls == 1), "and each exactly once");
    };
    runtime.block_on(async {
        tokio::time::timeout(Duration::from_secs(120), bounded)
            .await
            .expect("the workload ends: no run was left owned")
    });
}

/// The set's owned count is the sum of its lanes': when the last runs of two lanes end at once
/// on two threads after a close, one of them must see the set drained and wake `drained`. The
/// jobs succeed before the close and the finalizers end together after it, so both runs give
/// their ownership back on the lock-free path, racing each other.
#[test]
fn the_last_runs_of_two_lanes_ending_at_once_drain_the_set() {
    let runtime = two_workers();
    runtime.block_on(async {
        for round in 0..500 {
            let set = lanes_of(&[("a", LaneLimits::new(1, 0)), ("b", LaneLimits::new(1, 0))]);
            let go = Arc::new(tokio::sync::Barrier::new(3));
            let finalizing = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            for lane in ["a", "b"] {
                let (go, finalizing) = (go.clone(), finalizing.clone());
                let run = Run::typed(|_cx| std::future::ready(Ok::<(), std::io::Error>(())))
                    .finalizer(move |outcome: Result<(), RunFailure>| async move {
                        finalizing.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        go.wait().await;
                        outcome
                    });
                set.spawn(lane, run).expect("an empty lane admits");
            }
            let ended = async {
                // Both jobs have succeeded once both finalizers have started.
                while finalizing.load(std::sync::atomic::Ordering::SeqCst) < 2 {
                    tokio::task::yield_now().await;
                }
                set.close();
                go.wait().await;
                set.drained().await;
            };
            tokio::time::timeout(Duration::from_secs(10), ended)
                .await
                .unwrap_or_else(|_| panic!("round {round}: the set never drained"));
            let snapshot = set.snapshot();
            assert_eq!(snapshot.owned, 0);
            let completed: u64 = snapshot.lanes.iter().map(|lane| lane.completed).sum();
            assert_eq!(completed, 2, "round {round}: both runs succeeded, after the close");
        }
    });
}

/// While every slot of a lane is taken, a queued background run is admitted into the lane's
/// inbox without the lane's lock, and taken into the queue when a slot is next given. Here
/// four tasks on two worker threads admit into lanes whose slots are freed and taken while
/// they do (blocking runs and runs with a queue timeout take the lane's lock among them), a
/// task reads snapshots throughout, and every other round closes the set part way. No run may
/// be stranded in the inbox (the set drains), each admitted run is finalized exactly once,
/// bounds hold at every snapshot, a lane of one slot starts its runs in their ids' order, and
/// the counts reconcile.
#[test]
fn admissions_from_many_threads_into_busy_lanes_keep_every_invariant() {
    const LANES: [(&str, usize, usize); 2] = [("one", 1, 40), ("few", 3, 120)];
    const SPAWNERS: u64 = 4;
    const PER_SPAWNER: u64 = 1_500;
    let mut started = 0;
    // The lanes' gauges are checked at quiescence: built under this recorder, their handles
    // record from any thread.
    let recorder = DebuggingRecorder::new();
    let snapshotter = &recorder.snapshotter();
    for round in 0..40u64 {
        let runtime = two_workers();
        let bounded = async move {
            let lanes: Vec<(&str, LaneLimits)> =
                LANES.iter().map(|(n, c, q)| (*n, LaneLimits::new(*c, *q))).collect();
            let set = lanes_of(&lanes);
            let finalized = Arc::new(Mutex::new(BTreeMap::<RunId, usize>::new()));
            let starts = Arc::new(Mutex::new(Vec::<RunId>::new()));
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let watcher = {
                let (set, stop) = (set.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut looks = 0u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        for (lane, (_, concurrent, queued)) in
                            set.snapshot().lanes.iter().zip(LANES)
                        {
                            assert!(lane.executing <= concurrent, "round {round}: executing");
                            assert!(lane.owned <= concurrent + queued, "round {round}: owned");
                            assert!(lane.executing + lane.queued <= lane.owned, "round {round}");
                        }
                        looks += 1;
                        tokio::task::yield_now().await;
                    }
                    looks
                })
            };
            let spawners: Vec<_> = (0..SPAWNERS)
                .map(|spawner| {
                    let (set, finalized, starts) = (set.clone(), finalized.clone(), starts.clone());
                    tokio::spawn(async move {
                        let seed =
                            (round * SPAWNERS + spawner + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                        let mut rng = Rng(seed);
                        let mut admitted = Vec::new();
                        let mut refused = 0u64;
                        let mut callers = Vec::new();
                        for i in 0..PER_SPAWNER {
                            if round % 2 == 1 && spawner == 0 && i == PER_SPAWNER / 2 {
                                set.close();
                            }
                            let lane = LANES[rng.below(2) as usize].0;
                            let yields = rng.below(3);
                            let (finalized, starts) = (finalized.clone(), starts.clone());
                            let mut run = Run::typed(move |cx: lanes::RunContext| async move {
                                if cx.lane() == "one" {
                                    starts.lock().unwrap().push(cx.run_id());
                                }
                                for _ in 0..yields {
                                    tokio::task::yield_now().await;
                                }
                                Ok::<RunId, std::io::Error>(cx.run_id())
                            })
                            .finalizer(
                                move |outcome: Result<RunId, RunFailure>| {
                                    let id = match &outcome {
                                        Ok(id) => *id,
                                        Err(failure) => failure.run_id(),
                                    };
                                    *finalized.lock().unwrap().entry(id).or_default() += 1;
                                    std::future::ready(outcome)
                                },
                            );
                            if rng.below(8) == 0 {
                                run = run.queue_timeout(Duration::from_millis(rng.below(3)));
                            }
                            let admission = if rng.below(8) == 0 {
                                set.run(lane, run).map(|handle| {
                                    let id = handle.run_id();
                                    callers.push(tokio::spawn(handle));
                                    id
                                })
                            } else {
                                set.spawn(lane, run)
                            };
                            match admission {
                                Ok(id) => admitted.push(id),
                                Err(_) => refused += 1,
                            }
                            if rng.below(16) == 0 {
                                tokio::task::yield_now().await;
                            }
                        }
                        for caller in callers {
                            let _ = caller.await.unwrap();
                        }
                        (admitted, refused)
                    })
                })
                .collect();
            let (mut admitted, mut refused) = (Vec::new(), 0u64);
            for spawner in spawners {
                let (ids, refusals) = spawner.await.unwrap();
                admitted.extend(ids);
                refused += refusals;
            }
            if round % 2 == 0 {
                // Not closed: every admitted run runs, none waits on in an inbox or a queue
                // with a slot free (a close would fail such a run, and hide it).
                let idle = async {
                    while set.snapshot().owned > 0 {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                };
                tokio::time::timeout(Duration::from_secs(10), idle)
                    .await
                    .unwrap_or_else(|_| panic!("round {round}: a run waits with a slot free"));
            }
            set.close();
            tokio::time::timeout(Duration::from_secs(30), set.drained())
                .await
                .unwrap_or_else(|_| panic!("round {round}: a run was left owned"));
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            assert!(watcher.await.unwrap() > 0, "the snapshots ran");

            let snapshot = set.snapshot();
            assert_eq!(snapshot.owned, 0);
            let finalized = finalized.lock().unwrap();
            admitted.sort();
            assert_eq!(
                finalized.keys().copied().collect::<Vec<_>>(),
                admitted,
                "round {round}: the finalized runs are the admitted ones"
            );
            assert!(finalized.values().all(|calls| *calls == 1), "round {round}: once each");
            // Nothing executes or waits, and the gauges say so: the `queued` one, which
            // admissions into an inbox move without the lane's lock, is back at zero. (A read
            // resets the recorder's gauges: each round's read covers that round.)
            let mut gauges = 0;
            for (key, _, _, value) in snapshotter.snapshot().into_vec() {
                let name = key.key().name();
                if name == "lanes_lane_queued" || name == "lanes_lane_executing" {
                    let labels: Vec<_> = key.key().labels().map(|l| l.value().to_owned()).collect();
                    assert_eq!(
                        value,
                        DebugValue::Gauge(0.0.into()),
                        "round {round}: {name} {labels:?}"
                    );
                    gauges += 1;
                }
            }
            assert_eq!(gauges, 2 * LANES.len(), "round {round}: every lane's two gauges");
            let (mut counted_in, mut counted_out) = (0, 0);
            for (lane, (name, concurrent, queued)) in snapshot.lanes.iter().zip(LANES) {
                assert!(lane.max_executing <= concurrent, "round {round}: {name} executing");
                assert!(lane.max_owned <= concurrent + queued, "round {round}: {name} owned");
                assert_eq!(lane.admitted, lane.completed + lane.failed.total(), "round {round}");
                counted_in += lane.admitted;
                counted_out += lane.rejected.total();
            }
            assert_eq!(counted_in, admitted.len() as u64, "round {round}: admissions counted");
            assert_eq!(counted_out, refused, "round {round}: refusals counted");
            if round % 2 == 0 {
                assert!(refused > 0, "round {round}: the workload should fill the lanes");
            }
            // One slot: a run starts only once the one before it ended, in the queue's order,
            // which is the order of the ids.
            let starts = starts.lock().unwrap();
            assert!(starts.windows(2).all(|w| w[0] < w[1]), "round {round}: not FIFO");
            starts.len()
        };
        started += metrics::with_local_recorder(&recorder, || {
            runtime.block_on(async {
                tokio::time::timeout(Duration::from_secs(120), bounded)
                    .await
                    .expect("the workload ends: no run was left owned")
            })
        });
    }
    // How many runs of the one-slot lane were checked for order, over all rounds: one round
    // may run few (its spawners meet the lane full), but the test means little if all do.
    assert!(started > 2_000, "the lane of one slot ran too few runs to check: {started}");
}

/// The race the inbox's admission must win: an admission reads the lane's one slot taken,
/// and before it has put its run in the inbox, the running run ends on a worker thread and
/// finds nothing to grant its slot to. The admission must then see the slot free and grant
/// it; else its run waits in the inbox for a grant nobody will make, and the lane's room runs
/// out for good. Admitting from a thread of its own, into a lane of one slot whose runs end at
/// once, puts admissions and releases side by side many times; the lane must keep admitting
/// and then go idle by itself, with no close to fail what waits. (Without the admission's
/// re-read of the slot it timed out, in stop 53.)
#[test]
fn a_run_admitted_as_the_last_slot_frees_is_not_stranded() {
    const RUNS: u64 = 200_000;
    let runtime = two_workers();
    let set = lanes_of(&[("one", LaneLimits::new(1, 2))]);
    let spawner = {
        let (set, handle) = (set.clone(), runtime.handle().clone());
        std::thread::spawn(move || {
            // In the runtime's context, not one of its workers: the runs execute on both.
            let _runtime = handle.enter();
            let mut admitted = 0u64;
            while admitted < RUNS {
                let run = Run::typed(|_cx| std::future::ready(Ok::<(), std::io::Error>(())));
                match set.spawn("one", run) {
                    Ok(_) => admitted += 1,
                    Err(_full) => std::thread::yield_now(),
                }
            }
        })
    };
    runtime.block_on(async {
        let admitting = async {
            while !spawner.is_finished() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(20), admitting)
            .await
            .expect("the lane keeps admitting: no run waits with its slot free");
        let idle = async {
            while set.snapshot().owned > 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), idle)
            .await
            .expect("every admitted run ran: none waits with the slot free");
    });
    spawner.join().unwrap();
    let lane = &set.snapshot().lanes[0];
    assert_eq!(lane.admitted, RUNS);
    assert_eq!(lane.completed, RUNS);
}

/// The bound holds across admissions that race for a lane's last places, whichever way each
/// goes in (the lane's lock, or the inbox once the slot reads taken). Four threads admit at
/// once into a lane of three places whose runs hold on until the close: exactly three are
/// admitted, every time. (Without the inbox's check of the bound it failed, in stop 53.)
#[test]
fn racing_admissions_never_exceed_the_bound() {
    const THREADS: usize = 4;
    let runtime = two_workers();
    let barrier = Arc::new(std::sync::Barrier::new(THREADS + 1));
    let slot: Arc<Mutex<Option<LaneSet>>> = Arc::new(Mutex::new(None));
    let (results, answers) = std::sync::mpsc::channel::<bool>();
    let threads: Vec<_> = (0..THREADS)
        .map(|_| {
            let (barrier, slot, results) = (barrier.clone(), slot.clone(), results.clone());
            let handle = runtime.handle().clone();
            std::thread::spawn(move || {
                let _runtime = handle.enter();
                loop {
                    barrier.wait();
                    let Some(set) = slot.lock().unwrap().clone() else { return };
                    let run = Run::typed(|cx: lanes::RunContext| async move {
                        cx.cancelled().await;
                        Ok::<(), std::io::Error>(())
                    });
                    results.send(set.spawn("one", run).is_ok()).unwrap();
                    barrier.wait();
                }
            })
        })
        .collect();
    for trial in 0..2_000 {
        let set = lanes_of(&[("one", LaneLimits::new(1, 2))]);
        *slot.lock().unwrap() = Some(set.clone());
        barrier.wait();
        barrier.wait();
        let admitted = answers.try_iter().take(THREADS).filter(|ok| *ok).count();
        assert_eq!(admitted, 3, "trial {trial}: three places, three runs");
        assert_eq!(set.snapshot().lanes[0].max_owned, 3, "trial {trial}");
        set.close();
        runtime.block_on(async {
            tokio::time::timeout(Duration::from_secs(10), set.drained()).await.expect("drains")
        });
    }
    *slot.lock().unwrap() = None;
    barrier.wait();
    threads.into_iter().for_each(|thread| thread.join().unwrap());
}
