//! A count many threads add to and few read: one cell per thread, so adding is a plain load
//! and store on a line no other thread writes.

use std::sync::atomic::{AtomicU64, Ordering};

use thread_local::ThreadLocal;

use super::Padded;

/// A count added to from any thread without a locked instruction or a shared cache line, and
/// read by summing every thread's cell.
///
/// An atomic `fetch_add` is a locked read-modify-write on a line every adding thread writes;
/// on a path that does little else (a lane refusing a run because it is full) it is most of
/// the path's cost, and under overload, when many threads add at once, the line moves between
/// their cores on each add. Here each thread writes only its own cell (padded to its own
/// lines), so an add is a load and a store. Reads are exact for every add that happened before
/// the read (each cell has one writer).
///
/// `thread_local::ThreadLocal` keeps the cells: a per-object, per-thread slot that can be
/// iterated, with its `unsafe` contained there (used by `tracing-subscriber` and `regex`).
/// A thread's cell lives as long as the tally, and a later thread that takes its id (ids are
/// reused as threads exit) adds to it. Memory is about half a KiB inline, plus cells for ids up
/// to the highest one that added, allocated in whole buckets of doubling size (256 bytes a
/// cell): a handful of KiB for a runtime's worker threads, 64-128 KiB once a thread with an id in
/// the hundreds has added. Adding from a thread-local's destructor, while the thread's own
/// thread-locals are torn down, may panic (the crate looks up the thread's id there).
#[derive(Default)]
pub(crate) struct Tally {
    cells: ThreadLocal<Padded<AtomicU64>>,
}

impl Tally {
    /// Adds one, from the calling thread's cell.
    #[inline]
    pub(crate) fn add_one(&self) {
        let cell = self.cells.get_or_default();
        // Only this thread writes this cell: a load and a store lose nothing.
        cell.store(cell.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
    }

    /// Every add that happened before this call.
    pub(crate) fn total(&self) -> u64 {
        self.cells.iter().fold(0u64, |sum, cell| sum.wrapping_add(cell.load(Ordering::Relaxed)))
    }
}

impl std::fmt::Debug for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Tally").field(&self.total()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tally_counts_every_add_from_every_thread() {
        let tally = std::sync::Arc::new(Tally::default());
        assert_eq!(tally.total(), 0);
        tally.add_one();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let tally = tally.clone();
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        tally.add_one();
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        assert_eq!(tally.total(), 40_001);
    }
}
