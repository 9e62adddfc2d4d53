//! The writer thread of a spill queue: group commit, rotation with seals, state persistence
//! (invariants 1 and 3 of `queue.rs`).

use std::fmt;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::error::SpillError;
use super::format::{Position, SEGMENT_HEADER, STATE, encode_state, segment_name};
use super::frame;
use super::options::{SpillOptions, SyncPolicy};
use super::queue::{Extent, Inner, Request, create_segment};
use super::storage::{AppendFile, Storage};
use crate::util::lock;

/// The writer thread's state.
pub(super) struct Writer {
    pub(super) inner: std::sync::Weak<Inner>,
    pub(super) storage: Arc<dyn Storage>,
    pub(super) options: SpillOptions,
    pub(super) file: Box<dyn AppendFile>,
    pub(super) active: u64,
    pub(super) active_len: u64,
    pub(super) unsynced: bool,
    pub(super) last_sync: Instant,
    /// The committed position the state file holds.
    pub(super) persisted: Position,
    /// The latest committed position asked for.
    pub(super) wanted: Position,
    /// Released when the writer stops, after its last sync (and before `close` answers, so
    /// the directory is free once `close` returns).
    pub(super) lock: Option<Box<dyn fmt::Debug + Send + Sync>>,
}

impl Writer {
    pub(super) fn run(mut self, requests: Receiver<Request>) {
        const GROUP_BYTES: usize = 4 << 20;
        loop {
            let first = match self.next(&requests) {
                Next::Request(request) => request,
                Next::Tick => {
                    self.tick();
                    continue;
                }
                Next::Done => break,
            };
            let mut group = vec![first];
            let mut bytes = group_bytes(&group);
            while bytes < GROUP_BYTES {
                match requests.try_recv() {
                    Ok(request) => {
                        bytes += group_bytes(std::slice::from_ref(&request));
                        group.push(request);
                    }
                    Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
                }
            }
            if self.options.sync == SyncPolicy::Batch && !self.options.batch_window.is_zero() {
                let deadline = Instant::now() + self.options.batch_window;
                while bytes < GROUP_BYTES {
                    let left = deadline.saturating_duration_since(Instant::now());
                    match requests.recv_timeout(left) {
                        Ok(request) => {
                            bytes += group_bytes(std::slice::from_ref(&request));
                            group.push(request);
                        }
                        Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => break,
                    }
                }
            }
            if !self.handle(group) {
                return;
            }
        }
        // Every handle is gone: leave things durable.
        let _ = self.sync();
        let _ = self.persist();
    }

    fn next(&mut self, requests: &Receiver<Request>) -> Next {
        match self.options.sync {
            SyncPolicy::Interval(every) => {
                let left = every.saturating_sub(self.last_sync.elapsed());
                match requests.recv_timeout(left) {
                    Ok(request) => Next::Request(request),
                    Err(RecvTimeoutError::Timeout) => Next::Tick,
                    Err(RecvTimeoutError::Disconnected) => Next::Done,
                }
            }
            _ => {
                // A short spin first: a producer answered a moment ago often sends its next
                // append right away, and catching it here saves a thread wake-up.
                let spin_until = Instant::now() + Duration::from_micros(30);
                while Instant::now() < spin_until {
                    match requests.try_recv() {
                        Ok(request) => return Next::Request(request),
                        Err(TryRecvError::Disconnected) => return Next::Done,
                        Err(TryRecvError::Empty) => std::hint::spin_loop(),
                    }
                }
                requests.recv().map_or(Next::Done, Next::Request)
            }
        }
    }

    /// `Interval`: sync what was written and persist the committed position.
    fn tick(&mut self) {
        if let Err(err) = self.sync().and_then(|()| self.persist()) {
            self.fail(&err.to_string());
        }
        self.last_sync = Instant::now();
    }

    /// Handles a group of requests; false once the queue was closed. Under `Always` every
    /// append is written and synced on its own; otherwise the group's appends are written
    /// together and share one sync (`Batch`) or none (`Interval`, `Never`).
    fn handle(&mut self, group: Vec<Request>) -> bool {
        let mut appended = Vec::new();
        let mut commits = Vec::new();
        let mut close = None;
        let mut buf = Vec::new();
        let mut failure: Option<Arc<str>> =
            self.inner.upgrade().and_then(|i| lock(&i.shared).failed.clone());
        for request in group {
            match request {
                Request::Append { frames, reply } => {
                    if let Some(cause) = &failure {
                        let _ = reply.send(Err(SpillError::Failed(cause.clone())));
                        continue;
                    }
                    let full = self.active_len + (buf.len() + frames.len()) as u64
                        > self.options.segment_size;
                    if full && self.active_len + buf.len() as u64 > SEGMENT_HEADER {
                        // Seal the segment (rotate syncs it) with what the group has so far.
                        let sealed = self.write(&buf).and_then(|()| self.rotate());
                        buf.clear();
                        if let Err(err) = sealed {
                            failure = Some(self.fail(&err.to_string()));
                        }
                        for (reply, _) in appended.drain(..) {
                            Self::answer(reply, failure.clone());
                        }
                        if let Some(cause) = &failure {
                            let _ = reply.send(Err(SpillError::Failed(cause.clone())));
                            continue;
                        }
                    }
                    buf.extend_from_slice(&frames);
                    appended.push((reply, frames.len()));
                    if self.options.sync == SyncPolicy::Always {
                        self.flush(&mut buf, &mut appended, &mut failure);
                    }
                }
                Request::Commit { to, reply } => {
                    self.wanted = self.wanted.max(to);
                    commits.push(reply);
                }
                Request::Close { reply } => close = Some(reply),
            }
        }
        self.flush(&mut buf, &mut appended, &mut failure);
        if !commits.is_empty() {
            let durable = matches!(self.options.sync, SyncPolicy::Always | SyncPolicy::Batch);
            let persisted = if durable { self.persist() } else { Ok(()) };
            let result = persisted.map_err(|e| e.to_string());
            for reply in commits {
                let _ = reply
                    .send(result.clone().map_err(|e| SpillError::Io(std::io::Error::other(e))));
            }
        }
        if let SyncPolicy::Interval(every) = self.options.sync
            && self.last_sync.elapsed() >= every
        {
            self.tick();
        }
        if let Some(reply) = close {
            let result = self.sync().and_then(|()| self.persist());
            drop(self.lock.take());
            let _ = reply.send(result.map_err(SpillError::Io));
            return false;
        }
        true
    }

