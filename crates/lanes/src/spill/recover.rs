//! Recovery: what a directory holds, checked frame by frame. Used by `open` (which repairs)
//! and by `check` (which only looks).
//!
//! # Invariants
//!
//! 1. Recovery never refuses a readable directory and always ends: a scan advances at least
//!    one byte per step, and every problem has a repair (truncate a torn tail, skip a corrupt
//!    region, drop a segment whose header is not its own, start over if the state is unreadable).
//! 2. Nothing acknowledged is discarded: acknowledged appends are whole, valid frames before
//!    the durable end of their segment, which no repair touches.
//! 3. Nothing is deleted that the state file did not show to be acknowledged: a state that
//!    points where no acknowledged position can be (past the last segment, inside a frame,
//!    past the valid data) is reported and replaced by a safe position at or before it, so
//!    records are delivered again rather than dropped.
//! 4. Loss is reported, never silent: a segment id missing inside the queue, a segment that is
//!    not a regular file (never followed), and a segment that lost its end after a later one
//!    was made (no crash tears those) each have their own count, at every check until the
//!    queue moves past them.

use std::collections::BTreeSet;
use std::io;

use serde::{Deserialize, Serialize};

use super::format::{
    Position, SEGMENT_HEADER, STATE, read_state, segment_header_ok, segment_id, segment_name,
    segment_version,
};
use super::frame;
use super::storage::{AppendFile, Storage};

/// The first segment id no queue reaches: files with ids from here on are foreign, and a state
/// pointing there is not believed. Far below `u64::MAX`, so every id a queue uses has a next.
const ID_LIMIT: u64 = 1 << 63;

/// One segment, as recovery found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Segment {
    pub(crate) id: u64,
    /// Where valid data ends (file offset): appends continue here.
    pub(crate) valid_end: u64,
    /// Corrupt regions skipped in the middle (file offsets).
    pub(crate) skipped: Vec<(u64, u64)>,
    /// Appends never continue here: the writer moved on from it (it ends with a seal), or it
    /// lost its end after a later segment was made (torn, cut short of its seal, or sealed
    /// with another length), and is kept as found (its loss stays visible; the bytes after
    /// its valid end are not the queue's to write over) even once that later segment is
    /// dropped.
    pub(crate) closed: bool,
}

/// What a check or an open found (and, for an open, repaired).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct CheckReport {
    /// Segment files holding unacknowledged records (or the active one).
    pub segments: usize,
    /// Unacknowledged records (after the committed position).
    pub records: u64,
    /// Their bytes on disk, frames included.
    pub bytes: u64,
    /// The committed position: records before it were acknowledged.
    pub committed: Option<Position>,
    /// The state file was missing or unreadable, so everything on disk counts as unacknowledged
    /// (redelivered).
    pub state_reset: bool,
    /// Corrupt regions in the middle of segments, skipped up to the next valid frame (each held
    /// at least one record).
    pub corrupt_regions: u64,
    /// Bytes in those regions.
    pub corrupt_bytes: u64,
    /// Torn or corrupt tails, truncated (or to truncate).
    pub torn_tails: u64,
    /// Bytes in those tails.
    pub torn_bytes: u64,
    /// Segment files whose header was not their own, dropped (or to drop).
    pub bad_segments: u64,
    /// Bytes in those files.
    pub bad_segment_bytes: u64,
    /// Fully acknowledged segments still on disk, deleted (or to delete).
    pub acknowledged_segments: u64,
    /// Segment ids missing inside the queue (from the committed segment to the last), or
    /// present with neither header nor record though the state names them, the position
    /// points into them, or a segment follows them: their records are lost.
    pub missing_segments: u64,
    /// The missing ids as inclusive ranges (the first 16).
    pub missing_ranges: Vec<(u64, u64)>,
    /// Entries named like segments that are not regular files (symlinks, directories): never
    /// followed, never read (the first 16 names).
    pub not_files: Vec<String>,
    /// The state file was readable but pointed where no acknowledged position can be; recovery
    /// started from a safe position at or before it instead (records are delivered again). A
    /// position in a segment deleted since, which the state's `last` shows the queue made, is
    /// not invalid: that segment and those after it are told in `missing_segments`.
    pub state_invalid: bool,
    /// Segments that lost their end after a later one was made (torn, or cut short of their
    /// seal): records lost inside the queue (kept as found, so the loss stays visible, and
    /// never appended to).
    pub truncated_inside: u64,
    /// Bytes of those tails.
    pub truncated_inside_bytes: u64,
    /// Segments whose header was damaged but whose frames are intact: kept (the header is
    /// rewritten on repair).
    pub damaged_headers: u64,
}

