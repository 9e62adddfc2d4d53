//! The pure schedulers behind the pools: which queued item a worker takes next. No I/O, no
//! clock, no tasks; the engine drives them under its lock.
//!
//! # Invariants
//!
//! - [`Fifo`]: items are taken in submit order by any worker.
//! - [`Sharded`]: an item goes to shard `fnv1a64(key) % shards` and only that shard's worker
//!   takes it, in submit order.
//! - [`PerKey`]: items of one key are taken one at a time, in submit order: a key's next item is
//!   only offered once its previous item is done. Keys with work wait in one FIFO of ready keys,
//!   so keys take turns and a slow key holds one worker, never others. A key with nothing queued
//!   and nothing running is idle: up to [`IDLE_KEPT`] idle keys are kept for their return (the
//!   least recently idle are forgotten first), and the tables shrink when they are mostly empty,
//!   so memory returns to a bounded baseline after a burst of keys.
//! - [`PerKey`]'s tables: every entry in use (`Some` in the slab) is listed in the key table
//!   exactly once, under its key's hash; an entry not in use is `None`, listed in `free` and not
//!   in the key table.
//! - [`PerKey`] runs a key's `Hash` once, at its push, before it changes anything; the entry
//!   keeps the hash, and the tables' upkeep (growth, eviction, compaction, shrinking) reads it
//!   there. So a `Hash` that panics refuses that push and cannot break the tables. So does
//!   a key's `Eq`, or the `Drop` of the key a push looks up by (dropped before anything
//!   changes); a forgotten key's `Drop` that panics is contained.

use std::collections::VecDeque;
use std::hash::BuildHasher;

use hashbrown::HashTable;

use super::fnv::{PoolKey, fnv1a64};
use crate::util::drop_contained;

/// Why a scheduler refused an item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The total queue bound was reached.
    Full,
    /// The item's key (or shard) queue bound was reached.
    KeyFull,
    /// The bound on tracked keys was reached.
    TooManyKeys,
}

/// Which worker a push should wake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wake {
    /// Any idle worker.
    Any,
    /// This worker (its shard got work).
    Worker(usize),
    /// None: the item waits behind its key's running item.
    None,
}

pub(crate) trait Scheduler<T>: Send + 'static {
    /// What a worker holds while processing an item, handed back to [`done`](Self::done).
    type Slot: Send;

    /// Queues `item`, or refuses it.
    fn push(&mut self, item: T) -> Result<Wake, (Refused, T)>;
    /// `reserved` rooms of the total bound are taken besides the queued items (handed to
    /// waiting producers by the engine): `Full` counts them from now on.
    fn reserve(&mut self, reserved: usize);
    fn pop(&mut self, worker: usize) -> Option<(Self::Slot, T)>;
    /// The item taken with `slot` is done.
    fn done(&mut self, slot: Self::Slot) -> Wake;
    fn queued(&self) -> usize;
    fn keys(&self) -> usize;
    /// Whether an item is ready for any worker ([`Wake::Any`] schedulers; a sharded one says
    /// no, its wakes are targeted).
    fn has_ready(&self) -> bool;
    /// Takes every queued item out (for abort), in no particular order.
    fn drain(&mut self) -> Vec<T>;
}

/// One queue, any worker, submit order.
#[derive(Debug)]
pub(crate) struct Fifo<T> {
    queue: VecDeque<T>,
    capacity: usize,
    /// Rooms handed to waiting producers ([`Scheduler::reserve`]).
    reserved: usize,
}

impl<T> Fifo<T> {
    pub(crate) fn new(capacity: usize) -> Self {
        Self { queue: VecDeque::new(), capacity, reserved: 0 }
    }
}

impl<T: Send + 'static> Scheduler<T> for Fifo<T> {
    type Slot = ();

    fn push(&mut self, item: T) -> Result<Wake, (Refused, T)> {
        if self.queue.len() + self.reserved >= self.capacity {
            return Err((Refused::Full, item));
        }
        self.queue.push_back(item);
        Ok(Wake::Any)
    }

    fn pop(&mut self, _worker: usize) -> Option<((), T)> {
        self.queue.pop_front().map(|item| ((), item))
    }

    fn done(&mut self, (): ()) -> Wake {
        Wake::None
    }

    fn queued(&self) -> usize {
        self.queue.len()
    }

    fn reserve(&mut self, reserved: usize) {
        self.reserved = reserved;
    }

    fn keys(&self) -> usize {
        0
    }

    fn has_ready(&self) -> bool {
        !self.queue.is_empty()
    }

    fn drain(&mut self) -> Vec<T> {
        self.queue.drain(..).collect()
    }
}

/// A shard per worker, chosen by FNV-1a of the key bytes: the seed's keyed pool.
pub(crate) struct Sharded<T, K> {
    shards: Vec<VecDeque<T>>,
    per_shard: usize,
    key_of: Box<dyn Fn(&T) -> K + Send + Sync>,
    queued: usize,
}

impl<T, K: PoolKey> Sharded<T, K> {
    pub(crate) fn new(
        shards: usize,
        per_shard: usize,
        key_of: Box<dyn Fn(&T) -> K + Send + Sync>,
    ) -> Self {
        Self {
            shards: (0..shards).map(|_| VecDeque::new()).collect(),
            per_shard,
            key_of,
            queued: 0,
        }
    }

    pub(crate) fn shard_of(&self, item: &T) -> usize {
        let key = (self.key_of)(item);
        (fnv1a64(&key.key_bytes()) % self.shards.len() as u64) as usize
    }
}

