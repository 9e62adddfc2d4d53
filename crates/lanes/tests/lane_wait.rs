//! Callers waiting for room in a run lane (`run_wait`, `spawn_wait`), against a model: a run
//! that ends hands its room to the caller that has waited longest, an admission that does not
//! wait never takes a room a waiter is owed, a caller that goes away passes its turn on, and
//! nothing is owned once every run ended.

mod common;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lanes::lane::{Finalize, Job};
use lanes::{AdmissionErrorKind, LaneLimits, LaneSet, Run};
use proptest::prelude::*;
use tokio::sync::{Semaphore, oneshot};
use tokio::task::JoinHandle;

type Res = Result<(), std::io::Error>;

#[derive(Debug, Clone)]
enum Op {
    /// A caller that does not wait (`spawn`).
    Direct,
    /// A caller that waits: `run_wait` (blocking) or `spawn_wait` (background).
    Wait { blocking: bool },
    /// The n-th caller still waiting goes away (its future is dropped).
    Leave(usize),
    /// The n-th executing run ends, and as it ends, before any waiter could run, `then`.
    End { at: usize, then: Then },
}

#[derive(Debug, Clone, Copy)]
enum Then {
    Nothing,
    /// A caller that does not wait tries to get in.
    Barge,
    /// The caller that has waited longest goes away, perhaps handed the room already.
    FirstLeaves,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => Just(Op::Direct),
        4 => any::<bool>().prop_map(|blocking| Op::Wait { blocking }),
        1 => (0usize..8).prop_map(Op::Leave),
        4 => (0usize..8, prop_oneof![Just(Then::Nothing), Just(Then::Barge), Just(Then::FirstLeaves)])
            .prop_map(|(at, then)| Op::End { at, then }),
    ]
}

/// What the lane should hold: the runs executing and queued, in grant order, and the callers
/// waiting for room, in the order they began.
#[derive(Debug, Default)]
struct Model {
    concurrent: usize,
    capacity: usize,
    executing: Vec<u32>,
    queued: VecDeque<u32>,
    waiting: VecDeque<u32>,
    /// The waiters let in, in order.
    granted: Vec<u32>,
}

impl Model {
    fn owned(&self) -> usize {
        self.executing.len() + self.queued.len()
    }

    fn admit(&mut self, tag: u32) {
        if self.executing.len() < self.concurrent {
            self.executing.push(tag);
        } else {
            self.queued.push_back(tag);
        }
    }

    /// Rooms go to the waiters, longest waiting first.
    fn settle(&mut self) {
        while self.owned() < self.capacity
            && let Some(first) = self.waiting.pop_front()
        {
            self.admit(first);
            self.granted.push(first);
        }
    }

    fn end(&mut self, at: usize) -> u32 {
        let ended = self.executing.remove(at);
        if let Some(next) = self.queued.pop_front() {
            self.executing.push(next);
        }
        self.settle();
        ended
    }
}

/// Each run's job records its start and waits for its own gate.
#[derive(Clone, Default)]
struct World {
    started: Arc<Mutex<Vec<u32>>>,
    admitted: Arc<Mutex<Vec<u32>>>,
    gates: Arc<Mutex<BTreeMap<u32, Arc<Semaphore>>>>,
    /// Told by a run's job as it returns.
    ending: Arc<Mutex<BTreeMap<u32, oneshot::Sender<()>>>>,
}

impl World {
    fn run(&self, tag: u32) -> Run<impl Job<Output = ()>> {
        let gate = Arc::new(Semaphore::new(0));
        self.gates.lock().unwrap().insert(tag, gate.clone());
        let (started, ending) = (self.started.clone(), self.ending.clone());
        Run::typed(move |_cx| async move {
            started.lock().unwrap().push(tag);
            let _ = gate.acquire().await;
            if let Some(tell) = ending.lock().unwrap().remove(&tag) {
                let _ = tell.send(());
            }
            Res::Ok(())
        })
    }

    fn open(&self, tag: u32) {
        self.gates.lock().unwrap()[&tag].add_permits(1);
    }
}

