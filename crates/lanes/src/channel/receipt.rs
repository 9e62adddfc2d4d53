//! Receipts: a producer learns how its record ended, exactly once.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::{Instant, Sleep};

use crate::util::lock;

/// How a record with a receipt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Settlement {
    /// The consumer processed it (and, with an output queue, it is there).
    Processed,
    /// The consumer failed it; it was tagged downstream or ignored, per the failure policy.
    Failed,
    /// The consumer failed it and it is in the dead-letter queue.
    DeadLettered,
    /// It was dropped: by the overflow policy, by a discarding close, by a consumer that went
    /// away, or in a batch dropped unsettled.
    Dropped,
    /// It went to the channel's spill queue (there under the queue's sync policy).
    Spilled,
    /// Nothing settled it within the channel's `ack_timeout`. A later settlement is ignored.
    TimedOut,
}

impl Settlement {
    const ALL: [Self; 6] = [
        Self::Processed,
        Self::Failed,
        Self::DeadLettered,
        Self::Dropped,
        Self::Spilled,
        Self::TimedOut,
    ];

    fn code(self) -> u8 {
        self as u8 + 1
    }

    fn from_code(code: u8) -> Option<Self> {
        code.checked_sub(1).and_then(|i| Self::ALL.get(usize::from(i)).copied())
    }
}

const PENDING: u8 = 0;

/// The shared state of one receipt: settled exactly once, by whoever gets there first.
pub(crate) struct ReceiptState {
    state: AtomicU8,
    deadline: Instant,
    waker: Mutex<Option<Waker>>,
}

impl ReceiptState {
    pub(crate) fn new(timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            state: AtomicU8::new(PENDING),
            // A timeout past the clock's range: as good as never (a century).
            deadline: Instant::now()
                .checked_add(timeout)
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(100 * 365 * 86_400)),
            waker: Mutex::new(None),
        })
    }

    /// Settles the receipt with `outcome`, unless it is settled already or its time is up (then
    /// it settles `TimedOut`). Whether `outcome` was the one recorded.
    pub(crate) fn settle(&self, outcome: Settlement) -> bool {
        if Instant::now() >= self.deadline {
            self.finish(Settlement::TimedOut);
            return false;
        }
        self.finish(outcome)
    }

    fn finish(&self, outcome: Settlement) -> bool {
        let won = self
            .state
            .compare_exchange(PENDING, outcome.code(), Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if won {
            // Taken in a statement of its own, so that the lock is let go before the wake.
            let waker = lock(&self.waker).take();
            if let Some(waker) = waker {
                waker.wake();
            }
        }
        won
    }

    fn current(&self) -> Option<Settlement> {
        match Settlement::from_code(self.state.load(Ordering::Acquire)) {
            Some(settled) => Some(settled),
            None if Instant::now() >= self.deadline => {
                self.finish(Settlement::TimedOut);
                Settlement::from_code(self.state.load(Ordering::Acquire))
            }
            None => None,
        }
    }
}

/// How a record emitted with [`emit_with_receipt`](super::Channel::emit_with_receipt) ended.
/// Await it for the [`Settlement`]; it settles exactly once, `TimedOut` at the latest when the
/// channel's `ack_timeout` has passed since the emit.
///
/// # Examples
///
/// ```
/// use lanes::channel::{Channel, ChannelConfig, ConsumerOptions, Settlement};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let channel = Channel::new(ChannelConfig::new(8))?;
/// let mut consumer = channel.consumer(ConsumerOptions::new())?;
/// let receipt = channel.emit_with_receipt("hello").await?;
///
/// let batch = consumer.next_batch().await.expect("a batch");
/// batch.ack().await?;
/// assert_eq!(receipt.await, Settlement::Processed);
/// # Ok(())
/// # }
/// ```
#[must_use = "a receipt does nothing unless it is awaited or checked"]
pub struct Receipt {
    state: Arc<ReceiptState>,
    sleep: Option<Pin<Box<Sleep>>>,
}

impl Receipt {
    pub(crate) fn new(state: Arc<ReceiptState>) -> Self {
        Self { state, sleep: None }
    }

    /// The settlement, if the record has one yet.
    pub fn settlement(&self) -> Option<Settlement> {
        self.state.current()
    }

    /// When the receipt times out.
    pub fn deadline(&self) -> Instant {
        self.state.deadline
    }
}

