//! `JetStreamQueue` against the real NATS server (`NATS_URL`, default `nats://127.0.0.1:4222`,
//! JetStream enabled): the channel's spill, dead-letter, output and receipt tests of the local
//! spill queue (`crates/lanes/tests/channel.rs`), run with the queue in a JetStream stream, and
//! the reader's acknowledgements, redelivery and bounds. Each test uses a stream of its own and
//! deletes it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use lanes::channel::{
    BinaryCodec, Channel, ChannelConfig, Codec, ConsumerOptions, EmitError, Emitted, Envelope,
    FailurePolicy, JsonCodec, Overflow, Settlement,
};
use lanes::spill::{DurableQueue, SpillError};
use lanes_nats::{HEADER_ROOM, JetStreamOptions, JetStreamQueue, JetStreamReader};
use tokio::time::timeout;

/// A stream of its own, deleted when dropped.
struct Stream {
    queue: JetStreamQueue,
    name: String,
}

impl Drop for Stream {
    /// Deletes the stream over a connection of its own, on a thread of its own: the test's
    /// connection is driven by the test's runtime, which this blocks (a one-thread runtime has
    /// no other thread to drive it).
    fn drop(&mut self) {
        let name = self.name.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async { jetstream::new(client().await).delete_stream(&name).await.ok() });
        })
        .join();
    }
}

async fn client() -> async_nats::Client {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    timeout(Duration::from_secs(5), async_nats::connect(&url))
        .await
        .unwrap_or_else(|_| panic!("NATS at {url} did not answer within 5 s (set NATS_URL)"))
        .unwrap_or_else(|e| panic!("cannot connect to NATS at {url}: {e} (set NATS_URL)"))
}

async fn stream(test: &str, options: JetStreamOptions) -> Stream {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let client = client().await;
    let js = jetstream::new(client.clone());
    // A stream that is never deleted keeps the account's storage directory (see completion.rs).
    js.get_or_create_stream(jetstream::stream::Config {
        name: "LANES_TEST_ANCHOR".to_owned(),
        subjects: vec!["lanes.test.anchor".to_owned()],
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("cannot create the anchor stream (is JetStream enabled?): {e}"));
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    let name = format!(
        "LANES_Q_{test}_{}_{}_{}",
        std::process::id(),
        nanos.subsec_nanos(),
        SEQ.fetch_add(1, Ordering::SeqCst)
    );
    let queue = JetStreamQueue::open(client, &name, options).await.expect("the stream opens");
    Stream { queue, name }
}

async fn reader(stream: &Stream) -> JetStreamReader {
    stream.queue.reader("reader", Duration::from_secs(30), 1_000).await.unwrap()
}

/// Reads (and acknowledges) `n` records, decoded with `decode`.
async fn read<T>(reader: &mut JetStreamReader, n: usize, decode: impl Fn(&[u8]) -> T) -> Vec<T> {
    let mut out = Vec::new();
    while out.len() < n {
        let delivery = reader
            .next(Duration::from_secs(5))
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("record {} of {n} arrives", out.len() + 1));
        out.push(decode(delivery.payload()));
        delivery.ack().await.unwrap();
    }
    out
}

fn u64_of(bytes: &[u8]) -> u64 {
    Codec::<u64>::decode(&BinaryCodec::new(), bytes).unwrap()
}

