//! The spill queue: appends through one writer thread (group commit), one reader with a
//! committed position.
//!
//! # Implementation details
//!
//! Producers encode their frames and reserve their bytes under the shared lock, then hand the
//! frames to the writer thread. The writer drains every request waiting (and, under
//! [`SyncPolicy::Batch`], waits up to `batch_window` for more), writes them with one `write`,
//! syncs once if the policy asks, publishes the new end of data to readers, and only then
//! answers the producers. A failed write or sync makes the queue refuse further appends until
//! it is reopened (recovery repairs what the failure left), so an unsynced failure is never
//! papered over.
//!
//! # Invariants
//!
//! 1. An append is acknowledged only after its frames were written (and synced, under `Always`
//!    and `Batch`).
//! 2. Readers only see frames below the published end of data, which only covers whole frames.
//! 3. A segment is deleted only after a durable state file commits past its end.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::path::Path;
use std::pin::pin;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, oneshot};

use super::error::SpillError;
use super::format::{self, Position, SEGMENT_HEADER, STATE, encode_state, segment_name};
use super::frame::{self, HEADER, Scanned};
use super::recover::{CheckReport, recover};
use super::storage::{AppendFile, FsStorage, Storage};
use crate::lane::{ConfigError, ConfigRule};
use crate::registry::{Registry, Snapshot, Source};
use crate::util::lock;

/// When appends are made durable.
///
/// | policy | an append returns after | lost by a process crash (kill -9) | lost by an OS crash or power loss |
/// |---|---|---|---|
/// | `Always` | its own write + `fdatasync` | nothing acknowledged | nothing acknowledged |
/// | `Batch` | write + one `fdatasync` shared with concurrent appends | nothing acknowledged | nothing acknowledged |
/// | `Interval(d)` | write | nothing acknowledged | up to `d` of acknowledged appends |
/// | `Never` | write | nothing acknowledged | whatever the OS had not flushed |
///
/// Commits follow the same policy: under `Always` and `Batch` a commit returns once the state
/// file is durable; under `Interval(d)` it is written every `d`, under `Never` at close. A
/// commit lost in a crash means its records are delivered again (at least once).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SyncPolicy {
    /// Every append is written and synced on its own before it returns.
    Always,
    /// Group commit: the appends waiting when a write starts share one sync, and each returns
    /// after it.
    Batch,
    /// Synced every interval; appends return after their write.
    Interval(Duration),
    /// Never synced explicitly (the OS flushes when it likes); synced at close.
    Never,
}

/// Options of a spill queue.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SpillOptions {
    /// When appends are made durable. Default: [`SyncPolicy::Batch`].
    pub sync: SyncPolicy,
    /// How long a `Batch` group lingers for more appends after taking every append already
    /// waiting. Default: zero (appends that arrive while a sync runs form the next group).
    pub batch_window: Duration,
    /// Unacknowledged bytes (frames included) the queue may hold; one more append fails with
    /// [`SpillError::Full`]. Default: 1 GiB. At least one whole frame of the largest record:
    /// `12 + max_record`.
    pub max_bytes: u64,
    /// The largest record, 1 to 2^31 - 1 bytes. Default: 8 MiB.
    pub max_record: u32,
    /// Segments are rotated once they reach this size. Default: 64 MiB. At least the segment
    /// header and one frame: `16 + min(12 + max_record, 1 MiB)`.
    pub segment_size: u64,
}

impl Default for SpillOptions {
    fn default() -> Self {
        Self {
            sync: SyncPolicy::Batch,
            batch_window: Duration::ZERO,
            max_bytes: 1 << 30,
            max_record: 8 << 20,
            segment_size: 64 << 20,
        }
    }
}

impl SpillOptions {
    /// Sets the sync policy.
    #[must_use]
    pub fn sync(mut self, sync: SyncPolicy) -> Self {
        self.sync = sync;
        self
    }

    /// Sets the unacknowledged-bytes bound.
    #[must_use]
    pub fn max_bytes(mut self, max_bytes: u64) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    /// Sets the largest record.
    #[must_use]
    pub fn max_record(mut self, max_record: u32) -> Self {
        self.max_record = max_record;
        self
    }