impl Future for Receipt {
    type Output = Settlement;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Settlement> {
        if let Some(settled) = self.state.current() {
            return Poll::Ready(settled);
        }
        *lock(&self.state.waker) = Some(cx.waker().clone());
        if let Some(settled) = self.state.current() {
            return Poll::Ready(settled);
        }
        let deadline = self.state.deadline;
        let sleep = self.sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if sleep.as_mut().poll(cx).is_ready() {
            self.state.finish(Settlement::TimedOut);
            if let Some(settled) = self.state.current() {
                return Poll::Ready(settled);
            }
        }
        Poll::Pending
    }
}

impl fmt::Debug for Receipt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Receipt").field("settlement", &self.settlement()).finish()
    }
}

/// Collects receipts and gates a commit on them: a commit may proceed only when every record
/// has settled and none timed out.
///
/// # Examples
///
/// ```
/// use lanes::channel::{AckSet, Channel, ChannelConfig, ConsumerOptions};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let channel = Channel::new(ChannelConfig::new(8))?;
/// let mut consumer = channel.consumer(ConsumerOptions::new().batch_max(8))?;
/// let mut acks = AckSet::new();
/// for offset in 0..3u64 {
///     acks.push(channel.emit_with_receipt(offset).await?);
/// }
/// assert!(!acks.settled());
///
/// consumer.next_batch().await.expect("a batch").ack().await?;
/// let summary = acks.wait().await;
/// assert_eq!(summary.processed, 3);
/// assert!(summary.may_commit());
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Default)]
pub struct AckSet {
    receipts: Vec<Receipt>,
}

impl AckSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a receipt.
    pub fn push(&mut self, receipt: Receipt) {
        self.receipts.push(receipt);
    }

    /// How many receipts the set holds.
    pub fn len(&self) -> usize {
        self.receipts.len()
    }

    /// Whether the set holds no receipt.
    pub fn is_empty(&self) -> bool {
        self.receipts.is_empty()
    }

    /// Whether every receipt has settled (timed-out ones included).
    pub fn settled(&self) -> bool {
        self.receipts.iter().all(|r| r.settlement().is_some())
    }

    /// Whether a commit may proceed now: every receipt settled, none timed out.
    pub fn may_commit(&self) -> bool {
        self.summary().may_commit()
    }

    /// The settlements so far.
    pub fn summary(&self) -> AckSummary {
        let mut summary = AckSummary::default();
        for receipt in &self.receipts {
            summary.count(receipt.settlement());
        }
        summary
    }

    /// Waits until every receipt has settled (at the latest, when the last one times out).
    pub async fn wait(&mut self) -> AckSummary {
        let mut summary = AckSummary::default();
        for receipt in &mut self.receipts {
            summary.count(Some(receipt.await));
        }
        summary
    }
}

impl Extend<Receipt> for AckSet {
    fn extend<I: IntoIterator<Item = Receipt>>(&mut self, iter: I) {
        self.receipts.extend(iter);
    }
}

impl FromIterator<Receipt> for AckSet {
    fn from_iter<I: IntoIterator<Item = Receipt>>(iter: I) -> Self {
        Self { receipts: iter.into_iter().collect() }
    }
}

/// Counts of an [`AckSet`]'s settlements.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AckSummary {
    /// Processed.
    pub processed: usize,
    /// Failed (tagged or ignored).
    pub failed: usize,
    /// Dead-lettered.
    pub dead_lettered: usize,
    /// Dropped.
    pub dropped: usize,
    /// Spilled.
    pub spilled: usize,
    /// Timed out.
    pub timed_out: usize,
    /// Not settled yet.
    pub pending: usize,
}

impl AckSummary {
    fn count(&mut self, settlement: Option<Settlement>) {
        let slot = match settlement {
            None => &mut self.pending,
            Some(Settlement::Processed) => &mut self.processed,
            Some(Settlement::Failed) => &mut self.failed,
            Some(Settlement::DeadLettered) => &mut self.dead_lettered,
            Some(Settlement::Dropped) => &mut self.dropped,
            Some(Settlement::Spilled) => &mut self.spilled,
            Some(Settlement::TimedOut) => &mut self.timed_out,
        };
        *slot += 1;
    }

    /// Whether a commit may proceed: nothing pending, nothing timed out.
    pub fn may_commit(&self) -> bool {
        self.pending == 0 && self.timed_out == 0
    }
}
