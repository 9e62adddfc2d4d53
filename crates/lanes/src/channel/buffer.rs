//! Where a channel's queued records sit, and how a take moves them out.
//!
//! Small records (at most [`BLOCK_MIN_BYTES`]) sit in one ring. A
//! read of a whole ring into an empty read-ahead swaps it; many at once move in bulk.
//!
//! Large records sit in blocks of up to [`BLOCK`], the back one taking new records, so that a read
//! of a busy channel moves a block rather than copying its records, and a busy channel does not
//! regrow (copy) a large ring: only a back block that did not come from a sealed block's room (a
//! new channel's, or a read-ahead's swapped in for it) grows as records come, as a ring does, so
//! that a quiet channel holds no more than it needs. An emptied block is kept for the next one
//! needed, and a read-ahead swapped for a full block comes back as the next empty one: a busy
//! channel read by `recv` allocates nothing (batches of more than a block empty several, and one is
//! kept). With 256-byte records at capacity 1,024 on one thread, a ring's reads copied 64 records
//! each, and a new channel's ring doubled its way to 270 KB (two thirds of the time in `memcpy`, a
//! tenth in page faults): 10.1 M/s against 12.9 M/s at capacity 64, 580 instructions a record
//! against 502 in blocks (BENCHMARKS.md, suite 3).
//!
//! Small records stay in a ring: blocks cost them instructions (stop 46 tried them for every
//! record type: 197 → 202 a `u64` record at capacity 64), and their bulk moves are cheap. The
//! record type fixes the layout at compile time: the other one's fields stay empty and its
//! branches are folded away.

use std::collections::VecDeque;

/// Records of more than this many bytes are kept in blocks, and only records of at most this
/// many move in bulk: a large record's move is a block copy either way, and the bulk path
/// would copy it twice and ask the allocator for a large block (with 256-byte records on two
/// threads it read 0.8–0.97× the one-by-one move, in paired rounds). The split was measured
/// when every record carried its receipt's 8-byte word (64 bytes with it); the receipts now
/// sit beside the records ([`Entry`](super::core::Entry)), and the split stays where it was.
pub(crate) const BLOCK_MIN_BYTES: usize = 56;

/// Records per block of large records: the consumer's read-ahead, so that a read of a busy
/// channel takes a block whole.
pub(crate) const BLOCK: usize = 64;

/// The room a new block is allocated with: a block, and one more for a record handed to the
/// read, which goes in front of a block taken whole ([`Core::take`](super::core::Core::take)),
/// so that the read-ahead does not regrow it.
const BLOCK_ROOM: usize = BLOCK + 1;

/// From this many records on, a take of small records into an empty destination moves them
/// in bulk ([`split_front`]: two block copies and an allocation) rather than one at a time (a
/// drain's move of each record costs about 25 instructions; an allocation and its free, about
/// 150).
pub(crate) const BULK: usize = 16;

/// Whether records of type `T` are kept in blocks.
pub(crate) const fn blocked<T>() -> bool {
    size_of::<T>() > BLOCK_MIN_BYTES
}

/// Whether a take of `n` records of type `T` into an empty destination moves them in bulk.
const fn bulk<T>(n: usize) -> bool {
    n >= BULK && !blocked::<T>()
}

/// The first `n` records of `ring`, in an allocation of their own: the ring is rotated so that
/// they sit at its end (no copy when it is full to its allocation, as a full channel of
/// power-of-two capacity is; else a block copy of the shorter side), then split off (one block
/// copy).
fn split_front<T>(ring: &mut VecDeque<T>, n: usize) -> VecDeque<T> {
    ring.rotate_left(n);
    ring.split_off(ring.len() - n)
}

/// Where taken records go.
pub(crate) trait Take<T> {
    /// A read-ahead takes at most one block of large records at a time, so that the next read
    /// of a busy channel finds the next block whole; a batch takes all it asks for.
    const ONE_BLOCK: bool;

    /// Moves the first `n` records of `ring` (`n <= ring.len()`) to the end of `self`.
    fn take_front(&mut self, ring: &mut VecDeque<T>, n: usize);

    /// How many records `self` holds.
    fn held(&self) -> usize;

    /// Puts `record` at position `at` (`at <= self.held()`).
    fn put_at(&mut self, at: usize, record: T);
}

/// A batch: many small records into an empty batch move in bulk ([`split_front`]; the block
/// split off becomes the `Vec` without a copy).
impl<T> Take<T> for Vec<T> {
    const ONE_BLOCK: bool = false;

    fn take_front(&mut self, ring: &mut VecDeque<T>, n: usize) {
        if self.is_empty() && bulk::<T>(n) {
            *self = Vec::from(split_front(ring, n));
        } else {
            self.extend(ring.drain(..n));
        }
    }

