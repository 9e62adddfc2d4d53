//! A count many threads add to and few read: one cell per thread, so adding is a plain load
//! and store on a line no other thread writes.

use std::cell::Cell;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use super::{Padded, lock};

/// A count added to from any thread without a locked instruction or a shared cache line, and
/// read by summing every thread's cell.
///
/// An atomic `fetch_add` is a locked read-modify-write on a line every adding thread writes;
/// on a path that does little else (a lane refusing a run because it is full) it is most of
/// the path's cost, and under overload, when many threads add at once, the line moves between
/// their cores on each add. Here each thread writes only its own cell (padded to its own
/// lines), so an add is a load and a store. Reads are exact for every add that happened before
/// the read (each cell has one writer at a time).
///
/// A thread's cell is the one at its slot: a number the thread takes the first time it adds
/// to any tally (the lowest free one) and gives back when it exits, kept in a thread-local
/// that needs no destructor, so finding the cell is one thread-local load and a bounds check.
/// A tally has cells for twice the host's parallelism (at least 8, at most 256), 128 bytes
/// each: a runtime's workers and its blocking threads. A thread whose slot is past them (more
/// threads hold slots at once) adds to one shared atomic, as does a thread adding while it
/// exits, once it has given its slot back.
pub(crate) struct Tally {
    /// `cells[i]` is written only by the thread that holds slot `i`.
    cells: Box<[Padded<AtomicU64>]>,
    /// Adds from threads without a cell.
    shared: Padded<AtomicU64>,
}

impl Default for Tally {
    fn default() -> Self {
        // Asked once: on Linux the answer reads the affinity mask and the cgroup's quota.
        static CELLS: OnceLock<usize> = OnceLock::new();
        let cells = *CELLS.get_or_init(|| {
            let parallelism = std::thread::available_parallelism().map_or(1, usize::from);
            (2 * parallelism).clamp(8, 256)
        });
        Self { cells: (0..cells).map(|_| Padded::default()).collect(), shared: Padded::default() }
    }
}