fn envelope_u64(bytes: &[u8]) -> (u64, Vec<String>) {
    let envelope = Envelope::from_bytes(bytes).unwrap();
    (JsonCodec::new().decode(&envelope.payload).unwrap(), envelope.tags)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spill_sends_overflow_to_the_stream_once_and_never_back() {
    let s = stream("spill", JetStreamOptions::default()).await;
    let channel = Channel::new(
        ChannelConfig::new(2).overflow(Overflow::spill(s.queue.clone(), BinaryCodec::new())),
    )
    .unwrap();
    let mut consumer = channel.consumer(ConsumerOptions::new().batch_max(10)).unwrap();
    for n in 0..5u64 {
        let emitted = channel.emit(n).await.unwrap();
        assert_eq!(emitted.is_queued(), n < 2, "record {n}");
    }
    assert!(matches!(channel.try_emit(5).unwrap(), Emitted::Spilled));
    channel.close();
    let batch = consumer.next_batch().await.unwrap();
    assert_eq!(&batch[..], &[0, 1]);
    batch.ack().await.unwrap();
    assert!(consumer.next_batch().await.is_none());
    let mut reader = reader(&s).await;
    assert_eq!(read(&mut reader, 4, u64_of).await, [2, 3, 4, 5]);
    assert!(reader.next(Duration::from_millis(300)).await.unwrap().is_none(), "nothing twice");
    let snapshot = channel.snapshot();
    assert_eq!((snapshot.emitted, snapshot.delivered, snapshot.spilled), (6, 2, 4));
    assert_eq!(s.queue.stored().await.unwrap(), 0, "acknowledged records leave the stream");
}

/// An emit cancelled while its append is in the queue's write path still counts the record,
/// and the counters reconcile with what the stream holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_spilling_emit_is_counted_as_the_stream_holds_it() {
    let s = stream("cancel", JetStreamOptions::default()).await;
    let channel = Channel::new(
        ChannelConfig::new(1).overflow(Overflow::spill(s.queue.clone(), BinaryCodec::new())),
    )
    .unwrap();
    channel.emit(1u64).await.unwrap();
    let (mut cancelled, mut n) = (0, 1u64);
    while cancelled < 5 && n < 500 {
        n += 1;
        if timeout(Duration::ZERO, channel.emit(n)).await.is_err() {
            cancelled += 1;
        }
        assert!(channel.snapshot().reconciles());
    }
    assert!(cancelled > 0, "no emit was cancelled mid-append: the test saw nothing");
    let total = usize::try_from(n - 1).unwrap();
    let mut reader = reader(&s).await;
    assert_eq!(read(&mut reader, total, u64_of).await, (2..=n).collect::<Vec<_>>());
    let snapshot = channel.snapshot();
    assert_eq!((snapshot.emitted, snapshot.spilled, snapshot.depth), (n, n - 1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_spill_hands_the_record_back_uncounted() {
    let s = stream("refused", JetStreamOptions::default().max_record(16)).await;
    let channel = Channel::new(
        ChannelConfig::new(1).overflow(Overflow::spill(s.queue.clone(), JsonCodec::new())),
    )
    .unwrap();
    channel.emit("short".to_owned()).await.unwrap();
    let long = "this record is longer than sixteen bytes".to_owned();
    let err = channel.emit(long.clone()).await.unwrap_err();
    assert!(matches!(err, EmitError::Spill(_, SpillError::TooLarge { .. })), "{err}");
    assert_eq!(err.into_record(), long);
    let snapshot = channel.snapshot();
    assert_eq!((snapshot.emitted, snapshot.spilled, snapshot.depth), (1, 0, 1));
    assert!(snapshot.reconciles());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_and_output_go_to_streams_and_receipts_settle() {
    let dead = stream("dead", JetStreamOptions::default()).await;
    let output = stream("output", JetStreamOptions::default()).await;
    let channel = Channel::new(ChannelConfig::new(8)).unwrap();
    let mut consumer = channel
        .consumer(
            ConsumerOptions::new()
                .batch_max(8)
                .codec(JsonCodec::new())
                .output(output.queue.clone())
                .on_failure(FailurePolicy::dead_letter(dead.queue.clone())),
        )
        .unwrap();
    let mut receipts = Vec::new();
    for n in 0..4u64 {
        receipts.push(channel.emit_with_receipt(n).await.unwrap());
    }
    let batch = consumer.next_batch().await.unwrap();
    let outcomes: Vec<Result<(), lanes::BoxError>> = batch
        .iter()
        .map(|n| if n % 2 == 1 { Err(format!("odd {n}").into()) } else { Ok(()) })
        .collect();
    let report = batch.settle(outcomes).await.unwrap();
    assert_eq!((report.processed, report.dead_lettered), (2, 2));
    // Settled only once both streams acknowledged what they were given.
    let mut settled = Vec::new();
    for receipt in receipts {
        settled.push(receipt.await);
    }
    use Settlement::{DeadLettered, Processed};
    assert_eq!(settled, [Processed, DeadLettered, Processed, DeadLettered]);
    let mut out = reader(&output).await;
    let processed = read(&mut out, 2, envelope_u64).await;
    assert_eq!(processed, [(0, vec![]), (2, vec![])]);
    let mut failed = reader(&dead).await;
    let dead_lettered = read(&mut failed, 2, envelope_u64).await;
    assert_eq!(
        dead_lettered,
        [(1, vec!["error=odd 1".to_owned()]), (3, vec!["error=odd 3".to_owned()])]
    );
}

/// A record delivered and not acknowledged comes back after `ack_wait`; an acknowledged one
/// never does; a handed-back one (`nak`) comes back at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unacknowledged_records_are_delivered_again_and_acknowledged_ones_never() {
    let s = stream("redeliver", JetStreamOptions::default()).await;
    for n in 0..3u8 {
        s.queue.enqueue(&[&[n]]).unwrap().await.unwrap();
    }
    // Two seconds: every step below until the redelivery must finish within `ack_wait`, or
    // JetStream delivers a record again early (a loaded host can stall a step for hundreds
    // of milliseconds).
    let mut reader = s.queue.reader("r", Duration::from_secs(2), 10).await.unwrap();
    let wait = Duration::from_secs(5);
    let first = reader.next(wait).await.unwrap().unwrap();
    assert_eq!((first.payload(), first.delivered()), (&[0u8][..], 1));
    first.ack().await.unwrap();
    let second = reader.next(wait).await.unwrap().unwrap();
    assert_eq!(second.payload(), [1]);
    drop(second); // neither acknowledged nor handed back: its reader "died"
    let third = reader.next(wait).await.unwrap().unwrap();
    assert_eq!(third.payload(), [2]);
    third.nak().await.unwrap();
    let mut again = Vec::new();
    for _ in 0..2 {
        let delivery = reader.next(wait).await.unwrap().expect("delivered again");
        assert_eq!(delivery.delivered(), 2, "{:?}", delivery.payload());
        again.push(delivery.payload()[0]);
        delivery.ack().await.unwrap();
    }
    again.sort_unstable();
    assert_eq!(again, [1, 2]);
    // Longer than `ack_wait`: acknowledged records are not delivered again.
    assert!(reader.next(Duration::from_millis(2_500)).await.unwrap().is_none());
    assert_eq!(s.queue.stored().await.unwrap(), 0);
}

/// Review finding (stop 73): nothing waited for appends handed over without waiting (a
/// `try_emit` spilling): a process that closed the queue and exited dropped them. `drained`
/// waits until each is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drained_waits_for_every_append_handed_over() {
    let s = stream("drained", JetStreamOptions::default()).await;
    for n in 0..2_000u32 {
        drop(s.queue.enqueue(&[&n.to_le_bytes()]).unwrap());
    }
    s.queue.close();
    timeout(Duration::from_secs(20), s.queue.drained()).await.expect("every append answered");
    assert_eq!(s.queue.stored().await.unwrap(), 2_000);
}

/// Review finding (stop 73): a reader opened again with other settings got the consumer as it
/// was on the server: a shorter `ack_wait` was silently ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_opened_again_takes_its_new_settings() {
    let s = stream("resettle", JetStreamOptions::default()).await;
    s.queue.enqueue(&[b"job"]).unwrap().await.unwrap();
    drop(s.queue.reader("r", Duration::from_secs(120), 10).await.unwrap());
    let mut reader = s.queue.reader("r", Duration::from_secs(1), 10).await.unwrap();
    let first = reader.next(Duration::from_secs(5)).await.unwrap().expect("delivered");
    drop(first); // not acknowledged
    let again = reader.next(Duration::from_secs(5)).await.unwrap();
    let again = again.expect("delivered again after the new ack_wait, not the old one");
    assert_eq!((again.payload(), again.delivered()), (&b"job"[..], 2));
    again.ack().await.unwrap();
}

/// Bytes awaiting acknowledgement are bounded (`Full`), and so is the stream (`Full` with its
/// own bound). The options' checks are `invalid_options_are_refused_naming_the_setting`.
///
/// One thread: the refused append must find the first still unacknowledged. On two workers
/// the writer could publish it and JetStream acknowledge it while this thread was descheduled
/// between the two calls, freeing the room (CI saw that once, stop 46).
#[tokio::test(flavor = "current_thread")]
async fn appends_are_bounded() {
    let s = stream(
        "bounds",
        JetStreamOptions::default().max_record(1024).max_in_flight(2048).max_bytes(8 * 1024),
    )
    .await;
    let record = vec![7u8; 1024];
    let first = s.queue.enqueue(&[&record, &record]).unwrap();
    let refused = s.queue.enqueue(&[&record]).map(drop).unwrap_err();
    assert!(matches!(refused, SpillError::Full { max_bytes: 2048 }), "{refused}");
    first.await.unwrap();
    s.queue.enqueue(&[&record]).unwrap().await.expect("room again once acknowledged");
    // The stream keeps 8 KiB: appends beyond it are refused by JetStream.
    let mut refused_by_stream = None;
    for _ in 0..16 {
        if let Err(err) = s.queue.enqueue(&[&record]).unwrap().await {
            refused_by_stream = Some(err);
            break;
        }
    }
    let err = refused_by_stream.expect("the stream's bound refuses an append");
    assert!(matches!(err, SpillError::Full { max_bytes: 8192 }), "the stream's bound: {err}");
}

/// Review finding (stop 73): the default `max_record` was the server's default `max_payload`,
/// and the record's id header comes on top: a record of the largest size made the server drop
/// the connection, again on every publish until the timeout. Now the default fits, and a
/// `max_record` that cannot is refused at open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_of_the_largest_size_fits_the_servers_max_payload() {
    let client = client().await;
    let max_payload = client.server_info().max_payload;
    let too_large = JetStreamOptions::default().max_record(max_payload - HEADER_ROOM + 1);
    let err = JetStreamQueue::open(client, "LANES_Q_NEVER", too_large).await.map(drop);
    match err.unwrap_err() {
        SpillError::InvalidOptions(err) => {
            assert_eq!(err.field(), "max_record");
            assert_eq!(err.rule(), lanes::ConfigRule::OverMax { max: max_payload - HEADER_ROOM });
        }
        other => panic!("{other:?}"),
    }
    let s = stream("largest", JetStreamOptions::default().publish_timeout(Duration::from_secs(5)))
        .await;
    let largest = vec![9u8; max_payload - HEADER_ROOM];
    s.queue.enqueue(&[&largest]).unwrap().await.expect("the largest record is stored");
    let mut reader = reader(&s).await;
    assert_eq!(read(&mut reader, 1, <[u8]>::len).await, [largest.len()]);
}

