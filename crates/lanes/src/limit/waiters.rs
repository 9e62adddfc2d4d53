//! The wait queue of a limit: priority levels, weighted round-robin over fairness keys, arrival
//! order within a key. A pure, deterministic state machine.
//!
//! # Invariants
//!
//! 1. Every waiting ticket is in exactly one key queue, or in the plain queue, and `index`
//!    maps it there. The plain queue holds waiters only while `levels` is empty: it is the
//!    whole queue of a limit whose waiters all have the default priority, served in arrival
//!    order without the levels' lookups.
//! 2. A key is in its level's rotation iff its queue is non-empty; a level is in `levels` iff
//!    it has a key. A key joins the end of the rotation, so one that empties and comes back
//!    goes last. A key with waiters has a slot in its level: `keys` maps the key to it, `slots`
//!    holds its queue and its neighbours in the rotation (a list through the slots, from
//!    `first` to `last`), and a waiting ticket's place names it (a pop neither hashes the key,
//!    counts a reference to it nor searches an ordered map for the next key); an emptied key's
//!    slot is free (`None`, in `free`) for the next key.
//! 3. Nothing depends on a hash map's order (levels are a `BTreeMap`, the rotation a list):
//!    identical operation sequences give identical answers, which is what lets a replicated
//!    store apply the same queue.
//! 4. A level with a single key has no turn: a lone key is served in arrival order, and when a
//!    second key arrives the rotation starts with a fresh turn of the first. (So the turn never
//!    needs saving for a default-priority queue, whose saved form is a plain list.)

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::priority::Priority;
use crate::util::FastMap;

type FairKey = Option<Arc<str>>;

/// Emptied ticket lists (of at most 16 places) a level keeps for its next keys.
const SPARE_LISTS: usize = 64;

/// No slot: the end of the rotation's list.
const NIL: u32 = u32::MAX;

/// Marks a withdrawn entry of a [`Line`] (the top bit of its arrival sequence, which never
/// reaches it).
const WITHDRAWN: u64 = 1 << 63;

/// Waiting tickets in arrival order: `(arrival sequence, ticket)`, sequences increasing.
///
/// A ticket withdrawn from the middle (its caller timed out or went away) is marked, not
/// shifted out: with 100,000 waiters on a limit, a removal that moved a quarter of the line
/// on average made a mass withdrawal quadratic, all of it under the limit's lock. Marked
/// entries are dropped when they reach the front, and the line is compacted when they are
/// more than half of it, so a withdrawal is amortized O(log n) (the search by sequence) and
/// the line's memory at most twice its waiters'. The front is never a marked entry: `front`
/// and `pop_front` need no skipping, and a line with no waiters is empty.
#[derive(Debug, Clone, Default)]
struct Line {
    entries: VecDeque<(u64, u64)>,
    withdrawn: usize,
}

impl Line {
    fn push_back(&mut self, seq: u64, ticket: u64) {
        self.entries.push_back((seq, ticket));
    }

    /// The first waiting ticket.
    fn front(&self) -> Option<u64> {
        self.entries.front().map(|(_, ticket)| *ticket)
    }

    /// Takes the first waiting ticket.
    fn pop_front(&mut self) -> Option<u64> {
        let (_, ticket) = self.entries.pop_front()?;
        self.drop_withdrawn_front();
        Some(ticket)
    }

    /// Withdraws the ticket that arrived as `seq` (the index says it waits here), wherever it
    /// is.
    fn withdraw(&mut self, seq: u64) {
        if self.entries.front().is_some_and(|(first, _)| *first == seq) {
            self.pop_front();
            return;
        }
        let Ok(at) = self.entries.binary_search_by_key(&seq, |(seq, _)| seq & !WITHDRAWN) else {
            return;
        };
        let entry = &mut self.entries[at].0;
        debug_assert_eq!(*entry & WITHDRAWN, 0, "a ticket is withdrawn once");
        *entry |= WITHDRAWN;
        self.withdrawn += 1;
        if self.withdrawn * 2 > self.entries.len() {
            self.entries.retain(|(seq, _)| seq & WITHDRAWN == 0);
            self.withdrawn = 0;
        }
    }

    fn drop_withdrawn_front(&mut self) {
        while self.withdrawn > 0
            && self.entries.front().is_some_and(|(seq, _)| seq & WITHDRAWN != 0)
        {
            self.entries.pop_front();
            self.withdrawn -= 1;
        }
    }

    /// Waiting tickets.
    fn len(&self) -> usize {
        self.entries.len() - self.withdrawn
    }

    fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Waiting tickets in arrival order.
    fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.entries.iter().filter(|(seq, _)| seq & WITHDRAWN == 0).map(|(_, ticket)| *ticket)
    }
}

