//! Shared helpers for the side-by-side benchmarks: criterion configuration (with a quick mode),
//! runtimes, a completion latch, and the calibration floor every suite starts with.

pub mod scenarios;

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use criterion::Criterion;
use tokio::sync::Notify;

/// Whether `LANES_BENCH_QUICK` asks for the quick mode (the whole suite in under 3 minutes).
pub fn quick() -> bool {
    std::env::var_os("LANES_BENCH_QUICK").is_some_and(|v| v != "0")
}

/// The criterion configuration of every suite.
pub fn config() -> Criterion {
    let c = Criterion::default().configure_from_args().without_plots();
    if quick() {
        c.sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(1))
    } else {
        c.sample_size(30)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(3))
    }
}

/// The two runtime shapes every async scenario runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// `current_thread`.
    CurrentThread,
    /// `multi_thread` with 2 workers (the machine has 2 cores).
    MultiThread,
}

impl Flavor {
    /// Both flavors.
    pub const ALL: [Flavor; 2] = [Flavor::CurrentThread, Flavor::MultiThread];

    /// A short name for benchmark ids.
    pub fn name(self) -> &'static str {
        match self {
            Flavor::CurrentThread => "current_thread",
            Flavor::MultiThread => "multi_thread_2",
        }
    }

    /// A runtime of this flavor.
    pub fn runtime(self) -> tokio::runtime::Runtime {
        match self {
            Flavor::CurrentThread => {
                tokio::runtime::Builder::new_current_thread().enable_all().build()
            }
            Flavor::MultiThread => {
                tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()
            }
        }
        .expect("runtime")
    }
}

/// Counts completions down and wakes the waiter at zero.
#[derive(Debug, Clone)]
pub struct Done {
    inner: Arc<(AtomicU64, Notify)>,
}

impl Done {
    /// A latch expecting `count` completions.
    pub fn new(count: u64) -> Self {
        Self { inner: Arc::new((AtomicU64::new(count), Notify::new())) }
    }

    /// Expects `count` more completions (between runs, when none is pending).
    pub fn reset(&self, count: u64) {
        self.inner.0.store(count, Ordering::Release);
    }

    /// One completion.
    pub fn finish_one(&self) {
        if self.inner.0.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.inner.1.notify_one();
        }
    }

    /// Waits for every completion.
    pub async fn wait(&self) {
        while self.inner.0.load(Ordering::Acquire) != 0 {
            self.inner.1.notified().await;
        }
    }
}

/// The calibration floor: an uncontended atomic compare-and-swap and a `std::sync::Mutex`
/// lock/unlock, on this host.
pub fn calibrate(c: &mut Criterion) {
    let mut group = c.benchmark_group("calibration");
    let atomic = AtomicU64::new(0);
    group.bench_function("atomic_cas", |b| {
        b.iter(|| {
            let current = atomic.load(Ordering::Relaxed);
            black_box(atomic.compare_exchange(
                current,
                current + 1,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ))
        })
    });
    let mutex = std::sync::Mutex::new(0u64);
    group.bench_function("mutex_lock_unlock", |b| {
        b.iter(|| {
            *black_box(&mutex).lock().unwrap() += 1;
        })
    });
    group.finish();
}

/// Resident memory of this process in bytes (from `/proc/self/statm`), 0 where unavailable.
pub fn rss_bytes() -> usize {
    let Ok(statm) = std::fs::read_to_string("/proc/self/statm") else {
        return 0;
    };
    let pages: usize = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
    pages * 4096
}

/// Where benchmarks leave results that are not times (correctness, memory) for the report.
pub fn results_dir() -> std::path::PathBuf {
    let workspace = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace");
    std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| workspace.join("target"), std::path::PathBuf::from)
        .join("lanes-bench")
}

/// Writes one named result as JSON into [`results_dir`].
pub fn write_result(name: &str, value: &serde_json::Value) {
    let dir = results_dir();
    std::fs::create_dir_all(&dir).expect("create the results directory");
    let text = serde_json::to_string_pretty(value).expect("serialize");
    std::fs::write(dir.join(format!("{name}.json")), text).expect("write a result");
}