/// A NATS server that goes away: a relay in front of the real one that, once cut, closes every
/// connection it carries and every one it is offered; and that can hold what the server sends
/// (the client's publishes arrive, their acknowledgements wait in the relay).
struct Relay {
    url: String,
    cut: Arc<std::sync::atomic::AtomicBool>,
    hold: Arc<std::sync::atomic::AtomicBool>,
}

impl Relay {
    async fn start() -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let target = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
        let target = target.trim_start_matches("nats://").to_owned();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("nats://{}", listener.local_addr().unwrap());
        let cut = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let hold = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (gone, held) = (cut.clone(), hold.clone());
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if gone.load(Ordering::SeqCst) {
                    let _ = inbound.shutdown().await;
                    continue;
                }
                let Ok(outbound) = tokio::net::TcpStream::connect(&target).await else {
                    continue;
                };
                let (gone, held) = (gone.clone(), held.clone());
                tokio::spawn(async move {
                    let (mut from_client, mut to_client) = inbound.into_split();
                    let (mut from_server, mut to_server) = outbound.into_split();
                    let up = tokio::io::copy(&mut from_client, &mut to_server);
                    let down = async {
                        let mut buf = vec![0u8; 64 * 1024];
                        while let Ok(n @ 1..) = from_server.read(&mut buf).await {
                            while held.load(Ordering::SeqCst) && !gone.load(Ordering::SeqCst) {
                                tokio::time::sleep(Duration::from_millis(5)).await;
                            }
                            // What was held goes with the connection.
                            if gone.load(Ordering::SeqCst)
                                || to_client.write_all(&buf[..n]).await.is_err()
                            {
                                break;
                            }
                        }
                    };
                    let cut = async {
                        while !gone.load(Ordering::SeqCst) {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    };
                    tokio::select! {
                        _ = up => {}
                        () = down => {}
                        () = cut => {}
                    }
                });
            }
        });
        Self { url, cut, hold }
    }
}

