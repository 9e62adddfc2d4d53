//! The spill queue: appends through one writer thread (group commit), one reader with a
//! committed position.
//!
//! # Implementation details
//!
//! Producers count their bytes under the shared lock, then frame their records straight into the
//! writer's mailbox (`writer.rs`). The writer takes everything waiting in one swap (and, under
//! [`SyncPolicy::Batch`], waits up to `batch_window` for more), writes them with one `write`,
//! and publishes the new end of data to readers. Under `Always` it then syncs and answers the
//! producers itself; under `Batch` it hands the answers to the sync thread and takes the next
//! group, and the sync thread answers them after the next sync it begins, so one group's write
//! overlaps the previous group's sync. A failed write or sync makes the queue refuse further
//! appends until it is reopened (recovery repairs what the failure left), so an unsynced failure
//! is never papered over.
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
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::{Notify, oneshot};

pub(super) use super::config::SpillOptions;
use super::config::SyncPolicy;
use super::core::Planner;
use super::error::SpillError;
use super::format::{self, Position, SEGMENT_HEADER, STATE, encode_state, segment_name};
use super::frame;
use super::metrics::SpillMetrics;
use super::reader::SpillReader;
use super::recover::{CheckReport, recover};
use super::snapshot::SpillSnapshot;
use super::storage::{AppendFile, FsStorage, Storage};
use super::writer::{Mailbox, Syncer, Writer};
use crate::observe::{Observe, Snapshot};
use crate::util::lock;

/// What a segment holds, for readers.
#[derive(Debug, Clone)]
pub(super) struct Extent {
    pub(super) valid_end: u64,
    pub(super) skipped: Vec<(u64, u64)>,
}

#[derive(Debug)]
pub(super) struct QueueState {
    pub(super) extents: BTreeMap<u64, Extent>,
    /// The segment appends go to.
    pub(super) active: u64,
    pub(super) committed: Position,
    /// The committed position the state file holds (the writer's last successful write).
    pub(super) persisted: Position,
    pub(super) records: u64,
    pub(super) bytes: u64,
    pub(super) failed: Option<Arc<str>>,
    pub(super) closed: bool,
    pub(super) reader: bool,
    pub(super) appended: u64,
    pub(super) acknowledged: u64,
}