impl CheckReport {
    /// Whether anything was corrupt, torn or dropped.
    pub fn is_clean(&self) -> bool {
        self.corrupt_regions == 0
            && self.torn_tails == 0
            && self.bad_segments == 0
            && !self.state_reset
            && self.missing_segments == 0
            && self.not_files.is_empty()
            && !self.state_invalid
            && self.truncated_inside == 0
            && self.damaged_headers == 0
    }

    /// Bytes discarded (or to discard) in all.
    pub fn discarded_bytes(&self) -> u64 {
        self.corrupt_bytes + self.torn_bytes + self.bad_segment_bytes
    }
}

/// The queue as recovered.
#[derive(Debug)]
pub(crate) struct Recovered {
    pub(crate) segments: Vec<Segment>,
    pub(crate) committed: Position,
    /// The id a new segment takes if appends cannot go on in the last one kept: after every id
    /// the queue has used (a dropped segment's id is not made anew), and not one a non-file
    /// entry holds.
    pub(crate) next_id: u64,
    pub(crate) report: CheckReport,
}

/// Scans the directory. With `repair`, truncates torn tails, removes foreign segments, fully
/// acknowledged segments and leftover temporary files. Without, changes nothing.
///
/// `_max_record` is not a bound on what counts as a record: a frame that passes both its
/// checksums is one, whatever setting it was written under (so a wrong `--max-record` can never
/// make a repair drop valid records).
pub(crate) fn recover(
    storage: &dyn Storage,
    _max_record: u32,
    repair: bool,
) -> io::Result<Recovered> {
    let names = storage.list()?;
    let others = storage.list_other()?;
    // Ids a new segment cannot take: entries named like segments that are not files.
    let blocked: BTreeSet<u64> = others.iter().filter_map(|n| segment_id(n)).collect();
    let mut report =
        CheckReport { not_files: others.into_iter().take(16).collect(), ..CheckReport::default() };
    let mut ids: Vec<u64> = names.iter().filter_map(|n| segment_id(n)).collect();
    ids.sort_unstable();
    // No queue makes 2^63 segments: a file with an id that high is not one the writer made
    // (and every id a queue uses has a successor to move to).
    while let Some(&id) = ids.last().filter(|id| **id >= ID_LIMIT) {
        ids.pop();
        let name = segment_name(id);
        let len = storage.len(&name)?;
        report.bad_segments += 1;
        report.bad_segment_bytes += len;
        if repair && scan_segment(storage, &name, len, |_, _| {})?.frames == 0 {
            storage.remove(&name)?;
        }
    }
    if repair {
        // The queue's own temporary files only (a state or a segment written whole); any
        // other file is not the queue's to remove.
        let temporary = |name: &str| {
            name.strip_suffix(".tmp")
                .is_some_and(|base| base == STATE || segment_id(base).is_some())
        };
        for name in names.iter().filter(|n| temporary(n)) {
            storage.remove(name)?;
        }
    }
    let has_state = names.iter().any(|n| n == STATE);
    let state = if has_state {
        let state = read_state(storage)?;
        report.state_reset = state.is_none();
        state
    } else {
        // A new queue, or one whose state was never written: start at the first segment.
        None
    };
    let stored = state.map(|state| state.committed);
    // A `last` no queue reaches is not believed.
    let recorded_last = state.and_then(|state| state.last).filter(|last| *last < ID_LIMIT);
    // The writer names a segment in the state only once its header is synced: a file past
    // every other with neither a header of its own nor a record, that the state neither names
    // nor points into, is a crash's half-made segment, or not the queue's. Foreign: dropped,
    // and told as if it were not there (a gap or a torn segment before it is told as such).
    while let Some(&id) = ids.last() {
        // (A position at the very start of `id` is where an open that had to make segment
        // `id` stood: killed before its header was synced, it left it blank.)
        let named = recorded_last.is_some_and(|last| id <= last)
            || stored.is_some_and(|position| position > Position::start_of(id));
        let name = segment_name(id);
        if named || segment_header_ok(&read_head(storage, &name)?, id) {
            break;
        }
        let len = storage.len(&name)?;
        if scan_segment(storage, &name, len, |_, _| {})?.frames > 0 {
            break;
        }
        ids.pop();
        report.bad_segments += 1;
        report.bad_segment_bytes += len;
        if repair {
            storage.remove(&name)?;
        }
    }
    let first = ids.first().copied().unwrap_or(1);
    let mut committed = stored.unwrap_or_else(|| Position::start_of(first));
    // Nor a position in a segment no queue reaches (it shows nothing acknowledged).
    if committed.segment >= ID_LIMIT {
        report.state_invalid = true;
        committed = Position::start_of(first);
    }
    // Invariant 3: a state past the last segment (other than the start of the next one, where
    // a reader that finished the last segment stands) shows nothing acknowledged. Unless the
    // state's `last` shows the queue made segments up to the position's: those were deleted
    // since, and are told as missing below (the ones before the position were acknowledged).
    let made_up_to = |last: u64| {
        committed.segment <= last || committed == Position::start_of(last.saturating_add(1))
    };
    if let (Some(_), Some(&last)) = (stored, ids.last()) {
        let next = Position::start_of(last.saturating_add(1));
        if committed.segment > last && committed != next && !recorded_last.is_some_and(made_up_to) {
            report.state_invalid = true;
            committed = Position::start_of(first);
        }
    }
    // Invariant 4: every id from the committed segment to the last must be there. An id a
    // non-file entry holds is missing too: it may have replaced a segment (nothing tells one
    // put there from one the writer went past; either way, it is also told as not a file).
    if stored.is_some() && !report.state_invalid {
        let mut expected = committed.segment;
        for &id in ids.iter().filter(|id| **id >= committed.segment) {
            if id > expected {
                report.missing_segments += id - expected;
                report.missing_ranges.push((expected, id - 1));
            }
            expected = id.saturating_add(1);
        }
    } else if let (Some(&lo), Some(&hi)) = (ids.first(), ids.last()) {
        let present = ids.len() as u64;
        let span = hi - lo + 1;
        if span > present {
            let mut expected = lo;
            for &id in &ids {
                if id > expected {
                    report.missing_segments += id - expected;
                    report.missing_ranges.push((expected, id - 1));
                }
                expected = id + 1;
            }
        }
    }
    // The state records the highest id ever created: segments after the last present one were
    // deleted (a crash never removes a segment).
    if let (Some(recorded), false) = (recorded_last, report.state_invalid) {
        let present = ids.last().copied().unwrap_or(0);
        if recorded > present && recorded != u64::MAX {
            let from = present.saturating_add(1).max(committed.segment);
            if recorded >= from {
                report.missing_segments += recorded - from + 1;
                report.missing_ranges.push((from, recorded));
            }
        }
    }
    let last_id = ids.last().copied();
    // The versions of the segments whose header is intact (each header is read once, here).
    // One whose header is damaged was written in version 2 if it is sealed or follows a sealed
    // one (only a version 2 writer seals), else in the version of the nearest intact one
    // before it (else after it; else the state file's), and a repair writes its header again in
    // that version: so a version 1 segment is not told as one that lost its seal, before the
    // repair or after.
    let mut intact = Vec::new();
    for &id in &ids {
        if let Some(version) = segment_version(&read_head(storage, &segment_name(id))?, id) {
            intact.push((id, version));
        }
    }
    // With no intact header at all, a version 1 state file tells: only a version 1 writer
    // leaves one (a version 2 writer rewrites it when it opens, before it writes a segment).
    let unknown = if state.is_some_and(|state| state.last.is_none()) {
        1
    } else {
        super::format::FORMAT_VERSION
    };
    let version_near = |id: u64| {
        let before = intact.iter().rev().find(|(other, _)| *other < id);
        let after = intact.iter().find(|(other, _)| *other > id);
        before.or(after).map_or(unknown, |(_, version)| *version)
    };
    // Whether a segment after `id` was made once: the state records the highest id created, and
    // the writer seals a segment before it makes the next. Such a segment is complete when
    // sealed; torn, or unsealed, it lost its end inside the queue, whatever became of the later
    // ones since (dropped, deleted): told the same way at every check, and never appended to.
    let recorded = recorded_last.filter(|_| !report.state_invalid);
    let later_made = |id: u64| Some(id) != last_id || recorded.is_some_and(|last| last > id);

    let mut segments = Vec::new();
    // The highest id of a segment with neither header nor record that was the queue's.
    let mut lost_blank: Option<u64> = None;
    // The last segment read that ends with a seal.
    let mut prev_sealed: Option<u64> = None;
    // A version 2 queue writes its state file when it opens, before any append: records with
    // no state file beside them lost it (and with it what was acknowledged, and the last id).
    let mut records_without_state = false;
    for id in ids {
        let name = segment_name(id);
        if id < committed.segment {
            report.acknowledged_segments += 1;
            if repair {
                storage.remove(&name)?;
            }
            continue;
        }
        // Read a window at a time, never whole: a segment file can be as large as the disk.
        let file_len = storage.len(&name)?;
        // Its header's version, if the header is its own (read above).
        let own = intact.binary_search_by_key(&id, |(other, _)| *other).ok().map(|at| intact[at].1);
        // What the committed position needs to know of this segment's frames, gathered by the
        // scan (it keeps no list of them).
        let mut tally = Tally::new(
            (id == committed.segment && !report.state_invalid)
                .then(|| committed.offset.checked_sub(SEGMENT_HEADER))
                .flatten(),
        );
        // Frames check themselves (header and payload CRCs): every valid frame is a record,
        // whatever `max_record` the caller gives, so a repair never drops one written under a
        // larger setting.
        let layout = scan_segment(storage, &name, file_len, |start, len| tally.see(start, len))?;
        records_without_state |=
            !has_state && layout.frames > 0 && own == Some(super::format::FORMAT_VERSION);
        // Only a version 2 writer seals, and it makes the next segment in version 2.
        let after_a_seal = prev_sealed.is_some_and(|prev| prev.checked_add(1) == Some(id));
        let version = own.unwrap_or_else(|| {
            if layout.seal.is_some() || after_a_seal {
                super::format::FORMAT_VERSION
            } else {
                version_near(id)
            }
        });
        if own.is_none() {
            // Frames check themselves: a damaged header loses the header, not the records.
            if layout.frames == 0 {
                // Not a half-made file (those were set apart above): the state names it, or a
                // segment of the queue follows it. It was damaged, and what it held (if
                // anything) is lost.
                report.missing_segments += 1;
                report.missing_ranges.push((id, id));
                lost_blank = Some(id);
                if repair {
                    storage.remove(&name)?;
                }
                continue;
            }
            report.damaged_headers += 1;
            if repair {
                rewrite(storage, &name, id, version, |out, piece| {
                    copy_range(storage, &name, SEGMENT_HEADER, file_len, out, piece)
                })?
                .put()?;
            }
        }
        let base = SEGMENT_HEADER;
        let valid_end = base + layout.valid_end;
        let tail = layout.tail;
        // Zeros after the data: space the writer reserved and never wrote. Not a loss; the
        // open cuts them so appends go on where the data ends.
        let unwritten = layout.len - layout.valid_end - tail;
        // Where the data ends: before the seal, if the writer sealed the segment. A version 2
        // segment after which another was made must be sealed, with the data length it
        // records: otherwise it lost its end (even a cut exactly at a frame boundary shows).
        let sealed = layout.seal.is_some();
        if sealed {
            prev_sealed = Some(id);
        }
        let data_end = layout.seal.map_or(valid_end, |(start, _)| base + start);
        let seal_lies = layout.seal.is_some_and(|(start, recorded)| recorded != base + start);
        let unsealed_v2 = version == super::format::FORMAT_VERSION && !sealed && later_made(id);
        let lost_end = (seal_lies || unsealed_v2) && tail == 0;
        if lost_end {
            report.truncated_inside += 1;
        }
        let valid_end = data_end;
        // Only the segment being written can be torn by a crash: one torn after a later one
        // was made lost records inside the queue. But bytes after a seal that records the
        // data's length are no record's (nothing follows a seal): a torn tail, cut on repair
        // (the seal stays).
        let whole = sealed && !seal_lies;
        let torn_inside = tail > 0 && later_made(id) && !whole;
        if torn_inside {
            // Kept as found (appends never go there), so the loss stays visible.
            report.truncated_inside += 1;
            report.truncated_inside_bytes += tail;
        } else if tail > 0 {
            report.torn_tails += 1;
            report.torn_bytes += tail;
            if repair {
                // Up to the seal's end, if there is one: the seal stays.
                storage.truncate(&name, base + layout.valid_end)?;
            }
        } else if unwritten > 0 && repair {
            // Up to the seal's end, if there is one: the seal stays.
            storage.truncate(&name, base + layout.valid_end)?;
        }
        // Invariant 3: the committed position is a frame boundary of its segment.
        if id == committed.segment
            && !report.state_invalid
            && Some(id) == last_id
            && !sealed
            && committed.offset > valid_end
        {
            // Past the data of the segment being written: records a reader read and
            // acknowledged before the disk kept them (a policy other than `Always`, then a
            // power loss), or a tail cut after they were acknowledged. Every record up to the
            // position was acknowledged, so the queue resumes where the data ends.
            committed.offset = valid_end;
        } else if id == committed.segment && !report.state_invalid {
            // A frame start, the valid end, or where a corrupt region starts (the frame there
            // was damaged after the position was committed).
            let boundary = committed.offset == valid_end
                || tally.at_start
                || layout.skipped.iter().any(|(start, _)| base + start == committed.offset);
            if !boundary {
                report.state_invalid = true;
                let before = tally.before.map_or(base, |start| base + start);
                committed.offset = before.min(valid_end);
            }
        }
        let skipped: Vec<(u64, u64)> =
            layout.skipped.iter().map(|(s, e)| (base + s, base + e)).collect();
        let from = if id == committed.segment { committed.offset } else { base };
        for (start, end) in &skipped {
            if *end > from {
                report.corrupt_regions += 1;
                report.corrupt_bytes += end - start.max(&from);
            }
        }
        let (records, bytes) = match tally.from(from.saturating_sub(base), layout.valid_end) {
            Some(counted) => counted,
            // A position recovery moved to where the scan did not count from: count again.
            None => {
                let mut counted = (0, 0);
                scan_segment(storage, &name, file_len, |start, len| {
                    if base + start >= from {
                        counted = (counted.0 + 1, counted.1 + len);
                    }
                })?;
                counted
            }
        };
        report.records += records;
        report.bytes += bytes;
        // A segment that lost its end inside the queue is left as found (its loss stays
        // visible: a seal written anew would hide it).
        if repair && !skipped.is_empty() && !torn_inside && !lost_end {
            // Rewrite the segment with its valid frames only, so a repaired queue checks clean:
            // into a file of its own, then put in its place (the old file stays whole until the
            // new one is). A committed position in it moves with the frames: to the first frame
            // at or after it, or the new end.
            let (mut moved, mut data_end) = (None, SEGMENT_HEADER);
            let rewritten = rewrite(storage, &name, id, version, |out, piece| {
                // Frames back to back are copied as one range (a file of tiny records would
                // otherwise cost a read and a write each).
                let (mut copied, mut range) = (Ok(()), None::<(u64, u64)>);
                scan_segment(storage, &name, file_len, |start, len| {
                    let old = base + start;
                    if moved.is_none() && old >= committed.offset {
                        moved = Some(data_end);
                    }
                    data_end += len;
                    match &mut range {
                        Some((_, end)) if *end == old => *end = old + len,
                        _ => {
                            if let (Some((from, to)), Ok(())) = (range, &copied) {
                                copied = copy_range(storage, &name, from, to, out, piece);
                            }
                            range = Some((old, old + len));
                        }
                    }
                })?;
                if let (Some((from, to)), Ok(())) = (range, &copied) {
                    copied = copy_range(storage, &name, from, to, out, piece);
                }
                copied?;
                if sealed {
                    let mut seal = Vec::new();
                    frame::encode_seal(data_end, &mut seal);
                    out.append(&seal)?;
                }
                Ok(())
            })?;
            let moved = moved.unwrap_or(data_end);
            if id == committed.segment && moved != committed.offset {
                // The state first: killed between the two writes, an offset too early in the
                // old file is found and delivered again; one too late in the new file would
                // skip records never acknowledged.
                committed.offset = moved;
                // No later id yet: one of them may be dropped below (a later write, at the
                // end, names the highest the queue made).
                let last = recorded.unwrap_or(0).max(id);
                storage.write_atomic(STATE, &super::format::encode_state(committed, last))?;
            }
            rewritten.put()?;
            segments.push(Segment { id, valid_end: data_end, skipped: Vec::new(), closed: sealed });
            continue;
        }
        segments.push(Segment {
            id,
            valid_end,
            skipped,
            closed: sealed || torn_inside || lost_end,
        });
    }
    // The highest id the queue made, as far as this directory shows: a check after a repair
    // finds a segment lost here as a gap, or past the state's last, which names it.
    let last_made = recorded.max(segments.last().map(|s: &Segment| s.id)).max(lost_blank);
    // The committed position must point at data recovery kept: into the first kept segment if
    // its own was dropped, and no further than its segment's valid end (appends continue there,
    // and must not land before it).
    if segments.first().is_some_and(|s| s.id > committed.segment) {
        committed = Position::start_of(segments[0].id);
    }
    // Nothing kept at or after the committed segment (it was deleted, or dropped as bad, with
    // every later one): appends go on in a segment after every id the queue has used, and the
    // committed position moves to its start. Kept as it was, the position pointed into a
    // segment made anew, past its first new records, which were then never read.
    let used = recorded_last.unwrap_or(0).max(last_id.unwrap_or(0));
    let free = |mut id: u64| {
        while blocked.contains(&id) && id < u64::MAX {
            id += 1;
        }
        id
    };
    if segments.is_empty() && stored.is_some() {
        let id = committed.segment.max(used.saturating_add(1));
        let id = if Position::start_of(id) != committed && id == committed.segment {
            id.saturating_add(1)
        } else {
            id
        };
        committed = Position::start_of(free(id));
    }
    // Past the ids the state names and those kept. A foreign file dropped past them (a crash's
    // half-made segment) leaves its id free: taking the next one would leave a gap that later
    // checks report as lost.
    let next_id = free(committed.segment.max(last_made.unwrap_or(0).saturating_add(1)));
    if let Some(segment) = segments.iter().find(|s| s.id == committed.segment)
        && committed.offset > segment.valid_end
    {
        committed.offset = segment.valid_end;
    }
    // A repair leaves a state that later checks tell as this one did: the position recovery
    // settled on (a state file missing or unreadable is written anew), and as its last id the
    // highest segment the queue made (a foreign file dropped past it was never the queue's; one
    // the position moved to above them all is made by the open, which records it then).
    if repair && (stored != Some(committed) || last_made > recorded_last) {
        let last = last_made.unwrap_or(committed.segment.saturating_sub(1));
        storage.write_atomic(STATE, &super::format::encode_state(committed, last))?;
    }
    report.missing_ranges = first_ranges(std::mem::take(&mut report.missing_ranges));
    report.state_reset |= records_without_state;
    report.segments = segments.len();
    report.committed = Some(committed);
    Ok(Recovered { segments, committed, next_id, report })
}

