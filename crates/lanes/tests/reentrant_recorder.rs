//! A `metrics` recorder is user code, and may call back into the primitive it counts for: to
//! read a snapshot beside a count, say. Each primitive calls it without holding its own locks,
//! so such a recorder neither deadlocks (a std mutex), spins for good (the channel's and the
//! pool's spin locks) nor panics (a borrowed thread-local cache). A `Channels` registry builds
//! a new channel, registering its handles with the recorder, before it takes its map's lock. A
//! waker is user code too: a limit's table wakes its waiters after its lock.
//!
//! Each scenario runs on a thread of its own ([`ends_in_time`]): before its fix, each of them
//! hung (or, for the check by name, panicked).

mod common;

use std::sync::{Arc, Weak};
use std::time::Duration;

use common::{CallsBack, Hook, Named, ends_in_time};
use lanes::channel::{Channel, ChannelConfig, Channels, ConsumerOptions};
use lanes::limit::KeyedLimit;
use lanes::pool::Dispatcher;
use lanes::spill::{SpillOptions, SpillQueue, SyncPolicy};
use lanes::{LaneLimits, LimitSpec, Limits, Priority, Run};

/// The answer of a future that is ready at its first poll (a check of a local limit).
fn at_once<F: std::future::Future>(future: F) -> F::Output {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match std::pin::pin!(future).poll(&mut cx) {
        std::task::Poll::Ready(answer) => answer,
        std::task::Poll::Pending => panic!("a local check answers at once"),
    }
}

/// A recorder that runs its action whenever a primitive resolves (registers) a handle, and
/// hands out handles that do nothing.
struct OnRegister(Box<dyn Fn() + Send + Sync>);

impl OnRegister {
    fn new(act: impl Fn() + Send + Sync + 'static) -> Self {
        Self(Box::new(act))
    }

    /// Runs `act` at the next handle registered, once.
    fn once(act: impl FnOnce() + Send + 'static) -> Self {
        let act = std::sync::Mutex::new(Some(act));
        Self::new(move || {
            let act = act.lock().unwrap().take();
            if let Some(act) = act {
                act();
            }
        })
    }
}

impl metrics::Recorder for OnRegister {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        (self.0)();
        metrics::Counter::noop()
    }
    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        (self.0)();
        metrics::Gauge::noop()
    }
    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        (self.0)();
        metrics::Histogram::noop()
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap()
}

/// A producer that blocks on a full channel is counted (`blocked_waits`) after the channel's
/// lock: a recorder that reads the channel's snapshot then finds it free.
#[test]
fn a_blocked_producer_is_counted_out_of_the_channels_lock() {
    ends_in_time("a blocked emit", || {
        let hook = Hook::default();
        let recorder = Named::all(&hook, &["lanes_channel_blocked_waits_total"], &[]);
        let channel = metrics::with_local_recorder(&recorder, || {
            Channel::new(ChannelConfig::new(1)).expect("a valid channel")
        });
        let seen = channel.clone();
        hook.set(move || drop(seen.snapshot()));
        hook.switch(true);
        runtime().block_on(async {
            let mut consumer = channel.consumer(ConsumerOptions::new()).unwrap();
            channel.emit(1).await.unwrap();
            let producer = channel.clone();
            let blocked = tokio::spawn(async move { producer.emit(2).await });
            tokio::task::yield_now().await;
            assert_eq!(consumer.recv().await, Some(1));
            blocked.await.unwrap().unwrap();
            assert_eq!(consumer.recv().await, Some(2));
        });
        assert_eq!(hook.calls(), 1, "the blocked emit was counted once");
        assert_eq!(channel.snapshot().blocked_waits, 1);
    });
}