/// Review finding (stop 73): the publish timeout ran from when the writer took a batch, and a
/// publish waited for room in the client's buffer (seconds each) while NATS was away, so an
/// append of thousands of records hung for hours, holding its room. Now an append ends at
/// its timeout, counted from the append.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_ends_at_its_publish_timeout_while_nats_is_away() {
    let relay = Relay::start().await;
    let client = timeout(Duration::from_secs(5), async_nats::connect(&relay.url))
        .await
        .expect("NATS answers through the relay")
        .unwrap();
    let s = stream("away", JetStreamOptions::default()).await;
    // The same stream, through the relay.
    let options =
        JetStreamOptions::default().publish_timeout(Duration::from_secs(2)).max_in_flight(64 << 20);
    let queue = JetStreamQueue::open(client, &s.name, options).await.unwrap();
    queue.enqueue(&[b"before"]).unwrap().await.expect("stored while NATS is there");
    relay.cut.store(true, Ordering::SeqCst);
    let records: Vec<Vec<u8>> = (0..6_000u32).map(|n| n.to_le_bytes().to_vec()).collect();
    let records: Vec<&[u8]> = records.iter().map(Vec::as_slice).collect();
    let started = std::time::Instant::now();
    let big = queue.enqueue(&records).unwrap();
    let small = queue.enqueue(&[b"after"]).unwrap();
    let (big, small) = timeout(Duration::from_secs(20), async { (big.await, small.await) })
        .await
        .expect("both appends end at their publish timeout");
    assert!(matches!(big, Err(SpillError::Remote(_))), "{big:?}");
    assert!(matches!(small, Err(SpillError::Remote(_))), "{small:?}");
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
}