/// Scans segment file `name` (`file_len` bytes) after its header, a window at a time.
fn scan_segment(
    storage: &dyn Storage,
    name: &str,
    file_len: u64,
    on_frame: impl FnMut(u64, u64),
) -> io::Result<frame::Streamed> {
    let mut read = |offset: u64, buf: &mut [u8]| {
        storage.read_at(name, SEGMENT_HEADER.saturating_add(offset), buf)
    };
    let body = file_len.saturating_sub(SEGMENT_HEADER);
    frame::scan_stream(&mut read, body, u32::MAX, frame::SCAN_WINDOW, on_frame)
}

/// The first bytes of `name`: its segment header, or what there is of it.
fn read_head(storage: &dyn Storage, name: &str) -> io::Result<Vec<u8>> {
    let mut head = vec![0u8; SEGMENT_HEADER as usize];
    let mut got = 0;
    while got < head.len() {
        match storage.read_at(name, got as u64, &mut head[got..])? {
            0 => break,
            n => got += n,
        }
    }
    head.truncate(got);
    Ok(head)
}

/// Appends bytes `from..to` of `name` to `out`, a window at a time through `piece`.
fn copy_range(
    storage: &dyn Storage,
    name: &str,
    from: u64,
    to: u64,
    out: &mut dyn AppendFile,
    piece: &mut Vec<u8>,
) -> io::Result<()> {
    piece.resize(frame::SCAN_WINDOW, 0);
    let mut at = from;
    while at < to {
        let n = usize::try_from(to - at).unwrap_or(usize::MAX).min(piece.len());
        match storage.read_at(name, at, &mut piece[..n])? {
            0 => {
                let message = format!("{name} shrank while recovery copied it");
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, message));
            }
            got => {
                out.append(&piece[..got])?;
                at += got as u64;
            }
        }
    }
    Ok(())
}

