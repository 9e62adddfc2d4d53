//! The spill queue: round trips, ordering, commit and redelivery, segment deletion, bounds,
//! options, locking, recovery from torn and corrupt files, sync policies' loss windows, and a
//! crash simulation against a reference model.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use lanes::spill::{self, Fault, MemStorage, SpillError, SpillOptions, SpillQueue, SyncPolicy};
use proptest::prelude::*;

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "lanes-spill-{name}-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        Self(dir)
    }

    fn files(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    fn segments(&self) -> Vec<String> {
        self.files().into_iter().filter(|n| n.ends_with(".seg")).collect()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn record(i: u64) -> Vec<u8> {
    format!("record-{i:06}-{}", "x".repeat((i % 37) as usize)).into_bytes()
}

async fn read_all(queue: &SpillQueue) -> Vec<Vec<u8>> {
    let mut reader = queue.reader().unwrap();
    let mut out = Vec::new();
    loop {
        let batch = reader.try_next_batch(1000).await.unwrap();
        if batch.is_empty() {
            return out;
        }
        out.extend(batch.into_iter().map(|r| r.into_data()));
    }
}

#[tokio::test]
async fn round_trip_order_commit_and_redelivery() {
    let dir = TempDir::new("roundtrip");
    let options = SpillOptions::default().sync(SyncPolicy::Always);
    let (queue, report) = SpillQueue::open(&dir.0, options.clone()).await.unwrap();
    assert!(report.is_clean());
    for i in 0..100 {
        queue.append(record(i)).await.unwrap();
    }
    queue.append_batch((100..150).map(record)).await.unwrap();
    assert_eq!(queue.len(), 150);
    let mut reader = queue.reader().unwrap();
    assert!(matches!(queue.reader(), Err(SpillError::ReaderTaken)));
    let first = reader.next_batch(60).await.unwrap();
    assert_eq!(first.len(), 60);
    assert_eq!(
        first.iter().map(|r| r.data().to_vec()).collect::<Vec<_>>(),
        (0..60).map(record).collect::<Vec<_>>()
    );
    // Commit the first 40; read 20 more without committing them.
    reader.commit(first[39].position()).await.unwrap();
    assert_eq!(queue.len(), 110);
    drop(reader);
    queue.close().await.unwrap();
    assert!(matches!(queue.append(b"late").await, Err(SpillError::Closed)));

    // Reopen: everything after the committed position comes back, the committed part never.
    let (queue, report) = SpillQueue::open(&dir.0, options).await.unwrap();
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(report.records, 110);
    let again = read_all(&queue).await;
    assert_eq!(again, (40..150).map(record).collect::<Vec<_>>());
    queue.close().await.unwrap();
}

/// Under every policy, while the queue runs: under `Never` (and `Interval` between its
/// ticks) commits were written only at close, so a long-running queue kept every segment it
/// ever filled (review finding, stop 72).
#[tokio::test]
async fn acknowledged_segments_are_deleted() {
    for policy in [
        SyncPolicy::Always,
        SyncPolicy::Batch,
        SyncPolicy::Interval(Duration::from_secs(3600)),
        SyncPolicy::Never,
    ] {
        acknowledged_segments_are_deleted_under(policy).await;
    }
}

async fn acknowledged_segments_are_deleted_under(policy: SyncPolicy) {
    let dir = TempDir::new("segments");
    let options = SpillOptions::default().sync(policy).segment_size(4096).max_record(1024);
    let (queue, _) = SpillQueue::open(&dir.0, options).await.unwrap();
    for i in 0..400 {
        queue.append(record(i)).await.unwrap();
    }
    assert!(dir.segments().len() >= 4, "{:?}", dir.segments());
    let mut reader = queue.reader().unwrap();
    let mut seen = 0;
    while seen < 400 {
        let batch = reader.next_batch(64).await.unwrap();
        seen += batch.len();
        reader.commit(batch.last().unwrap().position()).await.unwrap();
    }
    assert_eq!(queue.len(), 0);
    assert_eq!(queue.bytes(), 0);
    assert_eq!(
        dir.segments().len(),
        1,
        "{policy:?}: only the active segment remains: {:?}",
        dir.segments()
    );
    let snapshot = queue.snapshot();
    assert_eq!((snapshot.appended, snapshot.acknowledged, snapshot.segments), (400, 400, 1));
    queue.close().await.unwrap();
}

#[tokio::test]
async fn bounds_and_options_are_typed() {
    let dir = TempDir::new("bounds");
    let options = SpillOptions::default().max_record(100).max_bytes(1000).sync(SyncPolicy::Never);
    let (queue, _) = SpillQueue::open(&dir.0, options).await.unwrap();
    assert!(matches!(
        queue.append(vec![0u8; 101]).await,
        Err(SpillError::TooLarge { len: 101, max: 100 })
    ));
    // 112-byte frames: 8 fit in 1000 bytes.
    for _ in 0..8 {
        queue.append(vec![1u8; 100]).await.unwrap();
    }
    let err = queue.append(vec![1u8; 100]).await.unwrap_err();
    assert!(err.is_full(), "{err}");
    let mut reader = queue.reader().unwrap();
    let batch = reader.next_batch(2).await.unwrap();
    reader.commit(batch[1].position()).await.unwrap();
    queue.append(vec![1u8; 100]).await.unwrap(); // room again
    queue.close().await.unwrap();

    let bad = [
        (SpillOptions::default().max_record(0), "max_record"),
        (SpillOptions::default().max_bytes(10), "max_bytes"),
        (SpillOptions::default().segment_size(10), "segment_size"),
        (SpillOptions::default().sync(SyncPolicy::Interval(Duration::ZERO)), "sync.interval"),
    ];
    for (options, field) in bad {
        match SpillQueue::open(&dir.0, options).await {
            Err(SpillError::InvalidOptions(err)) => assert_eq!(err.field(), field),
            other => panic!("{field}: {other:?}"),
        }
    }
}

/// A queue opened where no directory is yet makes each missing one (and syncs each into its
/// parent, which this test cannot see: it sees them made and the queue work).
#[tokio::test]
async fn an_open_makes_the_missing_directories() {
    let dir = TempDir::new("nested");
    let nested = dir.0.join("a").join("b");
    let (queue, report) = SpillQueue::open(&nested, SpillOptions::default()).await.unwrap();
    assert!(report.is_clean(), "{report:?}");
    queue.append(b"one".to_vec()).await.unwrap();
    queue.close().await.unwrap();
    let (queue, report) = SpillQueue::open(&nested, SpillOptions::default()).await.unwrap();
    assert_eq!(report.records, 1, "{report:?}");
    queue.close().await.unwrap();
}

#[tokio::test]
async fn one_owner_at_a_time() {
    let dir = TempDir::new("lock");
    let (queue, _) = SpillQueue::open(&dir.0, SpillOptions::default()).await.unwrap();
    // In this process: said so (flock alone would blame another process).
    assert!(matches!(
        SpillQueue::open(&dir.0, SpillOptions::default()).await,
        Err(SpillError::LockedHere)
    ));
    assert!(matches!(spill::check(&dir.0, 1 << 20), Err(SpillError::LockedHere)));
    queue.close().await.unwrap();
    // The directory is free as soon as `close` returns, every time.
    for _ in 0..100 {
        let (again, _) = SpillQueue::open(&dir.0, SpillOptions::default()).await.unwrap();
        again.append(b"x").await.unwrap();
        again.close().await.unwrap();
    }
}

#[tokio::test]
async fn check_reports_without_changing_and_repair_fixes() {
    let missing = TempDir::new("missing");
    assert!(matches!(spill::check(&missing.0, 1024), Err(SpillError::Missing(_))));
    let empty = TempDir::new("empty");
    std::fs::create_dir_all(&empty.0).unwrap();
    std::fs::write(empty.0.join("notes.txt"), "hi").unwrap();
    assert!(matches!(spill::check(&empty.0, 1024), Err(SpillError::NotAQueue(_))));

    let dir = TempDir::new("check");
    let options = SpillOptions::default().sync(SyncPolicy::Always).max_record(1024);
    let (queue, _) = SpillQueue::open(&dir.0, options.clone()).await.unwrap();
    for i in 0..10 {
        queue.append(record(i)).await.unwrap();
    }
    queue.close().await.unwrap();
    let segment = dir.0.join(&dir.segments()[0]);
    // A torn tail: half a frame of garbage at the end.
    let mut bytes = std::fs::read(&segment).unwrap();
    let clean_len = bytes.len();
    bytes.extend_from_slice(&[0xAB; 7]);
    std::fs::write(&segment, &bytes).unwrap();

    let report = spill::check(&dir.0, 1024).unwrap();
    assert_eq!((report.records, report.torn_tails, report.torn_bytes), (10, 1, 7));
    assert!(!report.is_clean());
    assert_eq!(std::fs::read(&segment).unwrap().len(), clean_len + 7, "check changes nothing");
    let repaired = spill::repair(&dir.0, 1024).unwrap();
    assert_eq!(repaired.torn_tails, 1);
    assert_eq!(std::fs::read(&segment).unwrap().len(), clean_len);
    assert!(spill::check(&dir.0, 1024).unwrap().is_clean());
}

/// Corrupts a file on disk in place.
fn corrupt(path: &std::path::Path, offset: usize, with: &[u8]) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[offset..offset + with.len()].copy_from_slice(with);
    std::fs::write(path, &bytes).unwrap();
}

#[tokio::test]
async fn recovery_skips_corruption_truncates_tails_and_never_refuses() {
    let dir = TempDir::new("recover");
    let options = SpillOptions::default().sync(SyncPolicy::Always).max_record(1024);
    let (queue, _) = SpillQueue::open(&dir.0, options.clone()).await.unwrap();
    for i in 0..20 {
        queue.append(record(i)).await.unwrap();
    }
    queue.close().await.unwrap();
    let segment = dir.0.join(&dir.segments()[0]);
    // Damage record 5's payload: records 0..5 and 6..20 survive.
    let offset_of_5: usize = 16 + (0..5).map(|i| 12 + record(i).len()).sum::<usize>();
    corrupt(&segment, offset_of_5 + 14, b"!!");
    // And tear the tail: cut record 19 in half.
    let len = std::fs::metadata(&segment).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&segment).unwrap().set_len(len - 5).unwrap();

    let (queue, report) = SpillQueue::open(&dir.0, options.clone()).await.unwrap();
    assert_eq!((report.corrupt_regions, report.torn_tails), (1, 1), "{report:?}");
    assert!(report.corrupt_bytes > 0 && report.torn_bytes > 0);
    let expected: Vec<Vec<u8>> = (0..19).filter(|i| *i != 5).map(record).collect();
    assert_eq!(read_all(&queue).await, expected);
    assert_eq!(queue.snapshot().recovered.corrupt_regions, 1);
    // Appends go on after the truncated tail.
    queue.append(b"after").await.unwrap();
    queue.close().await.unwrap();

    // An unreadable state file: everything is delivered again, and the report says so.
    std::fs::write(dir.0.join("STATE"), b"garbage").unwrap();
    let (queue, report) = SpillQueue::open(&dir.0, options.clone()).await.unwrap();
    assert!(report.state_reset);
    assert_eq!(read_all(&queue).await.len(), 19);
    queue.close().await.unwrap();

    // A damaged header loses the header, not the records: frames check themselves.
    let name = dir.segments()[0].clone();
    corrupt(&dir.0.join(&name), 0, b"XXXX");
    let (queue, report) = SpillQueue::open(&dir.0, options.clone()).await.unwrap();
    assert_eq!((report.damaged_headers, report.bad_segments), (1, 0), "{report:?}");
    assert_eq!(read_all(&queue).await.len(), 19);
    queue.close().await.unwrap();

    // A segment file holding no valid frame at all is dropped, not trusted; the state names
    // it (its header was synced before), so what it held is lost (stop 74: it was counted a
    // foreign file, and a repair exited 0 over the loss).
    let name = dir.segments()[0].clone();
    std::fs::write(dir.0.join(&name), vec![0xA5; 300]).unwrap();
    let (queue, report) = SpillQueue::open(&dir.0, options).await.unwrap();
    assert_eq!((report.bad_segments, report.missing_segments), (0, 1), "{report:?}");
    assert!(read_all(&queue).await.is_empty());
    queue.append(b"fresh").await.unwrap();
    assert_eq!(read_all(&queue).await, [b"fresh".to_vec()]);
    queue.close().await.unwrap();
}

