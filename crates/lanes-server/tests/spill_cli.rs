//! `lanes spill check` end to end: the real binary on real directories.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use lanes::spill::{SpillOptions, SpillQueue, SyncPolicy};

fn lanes(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lanes")).args(args).output().expect("run the lanes binary")
}

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lanes-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

async fn queue_with(dir: &Path, records: usize) {
    let options = SpillOptions::default().sync(SyncPolicy::Always);
    let (queue, _) = SpillQueue::open(dir, options).await.unwrap();
    for i in 0..records {
        queue.append(format!("record {i}")).await.unwrap();
    }
    queue.close().await.unwrap();
}

#[tokio::test]
async fn check_reports_repairs_and_explains() {
    let missing = lanes(&["spill", "check", "/definitely/not/here"]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("does not exist"));

    let foreign = temp("foreign");
    std::fs::create_dir_all(&foreign).unwrap();
    std::fs::write(foreign.join("README"), "not a queue").unwrap();
    let out = lanes(&["spill", "check", foreign.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not hold a spill queue"));

    let dir = temp("queue");
    queue_with(&dir, 12).await;
    let path = dir.to_str().unwrap();
    let out = lanes(&["spill", "check", path]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(
        stdout.contains("records             12") && stdout.contains("corruption          none"),
        "{stdout}"
    );

    // A torn tail: reported (exit 3) without changing anything, then repaired.
    let segment = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "seg"))
        .unwrap();
    let mut bytes = std::fs::read(&segment).unwrap();
    let clean = bytes.len();
    bytes.extend_from_slice(&[1, 2, 3, 4, 5]);
    std::fs::write(&segment, &bytes).unwrap();
    let out = lanes(&["spill", "check", path, "--json"]);
    assert_eq!(out.status.code(), Some(3));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((report["torn_tails"].as_u64(), report["torn_bytes"].as_u64()), (Some(1), Some(5)));
    assert_eq!(std::fs::read(&segment).unwrap().len(), clean + 5, "check changed nothing");
    let out = lanes(&["spill", "check", path, "--repair"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("truncated"));
    assert_eq!(std::fs::read(&segment).unwrap().len(), clean);

    // Open in this process: the CLI says who holds it instead of reading a live queue.
    let (queue, _) = SpillQueue::open(&dir, SpillOptions::default()).await.unwrap();
    let out = lanes(&["spill", "check", path]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("open in another process"));
    queue.close().await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&foreign);
}

/// Review finding (stop 72): `--repair` exited 0 whatever it could not undo. A lost segment
/// stays lost: the repair says so and exits 3.
#[tokio::test]
async fn a_repair_that_cannot_undo_a_loss_exits_3() {
    let dir = temp("lost");
    let options = SpillOptions::default().sync(SyncPolicy::Always).max_record(64).segment_size(256);
    let (queue, _) = SpillQueue::open(&dir, options).await.unwrap();
    for i in 0..30 {
        queue.append(format!("record {i:04}")).await.unwrap();
    }
    queue.close().await.unwrap();
    let mut segments: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .collect();
    segments.sort();
    assert!(segments.len() >= 3, "{segments:?}");
    std::fs::remove_file(&segments[1]).unwrap();
    let path = dir.to_str().unwrap();
    for args in [&["spill", "check", path][..], &["spill", "check", path, "--repair"]] {
        let out = lanes(args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(3), "{args:?}: {stdout}");
        assert!(stdout.contains("missing segments    1"), "{args:?}: {stdout}");
    }
    let out = lanes(&["spill", "check", path, "--repair", "--json"]);
    assert_eq!(out.status.code(), Some(3));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Review finding (stop 72, second look): `--repair` read its exit from the check after the
/// repair alone. With the committed segment and every later one lost, the repair moves the
/// queue on and the check after it is clean: exit 0 for lost records. And with the state file
/// deleted, the repair never wrote one: exit 3 for a queue that only delivers again.
#[tokio::test]
async fn a_repair_exits_on_what_it_found() {
    let dir = temp("tail-lost");
    queue_with(&dir, 5).await;
    let path = dir.to_str().unwrap();
    for segment in std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
    {
        std::fs::remove_file(segment).unwrap();
    }
    let out = lanes(&["spill", "check", path, "--repair"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(3), "{stdout}");
    assert!(stdout.contains("missing segments"), "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);

    let dir = temp("state-lost");
    queue_with(&dir, 5).await;
    let path = dir.to_str().unwrap();
    std::fs::remove_file(dir.join("STATE")).unwrap();
    let out = lanes(&["spill", "check", path]);
    assert_eq!(out.status.code(), Some(3), "{}", String::from_utf8_lossy(&out.stdout));
    let out = lanes(&["spill", "check", path, "--repair"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stdout));
    let out = lanes(&["spill", "check", path]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(stdout.contains("records             5"), "delivered again, not lost: {stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}
