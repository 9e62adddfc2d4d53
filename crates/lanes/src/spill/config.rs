//! The spill queue's options: the sync policy and the bounds, validated once at open.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::format::SEGMENT_HEADER;
use super::frame::{self, HEADER};
use crate::config::{ConfigError, ConfigRule};
use crate::observe::{Registration, Registry};

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
/// file is durable; under `Interval(d)` it is written every `d`, under `Never` at close, and
/// under both whenever a commit moves into a later segment, so that the segments the reader
/// finished are deleted while the queue runs. A commit lost in a crash means its records are
/// delivered again (at least once).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SyncPolicy {
    /// Every append is written and synced on its own before it returns.
    Always,
    /// Group commit: appends are written as they come, and each returns after the next sync
    /// that began after its write. Syncs run on their own thread, one after another: the
    /// appends written while one runs share the next, so writing overlaps syncing.
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
    /// [`SpillError::Full`](super::SpillError::Full). Default: 1 GiB. At least one whole frame of
    /// the largest record: `12 + max_record`.
    pub max_bytes: u64,
    /// The largest record, 1 to 2^31 - 1 bytes. Default: 8 MiB.
    pub max_record: u32,
    /// Segments are rotated once they reach this size. Default: 64 MiB. At least the segment
    /// header and one frame: `16 + min(12 + max_record, 1 MiB)`.
    pub segment_size: u64,
    /// The queue's name in metrics (the `spill` label). Default: the registry name, else the
    /// directory's last component for [`SpillQueue::open`](super::SpillQueue::open), else
    /// `unnamed`.
    pub name: Option<String>,
    /// Where the queue reports its snapshot, set with [`registry`](Self::registry).
    pub(crate) registry: Option<Registration>,
}

impl Default for SpillOptions {
    fn default() -> Self {
        Self {
            sync: SyncPolicy::Batch,
            batch_window: Duration::ZERO,
            max_bytes: 1 << 30,
            max_record: 8 << 20,
            segment_size: 64 << 20,
            name: None,
            registry: None,
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

    /// Sets the queue's name in metrics.
    #[must_use]
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Reports the queue's snapshot in `registry` under `name` once it is open (a name already
    /// taken refuses the open before recovery starts). The name is also the metrics label
    /// unless [`name`](Self::name) gives another.
    ///
    /// # Examples
    ///
    /// ```
    /// use lanes::{Registry, SpillOptions, SpillQueue};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lanes::SpillError> {
    /// let dir = std::env::temp_dir().join(format!("lanes-doc-registry-{}", std::process::id()));
    /// let registry = Registry::new();
    /// let options = SpillOptions::default().registry(&registry, "overflow");
    /// let (queue, _report) = SpillQueue::open(&dir, options).await?;
    /// assert_eq!(registry.snapshot().spill("overflow").unwrap().records, 0);
    /// queue.close().await?;
    /// # drop(queue);
    /// # std::fs::remove_dir_all(&dir).ok();
    /// # Ok(())
    /// # }
    /// ```
    #[must_use]
    pub fn registry(mut self, registry: &Registry, name: impl Into<String>) -> Self {
        self.registry = Some(Registration::new(registry, name));
        self
    }

    /// Sets the group-commit window.
    #[must_use]
    pub fn batch_window(mut self, window: Duration) -> Self {
        self.batch_window = window;
        self
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
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
        self.registry.as_ref().map_or(Ok(()), Registration::check)
    }
}
