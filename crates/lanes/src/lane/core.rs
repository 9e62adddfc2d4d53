//! The pure lane scheduler: admission, strict FIFO grants, ownership and counters.
//!
//! No I/O, no clock, no tasks: the async shell in `handle.rs` drives it under one lock per lane and
//! turns its answers into wake-ups. Each run carries a payload `W` (the shell's signal handle) that
//! the core hands back when the run is granted, detached or cancelled.
//!
//! # Invariants
//!
//! 1. `owned <= concurrent + queued`: ownership is taken at admission and given back only by
//!    [`LaneCore::complete`], after the run's finalizer and cleanup.
//! 2. `executing <= concurrent`: an execution slot is taken at grant and given back by
//!    [`LaneCore::release_execution`], *before* the finalizer runs.
//! 3. `limited.len() + queue.len() + executing <= owned`; the rest of `owned` are runs
//!    finalizing.
//! 4. Grants follow readiness order: only the queue head may be granted, and
//!    [`LaneCore::grant`] runs after every change that frees a slot. Hence while
//!    `executing < concurrent` the queue is empty, and a run that becomes ready either starts
//!    at once (empty queue) or waits behind everyone ready before it. (Runs taken in with
//!    [`LaneCore::enqueue_admitted`] may wait with a slot free until the
//!    [`LaneCore::grant_free`] that follows.) A run is ready at
//!    admission, or, if it names a limit, once its permit is granted ([`LaneCore::ready`]): until
//!    then it waits in `limited`, holding no execution slot (so a slot is only ever held by a
//!    job that can run).
//! 5. Once closed (or poisoned) the lane admits and grants nothing; closing detaches the queue
//!    and the runs waiting for a permit.

use std::collections::VecDeque;

use super::config::LaneLimits;
use super::error::{AdmissionErrorKind, Reason};
use super::snapshot::{FailedCounts, LaneCounters, RejectedCounts};

/// Why a lane stopped admitting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shut {
    Closed,
    Poisoned,
}

/// Where an admitted run starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admitted {
    /// The run holds execution slot `slot` already.
    Executing { seq: u64, slot: usize },
    /// The run waits in the queue.
    Queued { seq: u64 },
    /// The run waits for its limit's permit before it joins the queue.
    Limited { seq: u64 },
}

/// The waiting runs in admission order. Withdrawn runs leave a tombstone (found by binary
/// search, since sequences only grow) that the head skips; tombstones are compacted away once
/// they outnumber the live entries, so memory stays within twice the queue bound.
#[derive(Debug)]
struct RunQueue<W> {
    entries: VecDeque<(u64, Option<W>)>,
    live: usize,
}

impl<W> RunQueue<W> {
    fn new() -> Self {
        Self { entries: VecDeque::new(), live: 0 }
    }

    fn push(&mut self, seq: u64, payload: W) {
        debug_assert!(self.entries.back().is_none_or(|(last, _)| *last < seq));
        self.entries.push_back((seq, Some(payload)));
        self.live += 1;
    }

    fn pop(&mut self) -> Option<(u64, W)> {
        while let Some((seq, payload)) = self.entries.pop_front() {
            if let Some(payload) = payload {
                self.live -= 1;
                return Some((seq, payload));
            }
        }
        None
    }

    /// The first entry whose payload `matches`: its sequence.
    fn find(&self, matches: impl Fn(&W) -> bool) -> Option<u64> {
        let found = self.entries.iter().find(|(_, payload)| payload.as_ref().is_some_and(&matches));
        found.map(|(seq, _)| *seq)
    }

    fn remove(&mut self, seq: u64) -> Option<W> {
        let index = self.entries.binary_search_by_key(&seq, |(s, _)| *s).ok()?;
        let payload = self.entries[index].1.take()?;
        self.live -= 1;
        let tombstones = self.entries.len() - self.live;
        if tombstones > self.live + 16 {
            self.entries.retain(|(_, payload)| payload.is_some());
        }
        Some(payload)
    }

    fn drain(&mut self) -> impl Iterator<Item = W> + '_ {
        self.live = 0;
        self.entries.drain(..).filter_map(|(_, payload)| payload)
    }

    fn is_empty(&self) -> bool {
        self.live == 0
    }

    fn len(&self) -> usize {
        self.live
    }
}

/// Executing runs by slot, reused through a free list: O(1) insert and remove.
#[derive(Debug)]
struct Slots<W> {
    slots: Vec<Option<W>>,
    free: Vec<usize>,
}