/// Where a waiting ticket is: its level, its arrival sequence and its key's slot in the
/// level (so that a pop or a removal finds its key without hashing it or counting a reference
/// to it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Loc {
    level: i32,
    seq: u64,
    slot: u32,
}

/// Tickets in a [`Block`] of the index.
const BLOCK: u64 = 8;

// A block's mask has a bit per ticket.
const _: () = assert!(BLOCK <= u8::BITS as u64);

/// The places of waiting tickets, by ticket: blocks of [`BLOCK`] consecutive ticket numbers
/// in a hash map, each with a mask of the tickets in it that wait.
///
/// Tickets are handed out in increasing order, so the tickets pushed one after another share
/// a block, and so (in a plain line, and in a rotation over keys that each hold a few) do the
/// tickets popped one after another: with 100,000 fairness keys, a map of single tickets put
/// each push and each pop on a line of memory of its own, where a block serves eight. The
/// blocks land at random places (a hash of the block's number), so no run of them clusters
/// in the table; and a plain line empties a block, and leaves a gap in the table, once per
/// eight pops rather than on each.
///
/// Memory: a bucket of the map is 145 bytes (the block's number, its mask, eight places of
/// 16 bytes, a control byte), against 25 for a map of single tickets. Consecutive tickets
/// share it: about 18 bytes a waiter before the map's spare room (it is 7/16 to 7/8 full).
/// At worst a block holds one waiter: 145 bytes before the spare room, about 165–330 with
/// it, against about 30–60. That is the case when a limit's waiting tickets are far apart:
/// one backend's tickets spread over many busy limits, or the tickets of many remote clients,
/// which each start at a random offset.
#[derive(Debug, Clone, Default)]
struct TicketIndex {
    blocks: FastMap<u64, Block>,
    len: usize,
}

#[derive(Debug, Clone, Copy, Default)]
struct Block {
    /// Bit `i` is set while ticket `BLOCK * number + i` waits.
    live: u8,
    places: [Loc; BLOCK as usize],
}

/// A ticket's block number and its bit in the block.
fn block_of(ticket: u64) -> (u64, usize) {
    (ticket / BLOCK, (ticket % BLOCK) as usize)
}

impl TicketIndex {
    fn len(&self) -> usize {
        self.len
    }

    fn contains(&self, ticket: u64) -> bool {
        let (number, at) = block_of(ticket);
        self.blocks.get(&number).is_some_and(|block| block.live & (1 << at) != 0)
    }

    /// The place to fill for `ticket`, now counted as waiting; `None` if it waits already.
    fn claim(&mut self, ticket: u64) -> Option<&mut Loc> {
        let (number, at) = block_of(ticket);
        let block = self.blocks.entry(number).or_default();
        if block.live & (1 << at) != 0 {
            return None;
        }
        block.live |= 1 << at;
        self.len += 1;
        Some(&mut block.places[at])
    }

    /// Takes `ticket` out; its place if it waited. (Not through `entry`, which makes room for
    /// an insert first: a ticket that does not wait could grow the map.)
    fn remove(&mut self, ticket: u64) -> Option<Loc> {
        let (number, at) = block_of(ticket);
        let block = self.blocks.get_mut(&number)?;
        if block.live & (1 << at) == 0 {
            return None;
        }
        block.live &= !(1 << at);
        let place = block.places[at];
        if block.live == 0 {
            self.blocks.remove(&number);
        }
        self.len -= 1;
        Some(place)
    }

    /// Every waiting ticket, in no particular order.
    fn tickets(&self) -> impl Iterator<Item = u64> + '_ {
        self.blocks.iter().flat_map(|(number, block)| {
            (0..BLOCK).filter(|at| block.live & (1 << at) != 0).map(move |at| number * BLOCK + at)
        })
    }
}

#[derive(Debug, Clone)]
struct KeyQueue {
    key: FairKey,
    weight: u32,
    /// The slots before and after this key in the rotation ([`NIL`] at its ends).
    prev: u32,
    next: u32,
    tickets: Line,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Turn {
    slot: u32,
    used: u32,
}

#[derive(Debug, Clone)]
struct Level {
    /// A key's slot in `slots`, found by hashing; never iterated in the map's order (service
    /// order is the rotation's).
    keys: FastMap<FairKey, u32>,
    /// The keys with waiters; `None` for a free slot (listed in `free`).
    slots: Vec<Option<KeyQueue>>,
    free: Vec<u32>,
    /// Emptied ticket lists kept for the next keys (see [`SPARE_LISTS`]): a key that comes
    /// and goes allocates nothing.
    spare: Vec<Line>,
    /// The rotation's first and last slots ([`NIL`] while it is empty).
    first: u32,
    last: u32,
    /// The key whose turn it is, and the grants it has had in this turn. Always a key in the
    /// rotation: a key that leaves passes its turn to the next one.
    turn: Option<Turn>,
}

impl Default for Level {
    fn default() -> Self {
        Self {
            keys: FastMap::default(),
            slots: Vec::new(),
            free: Vec::new(),
            spare: Vec::new(),
            first: NIL,
            last: NIL,
            turn: None,
        }
    }
}

impl Level {
    fn queue(&self, slot: u32) -> &KeyQueue {
        self.slots[slot as usize].as_ref().expect("a slot in the rotation holds a key")
    }