/// The same through a shared budget: a producer that waits for one of the registry's units is
/// counted after the channel's lock.
#[test]
fn a_producer_blocked_on_a_shared_budget_is_counted_out_of_the_channels_lock() {
    ends_in_time("an emit blocked on the budget", || {
        let hook = Hook::default();
        let recorder = Named::all(&hook, &["lanes_channel_blocked_waits_total"], &[]);
        let channels = Channels::with_budget(1).expect("a valid budget");
        let channel = metrics::with_local_recorder(&recorder, || {
            channels.create::<u32>("budgeted", ChannelConfig::new(4)).expect("a new channel")
        });
        let seen = channel.clone();
        hook.set(move || drop(seen.snapshot()));
        hook.switch(true);
        runtime().block_on(async {
            let mut consumer = channel.consumer(ConsumerOptions::new()).unwrap();
            channel.emit(1).await.unwrap();
            let producer = channel.clone();
            let blocked = tokio::spawn(async move { producer.emit(2).await });
            tokio::task::yield_now().await;
            assert_eq!(channels.budget_used(), Some(1), "the second record waits for a unit");
            assert_eq!(consumer.recv().await, Some(1));
            blocked.await.unwrap().unwrap();
            assert_eq!(consumer.recv().await, Some(2));
        });
        assert_eq!(hook.calls(), 1, "the blocked emit was counted once");
    });
}

/// A run lane moves its gauges after its locks, as a run takes the free slot, waits in the
/// queue, waits in the inbox (admitted while the slot is taken, outside the lane's lock),
/// leaves the queue at its deadline or when its handle is dropped, waits for a limit's permit
/// and gets it or is dropped meanwhile, is failed by the lane's close, and as each run ends: a
/// recorder that reads the set's snapshot (the lane's lock and the inbox's) finds them free.
#[test]
fn a_lane_moves_its_gauges_out_of_its_locks() {
    ends_in_time("a lane's admissions and releases", || {
        let hook = Hook::default();
        let counters = [
            "lanes_lane_admitted_total",
            "lanes_lane_rejected_total",
            "lanes_lane_timed_out_total",
            "lanes_lane_finished_total",
        ];
        let recorder = Named::all(&hook, &counters, &["lanes_lane_executing", "lanes_lane_queued"]);
        let set = metrics::with_local_recorder(&recorder, || {
            common::one_lane("a", LaneLimits::new(1, 4)).build().expect("a valid set")
        });
        let seen = set.clone();
        hook.set(move || drop(seen.snapshot()));
        hook.switch(true);
        let quick = || Run::new(|_cx| async { Ok(true) });
        runtime().block_on(async {
            // Held in the slot until `release` gets a permit.
            let release = Arc::new(tokio::sync::Semaphore::new(0));
            let holding = |release: &Arc<tokio::sync::Semaphore>| {
                let held = release.clone();
                Run::new(move |_cx| async move { Ok(held.acquire().await.is_ok()) })
            };
            let holder = set.run("a", holding(&release)).expect("admitted into the free slot");
            tokio::task::yield_now().await;
            let queued = set.run("a", quick()).expect("queued");
            let late = quick().queue_timeout(Duration::from_secs(1));
            let late = set.run("a", late).expect("queued, with a deadline");
            let dropped = set.run("a", quick()).expect("queued, then dropped");
            set.spawn("a", quick()).expect("admitted into the inbox");
            drop(dropped);
            assert!(late.await.is_err(), "it left the queue at its deadline");
            release.add_permits(1);
            assert!(holder.await.expect("the holder ran"));
            assert!(queued.await.expect("the queued run ran"));

            // Runs that wait for a limit's permit first.
            let limits = Limits::new();
            limits.define("l", LimitSpec::concurrent(1)).await.unwrap();
            let permit = limits.acquire("l", Priority::default()).await.unwrap();
            let limited = quick().limit(&limits, "l", Priority::default());
            let limited = set.run("a", limited).expect("admitted, waiting for its permit");
            let gone = quick().limit(&limits, "l", Priority::default());
            let gone = set.run("a", gone).expect("admitted, waiting for its permit");
            tokio::task::yield_now().await;
            drop(gone);
            drop(permit);
            assert!(limited.await.expect("the limited run ran"));

            // The close fails the queued run.
            let holder = set.run("a", holding(&release)).expect("admitted into the free slot");
            tokio::task::yield_now().await;
            let shut = set.run("a", quick()).expect("queued");
            set.close();
            assert!(shut.await.is_err(), "the close failed it");
            release.add_permits(1);
            assert!(holder.await.expect("the holder ran"));
            while set.snapshot().owned > 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        });
        let lane = &set.snapshot().lanes[0];
        let failed = (lane.failed.canceled, lane.failed.timeout, lane.failed.closed);
        assert_eq!((lane.admitted, lane.completed, failed), (9, 5, (2, 1, 1)), "{lane:?}");
        assert!(hook.calls() >= 20, "every move was made: {}", hook.calls());
    });
}

