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

use std::io;

use serde::{Deserialize, Serialize};

use super::format::{
    Position, SEGMENT_HEADER, STATE, decode_state, segment_header_ok, segment_id, segment_name,
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
}

impl CheckReport {
    /// Whether anything was corrupt, torn or dropped.
    pub fn is_clean(&self) -> bool {
        self.corrupt_regions == 0
            && self.torn_tails == 0
            && self.bad_segments == 0
            && !self.state_reset
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
pub(crate) fn recover(
    storage: &dyn Storage,
    max_record: u32,
    repair: bool,
) -> io::Result<Recovered> {
    let names = storage.list()?;
    let mut ids: Vec<u64> = names.iter().filter_map(|n| segment_id(n)).collect();
    ids.sort_unstable();
    if repair {
        for name in names.iter().filter(|n| n.ends_with(".tmp")) {
            storage.remove(name)?;
        }
    }
    let mut report = CheckReport::default();
    let stored = if names.iter().any(|n| n == STATE) {
        let state = decode_state(&storage.read_all(STATE)?);
        report.state_reset = state.is_none();
        state
    } else {
        // A new queue, or one whose state was never written: start at the first segment.
        None
    };
    let first = ids.first().copied().unwrap_or(1);
    let mut committed = stored.unwrap_or_else(|| Position::start_of(first));

    let mut segments = Vec::new();
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
        if !segment_header_ok(&bytes, id) {
            report.bad_segments += 1;
            report.bad_segment_bytes += bytes.len() as u64;
            if repair {
                storage.remove(&name)?;
            }
            continue;
        }
        let body = &bytes[SEGMENT_HEADER as usize..];
        let layout: Layout = frame::scan(body, max_record);
        let base = SEGMENT_HEADER;
        let valid_end = base + layout.valid_end;
        let tail = layout.tail(body.len() as u64);
        if tail > 0 {
            report.torn_tails += 1;
            report.torn_bytes += tail;
            if repair {
                storage.truncate(&name, valid_end)?;
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
        segments.push(Segment { id, valid_end, skipped });
    }
    // The committed position must point at data recovery kept: into the first kept segment if
    // its own was dropped, and no further than its segment's valid end (appends continue there,
    // and must not land before it).
    if segments.first().is_some_and(|s| s.id > committed.segment) {
        committed = Position::start_of(segments[0].id);
    }
    if let Some(segment) = segments.iter().find(|s| s.id == committed.segment)
        && committed.offset > segment.valid_end
    {
        committed.offset = segment.valid_end;
    }
    report.segments = segments.len();
    report.committed = Some(committed);
    Ok(Recovered { segments, committed, report })
}
