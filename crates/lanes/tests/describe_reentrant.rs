//! A metrics recorder whose `describe_*` builds a primitive (user code calling back into the
//! library), met by the first primitive built: the descriptions are given once per process,
//! and the primitive built from inside them must not wait for them to end (inside a
//! `std::sync::Once`, it deadlocked). Its own test binary: any other test in a binary could be
//! the first to build a primitive.

mod common;

use std::sync::Mutex;

use lanes::channel::{Channel, ChannelConfig};
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};

/// A recorder that builds a channel at its first description, and keeps it.
#[derive(Default)]
struct BuildsOnDescribe {
    built: Mutex<Vec<Channel<u32>>>,
}

impl BuildsOnDescribe {
    fn described(&self) {
        let mut built = self.built.lock().unwrap();
        if built.is_empty() {
            built.push(Channel::new(ChannelConfig::new(4)).expect("a valid channel"));
        }
    }
}

impl Recorder for BuildsOnDescribe {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {
        self.described();
    }
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
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

#[test]
fn a_recorder_that_builds_a_primitive_while_it_takes_the_descriptions() {
    common::ends_in_time("a primitive built from a description", || {
        let recorder = BuildsOnDescribe::default();
        let first = metrics::with_local_recorder(&recorder, || {
            Channel::<u32>::new(ChannelConfig::new(4)).expect("a valid channel")
        });
        assert_eq!(recorder.built.lock().unwrap().len(), 1, "the recorder built its channel");
        assert!(first.try_emit(1).is_ok());
    });
}
