//! The reader of a spill queue: reads in order from the committed position and commits what
//! was processed (invariant 2 of `handle.rs`: only frames below the published end are read).

use std::collections::VecDeque;
use std::fmt;
use std::pin::pin;
use std::sync::Arc;

use tokio::sync::oneshot;

use super::error::SpillError;
use super::format::{Position, segment_name};
use super::frame::{self, HEADER, Scanned};
use super::handle::{Inner, SpillRecord};
use super::storage::Storage;
use crate::util::{call_contained, lock};

/// Reads a [`SpillQueue`](super::SpillQueue) in order and commits what it processed. One per queue
/// at a time.
pub struct SpillReader {
    pub(super) inner: Arc<Inner>,
    pub(super) cursor: Position,
    /// Records read and not yet committed: (end position, frame bytes).
    pub(super) unacked: VecDeque<(Position, u64)>,
}

impl fmt::Debug for SpillReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SpillReader")
            .field("cursor", &self.cursor)
            .field("unacked", &self.unacked.len())
            .finish()
    }
}

impl Drop for SpillReader {
    fn drop(&mut self) {
        lock(&self.inner.shared).reader = false;
    }
}

/// What to read next: a segment's readable range.
struct Plan {
    segment: u64,
    from: u64,
    to: u64,
}

impl SpillReader {
    /// Waits for at least one record, then returns up to `max` records in order.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: records are only taken from the queue when the future returns them.
    ///
    /// # Errors
    ///
    /// [`SpillError::Closed`] once the queue is closed and everything was read; an I/O error;
    /// [`SpillError::Corrupt`] if a record's bytes changed on disk after they were written.
    pub async fn next_batch(&mut self, max: usize) -> Result<Vec<SpillRecord>, SpillError> {
        let inner = self.inner.clone();
        loop {
            let mut notified = pin!(inner.data.notified());
            notified.as_mut().enable();
            // Read before the batch: once the writer finished, every record it wrote is there
            // to read. (Closed as soon as the close began, a reader stopped before the last
            // accepted appends were written, and a drain that took `Closed` for "all read"
            // left them behind.)
            let finished = *inner.finished.borrow();
            let batch = self.try_next_batch(max).await?;
            if !batch.is_empty() {
                return Ok(batch);
            }
            if finished {
                return Err(SpillError::Closed);
            }
            notified.await;
        }
    }

    /// Up to `max` records that are already written, without waiting for new ones.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    ///
    /// # Errors
    ///
    /// As for [`next_batch`](Self::next_batch), except that an empty queue is `Ok(vec![])`.
    pub async fn try_next_batch(&mut self, max: usize) -> Result<Vec<SpillRecord>, SpillError> {
        // Read ahead of the reader's own cursor, which moves (with the records to acknowledge)
        // only when the records are returned: a batch that spans reads (a segment's end, a
        // skipped region, the read size) and is cancelled, or fails, in a later read leaves
        // its earlier records to the next call, not skipped.
        let mut cursor = self.cursor;
        let (mut out, mut taken) = (Vec::new(), Vec::new());
        let failed = loop {
            if out.len() >= max.max(1) {
                break None;
            }
            let Some(plan) = self.plan(&mut cursor) else {
                break None;
            };
            let storage = self.inner.storage.clone();
            let want = max.max(1) - out.len();
            let read = tokio::task::spawn_blocking(move || read_frames(&*storage, &plan, want))
                .await
                .map_err(|_| SpillError::Closed)
                .and_then(|read| read);
            let read = match read {
                Ok(read) => read,
                Err(err) => break Some(err),
            };
            if read.records.is_empty() && read.next == cursor {
                break None;
            }
            for (data, end, len) in read.records {
                taken.push((end, len));
                out.push(SpillRecord { data, end });
            }
            cursor = read.next;
        };
        match failed {
            // Nothing read: the error is this call's. (Records read before it are returned,
            // and the next call meets it again.)
            Some(err) if out.is_empty() => Err(err),
            _ => {
                self.cursor = cursor;
                self.unacked.extend(taken);
                Ok(out)
            }
        }
    }