/// Opens a queue on `storage` with `policy` and appends records `from..from + n`.
async fn append_some(storage: &MemStorage, policy: SyncPolicy, from: u64, n: u64) -> SpillQueue {
    let (queue, _) =
        SpillQueue::open_with(storage.clone(), SpillOptions::default().sync(policy)).await.unwrap();
    for i in from..from + n {
        queue.append(record(i)).await.unwrap();
    }
    queue
}

#[tokio::test]
async fn each_policy_loses_only_what_it_documents() {
    // Always and Batch: a crash that keeps nothing unsynced loses nothing acknowledged.
    for policy in [SyncPolicy::Always, SyncPolicy::Batch] {
        let storage = MemStorage::new();
        let queue = append_some(&storage, policy, 0, 50).await;
        storage.crash(|_, _| 0);
        drop(queue);
        let (queue, _) =
            SpillQueue::open_with(storage.after_crash(), SpillOptions::default()).await.unwrap();
        assert_eq!(read_all(&queue).await, (0..50).map(record).collect::<Vec<_>>(), "{policy:?}");
    }
    // Interval: what was written since the last tick can be lost; after a tick it is durable.
    let every = Duration::from_millis(50);
    let storage = MemStorage::new();
    let queue = append_some(&storage, SyncPolicy::Interval(every), 0, 10).await;
    // A tick syncs (twenty ticks' time: the sync runs on the writer's thread, which a loaded
    // host may not run for a while).
    tokio::time::sleep(every * 20).await;
    for i in 10..20 {
        queue.append(record(i)).await.unwrap();
    }
    storage.crash(|_, _| 0); // before the next tick
    drop(queue);
    let (queue, _) =
        SpillQueue::open_with(storage.after_crash(), SpillOptions::default()).await.unwrap();
    let survived = read_all(&queue).await;
    assert!(survived.len() >= 10 && survived.len() <= 20, "{}", survived.len());
    assert_eq!(survived[..10], (0..10).map(record).collect::<Vec<_>>()[..]);
    // Never: nothing is synced until close; a crash can lose all of it, a close loses nothing.
    let storage = MemStorage::new();
    let queue = append_some(&storage, SyncPolicy::Never, 0, 10).await;
    storage.crash(|_, _| 0);
    drop(queue);
    let (queue, _) =
        SpillQueue::open_with(storage.after_crash(), SpillOptions::default()).await.unwrap();
    assert!(read_all(&queue).await.is_empty(), "a crash before any sync loses what Never wrote");
    queue.close().await.unwrap();
    let storage = MemStorage::new();
    let queue = append_some(&storage, SyncPolicy::Never, 0, 10).await;
    queue.close().await.unwrap();
    storage.crash(|_, _| 0);
    let (queue, _) =
        SpillQueue::open_with(storage.after_crash(), SpillOptions::default()).await.unwrap();
    assert_eq!(read_all(&queue).await.len(), 10, "close syncs");
}