impl<T: Send + 'static, K: PoolKey> Scheduler<T> for Sharded<T, K> {
    type Slot = ();

    fn push(&mut self, item: T) -> Result<Wake, (Refused, T)> {
        let shard = self.shard_of(&item);
        if self.shards[shard].len() >= self.per_shard {
            return Err((Refused::KeyFull, item));
        }
        self.shards[shard].push_back(item);
        self.queued += 1;
        Ok(Wake::Worker(shard))
    }

    fn pop(&mut self, worker: usize) -> Option<((), T)> {
        let item = self.shards.get_mut(worker)?.pop_front()?;
        self.queued -= 1;
        Some(((), item))
    }

    fn done(&mut self, (): ()) -> Wake {
        Wake::None
    }

    fn queued(&self) -> usize {
        self.queued
    }

    /// Shards bound only their own queues (`KeyFull`): rooms handed count against nothing.
    fn reserve(&mut self, _reserved: usize) {}

    fn keys(&self) -> usize {
        0
    }

    fn has_ready(&self) -> bool {
        false
    }

    fn drain(&mut self) -> Vec<T> {
        self.queued = 0;
        self.shards.iter_mut().flat_map(|s| s.drain(..)).collect()
    }
}

/// A key and its queue, in its slab entry: what every item's push, pop and `done` touch, on one
/// cache line for small items and keys. A key with a single queued item (the common case) keeps
/// it inline, so a burst of distinct keys allocates nothing per key beyond the tables; the items
/// behind it are boxed, a word instead of a `VecDeque`'s four.
///
/// Over 10,000 uniform keys the tables outgrow a core's L2 cache and an item's time goes to its
/// misses (BENCHMARKS.md, suite 8, stops 56 and 61). So the key is compared here, in the line the
/// push reads anyway, and the key table holds only entry numbers (4 bytes a bucket, where a
/// `u64` key and its entry number took 16).
#[repr(align(64))]
struct KeyState<T, K> {
    first: Option<T>,
    #[allow(clippy::box_collection, reason = "a word in the entry, not a VecDeque's four")]
    more: Option<Box<VecDeque<T>>>,
    key: K,
    /// When it last went idle: `PerKey::next_idled` then (see `PerKey::go_idle`). A `u32`
    /// that wraps: stamps are compared by age ([`PerKey::age`]), and after a wrap only the
    /// order in which idle keys are forgotten can be off, never their bound.
    idled: u32,
    /// The key's hash, as pushed: the tables' upkeep reads it here and never runs the key's
    /// `Hash` again (see [`table_hash`]).
    hash: u32,
    /// Items queued: `first`'s and `more`'s (read on every push without going to `more`). A
    /// `u32` keeps the entry of a `u64` key and a three-word queued item (two words of the
    /// user's and the engine's stamp) on one line; `PerKey::new` caps the per-key bound to fit.
    len: u32,
    running: bool,
    /// Nothing queued, nothing running: kept for the key's return (see `PerKey::go_idle`).
    idle: bool,
}

impl<T, K> KeyState<T, K> {
    fn new(key: K, hash: u32) -> Self {
        let (first, more) = (None, None);
        Self { first, more, key, idled: 0, hash, len: 0, running: false, idle: false }
    }

    fn len(&self) -> usize {
        self.len as usize
    }

    fn push(&mut self, item: T) {
        if self.len == 0 {
            self.first = Some(item);
        } else {
            self.more.get_or_insert_default().push_back(item);
        }
        self.len += 1;
    }

    fn pop(&mut self) -> Option<T> {
        let item = self.first.take().or_else(|| self.more.as_mut()?.pop_front())?;
        self.len -= 1;
        Some(item)
    }
}

/// Per-key FIFO queues scheduled onto any worker, one item per key at a time.
///
/// Keys and their queues live in a slab; the key table maps a key's hash to its entry, and
/// everything after the push (the ready queue, a worker's slot, `done`) names the entry, not
/// the key. A key that goes idle keeps its entry, up to [`IDLE_KEPT`] idle keys (the least
/// recently idle are forgotten first): a key that comes back costs one hash lookup and no
/// allocation. So an item costs one lookup at push, and a key is never cloned into the ready
/// queue.
#[repr(C)]
pub(crate) struct PerKey<T, K> {
    // What every push reads and the workers do not write, first (the key table changes only
    // when a key is added or forgotten, and a worker's `done` forgets keys only once more than
    // `IDLE_KEPT` are idle); then, on lines of their own, what a worker's pop and `done` write.
    /// Entry numbers, found by their key's hash and compared by the entry's key.
    index: HashTable<u32>,
    hasher: foldhash::fast::RandomState,
    key_of: Box<dyn Fn(&T) -> K + Send + Sync>,
    /// The entries; `None` while free.
    slab: Vec<Option<KeyState<T, K>>>,
    /// The most keys the key table has held since it was last shrunk: its memory follows this,
    /// not `capacity()`, which counts the tombstones of removed keys as used room.
    index_high: usize,
    /// How many idle keys are kept ([`IDLE_KEPT`]; fewer in tests).
    idle_kept: usize,
    max_queued: usize,
    max_per_key: usize,
    max_keys: usize,
    _line: [Line; 0],
    /// Entries with queued items and none running, in the order they became ready.
    ready: VecDeque<u32>,
    queued: usize,
    /// `max_queued` less the rooms handed to waiting producers ([`Scheduler::reserve`]): the
    /// bound a push sees (one field to read, as before rooms were handed).
    open_bound: usize,
    /// How many entries are idle.
    idle_count: usize,
    /// The next `idled` stamp: how many times an entry has gone idle, wrapping.
    next_idled: u32,
    /// Evictions since the slab's free tail was last cut (see `shrink`).
    evicted: usize,
    /// Free slab entries, reused last-freed first.
    free: Vec<u32>,
    /// The idle entries in the order they went idle, as (entry, `idled`), kept only while idle
    /// entries are at their bound (see [`go_idle`](Self::go_idle)). An entry used again since
    /// leaves a stale pair behind, skipped and compacted away.
    idle: Option<VecDeque<(u32, u32)>>,
}

