//! Errors of the spill queue.

use std::fmt;
use std::io;
use std::sync::Arc;

use crate::config::ConfigError;

/// Why a spill queue operation failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum SpillError {
    /// The queue holds `max_bytes` of unacknowledged data already.
    Full {
        /// The configured bound.
        max_bytes: u64,
    },
    /// The record is larger than the configured maximum.
    TooLarge {
        /// The record's length.
        len: usize,
        /// The configured maximum.
        max: u32,
    },
    /// An earlier write or sync failed: the queue refuses further appends until it is
    /// reopened (recovery then repairs what the failure left). Appends acknowledged before the
    /// failure are safe.
    Failed(Arc<str>),
    /// An I/O error.
    Io(io::Error),
    /// Another process owns the directory.
    Locked,
    /// This process has the directory open already (another `SpillQueue`, or a repair).
    LockedHere,
    /// The directory does not exist.
    Missing(String),
    /// The path exists but is not a directory.
    NotADirectory(String),
    /// The directory exists but holds no spill queue.
    NotAQueue(String),
    /// Another reader is open on this queue.
    ReaderTaken,
    /// The queue was closed.
    Closed,
    /// The options broke a rule.
    InvalidOptions(ConfigError),
    /// A record read back failed its checksum (the data changed on disk after it was written).
    Corrupt {
        /// Where.
        position: super::Position,
    },
    /// A commit past what the reader has read, or of a position it never handed out (a
    /// position of another queue, say): it would acknowledge records nobody read, or leave the
    /// committed position inside a record.
    NotRead {
        /// The position asked for.
        position: super::Position,
        /// Where the reader's next read starts: commits go up to here.
        read_to: super::Position,
    },
    /// A queue kept by a remote store (a [`DurableQueue`](super::DurableQueue) such as a
    /// JetStream stream) could not take the records: unreachable, refused (its limits), or no
    /// acknowledgement in time. They may or may not have been stored.
    Remote(String),
}

impl SpillError {
    /// The queue is full.
    pub fn is_full(&self) -> bool {
        matches!(self, Self::Full { .. })
    }
}

impl fmt::Display for SpillError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Full { max_bytes } => {
                write!(f, "spill queue full ({max_bytes} bytes unacknowledged)")
            }
            Self::TooLarge { len, max } => {
                write!(f, "record of {len} bytes is over the maximum of {max}")
            }
            Self::Failed(cause) => {
                write!(f, "spill queue failed earlier ({cause}); reopen it to recover")
            }
            Self::Io(err) => write!(f, "spill queue I/O: {err}"),
            Self::Locked => f.write_str("spill queue directory is locked by another process"),
            Self::LockedHere => {
                f.write_str("spill queue directory is already open in this process")
            }
            Self::Missing(dir) => write!(f, "spill queue directory {dir} does not exist"),
            Self::NotADirectory(path) => write!(f, "{path} is not a directory"),
            Self::NotAQueue(dir) => write!(f, "{dir} does not hold a spill queue"),
            Self::ReaderTaken => f.write_str("spill queue already has a reader"),
            Self::Closed => f.write_str("spill queue is closed"),
            Self::InvalidOptions(err) => err.fmt(f),
            Self::Corrupt { position } => write!(f, "spill record at {position} is corrupt"),
            Self::NotRead { position, read_to } => {
                write!(f, "commit at {position} is past what the reader has read (up to {read_to})")
            }
            Self::Remote(message) => write!(f, "durable queue: {message}"),
        }
    }
}

impl std::error::Error for SpillError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io(err) => Some(err),
            Self::InvalidOptions(err) => Some(err),
            _ => None,
        }
    }
}

impl From<io::Error> for SpillError {
    fn from(err: io::Error) -> Self {
        match err.kind() {
            io::ErrorKind::WouldBlock => Self::Locked,
            // The storage's way of saying "this process holds the lock already".
            io::ErrorKind::ResourceBusy => Self::LockedHere,
            _ => Self::Io(err),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A channel's `EmitError` carries it: the answer of every `emit`, written and copied on the
    /// producer's path (suite 3's stop-52 note). No larger than its largest part, five words.
    #[test]
    fn a_spill_error_stays_five_words() {
        assert!(std::mem::size_of::<SpillError>() <= 40, "{}", std::mem::size_of::<SpillError>());
    }
}