#[tokio::test]
async fn a_failed_write_or_sync_is_sticky_and_loses_nothing_acknowledged() {
    // `Batch` syncs on its own thread behind the writer: a sync failed there is as sticky.
    // A sync that panics (a careless `Storage`) fails the queue the same way.
    let cases = [Fault::FailAppendAfter(7), Fault::FailSync, Fault::PanicSync]
        .into_iter()
        .flat_map(|fault| [(fault, SyncPolicy::Always), (fault, SyncPolicy::Batch)]);
    for (fault, policy) in cases {
        let storage = MemStorage::new();
        let queue = append_some(&storage, policy, 0, 10).await;
        storage.inject(fault);
        let failed = queue.append(record(10)).await;
        assert!(matches!(failed, Err(SpillError::Failed(_))), "{fault:?} {policy:?}: {failed:?}");
        assert!(matches!(queue.append(record(11)).await, Err(SpillError::Failed(_))), "sticky");
        assert!(queue.snapshot().failed.is_some());
        storage.crash(|_, unsynced| unsynced); // even keeping every partial byte
        drop(queue);
        let (queue, _) =
            SpillQueue::open_with(storage.after_crash(), SpillOptions::default()).await.unwrap();
        let survived = read_all(&queue).await;
        let first: Vec<_> = (0..10).map(record).collect();
        assert_eq!(survived[..10], first[..], "{fault:?} {policy:?}");
        // The failed append was not acknowledged: it may or may not be there, but nothing else.
        assert!(survived.len() <= 11);
    }
}

