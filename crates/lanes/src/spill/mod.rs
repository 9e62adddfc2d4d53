//! The spill queue: an embedded, crash-safe, disk-backed FIFO queue of byte records — the
//! durable path behind a channel's `Overflow::Spill` and a consumer's `output` queue.
//!
//! The on-disk format (frames, segments, the state file, how it is replaced atomically, the
//! version) is specified in `FORMAT.md` beside this module.
//!
//! # Ordering
//!
//! Records are read in append order. Appends from several tasks are ordered by when the
//! writer receives them; a batch append stays together.
//!
//! # Durability
//!
//! See [`SyncPolicy`] for what each policy may lose, and when. Under every policy an
//! acknowledged append survives a process crash; under `Always` and `Batch` it also survives an
//! OS crash or a power loss.
//!
//! # Delivery
//!
//! At least once. A [`SpillReader`] reads from the committed position, processes, then commits.
//! Records read but not committed when the process stops are read again by the next reader.
//!
//! # Overflow
//!
//! The queue holds at most `max_bytes` of unacknowledged data; one more append fails at once
//! with [`SpillError::Full`] and writes nothing. A record over `max_record` fails with
//! [`SpillError::TooLarge`].
//!
//! # Recovery
//!
//! [`SpillQueue::open`] never refuses to start and never loops: a torn or corrupt tail is
//! truncated, a corrupt region in the middle of a segment is skipped up to the next valid
//! frame, a segment whose header is not its own is dropped, an unreadable state file means
//! everything on disk is delivered again. What was discarded is counted in the returned
//! [`CheckReport`] and in the snapshot. [`check`] reports the same without changing anything
//! (`lanes spill check DIR`).
//!
//! # Ownership
//!
//! One process owns a directory at a time, through an OS advisory lock on its `LOCK` file;
//! the OS releases it when the process dies, even by kill -9, so it is never stale.
//!
//! # Failures
//!
//! A failed write or sync makes the queue refuse further appends with [`SpillError::Failed`]
//! until it is reopened: after a failed `fsync` the state of the page cache is unknown, so the
//! queue does not pretend otherwise. Appends acknowledged before the failure are safe.
//!
//! ---
//!
#![doc = include_str!("FORMAT.md")]

mod config;
mod core;
mod durable;
mod error;
mod format;
mod frame;
mod handle;
mod metrics;
mod reader;
mod recover;
mod snapshot;
mod storage;
mod writer;

use std::path::Path;

pub use config::{SpillOptions, SyncPolicy};
pub use durable::{Appending, DurableQueue};
pub use error::SpillError;
pub use format::{FORMAT_VERSION, Position};
pub use handle::{PendingAppend, SpillQueue, SpillRecord};
pub use reader::SpillReader;
pub use recover::CheckReport;
pub use snapshot::SpillSnapshot;
pub use storage::{AppendFile, Fault, FileSync, FsStorage, MemStorage, Storage};

/// Checks the queue in `dir` without changing anything: segments, records, bytes, committed
/// position and any corruption.
///
/// # Errors
///
/// [`SpillError::Missing`] if `dir` does not exist, [`SpillError::NotADirectory`] if it is a
/// file, [`SpillError::NotAQueue`] if it holds no queue, [`SpillError::Locked`] if another
/// process owns it ([`SpillError::LockedHere`]: this one), or an I/O error.
pub fn check(dir: impl AsRef<Path>, max_record: u32) -> Result<CheckReport, SpillError> {
    inspect(&FsStorage::new(dir.as_ref()), max_record, false)
}

/// Repairs the queue in `dir` the way opening it would — truncates torn tails, drops foreign
/// segments and fully acknowledged ones — and reports what it found.
///
/// # Errors
///
/// As for [`check`].
pub fn repair(dir: impl AsRef<Path>, max_record: u32) -> Result<CheckReport, SpillError> {
    inspect(&FsStorage::new(dir.as_ref()), max_record, true)
}

fn inspect(storage: &FsStorage, max_record: u32, repair: bool) -> Result<CheckReport, SpillError> {
    let shown = storage.dir().display().to_string();
    if storage.dir().exists() && !storage.exists() {
        return Err(SpillError::NotADirectory(shown));
    }
    if !storage.exists() {
        return Err(SpillError::Missing(shown));
    }
    let names = storage.list()?;
    let is_queue = names.iter().any(|n| n == format::STATE || format::segment_id(n).is_some());
    if !is_queue {
        return Err(SpillError::NotAQueue(shown));
    }
    // A live owner makes the result meaningless. A repair holds the lock; a check only reads,
    // so it works on a read-only file system and leaves no LOCK file behind.
    if repair {
        let _lock = storage.lock()?;
        return Ok(recover::recover(storage, max_record, true)?.report);
    }
    if storage.is_owned()? {
        return Err(SpillError::Locked);
    }
    Ok(recover::recover(storage, max_record, false)?.report)
}
