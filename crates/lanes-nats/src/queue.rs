//! [`JetStreamQueue`]: a [`DurableQueue`] kept in a NATS JetStream stream, so the records a
//! channel spills, dead-letters or outputs live on the NATS servers — read by a consumer on
//! another machine, or by a fleet draining one backlog — instead of on this machine's disk.

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy};
use async_nats::jetstream::consumer::{PullConsumer, pull};
use async_nats::jetstream::context::{PublishAckFuture, PublishError, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::stream::{DiscardPolicy, RetentionPolicy, StorageType};
use async_nats::jetstream::{self, AckKind, Context};
use bytes::Bytes;
use futures_util::StreamExt;
use lanes::spill::{Appending, DurableQueue, SpillError};
use lanes::{ConfigError, ConfigRule};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::time::Instant;

/// How a [`JetStreamQueue`] is kept: its stream's bounds and the client's.
#[derive(Debug, Clone)]
pub struct JetStreamOptions {
    max_bytes: i64,
    max_record: usize,
    max_in_flight: usize,
    publish_timeout: Duration,
    replicas: usize,
    duplicate_window: Duration,
}

/// Bytes a record's message takes beyond the record (its `Nats-Msg-Id` header, with room to
/// spare): a record of `max_record` bytes must fit the server's `max_payload` with them. A
/// record counts them too against [`JetStreamOptions::max_in_flight`].
pub const HEADER_ROOM: usize = 256;

impl Default for JetStreamOptions {
    fn default() -> Self {
        Self {
            max_bytes: 1 << 30,
            max_record: (1 << 20) - HEADER_ROOM,
            max_in_flight: 8 << 20,
            publish_timeout: Duration::from_secs(30),
            replicas: 1,
            duplicate_window: Duration::from_secs(120),
        }
    }
}

impl JetStreamOptions {
    /// The most bytes the stream keeps (default 1 GiB); beyond it an append is refused
    /// ([`SpillError::Full`] with this bound, once the stream answers) until the reader
    /// acknowledges records. At least 1 KiB.
    pub fn max_bytes(mut self, max_bytes: u64) -> Self {
        self.max_bytes = i64::try_from(max_bytes).unwrap_or(i64::MAX);
        self
    }

    /// The largest record (default 1 MiB less [`HEADER_ROOM`], so that a record and its
    /// header fit a NATS server's default `max_payload` of 1 MiB). With its header it must fit
    /// the server's `max_payload`: [`JetStreamQueue::open`] refuses a larger one (a message
    /// over it would make the server drop the connection).
    pub fn max_record(mut self, max_record: usize) -> Self {
        self.max_record = max_record;
        self
    }

    /// The most bytes appended but not yet acknowledged by the stream (default 8 MiB); an
    /// append beyond it is refused with [`SpillError::Full`] (one larger than all of it goes
    /// alone, when nothing else awaits acknowledgement). At least `max_record`.
    ///
    /// A record counts its length and [`HEADER_ROOM`] more: its id, kept until the record is
    /// acknowledged and sent as its header, and the writer's bookkeeping of it. The bound is
    /// then one on memory, whatever the records' size (counting their bytes alone, a bound of
    /// 8 MiB let a million empty records await acknowledgement).
    pub fn max_in_flight(mut self, max_in_flight: usize) -> Self {
        self.max_in_flight = max_in_flight;
        self
    }

    /// How long an append may take to be acknowledged, counted from the append, publishing
    /// again (deduplicated by the record's id) while NATS is away (default 30 s, at most the
    /// duplicate window). An append still unacknowledged then resolves
    /// [`SpillError::Remote`], whether it waited behind others, for the client's buffer, or
    /// for the stream's answer.
    pub fn publish_timeout(mut self, timeout: Duration) -> Self {
        self.publish_timeout = timeout;
        self
    }

    /// How many servers of a NATS cluster keep the stream (default 1).
    pub fn replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas;
        self
    }

    /// How long the stream remembers record ids to drop a record published twice (default
    /// 120 s; at least the publish timeout).
    pub fn duplicate_window(mut self, window: Duration) -> Self {
        self.duplicate_window = window;
        self
    }

    fn validate(&self) -> Result<(), SpillError> {
        let bad =
            |field: &str, rule| Err(SpillError::InvalidOptions(ConfigError::new(field, rule)));
        if self.max_bytes < 1024 {
            return bad("max_bytes", ConfigRule::AtLeast { min: 1024 });
        }
        if self.max_record == 0 {
            return bad("max_record", ConfigRule::Zero);
        }
        if self.max_record > i32::MAX as usize {
            return bad("max_record", ConfigRule::OverMax { max: i32::MAX as usize });
        }
        if self.max_in_flight < self.max_record {
            return bad("max_in_flight", ConfigRule::AtLeastSetting { setting: "max_record" });
        }
        if self.max_in_flight > u32::MAX as usize {
            return bad("max_in_flight", ConfigRule::OverMax { max: u32::MAX as usize });
        }
        if self.publish_timeout.is_zero() {
            return bad("publish_timeout", ConfigRule::ZeroTimeout);
        }
        if self.duplicate_window < self.publish_timeout {
            return bad(
                "duplicate_window",
                ConfigRule::AtLeastSetting { setting: "publish_timeout" },
            );
        }
        if self.replicas == 0 {
            return bad("replicas", ConfigRule::Zero);
        }
        Ok(())
    }
}