/// Two channel configs are the same only with the very same queue; a queue knows itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_is_the_same_only_as_itself() {
    let a = stream("same_a", JetStreamOptions::default()).await;
    let b = stream("same_b", JetStreamOptions::default()).await;
    assert!(a.queue.same_as(&a.queue.clone()));
    assert!(!a.queue.same_as(&b.queue));
    assert!(a.queue.describe().contains(&a.name));
    a.queue.close();
    assert!(matches!(a.queue.enqueue(&[b"x"]).map(drop), Err(SpillError::Closed)));
}

/// Review finding (stop 77): the bound on appends awaiting acknowledgement counted the records'
/// bytes alone, so small records passed it by far: 8 MiB let a million empty records, with
/// their ids and the writer's bookkeeping, await acknowledgement. A record now counts its
/// length and `HEADER_ROOM`: a thousand one-byte records fill a bound of 64 KiB.
///
/// One thread, as `appends_are_bounded`: the writer cannot acknowledge the first append
/// between the two calls.
#[tokio::test(flavor = "current_thread")]
async fn small_records_count_their_overhead_against_the_bound() {
    let options = JetStreamOptions::default().max_record(1024).max_in_flight(64 * 1024);
    let s = stream("small", options).await;
    let records = vec![[1u8]; 1_000];
    let records: Vec<&[u8]> = records.iter().map(|r| r.as_slice()).collect();
    let first = s.queue.enqueue(&records).unwrap();
    let refused = s.queue.enqueue(&[b"x"]).map(drop).unwrap_err();
    assert!(matches!(refused, SpillError::Full { max_bytes: 65_536 }), "{refused}");
    first.await.unwrap();
    s.queue.enqueue(&[b"x"]).unwrap().await.expect("room again once acknowledged");
    assert_eq!(s.queue.stored().await.unwrap(), 1_001);
}