    fn queue_mut(&mut self, slot: u32) -> &mut KeyQueue {
        self.slots[slot as usize].as_mut().expect("a slot in the rotation holds a key")
    }

    /// Takes a slot for `key`, at the end of the rotation; returns it.
    fn add_key(&mut self, key: FairKey, weight: u32, first: (u64, u64)) -> u32 {
        let mut tickets = self.spare.pop().unwrap_or_default();
        tickets.push_back(first.0, first.1);
        let prev = self.last;
        let queue = KeyQueue { key: key.clone(), weight, prev, next: NIL, tickets };
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some(queue);
                slot
            }
            None => {
                self.slots.push(Some(queue));
                let slot = u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 - 1 keys");
                assert_ne!(slot, NIL, "fewer than 2^32 - 1 keys");
                slot
            }
        };
        match prev {
            NIL => self.first = slot,
            prev => self.queue_mut(prev).next = slot,
        }
        self.last = slot;
        self.keys.insert(key, slot);
        slot
    }

    /// Takes `slot`'s key out of the rotation, passing its turn (if it has it) to the next key.
    fn unlink_key(&mut self, slot: u32, queue: &KeyQueue) {
        match queue.prev {
            NIL => self.first = queue.next,
            prev => self.queue_mut(prev).next = queue.next,
        }
        match queue.next {
            NIL => self.last = queue.prev,
            next => self.queue_mut(next).prev = queue.prev,
        }
        if self.turn.is_some_and(|turn| turn.slot == slot) {
            self.turn = (queue.next != NIL).then_some(Turn { slot: queue.next, used: 0 });
        }
    }

    /// The slot of the key whose head is served next: the key whose turn it is while it has
    /// grants left in it, then the next key, wrapping round to the first.
    fn next_key(&self) -> Option<u32> {
        if let Some(turn) = self.turn {
            let queue = self.queue(turn.slot);
            if turn.used < queue.weight {
                return Some(turn.slot);
            }
            if queue.next != NIL {
                return Some(queue.next);
            }
        }
        (self.first != NIL).then_some(self.first)
    }

    /// The keys' slots in rotation order.
    fn rotation(&self) -> impl Iterator<Item = u32> + '_ {
        let mut slot = self.first;
        std::iter::from_fn(move || {
            let at = slot;
            (at != NIL).then(|| {
                slot = self.queue(at).next;
                at
            })
        })
    }
}

/// Waiters of one limit, in the order they are served. See the [module docs](super) for the
/// ordering rules.
///
/// Serializes (serde) as the plain arrival-order list of tickets when every waiter has the
/// default priority, and as its levels otherwise.
///
/// # Examples
///
/// ```
/// use lanes::{Priority, WaitQueue};
///
/// let mut queue = WaitQueue::new();
/// queue.push(1, &Priority::default().key("a"));
/// queue.push(2, &Priority::default().key("a"));
/// queue.push(3, &Priority::default().key("b"));
/// queue.push(4, &Priority::level(5));
/// assert_eq!(queue.pop(), Some(4)); // the highest level first
/// assert_eq!(queue.pop(), Some(1)); // then "a" and "b" take turns
/// assert_eq!(queue.pop(), Some(3));
/// assert_eq!(queue.pop(), Some(2));
/// assert_eq!(queue.pop(), None);
/// ```
#[derive(Debug, Clone, Default)]
pub struct WaitQueue {
    /// While every waiter has the default priority: `(arrival sequence, ticket)` in arrival
    /// order, and `levels` is empty (a plain FIFO, which a default-priority concurrency limit
    /// uses all its life). The first push of another priority moves these into `levels` as
    /// level 0's one unkeyed queue, which serves them in the same order.
    plain: Line,
    levels: BTreeMap<i32, Level>,
    /// Found by hashing; listed only by [`tickets`](Self::tickets), which sorts the list.
    index: TicketIndex,
    next_seq: u64,
    /// The ticket served next ([`find_head`](Self::find_head)), found again after every change
    /// that can move it rather than on every [`peek`](Self::peek): a limit's owner asks for the
    /// head several times per change (whether to grant, what to wake, which timer to arm).
    head: Option<u64>,
}

