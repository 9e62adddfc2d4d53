//! How a channel and its consumer are configured, and the errors that can come back.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::codec::Codec;
use crate::config::{ConfigError, ConfigRule};
use crate::limit::{Limits, OnRefusal, Priority, Throttle};
use crate::observe::{Registration, Registry};
use crate::spill::DurableQueue;

/// The largest capacity a channel accepts.
pub const MAX_CAPACITY: usize = 1 << 24;

/// The capacity of a channel configured with [`ChannelConfig::default`], as dynamic channels are.
pub const DEFAULT_CAPACITY: usize = 512;

/// The default time a receipt waits for its record to be settled.
pub const DEFAULT_ACK_TIMEOUT: Duration = Duration::from_secs(30);

/// What a producer's record does when the channel (or the registry's shared budget) is full.
pub enum Overflow<T> {
    /// The producer waits for room (the default). [`Channel::emit`](super::Channel::emit) is
    /// cancel-safe: dropping it while it waits leaves nothing enqueued. Waits are counted in
    /// `blocked_waits`.
    Block,
    /// The new record is dropped (counted in `dropped`) and handed back to the producer.
    DropNewest,
    /// The oldest queued record is dropped (counted in `dropped`) to make room for the new one.
    DropOldest,
    /// The new record is encoded once with the codec and appended to the spill queue (counted in
    /// `spilled`). It never flows back into the channel: a slow-path consumer reads the queue.
    /// The queue is any [`DurableQueue`]: a local [`SpillQueue`](crate::spill::SpillQueue), or
    /// one on another machine (`lanes_nats::JetStreamQueue`).
    Spill(Arc<dyn DurableQueue>, Arc<dyn Codec<T>>),
}

impl<T> Overflow<T> {
    /// [`Overflow::Spill`] to `queue` with `codec`.
    pub fn spill(queue: impl DurableQueue, codec: impl Codec<T> + 'static) -> Self {
        Self::Spill(Arc::new(queue), Arc::new(codec))
    }

    /// The policy's name, as snapshots report it.
    pub fn kind(&self) -> OverflowKind {
        match self {
            Self::Block => OverflowKind::Block,
            Self::DropNewest => OverflowKind::DropNewest,
            Self::DropOldest => OverflowKind::DropOldest,
            Self::Spill(..) => OverflowKind::Spill,
        }
    }

    fn same(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Spill(a, ca), Self::Spill(b, cb)) => {
                a.same_as(&**b) && ca.codec_id() == cb.codec_id()
            }
            _ => self.kind() == other.kind(),
        }
    }
}

impl<T> Clone for Overflow<T> {
    fn clone(&self) -> Self {
        match self {
            Self::Block => Self::Block,
            Self::DropNewest => Self::DropNewest,
            Self::DropOldest => Self::DropOldest,
            Self::Spill(queue, codec) => Self::Spill(queue.clone(), codec.clone()),
        }
    }
}

// A derive would ask `T: Default`.
#[allow(clippy::derivable_impls)]
impl<T> Default for Overflow<T> {
    fn default() -> Self {
        Self::Block
    }
}

impl<T> fmt::Debug for Overflow<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Spill(_, codec) => write!(f, "Spill({})", codec.codec_id()),
            other => fmt::Debug::fmt(&other.kind(), f),
        }
    }
}

/// The name of an [`Overflow`] policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OverflowKind {
    /// [`Overflow::Block`].
    Block,
    /// [`Overflow::DropNewest`].
    DropNewest,
    /// [`Overflow::DropOldest`].
    DropOldest,
    /// [`Overflow::Spill`].
    Spill,
}

/// A channel's configuration. Two configurations are the same (for
/// [`Channels::get_or_create`](super::Channels::get_or_create)) when every field is, spill
/// queues being the same queue and codecs the same type.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use lanes::channel::{ChannelConfig, Overflow};
///
/// let config = ChannelConfig::<u64>::new(1024)
///     .overflow(Overflow::DropOldest)
///     .owner("session-42")
///     .ack_timeout(Duration::from_secs(5));
/// assert_eq!(config.capacity(), 1024);
/// ```
pub struct ChannelConfig<T> {
    pub(crate) capacity: usize,
    pub(crate) overflow: Overflow<T>,
    pub(crate) owner: Option<Arc<str>>,
    pub(crate) discard_on_close: bool,
    pub(crate) ack_timeout: Duration,
    pub(crate) registry: Option<Registration>,
}