impl<W> Slots<W> {
    fn new() -> Self {
        Self { slots: Vec::new(), free: Vec::new() }
    }

    fn insert(&mut self, payload: W) -> usize {
        match self.free.pop() {
            Some(slot) => {
                self.slots[slot] = Some(payload);
                slot
            }
            None => {
                self.slots.push(Some(payload));
                self.slots.len() - 1
            }
        }
    }

    fn remove(&mut self, slot: usize) -> Option<W> {
        let payload = self.slots.get_mut(slot)?.take()?;
        self.free.push(slot);
        Some(payload)
    }

    /// The payload in `slot`, which is in use.
    fn get_mut(&mut self, slot: usize) -> &mut W {
        self.slots[slot].as_mut().expect("a slot in use")
    }

    fn iter(&self) -> impl Iterator<Item = &W> {
        self.slots.iter().flatten()
    }
}

#[derive(Debug)]
pub(crate) struct LaneCore<W> {
    limits: LaneLimits,
    shut: Option<Shut>,
    next_seq: u64,
    owned: usize,
    executing: usize,
    /// Waiting runs in readiness order.
    queue: RunQueue<W>,
    /// Admitted runs waiting for their limit's permit, by admission sequence.
    limited: RunQueue<W>,
    /// Executing runs, so that close and poison can cancel them.
    running: Slots<W>,
    counters: LaneCounters,
}

impl<W> LaneCore<W> {
    pub(crate) fn new(limits: LaneLimits) -> Self {
        Self {
            limits,
            shut: None,
            next_seq: 0,
            owned: 0,
            executing: 0,
            queue: RunQueue::new(),
            limited: RunQueue::new(),
            running: Slots::new(),
            counters: LaneCounters::default(),
        }
    }

    /// Admits a run, or says why not. `make(seq, starts)` builds the run's payload only once
    /// the run is admitted, so a rejection costs no allocation; `starts` says whether the run
    /// takes an execution slot at once. A full lane is counted as a refusal only if
    /// `count_full` (a caller waiting for room counts once, when it gives up). `reserved` rooms
    /// are promised to others (handed to callers that waited for room) and count as owned. A
    /// `limited` run (one that names a limit) is owned but not ready: it waits for its permit
    /// in `limited`, and [`ready`](Self::ready) moves it on.
    pub(crate) fn admit(
        &mut self,
        count_full: bool,
        reserved: usize,
        limited: bool,
        make: impl FnOnce(u64, bool) -> W,
    ) -> Result<Admitted, AdmissionErrorKind> {
        let rejection = match self.shut {
            Some(Shut::Closed) => Some(AdmissionErrorKind::Closed),
            Some(Shut::Poisoned) => Some(AdmissionErrorKind::Poisoned),
            None if self.owned + reserved >= self.limits.capacity() => {
                Some(AdmissionErrorKind::Full)
            }
            None => None,
        };
        if let Some(kind) = rejection {
            if count_full || kind != AdmissionErrorKind::Full {
                self.counters.rejected.count(kind);
            }
            return Err(kind);
        }
        self.next_seq += 1;
        let seq = self.next_seq;
        let payload = make(seq, !limited && self.can_start());
        self.owned += 1;
        self.counters.admitted += 1;
        self.counters.max_owned = self.counters.max_owned.max(self.owned);
        if limited {
            self.limited.push(seq, payload);
            return Ok(Admitted::Limited { seq });
        }
        Ok(self.enter(payload))
    }

    /// Takes in a run admitted without the lane's lock (the shell's inbox), whose ownership
    /// the shell counted against the bound already: it is ready, and waits at the queue's tail.
    /// Only ever called on an open lane (a shut takes the inbox's runs in first, then detaches
    /// them with the queue). If a slot is free, whoever took the runs in, or the admission
    /// that put them in the inbox, grants it next ([`grant_free`](Self::grant_free)).
    pub(crate) fn enqueue_admitted(&mut self, payload: W) {
        debug_assert!(self.shut.is_none(), "a shut lane takes in no more runs");
        self.next_seq += 1;
        self.owned += 1;
        self.counters.admitted += 1;
        self.counters.max_owned = self.counters.max_owned.max(self.owned);
        self.queue.push(self.next_seq, payload);
    }