impl WaitQueue {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// Waiters in the queue.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether nobody waits.
    pub fn is_empty(&self) -> bool {
        self.index.len() == 0
    }

    /// How many tickets wait per fairness key.
    pub fn waiting_by_key(&self) -> BTreeMap<Option<Arc<str>>, usize> {
        let mut waiting = BTreeMap::new();
        if !self.plain.is_empty() {
            waiting.insert(None, self.plain.len());
        }
        for level in self.levels.values() {
            for queue in level.slots.iter().flatten() {
                *waiting.entry(queue.key.clone()).or_insert(0) += queue.tickets.len();
            }
        }
        waiting
    }

    /// Whether `ticket` waits here.
    pub fn contains(&self, ticket: u64) -> bool {
        self.index.contains(ticket)
    }

    /// Adds `ticket` at `priority`. Returns false (and changes nothing) if it already waits: a
    /// waiter keeps the priority it first asked with. O(1) expected (a hash of the ticket and
    /// of the fairness key), plus O(log l) for l priority levels in use.
    pub fn push(&mut self, ticket: u64, priority: &Priority) -> bool {
        if self.levels.is_empty() && priority.is_default() {
            // The plain queue: one probe of the index both checks and inserts.
            let Some(place) = self.index.claim(ticket) else {
                return false;
            };
            self.next_seq += 1;
            let seq = self.next_seq;
            *place = Loc { level: 0, seq, slot: 0 };
            self.plain.push_back(seq, ticket);
            if self.plain.len() == 1 {
                self.head = Some(ticket);
            }
            return true;
        }
        let Some(place) = self.index.claim(ticket) else {
            return false;
        };
        Self::leave_plain(&mut self.plain, &mut self.levels);
        self.next_seq += 1;
        let seq = self.next_seq;
        let key = &priority.fairness_key;
        // The head can move only if the ticket goes to the top level (or above it), and there
        // either starts a key or changes a key's weight; behind a key's last waiter it cannot.
        let top = self.levels.last_key_value().map(|(level, _)| *level);
        let mut head_moves = top.is_none_or(|top| priority.level > top);
        let level = self.levels.entry(priority.level).or_default();
        let weight = priority.effective_weight();
        let slot = match level.keys.get(key) {
            Some(&slot) => {
                let queue = level.queue_mut(slot);
                head_moves |= top == Some(priority.level) && queue.weight != weight;
                queue.weight = weight;
                queue.tickets.push_back(seq, ticket);
                slot
            }
            None => {
                head_moves |= top == Some(priority.level);
                level.add_key(key.clone(), weight, (seq, ticket))
            }
        };
        *place = Loc { level: priority.level, seq, slot };
        if head_moves {
            self.head = self.find_head();
        }
        true
    }

    /// Moves the plain queue's waiters into `levels`, as level 0's one unkeyed queue (a lone
    /// key has no turn, invariant 4), before a push of another priority.
    fn leave_plain(plain: &mut Line, levels: &mut BTreeMap<i32, Level>) {
        if plain.is_empty() {
            return;
        }
        let tickets = std::mem::take(plain);
        let mut level = Level::default();
        level.slots.push(Some(KeyQueue { key: None, weight: 1, prev: NIL, next: NIL, tickets }));
        (level.first, level.last) = (0, 0);
        level.keys.insert(None, 0);
        levels.insert(0, level);
    }

    /// The ticket served next, if any. O(1).
    pub fn peek(&self) -> Option<u64> {
        self.head
    }

    /// The ticket served next, found in the levels. O(log l) for l priority levels in use.
    fn find_head(&self) -> Option<u64> {
        if let Some(ticket) = self.plain.front() {
            return Some(ticket);
        }
        let (_, level) = self.levels.last_key_value()?;
        let slot = level.next_key()?;
        level.queue(slot).tickets.front()
    }

    /// Serves the next ticket. O(1) expected, plus O(log l) for l priority levels in use.
    pub fn pop(&mut self) -> Option<u64> {
        let ticket = self.peek()?;
        let loc = self.index.remove(ticket)?;
        if let Some(first) = self.plain.pop_front() {
            debug_assert_eq!(first, ticket, "the plain queue's head is the head");
            self.head = self.plain.front();
            return Some(ticket);
        }
        let level = self.levels.get_mut(&loc.level)?;
        let weight = level.queue(loc.slot).weight;
        let slot = loc.slot;
        level.turn = Some(match level.turn {
            Some(turn) if turn.slot == slot && turn.used < weight => {
                Turn { slot, used: turn.used + 1 }
            }
            _ => Turn { slot, used: 1 },
        });
        Self::unlink(&mut self.levels, loc);
        self.head = self.find_head();
        Some(ticket)
    }