#[tokio::test]
async fn snapshots_report_spill_queues() {
    let registry = lanes::Registry::new();
    let options = SpillOptions::default().registry(&registry, "overflow");
    let (queue, _) = SpillQueue::open_with(MemStorage::new(), options).await.unwrap();
    queue.append(b"a").await.unwrap();
    let json: serde_json::Value = serde_json::from_str(&registry.snapshot().to_json()).unwrap();
    assert_eq!(json["spill"]["overflow"]["records"], 1);
    assert_eq!(json["spill"]["overflow"]["sync"], "batch");
}

#[derive(Debug, Clone)]
enum Op {
    Append(u8),
    Batch(u8, u8),
    /// Read up to n and commit them.
    Consume(u8),
    /// Read up to n without committing.
    Peek(u8),
    /// Crash; each file keeps `cut` per mille of its unsynced bytes.
    Crash(u16),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => any::<u8>().prop_map(Op::Append),
        2 => (any::<u8>(), 1u8..6).prop_map(|(a, n)| Op::Batch(a, n)),
        3 => (1u8..20).prop_map(Op::Consume),
        1 => (1u8..10).prop_map(Op::Peek),
        2 => (0u16..=1000).prop_map(Op::Crash),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Crash simulation against a reference model: after any crash (each file keeping an
    /// arbitrary prefix of its unsynced bytes), reopen succeeds, and every record acknowledged
    /// under `Always` or `Batch` (synced by its own thread) and not committed is present, in
    /// order, exactly once.
    #[test]
    fn acknowledged_records_survive_any_crash(
        ops in proptest::collection::vec(op(), 1..60),
        batch in any::<bool>(),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let policy = if batch { SyncPolicy::Batch } else { SyncPolicy::Always };
            let options = SpillOptions::default().sync(policy).segment_size(512).max_record(400);
            let mut storage = MemStorage::new();
            let (mut queue, _) = SpillQueue::open_with(storage.clone(), options.clone()).await.unwrap();
            // The model: acknowledged, not yet committed records, in order.
            let mut model: std::collections::VecDeque<Vec<u8>> = Default::default();
            let mut next = 0u64;
            for op in ops {
                match op {
                    Op::Append(size) => {
                        let data = format!("{next}:{}", "y".repeat(size as usize)).into_bytes();
                        next += 1;
                        queue.append(&data).await.unwrap();
                        model.push_back(data);
                    }
                    Op::Batch(size, n) => {
                        let batch: Vec<Vec<u8>> = (0..n).map(|k| format!("{}:{k}:{}", next, "z".repeat(size as usize)).into_bytes()).collect();
                        next += 1;
                        queue.append_batch(&batch).await.unwrap();
                        model.extend(batch);
                    }
                    Op::Consume(n) | Op::Peek(n) => {
                        let mut reader = queue.reader().unwrap();
                        let batch = reader.try_next_batch(n as usize).await.unwrap();
                        let expected: Vec<Vec<u8>> = model.iter().take(batch.len()).cloned().collect();
                        prop_assert_eq!(batch.len(), (n as usize).min(model.len()));
                        prop_assert_eq!(batch.iter().map(|r| r.data().to_vec()).collect::<Vec<_>>(), expected);
                        if matches!(op, Op::Consume(_)) && let Some(last) = batch.last() {
                            reader.commit(last.position()).await.unwrap();
                            model.drain(..batch.len());
                        }
                    }
                    Op::Crash(per_mille) => {
                        storage.crash(|_, unsynced| unsynced * per_mille as usize / 1000);
                        drop(queue);
                        storage = storage.after_crash();
                        let (reopened, _) = SpillQueue::open_with(storage.clone(), options.clone()).await.unwrap();
                        queue = reopened;
                        let survived = read_all(&queue).await;
                        prop_assert_eq!(survived, model.iter().cloned().collect::<Vec<_>>());
                    }
                }
            }
            queue.close().await.unwrap();
            Ok(())
        })?;
    }
}

