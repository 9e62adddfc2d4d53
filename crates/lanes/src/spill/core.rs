//! The writer's group-commit decisions, as a pure planner: given the appends waiting (their
//! frame lengths, in arrival order) and what else was asked, it returns the actions the writer
//! performs in order. No I/O, no clock, no locks; the writer executes (`writer.rs`).

use std::ops::Range;

use super::config::SyncPolicy;
use super::format::SEGMENT_HEADER;

/// One step of the writer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Action {
    /// Append these bytes of the group's buffer to the active segment and publish them to
    /// readers.
    Write(Range<usize>),
    /// Make what was written durable.
    Sync,
    /// Answer the group's appends with index below this (those not answered yet) once a sync
    /// begun after this point has ended; the writer goes on meanwhile (`Batch`: the next
    /// group's write overlaps this group's sync, and one sync covers whatever was written
    /// while the previous one ran).
    SyncThenAnswer(usize),
    /// Seal the active segment (synced) and start the next one.
    Rotate,
    /// Answer the group's appends with index below this (those not answered yet): their
    /// policy is satisfied.
    Answer(usize),
    /// Write the committed position the reader asked for to the state file (and delete the
    /// segments it covers).
    Persist,
    /// Answer the waiting commits (after `Persist` under a durable policy).
    AnswerCommits,
    /// Sync and persist, then stop.
    Close,
}

/// What the writer was handed in one turn.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Group {
    /// The frame bytes of each append, in order (they lie back to back in the buffer).
    pub(super) appends: Vec<usize>,
    /// Whether a commit is waiting.
    pub(super) commit: bool,
    /// Whether the position the reader asked for is in a later segment than the state file
    /// records: persisting it frees the segments before it.
    pub(super) frees: bool,
    /// Whether the `Interval` is due (a sync and a persist).
    pub(super) tick: bool,
    /// Whether the queue is closing (or every handle is gone).
    pub(super) close: bool,
}

/// Whether a `Batch` group should keep waiting for more appends before it is written: while
/// fewer than `want` appends wait (the last group's count, so the appenders it answered can
/// rejoin; `usize::MAX` for a configured window) and the group holds fewer than `most` bytes
/// ([`LINGER_BYTES`], or [`GROUP_BYTES`] for a configured window). The writer bounds the wait
/// in time.
pub(super) fn lingers(appends: usize, bytes: usize, want: usize, most: usize) -> bool {
    appends < want && bytes < most
}

/// Past this, a group's bytes cost more to write than the sync an adaptive linger would save:
/// it is written at once (a sync costs about as much as writing a few hundred KiB).
pub(super) const LINGER_BYTES: usize = 256 << 10;

/// How much a lingering `Batch` group gathers at most before it is written.
pub(super) const GROUP_BYTES: usize = 4 << 20;

/// The planner's model of the active segment.
#[derive(Debug, Clone)]
pub(super) struct Planner {
    sync: SyncPolicy,
    segment_size: u64,
    /// Bytes in the active segment, header included.
    len: u64,
}

impl Planner {
    pub(super) fn new(sync: SyncPolicy, segment_size: u64, len: u64) -> Self {
        Self { sync, segment_size, len }
    }