/// Refuses a name NATS would refuse for a stream or a consumer: `field` is the setting.
fn check_name(field: &str, name: &str) -> Result<(), SpillError> {
    let reserved = |c: char| matches!(c, '.' | '*' | '>' | '/' | '\\') || c.is_whitespace();
    if name.is_empty() || name.chars().any(|c| reserved(c) || c.is_control()) {
        let must_be = "non-empty, without '.', '*', '>', slashes, whitespace or control characters";
        let rule = ConfigRule::Form { must_be };
        return Err(SpillError::InvalidOptions(ConfigError::new(field, rule)));
    }
    Ok(())
}

/// Refuses a stream that could lose or duplicate records this queue acknowledged: see
/// [`JetStreamQueue::open`].
fn keeps_records(
    config: &jetstream::stream::Config,
    subject: &str,
    options: &JetStreamOptions,
) -> Result<(), SpillError> {
    let refuse = |why: String| {
        Err(SpillError::Remote(format!(
            "stream {:?} cannot keep a queue's records: {why}",
            config.name
        )))
    };
    if config.retention != RetentionPolicy::WorkQueue {
        return refuse(format!(
            "its retention is {:?}, not WorkQueue (acknowledged records would stay, or go unread)",
            config.retention
        ));
    }
    if config.discard != DiscardPolicy::New {
        return refuse("a full stream discards old records (discard policy Old)".to_owned());
    }
    if !config.max_age.is_zero() {
        return refuse(format!("records expire after {:?} (max_age)", config.max_age));
    }
    if config.max_messages_per_subject > 0 {
        return refuse(format!(
            "at most {} records per subject, older ones discarded (max_messages_per_subject)",
            config.max_messages_per_subject
        ));
    }
    if config.storage != StorageType::File {
        return refuse("records are kept in memory, lost when NATS restarts".to_owned());
    }
    if config.no_ack {
        return refuse("publishes are not acknowledged (no_ack)".to_owned());
    }
    if !config.subjects.iter().any(|s| s == subject) {
        return refuse(format!("its subjects {:?} do not include {subject:?}", config.subjects));
    }
    let largest = options.max_record.saturating_add(HEADER_ROOM);
    if config.max_message_size > 0 && (config.max_message_size as usize) < largest {
        return refuse(format!(
            "its max_message_size ({}) is below max_record ({}) and its header ({HEADER_ROOM} \
             bytes): a record the queue takes would be refused unseen",
            config.max_message_size, options.max_record
        ));
    }
    if config.duplicate_window < options.publish_timeout {
        return refuse(format!(
            "its duplicate window ({:?}) is shorter than the publish timeout ({:?}): a record \
             published again would be stored twice",
            config.duplicate_window, options.publish_timeout
        ));
    }
    Ok(())
}