/// The active segment is extended with zeros ahead of the data (an in-place write syncs
/// cheaper than one that grows the file). A crash leaves that zero tail: it is space never
/// written, not a torn tail; reopening reads every record, and appends go on where the data
/// ends. A sealed or closed segment is exactly as long as its data.
#[tokio::test]
async fn a_reserved_zero_tail_is_unwritten_space_and_appends_continue_after_the_data() {
    let dir = TempDir::new("reserved");
    let options =
        SpillOptions::default().sync(SyncPolicy::Always).max_record(1024).segment_size(64 << 10);
    let (queue, _) = SpillQueue::open(&dir.0, options.clone()).await.unwrap();
    for i in 0..10 {
        queue.append(record(i)).await.unwrap();
    }
    let data_len: u64 = 16 + (0..10).map(|i| 12 + record(i).len() as u64).sum::<u64>();
    let live = dir.0.join(&dir.segments()[0]);
    assert_eq!(std::fs::metadata(&live).unwrap().len(), 64 << 10, "reserved ahead");
    // What a kill -9 leaves: the files as they are now (every append was synced).
    let crashed = TempDir::new("reserved-crash");
    std::fs::create_dir_all(&crashed.0).unwrap();
    for name in dir.files().into_iter().filter(|n| n != "LOCK") {
        std::fs::copy(dir.0.join(&name), crashed.0.join(&name)).unwrap();
    }
    queue.close().await.unwrap();
    assert_eq!(std::fs::metadata(&live).unwrap().len(), data_len, "a closed segment is trimmed");

    let report = spill::check(&crashed.0, 1024).unwrap();
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(report.records, 10);
    let (queue, report) = SpillQueue::open(&crashed.0, options.clone()).await.unwrap();
    assert!(report.is_clean(), "{report:?}");
    queue.append(b"after the crash").await.unwrap();
    let mut expected: Vec<Vec<u8>> = (0..10).map(record).collect();
    expected.push(b"after the crash".to_vec());
    assert_eq!(read_all(&queue).await, expected);
    // Fill past a rotation: the sealed segment ends at its seal.
    for i in 0..2000 {
        queue.append(record(i)).await.unwrap();
    }
    let segments = crashed.segments();
    assert!(segments.len() >= 2, "{segments:?}");
    let sealed = crashed.0.join(&segments[0]);
    let bytes = std::fs::read(&sealed).unwrap();
    // The file ends with the seal (a 20-byte frame whose payload is where the data ends).
    let recorded = u64::from_le_bytes(bytes[bytes.len() - 8..].try_into().unwrap());
    assert_eq!(recorded, bytes.len() as u64 - 20, "no reserved zeros behind a seal");
    queue.close().await.unwrap();
    let report = spill::check(&crashed.0, 1024).unwrap();
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(report.records, 2011);
}