    /// The actions for one group. Rules:
    /// - an append's frames never straddle segments: one that would overflow a segment holding
    ///   data starts the next (an append larger than a segment gets one of its own);
    /// - `Always`: each append is written, synced and answered on its own;
    /// - `Batch`: the group is written together (split only at rotations) and shares one sync,
    ///   which the next group does not wait for;
    /// - `Interval` and `Never`: appends are answered once written;
    /// - a rotation syncs the sealed segment, so the appends written before it are answered;
    /// - commits are persisted (under `Always` and `Batch`; otherwise when they free a segment,
    ///   so that acknowledged segments are deleted while the queue runs, and by the tick or the
    ///   close) and answered after the appends, then the tick, the close last.
    pub(super) fn plan(&mut self, group: &Group) -> Vec<Action> {
        let durable = matches!(self.sync, SyncPolicy::Always | SyncPolicy::Batch);
        let mut actions = Vec::new();
        let (mut start, mut end, mut answered) = (0usize, 0usize, 0usize);
        for (index, &bytes) in group.appends.iter().enumerate() {
            let len = self.len + (end - start) as u64;
            if len + bytes as u64 > self.segment_size && len > SEGMENT_HEADER {
                self.write(&mut actions, &mut start, end);
                actions.push(Action::Rotate);
                self.len = SEGMENT_HEADER;
                if index > answered {
                    actions.push(Action::Answer(index));
                    answered = index;
                }
            }
            end += bytes;
            if self.sync == SyncPolicy::Always {
                self.write(&mut actions, &mut start, end);
                actions.extend([Action::Sync, Action::Answer(index + 1)]);
                answered = index + 1;
            }
        }
        let wrote = end > start;
        self.write(&mut actions, &mut start, end);
        if answered < group.appends.len() {
            match wrote && durable {
                true => actions.push(Action::SyncThenAnswer(group.appends.len())),
                false => actions.push(Action::Answer(group.appends.len())),
            }
        }
        if group.commit {
            if durable || group.frees {
                actions.push(Action::Persist);
            }
            actions.push(Action::AnswerCommits);
        }
        if group.tick && !group.close {
            actions.extend([Action::Sync, Action::Persist]);
        }
        if group.close {
            actions.push(Action::Close);
        }
        actions
    }