impl Tally {
    /// Adds one, from the calling thread's cell.
    #[inline]
    pub(crate) fn add_one(&self) {
        match self.cells.get(slot()) {
            Some(cell) => {
                // Only this thread writes this cell while it holds the slot, and whoever held
                // the slot before gave it back under `SLOTS`' lock, which this thread took
                // since: a load and a store lose nothing.
                cell.store(cell.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
            }
            None => {
                self.shared.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Every add that happened before this call.
    pub(crate) fn total(&self) -> u64 {
        let cells = self.cells.iter().map(|cell| cell.load(Ordering::Relaxed));
        cells.fold(self.shared.load(Ordering::Relaxed), u64::wrapping_add)
    }
}

impl std::fmt::Debug for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Tally").field(&self.total()).finish()
    }
}

/// A thread's slot before it first adds.
const UNSET: usize = usize::MAX;
/// A thread's slot once it gave its slot back (it is exiting): past every tally's cells.
const GIVEN_BACK: usize = usize::MAX - 1;

/// The slots no live thread holds: the free ones below `next`, and `next`.
struct Slots {
    free: BinaryHeap<Reverse<usize>>,
    next: usize,
}

static SLOTS: Mutex<Slots> = Mutex::new(Slots { free: BinaryHeap::new(), next: 0 });

thread_local! {
    /// This thread's slot, [`UNSET`] or [`GIVEN_BACK`]. No destructor: where thread-locals are
    /// native (Linux, macOS, Windows) it stays readable while the thread's other thread-locals
    /// are torn down. Where they are OS keys it may be set up again after the holder gave the
    /// slot back: that thread then takes another slot, which is never given back (a leaked
    /// number, never a second writer).
    static SLOT: Cell<usize> = const { Cell::new(UNSET) };
    /// Gives the slot back when the thread exits.
    static HOLDER: Holder = const { Holder };
}

/// The calling thread's slot, taking one the first time.
#[inline]
fn slot() -> usize {
    // `try_with`: where thread-locals are OS keys, `SLOT` can be gone while other
    // thread-locals' destructors run; natively this is one load, with no state to check.
    match SLOT.try_with(Cell::get) {
        Ok(UNSET) => take_slot(),
        Ok(slot) => slot,
        Err(_) => GIVEN_BACK,
    }
}

#[cold]
fn take_slot() -> usize {
    // A first add from another thread-local's destructor registers the holder here, and the
    // slot is given back when the holder's destructor runs. A thread whose holder was already
    // destroyed (possible only where thread-locals are OS keys and `SLOT` was set up again)
    // adds to the shared atomic.
    if HOLDER.try_with(|_| ()).is_err() {
        let _ = SLOT.try_with(|slot| slot.set(GIVEN_BACK));
        return GIVEN_BACK;
    }
    let mut slots = lock(&SLOTS);
    let taken = match slots.free.pop() {
        Some(Reverse(slot)) => slot,
        None => {
            slots.next += 1;
            slots.next - 1
        }
    };
    if SLOT.try_with(|slot| slot.set(taken)).is_err() {
        // Nowhere to keep it: give it back at once.
        slots.free.push(Reverse(taken));
        return GIVEN_BACK;
    }
    taken
}

/// A thread-local whose destructor gives the thread's slot back.
struct Holder;

impl Drop for Holder {
    fn drop(&mut self) {
        let slot = SLOT.try_with(|slot| slot.replace(GIVEN_BACK)).unwrap_or(UNSET);
        if slot != UNSET && slot != GIVEN_BACK {
            lock(&SLOTS).free.push(Reverse(slot));
        }
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

    /// More threads than cells at once, in waves that exit and give their slots back: the
    /// adds past the cells go to the shared atomic, and a slot's next holder adds to what its
    /// last holder left. Checks nothing is lost, and that slots are reused, not leaked.
    #[test]
    fn threads_past_the_cells_and_threads_that_reuse_slots_lose_nothing() {
        let tally = std::sync::Arc::new(Tally::default());
        let threads = tally.cells.len() + 8;
        for _wave in 0..3 {
            let barrier = std::sync::Arc::new(std::sync::Barrier::new(threads));
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    let (tally, barrier) = (tally.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        tally.add_one();
                        // Every thread of the wave holds its slot at once.
                        barrier.wait();
                        for _ in 0..999 {
                            tally.add_one();
                        }
                    })
                })
                .collect();
            for handle in handles {
                handle.join().unwrap();
            }
        }
        assert_eq!(tally.total(), 3 * threads as u64 * 1_000);
        assert!(tally.shared.load(Ordering::Relaxed) > 0, "some threads had no cell");
        // Three waves of threads took no more slots than one wave holds at once (plus this
        // test's own threads and whatever other tests run beside it).
        assert!(lock(&SLOTS).next < 3 * threads, "slots given back are taken again");
    }

    /// A thread-local's destructor that adds while the thread exits is counted, whether it runs
    /// while the thread still holds its slot or after the thread gave it back.
    #[test]
    fn adds_from_a_thread_local_destructor_are_counted() {
        struct AddsOnDrop(std::sync::Arc<Tally>);
        impl Drop for AddsOnDrop {
            fn drop(&mut self) {
                self.0.add_one();
            }
        }
        thread_local! {
            static ADDS: Cell<Option<AddsOnDrop>> = const { Cell::new(None) };
        }
        let tally = std::sync::Arc::new(Tally::default());
        // The holder is registered by the first add, before `ADDS`: destructors run last
        // registered first, so `ADDS` adds while the slot is held.
        let adds = tally.clone();
        std::thread::spawn(move || {
            adds.add_one();
            ADDS.with(|cell| cell.set(Some(AddsOnDrop(adds))));
        })
        .join()
        .unwrap();
        assert_eq!(tally.total(), 2);
        // `ADDS` first, the holder at the first add: the holder gives the slot back first, and
        // `ADDS`'s add goes to the shared atomic.
        let adds = tally.clone();
        let shared_before = tally.shared.load(Ordering::Relaxed);
        std::thread::spawn(move || {
            ADDS.with(|cell| cell.set(Some(AddsOnDrop(adds.clone()))));
            adds.add_one();
        })
        .join()
        .unwrap();
        assert_eq!(tally.total(), 4);
        #[cfg(target_os = "linux")]
        assert_eq!(
            tally.shared.load(Ordering::Relaxed),
            shared_before + 1,
            "added after the give-back"
        );
    }
}