/// A producer that was handed a slot of a full channel but finds the shared budget spent hands
/// the slot on to the next producer in line and waits for a unit: it wakes that producer after
/// the channel's lock, so a waker (user code) that reads the channel's snapshot finds it free.
/// (Before, the wake was made under the lock, and spun there for good.)
#[test]
fn a_slot_handed_on_wakes_its_producer_out_of_the_channels_lock() {
    use std::task::{Context, Waker};
    ends_in_time("a slot handed on for want of a budget unit", || {
        runtime().block_on(async {
            let channels = Channels::with_budget(1).expect("a valid budget");
            let full = channels.create::<u32>("full", ChannelConfig::new(1)).unwrap();
            let other = channels.create::<u32>("other", ChannelConfig::new(4)).unwrap();
            let mut reader = full.consumer(ConsumerOptions::new()).unwrap();
            full.emit(1).await.unwrap();
            let plain = &mut Context::from_waker(Waker::noop());
            let mut first = std::pin::pin!(full.emit(2));
            assert!(first.as_mut().poll(plain).is_pending(), "the channel is full");
            let seen = full.clone();
            let (woken, snapshots) = CallsBack::waker(move || drop(seen.snapshot()));
            let mut second = std::pin::pin!(full.emit(3));
            let reads = &mut Context::from_waker(&snapshots);
            assert!(second.as_mut().poll(reads).is_pending(), "behind the first in line");
            // The read hands its slot to the first producer, and its unit goes back...
            assert_eq!(reader.recv().await, Some(1));
            // ... which another channel takes.
            other.emit(10).await.unwrap();
            assert!(first.as_mut().poll(plain).is_pending(), "it waits for a unit now");
            assert_eq!(woken.wakes(), 1, "the slot was handed on to the second producer");
            // The second producer has the slot, and no unit either.
            assert!(second.as_mut().poll(reads).is_pending());
            assert_eq!(channels.budget_used(), Some(1));
        });
    });
}

/// A lane's close cancels its executing runs after the lane's lock: a task awaiting a run's
/// `cancelled()` whose waker (user code) reads the set's snapshot finds the lock free.
/// (Before, the cancel woke it under the lock, and it spun there for good.)
#[test]
fn a_lanes_close_cancels_its_runs_out_of_its_lock() {
    use std::task::{Context, Poll};
    ends_in_time("a run cancelled by the close", || {
        let set = common::one_lane("a", LaneLimits::new(1, 1)).build().expect("a valid set");
        runtime().block_on(async {
            let (context, contexts) = tokio::sync::oneshot::channel();
            let run = Run::new(move |cx| async move {
                let _ = context.send(cx.clone());
                Ok(cx.cancelled().await)
            });
            let run = set.run("a", run).expect("admitted into the free slot");
            let cx = contexts.await.expect("the run started");
            let seen = set.clone();
            let (woken, waker) = CallsBack::waker(move || drop(seen.snapshot()));
            let reads = &mut Context::from_waker(&waker);
            let mut cancelled = std::pin::pin!(cx.cancelled());
            assert!(cancelled.as_mut().poll(reads).is_pending(), "the run executes");
            set.close();
            assert_eq!(woken.wakes(), 1, "woken by the close");
            assert!(matches!(cancelled.as_mut().poll(reads), Poll::Ready(_)));
            let _ = run.await;
        });
        assert_eq!(set.snapshot().owned, 0);
    });
}