    /// Writes what `buf` holds (synced under `Always` and `Batch`), then answers its appends.
    fn flush(
        &mut self,
        buf: &mut Vec<u8>,
        appended: &mut Vec<(oneshot::Sender<Result<(), SpillError>>, usize)>,
        failure: &mut Option<Arc<str>>,
    ) {
        if failure.is_none() && !buf.is_empty() {
            let durable = matches!(self.options.sync, SyncPolicy::Always | SyncPolicy::Batch);
            let written = self.write(buf).and_then(|()| if durable { self.sync() } else { Ok(()) });
            if let Err(err) = written {
                *failure = Some(self.fail(&err.to_string()));
            }
        }
        buf.clear();
        for (reply, _) in appended.drain(..) {
            Self::answer(reply, failure.clone());
        }
    }

    fn answer(reply: oneshot::Sender<Result<(), SpillError>>, failure: Option<Arc<str>>) {
        let _ = reply.send(match failure {
            None => Ok(()),
            Some(cause) => Err(SpillError::Failed(cause)),
        });
    }

    /// Writes `buf` to the active segment and publishes the new end to readers.
    fn write(&mut self, buf: &[u8]) -> std::io::Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        self.file.append(buf)?;
        self.active_len += buf.len() as u64;
        self.unsynced = true;
        if let Some(inner) = self.inner.upgrade() {
            let mut shared = lock(&inner.shared);
            if let Some(extent) = shared.extents.get_mut(&self.active) {
                extent.valid_end = self.active_len;
            }
            drop(shared);
            inner.data.notify_waiters();
        }
        Ok(())
    }

    fn sync(&mut self) -> std::io::Result<()> {
        if self.unsynced {
            self.file.sync()?;
            self.unsynced = false;
        }
        self.last_sync = Instant::now();
        Ok(())
    }

    /// Seals the active segment (synced) and starts the next one.
    fn rotate(&mut self) -> std::io::Result<()> {
        // The seal says where the data ends, so recovery can tell a complete segment from one
        // that lost its end. Not part of the readable range (the extent ends before it).
        let mut seal = Vec::with_capacity(frame::SEAL_LEN as usize);
        frame::encode_seal(self.active_len, &mut seal);
        self.file.append(&seal)?;
        self.active_len += frame::SEAL_LEN;
        self.unsynced = true;
        self.sync()?;
        let id = self.active + 1;
        self.file = create_segment(&*self.storage, id)?;
        self.active = id;
        self.active_len = SEGMENT_HEADER;
        // After the file exists (a crash in between leaves a segment past the recorded last,
        // which is fine; the other order would report a loss that did not happen).
        self.storage.write_atomic(STATE, &encode_state(self.persisted, id))?;
        if let Some(inner) = self.inner.upgrade() {
            let mut shared = lock(&inner.shared);
            shared.extents.insert(id, Extent { valid_end: SEGMENT_HEADER, skipped: Vec::new() });
            shared.active = id;
        }
        Ok(())
    }

    /// Writes the state file if the committed position moved, then deletes the segments it
    /// fully covers (invariant 3).
    fn persist(&mut self) -> std::io::Result<()> {
        if self.wanted <= self.persisted {
            return Ok(());
        }
        self.storage.write_atomic(STATE, &encode_state(self.wanted, self.active))?;
        self.persisted = self.wanted;
        let covered: Vec<u64> = match self.inner.upgrade() {
            Some(inner) => {
                let mut shared = lock(&inner.shared);
                let ids: Vec<u64> = shared
                    .extents
                    .range(..self.persisted.segment)
                    .map(|(id, _)| *id)
                    .filter(|id| *id != self.active)
                    .collect();
                for id in &ids {
                    shared.extents.remove(id);
                }
                ids
            }
            None => Vec::new(),
        };
        for id in covered {
            self.storage.remove(&segment_name(id))?;
        }
        if !matches!(self.options.sync, SyncPolicy::Never) {
            self.storage.sync_dir()?;
        }
        Ok(())
    }

    /// Makes the queue refuse appends from now on.
    fn fail(&mut self, cause: &str) -> Arc<str> {
        let cause: Arc<str> = Arc::from(cause);
        if let Some(inner) = self.inner.upgrade() {
            let mut shared = lock(&inner.shared);
            shared.failed.get_or_insert_with(|| cause.clone());
        }
        cause
    }
}

enum Next {
    Request(Request),
    Tick,
    Done,
}

fn group_bytes(requests: &[Request]) -> usize {
    requests
        .iter()
        .map(|r| match r {
            Request::Append { frames, .. } => frames.len(),
            _ => 0,
        })
        .sum()
}