/// A set of one lane, "one", with these limits and lifecycle bounds that never fire here.
fn lane_one(concurrent: usize, queued: usize) -> LaneSet {
    common::one_lane("one", LaneLimits::new(concurrent, queued)).build().unwrap()
}

/// Lets every task that can run, run (time is paused: the sleep ends once all are idle).
async fn settle() {
    tokio::time::sleep(Duration::from_millis(1)).await;
}

async fn check(ops: Vec<Op>, concurrent: usize, queued: usize) -> Result<(), TestCaseError> {
    let lanes = lane_one(concurrent, queued);
    let world = World::default();
    let mut model = Model { concurrent, capacity: concurrent + queued, ..Model::default() };
    let mut waiters: BTreeMap<u32, JoinHandle<()>> = BTreeMap::new();
    let mut refused = 0;
    for (tag, op) in (0u32..).zip(ops) {
        match op {
            Op::Direct => {
                let answer = lanes.spawn("one", world.run(tag));
                if model.owned() < model.capacity {
                    prop_assert!(answer.is_ok(), "room was free");
                    model.admit(tag);
                } else {
                    prop_assert_eq!(
                        answer.map(|_| ()).unwrap_err().kind(),
                        AdmissionErrorKind::Full
                    );
                    refused += 1;
                }
            }
            Op::Wait { blocking } => {
                let (lanes, world2) = (lanes.clone(), world.clone());
                let run = world.run(tag);
                waiters.insert(
                    tag,
                    tokio::spawn(async move {
                        // Refused only once the set closes, at the end.
                        if blocking {
                            if let Ok(handle) = lanes.run_wait("one", run, None).await {
                                world2.admitted.lock().unwrap().push(tag);
                                let _ = handle.await;
                            }
                        } else if lanes.spawn_wait("one", run, None).await.is_ok() {
                            world2.admitted.lock().unwrap().push(tag);
                        }
                    }),
                );
                model.waiting.push_back(tag);
                model.settle();
            }
            Op::Leave(n) => {
                if model.waiting.is_empty() {
                    continue;
                }
                let gone = model.waiting.remove(n % model.waiting.len()).unwrap();
                waiters[&gone].abort();
            }
            Op::End { at, then } => {
                if model.executing.is_empty() {
                    continue;
                }
                let at = at % model.executing.len();
                let ending = |world: &World| {
                    let (tell, told) = oneshot::channel();
                    world.ending.lock().unwrap().insert(model.executing[at], tell);
                    told
                };
                let mut barger = None;
                match then {
                    Then::Nothing => {}
                    Then::Barge => {
                        let (told, lanes, run) = (ending(&world), lanes.clone(), world.run(tag));
                        barger = Some(tokio::spawn(async move {
                            told.await.unwrap();
                            lanes.spawn("one", run).map(|_| ()).map_err(|refused| refused.kind())
                        }));
                    }
                    Then::FirstLeaves => {
                        if let Some(first) = model.waiting.pop_front() {
                            let (told, leaving) = (ending(&world), waiters[&first].abort_handle());
                            tokio::spawn(async move {
                                told.await.unwrap();
                                leaving.abort();
                            });
                        }
                    }
                }
                let ended = model.end(at);
                world.open(ended);
                if let Some(barger) = barger {
                    let answer = barger.await.unwrap();
                    if model.owned() < model.capacity {
                        // Nobody waited: the room was free to take, or not yet given back
                        // when the caller came (the run's end continues after its job).
                        match answer {
                            Ok(()) => model.admit(tag),
                            Err(kind) => {
                                prop_assert_eq!(kind, AdmissionErrorKind::Full);
                                refused += 1;
                            }
                        }
                    } else {
                        prop_assert_eq!(
                            answer,
                            Err(AdmissionErrorKind::Full),
                            "took a waiter's room"
                        );
                        refused += 1;
                    }
                }
            }
        }
        settle().await;
        // Waiters were let in in the order they began, when the model says, each once.
        prop_assert_eq!(&*world.admitted.lock().unwrap(), &model.granted, "waiters let in");
        let started = world.started.lock().unwrap().clone();
        let mut once = started.clone();
        once.sort_unstable();
        once.dedup();
        prop_assert_eq!(once.len(), started.len(), "a run started twice");
        let mut executing: Vec<u32> =
            started.into_iter().filter(|tag| model.executing.contains(tag)).collect();
        executing.sort_unstable();
        let mut want = model.executing.clone();
        want.sort_unstable();
        prop_assert_eq!(executing, want, "runs executing");
        let snapshot = lanes.snapshot();
        prop_assert_eq!(snapshot.owned, model.owned());
        prop_assert!(snapshot.lanes[0].max_owned <= model.capacity);
        prop_assert_eq!(snapshot.lanes[0].rejected.full, refused);
    }
    // Everything ends: nothing stays owned, no room stays handed.
    lanes.close();
    let tags: Vec<u32> = world.gates.lock().unwrap().keys().copied().collect();
    for tag in tags {
        world.open(tag);
    }
    let drained = tokio::time::timeout(Duration::from_secs(60), lanes.drained()).await;
    prop_assert!(drained.is_ok(), "a room stayed owned after every run ended");
    prop_assert_eq!(lanes.snapshot().owned, 0);
    for (_, waiter) in waiters {
        waiter.abort();
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn waiting_callers_get_rooms_in_the_order_they_began(
        concurrent in 1usize..3,
        queued in 0usize..3,
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        runtime.block_on(check(ops, concurrent, queued))?;
    }
}

/// What the stress's runs did: which were admitted and started (by id), and counts.
#[derive(Default)]
struct Tally {
    admitted: Mutex<BTreeSet<u64>>,
    started: Mutex<BTreeSet<u64>>,
    started_twice: AtomicUsize,
    finalized: AtomicUsize,
    executing: AtomicUsize,
    max_executing: AtomicUsize,
}

/// A run that yields a few times while it counts itself executing, and whose finalizer counts.
fn counted(
    tally: &Arc<Tally>,
    id: u64,
    yields: u64,
) -> Run<impl Job<Output = ()>, impl Finalize<()>> {
    let (job_tally, final_tally) = (tally.clone(), tally.clone());
    Run::typed(move |_cx| async move {
        if !job_tally.started.lock().unwrap().insert(id) {
            job_tally.started_twice.fetch_add(1, Ordering::SeqCst);
        }
        let now = job_tally.executing.fetch_add(1, Ordering::SeqCst) + 1;
        job_tally.max_executing.fetch_max(now, Ordering::SeqCst);
        for _ in 0..yields {
            tokio::task::yield_now().await;
        }
        job_tally.executing.fetch_sub(1, Ordering::SeqCst);
        Res::Ok(())
    })
    .finalizer(move |_outcome| {
        final_tally.finalized.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Res::Ok(()))
    })
}