pub(super) struct Inner {
    pub(super) storage: Arc<dyn Storage>,
    pub(super) options: SpillOptions,
    pub(super) mailbox: Arc<Mailbox>,
    pub(super) shared: Mutex<QueueState>,
    pub(super) data: Notify,
    pub(super) report: CheckReport,
    pub(super) metrics: SpillMetrics,
    /// Set by the writer once a close made everything durable and stopped it.
    pub(super) finished: tokio::sync::watch::Sender<bool>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Every handle and reader is gone: the writer makes things durable and stops.
        self.mailbox.abandon();
    }
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
    pub(super) data: Vec<u8>,
    pub(super) end: Position,
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
        let dir = dir.as_ref();
        let mut options = options;
        if options.name.is_none() && options.registry.is_none() {
            options.name = dir.file_name().map(|name| name.to_string_lossy().into_owned());
        }
        Self::open_with(FsStorage::new(dir), options).await
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
        let mut options = options;
        if options.name.is_none() {
            options.name = options.registry.as_ref().map(|r| r.name.clone());
        }
        let storage: Arc<dyn Storage> = Arc::new(storage);
        let blocking = storage.clone();
        let opts = options.clone();
        let metrics = SpillMetrics::new(options.name.as_deref().unwrap_or("unnamed"));
        tokio::task::spawn_blocking(move || Self::open_blocking(blocking, opts, metrics))
            .await
            .map_err(|_| SpillError::Closed)?
    }

    fn open_blocking(
        storage: Arc<dyn Storage>,
        options: SpillOptions,
        metrics: SpillMetrics,
    ) -> Result<(Self, CheckReport), SpillError> {
        storage.create_dir()?;
        let guard = storage.lock()?;
        let name = options.name.as_deref().unwrap_or("unnamed");
        let recovered = tracing::info_span!("lanes.spill.recover", spill = name)
            .in_scope(|| recover(&*storage, options.max_record, true))?;
        let report = recovered.report.clone();
        if report.is_clean() {
            tracing::debug!(
                spill = name,
                records = report.records,
                bytes = report.bytes,
                "recovered"
            );
        } else {
            tracing::warn!(
                spill = name,
                records = report.records,
                corrupt_regions = report.corrupt_regions,
                torn_tails = report.torn_tails,
                bad_segments = report.bad_segments,
                missing_segments = report.missing_segments,
                state_reset = report.state_reset,
                "recovered a damaged spill directory (see its CheckReport)"
            );
        }
        let committed = recovered.committed;
        // Appends continue in the last segment kept, or a fresh one after it. Only where the
        // file ends at its valid data: an append lands at the file's end, and its position is
        // counted from the valid end (bytes between would be read as a corrupt record).
        let (active, active_len, file) = match recovered.segments.last() {
            Some(last)
                if last.id >= committed.segment
                    && !last.closed
                    && storage.len(&segment_name(last.id))? == last.valid_end =>
            {
                let mut file = storage.open_append(&segment_name(last.id))?;
                reserve(&mut *file, options.segment_size);
                (last.id, last.valid_end, file)
            }
            _ => {
                let id = recovered.next_id;
                let file = create_segment(&*storage, id, options.segment_size)?;
                (id, SEGMENT_HEADER, file)
            }
        };
        // The state file records the last segment id from the start (a version 1 file is
        // rewritten as version 2 here).
        let current = match storage.list()?.iter().any(|n| n == STATE) {
            true => format::read_state(&*storage)?,
            false => None,
        };
        if current.is_none_or(|state| state.last.is_none_or(|last| last < active)) {
            storage.write_atomic(STATE, &encode_state(committed, active))?;
        }
        let mut extents: BTreeMap<u64, Extent> = recovered
            .segments
            .iter()
            .map(|s| (s.id, Extent { valid_end: s.valid_end, skipped: s.skipped.clone() }))
            .collect();
        extents.entry(active).or_insert(Extent { valid_end: active_len, skipped: Vec::new() });
        let shared = QueueState {
            extents,
            active,
            committed,
            persisted: committed,
            records: report.records,
            bytes: report.bytes,
            failed: None,
            closed: false,
            reader: false,
            appended: 0,
            acknowledged: 0,
        };
        let mailbox = Arc::new(Mailbox::default());
        let inner = Arc::new(Inner {
            storage: storage.clone(),
            options: options.clone(),
            mailbox: mailbox.clone(),
            shared: Mutex::new(shared),
            data: Notify::new(),
            finished: tokio::sync::watch::Sender::new(false),
            metrics: {
                metrics.recovered.increment(report.records);
                metrics.unacked_bytes.set(report.bytes as f64);
                metrics
            },
            report: report.clone(),
        });
        if let Some(registration) = &options.registry {
            // Before the writer starts: a refusal here drops the queue and frees the directory.
            registration.register(&inner).map_err(SpillError::InvalidOptions)?;
        }
        let syncer = match (options.sync, file.syncer().map_err(SpillError::Io)?) {
            (SyncPolicy::Batch, Some(handle)) => {
                Some((Syncer::start(Arc::downgrade(&inner)).map_err(SpillError::Io)?, handle))
            }
            _ => None,
        };
        let writer = Writer {
            syncer,
            inner: Arc::downgrade(&inner),
            mailbox,
            planner: Planner::new(options.sync, options.segment_size, active_len),
            storage,
            options,
            file,
            active,
            active_len,
            unsynced: false,
            last_sync: Instant::now(),
            sync_took: std::time::Duration::ZERO,
            last_group: 1,
            persisted: committed,
            wanted: committed,
            lock: Some(guard),
        };
        std::thread::Builder::new()
            .name("lanes-spill-writer".to_owned())
            .spawn(move || writer.run())
            .map_err(SpillError::Io)?;
        Ok((Self { inner }, report))
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
        let since = crate::observe::timing_start();
        let appended = self.hand_over(std::slice::from_ref(&record))?.await;
        self.timed(since);
        appended
    }

    /// Records an append's time to durability, if wait timing is on.
    fn timed(&self, since: Option<tokio::time::Instant>) {
        if let Some(since) = since {
            self.inner.metrics.append.record(since.elapsed().as_secs_f64());
        }
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
        let since = crate::observe::timing_start();
        let appended = self.start_append(records)?.await;
        self.timed(since);
        appended
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
        let records: Vec<R> = records.into_iter().collect();
        self.hand_over(&records)
    }

    /// Checks the records against the bounds, counts them, and frames them into the writer's
    /// mailbox.
    fn hand_over<R: AsRef<[u8]>>(&self, records: &[R]) -> Result<PendingAppend, SpillError> {
        let max = self.inner.options.max_record;
        let mut bytes = 0usize;
        for record in records {
            let len = record.as_ref().len();
            if len > max as usize {
                return Err(SpillError::TooLarge { len, max });
            }
            bytes += frame::HEADER + len;
        }
        let (reply, answer) = oneshot::channel();
        if records.is_empty() {
            let _ = reply.send(Ok(()));
            return Ok(PendingAppend { answer });
        }
        let count = records.len() as u64;
        {
            let mut shared = lock(&self.inner.shared);
            if let Some(cause) = &shared.failed {
                return Err(SpillError::Failed(cause.clone()));
            }
            if shared.closed {
                return Err(SpillError::Closed);
            }
            if shared.bytes + bytes as u64 > self.inner.options.max_bytes {
                return Err(SpillError::Full { max_bytes: self.inner.options.max_bytes });
            }
            shared.bytes += bytes as u64;
            shared.records += count;
            shared.appended += count;
        }
        if self.inner.mailbox.append(records, bytes, reply).is_err() {
            // Closed between the count and the hand-over: take the count back.
            let mut shared = lock(&self.inner.shared);
            shared.bytes -= bytes as u64;
            shared.records -= count;
            shared.appended -= count;
            return Err(SpillError::Closed);
        }
        let metrics = &self.inner.metrics;
        metrics.appended.increment(count);
        metrics.appended_bytes.increment((bytes - frame::HEADER * records.len()) as u64);
        metrics.unacked_bytes.increment(bytes as f64);
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

    /// Flushes and syncs everything, persists the committed position, and stops the writer.
    /// Appends after this fail with [`SpillError::Closed`]; the directory is free once this
    /// returns (a close another caller began is waited for).
    ///
    /// # Errors
    ///
    /// An I/O error of the final sync.
    pub async fn close(&self) -> Result<(), SpillError> {
        match self.begin_close() {
            // Closed by another caller (or the `Lifecycle` close): done once that close is,
            // failed if the queue failed. (Before, `Ok` at once, while the writer still wrote
            // and held the directory: a reopen right after found it locked.)
            None => {
                self.drained().await;
                match lock(&self.inner.shared).failed.clone() {
                    Some(cause) => Err(SpillError::Failed(cause)),
                    None => Ok(()),
                }
            }
            Some(answer) => answer.await.map_err(|_| SpillError::Closed)?,
        }
    }

    /// Refuses appends from now on and asks the writer to make everything durable and stop;
    /// `None` if the queue was closed already.
    fn begin_close(&self) -> Option<oneshot::Receiver<Result<(), SpillError>>> {
        {
            let mut shared = lock(&self.inner.shared);
            if shared.closed {
                return None;
            }
            shared.closed = true;
        }
        let (reply, answer) = oneshot::channel();
        let sent = self.inner.mailbox.close(reply);
        if sent.is_err() {
            // The writer is gone already (it failed): nothing more will be made durable.
            self.inner.finished.send_replace(true);
        }
        // After `finished`: a reader woken here reads it (the writer wakes them again when it
        // finishes).
        self.inner.data.notify_waiters();
        Some(answer)
    }

    /// Whether appends are refused (the queue was closed).
    pub fn is_closed(&self) -> bool {
        lock(&self.inner.shared).closed
    }

    /// Resolves once the queue is closed and its writer made every accepted append durable
    /// and stopped (what [`close`](Self::close) waits for). A spill queue's records outlive
    /// it on disk: drained means durable, not consumed. Waits forever if nobody closes it.
    pub async fn drained(&self) {
        let mut finished = self.inner.finished.subscribe();
        let _ = finished.wait_for(|done| *done).await;
    }
}

