//! A metrics recorder whose `describe_*` panics, met by the first primitive built: the
//! descriptions are given once per process (a `std::sync::Once`), and a panic unwound out of it
//! would poison it, so that every primitive built after panicked too. Its own test binary: any
//! other test in a binary could be the first to build a primitive.

use std::time::Duration;

use lanes::{LaneLimits, LaneSet};
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};

/// A recorder whose descriptions panic; its handles do nothing.
struct PanicsOnDescribe;

impl Recorder for PanicsOnDescribe {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {
        panic!("the recorder's description panics");
    }
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {
        panic!("the recorder's description panics");
    }
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {
        panic!("the recorder's description panics");
    }
    fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
        Counter::noop()
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

fn build() -> LaneSet {
    let second = Duration::from_secs(1);
    let set = LaneSet::builder().lane("a", LaneLimits::new(1, 1)).audit_timeout(second);
    let set = set.finalization_timeout(second).worker_drain_timeout(second);
    set.build().expect("a valid set")
}

#[test]
fn a_recorder_whose_description_panics_does_not_stop_primitives_being_built() {
    let first = metrics::with_local_recorder(&PanicsOnDescribe, build);
    let second = build();
    assert_eq!(first.snapshot().lanes.len(), 1);
    assert_eq!(second.snapshot().lanes.len(), 1);
}