impl<T> ChannelConfig<T> {
    /// A channel holding at most `capacity` records, blocking producers when full.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            overflow: Overflow::Block,
            owner: None,
            discard_on_close: false,
            ack_timeout: DEFAULT_ACK_TIMEOUT,
            registry: None,
        }
    }

    /// What a record does when the channel is full (default [`Overflow::Block`]).
    pub fn overflow(mut self, overflow: Overflow<T>) -> Self {
        self.overflow = overflow;
        self
    }

    /// The owner: [`Channels::close_owner`](super::Channels::close_owner) closes every channel
    /// of an owner at once.
    pub fn owner(mut self, owner: impl Into<Arc<str>>) -> Self {
        self.owner = Some(owner.into());
        self
    }

    /// On close, drop the records still queued (counted in `dropped`, their receipts settle
    /// [`Dropped`](super::Settlement::Dropped)) instead of letting the consumer drain them.
    pub fn discard_on_close(mut self) -> Self {
        self.discard_on_close = true;
        self
    }

    /// How long a receipt waits to be settled before it settles
    /// [`TimedOut`](super::Settlement::TimedOut) (default 30 s).
    pub fn ack_timeout(mut self, timeout: Duration) -> Self {
        self.ack_timeout = timeout;
        self
    }

    /// Reports a standalone channel in `registry` under `name` when it is built (a name already
    /// taken refuses the build). The name is also the channel's name unless
    /// [`Channel::named`](super::Channel::named) gives another. A channel of a
    /// [`Channels`](super::Channels) is reported with its `Channels` instead
    /// ([`ChannelsBuilder::registry`](super::ChannelsBuilder::registry)).
    ///
    /// # Examples
    ///
    /// ```
    /// use lanes::{Channel, ChannelConfig, Registry};
    ///
    /// let registry = Registry::new();
    /// let channel = Channel::<u32>::new(ChannelConfig::new(8).registry(&registry, "events"))?;
    /// assert_eq!(channel.name(), "events");
    /// assert!(registry.snapshot().channels("events").is_some());
    /// # Ok::<(), lanes::ChannelError>(())
    /// ```
    pub fn registry(mut self, registry: &Registry, name: impl Into<String>) -> Self {
        self.registry = Some(Registration::new(registry, name));
        self
    }

    /// The capacity.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub(crate) fn validate(&self, name: &str) -> Result<(), ConfigError> {
        if self.capacity == 0 {
            return Err(ConfigError::new(format!("channels.{name}.capacity"), ConfigRule::Zero));
        }
        if self.capacity > MAX_CAPACITY {
            return Err(ConfigError::new(
                format!("channels.{name}.capacity"),
                ConfigRule::OverMax { max: MAX_CAPACITY },
            ));
        }
        if self.ack_timeout.is_zero() {
            return Err(ConfigError::new(
                format!("channels.{name}.ack_timeout"),
                ConfigRule::ZeroTimeout,
            ));
        }
        Ok(())
    }

    /// The first field that differs from `other`, if any.
    pub(crate) fn difference(&self, other: &Self) -> Option<&'static str> {
        if self.capacity != other.capacity {
            Some("capacity")
        } else if !self.overflow.same(&other.overflow) {
            Some("overflow")
        } else if self.owner != other.owner {
            Some("owner")
        } else if self.discard_on_close != other.discard_on_close {
            Some("discard_on_close")
        } else if self.ack_timeout != other.ack_timeout {
            Some("ack_timeout")
        } else {
            None
        }
    }
}

impl<T> Default for ChannelConfig<T> {
    /// [`DEFAULT_CAPACITY`] records, blocking.
    fn default() -> Self {
        Self::new(DEFAULT_CAPACITY)
    }
}

impl<T> Clone for ChannelConfig<T> {
    fn clone(&self) -> Self {
        Self {
            capacity: self.capacity,
            overflow: self.overflow.clone(),
            owner: self.owner.clone(),
            discard_on_close: self.discard_on_close,
            ack_timeout: self.ack_timeout,
            registry: self.registry.clone(),
        }
    }
}