/// A spill queue's `close` (the trait's, which does not wait: [`SpillQueue::drained`] does)
/// makes everything durable; `abort` is the same, since the queue never drops an accepted
/// record.
impl crate::Lifecycle for SpillQueue {
    type Snapshot = SpillSnapshot;

    fn close(&self) {
        drop(self.begin_close());
    }

    fn is_closed(&self) -> bool {
        SpillQueue::is_closed(self)
    }

    fn drained(&self) -> crate::BoxFuture<'_, ()> {
        Box::pin(SpillQueue::drained(self))
    }

    fn abort(&self) {
        drop(self.begin_close());
    }

    fn snapshot(&self) -> SpillSnapshot {
        SpillQueue::snapshot(self)
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

impl Observe for Inner {
    fn report(&self, name: &str, snapshot: &mut Snapshot) {
        snapshot.insert("spill", name, &self.snapshot());
    }
}

/// Reserves `len` bytes of `file` (see [`AppendFile::reserve`]), if the disk has them: a
/// failure costs only the reservation. (Fatal, a disk too full for a whole segment failed the
/// queue at its next rotation, and then every open, though it had room for records: the
/// backlog could not even be opened to drain it.)
fn reserve(file: &mut dyn AppendFile, len: u64) {
    if let Err(err) = file.reserve(len) {
        tracing::debug!(error = %err, "segment space not reserved; appends grow the file");
    }
}

/// Creates segment `id` with its header, extended to `reserve` bytes if the disk has them
/// (see [`AppendFile::reserve`]), durably.
pub(super) fn create_segment(
    storage: &dyn Storage,
    id: u64,
    reserve: u64,
) -> std::io::Result<Box<dyn AppendFile>> {
    let mut file = storage.create(&segment_name(id))?;
    file.append(&format::segment_header(id))?;
    self::reserve(&mut *file, reserve);
    file.sync()?;
    storage.sync_dir()?;
    Ok(file)
}