    /// Where the next read from `cursor` goes, if there is anything to read (`cursor` moves
    /// past acknowledged segments and skipped regions, which hold no record to read).
    fn plan(&self, cursor: &mut Position) -> Option<Plan> {
        let shared = lock(&self.inner.shared);
        loop {
            let extent = shared.extents.get(&cursor.segment);
            let Some(extent) = extent else {
                // The cursor's segment is gone (acknowledged) or not created yet.
                let next = shared.extents.range(cursor.segment..).next()?;
                *cursor = Position::start_of(*next.0);
                continue;
            };
            if let Some((_, end)) =
                extent.skipped.iter().find(|(s, e)| (*s..*e).contains(&cursor.offset))
            {
                cursor.offset = *end;
                continue;
            }
            if cursor.offset < extent.valid_end {
                let to = extent
                    .skipped
                    .iter()
                    .map(|(s, _)| *s)
                    .filter(|s| *s > cursor.offset)
                    .min()
                    .unwrap_or(extent.valid_end)
                    .min(extent.valid_end);
                return Some(Plan { segment: cursor.segment, from: cursor.offset, to });
            }
            // The end of this segment: move on if a later one exists.
            let next = shared.extents.range(cursor.segment.checked_add(1)?..).next()?;
            *cursor = Position::start_of(*next.0);
        }
    }

    /// Acknowledges every record up to `to` (a record's [`position`](SpillRecord::position)):
    /// they will not be read again, and segments they fully cover are deleted. Returns once the
    /// commit is as durable as the sync policy makes it.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future may still persist the commit.
    ///
    /// Committing a position again (after an error, say) persists it if it was not.
    ///
    /// # Errors
    ///
    /// An I/O error persisting the state file, [`SpillError::NotRead`] for a position past
    /// what this reader has read or that it never handed out (not a record's), or
    /// [`SpillError::Closed`].
    pub async fn commit(&mut self, to: Position) -> Result<(), SpillError> {
        if to > self.cursor {
            return Err(SpillError::NotRead { position: to, read_to: self.cursor });
        }
        let committed = lock(&self.inner.shared).committed;
        // A position this reader handed out (a record's, or where its reads stand), or one
        // committed already. (Any position up to the cursor was taken: one inside a frame, of
        // another queue say, was persisted, and every reader made after it failed `Corrupt`
        // until the queue was opened again.)
        let handed_out =
            to == self.cursor || self.unacked.binary_search_by(|(end, _)| end.cmp(&to)).is_ok();
        if to > committed && !handed_out {
            return Err(SpillError::NotRead { position: to, read_to: self.cursor });
        }
        if to <= committed {
            // Counted already; sent again all the same: the writer persists it unless it did
            // (the state write of the first commit may have failed). A closed queue took it
            // (below) and tried to persist it as it closed: done if the state file holds it.
            // (Taken for done whenever the queue had closed, a retry after a close whose own
            // state write failed answered `Ok`, and the records came back at the next open.)
            return match self.send_commit(to).await {
                Err(SpillError::Closed) if to <= lock(&self.inner.shared).persisted => Ok(()),
                done => done,
            };
        }
        // On its way to the writer before anything is counted: a commit the writer can no
        // longer take (the queue closed) moves nothing, and a retry says `Closed` again.
        // (Counted first, a refused commit still moved the position, and its retry, finding
        // it done, answered `Ok` for records that came back at the next open.)
        let (reply, answer) = oneshot::channel();
        self.inner.mailbox.commit(to, reply).map_err(|_| SpillError::Closed)?;
        let (mut records, mut bytes) = (0u64, 0u64);
        while let Some((end, len)) = self.unacked.front().copied() {
            if end > to {
                break;
            }
            self.unacked.pop_front();
            records += 1;
            bytes += len;
        }
        let acked = {
            let mut shared = lock(&self.inner.shared);
            shared.committed = to;
            shared.records -= records.min(shared.records);
            let acked = bytes.min(shared.bytes);
            shared.bytes -= acked;
            shared.acknowledged += records;
            acked
        };
        // After the lock (the recorder is user code, which may call into this queue), by the
        // difference (as appends move it after their own lock, the moves add up in any order),
        // and contained.
        let _ = call_contained(|| self.inner.metrics.unacked_bytes.decrement(acked as f64));
        // Counted once the commit is on its way (a recorder's panic here reaches the caller,
        // the commit sent all the same).
        self.inner.metrics.acked.increment(records);
        answer.await.map_err(|_| SpillError::Closed)?
    }