    /// Sets the segment size.
    #[must_use]
    pub fn segment_size(mut self, segment_size: u64) -> Self {
        self.segment_size = segment_size;
        self
    }

    /// Sets the group-commit window.
    #[must_use]
    pub fn batch_window(mut self, window: Duration) -> Self {
        self.batch_window = window;
        self
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let frame = HEADER as u64 + u64::from(self.max_record);
        if self.max_record == 0 {
            return Err(ConfigError::new("max_record", ConfigRule::Zero));
        }
        // The high bit of a frame's length marks a control frame (the seal).
        if self.max_record >= frame::SEAL_FLAG {
            let max = (frame::SEAL_FLAG - 1) as usize;
            return Err(ConfigError::new("max_record", ConfigRule::OverMax { max }));
        }
        if self.max_bytes < frame {
            return Err(ConfigError::new("max_bytes", ConfigRule::AtLeast { min: frame }));
        }
        let segment = SEGMENT_HEADER + frame.min(1 << 20);
        if self.segment_size < segment {
            return Err(ConfigError::new("segment_size", ConfigRule::AtLeast { min: segment }));
        }
        if let SyncPolicy::Interval(d) = self.sync
            && d.is_zero()
        {
            return Err(ConfigError::new("sync.interval", ConfigRule::ZeroTimeout));
        }
        Ok(())
    }
}

/// What a segment holds, for readers.
#[derive(Debug, Clone)]
struct Extent {
    valid_end: u64,
    skipped: Vec<(u64, u64)>,
}

#[derive(Debug)]
struct Shared {
    extents: BTreeMap<u64, Extent>,
    /// The segment appends go to.
    active: u64,
    committed: Position,
    records: u64,
    bytes: u64,
    failed: Option<Arc<str>>,
    closed: bool,
    reader: bool,
    appended: u64,
    acknowledged: u64,
}

struct Inner {
    storage: Arc<dyn Storage>,
    options: SpillOptions,
    requests: Mutex<Option<Sender<Request>>>,
    shared: Mutex<Shared>,
    data: Notify,
    report: CheckReport,
}

enum Request {
    Append { frames: Vec<u8>, reply: oneshot::Sender<Result<(), SpillError>> },
    Commit { to: Position, reply: oneshot::Sender<Result<(), SpillError>> },
    Close { reply: oneshot::Sender<Result<(), SpillError>> },
}

/// An embedded, crash-safe, disk-backed FIFO queue of byte records. Cheap to clone: clones share
/// the queue.
///
/// One process owns a directory at a time (an OS advisory lock, released by the OS even after
/// a kill -9). Appends go through one writer thread with group commit; one [`SpillReader`] reads
/// in order from the committed position, and commits what it processed. Delivery is at least
/// once: records read but not committed are read again after a crash or a reopen.
///
/// See the [module documentation](super) for the sync policies' loss windows and recovery.
///
/// # Examples
///
/// ```
/// use lanes::spill::{SpillOptions, SpillQueue, SyncPolicy};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lanes::spill::SpillError> {
/// # let dir = std::env::temp_dir().join(format!("lanes-doc-{}", std::process::id()));
/// let (queue, report) = SpillQueue::open(&dir, SpillOptions::default().sync(SyncPolicy::Always)).await?;
/// assert!(report.is_clean());
/// queue.append(b"first".to_vec()).await?;
/// queue.append(b"second".to_vec()).await?;
///
/// let mut reader = queue.reader()?;
/// let batch = reader.next_batch(10).await?;
/// assert_eq!(batch[0].data(), b"first");
/// reader.commit(batch.last().unwrap().position()).await?; // acknowledged: never read again
/// queue.close().await?;
/// # std::fs::remove_dir_all(&dir).ok();
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct SpillQueue {
    inner: Arc<Inner>,
}

impl fmt::Debug for SpillQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SpillQueue")
            .field("storage", &self.inner.storage)
            .field("len", &self.len())
            .field("bytes", &self.bytes())
            .finish()
    }
}