/// Options that break a rule are refused at open with the typed error every other `lanes`
/// option gives, naming the setting (they came back as `SpillError::Remote`, the error of a
/// store that could not take records, so a caller could not tell its own mistake from an
/// outage). Nothing is made on the server for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_options_are_refused_naming_the_setting() {
    use lanes::ConfigRule;
    let seconds = Duration::from_secs;
    let base = JetStreamOptions::default;
    let cases = [
        (base().max_bytes(1023), "max_bytes", ConfigRule::AtLeast { min: 1024 }),
        (base().max_record(0), "max_record", ConfigRule::Zero),
        (
            base().max_record(1 << 31).max_in_flight(1 << 31),
            "max_record",
            ConfigRule::OverMax { max: i32::MAX as usize },
        ),
        (
            base().max_record(4096).max_in_flight(4095),
            "max_in_flight",
            ConfigRule::AtLeastSetting { setting: "max_record" },
        ),
        (
            base().max_in_flight(1 << 32),
            "max_in_flight",
            ConfigRule::OverMax { max: u32::MAX as usize },
        ),
        (base().publish_timeout(Duration::ZERO), "publish_timeout", ConfigRule::ZeroTimeout),
        (
            base().publish_timeout(seconds(10)).duplicate_window(seconds(9)),
            "duplicate_window",
            ConfigRule::AtLeastSetting { setting: "publish_timeout" },
        ),
        (base().replicas(0), "replicas", ConfigRule::Zero),
    ];
    let name = format!("LANES_Q_invalid_{}", std::process::id());
    for (options, field, rule) in cases {
        let opened = JetStreamQueue::open(client().await, &name, options).await;
        match opened.map(drop) {
            Err(SpillError::InvalidOptions(err)) => {
                assert_eq!((err.field(), err.rule()), (field, rule), "{err}");
            }
            other => panic!("{field}: {other:?}"),
        }
    }
    for bad in ["", "a.b", "a b", "a*", "a>", "a/b", "a\\b", "a\tb", "a\u{1}b"] {
        let opened = JetStreamQueue::open(client().await, bad, base()).await;
        match opened.map(drop) {
            Err(SpillError::InvalidOptions(err)) => assert_eq!(err.field(), "stream", "{err}"),
            other => panic!("{bad:?}: {other:?}"),
        }
    }
    let js = jetstream::new(client().await);
    assert!(js.get_stream(&name).await.is_err(), "no stream was made for invalid options");
    // A reader's too: a consumer name NATS refuses, a zero `ack_wait`.
    let s = stream("reader_options", base()).await;
    let second = Duration::from_secs(1);
    for (consumer, ack_wait, field) in
        [("a.b", second, "consumer"), ("", second, "consumer"), ("ok", Duration::ZERO, "ack_wait")]
    {
        match s.queue.reader(consumer, ack_wait, 10).await.map(drop) {
            Err(SpillError::InvalidOptions(err)) => assert_eq!(err.field(), field, "{err}"),
            other => panic!("{consumer:?}: {other:?}"),
        }
    }
}

/// One append of more records than async-nats lets await acknowledgement at once (5,000):
/// it completes, every record stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_of_many_records_completes() {
    let s = stream("many", JetStreamOptions::default()).await;
    let records: Vec<[u8; 8]> = (0..6_000u64).map(u64::to_be_bytes).collect();
    let refs: Vec<&[u8]> = records.iter().map(|r| r.as_slice()).collect();
    let appending = s.queue.enqueue(&refs).unwrap();
    timeout(Duration::from_secs(30), appending).await.expect("the append completes").unwrap();
    assert_eq!(s.queue.stored().await.unwrap(), 6_000);
}

/// Review finding (stop 75): an existing stream was used as it was, so one made by an operator
/// with settings that discard records lost appends the queue had acknowledged (a stream of at
/// most 2 records, discarding old ones: the third append resolved `Ok`, and the first record
/// was gone). Such a stream is now refused at open, naming the setting; one that keeps records
/// opens with its own bounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_stream_that_would_lose_records_is_refused() {
    use jetstream::stream::{Config, DiscardPolicy, RetentionPolicy, StorageType};
    let js = jetstream::new(client().await);
    let name = format!("LANES_Q_premade_{}", std::process::id());
    let subject = format!("lanes.queue.{name}");
    let keeps = Config {
        name: name.clone(),
        subjects: vec![subject.clone()],
        retention: RetentionPolicy::WorkQueue,
        discard: DiscardPolicy::New,
        storage: StorageType::File,
        duplicate_window: Duration::from_secs(120),
        max_bytes: 64 * 1024,
        ..Default::default()
    };
    let cases = [
        (
            Config { retention: RetentionPolicy::Limits, max_messages: 2, ..keeps.clone() },
            "retention",
        ),
        (Config { discard: DiscardPolicy::Old, max_messages: 2, ..keeps.clone() }, "discard"),
        (Config { max_age: Duration::from_secs(600), ..keeps.clone() }, "max_age"),
        (Config { max_messages_per_subject: 2, ..keeps.clone() }, "max_messages_per_subject"),
        (Config { storage: StorageType::Memory, ..keeps.clone() }, "memory"),
        (Config { duplicate_window: Duration::from_secs(5), ..keeps.clone() }, "duplicate window"),
        (Config { subjects: vec![format!("{subject}.other")], ..keeps.clone() }, "subjects"),
        (Config { max_message_size: 64 * 1024, ..keeps.clone() }, "max_message_size"),
    ];
    for (config, setting) in cases {
        let _ = js.delete_stream(&name).await;
        js.create_stream(config).await.unwrap_or_else(|e| panic!("{setting}: {e}"));
        let options = JetStreamOptions::default().publish_timeout(Duration::from_secs(30));
        let opened = JetStreamQueue::open(client().await, &name, options).await;
        let err = opened.map(drop).expect_err(setting);
        assert!(matches!(err, SpillError::Remote(_)), "{setting}: {err}");
        assert!(err.to_string().contains(setting), "{setting}: {err}");
    }
    let _ = js.delete_stream(&name).await;
    js.create_stream(keeps).await.unwrap();
    let queue = JetStreamQueue::open(client().await, &name, JetStreamOptions::default()).await;
    let queue = queue.expect("a stream that keeps records opens");
    queue.enqueue(&[b"kept"]).unwrap().await.unwrap();
    js.delete_stream(&name).await.unwrap();
}

