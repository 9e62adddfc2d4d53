//! A FIFO list of waiting tasks: O(1) push, removal by key and wake of the first, with stale
//! keys detected. The owner keeps it under its own lock and decides what a wake hands over;
//! each waiter may carry a value of its own (`T`) that comes out with it, such as the cell a
//! permit's fencing token is handed over in.
//!
//! Nodes live in a slab (a `Vec` with a free list) linked both ways by index, so removing a
//! waiter that went away (a cancelled future) costs the same as waking the first one, however
//! long the list. A [`WaitKey`] carries a stamp unique to its push: once its node was woken or
//! removed, the key never matches anything again, even when the node is reused.

use std::task::Waker;

const NIL: u32 = u32::MAX;

/// A waiter's place in a [`WaitList`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WaitKey {
    index: u32,
    stamp: u64,
}

impl WaitKey {
    /// A key that never waits: for a waiter handed what it asked for at once.
    pub(crate) const HANDED: Self = Self { index: NIL, stamp: 0 };
}

#[derive(Debug)]
struct Node<T> {
    /// The waiter's waker and what it carries, taken together; `None` once it is gone. One
    /// option, so that a `WaitList<()>`'s node stays as small as a waker alone.
    entry: Option<(Waker, T)>,
    prev: u32,
    next: u32,
    /// The stamp of the push that put the waiter here; 0 when the node is free.
    stamp: u64,
}

/// Waiting tasks in arrival order, each with a `T` of its own.
#[derive(Debug)]
pub(crate) struct WaitList<T = ()> {
    nodes: Vec<Node<T>>,
    free: Vec<u32>,
    head: u32,
    tail: u32,
    len: usize,
    /// The last stamp handed out.
    stamps: u64,
}

impl<T> Default for WaitList<T> {
    fn default() -> Self {
        Self { nodes: Vec::new(), free: Vec::new(), head: NIL, tail: NIL, len: 0, stamps: 0 }
    }
}

impl WaitList {
    /// Adds a waiter at the back.
    #[inline(always)]
    pub(crate) fn push(&mut self, waker: &Waker) -> WaitKey {
        self.push_with(waker, ())
    }

    /// Removes the first waiter and returns its waker.
    #[inline]
    pub(crate) fn pop(&mut self) -> Option<Waker> {
        self.pop_with().map(|(waker, ())| waker)
    }
}

impl<T> WaitList<T> {
    /// An empty list whose stamps continue after `stamps` (another list's
    /// [`stamps`](Self::stamps)): a key from a list that was dropped never matches this one.
    pub(crate) fn after(stamps: u64) -> Self {
        Self { stamps, ..Self::default() }
    }

    /// The last stamp handed out.
    pub(crate) fn stamps(&self) -> u64 {
        self.stamps
    }

    /// Waiters in the list.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Adds a waiter carrying `data` at the back.
    #[inline(always)]
    pub(crate) fn push_with(&mut self, waker: &Waker, data: T) -> WaitKey {
        self.stamps += 1;
        let stamp = self.stamps;
        let node = Node { entry: Some((waker.clone(), data)), prev: self.tail, next: NIL, stamp };
        let index = match self.free.pop() {
            Some(index) => {
                self.nodes[index as usize] = node;
                index
            }
            None => {
                let index = u32::try_from(self.nodes.len()).expect("fewer than 2^32 waiters");
                self.nodes.push(node);
                index
            }
        };
        match self.tail {
            NIL => self.head = index,
            tail => self.nodes[tail as usize].next = index,
        }
        self.tail = index;
        self.len += 1;
        WaitKey { index, stamp }
    }

    /// The first waiter's waker, left in place.
    pub(crate) fn first(&self) -> Option<&Waker> {
        match self.head {
            NIL => None,
            head => self.nodes[head as usize].entry.as_ref().map(|(waker, _)| waker),
        }
    }

    /// Whether `key` still waits (was neither woken nor removed).
    #[inline]
    pub(crate) fn contains(&self, key: WaitKey) -> bool {
        self.nodes.get(key.index as usize).is_some_and(|node| node.stamp == key.stamp)
    }

    /// Registers `waker` for a waiter already in the list; `false` if `key` no longer waits.
    #[inline]
    pub(crate) fn refresh(&mut self, key: WaitKey, waker: &Waker) -> bool {
        if !self.contains(key) {
            return false;
        }
        if let Some((current, _)) = &mut self.nodes[key.index as usize].entry
            && !super::same_waker(current, waker)
        {
            *current = waker.clone();
        }
        true
    }

    /// Removes a waiter that went away; `false` if it was woken (or removed) already.
    pub(crate) fn remove(&mut self, key: WaitKey) -> bool {
        if !self.contains(key) {
            return false;
        }
        self.unlink(key.index);
        true
    }

    /// Removes the first waiter and returns its waker and what it carried.
    #[inline]
    pub(crate) fn pop_with(&mut self) -> Option<(Waker, T)> {
        match self.head {
            NIL => None,
            head => self.unlink(head),
        }
    }