impl<T> fmt::Debug for ChannelConfig<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChannelConfig")
            .field("capacity", &self.capacity)
            .field("overflow", &self.overflow)
            .field("owner", &self.owner)
            .field("discard_on_close", &self.discard_on_close)
            .field("ack_timeout", &self.ack_timeout)
            .field("registry", &self.registry)
            .finish()
    }
}

/// What the consumer does with a record it failed.
pub enum FailurePolicy {
    /// Count it (`failed`, `ignored`) and drop it.
    Ignore,
    /// Re-emit it downstream, to the consumer's [`output`](ConsumerOptions::output) queue, with
    /// this tag and the error's message as its envelope's tags.
    Tag(String),
    /// Append it to this dead-letter queue, with the error's message as its envelope's tag.
    DeadLetter(Arc<dyn DurableQueue>),
}

impl FailurePolicy {
    /// [`FailurePolicy::DeadLetter`] to `queue`: a local
    /// [`SpillQueue`](crate::spill::SpillQueue), or any other [`DurableQueue`].
    pub fn dead_letter(queue: impl DurableQueue) -> Self {
        Self::DeadLetter(Arc::new(queue))
    }
}

impl fmt::Debug for FailurePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ignore => f.write_str("Ignore"),
            Self::Tag(tag) => f.debug_tuple("Tag").field(tag).finish(),
            Self::DeadLetter(_) => f.write_str("DeadLetter(..)"),
        }
    }
}

/// Whether a consumer with a limit takes a permit per batch or per record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PermitPer {
    /// One permit per batch, held until the batch is settled or dropped.
    Batch,
    /// One permit per record: a batch is as large as the permits available at once (at least
    /// one, awaited), all held until the batch is settled or dropped.
    Record,
}

/// How a consumer receives and settles batches.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use lanes::channel::{ConsumerOptions, FailurePolicy};
///
/// let options = ConsumerOptions::<u64>::new()
///     .batch_max(64)
///     .batch_flush(Duration::from_millis(10))
///     .on_failure(FailurePolicy::Ignore);
/// # let _ = options;
/// ```
pub struct ConsumerOptions<T> {
    pub(crate) batch_max: usize,
    pub(crate) batch_flush: Duration,
    pub(crate) on_failure: FailurePolicy,
    pub(crate) output: Option<Arc<dyn DurableQueue>>,
    pub(crate) codec: Option<Arc<dyn Codec<T>>>,
    pub(crate) limit: Option<ConsumerLimit>,
}

pub(crate) struct ConsumerLimit {
    pub(crate) throttle: Throttle,
    pub(crate) per: PermitPer,
}

impl<T> ConsumerOptions<T> {
    /// One record per batch, delivered at once, failures ignored, no output, no limit.
    pub fn new() -> Self {
        Self {
            batch_max: 1,
            batch_flush: Duration::ZERO,
            on_failure: FailurePolicy::Ignore,
            output: None,
            codec: None,
            limit: None,
        }
    }

    /// The most records in a batch (default 1). A full batch is delivered at once.
    pub fn batch_max(mut self, batch_max: usize) -> Self {
        self.batch_max = batch_max;
        self
    }

    /// The longest the oldest record of a partial batch waits before the batch is delivered
    /// anyway (default zero: whatever is queued is delivered at once, up to `batch_max`).
    /// To stay within it on tokio's 1 ms timer ticks, a partial batch leaves up to
    /// `min(1 ms, batch_flush / 10)` early. The oldest record's enqueue time is sampled (every
    /// 128th record, and any record that finds the channel empty: see
    /// [`ChannelSnapshot::oldest_age_ms`](super::ChannelSnapshot::oldest_age_ms)), so a partial
    /// batch left behind by a full one may leave earlier still, never later. A `DropOldest`
    /// channel's partial batch lingers from its first record, dropped or not (so records
    /// dropped faster than they linger still leave in batches). `Duration::MAX` means full
    /// batches only (and what the close flushes): a linger past thirty years is thirty years.
    pub fn batch_flush(mut self, linger: Duration) -> Self {
        self.batch_flush = linger;
        self
    }

    /// What happens to a record the consumer fails (default [`FailurePolicy::Ignore`]).
    pub fn on_failure(mut self, policy: FailurePolicy) -> Self {
        self.on_failure = policy;
        self
    }