/// A keyed limit counts a new key, a permit, a caller in the key's line, a full line's
/// refusal, a hand-over and a return after its shard's lock, and so does its rate's wait: a
/// recorder that reads the limit's `info` (every shard's lock) finds them free.
#[test]
fn a_keyed_limit_counts_out_of_its_shards_lock() {
    ends_in_time("a keyed limit's acquires, line and returns", || {
        let hook = Hook::default();
        let recorder = Named::all(
            &hook,
            &[
                "lanes_limit_keyed_acquired_total",
                "lanes_limit_keyed_refused_total",
                "lanes_limit_keyed_timed_out_total",
            ],
            &["lanes_limit_keyed_held", "lanes_limit_keyed_waiters", "lanes_limit_keyed_keys"],
        );
        let (room, rate) = metrics::with_local_recorder(&recorder, || {
            let room = KeyedLimit::builder("room", LimitSpec::concurrent(1)).max_waiters(1);
            let rate = KeyedLimit::new("rate", LimitSpec::rate(1.0).burst(1));
            (room.build().expect("a valid limit"), rate.expect("a valid limit"))
        });
        let seen = (room.clone(), rate.clone());
        hook.set(move || drop((seen.0.info(), seen.1.info())));
        hook.switch(true);
        runtime().block_on(async {
            let first = room.acquire("a").await.expect("a permit at once");
            let line = room.clone();
            let second = tokio::spawn(async move { line.acquire("a").await.map(drop) });
            tokio::task::yield_now().await;
            assert_eq!(room.info().waiting, 1, "the second caller is in the key's line");
            let full = room.acquire("a").await;
            assert!(full.is_err(), "the line holds one caller");
            drop(first);
            second.await.unwrap().expect("handed the first permit");

            drop(rate.acquire("a").await.expect("the burst's token"));
            // The next token is a second away: the caller sleeps for it (paused time).
            drop(rate.acquire("a").await.expect("the next token"));
        });
        let (room, rate) = (room.info(), rate.info());
        assert_eq!((room.held, room.waiting, rate.held, rate.waiting), (0, 0, 0, 0));
        assert!(hook.calls() >= 8, "every step was counted: {}", hook.calls());
    });
}

/// A pool counts a finished item after its lock: a recorder that reads its stats finds it free.
#[test]
fn a_pool_counts_a_finished_item_out_of_its_lock() {
    ends_in_time("a dispatcher's items", || {
        let hook = Hook::default();
        let recorder = Named::all(&hook, &["lanes_pool_completed_total"], &[]);
        let runtime = runtime();
        let _in = runtime.enter();
        let dispatcher = Arc::new(metrics::with_local_recorder(&recorder, || {
            Dispatcher::builder()
                .workers(2)
                .queue_size(16)
                .build(|_: u32| async { Ok::<_, std::io::Error>(()) })
                .expect("a valid dispatcher")
        }));
        let seen: Weak<Dispatcher<u32>> = Arc::downgrade(&dispatcher);
        hook.set(move || {
            if let Some(dispatcher) = seen.upgrade() {
                let _ = dispatcher.stats();
            }
        });
        hook.switch(true);
        runtime.block_on(async {
            for n in 0..10 {
                dispatcher.submit(n).expect("room for every item");
            }
            dispatcher.stop(Duration::from_secs(10)).await.expect("every worker ends");
        });
        assert_eq!(hook.calls(), 10, "every item was counted");
        assert_eq!(dispatcher.stats().completed, 10);
    });
}

/// The pool's workers count a finished item after the engine's lock, and each counts itself
/// out of the pool only after: a caller of `stop`, on another thread, finds every outcome
/// counted when it returns, however slow the recorder.
#[test]
fn a_pool_stop_finds_every_outcome_counted() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    ends_in_time("a dispatcher's stop", || {
        let hook = Hook::default();
        let recorder = Named::all(&hook, &["lanes_pool_completed_total"], &[]);
        let landed = Arc::new(AtomicUsize::new(0));
        let counted = landed.clone();
        hook.set(move || {
            std::thread::sleep(Duration::from_millis(2));
            counted.fetch_add(1, Ordering::SeqCst);
        });
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let _in = runtime.enter();
        let dispatcher = metrics::with_local_recorder(&recorder, || {
            Dispatcher::builder()
                .workers(4)
                .queue_size(64)
                .build(|_: u32| async { Ok::<_, std::io::Error>(()) })
                .expect("a valid dispatcher")
        });
        hook.switch(true);
        runtime.block_on(async {
            for n in 0..40 {
                dispatcher.submit(n).expect("room for every item");
            }
            dispatcher.stop(Duration::from_secs(10)).await.expect("every worker ends");
            assert_eq!(landed.load(Ordering::SeqCst), 40, "every outcome counted by the stop");
        });
    });
}