/// Records handed to a [`SpillQueue`]'s writer; resolves once their sync policy is satisfied.
#[must_use = "the append happens anyway; await this to learn when it is durable"]
#[derive(Debug)]
pub struct PendingAppend {
    answer: oneshot::Receiver<Result<(), SpillError>>,
}

impl std::future::Future for PendingAppend {
    type Output = Result<(), SpillError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.answer).poll(cx).map(|r| r.unwrap_or(Err(SpillError::Closed)))
    }
}

/// One record read from a [`SpillQueue`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpillRecord {
    data: Vec<u8>,
    end: Position,
}

impl SpillRecord {
    /// The record's bytes.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// The record's bytes, owned.
    pub fn into_data(self) -> Vec<u8> {
        self.data
    }

    /// The position just after this record: commit it to acknowledge this record and every
    /// one before it.
    pub fn position(&self) -> Position {
        self.end
    }
}

/// The state of a spill queue, in the registry's snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct SpillSnapshot {
    /// The sync policy.
    pub sync: SyncPolicy,
    /// Unacknowledged records.
    pub records: u64,
    /// Their bytes, frames included.
    pub bytes: u64,
    /// The bound on `bytes`.
    pub max_bytes: u64,
    /// Segment files.
    pub segments: usize,
    /// The committed position.
    pub committed: Position,
    /// Records appended since open.
    pub appended: u64,
    /// Records acknowledged (committed) since open.
    pub acknowledged: u64,
    /// Set once a write or sync failed: the queue refuses appends until reopened.
    pub failed: Option<String>,
    /// What recovery found and repaired at open.
    pub recovered: CheckReport,
}

impl SpillQueue {
    /// Opens (creating if needed) the queue in directory `dir`, recovering what a crash left.
    /// Recovery never refuses to start: torn tails are truncated, corrupt regions skipped, and
    /// what was discarded is counted in the returned report.
    ///
    /// # Errors
    ///
    /// [`SpillError::InvalidOptions`], [`SpillError::Locked`] if another process owns the
    /// directory, or an I/O error.
    pub async fn open(
        dir: impl AsRef<Path>,
        options: SpillOptions,
    ) -> Result<(Self, CheckReport), SpillError> {
        Self::open_with(FsStorage::new(dir.as_ref()), options).await
    }

    /// Opens a queue on any [`Storage`] (for example a [`MemStorage`](super::MemStorage)).
    ///
    /// # Errors
    ///
    /// As for [`open`](Self::open).
    pub async fn open_with(
        storage: impl Storage,
        options: SpillOptions,
    ) -> Result<(Self, CheckReport), SpillError> {
        options.validate().map_err(SpillError::InvalidOptions)?;
        let storage: Arc<dyn Storage> = Arc::new(storage);
        let blocking = storage.clone();
        let opts = options.clone();
        tokio::task::spawn_blocking(move || Self::open_blocking(blocking, opts))
            .await
            .map_err(|_| SpillError::Closed)?
    }