    fn held(&self) -> usize {
        self.len()
    }

    fn put_at(&mut self, at: usize, record: T) {
        self.insert(at, record);
    }
}

/// The consumer's read-ahead: a whole ring or block taken into an empty one is swapped, not
/// copied; many small records into an empty one move in bulk ([`split_front`]). A swap may
/// hand the channel a read-ahead's allocation smaller than its ring. Keeping the channel's
/// allocation instead (swapping only into a read-ahead at least as large) ran slower at
/// capacity 1,024, 0.60× kanal against 0.67–0.79× in alternating paired rounds, although it
/// saved an instruction a record. So the swap stays, and a ring of small records swapped out
/// in bulk (at a burst's end) gets a fresh allocation of its former room, with nothing to copy.
/// Before, the next burst regrew it by doubling and copied about as many records again as the
/// burst held (callgrind, `fixed channel 1024 6` minus `2`, `u64` records: 156 → 149
/// instructions a record; BENCHMARKS.md, suite 3, stop 60). A swap of fewer than [`BULK`]
/// records leaves the allocations as they are: a channel read only in trickles keeps one ring
/// of its largest size. After a burst, the ring and the read-ahead both keep that room until
/// the consumer goes: at most twice the ring's largest size, as during a burst before.
impl<T> Take<T> for VecDeque<T> {
    const ONE_BLOCK: bool = true;

    // Inlined at both of `take_into`'s calls: called out of line, a read at capacity 1 cost
    // 16 instructions a 256-byte record more.
    #[inline(always)]
    fn take_front(&mut self, ring: &mut VecDeque<T>, n: usize) {
        if self.is_empty() && n == ring.len() {
            let room = ring.capacity();
            std::mem::swap(self, ring);
            if bulk::<T>(n) && ring.capacity() < room {
                *ring = VecDeque::with_capacity(room);
            }
        } else if self.is_empty() && bulk::<T>(n) {
            *self = split_front(ring, n);
        } else {
            self.extend(ring.drain(..n));
        }
    }

    fn held(&self) -> usize {
        self.len()
    }

    fn put_at(&mut self, at: usize, record: T) {
        self.insert(at, record);
    }
}

/// A channel's queued records, in order: a ring of small records, or blocks of large ones.
#[derive(Debug)]
pub(crate) struct Buffer<T> {
    /// Small records; or the back block of large ones, which takes new records (it moves to
    /// `blocks` once it holds [`BLOCK`], so it holds fewer).
    ring: VecDeque<T>,
    /// The blocks of large records ahead of the back one, oldest first, each of 1 to
    /// [`BLOCK`] records (none empty).
    blocks: VecDeque<VecDeque<T>>,
    /// Records in `blocks`.
    in_blocks: usize,
    /// An emptied block's allocation, kept for the next back block (no allocation when
    /// empty).
    spare: VecDeque<T>,
}

impl<T> Buffer<T> {
    /// An empty buffer; it allocates nothing until a record comes.
    pub(crate) fn new() -> Self {
        Self {
            ring: VecDeque::new(),
            blocks: VecDeque::new(),
            in_blocks: 0,
            spare: VecDeque::new(),
        }
    }

    /// Records queued.
    #[inline(always)]
    pub(crate) fn len(&self) -> usize {
        if blocked::<T>() { self.in_blocks + self.ring.len() } else { self.ring.len() }
    }

    #[inline(always)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Queues `record` at the back.
    // On every record's path (see `Emit::poll`).
    #[inline(always)]
    pub(crate) fn push_back(&mut self, record: T) {
        self.ring.push_back(record);
        // Sealed once full, after the push: a test before it made the compiler copy a large
        // record through the stack once more (635 instructions a record against 530).
        if blocked::<T>() && self.ring.len() >= BLOCK {
            self.seal();
        }
    }

    /// Queues the record `record` makes at the back. A large record is made once its slot is
    /// free (`extend` grows the ring first, then writes what the iterator yields in place), so
    /// that it goes from where `record` reads it straight into the slot: `push_back(record())`
    /// copied it to the stack first, to keep it across the grow's call. A small one (at most
    /// [`BLOCK_MIN_BYTES`]) is pushed: the out-of-line `extend` cost a `u64` record 17%.
    #[inline(always)]
    pub(crate) fn push_back_with(&mut self, record: impl FnOnce() -> T) {
        if blocked::<T>() {
            self.ring.extend(std::iter::once_with(record));
            if self.ring.len() >= BLOCK {
                self.seal();
            }
        } else {
            self.push_back(record());
        }
    }