    /// Sends a commit the queue counted already to the writer, and waits for its answer.
    async fn send_commit(&self, to: Position) -> Result<(), SpillError> {
        let (reply, answer) = oneshot::channel();
        self.inner.mailbox.commit(to, reply).map_err(|_| SpillError::Closed)?;
        answer.await.map_err(|_| SpillError::Closed)?
    }

    /// Commits everything read so far.
    ///
    /// # Errors
    ///
    /// As for [`commit`](Self::commit).
    pub async fn commit_read(&mut self) -> Result<(), SpillError> {
        match self.unacked.back() {
            Some((end, _)) => self.commit(*end).await,
            None => Ok(()),
        }
    }
}

struct Read {
    /// (payload, end position, frame length)
    records: Vec<(Vec<u8>, Position, u64)>,
    next: Position,
}

/// Reads up to `want` whole frames of `plan`'s range.
fn read_frames(storage: &dyn Storage, plan: &Plan, want: usize) -> Result<Read, SpillError> {
    // A read's size follows what it wants: 4 KiB a record wanted, 4 KiB to 1 MiB. (Sized
    // by `max_record` instead, 8 MiB by default, a reader taking one record at a time read and
    // threw away up to 8 MiB a call: quadratic over a backlog.) A first frame longer than the
    // read is read whole below.
    const CHUNK: u64 = 1 << 20;
    const PER_RECORD: u64 = 4 << 10;
    let name = segment_name(plan.segment);
    let chunk = (want as u64).saturating_mul(PER_RECORD).clamp(PER_RECORD, CHUNK);
    let len = (plan.to - plan.from).min(chunk);
    let mut buf = vec![0u8; len as usize];
    let n = storage.read_at(&name, plan.from, &mut buf)?;
    buf.truncate(n);
    let mut records = Vec::new();
    let mut at = 0usize;
    while records.len() < want && at < buf.len() {
        let position = Position { segment: plan.segment, offset: plan.from + at as u64 };
        // Frames check themselves (two CRCs): one larger than this queue's `max_record` was
        // written under another setting and is still a record, never corruption.
        match frame::scan_at(&buf[at..], u32::MAX) {
            Scanned::Frame { len } => {
                let payload = buf[at + HEADER..at + len as usize].to_vec();
                at += len as usize;
                let end = Position { segment: plan.segment, offset: plan.from + at as u64 };
                records.push((payload, end, len));
            }
            Scanned::Short if !records.is_empty() => break,
            Scanned::Short => {
                // The first frame is longer than the chunk read: read it whole.
                let Some(header) = frame::header(&buf[at..], u32::MAX) else {
                    return Err(SpillError::Corrupt { position });
                };
                let len = HEADER as u64 + u64::from(header.len);
                if plan.from + len > plan.to {
                    return Err(SpillError::Corrupt { position });
                }
                let mut whole = vec![0u8; len as usize];
                let n = storage.read_at(&name, plan.from, &mut whole)?;
                if n as u64 != len || !frame::payload_ok(header, &whole[HEADER..]) {
                    return Err(SpillError::Corrupt { position });
                }
                let end = Position { segment: plan.segment, offset: plan.from + len };
                records.push((whole.split_off(HEADER), end, len));
                at = len as usize;
                break;
            }
            // Readable ranges end before a seal; meeting one ends the range all the same.
            Scanned::Seal { .. } => break,
            Scanned::Invalid => return Err(SpillError::Corrupt { position }),
        }
    }
    Ok(Read { records, next: Position { segment: plan.segment, offset: plan.from + at as u64 } })
}