/// `Batch` with its sync thread, under load: many appenders, some with appends in flight while
/// they frame the next, segments rotating under them, and a crash at a random point (each file
/// keeping an arbitrary part of what was not synced). Every append acknowledged before the
/// crash is there after it, exactly once and in each appender's order; nothing appears twice.
#[test]
fn batch_acknowledges_only_what_its_sync_thread_made_durable() {
    for seed in 0..24u64 {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).build().unwrap();
        let storage = MemStorage::new();
        let options = SpillOptions::default()
            .sync(SyncPolicy::Batch)
            .segment_size(2048)
            .max_record(256)
            .max_bytes(64 << 20);
        let (queue, _) = rt.block_on(SpillQueue::open_with(storage.clone(), options)).unwrap();
        const APPENDERS: u64 = 12;
        // Crash once this many appends were acknowledged (varies with the seed).
        let crash_after = 50 + seed * 37 % 400;
        let acked = std::sync::Arc::new(AtomicU64::new(0));
        let tasks: Vec<_> = (0..APPENDERS)
            .map(|who| {
                let (queue, acked) = (queue.clone(), acked.clone());
                rt.spawn(async move {
                    let mut mine = Vec::new();
                    for n in 0..10_000u64 {
                        let data =
                            format!("{who}:{n}:{}", "p".repeat(((who * 7 + n) % 90) as usize));
                        // Every third append keeps one more in flight while the next is framed.
                        let result = if n % 3 == 0 {
                            let first = match queue.start_append([data.as_bytes()]) {
                                Ok(pending) => pending,
                                Err(_) => break,
                            };
                            let next = format!("{who}:{}:b", n);
                            let second = queue.append(next.as_bytes()).await;
                            let first = first.await;
                            if first.is_ok() {
                                mine.push(data.into_bytes());
                                acked.fetch_add(1, Ordering::SeqCst);
                            }
                            second.map(|()| next.into_bytes())
                        } else {
                            queue.append(data.as_bytes()).await.map(|()| data.into_bytes())
                        };
                        match result {
                            Ok(data) => {
                                mine.push(data);
                                acked.fetch_add(1, Ordering::SeqCst);
                            }
                            Err(_) => break,
                        }
                    }
                    mine
                })
            })
            .collect();
        while acked.load(Ordering::SeqCst) < crash_after {
            std::thread::yield_now();
        }
        let keep = seed * 131 % 1001;
        storage.crash(|_, unsynced| unsynced * keep as usize / 1000);
        let acknowledged: Vec<Vec<Vec<u8>>> =
            tasks.into_iter().map(|t| rt.block_on(t).unwrap()).collect();
        drop(queue);
        let (queue, _) = rt
            .block_on(SpillQueue::open_with(storage.after_crash(), SpillOptions::default()))
            .unwrap();
        let survived = rt.block_on(read_all(&queue));
        let unique: std::collections::HashSet<&Vec<u8>> = survived.iter().collect();
        assert_eq!(unique.len(), survived.len(), "seed {seed}: a record appears twice");
        for (who, mine) in acknowledged.iter().enumerate() {
            let prefix = format!("{who}:");
            let theirs: Vec<&Vec<u8>> =
                survived.iter().filter(|r| r.starts_with(prefix.as_bytes())).collect();
            // Acknowledged records are present and in order (unacknowledged ones may be too).
            let mut at = theirs.iter();
            for record in mine {
                assert!(
                    at.any(|r| *r == record),
                    "seed {seed}: appender {who} lost an acknowledged record or its order"
                );
            }
        }
        rt.block_on(queue.close()).unwrap();
    }
}

/// Review finding (stop 74): a batch that spanned reads (here, two segments) and failed in a
/// later read lost the records of the earlier ones: the reader's cursor had moved past them,
/// and a commit of what it had read acknowledged records nobody was given.
#[tokio::test]
async fn a_batch_that_fails_partway_returns_what_it_read_and_skips_nothing() {
    let storage = MemStorage::new();
    let options = SpillOptions::default().max_record(1024).segment_size(4096);
    let (queue, _) = SpillQueue::open_with(storage.clone(), options).await.unwrap();
    let big = |i: u64| {
        let mut data = record(i);
        data.resize(1000, b'.');
        data
    };
    for i in 0..10 {
        queue.append(big(i)).await.unwrap();
    }
    let mut names: Vec<String> = spill::Storage::list(&storage)
        .unwrap()
        .into_iter()
        .filter(|n| n.ends_with(".seg"))
        .collect();
    names.sort();
    assert!(names.len() >= 3, "{names:?}");
    // The second segment's first record, damaged on disk after it was written.
    storage.corrupt(&names[1], 16 + 12, b"damage");
    let mut reader = queue.reader().unwrap();
    let first = reader.try_next_batch(100).await.expect("the first segment's records");
    assert!(!first.is_empty());
    let got: Vec<Vec<u8>> = first.iter().map(|r| r.data().to_vec()).collect();
    assert_eq!(got, (0..got.len() as u64).map(big).collect::<Vec<_>>());
    let err = reader.try_next_batch(100).await.unwrap_err();
    assert!(matches!(err, SpillError::Corrupt { .. }), "{err:?}");
}

/// A `MemStorage` that counts the bytes read and the state writes, and can fail the latter.
#[derive(Debug, Clone, Default)]
struct Watched {
    inner: MemStorage,
    read: Arc<AtomicU64>,
    state_writes: Arc<AtomicU64>,
    fail_state: Arc<AtomicBool>,
}