/// Starts a cache line (and its adjacent-line prefetch pair).
#[repr(align(128))]
struct Line;

/// Tables up to this many entries are kept when they empty, so steady traffic does not grow
/// and shrink them over and over; it is the baseline memory returns to.
const SHRINK_FLOOR: usize = 16_384;

/// Idle keys kept for their return; beyond this, the least recently idle are forgotten.
pub(crate) const IDLE_KEPT: usize = 16_384;

impl<T, K: PoolKey> PerKey<T, K> {
    pub(crate) fn new(
        max_queued: usize,
        max_per_key: usize,
        max_keys: usize,
        key_of: Box<dyn Fn(&T) -> K + Send + Sync>,
    ) -> Self {
        Self {
            index: HashTable::new(),
            hasher: foldhash::fast::RandomState::default(),
            index_high: 0,
            idle: None,
            idle_count: 0,
            next_idled: 0,
            idle_kept: IDLE_KEPT,
            slab: Vec::new(),
            free: Vec::new(),
            evicted: 0,
            ready: VecDeque::new(),
            key_of,
            queued: 0,
            open_bound: max_queued,
            max_queued,
            // A key's count is a `u32`, so that its entry stays on one line (`KeyState::len`).
            max_per_key: max_per_key.min(u32::MAX as usize),
            max_keys,
            _line: [],
        }
    }

    /// The entry `slot`, which is in use (named by the key table, the ready queue or a worker).
    fn entry(&mut self, slot: u32) -> &mut KeyState<T, K> {
        self.slab[slot as usize].as_mut().expect("an entry in use")
    }

    /// Entry `slot` has nothing queued and nothing running: it is kept for its key's return,
    /// stamped with when it went idle, and the least recently idle entries beyond
    /// [`IDLE_KEPT`] are forgotten.
    ///
    /// Which entries went idle first is kept in a list only while idle entries are at that
    /// bound: from the first time more than `IDLE_KEPT` are idle, when the list is read off
    /// the entries' stamps (a pass over the slab and a sort), until fewer than half that many
    /// are and the slab is small enough to read it off again cheaply. So it is read off at most
    /// once per `IDLE_KEPT / 2` keys going idle, and over a slab of more than `2 * IDLE_KEPT`
    /// entries only once per as many keys added since it was dropped. Kept all the time, the
    /// list gained a stale pair for every key that came back, and checking those pairs (a
    /// read of a random entry each, under the pool's lock) cost about an entry read per item
    /// over 10,000 uniform keys, which halved the pool's throughput there (BENCHMARKS.md,
    /// suite 8, stop 63).
    fn go_idle(&mut self, slot: u32) {
        let stamp = self.next_idled;
        self.next_idled = stamp.wrapping_add(1);
        let state = self.entry(slot);
        state.idle = true;
        state.idled = stamp;
        self.idle_count += 1;
        if self.idle.is_some()
            && self.idle_count < self.idle_kept / 2
            && self.slab.len() <= 2 * self.idle_kept
        {
            // Well under the bound again, and the list is cheap to read off the stamps if it
            // is reached again. (Over a large slab it is kept: reading it off again would cost
            // a pass over the slab per half bound of keys going idle.)
            self.idle = None;
        }
        match &mut self.idle {
            None if self.idle_count <= self.idle_kept => {
                if self.idle_count == self.index.len()
                    && self.slab.len() > 2 * self.idle_count + SHRINK_FLOOR
                {
                    // The last key with work went idle after a burst of keys: memory goes
                    // back now (`shrink`), not at the next eviction, which may never come.
                    self.shrink(0);
                }
                return;
            }
            // At the bound: the order is read off the stamps, this entry's among them.
            None => self.idle = Some(self.idle_order()),
            Some(order) => order.push_back((slot, stamp)),
        }
        while self.idle_count > self.idle_kept {
            let oldest = self.idle.as_mut().and_then(VecDeque::pop_front);
            let (oldest, idled) = oldest.expect("idle entries at the bound are listed");
            if self.is_idle(oldest, idled) {
                self.evict(oldest);
            }
        }
        // Stale pairs (entries used again or forgotten) are dropped once they outnumber the
        // live ones.
        if let Some(mut order) = self.idle.take() {
            if order.len() > 2 * self.idle_count + 64 {
                order.retain(|(slot, idled)| self.is_idle(*slot, *idled));
            }
            self.idle = Some(order);
        }
    }

    /// The idle entries in the order they went idle, read off their stamps.
    fn idle_order(&self) -> VecDeque<(u32, u32)> {
        let mut order: Vec<(u32, u32)> = (self.slab.iter().enumerate())
            .filter_map(|(slot, state)| Some((state.as_ref()?, slot)))
            .filter(|(state, _)| state.idle)
            .map(|(state, slot)| (slot as u32, state.idled))
            .collect();
        // Oldest first.
        order.sort_unstable_by_key(|(_, idled)| std::cmp::Reverse(self.age(*idled)));
        order.into()
    }

    /// How many entries went idle after the one stamped `idled`.
    fn age(&self, idled: u32) -> u32 {
        self.next_idled.wrapping_sub(idled)
    }

    /// Whether entry `slot` is still the idle entry listed with stamp `idled`.
    fn is_idle(&self, slot: u32, idled: u32) -> bool {
        let state = self.slab.get(slot as usize).and_then(Option::as_ref);
        state.is_some_and(|state| state.idle && state.idled == idled)
    }