    /// Writes the buffer's bytes from `start` to `end`, if any.
    fn write(&mut self, actions: &mut Vec<Action>, start: &mut usize, end: usize) {
        if end > *start {
            actions.push(Action::Write(*start..end));
            self.len += (end - *start) as u64;
            *start = end;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Action::*;

    const H: u64 = SEGMENT_HEADER;

    fn group(appends: &[usize]) -> Group {
        Group { appends: appends.to_vec(), ..Group::default() }
    }

    #[test]
    fn batch_writes_once_and_shares_one_sync() {
        let mut planner = Planner::new(SyncPolicy::Batch, 1 << 20, H);
        assert_eq!(planner.plan(&group(&[10, 20, 30])), vec![Write(0..60), SyncThenAnswer(3)]);
        assert_eq!(planner.len, H + 60);
    }

    #[test]
    fn always_syncs_and_answers_each_append_on_its_own() {
        let mut planner = Planner::new(SyncPolicy::Always, 1 << 20, H);
        assert_eq!(
            planner.plan(&group(&[10, 20])),
            vec![Write(0..10), Sync, Answer(1), Write(10..30), Sync, Answer(2)]
        );
    }

    #[test]
    fn interval_and_never_answer_after_the_write_without_a_sync() {
        for sync in [SyncPolicy::Never, SyncPolicy::Interval(std::time::Duration::from_secs(1))] {
            let mut planner = Planner::new(sync, 1 << 20, H);
            assert_eq!(planner.plan(&group(&[5, 5])), vec![Write(0..10), Answer(2)]);
        }
    }

    #[test]
    fn a_full_segment_rotates_between_appends_and_answers_what_the_seal_made_durable() {
        // Room for 100 bytes after the header.
        let mut planner = Planner::new(SyncPolicy::Batch, H + 100, H);
        assert_eq!(
            planner.plan(&group(&[40, 40, 40, 40])),
            vec![Write(0..80), Rotate, Answer(2), Write(80..160), SyncThenAnswer(4)]
        );
        assert_eq!(planner.len, H + 80);
        // The next group continues in the new segment.
        assert_eq!(planner.plan(&group(&[40])), vec![Rotate, Write(0..40), SyncThenAnswer(1)]);
    }

    #[test]
    fn an_append_larger_than_a_segment_gets_one_of_its_own_and_is_never_split() {
        let mut planner = Planner::new(SyncPolicy::Batch, H + 100, H);
        // A fresh segment takes it whole (nothing to seal first).
        assert_eq!(planner.plan(&group(&[500])), vec![Write(0..500), SyncThenAnswer(1)]);
        assert_eq!(
            planner.plan(&group(&[10, 500, 10])),
            vec![
                Rotate,
                Write(0..10),
                Rotate,
                Answer(1),
                Write(10..510),
                Rotate,
                Answer(2),
                Write(510..520),
                SyncThenAnswer(3)
            ]
        );
    }

    #[test]
    fn always_rotates_before_the_append_that_does_not_fit() {
        let mut planner = Planner::new(SyncPolicy::Always, H + 100, H + 90);
        assert_eq!(planner.plan(&group(&[20])), vec![Rotate, Write(0..20), Sync, Answer(1)]);
    }

    #[test]
    fn commits_tick_and_close_come_after_the_appends() {
        let mut planner = Planner::new(SyncPolicy::Batch, 1 << 20, H);
        let all = Group { appends: vec![8], commit: true, frees: false, tick: true, close: true };
        assert_eq!(
            planner.plan(&all),
            vec![Write(0..8), SyncThenAnswer(1), Persist, AnswerCommits, Close]
        );
        let tick = Group { tick: true, ..Group::default() };
        assert_eq!(planner.plan(&tick), vec![Sync, Persist]);
        assert_eq!(planner.plan(&Group::default()), vec![]);
        let mut never = Planner::new(SyncPolicy::Never, 1 << 20, H);
        let commit = Group { commit: true, ..Group::default() };
        assert_eq!(never.plan(&commit), vec![AnswerCommits]);
        // A commit that frees a segment is persisted (the segments before it deleted) under
        // every policy: acknowledged segments do not pile up until the close.
        let frees = Group { commit: true, frees: true, ..Group::default() };
        assert_eq!(never.plan(&frees), vec![Persist, AnswerCommits]);
    }

    #[test]
    fn a_batch_group_lingers_for_the_last_groups_appenders_up_to_a_size() {
        assert!(lingers(1, 64, 64, LINGER_BYTES));
        assert!(!lingers(64, 64 * 64, 64, LINGER_BYTES));
        assert!(!lingers(1, 64, 1, LINGER_BYTES));
        assert!(!lingers(4, LINGER_BYTES, 64, LINGER_BYTES));
        assert!(lingers(4, LINGER_BYTES, usize::MAX, GROUP_BYTES));
        assert!(!lingers(3, GROUP_BYTES, usize::MAX, GROUP_BYTES));
    }

    proptest::proptest! {
        /// Every append is written exactly once, in order, never split; every append is answered
        /// exactly once and only after its bytes were written (and synced or sealed when the
        /// policy is durable); no segment with data grows past its size except by one append
        /// that alone exceeds it.
        #[test]
        fn every_plan_writes_each_append_once_and_answers_it_after_it_is_durable(
            appends in proptest::collection::vec(1usize..300, 0..40),
            segment in 50u64..600,
            policy in 0u8..3,
        ) {
            let sync = match policy {
                0 => SyncPolicy::Always,
                1 => SyncPolicy::Batch,
                _ => SyncPolicy::Never,
            };
            let durable = sync != SyncPolicy::Never;
            let size = H + segment;
            let mut planner = Planner::new(sync, size, H);
            let actions = planner.plan(&group(&appends));
            let ends: Vec<usize> =
                appends.iter().scan(0, |at, n| { *at += n; Some(*at) }).collect();
            let (mut written, mut synced, mut answered) = (0usize, 0usize, 0usize);
            let mut len = H;
            for action in &actions {
                match action {
                    Write(range) => {
                        proptest::prop_assert_eq!(range.start, written);
                        proptest::prop_assert!(range.start == 0 || ends.contains(&range.start));
                        proptest::prop_assert!(ends.contains(&range.end));
                        let bytes = (range.end - range.start) as u64;
                        let first = ends.iter().position(|e| *e > range.start).unwrap();
                        let one = ends[first] == range.end;
                        proptest::prop_assert!(len + bytes <= size || (one && len == H));
                        len += bytes;
                        written = range.end;
                    }
                    Sync => synced = written,
                    Rotate => { synced = written; len = H; }
                    SyncThenAnswer(n) => {
                        // Answered once a sync begun now ends: it covers what was written.
                        proptest::prop_assert!(*n > answered);
                        proptest::prop_assert!(durable && written >= ends[*n - 1]);
                        answered = *n;
                    }
                    Answer(n) => {
                        proptest::prop_assert!(*n > answered);
                        let need = ends[*n - 1];
                        proptest::prop_assert!(written >= need);
                        if durable { proptest::prop_assert!(synced >= need); }
                        answered = *n;
                    }
                    Persist | AnswerCommits | Close => {}
                }
            }
            proptest::prop_assert_eq!(written, ends.last().copied().unwrap_or(0));
            proptest::prop_assert_eq!(answered, appends.len());
        }
    }
}