    /// Moves the full back block behind the others, and starts a new one.
    #[inline(never)]
    fn seal(&mut self) {
        let mut next = std::mem::take(&mut self.spare);
        if next.capacity() == 0 {
            next = VecDeque::with_capacity(BLOCK_ROOM);
        }
        let full = std::mem::replace(&mut self.ring, next);
        self.in_blocks += full.len();
        self.blocks.push_back(full);
    }

    /// Removes the oldest record.
    pub(crate) fn pop_front(&mut self) -> Option<T> {
        if !blocked::<T>() {
            return self.ring.pop_front();
        }
        let Some(front) = self.blocks.front_mut() else {
            return self.ring.pop_front();
        };
        let record = front.pop_front();
        if front.is_empty() {
            let emptied = self.blocks.pop_front().expect("the front block");
            self.recycle(emptied);
        }
        self.in_blocks -= 1;
        record
    }

    /// Removes every record, in order.
    pub(crate) fn drain_all(&mut self) -> Vec<T> {
        self.in_blocks = 0;
        self.blocks.drain(..).flatten().chain(self.ring.drain(..)).collect()
    }

    /// Moves up to `n` records from the front to the end of `out`, in order; returns how
    /// many. Small records: `n`, or all there are if fewer. Large records: the same into a
    /// batch, but a read-ahead ([`Take::ONE_BLOCK`]) takes at most the front block, whole
    /// when it can.
    pub(crate) fn take_into<O: Take<T>>(&mut self, n: usize, out: &mut O) -> usize {
        if !blocked::<T>() {
            let n = n.min(self.ring.len());
            out.take_front(&mut self.ring, n);
            return n;
        }
        let mut moved = 0;
        while moved < n
            && let Some(front) = self.blocks.front_mut()
        {
            let k = (n - moved).min(front.len());
            // A whole block into an empty read-ahead is swapped: the block's place then holds
            // the read-ahead's empty allocation.
            out.take_front(front, k);
            if front.is_empty() {
                let emptied = self.blocks.pop_front().expect("the front block");
                self.recycle(emptied);
            }
            self.in_blocks -= k;
            moved += k;
            if O::ONE_BLOCK {
                return moved;
            }
        }
        // The back block (swapped whole into an empty read-ahead).
        let k = (n - moved).min(self.ring.len());
        out.take_front(&mut self.ring, k);
        moved + k
    }

    /// Keeps an emptied block's allocation for the next back block, if none is kept and it
    /// has a block's room ([`BLOCK_ROOM`]).
    fn recycle(&mut self, emptied: VecDeque<T>) {
        debug_assert!(emptied.is_empty());
        if self.spare.capacity() == 0 && emptied.capacity() >= BLOCK_ROOM {
            self.spare = emptied;
        }
    }