    /// Grants free execution slots to the queue head, as [`release_execution`] does once it
    /// freed one: for runs that joined the queue while a slot was free (the inbox's, taken in
    /// after the slot was given back).
    ///
    /// [`release_execution`]: Self::release_execution
    pub(crate) fn grant_free(&mut self, on_grant: impl FnMut(u64, usize, &mut W)) {
        self.grant(on_grant);
    }

    /// Whether a slot is free: then nobody waits in the queue (invariant 4), but runs just
    /// taken in from the shell's inbox, about to be granted.
    pub(crate) fn has_free_slot(&self) -> bool {
        self.executing < self.limits.concurrent
    }

    /// Whether a run that becomes ready now starts at once: nobody waits ahead of it and a
    /// slot is free.
    fn can_start(&self) -> bool {
        self.queue.is_empty() && self.executing < self.limits.concurrent
    }

    /// A ready run takes a free slot if nobody is ahead of it, else joins the queue's tail.
    fn enter(&mut self, payload: W) -> Admitted {
        let seq = self.next_seq;
        if self.can_start() {
            let slot = self.start(payload);
            Admitted::Executing { seq, slot }
        } else {
            self.queue.push(seq, payload);
            Admitted::Queued { seq }
        }
    }

    /// The limited run admitted as `seq` got its permit: it becomes ready, under a new
    /// sequence (its place in the queue is its readiness). `None` if it is no longer waiting
    /// (the lane was shut meanwhile and detached it).
    pub(crate) fn ready(&mut self, seq: u64) -> Option<Admitted> {
        let payload = self.limited.remove(seq)?;
        self.next_seq += 1;
        Some(self.enter(payload))
    }

    /// Takes a limited run out (cancelled, timed out or refused while waiting for its permit).
    /// Returns false if it is no longer waiting (detached by a shut).
    pub(crate) fn withdraw_limited(&mut self, seq: u64) -> bool {
        self.limited.remove(seq).is_some()
    }

    fn start(&mut self, payload: W) -> usize {
        self.executing += 1;
        self.counters.max_executing = self.counters.max_executing.max(self.executing);
        self.running.insert(payload)
    }

    /// Grants execution slots to the queue head while slots are free; `on_grant(seq, slot,
    /// payload)` is called for each granted run, in admission order, with the payload in its
    /// slot.
    fn grant(&mut self, mut on_grant: impl FnMut(u64, usize, &mut W)) {
        if self.shut.is_some() {
            return;
        }
        while self.executing < self.limits.concurrent {
            let Some((seq, payload)) = self.queue.pop() else {
                break;
            };
            // Moved, not cloned: a payload is a reference count, and its clone and drop would
            // be two locked writes under the lane's lock.
            let slot = self.start(payload);
            on_grant(seq, slot, self.running.get_mut(slot));
        }
    }

    /// The run in execution slot `slot` is done executing: the slot goes to the queue head.
    /// Returns the run's payload, or `None` if the slot was not in use.
    // Inlined into the shell's release, its one caller on every run's path (the compiler
    // stopped doing so on its own once the release told its later grants in two passes: 23
    // instructions a run).
    #[inline(always)]
    pub(crate) fn release_execution(
        &mut self,
        slot: usize,
        on_grant: impl FnMut(u64, usize, &mut W),
    ) -> Option<W> {
        let payload = self.running.remove(slot)?;
        self.executing -= 1;
        self.grant(on_grant);
        Some(payload)
    }

    /// Takes a queued run out of the queue (cancelled or timed out while waiting). Returns
    /// false if it is no longer queued (granted or detached meanwhile). Removing a waiter frees
    /// no execution slot, so nothing is granted.
    pub(crate) fn withdraw(&mut self, seq: u64) -> bool {
        self.queue.remove(seq).is_some()
    }

    /// As [`withdraw`](Self::withdraw), for a queued run known by its payload, not its
    /// sequence (a scan of the queue: for a run's end outside its drive only).
    pub(crate) fn withdraw_where(&mut self, matches: impl Fn(&W) -> bool) -> bool {
        self.queue.find(matches).is_some_and(|seq| self.withdraw(seq))
    }

    /// `runs` runs completed (successfully): their ownership is given back.
    pub(crate) fn complete_many(&mut self, runs: usize) {
        debug_assert!(self.owned >= runs, "complete without ownership");
        self.owned -= runs;
        self.counters.completed += runs as u64;
    }