    fn open_blocking(
        storage: Arc<dyn Storage>,
        options: SpillOptions,
    ) -> Result<(Self, CheckReport), SpillError> {
        storage.create_dir()?;
        let guard = storage.lock()?;
        let recovered = recover(&*storage, options.max_record, true)?;
        let report = recovered.report.clone();
        let committed = recovered.committed;
        // Appends continue in the last segment, or a fresh one that sorts after everything.
        let (active, active_len, file) = match recovered.segments.last() {
            Some(last) if last.id >= committed.segment && !last.sealed => {
                (last.id, last.valid_end, storage.open_append(&segment_name(last.id))?)
            }
            _ => {
                let id = committed.segment.max(recovered.segments.last().map_or(1, |s| s.id + 1));
                let file = create_segment(&*storage, id)?;
                (id, SEGMENT_HEADER, file)
            }
        };
        // The state file records the last segment id from the start (a version 1 file is
        // rewritten as version 2 here).
        let current = storage
            .list()?
            .iter()
            .any(|n| n == STATE)
            .then(|| storage.read_all(STATE))
            .transpose()?
            .and_then(|bytes| format::decode_state(&bytes));
        if current.is_none_or(|state| state.last.is_none_or(|last| last < active)) {
            storage.write_atomic(STATE, &encode_state(committed, active))?;
        }
        let mut extents: BTreeMap<u64, Extent> = recovered
            .segments
            .iter()
            .map(|s| (s.id, Extent { valid_end: s.valid_end, skipped: s.skipped.clone() }))
            .collect();
        extents.entry(active).or_insert(Extent { valid_end: active_len, skipped: Vec::new() });
        let shared = Shared {
            extents,
            active,
            committed,
            records: report.records,
            bytes: report.bytes,
            failed: None,
            closed: false,
            reader: false,
            appended: 0,
            acknowledged: 0,
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let inner = Arc::new(Inner {
            storage: storage.clone(),
            options: options.clone(),
            requests: Mutex::new(Some(tx)),
            shared: Mutex::new(shared),
            data: Notify::new(),
            report: report.clone(),
        });
        let writer = Writer {
            inner: Arc::downgrade(&inner),
            storage,
            options,
            file,
            active,
            active_len,
            unsynced: false,
            last_sync: Instant::now(),
            persisted: committed,
            wanted: committed,
            lock: Some(guard),
        };
        std::thread::Builder::new()
            .name("lanes-spill-writer".to_owned())
            .spawn(move || writer.run(rx))
            .map_err(SpillError::Io)?;
        Ok((Self { inner }, report))
    }

    fn send(&self, request: Request) -> Result<(), SpillError> {
        let requests = lock(&self.inner.requests);
        let sender = requests.as_ref().ok_or(SpillError::Closed)?;
        sender.send(request).map_err(|_| SpillError::Closed)
    }

    /// Appends one record; returns once its sync policy is satisfied.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future after it started may still append the record (the write was handed
    /// to the writer): treat a dropped append as "maybe appended".
    ///
    /// # Errors
    ///
    /// [`SpillError::TooLarge`], [`SpillError::Full`], [`SpillError::Failed`] after an earlier
    /// I/O failure, [`SpillError::Closed`].
    pub async fn append(&self, record: impl AsRef<[u8]>) -> Result<(), SpillError> {
        self.append_batch(std::iter::once(record)).await
    }

    /// Appends records in order, as one group: they become durable together.
    ///
    /// # Cancel safety
    ///
    /// As for [`append`](Self::append).
    ///
    /// # Errors
    ///
    /// As for [`append`](Self::append); a refusal appends none of them.
    pub async fn append_batch<R: AsRef<[u8]>>(
        &self,
        records: impl IntoIterator<Item = R>,
    ) -> Result<(), SpillError> {
        self.start_append(records)?.await
    }

    /// Hands records to the writer without waiting: once this returns `Ok`, they are in the
    /// queue's write path (in order, ahead of any later append); the returned [`PendingAppend`]
    /// resolves when their sync policy is satisfied. Dropping it does not withdraw them.
    ///
    /// # Errors
    ///
    /// As for [`append`](Self::append), for the checks made before handing over.
    pub fn start_append<R: AsRef<[u8]>>(
        &self,
        records: impl IntoIterator<Item = R>,
    ) -> Result<PendingAppend, SpillError> {
        let max = self.inner.options.max_record;
        let mut frames = Vec::new();
        let mut count = 0u64;
        for record in records {
            let record = record.as_ref();
            if record.len() > max as usize {
                return Err(SpillError::TooLarge { len: record.len(), max });
            }
            frame::encode(record, &mut frames);
            count += 1;
        }
        if count == 0 {
            let (reply, answer) = oneshot::channel();
            let _ = reply.send(Ok(()));
            return Ok(PendingAppend { answer });
        }
        {
            let mut shared = lock(&self.inner.shared);
            if let Some(cause) = &shared.failed {
                return Err(SpillError::Failed(cause.clone()));
            }
            if shared.closed {
                return Err(SpillError::Closed);
            }
            let bytes = frames.len() as u64;
            if shared.bytes + bytes > self.inner.options.max_bytes {
                return Err(SpillError::Full { max_bytes: self.inner.options.max_bytes });
            }
            shared.bytes += bytes;
            shared.records += count;
            shared.appended += count;
        }
        let (reply, answer) = oneshot::channel();
        self.send(Request::Append { frames, reply })?;
        Ok(PendingAppend { answer })
    }

    /// Whether two handles are the same queue.
    pub fn same_queue(a: &Self, b: &Self) -> bool {
        Arc::ptr_eq(&a.inner, &b.inner)
    }

    /// The reader of this queue, starting at the committed position.
    ///
    /// # Errors
    ///
    /// [`SpillError::ReaderTaken`] while another reader is alive.
    pub fn reader(&self) -> Result<SpillReader, SpillError> {
        let mut shared = lock(&self.inner.shared);
        if shared.reader {
            return Err(SpillError::ReaderTaken);
        }
        shared.reader = true;
        Ok(SpillReader {
            inner: self.inner.clone(),
            cursor: shared.committed,
            unacked: VecDeque::new(),
        })
    }

    /// Unacknowledged records (appended, not yet committed by the reader).
    pub fn len(&self) -> u64 {
        lock(&self.inner.shared).records
    }

    /// Whether there is nothing unacknowledged.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Unacknowledged bytes, frames included.
    pub fn bytes(&self) -> u64 {
        lock(&self.inner.shared).bytes
    }

    /// What recovery found at open.
    pub fn recovered(&self) -> &CheckReport {
        &self.inner.report
    }

    /// The queue, as it is now.
    pub fn snapshot(&self) -> SpillSnapshot {
        self.inner.snapshot()
    }

    /// Reports the queue in `registry` under `name`.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] if `name` is taken.
    pub fn register(
        &self,
        registry: &Registry,
        name: impl Into<String>,
    ) -> Result<(), ConfigError> {
        let source: Arc<dyn Source> = self.inner.clone();
        // The registry holds it weakly; the queue's Inner keeps it alive.
        registry.register(name.into(), Arc::downgrade(&source))
    }

    /// Flushes and syncs everything, persists the committed position, and stops the writer.
    /// Appends after this fail with [`SpillError::Closed`]; the directory is free once this
    /// returns.
    ///
    /// # Errors
    ///
    /// An I/O error of the final sync.
    pub async fn close(&self) -> Result<(), SpillError> {
        {
            let mut shared = lock(&self.inner.shared);
            if shared.closed {
                return Ok(());
            }
            shared.closed = true;
        }
        let (reply, answer) = oneshot::channel();
        let sent = self.send(Request::Close { reply });
        lock(&self.inner.requests).take();
        self.inner.data.notify_waiters();
        sent?;
        answer.await.map_err(|_| SpillError::Closed)?
    }
}

impl Inner {
    fn snapshot(&self) -> SpillSnapshot {
        let shared = lock(&self.shared);
        SpillSnapshot {
            sync: self.options.sync,
            records: shared.records,
            bytes: shared.bytes,
            max_bytes: self.options.max_bytes,
            segments: shared.extents.len(),
            committed: shared.committed,
            appended: shared.appended,
            acknowledged: shared.acknowledged,
            failed: shared.failed.as_ref().map(|f| f.to_string()),
            recovered: self.report.clone(),
        }
    }
}

impl Source for Inner {
    fn report(&self, name: &str, snapshot: &mut Snapshot) {
        snapshot.spill.insert(name.to_owned(), self.snapshot());
    }
}

fn create_segment(storage: &dyn Storage, id: u64) -> std::io::Result<Box<dyn AppendFile>> {
    let mut file = storage.create(&segment_name(id))?;
    file.append(&format::segment_header(id))?;
    file.sync()?;
    storage.sync_dir()?;
    Ok(file)
}

/// Reads a [`SpillQueue`] in order and commits what it processed. One per queue at a time.
pub struct SpillReader {
    inner: Arc<Inner>,
    cursor: Position,
    /// Records read and not yet committed: (end position, frame bytes).
    unacked: VecDeque<(Position, u64)>,
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
            let batch = self.try_next_batch(max).await?;
            if !batch.is_empty() {
                return Ok(batch);
            }
            if lock(&self.inner.shared).closed {
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
        let mut out = Vec::new();
        while out.len() < max.max(1) {
            let Some(plan) = self.plan() else {
                break;
            };
            let storage = self.inner.storage.clone();
            let max_record = self.inner.options.max_record;
            let want = max.max(1) - out.len();
            let read = tokio::task::spawn_blocking(move || {
                read_frames(&*storage, &plan, want, max_record)
            })
            .await
            .map_err(|_| SpillError::Closed)??;
            if read.records.is_empty() && read.next == self.cursor {
                break;
            }
            for (data, end, len) in read.records {
                self.unacked.push_back((end, len));
                out.push(SpillRecord { data, end });
            }
            self.cursor = read.next;
        }
        Ok(out)
    }