impl spill::Storage for Watched {
    fn list(&self) -> std::io::Result<Vec<String>> {
        self.inner.list()
    }
    fn list_other(&self) -> std::io::Result<Vec<String>> {
        self.inner.list_other()
    }
    fn exists(&self) -> bool {
        self.inner.exists()
    }
    fn create_dir(&self) -> std::io::Result<()> {
        self.inner.create_dir()
    }
    fn lock(&self) -> std::io::Result<Box<dyn std::fmt::Debug + Send + Sync>> {
        self.inner.lock()
    }
    fn is_owned(&self) -> std::io::Result<bool> {
        self.inner.is_owned()
    }
    fn len(&self, name: &str) -> std::io::Result<u64> {
        self.inner.len(name)
    }
    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> std::io::Result<usize> {
        self.read.fetch_add(buf.len() as u64, Ordering::SeqCst);
        self.inner.read_at(name, offset, buf)
    }
    fn read_all(&self, name: &str) -> std::io::Result<Vec<u8>> {
        self.inner.read_all(name)
    }
    fn create(&self, name: &str) -> std::io::Result<Box<dyn spill::AppendFile>> {
        self.inner.create(name)
    }
    fn open_append(&self, name: &str) -> std::io::Result<Box<dyn spill::AppendFile>> {
        self.inner.open_append(name)
    }
    fn truncate(&self, name: &str, len: u64) -> std::io::Result<()> {
        self.inner.truncate(name, len)
    }
    fn remove(&self, name: &str) -> std::io::Result<()> {
        self.inner.remove(name)
    }
    fn write_atomic(&self, name: &str, data: &[u8]) -> std::io::Result<()> {
        self.state_writes.fetch_add(1, Ordering::SeqCst);
        if self.fail_state.load(Ordering::SeqCst) {
            return Err(std::io::Error::other("injected state write failure"));
        }
        self.inner.write_atomic(name, data)
    }
    fn sync_dir(&self) -> std::io::Result<()> {
        self.inner.sync_dir()
    }
}

/// Review finding (stop 79): a disk too full for a whole segment's reservation (`fallocate`,
/// 64 MiB by default) failed the queue at its next rotation, though it had room for records,
/// and then every open: the backlog could not even be opened to drain it. A reservation that
/// fails costs only the reservation.
#[tokio::test]
async fn a_disk_too_full_for_a_segments_reservation_still_takes_records_and_opens() {
    let storage = MemStorage::new();
    storage.inject(Fault::FailReserve);
    let options = || SpillOptions::default().segment_size(512).max_record(400);
    let (queue, _) = SpillQueue::open_with(storage.clone(), options()).await.expect("opens");
    // Past several rotations, each of which reserves its new segment.
    for i in 0..100 {
        queue.append(record(i)).await.expect("the record fits");
    }
    queue.close().await.unwrap();
    let (queue, _) = SpillQueue::open_with(storage, options()).await.expect("opens again");
    assert_eq!(read_all(&queue).await, (0..100).map(record).collect::<Vec<_>>());
}

/// Review finding (stop 79): `next_batch` answered `Closed` as soon as the close began, while
/// the writer still wrote the appends accepted before it: a consumer that took `Closed` for
/// "everything read" stopped short. It answers `Closed` once the writer finished, and every
/// record it wrote was read. A second `close` waits for the first (it answered `Ok` at once,
/// while the writer still held the directory, and a reopen found it locked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_lets_the_reader_read_every_accepted_record_and_a_second_close_waits() {
    const N: u64 = 5_000;
    let storage = MemStorage::new();
    let options = || SpillOptions::default().sync(SyncPolicy::Always);
    let (queue, _) = SpillQueue::open_with(storage.clone(), options()).await.unwrap();
    let mut reader = queue.reader().unwrap();
    let consumer = tokio::spawn(async move {
        let mut read = 0;
        loop {
            match reader.next_batch(100).await {
                Ok(batch) => read += batch.len() as u64,
                Err(SpillError::Closed) => return read,
                Err(err) => panic!("{err}"),
            }
        }
    });
    let pending: Vec<_> = (0..N).map(|i| queue.start_append([record(i)]).unwrap()).collect();
    lanes::Lifecycle::close(&queue);
    queue.close().await.expect("the close the first began");
    let reopened = SpillQueue::open_with(storage.clone(), options()).await;
    assert!(reopened.is_ok(), "the directory is free once close returns: {reopened:?}");
    drop(reopened);
    assert_eq!(consumer.await.unwrap(), N, "every accepted record read before Closed");
    drop(pending);
}

/// Review finding (stop 79): a commit refused because the queue had closed still moved the
/// reader's acknowledged position, so its retry answered `Ok`, and the records came back at
/// the next open. A refused commit moves nothing.
#[tokio::test]
async fn a_commit_refused_after_the_close_stays_refused() {
    let storage = MemStorage::new();
    let queue = append_some(&storage, SyncPolicy::Always, 0, 10).await;
    let mut reader = queue.reader().unwrap();
    let batch = reader.next_batch(10).await.unwrap();
    assert_eq!(batch.len(), 10);
    queue.close().await.unwrap();
    let last = batch[9].position();
    assert!(matches!(reader.commit(last).await, Err(SpillError::Closed)));
    assert!(matches!(reader.commit(last).await, Err(SpillError::Closed)), "still refused");
    assert_eq!(queue.len(), 10, "nothing acknowledged");
    drop((reader, queue));
    let (queue, _) = SpillQueue::open_with(storage, SpillOptions::default()).await.unwrap();
    assert_eq!(read_all(&queue).await.len(), 10, "delivered again, as told");
}