/// Review finding (stop 75): the reader pulled records 200 at a time, so `ack_wait` ran for
/// records sitting in the client's buffer: a reader that took longer than `ack_wait` over one
/// record was given the next ones again, though it acknowledged each as soon as it had it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_records_ack_wait_starts_when_it_is_handed_out() {
    let s = stream("ackwait", JetStreamOptions::default()).await;
    for n in 0..5u8 {
        s.queue.enqueue(&[&[n]]).unwrap().await.unwrap();
    }
    let mut reader = s.queue.reader("r", Duration::from_secs(1), 100).await.unwrap();
    let wait = Duration::from_secs(5);
    let first = reader.next(wait).await.unwrap().unwrap();
    // Slow over the first record: longer than `ack_wait` (it may be delivered again itself).
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let _ = first.ack().await;
    let mut seen = Vec::new();
    while let Some(delivery) = reader.next(Duration::from_millis(1_500)).await.unwrap() {
        seen.push((delivery.payload()[0], delivery.delivered()));
        delivery.ack().await.unwrap();
        assert!(seen.len() <= 10, "{seen:?}");
    }
    let rest: Vec<(u8, i64)> = seen.into_iter().filter(|(n, _)| *n != 0).collect();
    assert_eq!(rest, [(1, 1), (2, 1), (3, 1), (4, 1)], "each handed out once");
    assert_eq!(s.queue.stored().await.unwrap(), 0);
}

/// A reader at `max_ack_pending` is handed nothing, without an error, until a record is
/// settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_at_max_ack_pending_waits_for_a_settled_record() {
    let s = stream("ackpending", JetStreamOptions::default()).await;
    for n in 0..2u8 {
        s.queue.enqueue(&[&[n]]).unwrap().await.unwrap();
    }
    let mut reader = s.queue.reader("r", Duration::from_secs(30), 1).await.unwrap();
    let first = reader.next(Duration::from_secs(5)).await.unwrap().unwrap();
    let started = Instant::now();
    let none = reader.next(Duration::from_millis(400)).await.unwrap();
    assert!(none.is_none(), "a second record past max_ack_pending");
    assert!(started.elapsed() >= Duration::from_millis(350), "{:?}", started.elapsed());
    // A wait of nothing at all ends at once all the same (review finding, stop 75: a no-wait
    // request without an expiry was kept by the server, and the call waited a second).
    let started = Instant::now();
    assert!(reader.next(Duration::ZERO).await.unwrap().is_none());
    assert!(started.elapsed() < Duration::from_millis(500), "{:?}", started.elapsed());
    first.ack().await.unwrap();
    let second = reader.next(Duration::from_secs(5)).await.unwrap().expect("the next record");
    assert_eq!(second.payload(), [1]);
    second.ack().await.unwrap();
}