    /// Where the next read goes, if there is anything to read.
    fn plan(&mut self) -> Option<Plan> {
        let shared = lock(&self.inner.shared);
        loop {
            let extent = shared.extents.get(&self.cursor.segment);
            let Some(extent) = extent else {
                // The cursor's segment is gone (acknowledged) or not created yet.
                let next = shared.extents.range(self.cursor.segment..).next()?;
                self.cursor = Position::start_of(*next.0);
                continue;
            };
            if let Some((_, end)) =
                extent.skipped.iter().find(|(s, e)| (*s..*e).contains(&self.cursor.offset))
            {
                self.cursor.offset = *end;
                continue;
            }
            if self.cursor.offset < extent.valid_end {
                let to = extent
                    .skipped
                    .iter()
                    .map(|(s, _)| *s)
                    .filter(|s| *s > self.cursor.offset)
                    .min()
                    .unwrap_or(extent.valid_end)
                    .min(extent.valid_end);
                return Some(Plan { segment: self.cursor.segment, from: self.cursor.offset, to });
            }
            // The end of this segment: move on if a later one exists.
            let next = shared.extents.range(self.cursor.segment + 1..).next()?;
            self.cursor = Position::start_of(*next.0);
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
    /// # Errors
    ///
    /// An I/O error persisting the state file, or [`SpillError::Closed`].
    pub async fn commit(&mut self, to: Position) -> Result<(), SpillError> {
        let (mut records, mut bytes) = (0u64, 0u64);
        while let Some((end, len)) = self.unacked.front().copied() {
            if end > to {
                break;
            }
            self.unacked.pop_front();
            records += 1;
            bytes += len;
        }
        {
            let mut shared = lock(&self.inner.shared);
            if to <= shared.committed {
                return Ok(());
            }
            shared.committed = to;
            shared.records -= records.min(shared.records);
            shared.bytes -= bytes.min(shared.bytes);
            shared.acknowledged += records;
        }
        let (reply, answer) = oneshot::channel();
        let requests = lock(&self.inner.requests).clone();
        requests
            .ok_or(SpillError::Closed)?
            .send(Request::Commit { to, reply })
            .map_err(|_| SpillError::Closed)?;
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
fn read_frames(
    storage: &dyn Storage,
    plan: &Plan,
    want: usize,
    max_record: u32,
) -> Result<Read, SpillError> {
    const CHUNK: u64 = 1 << 20;
    let name = segment_name(plan.segment);
    let len = (plan.to - plan.from).min(CHUNK.max(HEADER as u64 + u64::from(max_record)));
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

/// The writer thread's state.
struct Writer {
    inner: std::sync::Weak<Inner>,
    storage: Arc<dyn Storage>,
    options: SpillOptions,
    file: Box<dyn AppendFile>,
    active: u64,
    active_len: u64,
    unsynced: bool,
    last_sync: Instant,
    /// The committed position the state file holds.
    persisted: Position,
    /// The latest committed position asked for.
    wanted: Position,
    /// Released when the writer stops, after its last sync (and before `close` answers, so
    /// the directory is free once `close` returns).
    lock: Option<Box<dyn fmt::Debug + Send + Sync>>,
}

impl Writer {
    fn run(mut self, requests: Receiver<Request>) {
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
