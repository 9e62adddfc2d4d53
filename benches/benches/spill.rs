//! Suite 9, the spill queue: append throughput per sync policy and record size, read-back,
//! recovery of 1 GiB, against the raw `write` + `fdatasync` floor of the same filesystem and a
//! queue built on redb with the same durability. Timed loops of fixed duration (fsync-bound
//! work does not suit criterion's many short samples); results go to
//! `target/lanes-bench/spill.json` for the report.
#![allow(missing_docs)]

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lanes::spill::{SpillOptions, SpillQueue, SyncPolicy};
use lanes_benches::{Flavor, quick, results_dir, write_result};
use redb::{Database, Durability, TableDefinition};
use serde_json::{Map, Value, json};

const SIZES: [usize; 3] = [64, 1024, 64 * 1024];
const APPENDERS: usize = 64;
const TABLE: TableDefinition<'_, u64, &[u8]> = TableDefinition::new("queue");

fn window() -> Duration {
    if quick() { Duration::from_millis(700) } else { Duration::from_secs(3) }
}

/// The filesystem type of the mount holding `path` (from /proc/mounts).
fn fs_type(path: &Path) -> String {
    let path = path.canonicalize().unwrap_or_else(|_| path.to_owned());
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    mounts
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (_, point, kind) = (fields.next()?, fields.next()?, fields.next()?);
            path.starts_with(point).then(|| (point.len(), kind.to_owned()))
        })
        .max_by_key(|(len, _)| *len)
        .map_or_else(|| "unknown".to_owned(), |(_, kind)| kind)
}

fn fresh(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    let _ = std::fs::remove_dir_all(&path);
    let _ = std::fs::remove_file(&path);
    path
}

/// The bandwidth floor: sequential 1 MiB writes, one fdatasync at the end; MB/s.
fn raw_bandwidth(dir: &Path) -> f64 {
    let path = fresh(dir, "raw.bin");
    let chunk = vec![7u8; 1 << 20];
    let total = if quick() { 256 } else { 1024 };
    let mut file =
        OpenOptions::new().create(true).write(true).truncate(true).open(&path).expect("raw file");
    let start = Instant::now();
    for _ in 0..total {
        file.write_all(&chunk).expect("write");
    }
    file.sync_data().expect("sync");
    let bandwidth = total as f64 / start.elapsed().as_secs_f64();
    let _ = std::fs::remove_file(&path);
    bandwidth
}

/// The latency floor: appending one frame of a `size`-byte record (`size` + 12 bytes) and
/// `fdatasync`, in a loop; the mean per durable write.
fn raw_fsync(dir: &Path, size: usize) -> Duration {
    let path = fresh(dir, "raw-sync.bin");
    let mut file =
        OpenOptions::new().create(true).write(true).truncate(true).open(&path).expect("raw file");
    let frame = vec![1u8; size + 12];
    let start = Instant::now();
    let mut syncs = 0u32;
    while start.elapsed() < window() {
        file.write_all(&frame).expect("write");
        file.sync_data().expect("sync");
        syncs += 1;
    }
    let latency = start.elapsed() / syncs;
    let _ = std::fs::remove_file(&path);
    latency
}

/// Appends `size`-byte records for a window with `appenders` concurrent tasks, each handing
/// over `per_call` records per `append_batch`; (records/s, MB/s of records).
async fn append_rate(
    dir: &Path,
    policy: SyncPolicy,
    size: usize,
    appenders: usize,
    per_call: usize,
) -> (f64, f64) {
    let path = fresh(dir, "queue");
    let options = SpillOptions::default().sync(policy).max_bytes(64 << 30).max_record(1 << 20);
    let (queue, _) = SpillQueue::open(&path, options).await.expect("open");
    let deadline = Instant::now() + window();
    let record = Arc::new(vec![5u8; size]);
    let start = Instant::now();
    let tasks: Vec<_> = (0..appenders)
        .map(|_| {
            let (queue, record) = (queue.clone(), record.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                let batch: Vec<&[u8]> = vec![record.as_slice(); per_call];
                while Instant::now() < deadline {
                    if per_call == 1 {
                        queue.append(&*record).await.expect("append");
                    } else {
                        queue.append_batch(batch.iter().copied()).await.expect("append");
                    }
                    n += per_call as u64;
                }
                n
            })
        })
        .collect();
    let mut records = 0u64;
    for task in tasks {
        records += task.await.expect("appender");
    }
    let elapsed = start.elapsed().as_secs_f64();
    queue.close().await.expect("close");
    let _ = std::fs::remove_dir_all(&path);
    let rate = records as f64 / elapsed;
    (rate, rate * size as f64 / 1e6)
}