    /// The durable bridge downstream: processed records (and records failed under
    /// [`FailurePolicy::Tag`]) are appended to `queue` as [`Envelope`](super::Envelope)s. The
    /// queue is any [`DurableQueue`]: a local [`SpillQueue`](crate::spill::SpillQueue), or one
    /// on another machine (`lanes_nats::JetStreamQueue`).
    pub fn output(mut self, queue: impl DurableQueue) -> Self {
        self.output = Some(Arc::new(queue));
        self
    }

    /// How records are encoded for the output and dead-letter queues (required with either,
    /// unless the channel spills: then its spill codec is the default).
    pub fn codec(mut self, codec: impl Codec<T> + 'static) -> Self {
        self.codec = Some(Arc::new(codec));
        self
    }

    /// A permit of the limit `name` is taken before each batch (or each record, see
    /// [`PermitPer`]) is taken out of the channel, and returned when the batch is settled or
    /// dropped. A refusal is retried after a backoff ([`OnRefusal::RETRY`]): records are never
    /// lost to it, and each refusal counts in the snapshot's `limit_errors`.
    pub fn limit(
        self,
        limits: &Limits,
        name: impl Into<Arc<str>>,
        priority: Priority,
        per: PermitPer,
    ) -> Self {
        self.throttle(Throttle::new(limits, name, priority).on_refusal(OnRefusal::RETRY), per)
    }

    /// Like [`limit`](Self::limit), with the limit, priority and backoff of `throttle`, whose
    /// policy must be [`OnRefusal::Retry`] (checked when the consumer is built).
    pub fn throttle(mut self, throttle: Throttle, per: PermitPer) -> Self {
        self.limit = Some(ConsumerLimit { throttle, per });
        self
    }

    pub(crate) fn validate(&self, name: &str) -> Result<(), ConfigError> {
        let field = |f: &str| format!("channels.{name}.consumer.{f}");
        if self.batch_max == 0 {
            return Err(ConfigError::new(field("batch_max"), ConfigRule::Zero));
        }
        if self.batch_max > MAX_CAPACITY {
            return Err(ConfigError::new(
                field("batch_max"),
                ConfigRule::OverMax { max: MAX_CAPACITY },
            ));
        }
        if let Some(limit) = &self.limit
            && limit.throttle.refusal_policy() == OnRefusal::Fail
        {
            // A consumer has no run to fail: its records wait in the channel.
            return Err(ConfigError::new(field("throttle"), ConfigRule::Unsupported));
        }
        if matches!(self.on_failure, FailurePolicy::Tag(_)) && self.output.is_none() {
            return Err(ConfigError::new(field("output"), ConfigRule::Missing));
        }
        let writes =
            self.output.is_some() || matches!(self.on_failure, FailurePolicy::DeadLetter(_));
        if writes && self.codec.is_none() {
            return Err(ConfigError::new(field("codec"), ConfigRule::Missing));
        }
        Ok(())
    }
}

impl<T> Default for ConsumerOptions<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> fmt::Debug for ConsumerOptions<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerOptions")
            .field("batch_max", &self.batch_max)
            .field("batch_flush", &self.batch_flush)
            .field("on_failure", &self.on_failure)
            .field("output", &self.output.is_some())
            .field("limit", &self.limit.as_ref().map(|l| (l.throttle.name(), l.per)))
            .finish()
    }
}

/// What happened to an emitted record.
#[derive(Debug)]
pub enum Emitted<T> {
    /// It is in the channel.
    Queued,
    /// The channel was full under [`Overflow::DropNewest`]: this record was dropped (counted)
    /// and is handed back.
    Dropped(T),
    /// The channel was full under [`Overflow::DropOldest`]: the new record is queued and this,
    /// the oldest, was dropped (counted).
    DroppedOldest(T),
    /// The channel was full under [`Overflow::Spill`]: the record went to the spill queue. From
    /// [`emit`](super::Channel::emit), it is there under the queue's sync policy; from
    /// [`try_emit`](super::Channel::try_emit), it is in the queue's write path.
    Spilled,
}

impl<T> Emitted<T> {
    /// Whether the record is in the channel.
    pub fn is_queued(&self) -> bool {
        matches!(self, Self::Queued)
    }
}
