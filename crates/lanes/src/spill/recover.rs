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
//!    not a regular file (never followed), and a torn segment other than the last (no crash
//!    tears those) each have their own count.

use std::io;

use serde::{Deserialize, Serialize};

use super::format::{
    Position, SEGMENT_HEADER, STATE, decode_state, segment_header_ok, segment_id, segment_name,
    segment_version,
};
use super::frame::{self, Layout};
use super::storage::Storage;

/// One segment, as recovery found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Segment {
    pub(crate) id: u64,
    /// Where valid data ends (file offset): appends continue here.
    pub(crate) valid_end: u64,
    /// Corrupt regions skipped in the middle (file offsets).
    pub(crate) skipped: Vec<(u64, u64)>,
    /// The writer moved on from it (it ends with a seal): appends never continue here.
    pub(crate) sealed: bool,
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
    /// present with neither header nor record though the state names them: their records are
    /// lost.
    pub missing_segments: u64,
    /// The missing ids as inclusive ranges (the first 16).
    pub missing_ranges: Vec<(u64, u64)>,
    /// Entries named like segments that are not regular files (symlinks, directories): never
    /// followed, never read (the first 16 names).
    pub not_files: Vec<String>,
    /// The state file was readable but pointed where no acknowledged position can be; recovery
    /// started from a safe position at or before it instead (records are delivered again).
    pub state_invalid: bool,
    /// Segments other than the last with a torn tail: records lost inside the queue (kept as
    /// found, so the loss stays visible).
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
    let mut report = CheckReport {
        not_files: storage.list_other()?.into_iter().take(16).collect(),
        ..CheckReport::default()
    };
    let mut ids: Vec<u64> = names.iter().filter_map(|n| segment_id(n)).collect();
    ids.sort_unstable();
    // No segment can follow u64::MAX: such a file is not one the writer made.
    if ids.last() == Some(&u64::MAX) {
        ids.pop();
        let name = segment_name(u64::MAX);
        let bytes = storage.read_all(&name)?;
        report.bad_segments += 1;
        report.bad_segment_bytes += bytes.len() as u64;
        if repair
            && frame::scan(bytes.get(SEGMENT_HEADER as usize..).unwrap_or(&[]), u32::MAX)
                .frames
                .is_empty()
        {
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
        let state = decode_state(&storage.read_all(STATE)?);
        report.state_reset = state.is_none();
        state
    } else {
        // A new queue, or one whose state was never written: start at the first segment.
        None
    };
    let stored = state.map(|state| state.committed);
    let recorded_last = state.and_then(|state| state.last);
    let first = ids.first().copied().unwrap_or(1);
    let mut committed = stored.unwrap_or_else(|| Position::start_of(first));
    // Invariant 3: a state past the last segment (other than the start of the next one, where
    // a reader that finished the last segment stands) shows nothing acknowledged.
    if let (Some(_), Some(&last)) = (stored, ids.last()) {
        let next = Position::start_of(last.saturating_add(1));
        if committed.segment > last && committed != next {
            report.state_invalid = true;
            committed = Position::start_of(first);
        }
    }
    // Invariant 4: every id from the committed segment to the last must be there.
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

    let mut segments = Vec::new();
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
        let bytes = storage.read_all(&name)?;
        let body = bytes.get(SEGMENT_HEADER as usize..).unwrap_or(&[]);
        // Frames check themselves (header and payload CRCs): every valid frame is a record,
        // whatever `max_record` the caller gives, so a repair never drops one written under a
        // larger setting.
        let layout: Layout = frame::scan(body, u32::MAX);
        records_without_state |= !has_state
            && !layout.frames.is_empty()
            && segment_version(&bytes, id) == Some(super::format::FORMAT_VERSION);
        if !segment_header_ok(&bytes, id) {
            // Frames check themselves: a damaged header loses the header, not the records.
            if layout.frames.is_empty() {
                // The writer names a segment in the state only once its header is synced: one
                // the state names that has neither header nor record was damaged, and what it
                // held (if anything) is lost. One past it is a crash's half-made file, or not
                // the queue's: foreign.
                let named = !report.state_invalid && recorded_last.is_some_and(|last| id <= last);
                if named {
                    report.missing_segments += 1;
                    report.missing_ranges.push((id, id));
                } else {
                    report.bad_segments += 1;
                    report.bad_segment_bytes += bytes.len() as u64;
                }
                if repair {
                    storage.remove(&name)?;
                }
                continue;
            }
            report.damaged_headers += 1;
            if repair {
                let mut fixed = bytes.clone();
                fixed[..SEGMENT_HEADER as usize]
                    .copy_from_slice(&super::format::segment_header(id));
                storage.write_atomic(&name, &fixed)?;
            }
        }
        let base = SEGMENT_HEADER;
        let valid_end = base + layout.valid_end;
        let tail = layout.tail(body);
        // Zeros after the data: space the writer reserved and never wrote. Not a loss; the
        // open cuts them so appends go on where the data ends.
        let unwritten = body.len() as u64 - layout.valid_end - tail;
        // Where the data ends: before the seal, if the writer sealed the segment. A version 2
        // segment before the last must be sealed, with the data length it records: otherwise
        // it lost its end (even a cut exactly at a frame boundary shows).
        let sealed = layout.seal.is_some();
        let data_end = layout.seal.map_or(valid_end, |(start, _)| base + start);
        let seal_lies = layout.seal.is_some_and(|(start, recorded)| recorded != base + start);
        let unsealed_v2 = segment_version(&bytes, id) == Some(super::format::FORMAT_VERSION)
            && !sealed
            && Some(id) != last_id;
        if (seal_lies || unsealed_v2) && tail == 0 {
            report.truncated_inside += 1;
        }
        let valid_end = data_end;
        if tail > 0 && Some(id) != last_id {
            // Only the last segment is written to, so only it can be torn by a crash: a torn
            // segment before it lost records inside the queue. Kept as found (appends never go
            // there), so the loss stays visible.
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
                || layout.frames.iter().any(|(start, _)| base + start == committed.offset)
                || layout.skipped.iter().any(|(start, _)| base + start == committed.offset);
            if !boundary {
                report.state_invalid = true;
                let before = layout
                    .frames
                    .iter()
                    .map(|(start, _)| base + start)
                    .filter(|start| *start <= committed.offset)
                    .max()
                    .unwrap_or(base);
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
        for (start, len) in &layout.frames {
            if base + start >= from {
                report.records += 1;
                report.bytes += len;
            }
        }
        // A torn segment before the last is left as found (its loss stays visible).
        let torn_inside = tail > 0 && Some(id) != last_id;
        if repair && !skipped.is_empty() && !torn_inside {
            // Rewrite the segment with its valid frames only, so a repaired queue checks clean;
            // a committed position in it moves with the frames: to the first frame at or after
            // it, or the new end.
            let mut out = super::format::segment_header(id).to_vec();
            let mut moved = None;
            for (start, len) in &layout.frames {
                let old = base + start;
                if moved.is_none() && old >= committed.offset {
                    moved = Some(out.len() as u64);
                }
                out.extend_from_slice(&bytes[old as usize..(old + len) as usize]);
            }
            let moved = moved.unwrap_or(out.len() as u64);
            let data_end = out.len() as u64;
            if sealed {
                frame::encode_seal(data_end, &mut out);
            }
            if id == committed.segment && moved != committed.offset {
                // The state first: killed between the two writes, an offset too early in the
                // old file is found and delivered again; one too late in the new file would
                // skip records never acknowledged.
                committed.offset = moved;
                let last = recorded_last.unwrap_or(0).max(last_id.unwrap_or(id));
                storage.write_atomic(STATE, &super::format::encode_state(committed, last))?;
            }
            storage.write_atomic(&name, &out)?;
            segments.push(Segment { id, valid_end: data_end, skipped: Vec::new(), sealed });
            continue;
        }
        segments.push(Segment { id, valid_end, skipped, sealed });
    }
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
    if segments.is_empty() && stored.is_some() {
        let used = recorded_last.unwrap_or(0).max(last_id.unwrap_or(0));
        let id = committed.segment.max(used.saturating_add(1));
        let id = if Position::start_of(id) != committed && id == committed.segment {
            id.saturating_add(1)
        } else {
            id
        };
        committed = Position::start_of(id);
    }
    if let Some(segment) = segments.iter().find(|s| s.id == committed.segment)
        && committed.offset > segment.valid_end
    {
        committed.offset = segment.valid_end;
    }
    // A repair leaves a state that checks clean: the position recovery settled on (a state
    // file missing or unreadable is written anew).
    // Its last id is the highest segment created: one the position moved to above them all is
    // made by the open, which records it then (a check after a repair finds nothing missing).
    if repair && stored != Some(committed) {
        let made = last_id.unwrap_or(committed.segment.saturating_sub(1));
        let last = recorded_last.unwrap_or(0).max(made);
        storage.write_atomic(STATE, &super::format::encode_state(committed, last))?;
    }
    report.missing_ranges = first_ranges(std::mem::take(&mut report.missing_ranges));
    report.state_reset |= records_without_state;
    report.segments = segments.len();
    report.committed = Some(committed);
    Ok(Recovered { segments, committed, report })
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