/// Review finding (stop 79): under `SyncPolicy::Interval`, a queue that had failed skipped its
/// ticks' syncs, so the next tick, timed from the last sync that ran, came at once, every turn:
/// the writer spun until closed, retrying a failing state write each turn. It ticks once an
/// interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_queue_under_an_interval_does_not_spin() {
    let storage = Watched::default();
    let options = SpillOptions::default().sync(SyncPolicy::Interval(Duration::from_millis(100)));
    let (queue, _) = SpillQueue::open_with(storage.clone(), options).await.unwrap();
    queue.append(b"a").await.unwrap();
    let mut reader = queue.reader().unwrap();
    let read = reader.next_batch(1).await.unwrap();
    storage.inner.inject(Fault::FailAppendAfter(0));
    assert!(queue.append(b"b").await.is_err(), "the queue failed");
    storage.fail_state.store(true, Ordering::SeqCst);
    let committed = tokio::spawn(async move { reader.commit(read[0].position()).await });
    let before = storage.state_writes.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let made = storage.state_writes.load(Ordering::SeqCst) - before;
    assert!(made <= 20, "{made} state writes in half a second, at one tick each 100 ms");
    committed.abort();
    drop(queue);
}

/// Review finding (stop 79): each read was sized by `max_record` (8 MiB by default), whatever
/// it wanted: a reader taking one record at a time read, and threw away, up to 8 MiB a call,
/// quadratic over a backlog. A read is sized by the records it wants.
#[tokio::test]
async fn a_reader_taking_one_record_at_a_time_reads_little_more_than_it_takes() {
    const N: u64 = 2_000;
    let storage = Watched::default();
    let (queue, _) = SpillQueue::open_with(storage.clone(), SpillOptions::default()).await.unwrap();
    for i in 0..N {
        queue.append(record(i)).await.unwrap();
    }
    let mut reader = queue.reader().unwrap();
    let before = storage.read.load(Ordering::SeqCst);
    for _ in 0..N {
        assert_eq!(reader.try_next_batch(1).await.unwrap().len(), 1);
    }
    let per_record = (storage.read.load(Ordering::SeqCst) - before) / N;
    assert!(per_record <= 8 << 10, "{per_record} bytes read a record");
}

/// Review finding (stop 79): a commit of any position up to what the reader had read was
/// taken, one inside a record too (of another queue, say): it was persisted, and every reader
/// made after it failed `Corrupt` until the queue was opened again. Only a position the reader
/// handed out is taken.
#[tokio::test]
async fn a_commit_of_a_position_inside_a_record_is_refused() {
    let storage = MemStorage::new();
    let queue = append_some(&storage, SyncPolicy::Always, 0, 10).await;
    let mut reader = queue.reader().unwrap();
    let batch = reader.next_batch(10).await.unwrap();
    let inside = spill::Position { offset: batch[4].position().offset - 3, ..batch[4].position() };
    let refused = reader.commit(inside).await;
    assert!(matches!(refused, Err(SpillError::NotRead { .. })), "{refused:?}");
    reader.commit(batch[4].position()).await.expect("a record's position");
    drop(reader);
    let mut reader = queue.reader().unwrap();
    let rest = reader.next_batch(10).await.expect("a later reader reads on");
    assert_eq!(rest.len(), 5);
    queue.close().await.unwrap();
}

/// Review finding (stop 79, second look): a commit whose state write failed, retried after a
/// close whose own state write failed too, answered `Ok`, and its records came back at the next
/// open. A retry after the close is `Ok` only if the state file holds the position.
#[tokio::test]
async fn a_commit_retried_after_a_close_that_could_not_persist_it_is_refused() {
    let storage = Watched::default();
    let (queue, _) = SpillQueue::open_with(storage.clone(), SpillOptions::default()).await.unwrap();
    for i in 0..10 {
        queue.append(record(i)).await.unwrap();
    }
    let mut reader = queue.reader().unwrap();
    let batch = reader.next_batch(10).await.unwrap();
    storage.fail_state.store(true, Ordering::SeqCst);
    let last = batch[9].position();
    assert!(reader.commit(last).await.is_err(), "its state write failed");
    let _ = queue.close().await;
    let retried = reader.commit(last).await;
    assert!(matches!(retried, Err(SpillError::Closed)), "{retried:?}");
    storage.fail_state.store(false, Ordering::SeqCst);
    drop((reader, queue));
    let (queue, _) = SpillQueue::open_with(storage, SpillOptions::default()).await.unwrap();
    assert_eq!(read_all(&queue).await.len(), 10, "delivered again, as the refusal told");
}