/// Segment `id` written anew in a file of its own (its header in `version`, then what `fill`
/// appends), synced: [`put`](Rewritten::put) puts it in the segment's place. Memory stays
/// within a window, however large the segment.
fn rewrite<'a>(
    storage: &'a dyn Storage,
    name: &str,
    id: u64,
    version: u16,
    fill: impl FnOnce(&mut dyn AppendFile, &mut Vec<u8>) -> io::Result<()>,
) -> io::Result<Rewritten<'a>> {
    let tmp = format!("{name}.tmp");
    match storage.remove(&tmp) {
        Err(err) if err.kind() != io::ErrorKind::NotFound => return Err(err),
        _ => {}
    }
    let mut out = storage.create(&tmp)?;
    out.append(&super::format::segment_header_of(id, version))?;
    fill(&mut *out, &mut Vec::new())?;
    out.sync()?;
    drop(out);
    Ok(Rewritten { storage, tmp, name: name.to_owned() })
}

/// A segment written anew, waiting to be put in place of the old one.
struct Rewritten<'a> {
    storage: &'a dyn Storage,
    tmp: String,
    name: String,
}

impl Rewritten<'_> {
    /// Renames it over the old segment (atomically, the directory synced).
    fn put(self) -> io::Result<()> {
        self.storage.replace(&self.tmp, &self.name)
    }
}

