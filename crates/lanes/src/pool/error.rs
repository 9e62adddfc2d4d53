//! Errors of the pools: submission (the item is handed back) and stop.

use std::error::Error;
use std::fmt;
use std::time::Duration;

/// An item was not accepted. It is handed back.
#[non_exhaustive]
pub enum SubmitError<T> {
    /// The pool's queue is full.
    Full(T),
    /// The item's key queue is full (in hashed mode, its shard's queue).
    KeyFull(T),
    /// The pool tracks its maximum of keys already.
    TooManyKeys(T),
    /// The pool was stopped or aborted.
    Stopped(T),
    /// Another item with the same completion key is still in flight: waiting for its
    /// completion signal, or still in the dispatcher.
    DuplicateKey(T),
    /// The completion tracker holds its maximum of items.
    TrackingFull(T),
}

impl<T> SubmitError<T> {
    /// Gives the item back.
    pub fn into_inner(self) -> T {
        match self {
            Self::Full(item)
            | Self::KeyFull(item)
            | Self::TooManyKeys(item)
            | Self::Stopped(item)
            | Self::DuplicateKey(item)
            | Self::TrackingFull(item) => item,
        }
    }

    /// The pool's queue was full.
    pub fn is_full(&self) -> bool {
        matches!(self, Self::Full(_))
    }

    /// The key's queue was full.
    pub fn is_key_full(&self) -> bool {
        matches!(self, Self::KeyFull(_))
    }

    /// The pool was stopped.
    pub fn is_stopped(&self) -> bool {
        matches!(self, Self::Stopped(_))
    }

    fn describe(&self) -> &'static str {
        match self {
            Self::Full(_) => "the pool's queue is full",
            Self::KeyFull(_) => "the key's queue is full",
            Self::TooManyKeys(_) => "the pool tracks too many keys",
            Self::Stopped(_) => "the pool was stopped",
            Self::DuplicateKey(_) => "an item with the same completion key is in flight",
            Self::TrackingFull(_) => "the completion tracker is full",
        }
    }
}

impl<T> fmt::Debug for SubmitError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Self::Full(_) => "Full",
            Self::KeyFull(_) => "KeyFull",
            Self::TooManyKeys(_) => "TooManyKeys",
            Self::Stopped(_) => "Stopped",
            Self::DuplicateKey(_) => "DuplicateKey",
            Self::TrackingFull(_) => "TrackingFull",
        };
        f.debug_tuple(name).finish_non_exhaustive()
    }
}

impl<T> fmt::Display for SubmitError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.describe())
    }
}

impl<T> Error for SubmitError<T> {}

/// A stop did not finish draining in time. Draining goes on: a later stop can observe it
/// finish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct StopTimeout {
    /// The timeout that elapsed.
    pub after: Duration,
    /// Items still queued.
    pub queued: usize,
    /// Items still being processed.
    pub inflight: usize,
}

impl fmt::Display for StopTimeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the pool did not drain within {:?} ({} queued, {} in flight); it keeps draining",
            self.after, self.queued, self.inflight
        )
    }
}

impl Error for StopTimeout {}

/// What an abort discarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct AbortReport {
    /// Queued items dropped unprocessed.
    pub discarded: u64,
    /// Items whose processing was cancelled.
    pub cancelled: u64,
}