/// Review finding (stop 75): an append of more bytes than `max_in_flight` (a consumer's output
/// or dead-letter batch of many records) was refused `Full` every time, even on an idle queue,
/// though `Full` tells the caller to try again later. It now goes alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_larger_than_max_in_flight_goes_alone() {
    let relay = Relay::start().await;
    let client = timeout(Duration::from_secs(5), async_nats::connect(&relay.url))
        .await
        .expect("NATS answers through the relay")
        .unwrap();
    let s = stream("oversized", JetStreamOptions::default()).await;
    // The same stream, through the relay, which holds acknowledgements while told to.
    let options = JetStreamOptions::default().max_record(1024).max_in_flight(2048);
    let queue = JetStreamQueue::open(client, &s.name, options).await.unwrap();
    let record = [9u8; 1024];
    queue.enqueue(&[&record, &record, &record]).unwrap().await.expect("an idle queue takes it");
    relay.hold.store(true, Ordering::SeqCst);
    let first = queue.enqueue(&[&record]).unwrap();
    let refused = queue.enqueue(&[&record, &record, &record]).map(drop).unwrap_err();
    assert!(matches!(refused, SpillError::Full { .. }), "not alone: {refused}");
    relay.hold.store(false, Ordering::SeqCst);
    first.await.unwrap();
    queue.enqueue(&[&record, &record, &record]).unwrap().await.unwrap();
    assert_eq!(s.queue.stored().await.unwrap(), 7);
}

/// Review finding (stop 75): an append nobody awaited (a channel's `try_emit` spilling) that
/// the stream refused later was only logged: the channel had counted the record spilled, and
/// nothing counted its loss. `unseen_failures` does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_append_nobody_awaited_is_counted() {
    let s =
        stream("unseen", JetStreamOptions::default().max_record(1024).max_bytes(8 * 1024)).await;
    let record = [3u8; 1024];
    for _ in 0..12 {
        drop(s.queue.enqueue(&[&record]).unwrap());
    }
    // An awaited failure is its caller's to count, not this one's.
    let awaited = s.queue.enqueue(&[&record]).unwrap().await.unwrap_err();
    assert!(matches!(awaited, SpillError::Full { .. }), "{awaited}");
    s.queue.close();
    timeout(Duration::from_secs(20), s.queue.drained()).await.unwrap();
    let stored = s.queue.stored().await.unwrap();
    assert!(stored < 12, "the stream's bound refused some: {stored}");
    assert_eq!(s.queue.unseen_failures(), 12 - stored, "each unseen loss counted once");
}

/// Review finding (stop 75): an append's records were confirmed one after another, and a
/// publish whose acknowledgement a dropped connection lost waits the client's whole reply
/// timeout (5 s) before it is published again: an append of L such records took L times that,
/// and one of a hundred failed at its publish timeout though NATS was back within a second.
/// Its records are now confirmed together: the lost acknowledgements cost one wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_whose_acknowledgements_a_reconnect_lost_completes_soon_after() {
    let relay = Relay::start().await;
    let client = timeout(Duration::from_secs(5), async_nats::connect(&relay.url))
        .await
        .expect("NATS answers through the relay")
        .unwrap();
    let s = stream("lost_acks", JetStreamOptions::default()).await;
    let options = JetStreamOptions::default().publish_timeout(Duration::from_secs(60));
    let queue = JetStreamQueue::open(client, &s.name, options).await.unwrap();
    queue.enqueue(&[b"before"]).unwrap().await.expect("stored while NATS is there");
    // The records reach the stream; their acknowledgements are held, then lost with the
    // connection, which comes back at once.
    relay.hold.store(true, Ordering::SeqCst);
    let records: Vec<Vec<u8>> = (0..100u32).map(|n| n.to_le_bytes().to_vec()).collect();
    let records: Vec<&[u8]> = records.iter().map(Vec::as_slice).collect();
    let mut append = queue.enqueue(&records).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(timeout(Duration::ZERO, &mut append).await.is_err(), "acknowledgements held");
    assert_eq!(s.queue.stored().await.unwrap(), 101, "the records arrived");
    relay.cut.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(100)).await;
    relay.hold.store(false, Ordering::SeqCst);
    relay.cut.store(false, Ordering::SeqCst);
    let started = std::time::Instant::now();
    let appended = timeout(Duration::from_secs(30), append).await.expect("the append ends");
    appended.expect("stored: NATS came back");
    // One reply timeout (5 s) and the publishes again, not a hundred of them; the margin is
    // for a loaded two-core host.
    assert!(started.elapsed() < Duration::from_secs(15), "{:?}", started.elapsed());
    assert_eq!(s.queue.stored().await.unwrap(), 101, "each record stored once");
}