/// The same through redb: one record per durable transaction, or `group` per transaction.
fn redb_rate(dir: &Path, size: usize, group: usize) -> (f64, f64) {
    let path = fresh(dir, "redb.db");
    let db = Database::create(&path).expect("redb");
    let record = vec![5u8; size];
    let mut key = 0u64;
    let start = Instant::now();
    while start.elapsed() < window() {
        let mut txn = db.begin_write().expect("txn");
        txn.set_durability(Durability::Immediate);
        {
            let mut table = txn.open_table(TABLE).expect("table");
            for _ in 0..group {
                table.insert(key, record.as_slice()).expect("insert");
                key += 1;
            }
        }
        txn.commit().expect("commit");
    }
    let rate = key as f64 / start.elapsed().as_secs_f64();
    drop(db);
    let _ = std::fs::remove_file(&path);
    (rate, rate * size as f64 / 1e6)
}

/// Writes `bytes` of 1 KiB records, then times reading them all back, and reopening (recovery).
async fn read_and_recover(dir: &Path, bytes: u64) -> (f64, f64, u64) {
    let path = fresh(dir, "big");
    let options = SpillOptions::default().sync(SyncPolicy::Never).max_bytes(4 << 30);
    let (queue, _) = SpillQueue::open(&path, options.clone()).await.expect("open");
    let record = vec![9u8; 1024];
    let batch: Vec<&[u8]> = (0..256).map(|_| record.as_slice()).collect();
    let count = bytes / 1024;
    for _ in 0..count / 256 {
        queue.append_batch(batch.iter().copied()).await.expect("append");
    }
    let start = Instant::now();
    let mut reader = queue.reader().expect("reader");
    let mut read = 0u64;
    loop {
        let got = reader.try_next_batch(4096).await.expect("read");
        if got.is_empty() {
            break;
        }
        read += got.iter().map(|r| r.data().len() as u64).sum::<u64>();
    }
    let read_mb_s = read as f64 / 1e6 / start.elapsed().as_secs_f64();
    drop(reader);
    queue.close().await.expect("close");
    let start = Instant::now();
    let (queue, report) = SpillQueue::open(&path, options).await.expect("reopen");
    let recovery = start.elapsed().as_secs_f64();
    queue.close().await.expect("close");
    let _ = std::fs::remove_dir_all(&path);
    (read_mb_s, recovery, report.records)
}

/// What a row is judged against.
enum Floor {
    /// Records/s of one `size`-byte frame written and `fdatasync`ed at a time.
    Fsync,
    /// MB/s of sequential 1 MiB writes and one `fdatasync`.
    Bandwidth,
    None,
}

/// One row of the append table: a policy, how many appenders, how many records per call, its
/// floor, and the records per redb transaction at the same durability.
struct Row {
    key: &'static str,
    policy: SyncPolicy,
    appenders: usize,
    per_call: fn(usize) -> usize,
    floor: Floor,
    redb: Option<fn(usize) -> usize>,
}

/// Alternating rounds per cell; each figure is the median of its rounds (this disk has
/// stalls that a mean would carry).
const ROUNDS: usize = 3;

/// The median of `values` (0 for none).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