    /// Pops up to `n` waiters' wakers into `out`, in order.
    #[inline]
    pub(crate) fn pop_into(&mut self, n: usize, out: &mut Vec<Waker>) {
        for _ in 0..n {
            match self.pop_with() {
                Some((waker, _)) => out.push(waker),
                None => break,
            }
        }
    }

    /// Clones of every waiter's waker, leaving them in place.
    pub(crate) fn wakers(&self) -> Vec<Waker> {
        let mut out = Vec::with_capacity(self.len);
        let mut at = self.head;
        while at != NIL {
            let node = &self.nodes[at as usize];
            out.extend(node.entry.as_ref().map(|(waker, _)| waker.clone()));
            at = node.next;
        }
        out
    }

    #[inline(always)]
    fn unlink(&mut self, index: u32) -> Option<(Waker, T)> {
        let node = &mut self.nodes[index as usize];
        let (prev, next) = (node.prev, node.next);
        let taken = node.entry.take();
        node.stamp = 0;
        match prev {
            NIL => self.head = next,
            prev => self.nodes[prev as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            next => self.nodes[next as usize].prev = prev,
        }
        self.free.push(index);
        self.len -= 1;
        if self.len == 0 && self.nodes.len() > 64 {
            // A burst of waiters is over: give its memory back.
            self.nodes.clear();
            self.free.clear();
            self.nodes.shrink_to(64);
        }
        taken
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    use proptest::prelude::*;

    use super::*;

    /// A waker that says who it is by counting its wakes in a shared table.
    struct Tagged(usize, Arc<Vec<AtomicUsize>>);

    impl Wake for Tagged {
        fn wake(self: Arc<Self>) {
            self.1[self.0].fetch_add(1, Ordering::SeqCst);
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Push,
        Pop,
        Remove(usize),
        Refresh(usize),
    }

    proptest! {
        /// Against a `VecDeque` of ids: the same waiters come out first, a removal takes out
        /// exactly that waiter, a key is dead once its waiter was woken or removed, and a
        /// refreshed waker is the one woken.
        #[test]
        fn matches_a_vecdeque_model(ops in proptest::collection::vec(
            prop_oneof![
                4 => Just(Op::Push),
                3 => Just(Op::Pop),
                2 => (0usize..64).prop_map(Op::Remove),
                1 => (0usize..64).prop_map(Op::Refresh),
            ],
            1..300,
        )) {
            let wakes = Arc::new((0..400).map(|_| AtomicUsize::new(0)).collect::<Vec<_>>());
            let waker = |id: usize| Waker::from(Arc::new(Tagged(id, wakes.clone())));
            let mut list = WaitList::default();
            let mut model: VecDeque<usize> = VecDeque::new();
            let mut keys: Vec<WaitKey> = Vec::new();
            let mut woken = Vec::new();
            for op in ops {
                match op {
                    Op::Push => {
                        let id = keys.len();
                        keys.push(list.push(&waker(id)));
                        model.push_back(id);
                    }
                    Op::Pop => {
                        let popped = list.pop();
                        prop_assert_eq!(popped.is_some(), !model.is_empty());
                        if let Some(w) = popped {
                            let id = model.pop_front().unwrap();
                            w.wake();
                            woken.push(id);
                            prop_assert!(!list.contains(keys[id]));
                        }
                    }
                    Op::Remove(i) if i < keys.len() => {
                        let waiting = model.contains(&i);
                        prop_assert_eq!(list.remove(keys[i]), waiting);
                        model.retain(|&id| id != i);
                        prop_assert!(!list.contains(keys[i]));
                    }
                    Op::Refresh(i) if i < keys.len() => {
                        // Refreshed with a waker tagged 200 + i: a later wake must come there.
                        let waiting = model.contains(&i);
                        prop_assert_eq!(list.refresh(keys[i], &waker(200 + i)), waiting);
                    }
                    Op::Remove(_) | Op::Refresh(_) => {}
                }
                prop_assert_eq!(list.len(), model.len());
                for (id, key) in keys.iter().enumerate() {
                    prop_assert_eq!(list.contains(*key), model.contains(&id));
                }
            }
            // Each woken waiter was woken once, through its latest waker.
            for id in woken {
                let total = wakes[id].load(Ordering::SeqCst) + wakes[200 + id].load(Ordering::SeqCst);
                prop_assert_eq!(total, 1, "waiter {} woken {} times", id, total);
            }
        }
    }

    #[test]
    fn a_stale_key_never_matches_a_reused_node() {
        let waker = Waker::noop().clone();
        let mut list = WaitList::default();
        let first = list.push(&waker);
        assert!(list.pop().is_some());
        let second = list.push(&waker);
        assert_ne!(first, second, "the node is reused with a new stamp");
        assert!(!list.remove(first), "the old key does not remove the new waiter");
        assert!(list.contains(second));
    }

    #[test]
    fn memory_is_given_back_after_a_burst() {
        let waker = Waker::noop().clone();
        let mut list = WaitList::default();
        let keys: Vec<_> = (0..10_000).map(|_| list.push(&waker)).collect();
        for key in keys {
            assert!(list.remove(key));
        }
        assert!(list.is_empty());
        assert!(list.nodes.capacity() <= 64);
    }
}