    /// Forgets the key of entry `slot`, which has nothing queued and nothing running.
    fn evict(&mut self, slot: u32) {
        self.forget(slot);
        self.shrink(1);
    }

    fn forget(&mut self, slot: u32) {
        let state = self.slab[slot as usize].take().expect("a forgotten entry is in use");
        if state.idle {
            self.idle_count -= 1;
        }
        let Ok(listed) = self.index.find_entry(table_hash(state.hash), |listed| *listed == slot)
        else {
            unreachable!("an entry in use is in the key table");
        };
        listed.remove();
        self.free.push(slot);
        // The key's `Drop` is user code, run under the pool's lock by a worker or an abort: a
        // panic there is contained (reported by the panic hook), so neither stops half done.
        drop_contained(state);
    }

    /// Gives memory back once the tables are mostly empty after a burst of keys: the key table
    /// is shrunk, and the slab loses its free tail (all of it once no key is tracked).
    fn shrink(&mut self, evicted: usize) {
        // Decided on the high-water mark: after many removals `capacity()` reads low (a
        // tombstone is counted as taken), so a table of mostly tombstones would never shrink.
        let len = self.index.len();
        if self.index_high > SHRINK_FLOOR && len < self.index_high / 4 {
            let slab = &self.slab;
            self.index.shrink_to((len * 2).max(SHRINK_FLOOR), |slot| hash_of(slab, *slot));
            self.index_high = len;
        }
        if let Some(order) = &mut self.idle
            && order.capacity() > SHRINK_FLOOR
            && order.len() < order.capacity() / 4
        {
            order.shrink_to((order.len() * 2).max(SHRINK_FLOOR));
        }
        self.evicted += evicted;
        if len == 0 {
            // Nothing tracked: the slab starts over.
            self.slab.clear();
            self.free.clear();
            self.idle = None;
            self.evicted = 0;
        }
        // Compacting is linear in the slab, so it waits for a quarter of the slab's evictions
        // (amortized constant work per eviction), or for the moment nothing is in use.
        let active = len - self.idle_count;
        let sparse = len < self.slab.len() / 4 && self.evicted >= self.slab.len() / 4;
        let unused = active == 0 && self.slab.len() > 2 * len + SHRINK_FLOOR;
        if self.slab.capacity() > SHRINK_FLOOR && (sparse || unused) {
            self.compact();
            self.evicted = 0;
        }
        if self.ready.capacity() > SHRINK_FLOOR && self.ready.len() < self.ready.capacity() / 8 {
            self.ready.shrink_to((self.ready.len() * 2).max(SHRINK_FLOOR));
        }
    }

    /// Gives `key`, of key-table hash `hash` and not tracked, an entry: its number. Out of the
    /// push, so that only the key table's hash is live across the push's lookup (with the
    /// entry's half computed here too, a register spilled in the lookup's loop: 10 instructions
    /// a push).
    #[inline(never)]
    fn add_key(&mut self, key: K, hash: u64) -> u32 {
        let slab = &mut self.slab;
        // Room first: should a growth fail, no entry has been filled that the key table does
        // not list.
        self.index.reserve(1, |slot| hash_of(slab, *slot));
        let state = Some(KeyState::new(key, hash as u32));
        let slot = match self.free.pop() {
            Some(slot) => {
                slab[slot as usize] = state;
                slot
            }
            None => {
                slab.push(state);
                u32::try_from(slab.len() - 1).expect("fewer than 2^32 keys tracked")
            }
        };
        self.index.insert_unique(hash, slot, |slot| hash_of(slab, *slot));
        self.index_high = self.index_high.max(self.index.len());
        slot
    }
}

/// The key table's hash of entry `slot`, which is in use (its rehash function): the hash kept
/// in the entry, so a growth or a shrink never runs a key's `Hash`.
fn hash_of<T, K>(slab: &[Option<KeyState<T, K>>], slot: u32) -> u64 {
    let state = slab[slot as usize].as_ref().expect("the key table names entries in use");
    table_hash(state.hash)
}

/// A key's hash as the key table takes it, from the 32 bits an entry keeps: the key table
/// places a row by the low bits and tags it with the top seven, so both halves carry the hash.
/// (Keeping 32 bits keeps an entry on one cache line; two keys in 2^32 share one and are told
/// apart by their entries, as keys whose hashes collide always are.)
#[inline]
fn table_hash(hash: u32) -> u64 {
    (u64::from(hash) << 32) | u64::from(hash)
}

impl<T, K: PoolKey> PerKey<T, K> {
    /// Moves the idle entries of the slab's tail into free entries below it and cuts the tail,
    /// down to the last entry in use (queued or running: the ready queue or a worker names it,
    /// so it stays put). A moved entry keeps its `idled` stamp, and the list of idle entries,
    /// if kept, is read off the stamps again.
    fn compact(&mut self) {
        let before = self.slab.len();
        // Free entries, lowest last: the tail's idle entries move as low as they can.
        let mut free = std::mem::take(&mut self.free);
        free.sort_unstable_by(|a, b| b.cmp(a));
        while let Some(tail) = self.slab.last() {
            let end = self.slab.len() - 1;
            if let Some(tail) = tail {
                if !tail.idle {
                    break;
                }
                let Some(to) = free.pop().filter(|to| (*to as usize) < end) else {
                    break;
                };
                let end_slot = end as u32;
                let listed =
                    self.index.find_mut(table_hash(tail.hash), |listed| *listed == end_slot);
                *listed.expect("an idle key is tracked") = to;
                // Entry `to` is free (`None`): the tail's entry takes its place, and the `None`
                // comes out and is dropped.
                self.slab.swap_remove(to as usize);
            } else {
                self.slab.pop();
            }
        }
        let end = self.slab.len() as u32;
        free.retain(|slot| *slot < end);
        self.free = free;
        if self.slab.len() < before {
            if self.idle.is_some() {
                self.idle = Some(self.idle_order());
            }
            self.slab.shrink_to((self.slab.len() * 2).max(SHRINK_FLOOR));
            self.free.shrink_to((self.free.len() * 2).max(SHRINK_FLOOR));
        }
    }
}

