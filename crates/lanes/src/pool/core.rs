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
//!   and nothing running is forgotten at once (idle eviction), and the key table shrinks when it
//!   is mostly empty, so memory returns to baseline after a burst of keys.

use std::collections::VecDeque;

use super::fnv::{PoolKey, fnv1a64};
use crate::util::FastMap;

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

    fn push(&mut self, item: T) -> Result<Wake, (Refused, T)>;
    fn pop(&mut self, worker: usize) -> Option<(Self::Slot, T)>;
    /// The item taken with `slot` is done.
    fn done(&mut self, slot: Self::Slot) -> Wake;
    fn queued(&self) -> usize;
    fn keys(&self) -> usize;
    /// Takes every queued item out (for abort), in no particular order.
    fn drain(&mut self) -> Vec<T>;
}

/// One queue, any worker, submit order.
#[derive(Debug)]
pub(crate) struct Fifo<T> {
    queue: VecDeque<T>,
    capacity: usize,
}

impl<T> Fifo<T> {
    pub(crate) fn new(capacity: usize) -> Self {
        Self { queue: VecDeque::new(), capacity }
    }
}

impl<T: Send + 'static> Scheduler<T> for Fifo<T> {
    type Slot = ();

    fn push(&mut self, item: T) -> Result<Wake, (Refused, T)> {
        if self.queue.len() >= self.capacity {
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

    fn keys(&self) -> usize {
        0
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

    fn keys(&self) -> usize {
        0
    }

    fn drain(&mut self) -> Vec<T> {
        self.queued = 0;
        self.shards.iter_mut().flat_map(|s| s.drain(..)).collect()
    }
}

/// A key's queue. A key with a single queued item (the common case) keeps it inline, so a
/// burst of distinct keys allocates nothing per key beyond the key table itself.
struct KeyState<T> {
    first: Option<T>,
    more: VecDeque<T>,
    running: bool,
}

impl<T> KeyState<T> {
    fn len(&self) -> usize {
        usize::from(self.first.is_some()) + self.more.len()
    }

    fn push(&mut self, item: T) {
        if self.first.is_none() && self.more.is_empty() {
            self.first = Some(item);
        } else {
            self.more.push_back(item);
        }
    }

    fn pop(&mut self) -> Option<T> {
        self.first.take().or_else(|| self.more.pop_front())
    }
}

/// Per-key FIFO queues scheduled onto any worker, one item per key at a time.
pub(crate) struct PerKey<T, K> {
    keys: FastMap<K, KeyState<T>>,
    /// Keys with queued items and none running, in the order they became ready.
    ready: VecDeque<K>,
    key_of: Box<dyn Fn(&T) -> K + Send + Sync>,
    queued: usize,
    max_queued: usize,
    max_per_key: usize,
    max_keys: usize,
}

impl<T, K: PoolKey> PerKey<T, K> {
    pub(crate) fn new(
        max_queued: usize,
        max_per_key: usize,
        max_keys: usize,
        key_of: Box<dyn Fn(&T) -> K + Send + Sync>,
    ) -> Self {
        Self {
            keys: FastMap::default(),
            ready: VecDeque::new(),
            key_of,
            queued: 0,
            max_queued,
            max_per_key,
            max_keys,
        }
    }

    /// Gives memory back once the key table is mostly empty after a burst of keys. Tables up
    /// to `SHRINK_FLOOR` entries are kept, so steady traffic does not grow and shrink them over
    /// and over; that floor is the baseline memory returns to.
    fn shrink(&mut self) {
        const SHRINK_FLOOR: usize = 16_384;
        let (len, capacity) = (self.keys.len(), self.keys.capacity());
        if capacity > SHRINK_FLOOR && len < capacity / 8 {
            self.keys.shrink_to((len * 2).max(SHRINK_FLOOR));
        }
        if self.ready.capacity() > SHRINK_FLOOR && self.ready.len() < self.ready.capacity() / 8 {
            self.ready.shrink_to((self.ready.len() * 2).max(SHRINK_FLOOR));
        }
    }
}

impl<T: Send + 'static, K: PoolKey> Scheduler<T> for PerKey<T, K> {
    type Slot = K;

    fn push(&mut self, item: T) -> Result<Wake, (Refused, T)> {
        let key = (self.key_of)(&item);
        let known = self.keys.get(&key);
        match known {
            Some(state) if state.len() >= self.max_per_key => {
                return Err((Refused::KeyFull, item));
            }
            None if self.keys.len() >= self.max_keys => return Err((Refused::TooManyKeys, item)),
            _ => {}
        }
        if self.queued >= self.max_queued {
            return Err((Refused::Full, item));
        }
        self.queued += 1;
        let state = self.keys.entry(key.clone()).or_insert_with(|| KeyState {
            first: None,
            more: VecDeque::new(),
            running: false,
        });
        state.push(item);
        if !state.running && state.len() == 1 {
            self.ready.push_back(key);
            Ok(Wake::Any)
        } else {
            Ok(Wake::None)
        }
    }

    fn pop(&mut self, _worker: usize) -> Option<(K, T)> {
        let key = self.ready.pop_front()?;
        let state = self.keys.get_mut(&key).expect("a ready key is tracked");
        let item = state.pop().expect("a ready key has an item");
        state.running = true;
        self.queued -= 1;
        Some((key, item))
    }

    fn done(&mut self, key: K) -> Wake {
        let Some(state) = self.keys.get_mut(&key) else {
            return Wake::None;
        };
        state.running = false;
        if state.len() == 0 {
            self.keys.remove(&key);
            self.shrink();
            Wake::None
        } else {
            self.ready.push_back(key);
            Wake::Any
        }
    }

    fn queued(&self) -> usize {
        self.queued
    }

    fn keys(&self) -> usize {
        self.keys.len()
    }

    fn drain(&mut self) -> Vec<T> {
        self.queued = 0;
        self.ready.clear();
        let mut out = Vec::new();
        self.keys.retain(|_, state| {
            out.extend(state.first.take());
            out.extend(state.more.drain(..));
            state.running
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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
    }

    #[test]
    fn idle_keys_are_evicted_and_the_table_shrinks() {
        let mut s: PerKey<u32, u32> = PerKey::new(usize::MAX, 1, usize::MAX, Box::new(|k| *k));
        for k in 0..100_000 {
            s.push(k).unwrap();
        }
        let peak = s.keys.capacity();
        while let Some((key, _)) = s.pop(0) {
            s.done(key);
        }
        assert_eq!(s.keys(), 0);
        assert!(s.keys.capacity() < peak / 3, "{} of {peak}", s.keys.capacity());
        assert!(s.keys.capacity() <= 2 * 16_384, "back to the floor: {}", s.keys.capacity());
    }

    proptest! {
        /// Against a model: every item is taken exactly once, per-key order holds, a key never
        /// has two items out at once, and bounds hold.
        #[test]
        fn per_key_order_and_exclusivity(ops in proptest::collection::vec((0u8..4, 0u8..6, any::<bool>()), 1..300)) {
            let mut s: PerKey<(u8, u32), u8> = PerKey::new(20, 4, 5, Box::new(|(k, _)| *k));
            let mut next_seq = [0u32; 6];
            let mut last_taken: [Option<u32>; 6] = [None; 6];
            let mut out: Vec<(u8, u8)> = Vec::new(); // (worker, key) in flight
            let mut accepted = 0u32;
            let mut taken = 0u32;
            for (worker, key, finish) in ops {
                if finish {
                    if let Some(i) = out.iter().position(|(w, _)| *w == worker) {
                        let (_, k) = out.remove(i);
                        s.done(k);
                    }
                } else if out.iter().all(|(w, _)| *w != worker)
                    && let Some((k, (item_key, seq))) = s.pop(usize::from(worker))
                {
                    {
                        prop_assert_eq!(k, item_key);
                        prop_assert!(out.iter().all(|(_, busy)| *busy != k), "two items of one key out");
                        prop_assert!(last_taken[usize::from(k)].is_none_or(|last| seq > last), "key order");
                        last_taken[usize::from(k)] = Some(seq);
                        out.push((worker, k));
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
                prop_assert_eq!(accepted, taken + s.queued() as u32);
            }
        }
    }
}