    /// Takes `ticket` out of the queue wherever it is. Returns whether it was waiting.
    /// Amortized O(log k) for k tickets waiting under its key (a search by arrival order; the
    /// entry is marked, and dropped when it reaches the front or the key's line is compacted),
    /// plus O(log l) for l priority levels in use.
    pub fn remove(&mut self, ticket: u64) -> bool {
        let Some(loc) = self.index.remove(ticket) else {
            return false;
        };
        if !self.plain.is_empty() {
            self.plain.withdraw(loc.seq);
            self.head = self.plain.front();
            return true;
        }
        Self::unlink(&mut self.levels, loc);
        self.head = self.find_head();
        true
    }

    /// Drops one waiter from its key queue, and the key and level if they empty (invariant 2).
    fn unlink(levels: &mut BTreeMap<i32, Level>, loc: Loc) {
        let Some(level) = levels.get_mut(&loc.level) else {
            return;
        };
        let Some(queue) = level.slots.get_mut(loc.slot as usize).and_then(Option::as_mut) else {
            return;
        };
        queue.tickets.withdraw(loc.seq);
        if queue.tickets.is_empty() {
            let queue = level.slots[loc.slot as usize].take().expect("matched above");
            level.unlink_key(loc.slot, &queue);
            level.keys.remove(&queue.key);
            level.free.push(loc.slot);
            // Small ones only: a burst's long list is given back.
            if level.spare.len() < SPARE_LISTS && queue.tickets.entries.capacity() <= 16 {
                level.spare.push(queue.tickets);
            }
            if level.keys.is_empty() {
                levels.remove(&loc.level);
                return;
            }
        }
        if level.keys.len() == 1 {
            level.turn = None;
        }
    }

    /// Every waiting ticket, in ascending ticket order (not the order of service).
    pub fn tickets(&self) -> impl Iterator<Item = u64> + '_ {
        let mut tickets: Vec<u64> = self.index.tickets().collect();
        tickets.sort_unstable();
        tickets.into_iter()
    }

    fn repr(&self) -> Repr {
        if !self.plain.is_empty() {
            return Repr::Fifo(self.plain.iter().collect());
        }
        let only_default = self.levels.len() <= 1
            && self.levels.iter().all(|(level, l)| {
                *level == 0
                    && l.keys.len() == 1
                    && l.slots.iter().flatten().all(|q| q.key.is_none() && q.weight == 1)
            });
        if only_default {
            let tickets = self
                .levels
                .values()
                .flat_map(|l| l.slots.iter().flatten())
                .flat_map(|q| q.tickets.iter())
                .collect();
            return Repr::Fifo(tickets);
        }
        let levels = self
            .levels
            .iter()
            .rev()
            .map(|(level, l)| LevelRepr {
                level: *level,
                turn: l
                    .turn
                    .map(|turn| TurnRepr { key: l.queue(turn.slot).key.clone(), used: turn.used }),
                keys: l
                    .rotation()
                    .map(|slot| {
                        let q = l.queue(slot);
                        KeyRepr {
                            key: q.key.clone(),
                            weight: q.weight,
                            tickets: q.tickets.iter().collect(),
                        }
                    })
                    .collect(),
            })
            .collect();
        Repr::Levels(levels)
    }

    fn from_repr(repr: Repr) -> Result<Self, String> {
        let mut queue = WaitQueue::new();
        let duplicate = |t: u64| format!("ticket {t} appears twice");
        match repr {
            Repr::Fifo(tickets) => {
                for ticket in tickets {
                    if !queue.push(ticket, &Priority::default()) {
                        return Err(duplicate(ticket));
                    }
                }
            }
            Repr::Levels(levels) => {
                for level in levels {
                    for key in &level.keys {
                        if key.tickets.is_empty() {
                            return Err("a key with no tickets".to_owned());
                        }
                        let priority = Priority {
                            level: level.level,
                            fairness_key: key.key.clone(),
                            fairness_weight: key.weight,
                        };
                        for ticket in &key.tickets {
                            if !queue.push(*ticket, &priority) {
                                return Err(duplicate(*ticket));
                            }
                        }
                    }
                    if let Some(turn) = level.turn
                        && let Some(l) = queue.levels.get_mut(&level.level)
                        && let Some(&slot) = l.keys.get(&turn.key)
                    {
                        l.turn = Some(Turn { slot, used: turn.used });
                    }
                }
            }
        }
        // The turns restored above may move the head.
        queue.head = queue.find_head();
        Ok(queue)
    }
}