/// A durable queue of records in a NATS JetStream stream (see the [crate docs](crate)).
///
/// - **Appends** ([`DurableQueue::enqueue`]) are published in order by one writer task, each
///   with an id of its own; an append resolves `Ok` once the stream acknowledged storing every
///   record of it. While NATS is away the writer publishes again (same ids: the stream drops a
///   record it has already stored) until the publish timeout, then the append fails
///   ([`SpillError::Remote`]) — its records may or may not be stored. A record published again
///   may be stored after records appended later: the stream keeps append order except for
///   records whose first publish was lost.
/// - **Bounded**: at most `max_in_flight` bytes (a record counting its length and
///   [`HEADER_ROOM`]) await acknowledgement ([`SpillError::Full`]
///   beyond, at once; an append larger than that goes alone, when nothing else awaits), and
///   the stream keeps at most `max_bytes` (an append beyond resolves [`SpillError::Full`] with
///   `max_bytes`: the stream refuses it when it arrives, so an append handed over without
///   waiting, as a channel's `try_emit` spills, is refused unseen by its producer; the writer
///   logs it and counts it in [`unseen_failures`](Self::unseen_failures)).
/// - **Reading** ([`reader`](Self::reader)): a durable pull consumer with explicit acks. A
///   record is removed once acknowledged; one not acknowledged within `ack_wait` (its reader
///   died, or is slow) is delivered again — at least once, never lost while the stream keeps it
///   (see the [crate docs](crate) for what JetStream keeps through a crash).
///
/// The stream has work-queue retention: one reader (consumer) per queue.
#[derive(Clone)]
pub struct JetStreamQueue {
    inner: Arc<Inner>,
}

struct Inner {
    context: Context,
    stream: String,
    subject: String,
    options: JetStreamOptions,
    /// Bytes awaiting acknowledgement.
    room: Arc<Semaphore>,
    /// This handle's prefix for record ids, and the next record's number.
    instance: String,
    next: AtomicU64,
    batches: mpsc::UnboundedSender<Batch>,
    closed: AtomicBool,
    /// Records of failed appends nobody awaited ([`JetStreamQueue::unseen_failures`]).
    unseen_failures: Arc<AtomicU64>,
}

/// One append, on its way to the writer.
struct Batch {
    records: Vec<(String, Bytes)>,
    /// When the append fails unacknowledged: the publish timeout after `enqueue`.
    deadline: Instant,
    done: oneshot::Sender<Result<(), SpillError>>,
    _room: OwnedSemaphorePermit,
}