/// What recovery needs to know of a segment's frames about the committed position in it
/// (`probe`, relative to the body), gathered as its scan goes: it keeps no list of them.
struct Tally {
    probe: Option<u64>,
    /// Every frame, and their bytes.
    all: (u64, u64),
    /// A frame starts at the probe.
    at_start: bool,
    /// The last frame start at or before the probe.
    before: Option<u64>,
    /// Frames that start at or after the probe, and their bytes.
    after: (u64, u64),
}

impl Tally {
    fn new(probe: Option<u64>) -> Self {
        Self { probe, all: (0, 0), at_start: false, before: None, after: (0, 0) }
    }

    fn see(&mut self, start: u64, len: u64) {
        self.all = (self.all.0 + 1, self.all.1 + len);
        if let Some(probe) = self.probe {
            self.at_start |= start == probe;
            if start <= probe {
                self.before = Some(start);
            }
            if start >= probe {
                self.after = (self.after.0 + 1, self.after.1 + len);
            }
        }
    }

    /// The frames that start at or after `from` (relative), and their bytes, if the scan
    /// counted them (`valid_end`: where the scan found the valid data end).
    fn from(&self, from: u64, valid_end: u64) -> Option<(u64, u64)> {
        if from == 0 {
            Some(self.all)
        } else if Some(from) == self.probe {
            Some(self.after)
        } else if from >= valid_end {
            Some((0, 0))
        } else {
            None
        }
    }
}

