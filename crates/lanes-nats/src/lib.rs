//! [`lanes`] over NATS JetStream: a durable queue of records kept in a stream
//! ([`JetStreamQueue`]), and completion tracking for dispatchers over a key-value bucket
//! ([`KvCompletions`]).
//!
//! # A durable queue in JetStream
//!
//! [`JetStreamQueue`] is a [`DurableQueue`](lanes::spill::DurableQueue): wherever a channel
//! takes a spill, dead-letter or output queue, it can take one kept in a JetStream stream
//! instead of a local directory, so a consumer on another machine (or a fleet draining one
//! backlog) reads it. An append is acknowledged only once the stream stored it; a reader's
//! records are delivered at least once, each until acknowledged.
//!
//! "Stored" is JetStream's word: a server acknowledges a record once it is written to its
//! files, and syncs them to disk on its own schedule (`sync_interval`, two minutes by default).
//! With one replica, an operating-system crash or a power loss of that server can lose
//! acknowledged records; with three replicas a record is acknowledged once a majority stored
//! it. Run replicas (`JetStreamOptions::replicas`), or the server with `sync_interval: always`,
//! where that matters.
//!
//! ```no_run
//! use std::time::Duration;
//! use lanes::channel::{BinaryCodec, Channel, ChannelConfig, Overflow};
//! use lanes_nats::{JetStreamOptions, JetStreamQueue};
//!
//! # async fn demo() -> Result<(), lanes::BoxError> {
//! let client = async_nats::connect("nats://127.0.0.1:4222").await?;
//! let backlog = JetStreamQueue::open(client, "ORDERS_BACKLOG", JetStreamOptions::default()).await?;
//! // Records that do not fit in memory go to the stream, acknowledged once stored there.
//! let channel = Channel::new(
//!     ChannelConfig::new(1_000).overflow(Overflow::spill(backlog.clone(), BinaryCodec::new())),
//! )?;
//! channel.emit(42u64).await?;
//!
//! // Elsewhere (another process, another machine): drain the backlog.
//! let mut reader = backlog.reader("drain", Duration::from_secs(30), 256).await?;
//! while let Some(record) = reader.next(Duration::from_secs(1)).await? {
//!     // process record.payload(), then:
//!     record.ack().await?;
//! }
//! # Ok(())
//! # }
//! ```
//!
//! # Completion tracking
//!
//! Work is processed by a [`Dispatcher`](lanes::pool::Dispatcher), but completed elsewhere:
//! another processor signals that an item is done by writing the item's key into a KV bucket.
//! [`KvCompletions`] is the [`CompletionSource`] that watches the bucket.
//!
//! - The watch is established before the dispatcher is built, and every item's key is
//!   registered before the item is enqueued, so a completion written at any time after the
//!   submit — even before the item is processed — is matched.
//! - Only writes (`put`) made after the watch started count: values already in the bucket are
//!   not replayed, and deletes and purges are ignored. Writes for keys nobody tracks are
//!   ignored (and counted in the dispatcher's snapshot).
//! - A broken watch is reported to `on_watch_error` and in the snapshot, and re-established
//!   with back-off, from the last revision it saw: a `put` made while it was down still
//!   completes its item, and none completes one twice — as long as the bucket still holds
//!   it. A bucket keeps a key's latest revisions only (its history): a `put` followed, while
//!   the watch was down, by a delete, a purge, an expiry or more puts past the history is
//!   gone, and its item stays tracked (until a later `put` of its key, or a stop).
//!
//! # Examples
//!
//! ```no_run
//! use std::time::Duration;
//! use lanes::pool::Dispatcher;
//! use lanes_nats::KvCompletions;
//!
//! # async fn demo() -> Result<(), lanes::BoxError> {
//! let client = async_nats::connect("nats://127.0.0.1:4222").await?;
//! let completions = KvCompletions::open(client, "uploads-done").await?;
//! let dispatcher = Dispatcher::builder()
//!     .workers(8)
//!     .queue_size(1_000)
//!     .completion(completions, |upload: &String| upload.clone(), |upload| async move {
//!         println!("{upload} was completed downstream");
//!         Ok::<_, std::io::Error>(())
//!     })
//!     .build(|upload: String| async move {
//!         // hand the upload to the processor that will write its key when done
//!         Ok::<_, std::io::Error>(())
//!     })
//!     .await?;
//! dispatcher.submit("photo-1".to_owned())?;
//! dispatcher.stop(Duration::from_secs(5)).await?;
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]