impl JetStreamQueue {
    /// Opens the queue kept in stream `stream`, creating it if missing (subject
    /// `lanes.queue.<stream>`, file storage, work-queue retention and these options' bounds).
    ///
    /// An existing stream (made by an operator, say) is used with its own bounds (`max_bytes`,
    /// message counts, replicas), but only if it keeps what this queue promises: records stored
    /// on file, kept until read and acknowledged (work-queue retention, no `max_age`, a full
    /// stream refusing new records rather than discarding old ones, no per-subject limit, which
    /// always discards), acknowledged publishes, the queue's subject, a message size that fits
    /// `max_record`, and a duplicate window at least the publish timeout (a publish made again
    /// is dropped, not stored twice).
    ///
    /// # Errors
    ///
    /// [`SpillError::InvalidOptions`] for options that break a rule (the error names the
    /// setting): a `max_record` that with [`HEADER_ROOM`] exceeds the server's `max_payload`
    /// among them, or a stream name NATS would refuse. [`SpillError::Remote`] for an existing
    /// stream that does not keep records as above (the message names the setting), or if
    /// JetStream cannot be reached or refuses the stream.
    pub async fn open(
        client: async_nats::Client,
        stream: &str,
        options: JetStreamOptions,
    ) -> Result<Self, SpillError> {
        options.validate()?;
        let max_payload = client.server_info().max_payload;
        if options.max_record.saturating_add(HEADER_ROOM) > max_payload {
            // The server's bound: a record and its header must fit one message.
            let max = max_payload.saturating_sub(HEADER_ROOM);
            let rule = ConfigRule::OverMax { max };
            return Err(SpillError::InvalidOptions(ConfigError::new("max_record", rule)));
        }
        check_name("stream", stream)?;
        let context = jetstream::new(client);
        let subject = format!("lanes.queue.{stream}");
        let config = jetstream::stream::Config {
            name: stream.to_owned(),
            subjects: vec![subject.clone()],
            max_bytes: options.max_bytes,
            max_message_size: i32::try_from(options.max_record + HEADER_ROOM).unwrap_or(i32::MAX),
            storage: StorageType::File,
            retention: RetentionPolicy::WorkQueue,
            discard: DiscardPolicy::New,
            num_replicas: options.replicas,
            duplicate_window: options.duplicate_window,
            ..Default::default()
        };
        let opened =
            context.get_or_create_stream(config).await.map_err(remote("open the stream"))?;
        let config = &opened.cached_info().config;
        keeps_records(config, &subject, &options)?;
        // The bound a full stream reports: its own (an existing stream keeps its bounds); one
        // without a bound is refused only by the server's storage, said as no bound at all.
        let max_bytes = u64::try_from(config.max_bytes).ok().filter(|b| *b > 0).unwrap_or(u64::MAX);
        let room = Arc::new(Semaphore::new(options.max_in_flight));
        let (batches, receiver) = mpsc::unbounded_channel();
        let instance = instance_id();
        let inner = Arc::new(Inner {
            context,
            stream: stream.to_owned(),
            subject,
            options,
            room,
            instance,
            next: AtomicU64::new(0),
            batches,
            closed: AtomicBool::new(false),
            unseen_failures: Arc::new(AtomicU64::new(0)),
        });
        let writer = Writer {
            context: inner.context.clone(),
            subject: inner.subject.clone(),
            max_bytes,
            unseen_failures: inner.unseen_failures.clone(),
        };
        tokio::spawn(writer.write(receiver));
        Ok(Self { inner })
    }

    /// The stream's name.
    pub fn stream(&self) -> &str {
        &self.inner.stream
    }

    /// Records in the stream now (appended and not yet acknowledged by the reader).
    ///
    /// # Errors
    ///
    /// [`SpillError::Remote`] if JetStream cannot answer.
    pub async fn stored(&self) -> Result<u64, SpillError> {
        let mut stream =
            self.inner.context.get_stream(&self.inner.stream).await.map_err(remote("get"))?;
        Ok(stream.info().await.map_err(remote("stream info"))?.state.messages)
    }

    /// Records of appends that failed after their caller stopped waiting for the answer, or
    /// never waited: a channel's `try_emit` that spilled here, an emit cancelled after the
    /// hand-over. The channel counted them spilled when the queue took them; this counts their
    /// loss (each failure is also logged). An append's failure does not say which of its
    /// records were stored, so all of a failed append's records are counted (some may be in
    /// the stream). An append that is awaited reports its failure to its caller instead, and
    /// is not counted here.
    pub fn unseen_failures(&self) -> u64 {
        self.inner.unseen_failures.load(Ordering::Relaxed)
    }

    /// Refuses further appends; appends already handed over still complete (see
    /// [`drained`](Self::drained) to wait for them).
    pub fn close(&self) {
        self.inner.closed.store(true, Ordering::Release);
    }