/// On two worker threads, callers that do not wait, that wait, that wait until a deadline and
/// that go away mid-wait, at random: the bounds hold throughout, every admitted run starts and
/// is finalized once, and at quiescence no room stays handed or owned: the lane takes exactly
/// its capacity again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_and_barging_callers_at_random_leave_nothing_owned() {
    const CLIENTS: u64 = 8;
    const ROUNDS: u64 = 400;
    let (concurrent, queued) = (2, 1);
    let lanes = lane_one(concurrent, queued);
    let tally = Arc::new(Tally::default());
    let clients: Vec<_> = (0..CLIENTS)
        .map(|client| {
            let (lanes, tally) = (lanes.clone(), tally.clone());
            tokio::spawn(async move {
                let mut seed = 0x9E37_79B9_7F4A_7C15 ^ (client + 1);
                for round in 0..ROUNDS {
                    let roll = common::xorshift(&mut seed);
                    let id = client << 32 | round;
                    let run = counted(&tally, id, roll % 5);
                    let admitted = match roll % 4 {
                        0 => lanes.spawn("one", run).is_ok(),
                        1 => match lanes.run_wait("one", run, None).await {
                            Ok(handle) => handle.await.is_ok(),
                            Err(refused) => panic!("a wait without deadline ended: {refused}"),
                        },
                        2 => {
                            let deadline = Instant::now() + Duration::from_micros(roll % 300);
                            lanes.spawn_wait("one", run, Some(deadline.into())).await.is_ok()
                        }
                        _ => {
                            // Goes away mid-wait, admitted or not.
                            let wait = lanes.spawn_wait("one", run, None);
                            let within = Duration::from_micros(roll % 200);
                            matches!(tokio::time::timeout(within, wait).await, Ok(Ok(_)))
                        }
                    };
                    if admitted {
                        tally.admitted.lock().unwrap().insert(id);
                    }
                }
            })
        })
        .collect();
    // A caller left waiting while the lane has room would never finish: fail, not hang.
    let all = async {
        for client in clients {
            client.await.unwrap();
        }
    };
    tokio::time::timeout(Duration::from_secs(120), all).await.expect("every caller finished");
    // Quiescence: the runs admitted end, and their finalizers run.
    let admitted = tally.admitted.lock().unwrap().len();
    let quiet = async {
        while lanes.snapshot().owned > 0 || tally.finalized.load(Ordering::SeqCst) < admitted {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), quiet).await.expect("every run ended");
    assert!(admitted > 0);
    assert_eq!(
        *tally.started.lock().unwrap(),
        *tally.admitted.lock().unwrap(),
        "exactly the admitted runs started"
    );
    assert_eq!(tally.started_twice.load(Ordering::SeqCst), 0, "no run started twice");
    assert_eq!(tally.finalized.load(Ordering::SeqCst), admitted, "each was finalized once");
    assert!(tally.max_executing.load(Ordering::SeqCst) <= concurrent);
    let lane = &lanes.snapshot().lanes[0];
    assert!(lane.max_owned <= concurrent + queued);
    assert_eq!(lane.owned, 0);
    // No room stayed handed: the lane takes its capacity, and no more.
    let hold = Arc::new(Semaphore::new(0));
    for _ in 0..concurrent + queued {
        let hold = hold.clone();
        let run = Run::typed(move |_cx| async move {
            let _ = hold.acquire().await;
            Res::Ok(())
        });
        assert!(lanes.spawn("one", run).is_ok(), "a room was lost");
    }
    let refused = lanes.spawn("one", Run::typed(|_cx| async { Res::Ok(()) })).unwrap_err();
    assert_eq!(refused.kind(), AdmissionErrorKind::Full);
    hold.add_permits(concurrent + queued);
    lanes.close();
    lanes.drained().await;
    assert_eq!(lanes.snapshot().owned, 0);
}