/// A spill reader's commit sets the unacknowledged bytes after the queue's lock: a recorder
/// that reads the queue's length finds it free.
#[test]
fn a_spill_commit_is_counted_out_of_the_queues_lock() {
    let dir = std::env::temp_dir().join(format!("lanes-reentrant-spill-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let path = dir.clone();
    ends_in_time("a spill reader's commit", move || {
        let hook = Hook::default();
        let recorder = Named::all(&hook, &[], &["lanes_spill_unacked_bytes"]);
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let options = SpillOptions::default().sync(SyncPolicy::Always);
        metrics::with_local_recorder(&recorder, || {
            runtime.block_on(async {
                let (queue, _) = SpillQueue::open(&path, options).await.unwrap();
                let seen = queue.clone();
                hook.set(move || {
                    let _ = seen.len();
                });
                for i in 0..10u8 {
                    queue.append([i]).await.unwrap();
                }
                let mut reader = queue.reader().unwrap();
                let read = reader.next_batch(10).await.unwrap();
                hook.switch(true);
                reader.commit(read[4].position()).await.expect("committed");
                hook.switch(false);
                assert_eq!(queue.len(), 5);
                queue.close().await.unwrap();
            });
        });
        assert_eq!(hook.calls(), 1, "the commit set the gauge once");
    });
    let _ = std::fs::remove_dir_all(&dir);
}

/// A waiter at another priority waits in the limit's table; a returned permit grants it there
/// and wakes it after the table's lock: a waker (user code) that reads the limit's info finds
/// the lock free. (Before, the table woke it under its lock, and it deadlocked.)
#[test]
fn a_limits_table_wakes_its_waiters_out_of_its_lock() {
    ends_in_time("a wake from the limit's table", || {
        runtime().block_on(async {
            let limits = Limits::new();
            limits.define("l", LimitSpec::concurrent(1)).await.unwrap();
            let held = limits.acquire("l", Priority::default()).await.unwrap();
            let seen = limits.clone();
            let (woken, waker) = CallsBack::waker(move || {
                let info = at_once(seen.info("l")).expect("the limit's info");
                assert!(info.is_some(), "the limit is defined");
            });
            let mut cx = std::task::Context::from_waker(&waker);
            let mut waiting = std::pin::pin!(limits.acquire("l", Priority::level(1)));
            assert!(waiting.as_mut().poll(&mut cx).is_pending(), "the one permit is held");
            drop(held);
            assert_eq!(woken.wakes(), 1, "granted and woken");
            match waiting.as_mut().poll(&mut cx) {
                std::task::Poll::Ready(permit) => drop(permit.expect("granted the permit")),
                std::task::Poll::Pending => panic!("the returned permit went to the waiter"),
            }
            let info = limits.info("l").await.unwrap().expect("defined");
            assert_eq!((info.in_use, info.waiting, info.granted_total), (0, 0, 2), "{info:?}");
        });
    });
}

/// A check by name whose count (user code) checks another name that this thread has not
/// looked up lately: the thread's cache of slots is lent to the first check, so the second
/// answers from the map and keeps nothing. (Before, it took the cache again and panicked.)
#[test]
fn a_check_by_name_whose_count_checks_another_name() {
    ends_in_time("a check by name inside a check's count", || {
        let hook = Hook::default();
        let recorder = Named::all(&hook, &["lanes_limit_acquired_total"], &[]);
        runtime().block_on(async {
            let limits = Limits::new();
            limits.define("counted", LimitSpec::rate(1e9)).await.unwrap();
            limits.define("other", LimitSpec::rate(1e9)).await.unwrap();
            // The counted limit's handles are resolved with this recorder; the other's, later,
            // with none (so the hook does not call itself).
            metrics::with_local_recorder(&recorder, || {
                for _ in 0..3 {
                    at_once(limits.check("counted")).expect("a token");
                }
            });
            let other = limits.clone();
            hook.set(move || {
                at_once(other.check("other")).expect("a token of the other limit");
            });
            hook.switch(true);
            for _ in 0..3 {
                at_once(limits.check("counted")).expect("a token");
            }
        });
        assert_eq!(hook.calls(), 3, "each check was counted");
    });
}

/// A registry builds a new channel, whose metrics are resolved then, out of its map's lock: a
/// recorder that lists the registry's channels as a handle is registered finds it free.
#[test]
fn a_registry_resolves_a_new_channels_metrics_out_of_its_lock() {
    ends_in_time("a channel's metrics resolved by its registry", || {
        let hook = Hook::default();
        let registry = Channels::new();
        let listed = Arc::new(std::sync::Mutex::new(Vec::new()));
        {
            let (registry, listed) = (registry.clone(), Arc::clone(&listed));
            hook.set(move || listed.lock().unwrap().push(registry.names().len()));
        }
        hook.switch(true);
        let recorder = {
            let hook = hook.clone();
            OnRegister::new(move || hook.fire())
        };
        let channel = metrics::with_local_recorder(&recorder, || {
            registry.get_or_create::<u32>("events", ChannelConfig::new(4)).unwrap()
        });
        assert!(hook.calls() > 0, "the channel's handles were registered");
        assert!(listed.lock().unwrap().iter().all(|&n| n == 0), "listed before it was named");
        assert!(channel.try_emit(1).is_ok());
        assert_eq!(registry.names(), ["events"]);
    });
}

/// The name is taken while the registry builds a channel for it (here by the recorder, as a
/// racing caller would): the registry answers as if the name had been there first. `create`
/// is refused, `get_or_create` answers the channel that took the name, and a different
/// capacity or record type is an error.
#[test]
fn a_name_taken_while_its_channel_is_built_answers_the_channel_that_took_it() {
    use lanes::channel::ChannelError;
    ends_in_time("a name taken while its channel is built", || {
        let registry = Channels::new();
        let under = |act: Box<dyn FnOnce(&Channels) + Send>| {
            let registry = registry.clone();
            OnRegister::once(move || act(&registry))
        };
        let taking = |name: &'static str, capacity: usize| -> Box<dyn FnOnce(&Channels) + Send> {
            Box::new(move |registry: &Channels| {
                registry.create::<u32>(name, ChannelConfig::new(capacity)).unwrap();
            })
        };

        let refused = metrics::with_local_recorder(&under(taking("a", 4)), || {
            registry.create::<u32>("a", ChannelConfig::new(4))
        });
        assert!(matches!(refused, Err(ChannelError::Duplicate(_))), "{refused:?}");

        let found = metrics::with_local_recorder(&under(taking("b", 4)), || {
            registry.get_or_create::<u32>("b", ChannelConfig::new(4))
        });
        found.unwrap().try_emit(7).unwrap();
        assert_eq!(registry.get::<u32>("b").unwrap().len(), 1, "one channel named b");

        let mismatch = metrics::with_local_recorder(&under(taking("c", 8)), || {
            registry.get_or_create::<u32>("c", ChannelConfig::new(4))
        });
        assert!(
            matches!(mismatch, Err(ChannelError::ConfigMismatch { field: "capacity", .. })),
            "{mismatch:?}"
        );

        let other_type: Box<dyn FnOnce(&Channels) + Send> = Box::new(|registry: &Channels| {
            registry.create::<u64>("d", ChannelConfig::new(4)).unwrap();
        });
        let mistyped = metrics::with_local_recorder(&under(other_type), || {
            registry.get_or_create::<u32>("d", ChannelConfig::new(4))
        });
        assert!(matches!(mistyped, Err(ChannelError::TypeMismatch(_))), "{mistyped:?}");
        assert_eq!(registry.names(), ["a", "b", "c", "d"]);
    });
}