    /// Waits until every append handed over so far has been answered (stored, or failed):
    /// for a process about to exit, after [`close`](Self::close), so that records handed over
    /// without waiting (a channel's `try_emit` spilling, an emit cancelled after the hand-over)
    /// are not dropped with the process. Call it after `close`: while it waits, room an
    /// answered append frees goes to it, so appends made meanwhile are refused
    /// ([`SpillError::Full`]).
    pub async fn drained(&self) {
        let all = u32::try_from(self.inner.options.max_in_flight).unwrap_or(u32::MAX);
        // Every append holds its bytes of room until it is answered.
        drop(self.inner.room.acquire_many(all).await);
    }

    /// The queue's reader: the durable consumer `consumer` (created if missing, and set to
    /// these settings if it exists). A record it delivers is delivered again after `ack_wait`
    /// unless acknowledged; at most `max_ack_pending` records are delivered and not yet
    /// acknowledged at once.
    ///
    /// # Errors
    ///
    /// [`SpillError::InvalidOptions`] for a consumer name NATS would refuse, or a zero
    /// `ack_wait`; [`SpillError::Remote`] if JetStream cannot be reached or refuses the
    /// consumer.
    pub async fn reader(
        &self,
        consumer: &str,
        ack_wait: Duration,
        max_ack_pending: usize,
    ) -> Result<JetStreamReader, SpillError> {
        check_name("consumer", consumer)?;
        if ack_wait.is_zero() {
            let rule = ConfigRule::ZeroTimeout;
            return Err(SpillError::InvalidOptions(ConfigError::new("ack_wait", rule)));
        }
        let stream =
            self.inner.context.get_stream(&self.inner.stream).await.map_err(remote("get"))?;
        let config = pull::Config {
            durable_name: Some(consumer.to_owned()),
            deliver_policy: DeliverPolicy::All,
            ack_policy: AckPolicy::Explicit,
            ack_wait,
            max_ack_pending: i64::try_from(max_ack_pending.max(1)).unwrap_or(i64::MAX),
            filter_subject: self.inner.subject.clone(),
            ..Default::default()
        };
        // Created, or updated to these settings if it exists (kept as it was, a reader asking
        // for a shorter `ack_wait` got the old one, silently).
        let consumer: PullConsumer =
            stream.create_consumer(config).await.map_err(remote("create the consumer"))?;
        Ok(JetStreamReader { consumer })
    }
}

impl fmt::Debug for JetStreamQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JetStreamQueue")
            .field("stream", &self.inner.stream)
            .field("subject", &self.inner.subject)
            .finish()
    }
}

impl DurableQueue for JetStreamQueue {
    fn enqueue(&self, records: &[&[u8]]) -> Result<Appending, SpillError> {
        let inner = &self.inner;
        if inner.closed.load(Ordering::Acquire) {
            return Err(SpillError::Closed);
        }
        let max = inner.options.max_record;
        let mut bytes = 0usize;
        for record in records {
            if record.len() > max {
                return Err(SpillError::TooLarge { len: record.len(), max: max as u32 });
            }
            bytes = bytes.saturating_add(record.len() + HEADER_ROOM);
        }
        if records.is_empty() {
            return Ok(Box::pin(async { Ok(()) }));
        }
        let full = || SpillError::Full { max_bytes: inner.options.max_in_flight as u64 };
        // An append larger than the whole bound (a consumer's output or dead-letter batch of
        // many records) takes all of it: it goes alone, once nothing else awaits its
        // acknowledgement, rather than being refused `Full` for good.
        let permits = u32::try_from(bytes.min(inner.options.max_in_flight)).map_err(|_| full())?;
        let room = inner.room.clone().try_acquire_many_owned(permits).map_err(|_| full())?;
        let first = inner.next.fetch_add(records.len() as u64, Ordering::Relaxed);
        let records = records
            .iter()
            .zip(first..)
            .map(|(record, n)| (format!("{}-{n}", inner.instance), Bytes::copy_from_slice(record)))
            .collect();
        let (done, answer) = oneshot::channel();
        let deadline = Instant::now() + inner.options.publish_timeout;
        let batch = Batch { records, deadline, done, _room: room };
        inner.batches.send(batch).map_err(|_| SpillError::Closed)?;
        Ok(Box::pin(async move { answer.await.unwrap_or(Err(SpillError::Closed)) }))
    }