fn main() {
    // `cargo bench` passes --bench; a criterion-style filter is ignored here.
    let dir = results_dir().join("spill-tmp");
    std::fs::create_dir_all(&dir).expect("bench directory");
    let fs = fs_type(&dir);
    eprintln!("spill bench on {} ({fs})", dir.display());
    let rt = Flavor::MultiThread.runtime();
    // This disk's speed drifts between runs and within one, so each cell measures its floor
    // and its redb counterpart next to it, in alternating rounds, and reports the means.
    let batched = |size: usize| (64 * 1024 / size).max(1);
    let rows: [Row; 5] = [
        Row {
            key: "always",
            policy: SyncPolicy::Always,
            appenders: 1,
            per_call: |_| 1,
            floor: Floor::Fsync,
            redb: Some(|_| 1),
        },
        Row {
            key: "batch",
            policy: SyncPolicy::Batch,
            appenders: APPENDERS,
            per_call: |_| 1,
            floor: Floor::Bandwidth,
            redb: Some(|_| APPENDERS),
        },
        Row {
            key: "batch_batched",
            policy: SyncPolicy::Batch,
            appenders: APPENDERS,
            per_call: batched,
            floor: Floor::Bandwidth,
            redb: Some(|size| APPENDERS * (64 * 1024 / size).max(1)),
        },
        Row {
            key: "interval_500ms",
            policy: SyncPolicy::Interval(Duration::from_millis(500)),
            appenders: APPENDERS,
            per_call: batched,
            floor: Floor::Bandwidth,
            redb: None,
        },
        Row {
            key: "always_concurrent",
            policy: SyncPolicy::Always,
            appenders: APPENDERS,
            per_call: |_| 1,
            floor: Floor::None,
            redb: None,
        },
    ];
    let mut policies = Map::new();
    for row in rows {
        // LANES_SPILL_ROWS=always,batch runs only those rows (while working on one of them).
        if std::env::var("LANES_SPILL_ROWS").is_ok_and(|r| !r.split(',').any(|k| k == row.key)) {
            continue;
        }
        let mut sizes = Map::new();
        for size in SIZES {
            let n = (row.per_call)(size);
            let (mut rates, mut floors, mut redbs) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..ROUNDS {
                floors.push(match row.floor {
                    Floor::Fsync => 1.0 / raw_fsync(&dir, size).as_secs_f64(),
                    Floor::Bandwidth => raw_bandwidth(&dir),
                    Floor::None => 0.0,
                });
                let (r, _) = rt.block_on(append_rate(&dir, row.policy, size, row.appenders, n));
                rates.push(r);
                if let Some(group) = row.redb {
                    redbs.push(redb_rate(&dir, size, group(size)).0);
                }
            }
            let (rate, floor, redb) = (median(rates), median(floors), median(redbs));
            let mb_s = rate * size as f64 / 1e6;
            eprintln!(
                "{} {size} B x{} ({n} per call): {rate:.0} records/s, {mb_s:.1} MB/s; floor \
                 {floor:.0}; redb {redb:.0} records/s",
                row.key, row.appenders
            );
            let mut cell = json!({ "records_s": rate, "mb_s": mb_s, "per_call": n });
            if !matches!(row.floor, Floor::None) {
                cell["floor"] = json!(floor);
            }
            if let Some(group) = row.redb {
                cell["redb_records_s"] = json!(redb);
                cell["redb_per_txn"] = json!(group(size));
            }
            sizes.insert(size.to_string(), cell);
        }
        policies.insert(row.key.to_owned(), Value::Object(sizes));
    }
    let gib = 1u64 << 30;
    let (read_mb_s, recovery_s, recovered) = rt.block_on(read_and_recover(&dir, gib));
    eprintln!(
        "read back {read_mb_s:.0} MB/s; recovery of 1 GiB ({recovered} records) in {recovery_s:.2} s"
    );
    let _ = std::fs::remove_dir_all(&dir);
    write_result(
        "spill",
        &json!({
            "fs": fs,
            "policies": policies,
            "read_mb_s": read_mb_s,
            "recovery_1gib_s": recovery_s,
            "recovered_records": recovered,
        }),
    );
}