impl<T: Send + 'static, K: PoolKey> Scheduler<T> for PerKey<T, K> {
    // A word, not a u32: a (u32, item) return value was packed at offset 4 and moved through
    // overlapping stack copies, a store-forwarding stall on every pop.
    type Slot = usize;

    fn push(&mut self, item: T) -> Result<Wake, (Refused, T)> {
        let key = (self.key_of)(&item);
        // The key's `Hash`, once: kept in its entry (the low half), for the tables' upkeep.
        let hash = table_hash(self.hasher.hash_one(&key) as u32);
        // One lookup: every bound is checked before a new key is inserted.
        let full = self.queued >= self.open_bound;
        let tracked = self.index.len() - self.idle_count;
        let slab = &mut self.slab;
        let known = self.index.find(hash, |slot| {
            slab[*slot as usize].as_ref().expect("the key table names entries in use").key == key
        });
        let (slot, state) = match known.copied() {
            Some(slot) => {
                // The key looked up by goes before anything changes: its `Drop` is user code,
                // which may panic (into the submitter, the item not taken).
                drop(key);
                let state = slab[slot as usize].as_mut().expect("a listed entry is in use");
                if state.len() >= self.max_per_key {
                    return Err((Refused::KeyFull, item));
                }
                if state.idle && tracked >= self.max_keys {
                    return Err((Refused::TooManyKeys, item));
                }
                if full {
                    return Err((Refused::Full, item));
                }
                if std::mem::take(&mut state.idle) {
                    // Back from idle; its pair in `idle` is stale now.
                    self.idle_count -= 1;
                }
                (slot, state)
            }
            None => {
                if tracked >= self.max_keys {
                    return Err((Refused::TooManyKeys, item));
                }
                if full {
                    return Err((Refused::Full, item));
                }
                let slot = self.add_key(key, hash);
                (slot, self.slab[slot as usize].as_mut().expect("the entry just made"))
            }
        };
        self.queued += 1;
        state.push(item);
        if !state.running && state.len() == 1 {
            self.ready.push_back(slot);
            Ok(Wake::Any)
        } else {
            Ok(Wake::None)
        }
    }

    // Inlined into the worker loop: returned through memory, the item was written in words
    // and read back in wider loads, a store-forwarding stall per item.
    #[inline]
    fn pop(&mut self, _worker: usize) -> Option<(usize, T)> {
        let slot = self.ready.pop_front()?;
        let state = self.entry(slot);
        let item = state.pop().expect("a ready key has an item");
        state.running = true;
        self.queued -= 1;
        Some((slot as usize, item))
    }

    fn done(&mut self, slot: usize) -> Wake {
        // Only a running entry is done (a running key is never forgotten).
        let running = self.slab.get_mut(slot).and_then(Option::as_mut).filter(|s| s.running);
        let Some(state) = running else {
            return Wake::None;
        };
        state.running = false;
        if state.len() == 0 {
            self.go_idle(slot as u32);
            Wake::None
        } else {
            self.ready.push_back(slot as u32);
            Wake::Any
        }
    }

    fn queued(&self) -> usize {
        self.queued
    }

    fn reserve(&mut self, reserved: usize) {
        self.open_bound = self.max_queued.saturating_sub(reserved);
    }

    fn keys(&self) -> usize {
        self.index.len() - self.idle_count
    }

    fn has_ready(&self) -> bool {
        !self.ready.is_empty()
    }

    fn drain(&mut self) -> Vec<T> {
        self.queued = 0;
        self.ready.clear();
        let mut out = Vec::new();
        // An eviction may shrink the slab's free tail: the bound is read every time.
        let mut slot = 0;
        while slot < self.slab.len() {
            if let Some(state) = &mut self.slab[slot] {
                state.len = 0;
                out.extend(state.first.take());
                out.extend(state.more.iter_mut().flat_map(|more| more.drain(..)));
                if !state.running {
                    self.evict(slot as u32);
                }
            }
            slot += 1;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The tables' invariant (the module's): every entry in use is listed once under its key's
    /// hash, every free entry is `None` and in `free`, and nothing else is listed.
    fn check_tables<T, K: PoolKey>(s: &PerKey<T, K>) {
        let in_use = s.slab.iter().filter(|state| state.is_some()).count();
        assert_eq!(s.index.len(), in_use, "key table rows against entries in use");
        for (slot, state) in s.slab.iter().enumerate() {
            let slot = slot as u32;
            match state {
                Some(state) => {
                    assert!(
                        s.index.find(table_hash(state.hash), |listed| *listed == slot).is_some(),
                        "{slot} unlisted"
                    );
                    assert!(!s.free.contains(&slot), "entry {slot} in use and free");
                }
                None => assert!(s.free.contains(&slot), "entry {slot} neither in use nor free"),
            }
        }
        assert!(s.free.iter().all(|slot| (*slot as usize) < s.slab.len()), "free beyond the slab");
        let idle = s.slab.iter().flatten().filter(|state| state.idle).count();
        assert_eq!(s.idle_count, idle, "idle entries counted");
        assert!(s.idle_count <= s.idle_kept, "{} idle entries kept", s.idle_count);
        if let Some(order) = &s.idle {
            let mut listed: Vec<u32> = (order.iter())
                .filter(|(slot, idled)| s.is_idle(*slot, *idled))
                .map(|(slot, _)| *slot)
                .collect();
            listed.sort_unstable();
            let idle = (s.slab.iter().enumerate())
                .filter(|(_, state)| state.as_ref().is_some_and(|state| state.idle))
                .map(|(slot, _)| slot as u32);
            assert!(listed.into_iter().eq(idle), "every idle entry listed once");
            let oldest_first = |(_, idled): &(u32, u32)| std::cmp::Reverse(s.age(*idled));
            assert!(order.iter().is_sorted_by_key(oldest_first), "listed in order");
        }
    }

    /// Whether key `key` has an entry (queued, running or idle).
    fn tracks<T, K: PoolKey>(s: &PerKey<T, K>, key: &K) -> bool {
        let hash = table_hash(s.hasher.hash_one(key) as u32);
        let entry = |slot: &u32| s.slab[*slot as usize].as_ref().is_some_and(|e| e.key == *key);
        s.index.find(hash, entry).is_some()
    }

    /// Once more keys are idle than are kept, the key that went idle longest ago is forgotten;
    /// a key that came back in the meantime is not idle and is kept (its place in the list is
    /// skipped), and goes idle again as the newest. The order is listed only while idle keys
    /// are at their bound, and read off the entries' stamps each time they reach it.
    #[test]
    fn the_key_idle_longest_is_forgotten_first() {
        let mut s: PerKey<u8, u8> = PerKey::new(100, 10, 100, Box::new(|k| *k));
        s.idle_kept = 4;
        let start = |s: &mut PerKey<u8, u8>, key: u8| {
            s.push(key).unwrap();
            let (slot, item) = s.pop(0).unwrap();
            assert_eq!(item, key);
            slot
        };
        let serve = |s: &mut PerKey<u8, u8>, key: u8| {
            let slot = start(s, key);
            s.done(slot);
            check_tables(s);
        };
        let tracked = |s: &PerKey<u8, u8>| (0..10).filter(|key| tracks(s, key)).collect::<Vec<_>>();
        for key in 0..4 {
            serve(&mut s, key);
        }
        // Key 0 comes back and stays busy while key 4 goes idle: four idle, none forgotten,
        // and no list kept under the bound.
        let zero = start(&mut s, 0);
        serve(&mut s, 4);
        assert_eq!(tracked(&s), [0, 1, 2, 3, 4]);
        assert!(s.idle.is_none(), "no list under the bound");
        // Key 0 goes idle again, the newest: five idle, so key 1, idle longest, goes.
        s.done(zero);
        check_tables(&s);
        assert_eq!(tracked(&s), [0, 2, 3, 4], "key 1 went idle first");
        assert!(s.idle.is_some(), "listed at the bound");
        // Key 2 comes back while listed and goes idle again after key 7: key 3 goes, not 2.
        let two = start(&mut s, 2);
        serve(&mut s, 7);
        s.done(two);
        check_tables(&s);
        assert_eq!(tracked(&s), [0, 2, 4, 7], "key 2's first place was skipped");
        // Every idle key comes back: well under the bound, the list goes at the next idle key.
        let busy: Vec<usize> = [4, 0, 7, 2].into_iter().map(|key| start(&mut s, key)).collect();
        serve(&mut s, 5);
        assert!(s.idle.is_none(), "no list well under the bound");
        // They go idle again in a new order (0, 2, 7, 4 after 5): at the bound again, the
        // order is read off their stamps, and key 5, idle longest, goes.
        for slot in [busy[1], busy[3], busy[2], busy[0]] {
            s.done(slot);
            check_tables(&s);
        }
        assert_eq!(tracked(&s), [0, 2, 4, 7], "key 5 went idle first");
        // The next forgotten is key 0, the first of the four to go idle.
        serve(&mut s, 6);
        assert_eq!(tracked(&s), [2, 4, 6, 7], "key 0 went idle next");
        assert_eq!((s.idle_count, s.keys()), (4, 0));
    }

    #[test]
    fn per_key_serves_keys_in_turn_and_one_at_a_time() {
        let mut s: PerKey<(u8, u32), u8> = PerKey::new(100, 10, 10, Box::new(|(k, _)| *k));
        for (k, n) in [(1, 0), (1, 1), (2, 0), (1, 2), (3, 0)] {
            s.push((k, n)).unwrap();
        }
        let (a, first) = s.pop(0).unwrap();
        assert_eq!(first, (1, 0));
        // Key 1 is running: its next item waits; keys 2 and 3 go meanwhile.
        assert_eq!(s.pop(1).unwrap().1, (2, 0));
        assert_eq!(s.pop(2).unwrap().1, (3, 0));
        assert!(s.pop(3).is_none());
        assert_eq!(s.done(a), Wake::Any);
        assert_eq!(s.pop(0).unwrap().1, (1, 1));
        assert_eq!(s.keys(), 3);
    }

    #[test]
    fn bounds_are_typed() {
        let mut s: PerKey<(u8, u32), u8> = PerKey::new(3, 2, 2, Box::new(|(k, _)| *k));
        s.push((1, 0)).unwrap();
        s.push((1, 1)).unwrap();
        assert_eq!(s.push((1, 2)).unwrap_err().0, Refused::KeyFull);
        s.push((2, 0)).unwrap();
        assert_eq!(s.push((3, 0)).unwrap_err().0, Refused::TooManyKeys);
        assert_eq!(s.push((2, 1)).unwrap_err().0, Refused::Full);
        assert_eq!(s.drain().len(), 3);
        assert_eq!((s.queued(), s.keys()), (0, 0));
        // Rooms handed to waiting producers count against the total bound.
        s.push((1, 0)).unwrap();
        s.reserve(2);
        assert_eq!(s.push((2, 0)).unwrap_err().0, Refused::Full);
        s.reserve(1);
        s.push((2, 0)).unwrap();
        let mut fifo = Fifo::new(2);
        fifo.push(0u8).unwrap();
        fifo.reserve(1);
        assert_eq!(fifo.push(1).unwrap_err().0, Refused::Full);
        fifo.reserve(0);
        fifo.push(1).unwrap();
    }

    /// The entry of a `u64` key whose items are three words (the bench's: a key, a sequence and
    /// the queued stamp) is one cache line, and a free entry costs no more.
    #[test]
    fn an_entry_for_a_small_item_and_key_is_one_cache_line() {
        type Entry = KeyState<(u64, u64, u64), u64>;
        assert_eq!(std::mem::size_of::<Entry>(), 64);
        assert_eq!(std::mem::align_of::<Entry>(), 64);
        assert_eq!(std::mem::size_of::<Option<Entry>>(), 64);
    }

    /// A drain while a key runs empties its queue (items in line and inline alike); items
    /// pushed after it wait for the running one, and none is served twice or lost.
    #[test]
    fn a_key_drained_while_it_runs_queues_again() {
        let mut s: PerKey<(u8, u32), u8> = PerKey::new(100, 10, 10, Box::new(|(k, _)| *k));
        for n in 0..4 {
            s.push((1, n)).unwrap();
        }
        s.push((2, 0)).unwrap();
        let (slot, item) = s.pop(0).unwrap();
        assert_eq!(item, (1, 0));
        let mut drained = s.drain();
        drained.sort_unstable();
        assert_eq!(drained, [(1, 1), (1, 2), (1, 3), (2, 0)]);
        assert_eq!((s.queued(), s.keys()), (0, 1));
        s.push((1, 4)).unwrap();
        s.push((1, 5)).unwrap();
        assert!(s.pop(1).is_none(), "key 1 still runs");
        assert_eq!(s.done(slot), Wake::Any);
        let (slot, item) = s.pop(1).unwrap();
        assert_eq!(item, (1, 4));
        assert_eq!(s.done(slot), Wake::Any);
        let (slot, item) = s.pop(0).unwrap();
        assert_eq!(item, (1, 5));
        assert_eq!(s.done(slot), Wake::None);
        assert!(s.pop(0).is_none());
        assert_eq!((s.queued(), s.keys()), (0, 0));
    }

    #[test]
    fn idle_keys_are_evicted_and_the_table_shrinks() {
        let mut s: PerKey<u32, u32> = PerKey::new(usize::MAX, 1, usize::MAX, Box::new(|k| *k));
        for k in 0..100_000 {
            s.push(k).unwrap();
        }
        let peak = (s.index.capacity(), s.slab.capacity());
        while let Some((slot, _)) = s.pop(0) {
            s.done(slot);
        }
        assert_eq!(s.keys(), 0);
        assert!(s.index.len() <= IDLE_KEPT, "{} idle keys kept", s.index.len());
        assert!(s.index.capacity() <= peak.0 / 2, "{} of {}", s.index.capacity(), peak.0);
        assert!(s.index.capacity() <= 4 * SHRINK_FLOOR, "back to the floor");
        assert!(s.slab.capacity() <= 4 * SHRINK_FLOOR, "slab: {} of {}", s.slab.capacity(), peak.1);
        assert!(s.free.capacity() <= 2 * SHRINK_FLOOR);
        assert!(s.idle.as_ref().map_or(0, VecDeque::capacity) <= 2 * SHRINK_FLOOR);
        check_tables(&s);
        // The kept keys were moved down the slab: each still finds its own entry (a key that
        // did not would get a new one, and the key table would grow).
        let kept = s.index.len();
        for k in 99_900..100_000 {
            s.push(k).unwrap();
        }
        assert_eq!(s.keys(), 100);
        assert_eq!(s.index.len(), kept, "every key came back to its kept entry");
        check_tables(&s);
        let mut back = Vec::new();
        while let Some((slot, k)) = s.pop(0) {
            s.done(slot);
            back.push(k);
        }
        back.sort_unstable();
        assert_eq!(back, (99_900..100_000).collect::<Vec<_>>());
        assert_eq!(s.keys(), 0);
    }

    /// A key whose hash is the same for every key: the key table finds entries by hash and
    /// tells them apart by the key in the entry, through forgetting, reuse and compaction.
    #[test]
    fn keys_whose_hashes_collide_are_told_apart_by_their_entries() {
        #[derive(Clone, PartialEq, Eq)]
        struct Colliding(u32);
        impl std::hash::Hash for Colliding {
            fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
                state.write_u8(7);
            }
        }
        impl PoolKey for Colliding {
            fn key_bytes(&self) -> std::borrow::Cow<'_, [u8]> {
                std::borrow::Cow::Owned(self.0.to_be_bytes().to_vec())
            }
        }
        let mut s: PerKey<(u32, u32), Colliding> =
            PerKey::new(usize::MAX, 8, usize::MAX, Box::new(|(k, _)| Colliding(*k)));
        s.idle_kept = 3;
        let mut next = [0u32; 40];
        for round in 0..5u32 {
            // Two items each for a sliding window of keys: older keys are forgotten, the slab's
            // entries are reused and moved down.
            let keys = (round * 5)..(round * 5 + 20);
            for key in keys.clone().chain(keys.clone()) {
                s.push((key, next[key as usize])).unwrap();
                next[key as usize] += 1;
            }
            assert_eq!((s.queued(), s.keys()), (40, 20));
            let mut seen = [None::<u32>; 40];
            while let Some((slot, (key, seq))) = s.pop(0) {
                assert!(seen[key as usize].is_none_or(|last| seq > last), "key {key} out of order");
                seen[key as usize] = Some(seq);
                s.done(slot);
            }
            for key in keys {
                assert_eq!(seen[key as usize], Some(next[key as usize] - 1), "key {key}");
            }
            assert_eq!((s.queued(), s.keys()), (0, 0));
            assert!(s.index.len() <= 3, "{} idle keys kept", s.index.len());
            check_tables(&s);
            // The kept keys' entries move down the slab (`shrink` waits for a larger slab).
            s.compact();
            assert_eq!(s.slab.len(), s.index.len(), "only the kept entries are left");
            check_tables(&s);
        }
    }

    /// A key's `Hash` runs once per push, before the push changes anything: the tables' upkeep
    /// (a growth, a shrink, an eviction, a compaction, all under the pool's lock) reads the
    /// hash kept in the entry. So a `Hash` that panics after its key was pushed refuses only
    /// the pushes of that key, and the tables stay whole.
    #[test]
    fn a_key_hash_runs_only_at_its_push() {
        thread_local!(static PANICS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
        #[derive(Clone, PartialEq, Eq)]
        struct Touchy(u32);
        impl std::hash::Hash for Touchy {
            fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
                assert!(self.0 != 1 || !PANICS.get(), "key 1 hashed");
                self.0.hash(state);
            }
        }
        impl PoolKey for Touchy {
            fn key_bytes(&self) -> std::borrow::Cow<'_, [u8]> {
                std::borrow::Cow::Owned(self.0.to_be_bytes().to_vec())
            }
        }
        let mut s: PerKey<u32, Touchy> =
            PerKey::new(usize::MAX, 8, usize::MAX, Box::new(|k| Touchy(*k)));
        s.idle_kept = 2;
        // More keys than the tables keep when they empty, so that they shrink and compact
        // below; key 1 last, so that it is running while the others are forgotten.
        let keys = (SHRINK_FLOOR + SHRINK_FLOOR / 2) as u32;
        for key in 2..keys {
            s.push(key).unwrap();
        }
        s.push(1).unwrap();
        PANICS.set(true);
        // The key table grows (a rehash of every key) with key 1 in it.
        let (capacity, mut key) = (s.index.capacity(), keys);
        while s.index.capacity() == capacity {
            s.push(key).unwrap();
            key += 1;
        }
        // Every key runs and goes idle, key 1 last; all but the last two are forgotten, and the
        // tables shrink and compact as they empty (key 1's entry, idle at the slab's end once
        // the entries after it are gone, moves down).
        let peak = (s.index.capacity(), s.slab.capacity());
        let mut last = None;
        while let Some((slot, item)) = s.pop(0) {
            match item {
                1 => last = Some(slot),
                _ => {
                    s.done(slot);
                }
            }
        }
        s.done(last.expect("key 1 ran"));
        assert!(s.index.capacity() < peak.0 && s.slab.capacity() < peak.1, "the tables shrank");
        check_tables(&s);
        let (slab, keys_kept) = (s.slab.len(), s.index.len());
        // A push of key 1 panics in its `Hash` with nothing changed; once it hashes again, it
        // finds its kept entry.
        let pushed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.push(1)));
        assert!(pushed.is_err(), "key 1's push hashed it");
        check_tables(&s);
        assert_eq!((s.slab.len(), s.index.len(), s.queued()), (slab, keys_kept, 0));
        PANICS.set(false);
        assert!(tracks(&s, &Touchy(1)), "key 1, idle last, is kept");
        s.push(1).unwrap();
        check_tables(&s);
        assert_eq!(s.index.len(), keys_kept, "key 1 came back to its entry");
    }

    proptest! {
        /// Against a model: every item is taken exactly once, per-key order holds, a key never
        /// has two items out at once, and bounds hold.
        #[test]
        fn per_key_order_and_exclusivity(
            idle_kept in 1usize..6,
            ops in proptest::collection::vec((0u8..4, 0u8..6, any::<bool>()), 1..300),
        ) {
            let mut s: PerKey<(u8, u32), u8> = PerKey::new(20, 4, 5, Box::new(|(k, _)| *k));
            // Few idle keys kept: keys are forgotten and come back under test, and the list of
            // idle keys comes and goes (from 4 kept: under 2 idle).
            s.idle_kept = idle_kept;
            let mut next_seq = [0u32; 6];
            let mut last_taken: [Option<u32>; 6] = [None; 6];
            let mut out: Vec<(u8, u8, usize)> = Vec::new(); // (worker, key, slot) in flight
            let mut accepted = 0u32;
            let mut taken = 0u32;
            for (worker, key, finish) in ops {
                if finish {
                    if let Some(i) = out.iter().position(|(w, ..)| *w == worker) {
                        let (_, _, slot) = out.remove(i);
                        s.done(slot);
                    }
                } else if out.iter().all(|(w, ..)| *w != worker)
                    && let Some((slot, (k, seq))) = s.pop(usize::from(worker))
                {
                    {
                        prop_assert!(out.iter().all(|(_, busy, _)| *busy != k), "two items of one key out");
                        prop_assert!(out.iter().all(|(.., held)| *held != slot), "one entry, two keys");
                        prop_assert!(last_taken[usize::from(k)].is_none_or(|last| seq > last), "key order");
                        last_taken[usize::from(k)] = Some(seq);
                        out.push((worker, k, slot));
                        taken += 1;
                    }
                }
                let seq = next_seq[usize::from(key)];
                if s.push((key, seq)).is_ok() {
                    next_seq[usize::from(key)] += 1;
                    accepted += 1;
                }
                prop_assert!(s.queued() <= 20);
                prop_assert!(s.keys() <= 5);
                check_tables(&s);
                prop_assert_eq!(accepted, taken + s.queued() as u32);
            }
        }
    }
}