    /// The run's finalizer and cleanup are done: its ownership is given back. `failure` is
    /// `None` for a completed run.
    pub(crate) fn complete(&mut self, failure: Option<Reason>) {
        debug_assert!(self.owned > 0, "complete without ownership");
        self.owned -= 1;
        match failure {
            None => self.counters.completed += 1,
            Some(reason) => self.counters.failed.count(reason),
        }
    }

    /// Stops admission. Queued runs are detached and handed to `on_queued`; executing runs are
    /// handed to `on_running` so they can be cancelled. Closing a closed lane only upgrades
    /// `Closed` to `Poisoned` (and then finds no queued runs).
    pub(crate) fn shut(
        &mut self,
        why: Shut,
        mut on_queued: impl FnMut(W),
        on_running: impl FnMut(&W),
    ) {
        if self.shut != Some(Shut::Poisoned) {
            self.shut = Some(why);
        }
        self.queue.drain().for_each(&mut on_queued);
        self.limited.drain().for_each(&mut on_queued);
        self.running.iter().for_each(on_running);
    }

    pub(crate) fn shut_state(&self) -> Option<Shut> {
        self.shut
    }

    pub(crate) fn owned(&self) -> usize {
        self.owned
    }

    pub(crate) fn executing(&self) -> usize {
        self.executing
    }

    /// Runs owned and waiting to start: for an execution slot, or for their permit first.
    pub(crate) fn queued(&self) -> usize {
        self.queue.len() + self.limited.len()
    }

    pub(crate) fn counters(&self) -> &LaneCounters {
        &self.counters
    }

    /// Counts a refusal made outside [`admit`](Self::admit) (a wait for room that gave up).
    pub(crate) fn count_rejected(&mut self, kind: AdmissionErrorKind) {
        self.counters.rejected.count(kind);
    }
}

impl RejectedCounts {
    fn count(&mut self, kind: AdmissionErrorKind) {
        match kind {
            AdmissionErrorKind::Full => self.full += 1,
            AdmissionErrorKind::Closed => self.closed += 1,
            AdmissionErrorKind::Poisoned => self.poisoned += 1,
            AdmissionErrorKind::UnknownLane => {}
        }
    }
}

impl FailedCounts {
    fn count(&mut self, reason: Reason) {
        let slot = match reason {
            Reason::Canceled => &mut self.canceled,
            Reason::Timeout => &mut self.timeout,
            Reason::Closed => &mut self.closed,
            Reason::Poisoned => &mut self.poisoned,
            Reason::Job => &mut self.job,
            Reason::Panic => &mut self.panic,
            Reason::Audit => &mut self.audit,
            Reason::Finalizer => &mut self.finalizer,
            Reason::Cleanup => &mut self.cleanup,
            Reason::Limit => &mut self.limit,
        };
        *slot += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn core(concurrent: usize, queued: usize) -> LaneCore<u64> {
        LaneCore::new(LaneLimits::new(concurrent, queued))
    }

    #[test]
    fn grants_in_admission_order() {
        let mut lane = core(1, 2);
        assert_eq!(
            lane.admit(true, 0, false, |s, _| s).unwrap(),
            Admitted::Executing { seq: 1, slot: 0 }
        );
        assert_eq!(lane.admit(true, 0, false, |s, _| s).unwrap(), Admitted::Queued { seq: 2 });
        assert_eq!(lane.admit(true, 0, false, |s, _| s).unwrap(), Admitted::Queued { seq: 3 });
        assert_eq!(lane.admit(true, 0, false, |s, _| s), Err(AdmissionErrorKind::Full));
        let mut granted = Vec::new();
        assert_eq!(lane.release_execution(0, |s, slot, _| granted.push((s, slot))), Some(1));
        assert_eq!(lane.release_execution(1, |_, _, _| {}), None, "slot 1 was never used");
        assert_eq!(granted, [(2, 0)]);
        // Run 1 still owns its slot while it finalizes: the lane is still full.
        assert_eq!(lane.admit(true, 0, false, |s, _| s), Err(AdmissionErrorKind::Full));
        lane.complete(None);
        // The room run 1 gave back, promised to a caller that waited for it: full to others.
        assert_eq!(lane.admit(true, 1, false, |s, _| s), Err(AdmissionErrorKind::Full));
        assert_eq!(lane.counters().rejected.full, 3);
        assert_eq!(lane.admit(true, 0, false, |s, _| s).unwrap(), Admitted::Queued { seq: 4 });
    }

    #[test]
    fn withdraw_does_not_grant_and_close_detaches() {
        let mut lane = core(1, 3);
        lane.admit(true, 0, false, |s, _| s).unwrap();
        lane.admit(true, 0, false, |s, _| s).unwrap();
        lane.admit(true, 0, false, |s, _| s).unwrap();
        assert!(lane.withdraw(2));
        assert!(!lane.withdraw(2));
        let (mut detached, mut cancelled) = (Vec::new(), Vec::new());
        lane.shut(Shut::Closed, |w| detached.push(w), |w| cancelled.push(*w));
        assert_eq!((detached, cancelled), (vec![3], vec![1]));
        assert_eq!(lane.admit(true, 0, false, |s, _| s), Err(AdmissionErrorKind::Closed));
        lane.shut(Shut::Poisoned, |_| {}, |_| {});
        assert_eq!(lane.admit(true, 0, false, |s, _| s), Err(AdmissionErrorKind::Poisoned));
        assert_eq!(lane.counters().rejected.closed, 1);
        assert_eq!(lane.counters().rejected.poisoned, 1);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Admit,
        /// Finish executing the n-th executing run (modulo the count).
        Release(usize),
        /// Complete the n-th finalizing run.
        Complete(usize),
        /// Withdraw the n-th queued run.
        Withdraw(usize),
        /// Admit a run that names a limit (it waits for its permit first).
        AdmitLimited,
        /// The n-th run waiting for its permit gets it.
        Ready(usize),
        /// The n-th run waiting for its permit gives up.
        WithdrawLimited(usize),
        Close,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => Just(Op::Admit),
            3 => any::<usize>().prop_map(Op::Release),
            3 => any::<usize>().prop_map(Op::Complete),
            1 => any::<usize>().prop_map(Op::Withdraw),
            2 => Just(Op::AdmitLimited),
            2 => any::<usize>().prop_map(Op::Ready),
            1 => any::<usize>().prop_map(Op::WithdrawLimited),
            1 => Just(Op::Close),
        ]
    }