mod queue;

pub use queue::{Delivery, HEADER_ROOM, JetStreamOptions, JetStreamQueue, JetStreamReader};

use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use async_nats::jetstream;
use async_nats::jetstream::kv::{Operation, Store, Watch};
use futures_core::Stream;
use lanes::pool::{CompletionSource, CompletionStream};
use lanes::{BoxError, BoxFuture};

pub use async_nats;

/// Completion signals from a NATS JetStream KV bucket: every `put` of a key after the watch
/// started completes the tracked item with that key.
///
/// The first watch starts after the bucket's last revision then; a watch made again (after one
/// broke) resumes after the last revision seen, so a `put` made while the watch was down is
/// still delivered if the bucket still holds it (see the [crate docs](crate)), and one
/// delivered before is not again. A bucket deleted and made again in
/// between (its revisions start again from 1) is watched from its start. A clone starts
/// afresh.
pub struct KvCompletions {
    store: Store,
    /// Where the watches are; `None` before the first watch.
    seen: Arc<Mutex<Option<Seen>>>,
}

/// How far the watches of one bucket have read.
#[derive(Debug, Clone, Copy)]
struct Seen {
    /// The last revision (stream sequence) seen, or that the first watch started after.
    revision: u64,
    /// When the bucket's stream was made (Unix nanoseconds): another time is another bucket
    /// under the same name, whose revisions started again.
    created: i128,
}

impl Clone for KvCompletions {
    fn clone(&self) -> Self {
        Self::new(self.store.clone())
    }
}

impl fmt::Debug for KvCompletions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvCompletions").field("bucket", &self.store.name).finish()
    }
}

impl KvCompletions {
    /// Watches an existing bucket.
    pub fn new(store: Store) -> Self {
        Self { store, seen: Arc::new(Mutex::new(None)) }
    }

    /// Opens the existing bucket `bucket` through `client`'s JetStream.
    ///
    /// # Errors
    ///
    /// The bucket does not exist, or JetStream cannot be reached.
    pub async fn open(client: async_nats::Client, bucket: &str) -> Result<Self, BoxError> {
        let store = jetstream::new(client).get_key_value(bucket).await?;
        Ok(Self::new(store))
    }

    /// The bucket's name.
    pub fn bucket(&self) -> &str {
        &self.store.name
    }
}

impl CompletionSource for KvCompletions {
    fn watch(&self) -> BoxFuture<'_, Result<CompletionStream, BoxError>> {
        Box::pin(async move {
            let mut stream = self.store.stream.clone();
            let info = stream.info().await?;
            let created = info.created.unix_timestamp_nanos();
            let after = {
                let mut seen = lock(&self.seen);
                let after = match *seen {
                    // Revisions never go back in one bucket.
                    Some(seen)
                        if seen.created == created && info.state.last_sequence >= seen.revision =>
                    {
                        seen.revision
                    }
                    // The bucket was made again while no watch ran: all of it is new.
                    Some(_) => 0,
                    // What the bucket holds now is not replayed.
                    None => info.state.last_sequence,
                };
                *seen = Some(Seen { revision: after, created });
                after
            };
            let watch = self.store.watch_all_from_revision(after + 1).await?;
            Ok(Box::pin(Puts { watch, seen: self.seen.clone() }) as CompletionStream)
        })
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The keys of new `put`s in a KV watch; deletes and purges are skipped, and so is any entry
/// at or before the last revision seen (a watch the client rebuilt may deliver from the
/// start).
struct Puts {
    watch: Watch,
    seen: Arc<Mutex<Option<Seen>>>,
}

impl Stream for Puts {
    type Item = Result<String, BoxError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            match Pin::new(&mut self.watch).poll_next(cx) {
                Poll::Ready(Some(Ok(entry))) => {
                    let new = {
                        let mut seen = lock(&self.seen);
                        match seen.as_mut() {
                            Some(seen) if entry.revision <= seen.revision => false,
                            Some(seen) => {
                                seen.revision = entry.revision;
                                true
                            }
                            None => true,
                        }
                    };
                    if new && entry.operation == Operation::Put {
                        return Poll::Ready(Some(Ok(entry.key)));
                    }
                }
                Poll::Ready(Some(Err(err))) => return Poll::Ready(Some(Err(Box::new(err)))),
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}