    fn same_as(&self, other: &dyn DurableQueue) -> bool {
        other
            .as_any()
            .downcast_ref::<Self>()
            .is_some_and(|other| Arc::ptr_eq(&self.inner, &other.inner))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn describe(&self) -> String {
        format!("JetStream stream {}", self.inner.stream)
    }
}

/// Records whose acknowledgements the writer lets pile up before handing them to a task of
/// their own: async-nats allows 5,000 unacknowledged publishes per context, and a publish
/// beyond waits for one to be acknowledged (awaited), so the writer must never hold more.
const CHUNK: usize = 1_000;

/// The writer: publishes every batch in order, handing each chunk's acknowledgements to a task
/// of its own, so publishing never waits for the stream. It owns what it needs: batches
/// already handed over are published even after every handle is dropped (the channel drains
/// before it closes).
struct Writer {
    context: Context,
    subject: String,
    /// The stream's bound, which a refusal for lack of room reports.
    max_bytes: u64,
    unseen_failures: Arc<AtomicU64>,
}

impl Writer {
    async fn write(self, mut batches: mpsc::UnboundedReceiver<Batch>) {
        let Self { context, subject, max_bytes, unseen_failures } = self;
        while let Some(batch) = batches.recv().await {
            // The deadline runs from the append, not from here: a batch that waited behind others
            // while NATS was away fails when its time is up, not a publish timeout later.
            let Batch { records, deadline, done, _room: room } = batch;
            let records = Arc::new(records);
            let mut chunks = Vec::new();
            for start in (0..records.len()).step_by(CHUNK) {
                let end = (start + CHUNK).min(records.len());
                let mut acks = Vec::with_capacity(end - start);
                for (id, payload) in &records[start..end] {
                    acks.push(publish(&context, &subject, id, payload, deadline).await);
                }
                let (context, subject, records) =
                    (context.clone(), subject.clone(), records.clone());
                chunks.push(tokio::spawn(async move {
                    // Together, not one after another: an acknowledgement a dropped connection
                    // lost is waited for the client's whole reply timeout before the record is
                    // published again, and each of a chunk's lost ones would add its own.
                    let confirms =
                        records[start..end].iter().zip(acks).map(|((id, payload), ack)| {
                            confirm(&context, &subject, id, payload, ack, deadline, max_bytes)
                        });
                    futures_util::future::join_all(confirms).await.into_iter().collect()
                }));
            }
            let (subject, unseen_failures) = (subject.clone(), unseen_failures.clone());
            tokio::spawn(async move {
                let mut result = Ok(());
                for chunk in chunks {
                    let outcome = chunk.await.unwrap_or(Err(SpillError::Closed));
                    if result.is_ok() {
                        result = outcome;
                    }
                }
                drop(room);
                if let Err(err) = &result {
                    // Said here too: an append handed over without waiting (a channel's `try_emit`
                    // spilling) has nobody awaiting its answer.
                    tracing::warn!(subject, records = records.len(), error = %err, "append failed");
                }
                if let Err(Err(_)) = done.send(result) {
                    unseen_failures.fetch_add(records.len() as u64, Ordering::Relaxed);
                }
            });
        }
    }
}

/// Publishes one record, giving up at `deadline`: while NATS is away the client's buffer
/// fills, and a publish then waits for room (seconds each, for every record after).
async fn publish(
    context: &Context,
    subject: &str,
    id: &str,
    payload: &Bytes,
    deadline: Instant,
) -> Result<PublishAckFuture, PublishError> {
    if Instant::now() >= deadline {
        return Err(PublishError::new(PublishErrorKind::TimedOut));
    }
    let message = PublishMessage::build().payload(payload.clone()).message_id(id);
    tokio::time::timeout_at(deadline, context.send_publish(subject.to_owned(), message))
        .await
        .unwrap_or_else(|_elapsed| Err(PublishError::new(PublishErrorKind::TimedOut)))
}

/// Whether a failed publish may succeed if made again: NATS or JetStream away (a timeout, a
/// broken connection, no responders while the server restarts), not a refusal by the stream.
fn transient(err: &PublishError) -> bool {
    matches!(
        err.kind(),
        PublishErrorKind::TimedOut
            | PublishErrorKind::BrokenPipe
            | PublishErrorKind::StreamNotFound
            | PublishErrorKind::MaxAckPending
    )
}

/// Whether the stream refused a record for want of room: its `max_bytes` (JetStream answers
/// "maximum bytes exceeded" as a store failure), or the server's storage.
fn stream_full(err: &PublishError) -> bool {
    use async_nats::jetstream::ErrorCode;
    std::error::Error::source(err)
        .and_then(|source| source.downcast_ref::<async_nats::jetstream::Error>())
        .is_some_and(|err| {
            let code = err.error_code();
            code == ErrorCode::STREAM_STORE_FAILED || code == ErrorCode::STORAGE_RESOURCES_EXCEEDED
        })
}

/// Waits for one record's acknowledgement; publishes it again (same id: the stream drops a
/// copy it already has) after a transient failure, with back-off, until `deadline`. A stream
/// without room refuses it with [`SpillError::Full`] (`max_bytes`, the stream's bound).
async fn confirm(
    context: &Context,
    subject: &str,
    id: &str,
    payload: &Bytes,
    first: Result<PublishAckFuture, PublishError>,
    deadline: Instant,
    max_bytes: u64,
) -> Result<(), SpillError> {
    let mut attempt = first;
    let mut backoff = Duration::from_millis(50);
    loop {
        let outcome = match attempt {
            Ok(ack) => tokio::time::timeout_at(deadline, ack)
                .await
                .unwrap_or_else(|_elapsed| Err(PublishError::new(PublishErrorKind::TimedOut)))
                .map(drop),
            Err(err) => Err(err),
        };
        let err = match outcome {
            Ok(()) => return Ok(()),
            Err(err) => err,
        };
        if stream_full(&err) {
            return Err(SpillError::Full { max_bytes });
        }
        if !transient(&err) {
            return Err(SpillError::Remote(format!("the stream refused a record: {err}")));
        }
        if Instant::now() + backoff >= deadline {
            return Err(SpillError::Remote(format!("no acknowledgement in time: {err}")));
        }
        tracing::debug!(subject, id, error = %err, "publishing again");
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
        attempt = publish(context, subject, id, payload, deadline).await;
    }
}

/// A reader of a [`JetStreamQueue`]: a durable pull consumer with explicit acks.
///
/// Each [`next`](Self::next) asks the stream for one record: nothing is fetched ahead, so a
/// record's `ack_wait` starts when it is handed out (a record fetched ahead would wait in the
/// client's buffer with its clock running, and a slow reader would be given it again), and a
/// reader buffers no records.
pub struct JetStreamReader {
    consumer: PullConsumer,
}

/// Below this, a call's wait asks the stream for a record only if it has one now (a no-wait
/// request, which the server answers at once when it has none to give).
const SHORTEST_PULL: Duration = Duration::from_millis(10);

/// How long past its wait a call still waits for the server's answer (a record, or the end of
/// the request) before it gives up on it.
const PULL_SLACK: Duration = Duration::from_secs(1);

impl JetStreamReader {
    /// The next record, waiting for one; `None` if none came within `wait`.
    ///
    /// A call dropped while it waits (a timeout around it, say) may leave its request with the
    /// server: a record the server sends it then is delivered again after `ack_wait`, with
    /// [`Delivery::delivered`] counting the lost delivery.
    ///
    /// # Errors
    ///
    /// [`SpillError::Remote`] if JetStream cannot be reached.
    pub async fn next(&mut self, wait: Duration) -> Result<Option<Delivery>, SpillError> {
        let deadline = Instant::now() + wait.min(Duration::from_secs(86_400));
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let request = async {
                if left < SHORTEST_PULL {
                    // With an expiry all the same: a server at `max_ack_pending` keeps a
                    // no-wait request that has none until a record is free for it.
                    let expires = left.max(Duration::from_millis(1));
                    self.consumer.fetch().max_messages(1).expires(expires).messages().await
                } else {
                    self.consumer.batch().max_messages(1).expires(left).messages().await
                }
            };
            let bound = left + PULL_SLACK;
            let mut batch = match tokio::time::timeout(bound, request).await {
                Ok(batch) => batch.map_err(remote("ask for a record"))?,
                Err(_elapsed) => {
                    return Err(SpillError::Remote("ask for a record: no answer".to_owned()));
                }
            };
            match tokio::time::timeout(bound, batch.next()).await {
                Err(_) | Ok(None) => return Ok(None),
                Ok(Some(Ok(message))) => return Ok(Some(Delivery { message })),
                Ok(Some(Err(err))) if waiting_for_acks(&*err) => {
                    // At `max_ack_pending`, as a server that answers such a request at once
                    // (409) says: nothing is handed out until a record is settled. (Others
                    // keep the request until it expires: `None` above.)
                    if Instant::now() >= deadline {
                        return Ok(None);
                    }
                    tokio::time::sleep(left.min(ACKS_POLL)).await;
                }
                Ok(Some(Err(err))) => return Err(SpillError::Remote(format!("read: {err}"))),
            }
        }
    }
}

