//! The channel's errors: what an emit, a build or a settlement refuses, with the record handed
//! back where there is one.

use std::fmt;

use super::consumer::SettleReport;
use crate::BoxError;
use crate::config::ConfigError;
use crate::spill::SpillError;

/// A record that was not emitted, handed back.
#[derive(Debug)]
pub enum EmitError<T> {
    /// The channel is full and its policy is [`Overflow::Block`](super::Overflow::Block) (from
    /// [`try_emit`](super::Channel::try_emit)).
    Full(T),
    /// The channel is closed.
    Closed(T),
    /// The record could not be spilled: the spill queue refused it or failed.
    Spill(T, SpillError),
    /// The record could not be encoded for the spill queue.
    Encode(T, BoxError),
}

impl<T> EmitError<T> {
    /// The refused record: the name every refusal in the crate uses
    /// ([`into_record`](Self::into_record) by another name).
    pub fn into_inner(self) -> T {
        self.into_record()
    }

    /// The record.
    pub fn into_record(self) -> T {
        match self {
            Self::Full(record)
            | Self::Closed(record)
            | Self::Spill(record, _)
            | Self::Encode(record, _) => record,
        }
    }

    /// Whether the channel was full: its buffer under [`Overflow::Block`](super::Overflow::Block),
    /// or its spill queue at its `max_bytes` ([`SpillError::Full`]) under
    /// [`Overflow::spill`](super::Overflow::spill).
    pub fn is_full(&self) -> bool {
        matches!(self, Self::Full(_) | Self::Spill(_, SpillError::Full { .. }))
    }

    /// Whether the channel was closed.
    pub fn is_closed(&self) -> bool {
        matches!(self, Self::Closed(_))
    }
}

impl<T> fmt::Display for EmitError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Full(_) => f.write_str("the channel is full"),
            Self::Closed(_) => f.write_str("the channel is closed"),
            Self::Spill(_, err) => write!(f, "the record could not be spilled: {err}"),
            Self::Encode(_, err) => write!(f, "the record could not be encoded: {err}"),
        }
    }
}

impl<T: fmt::Debug> std::error::Error for EmitError<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Spill(_, err) => Some(err),
            Self::Encode(_, err) => Some(&**err),
            Self::Full(_) | Self::Closed(_) => None,
        }
    }
}

/// A registry or consumer operation that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ChannelError {
    /// The configuration broke a rule.
    Config(ConfigError),
    /// [`Channels::create`](super::Channels::create): the name is taken.
    Duplicate(String),
    /// [`Channels::get_or_create`](super::Channels::get_or_create): the channel exists with a
    /// different configuration.
    ConfigMismatch {
        /// The channel.
        name: String,
        /// The first field that differs.
        field: &'static str,
    },
    /// The channel exists with another record type.
    TypeMismatch(String),
    /// No channel has this name.
    NotFound(String),
    /// The channel already has its consumer.
    ConsumerTaken(String),
    /// The channel is closed.
    Closed(String),
}

impl fmt::Display for ChannelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Config(err) => err.fmt(f),
            Self::Duplicate(name) => write!(f, "channel {name:?} already exists"),
            Self::ConfigMismatch { name, field } => {
                write!(f, "channel {name:?} exists with a different {field}")
            }
            Self::TypeMismatch(name) => {
                write!(f, "channel {name:?} exists with another record type")
            }
            Self::NotFound(name) => write!(f, "no channel is named {name:?}"),
            Self::ConsumerTaken(name) => write!(f, "channel {name:?} already has its consumer"),
            Self::Closed(name) => write!(f, "channel {name:?} is closed"),
        }
    }
}

impl std::error::Error for ChannelError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Config(err) => Some(err),
            _ => None,
        }
    }
}

impl From<ConfigError> for ChannelError {
    fn from(err: ConfigError) -> Self {
        Self::Config(err)
    }
}

/// A settlement whose output or dead-letter write failed: the records concerned are counted
/// failed (`unwritten`), the rest settled as reported.
#[derive(Debug)]
pub struct SettleError {
    /// What the settlement did.
    pub report: SettleReport,
    /// The first write error.
    pub error: SpillError,
}

impl fmt::Display for SettleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} records could not be written: {}", self.report.unwritten, self.error)
    }
}

impl std::error::Error for SettleError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}