/// A caller handed a room whose future is never polled again does not hold the set's drain:
/// the room is no run, and the caller gives it back if it ever runs.
#[tokio::test(start_paused = true)]
async fn a_room_handed_to_a_caller_that_never_runs_does_not_hold_the_drain() {
    let lanes = lane_one(1, 0);
    let gate = Arc::new(Semaphore::new(0));
    let held = gate.clone();
    lanes
        .spawn(
            "one",
            Run::typed(move |_cx| async move {
                let _ = held.acquire().await;
                Res::Ok(())
            }),
        )
        .unwrap();
    let mut waiting =
        std::pin::pin!(lanes.spawn_wait("one", Run::typed(|_cx| async { Res::Ok(()) }), None));
    let waker = std::task::Waker::noop();
    assert!(waiting.as_mut().poll(&mut std::task::Context::from_waker(waker)).is_pending());
    // The run ends and hands its room to the caller, which is never polled again.
    gate.add_permits(1);
    settle().await;
    assert_eq!(lanes.snapshot().owned, 0, "a handed room is no run");
    lanes.close();
    let drained = tokio::time::timeout(Duration::from_secs(60), lanes.drained()).await;
    assert!(drained.is_ok(), "the drain waited for a caller that never runs");
    // If it runs after all, it finds the set closed and gives the room back.
    let refused = waiting.await.map(|_| ()).unwrap_err();
    assert_eq!(refused.kind(), AdmissionErrorKind::Closed);
    assert_eq!(lanes.snapshot().owned, 0);
}
