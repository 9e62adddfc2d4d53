//! What several of this crate's test files share.

#![allow(dead_code)] // each test binary uses part of this module

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use lanes::{LaneLimits, LaneSetBuilder};
use metrics::SharedString;

/// A builder of a set with one lane, `name`, of `limits`, and audit, finalization and drain
/// timeouts of a second: long enough never to fire in a test, short enough that a hang fails.
pub(crate) fn one_lane(name: &str, limits: LaneLimits) -> LaneSetBuilder {
    lanes::LaneSet::builder()
        .lane(name, limits)
        .audit_timeout(Duration::from_secs(1))
        .finalization_timeout(Duration::from_secs(1))
        .worker_drain_timeout(Duration::from_secs(1))
}

/// One step of a xorshift generator: the stress tests' cheap, seeded randomness.
pub(crate) fn xorshift(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

/// A metrics recorder that hands out the given handles by metric name, and no-op handles for
/// every other metric: for a test that watches (or breaks) a few of them.
#[derive(Default)]
pub(crate) struct Named {
    pub(crate) counters: Vec<(&'static str, metrics::Counter)>,
    pub(crate) gauges: Vec<(&'static str, metrics::Gauge)>,
}

impl Named {
    fn find<H: Clone>(handles: &[(&'static str, H)], key: &metrics::Key) -> Option<H> {
        let found = handles.iter().find(|(name, _)| *name == key.name());
        found.map(|(_, handle)| handle.clone())
    }
}

impl metrics::Recorder for Named {
    fn describe_counter(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: SharedString) {}
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        Self::find(&self.counters, key).unwrap_or_else(metrics::Counter::noop)
    }
    fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        Self::find(&self.gauges, key).unwrap_or_else(metrics::Gauge::noop)
    }
    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

/// A `metrics` counter or gauge that panics on every call while its switch is on:
/// a recorder written carelessly. (A [`Hook`] whose hook panics.)
#[derive(Clone)]
pub(crate) struct Breaking(Hook);

impl Default for Breaking {
    fn default() -> Self {
        let hook = Hook::default();
        hook.set(|| panic!("the recorder panics"));
        Self(hook)
    }
}

impl Breaking {
    pub(crate) fn switch(&self, on: bool) {
        self.0.switch(on);
    }

    pub(crate) fn panics(&self) -> usize {
        self.0.calls()
    }

    /// A recorder whose `counters` and `gauges` (by name) are all this one.
    pub(crate) fn recorder(&self, counters: &[&'static str], gauges: &[&'static str]) -> Named {
        Named::all(&self.0, counters, gauges)
    }

    /// A counter handle that is this one.
    pub(crate) fn counter(&self) -> metrics::Counter {
        metrics::Counter::from_arc(Arc::new(self.0.clone()))
    }
}

impl Named {
    /// A recorder whose `counters` and `gauges` (by name) are all `handle`.
    pub(crate) fn all<H>(handle: &H, counters: &[&'static str], gauges: &[&'static str]) -> Self
    where
        H: metrics::CounterFn + metrics::GaugeFn + Clone + Send + Sync + 'static,
    {
        let counter = |name| (name, metrics::Counter::from_arc(Arc::new(handle.clone())));
        let gauge = |name| (name, metrics::Gauge::from_arc(Arc::new(handle.clone())));
        Named {
            counters: counters.iter().copied().map(counter).collect(),
            gauges: gauges.iter().copied().map(gauge).collect(),
        }
    }
}

/// A `metrics` counter or gauge that runs its hook on every call while its switch is on: a
/// recorder that calls back into the library (say, to read a snapshot of what it counts).
#[derive(Clone, Default)]
pub(crate) struct Hook {
    hook: Arc<std::sync::OnceLock<Box<dyn Fn() + Send + Sync>>>,
    on: Arc<AtomicBool>,
    calls: Arc<AtomicUsize>,
}

impl Hook {
    /// Sets what every call runs (once: the hook usually needs the primitive made with it).
    pub(crate) fn set(&self, hook: impl Fn() + Send + Sync + 'static) {
        assert!(self.hook.set(Box::new(hook)).is_ok(), "the hook is set once");
    }

    pub(crate) fn switch(&self, on: bool) {
        self.on.store(on, Ordering::SeqCst);
    }

    /// Runs the hook as a call of a handle would (while the switch is on).
    pub(crate) fn fire(&self) {
        self.called();
    }

    /// How many calls ran the hook.
    pub(crate) fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    fn called(&self) {
        if self.on.load(Ordering::SeqCst)
            && let Some(hook) = self.hook.get()
        {
            self.calls.fetch_add(1, Ordering::SeqCst);
            hook();
        }
    }
}

impl metrics::CounterFn for Hook {
    fn increment(&self, _value: u64) {
        self.called();
    }
    fn absolute(&self, _value: u64) {}
}

impl metrics::GaugeFn for Hook {
    fn increment(&self, _value: f64) {
        self.called();
    }
    fn decrement(&self, _value: f64) {
        self.called();
    }
    fn set(&self, _value: f64) {
        self.called();
    }
}

/// A waker that calls back into the library when it is woken (user code: say, to read a
/// snapshot), and counts its wakes.
pub(crate) struct CallsBack {
    call: Box<dyn Fn() + Send + Sync>,
    wakes: AtomicUsize,
}

impl CallsBack {
    /// The waker, and a handle to count its wakes.
    pub(crate) fn waker(call: impl Fn() + Send + Sync + 'static) -> (Arc<Self>, std::task::Waker) {
        let woken = Arc::new(Self { call: Box::new(call), wakes: AtomicUsize::new(0) });
        (woken.clone(), std::task::Waker::from(woken))
    }

    /// How many times it was woken.
    pub(crate) fn wakes(&self) -> usize {
        self.wakes.load(Ordering::SeqCst)
    }
}

impl std::task::Wake for CallsBack {
    fn wake(self: Arc<Self>) {
        (self.call)();
        self.wakes.fetch_add(1, Ordering::SeqCst);
    }
}

/// Runs `scenario` on a thread of its own and fails if it has not ended within ten seconds: a
/// scenario that deadlocks (or spins for good on a lock its own thread holds) fails rather
/// than hangs. (A thread stuck so is left behind.)
pub(crate) fn ends_in_time(what: &str, scenario: impl FnOnce() + Send + 'static) {
    use std::sync::mpsc::RecvTimeoutError;
    let (done, ended) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        scenario();
        let _ = done.send(());
    });
    match ended.recv_timeout(Duration::from_secs(10)) {
        Ok(()) => {}
        Err(RecvTimeoutError::Timeout) => panic!("{what}: still running after 10 s (deadlocked)"),
        Err(RecvTimeoutError::Disconnected) => panic!("{what}: panicked"),
    }
}