/// How often a reader at `max_ack_pending` asks again.
const ACKS_POLL: Duration = Duration::from_millis(50);

/// The server's answer to a request while the consumer has `max_ack_pending` records out.
fn waiting_for_acks(err: &(dyn std::error::Error + Send + Sync)) -> bool {
    let text = err.to_string();
    text.contains("409") && text.contains("Ack")
}

impl fmt::Debug for JetStreamReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JetStreamReader").finish_non_exhaustive()
    }
}

/// One delivered record: acknowledge it once processed, or it is delivered again.
pub struct Delivery {
    message: jetstream::Message,
}

impl Delivery {
    /// The record.
    pub fn payload(&self) -> &[u8] {
        &self.message.payload
    }

    /// How many times it has been delivered (1 the first time).
    pub fn delivered(&self) -> i64 {
        self.message.info().map_or(1, |info| info.delivered)
    }

    /// Acknowledges it and waits for the stream to confirm: it is removed from the queue and
    /// never delivered again.
    ///
    /// # Errors
    ///
    /// [`SpillError::Remote`] if the acknowledgement was not confirmed (the record may then be
    /// delivered again).
    pub async fn ack(self) -> Result<(), SpillError> {
        self.message.double_ack().await.map_err(|err| SpillError::Remote(format!("ack: {err}")))
    }

    /// Hands it back for delivery again at once (to this or another reader).
    ///
    /// # Errors
    ///
    /// [`SpillError::Remote`] if NATS cannot take the answer (it is delivered again after
    /// `ack_wait` anyway).
    pub async fn nak(self) -> Result<(), SpillError> {
        self.message
            .ack_with(AckKind::Nak(None))
            .await
            .map_err(|err| SpillError::Remote(format!("nak: {err}")))
    }
}

impl fmt::Debug for Delivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Delivery").field("len", &self.payload().len()).finish()
    }
}

fn remote<E: fmt::Display>(what: &'static str) -> impl Fn(E) -> SpillError {
    move |err| SpillError::Remote(format!("{what}: {err}"))
}

/// An id unique to this handle: record ids are `<it>-<n>`, so two handles (or a restarted
/// process) never share one within the duplicate window.
fn instance_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(nanos);
    hasher.write_u32(std::process::id());
    format!("{:016x}", hasher.finish())
}
