//! A real kill -9 harness: a child process appends under `Always` and prints every
//! acknowledged sequence number; it is killed at random moments, 200+ times. After each kill the
//! queue must reopen (no stale lock), with every acknowledged record present, in order, once.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use lanes::spill::{SpillOptions, SpillQueue, SyncPolicy};

const CHILD_DIR: &str = "LANES_SPILL_CHILD_DIR";
const CHILD_FROM: &str = "LANES_SPILL_CHILD_FROM";

fn options() -> SpillOptions {
    SpillOptions::default().sync(SyncPolicy::Always).segment_size(64 << 10).max_record(1024)
}

/// The child's body: appends forever, printing each acknowledged sequence number. Without the
/// environment variables (a normal test run) it returns at once.
#[test]
fn child_appender() {
    let (Ok(dir), Ok(from)) = (std::env::var(CHILD_DIR), std::env::var(CHILD_FROM)) else {
        return;
    };
    let from: u64 = from.parse().unwrap();
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async move {
        let (queue, _) = SpillQueue::open(&dir, options()).await.unwrap();
        // Several concurrent appenders, as a service would have.
        let tasks: Vec<_> = (0..4u64)
            .map(|lane| {
                let queue = queue.clone();
                tokio::spawn(async move {
                    for i in 0.. {
                        let seq = from + i * 4 + lane;
                        let payload = format!("{seq}:{}", "p".repeat((seq % 97) as usize));
                        queue.append(payload).await.unwrap();
                        let mut out = std::io::stdout().lock();
                        writeln!(out, "ack {seq}").unwrap();
                        out.flush().unwrap();
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
    });
}

#[test]
fn acknowledged_appends_survive_kill_9() {
    if std::env::var(CHILD_DIR).is_ok() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("lanes-spill-kill-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let exe = std::env::current_exe().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut next = 0u64;
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let started = Instant::now();
    let mut total_acked = 0usize;
    let cycles = 200;
    for cycle in 0..cycles {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let mut child = Command::new(&exe)
            .args(["--exact", "child_appender", "--nocapture", "--test-threads=1"])
            .env(CHILD_DIR, &dir)
            .env(CHILD_FROM, next.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Lines go through a thread of their own, so that waiting for the first ack has a
        // deadline (a child that wedges, say on a stale lock, must fail the test, not hang it).
        // An ack may share its line with the test harness's own output: found anywhere in it.
        let ack =
            |line: &str| line.split_once("ack ").and_then(|(_, n)| n.trim().parse::<u64>().ok());
        let stdout = child.stdout.take().unwrap();
        let (lines_tx, lines) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if lines_tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut acked: Vec<u64> = Vec::new();
        // Kill at a random moment: in one cycle of four during startup, in the others
        // mid-append, counted from the child's first acknowledgement (not from its spawn, which
        // a loaded host can make take longer than the whole window).
        if cycle % 4 != 0 {
            let deadline = Instant::now() + Duration::from_secs(30);
            while acked.is_empty() {
                let left = deadline.saturating_duration_since(Instant::now());
                match lines.recv_timeout(left) {
                    Ok(line) => acked.extend(ack(&line)),
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                        let _ = child.kill();
                        panic!("cycle {cycle}: the child acknowledged nothing within 30 s");
                    }
                    // It died before its first ack: nothing to wait for.
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
                }
            }
        }
        std::thread::sleep(Duration::from_micros(2_000 + seed % 25_000));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        reader.join().unwrap();
        acked.extend(lines.into_iter().filter_map(|line| ack(&line)));
        total_acked += acked.len();

        let survived: Vec<u64> = rt.block_on(async {
            let (queue, report) = SpillQueue::open(&dir, options())
                .await
                .unwrap_or_else(|e| panic!("cycle {cycle}: reopen after kill -9 failed: {e}"));
            assert_eq!(report.corrupt_regions, 0, "cycle {cycle}: {report:?}");
            let mut reader = queue.reader().unwrap();
            let mut seqs = Vec::new();
            loop {
                let batch = reader.try_next_batch(10_000).await.unwrap();
                let Some(last) = batch.last().map(|r| r.position()) else { break };
                for record in &batch {
                    let text = std::str::from_utf8(record.data()).unwrap();
                    seqs.push(text.split(':').next().unwrap().parse::<u64>().unwrap());
                }
                reader.commit(last).await.unwrap();
            }
            drop(reader);
            queue.close().await.unwrap();
            seqs
        });
        // Every acknowledged append is there, exactly once; nothing is there twice.
        let mut sorted = survived.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), survived.len(), "cycle {cycle}: duplicates in {survived:?}");
        for seq in &acked {
            assert!(
                sorted.binary_search(seq).is_ok(),
                "cycle {cycle}: acknowledged {seq} was lost"
            );
        }
        // Each appender's records are in its order.
        for lane in 0..4 {
            let mine: Vec<u64> = survived.iter().copied().filter(|s| s % 4 == lane).collect();
            assert!(
                mine.windows(2).all(|w| w[0] < w[1]),
                "cycle {cycle}: lane {lane} out of order"
            );
        }
        next = survived.iter().chain(&acked).max().map_or(next, |m| m + 1);
        next += 4 - next % 4; // keep lanes aligned
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        total_acked > cycles,
        "the children acknowledged too little to mean much: {total_acked}"
    );
    eprintln!(
        "{cycles} kill -9 cycles, {total_acked} acknowledged appends checked, in {:?}",
        started.elapsed()
    );
}