/// The first 16 of `ranges` in id order, those that touch merged: gaps between the ids found
/// and blank segments are found in two passes. (At most one range per segment file or gap, so
/// the list before the cut is bounded by the directory.)
fn first_ranges(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(ranges.len().min(16));
    for (from, to) in ranges {
        let full = merged.len() == 16;
        match merged.last_mut() {
            Some((_, end)) if from <= end.saturating_add(1) => *end = (*end).max(to),
            _ if full => break,
            _ => merged.push((from, to)),
        }
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::first_ranges;

    #[test]
    fn missing_ranges_are_in_id_order_merged_and_cut_at_16() {
        // A blank segment (3) is found after the gaps (5..=6, 8..=9); 4 touches both sides.
        assert_eq!(first_ranges(vec![(5, 6), (8, 9), (3, 3), (4, 4)]), [(3, 6), (8, 9)]);
        let many: Vec<(u64, u64)> = (0..40).rev().map(|i| (i * 10, i * 10 + 1)).collect();
        let first = first_ranges(many);
        assert_eq!((first.len(), first[0], first[15]), (16, (0, 1), (150, 151)));
        assert_eq!(first_ranges(vec![(7, u64::MAX), (u64::MAX, u64::MAX)]), [(7, u64::MAX)]);
    }
}
