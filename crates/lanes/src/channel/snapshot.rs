//! What a channel and a registry of channels report: the snapshots the
//! [`Registry`](crate::Registry) stores.

use serde::{Deserialize, Serialize};

use super::config::OverflowKind;

/// A channel's state and counters, as a snapshot reports them.
///
/// The counters reconcile exactly: `emitted = delivered + dropped + spilled + depth`, and of
/// the delivered, `processed + failed + abandoned` have been settled (the rest are in batches
/// the consumer holds).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ChannelSnapshot {
    /// The channel's name.
    pub name: String,
    /// Its owner, if it has one.
    pub owner: Option<String>,
    /// Whether it is a dynamic channel (under the registry's budget).
    pub dynamic: bool,
    /// Its overflow policy.
    pub overflow: OverflowKind,
    /// The most records it holds.
    pub capacity: usize,
    /// Records queued now.
    pub depth: usize,
    /// Records producers emitted (queued, dropped as newest, or spilled).
    pub emitted: u64,
    /// Records handed to the consumer.
    pub delivered: u64,
    /// Records dropped: by the overflow policy, on a discarding close, or when the consumer
    /// went away.
    pub dropped: u64,
    /// Records sent to the spill queue.
    pub spilled: u64,
    /// Emits that had to wait for room.
    pub blocked_waits: u64,
    /// Delivered records the consumer processed.
    pub processed: u64,
    /// Delivered records the consumer failed (`tagged + dead_lettered + ignored`, plus records
    /// whose output write failed).
    pub failed: u64,
    /// Failed records re-emitted downstream with a tag.
    pub tagged: u64,
    /// Failed records sent to the dead-letter queue.
    pub dead_lettered: u64,
    /// Failed records counted and dropped.
    pub ignored: u64,
    /// Delivered records whose batch was dropped unsettled.
    pub abandoned: u64,
    /// Settlements that came after their receipt had timed out (and were ignored).
    pub late_settlements: u64,
    /// Times the consumer's limit refused a permit (the consumer retries with a backoff).
    pub limit_errors: u64,
    /// Whether it is closed.
    pub closed: bool,
    /// Whether its consumer has been taken.
    pub has_consumer: bool,
    /// How long the oldest queued record has waited, in milliseconds (0 when empty). Enqueue
    /// times are sampled every 128 records (and whenever a record finds the channel empty), so
    /// this is the age of the nearest sample at or before the oldest record: never younger than
    /// the truth, older by at most the time 127 records took to arrive.
    pub oldest_age_ms: u64,
}

impl ChannelSnapshot {
    /// Whether `emitted = delivered + dropped + spilled + depth`.
    pub fn reconciles(&self) -> bool {
        self.emitted == self.delivered + self.dropped + self.spilled + self.depth as u64
    }
}

/// A [`Channels`](super::Channels) registry (or one registered channel), as a snapshot reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ChannelsSnapshot {
    /// The budget of the dynamic channels, if there is one.
    pub budget: Option<BudgetSnapshot>,
    /// The open channels, by name.
    pub channels: Vec<ChannelSnapshot>,
}

/// A registry's budget of queued records across its dynamic channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetSnapshot {
    /// The most records the dynamic channels hold together.
    pub total: usize,
    /// Records they hold now (queued, or handed to a waiting read and not yet taken).
    pub used: usize,
}

impl crate::observe::Snapshot {
    /// The channel registry (or single channel) registered as `name`.
    pub fn channels(&self, name: &str) -> Option<ChannelsSnapshot> {
        self.get("channels", name)
    }
}
