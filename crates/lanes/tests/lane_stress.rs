//! Randomized stress of run lanes: thousands of runs with random durations, errors, panics,
//! timeouts, dropped callers, audits and finalizers that wait, and a close in the middle, on
//! paused time. Invariants are checked at the end: every admitted run finalized exactly once,
//! bounds never exceeded, grants FIFO per lane, the caller saw what the finalizer saw, counters
//! reconcile.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lanes::{LaneLimits, LaneSet, Run, RunFailure, RunId};
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