    proptest! {
        /// The core against a reference model: a plain FIFO list of ready runs, a list of runs
        /// waiting for their permit, a set of executing runs and a count of finalizing ones.
        #[test]
        fn matches_reference_model(
            concurrent in 1usize..4,
            queued in 0usize..4,
            ops in proptest::collection::vec(op(), 1..200),
        ) {
            let mut lane = core(concurrent, queued);
            let mut model_queue: Vec<u64> = Vec::new();
            // Runs waiting for their permit, by admission sequence (also their payload).
            let mut model_limited: Vec<u64> = Vec::new();
            // The payload of each queued or running sequence.
            let mut payload_of = std::collections::BTreeMap::new();
            let mut model_running: Vec<u64> = Vec::new();
            let mut slot_of = std::collections::BTreeMap::new();
            let mut finalizing: Vec<u64> = Vec::new();
            let mut closed = false;
            let mut next = 0u64;
            let mut grant_order: Vec<u64> = Vec::new();
            for op in ops {
                match op {
                    Op::AdmitLimited => {
                        let owned = model_queue.len()
                            + model_limited.len()
                            + model_running.len()
                            + finalizing.len();
                        let mut starts = None;
                        let answer = lane.admit(true, 0, true, |s, now| {
                            starts = Some(now);
                            s
                        });
                        if closed {
                            prop_assert_eq!(answer, Err(AdmissionErrorKind::Closed));
                        } else if owned >= concurrent + queued {
                            prop_assert_eq!(answer, Err(AdmissionErrorKind::Full));
                        } else {
                            next += 1;
                            prop_assert_eq!(answer, Ok(Admitted::Limited { seq: next }));
                            prop_assert_eq!(starts, Some(false), "a limited run waits first");
                            model_limited.push(next);
                        }
                    }
                    Op::Ready(i) if !model_limited.is_empty() => {
                        let payload = model_limited.remove(i % model_limited.len());
                        next += 1;
                        let answer = lane.ready(payload);
                        payload_of.insert(next, payload);
                        if model_queue.is_empty() && model_running.len() < concurrent {
                            let Some(Admitted::Executing { seq, slot }) = answer else {
                                return Err(TestCaseError::fail(format!("{answer:?}")));
                            };
                            prop_assert_eq!(seq, next);
                            prop_assert!(!slot_of.values().any(|s| *s == slot), "slot reused");
                            slot_of.insert(next, slot);
                            model_running.push(next);
                            grant_order.push(next);
                        } else {
                            prop_assert_eq!(answer, Some(Admitted::Queued { seq: next }));
                            model_queue.push(next);
                        }
                    }
                    Op::WithdrawLimited(i) if !model_limited.is_empty() => {
                        let seq = model_limited.remove(i % model_limited.len());
                        prop_assert!(lane.withdraw_limited(seq));
                        prop_assert!(!lane.withdraw_limited(seq), "withdrawn once");
                        prop_assert_eq!(lane.ready(seq), None, "a withdrawn run is never ready");
                        finalizing.push(seq);
                    }
                    Op::Admit => {
                        let owned = model_queue.len()
                            + model_limited.len()
                            + model_running.len()
                            + finalizing.len();
                        let mut starts = None;
                        let answer = lane.admit(true, 0, false, |s, now| {
                            starts = Some(now);
                            s
                        });
                        if closed {
                            prop_assert_eq!(answer, Err(AdmissionErrorKind::Closed));
                        } else if owned >= concurrent + queued {
                            prop_assert_eq!(answer, Err(AdmissionErrorKind::Full));
                        } else {
                            next += 1;
                            if model_queue.is_empty() && model_running.len() < concurrent {
                                let Ok(Admitted::Executing { seq, slot }) = answer else {
                                    return Err(TestCaseError::fail(format!("{answer:?}")));
                                };
                                prop_assert_eq!(seq, next);
                                prop_assert_eq!(starts, Some(true), "made knowing it starts");
                                payload_of.insert(next, next);
                                prop_assert!(!slot_of.values().any(|s| *s == slot), "slot reused");
                                slot_of.insert(next, slot);
                                model_running.push(next);
                                grant_order.push(next);
                            } else {
                                prop_assert_eq!(answer, Ok(Admitted::Queued { seq: next }));
                                prop_assert_eq!(starts, Some(false), "made knowing it waits");
                                payload_of.insert(next, next);
                                model_queue.push(next);
                            }
                        }
                    }
                    Op::Release(i) if !model_running.is_empty() => {
                        let seq = model_running.remove(i % model_running.len());
                        let mut granted = Vec::new();
                        let slot = slot_of.remove(&seq).unwrap();
                        let released = lane.release_execution(slot, |s, slot, _| granted.push((s, slot)));
                        prop_assert!(released.is_some(), "the slot was in use");
                        finalizing.push(seq);
                        for (seq, slot) in &granted {
                            prop_assert!(!slot_of.values().any(|s| s == slot), "slot reused");
                            slot_of.insert(*seq, *slot);
                        }
                        let granted: Vec<u64> = granted.into_iter().map(|(s, _)| s).collect();
                        let mut expected = Vec::new();
                        while !closed && model_running.len() < concurrent && !model_queue.is_empty() {
                            let head = model_queue.remove(0);
                            model_running.push(head);
                            expected.push(head);
                        }
                        prop_assert_eq!(&granted, &expected);
                        grant_order.extend(granted);
                    }
                    Op::Complete(i) if !finalizing.is_empty() => {
                        finalizing.remove(i % finalizing.len());
                        lane.complete(None);
                    }
                    Op::Withdraw(i) if !model_queue.is_empty() => {
                        let seq = model_queue.remove(i % model_queue.len());
                        prop_assert!(lane.withdraw(seq));
                        finalizing.push(seq);
                    }
                    Op::Close => {
                        let mut detached = Vec::new();
                        lane.shut(Shut::Closed, |w| detached.push(w), |_| {});
                        // The queue's runs in order, then those waiting for a permit.
                        let mut expected: Vec<u64> =
                            model_queue.iter().map(|seq| payload_of[seq]).collect();
                        expected.extend(&model_limited);
                        prop_assert_eq!(&detached, &expected);
                        finalizing.append(&mut model_queue);
                        finalizing.append(&mut model_limited);
                        closed = true;
                    }
                    _ => {}
                }
                let owned =
                    model_queue.len() + model_limited.len() + model_running.len() + finalizing.len();
                prop_assert_eq!(lane.owned(), owned);
                prop_assert_eq!(lane.executing(), model_running.len());
                prop_assert_eq!(lane.queued(), model_queue.len() + model_limited.len());
                prop_assert!(lane.owned() <= concurrent + queued);
                prop_assert!(lane.executing() <= concurrent);
            }
            // Grants happened in readiness order.
            prop_assert!(grant_order.windows(2).all(|w| w[0] < w[1]));
        }
    }
}