/// Two queues are equal when they serve the same tickets in the same order from now on.
impl PartialEq for WaitQueue {
    fn eq(&self, other: &Self) -> bool {
        self.repr() == other.repr()
    }
}

impl Eq for WaitQueue {}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
enum Repr {
    /// Default priority only: the arrival order.
    Fifo(Vec<u64>),
    /// Highest level first; keys in rotation order.
    Levels(Vec<LevelRepr>),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct LevelRepr {
    level: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    turn: Option<TurnRepr>,
    keys: Vec<KeyRepr>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct TurnRepr {
    key: FairKey,
    used: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct KeyRepr {
    key: FairKey,
    weight: u32,
    tickets: Vec<u64>,
}

impl Serialize for WaitQueue {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.repr().serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for WaitQueue {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let repr = Repr::deserialize(deserializer)?;
        WaitQueue::from_repr(repr).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(k: &str) -> Priority {
        Priority::default().key(k)
    }

    fn drain(queue: &mut WaitQueue) -> Vec<u64> {
        std::iter::from_fn(|| queue.pop()).collect()
    }

    #[test]
    fn default_priority_is_arrival_order() {
        let mut queue = WaitQueue::new();
        for ticket in [5, 3, 9, 1] {
            assert!(queue.push(ticket, &Priority::default()));
        }
        assert!(!queue.push(3, &Priority::level(9)), "a waiter keeps its first priority");
        assert!(queue.remove(9));
        assert!(!queue.remove(9));
        assert_eq!(drain(&mut queue), [5, 3, 1]);
    }

    #[test]
    fn weights_set_grants_per_turn() {
        let mut queue = WaitQueue::new();
        for t in 0..6 {
            queue.push(t, &key("heavy").weight(3));
        }
        for t in 10..13 {
            queue.push(t, &key("light"));
        }
        assert_eq!(drain(&mut queue), [0, 1, 2, 10, 3, 4, 5, 11, 12]);
    }

    #[test]
    fn a_returning_key_joins_the_end_of_the_rotation() {
        let mut queue = WaitQueue::new();
        queue.push(1, &key("a"));
        queue.push(2, &key("b"));
        queue.push(3, &key("c"));
        assert_eq!(queue.pop(), Some(1)); // "a" empties and leaves the rotation
        queue.push(4, &key("a"));
        assert_eq!(drain(&mut queue), [2, 3, 4]);
    }

    #[test]
    fn serializes_default_queues_as_a_plain_list() {
        let mut queue = WaitQueue::new();
        queue.push(7, &Priority::default());
        queue.push(8, &Priority::default());
        let json = serde_json::to_string(&queue).unwrap();
        assert_eq!(json, "[7,8]");
        let back: WaitQueue = serde_json::from_str(&json).unwrap();
        assert_eq!(back, queue);

        queue.push(9, &Priority::level(2).key("t").weight(2));
        let json = serde_json::to_string(&queue).unwrap();
        assert_eq!(
            json,
            r#"[{"level":2,"keys":[{"key":"t","weight":2,"tickets":[9]}]},{"level":0,"keys":[{"key":null,"weight":1,"tickets":[7,8]}]}]"#
        );
        let mut back: WaitQueue = serde_json::from_str(&json).unwrap();
        assert_eq!(back, queue);
        assert_eq!(drain(&mut back), drain(&mut queue));
        assert!(serde_json::from_str::<WaitQueue>("[1,1]").is_err(), "duplicates are refused");
    }

    #[test]
    fn withdrawals_in_scattered_order_keep_the_rest_in_order() {
        for priority in [Priority::default(), key("a"), Priority::level(3).key("b").weight(2)] {
            let mut queue = WaitQueue::new();
            for ticket in 0..1_000 {
                queue.push(ticket, &priority);
            }
            // Every odd ticket, in a scattered order (a stride coprime with 500).
            for i in 0..500u64 {
                let ticket = 2 * ((i * 337) % 500) + 1;
                assert!(queue.remove(ticket), "{ticket} waited");
                assert!(!queue.remove(ticket), "{ticket} withdrawn twice");
                assert_eq!(queue.len(), 1_000 - i as usize - 1);
            }
            let waiting: usize = queue.waiting_by_key().values().sum();
            assert_eq!(waiting, 500, "withdrawn tickets are not counted as waiting");
            let back: WaitQueue =
                serde_json::from_str(&serde_json::to_string(&queue).unwrap()).unwrap();
            assert_eq!(back, queue, "withdrawn tickets are not saved");
            // Past half of the line withdrawn, it is compacted: 100 more from its middle.
            for ticket in (400..600).step_by(2) {
                assert!(queue.remove(ticket), "{ticket} waited");
            }
            assert_eq!(queue.len(), 400);
            let rest: Vec<u64> =
                (0..1_000).step_by(2).filter(|t| !(400..600).contains(t)).collect();
            assert_eq!(queue.tickets().count(), 400);
            assert_eq!(drain(&mut queue), rest);
        }
    }

    /// Per level of the model: keys in rotation order with their activation number, and the
    /// turn as (activation number, grants used).
    type ModelLevel = (Vec<(u64, Option<String>)>, Option<(u64, u32)>);

    /// A reference model: a flat list of (ticket, level, key, weight, arrival), served by brute
    /// force scans.
    #[derive(Default, Clone)]
    struct Model {
        waiting: Vec<(u64, i32, Option<String>, u32, u64)>,
        arrivals: u64,
        ring: BTreeMap<i32, ModelLevel>,
    }

    impl Model {
        fn push(&mut self, ticket: u64, level: i32, key: Option<String>, weight: u32) {
            if self.waiting.iter().any(|w| w.0 == ticket) {
                return;
            }
            self.arrivals += 1;
            let (ring, _) = self.ring.entry(level).or_default();
            if !ring.iter().any(|(_, k)| *k == key) {
                ring.push((self.arrivals, key.clone()));
            }
            for w in self.waiting.iter_mut().filter(|w| w.1 == level && w.2 == key) {
                w.3 = weight.max(1);
            }
            self.waiting.push((ticket, level, key, weight.max(1), self.arrivals));
        }

        fn remove(&mut self, ticket: u64) {
            if let Some(i) = self.waiting.iter().position(|w| w.0 == ticket) {
                let (_, level, key, _, _) = self.waiting.remove(i);
                self.forget_if_empty(level, &key);
            }
        }

        fn forget_if_empty(&mut self, level: i32, key: &Option<String>) {
            if self.waiting.iter().any(|w| w.1 == level && &w.2 == key) {
                return;
            }
            let (ring, turn) = self.ring.get_mut(&level).unwrap();
            let i = ring.iter().position(|(_, k)| k == key).unwrap();
            let (pos, _) = ring.remove(i);
            if turn.is_some_and(|(p, _)| p == pos) {
                *turn = ring.iter().find(|(p, _)| *p > pos).map(|(p, _)| (*p, 0));
            }
            if ring.len() == 1 {
                *turn = None;
            }
            if ring.is_empty() {
                self.ring.remove(&level);
            }
        }

        fn pop(&mut self) -> Option<u64> {
            let level = *self.ring.keys().next_back()?;
            let (ring, turn) = self.ring.get(&level).unwrap().clone();
            let weight = |k: &Option<String>| {
                self.waiting.iter().find(|w| w.1 == level && &w.2 == k).map(|w| w.3).unwrap()
            };
            let (pos, key) = match turn {
                Some((p, used)) => match ring.iter().find(|(q, _)| *q == p) {
                    Some((_, k)) if used < weight(k) => (p, k.clone()),
                    _ => ring.iter().find(|(q, _)| *q > p).unwrap_or(&ring[0]).clone(),
                },
                None => ring[0].clone(),
            };
            let (i, _) = self
                .waiting
                .iter()
                .enumerate()
                .filter(|(_, w)| w.1 == level && w.2 == key)
                .min_by_key(|(_, w)| w.4)
                .unwrap();
            let key_weight = weight(&key);
            let (ticket, ..) = self.waiting.remove(i);
            let used = match turn {
                Some((p, used)) if p == pos && used < key_weight => used + 1,
                _ => 1,
            };
            self.ring.get_mut(&level).unwrap().1 = Some((pos, used));
            self.forget_if_empty(level, &key);
            let single = self.ring.get(&level).is_some_and(|(ring, _)| ring.len() == 1);
            if single {
                self.ring.get_mut(&level).unwrap().1 = None;
            }
            Some(ticket)
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Push(u64, i32, Option<u8>, u32),
        Pop,
        Remove(u64),
        RoundTrip,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            5 => (0u64..60, 0i32..3, proptest::option::of(0u8..4), 0u32..4)
                .prop_map(|(t, l, k, w)| Op::Push(t, l, k, w)),
            4 => Just(Op::Pop),
            1 => (0u64..60).prop_map(Op::Remove),
            1 => Just(Op::RoundTrip),
        ]
    }

    /// Mostly default-priority pushes, so that the plain queue runs long and is left (for
    /// levels) and taken again (once the queue empties) many times.
    fn mostly_default_op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0u64..40).prop_map(|t| Op::Push(t, 0, None, 1)),
            1 => (0u64..40, 0i32..2, proptest::option::of(0u8..2), 0u32..3)
                .prop_map(|(t, l, k, w)| Op::Push(t, l, k, w)),
            5 => Just(Op::Pop),
            2 => (0u64..40).prop_map(Op::Remove),
            1 => Just(Op::RoundTrip),
        ]
    }

    /// Removing a ticket that does not wait changes nothing, not even the map's room: std's
    /// `entry` makes room for an insert first, so a full map would grow on such a removal
    /// (a release of a ticket twice, or after its lease expired).
    #[test]
    fn removing_a_ticket_that_does_not_wait_never_grows_the_index() {
        let mut index = TicketIndex::default();
        let mut number = 0;
        while index.blocks.capacity() == 0 || index.blocks.len() < index.blocks.capacity() {
            let place = index.claim(number * BLOCK).expect("a new ticket");
            *place = Loc::default();
            number += 1;
        }
        let room = index.blocks.capacity();
        assert_eq!(index.remove(number * BLOCK), None);
        assert_eq!(index.remove(1), None, "a ticket of a block that exists");
        assert_eq!((index.blocks.capacity(), index.len()), (room, number as usize));
    }

    /// A ticket for the index's test: small numbers (several to a block) or the top of the
    /// range, where a block number times its size must not overflow.
    fn index_ticket() -> impl Strategy<Value = u64> {
        prop_oneof![0u64..64, (0u64..24).prop_map(|t| u64::MAX - t)]
    }

    proptest! {
        /// The ticket index answers as a map of single tickets would: what waits, where, how
        /// many, and the list of them.
        #[test]
        fn the_ticket_index_matches_a_map(
            ops in proptest::collection::vec((any::<bool>(), index_ticket(), any::<u32>()), 1..400)
        ) {
            let mut index = TicketIndex::default();
            let mut model = std::collections::HashMap::new();
            for (insert, ticket, slot) in ops {
                let place = Loc { level: 0, seq: ticket ^ 1, slot };
                if insert {
                    let claimed = index.claim(ticket).map(|loc| *loc = place).is_some();
                    prop_assert_eq!(claimed, !model.contains_key(&ticket));
                    model.entry(ticket).or_insert(place);
                } else {
                    prop_assert_eq!(index.remove(ticket), model.remove(&ticket));
                }
                prop_assert_eq!(index.len(), model.len());
                prop_assert_eq!(index.contains(ticket), model.contains_key(&ticket));
                // A block lives exactly while one of its tickets waits.
                prop_assert!(index.blocks.values().all(|block| block.live != 0));
            }
            let mut listed: Vec<u64> = index.tickets().collect();
            let mut expected: Vec<u64> = model.keys().copied().collect();
            listed.sort_unstable();
            expected.sort_unstable();
            prop_assert_eq!(listed, expected);
        }

        /// As below, with the plain queue of default-priority waiters in most steps.
        #[test]
        fn matches_the_reference_model_mostly_default(
            ops in proptest::collection::vec(mostly_default_op(), 1..300)
        ) {
            check_against_the_model(ops)?;
        }

        /// The queue serves exactly what the brute-force model serves, and survives a serde round
        /// trip at any point without changing what it serves.
        #[test]
        fn matches_the_reference_model(ops in proptest::collection::vec(op(), 1..300)) {
            check_against_the_model(ops)?;
        }
    }

    fn check_against_the_model(ops: Vec<Op>) -> Result<(), TestCaseError> {
        {
            let mut queue = WaitQueue::new();
            let mut model = Model::default();
            for op in ops {
                match op {
                    Op::Push(t, level, key, weight) => {
                        let name = key.map(|k| format!("k{k}"));
                        let mut priority = Priority::level(level).weight(weight);
                        priority.fairness_key = name.as_deref().map(Arc::from);
                        queue.push(t, &priority);
                        model.push(t, level, name, weight);
                    }
                    Op::Pop => prop_assert_eq!(queue.pop(), model.pop()),
                    Op::Remove(t) => {
                        let expected = model.waiting.iter().any(|w| w.0 == t);
                        prop_assert_eq!(queue.remove(t), expected);
                        model.remove(t);
                    }
                    Op::RoundTrip => {
                        let json = serde_json::to_string(&queue).unwrap();
                        let back: WaitQueue = serde_json::from_str(&json).unwrap();
                        prop_assert_eq!(&back, &queue);
                        queue = back;
                    }
                }
                prop_assert_eq!(queue.len(), model.waiting.len());
                // The head kept across changes is the one the levels give now.
                prop_assert_eq!(queue.peek(), queue.find_head());
                // Plain only while every waiter has the default priority, with nothing in levels.
                prop_assert!(queue.plain.is_empty() || queue.levels.is_empty());
            }
        }
        Ok(())
    }
}