    /// How many records a read-ahead's take finds in one piece: the front block's, or all
    /// there are of small records.
    pub(crate) fn front_run(&self) -> usize {
        if !blocked::<T>() {
            return self.ring.len();
        }
        self.blocks.front().map_or(self.ring.len(), VecDeque::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record large enough to be kept in blocks: its id, padded.
    #[derive(Debug, Clone, PartialEq)]
    struct Wide(u64, [u64; 15]);

    fn fill(buf: &mut Buffer<Wide>, ids: std::ops::Range<u64>) {
        for id in ids {
            buf.push_back(Wide(id, [id; 15]));
        }
    }

    fn read(buf: &mut Buffer<Wide>, ahead: &mut VecDeque<Wide>) -> Vec<u64> {
        let n = buf.take_into(BLOCK, ahead);
        assert_eq!(n, ahead.len());
        ahead.drain(..).map(|r| r.0).collect()
    }

    #[test]
    fn large_records_sit_in_blocks_and_small_ones_in_a_ring() {
        assert!(blocked::<Wide>());
        assert!(!blocked::<u64>());
        let mut small = Buffer::new();
        (0..200u64).for_each(|i| small.push_back(i));
        assert_eq!((small.len(), small.ring.len(), small.blocks.len()), (200, 200, 0));
        let mut large = Buffer::new();
        fill(&mut large, 0..200);
        // Three full blocks, and the back one taking records.
        assert_eq!((large.len(), large.ring.len(), large.blocks.len()), (200, 8, 3));
        fill(&mut large, 200..256);
        assert_eq!((large.len(), large.ring.len(), large.blocks.len()), (256, 0, 4));
    }

    #[test]
    fn a_read_takes_the_front_block_whole_and_the_channel_recycles_its_read_ahead() {
        let mut buf = Buffer::new();
        let mut ahead = VecDeque::new();
        fill(&mut buf, 0..200);
        let lens: Vec<usize> = (0..4).map(|_| read(&mut buf, &mut ahead).len()).collect();
        assert_eq!(lens, [64, 64, 64, 8]);
        assert!(buf.is_empty() && buf.blocks.is_empty());
        // The read-ahead, swapped for a block and emptied, is the next back block.
        assert!(buf.spare.capacity() >= BLOCK_ROOM);
        let spare = buf.spare.as_slices().0.as_ptr();
        fill(&mut buf, 200..265);
        assert_eq!(buf.ring.as_slices().0.as_ptr(), spare);
        assert_eq!(read(&mut buf, &mut ahead), (200..264).collect::<Vec<_>>());
        assert_eq!(read(&mut buf, &mut ahead), [264]);
    }

    #[test]
    fn reads_after_a_dropped_oldest_record_find_whole_blocks_again() {
        let mut buf = Buffer::new();
        let mut ahead = VecDeque::new();
        fill(&mut buf, 0..192);
        assert_eq!(buf.pop_front().map(|r| r.0), Some(0));
        // The rest of the front block, then the next blocks whole.
        assert_eq!(read(&mut buf, &mut ahead), (1..64).collect::<Vec<_>>());
        assert_eq!(read(&mut buf, &mut ahead), (64..128).collect::<Vec<_>>());
        // A partial take from a block leaves its rest for the next read.
        assert_eq!(buf.take_into(10, &mut ahead), 10);
        ahead.clear();
        assert_eq!(read(&mut buf, &mut ahead), (138..192).collect::<Vec<_>>());
        assert!(buf.is_empty());
    }

    #[test]
    fn a_quiet_channel_of_large_records_holds_no_more_than_it_needs() {
        let mut buf = Buffer::new();
        assert_eq!(buf.ring.capacity(), 0);
        fill(&mut buf, 0..1);
        assert!(buf.ring.capacity() < BLOCK, "{} slots for one record", buf.ring.capacity());
        // Sealed blocks of a busy channel have a block's room, and one more.
        fill(&mut buf, 1..70);
        assert!(buf.ring.capacity() >= BLOCK_ROOM);
    }

    #[test]
    fn a_ring_swapped_out_in_bulk_keeps_its_room_and_a_trickle_does_not_grow_it() {
        let mut buf: Buffer<u64> = Buffer::new();
        let mut ahead: VecDeque<u64> = VecDeque::new();
        (0..1024).for_each(|i| buf.push_back(i));
        let room = buf.ring.capacity();
        // Reads of a busy channel: the front in bulk, then the last of it swapped whole.
        let mut got = Vec::new();
        while !buf.is_empty() {
            assert_eq!(buf.take_into(BLOCK, &mut ahead), BLOCK);
            got.extend(ahead.drain(..));
        }
        assert_eq!(got, (0..1024).collect::<Vec<_>>());
        assert!(buf.ring.capacity() >= room, "{} of {room}", buf.ring.capacity());
        // The next burst fills it without regrowing it.
        let kept = buf.ring.capacity();
        (0..1024).for_each(|i| buf.push_back(i));
        assert_eq!(buf.ring.capacity(), kept);

        // A trickle: one record at a time, neither allocation grown.
        let mut quiet: Buffer<u64> = Buffer::new();
        let mut ahead: VecDeque<u64> = VecDeque::new();
        for i in 0..10 {
            quiet.push_back(i);
            assert_eq!(quiet.take_into(BLOCK, &mut ahead), 1);
            assert_eq!(ahead.pop_front(), Some(i));
        }
        assert!(quiet.ring.capacity() < BULK && ahead.capacity() < BULK);
    }

    #[test]
    fn a_batch_takes_all_it_asks_for_across_blocks_in_order() {
        let mut buf = Buffer::new();
        fill(&mut buf, 0..150);
        let mut batch = vec![Wide(999, [0; 15])];
        assert_eq!(buf.take_into(100, &mut batch), 100);
        let ids: Vec<u64> = batch.iter().map(|r| r.0).collect();
        assert_eq!(ids, [999].into_iter().chain(0..100).collect::<Vec<_>>());
        assert_eq!(buf.len(), 50);
        let rest: Vec<u64> = buf.drain_all().into_iter().map(|r| r.0).collect();
        assert_eq!(rest, (100..150).collect::<Vec<_>>());
        assert!(buf.is_empty() && buf.blocks.is_empty());
    }

    #[test]
    fn a_read_into_a_read_ahead_holding_records_appends_after_them() {
        let mut buf = Buffer::new();
        fill(&mut buf, 0..70);
        let mut ahead: VecDeque<Wide> = VecDeque::new();
        ahead.push_back(Wide(999, [0; 15]));
        assert_eq!(buf.take_into(BLOCK, &mut ahead), 64);
        let ids: Vec<u64> = ahead.iter().map(|r| r.0).collect();
        assert_eq!(ids, [999].into_iter().chain(0..64).collect::<Vec<_>>());
        assert_eq!(buf.len(), 6);
    }
}
