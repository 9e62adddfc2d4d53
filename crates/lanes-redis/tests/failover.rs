//! A Redis Cluster primary killed in the middle of a hammer, its replica promoted: six limits
//! spread over the cluster's three primaries, 64 tasks over four clients. The killed primary's
//! replica is made to lag first, so the grants of its last moments are lost with it — the case
//! that can hand one permit to two holders. By the holders' own count (a holder stops at once
//! when its permit is reported lost) no limit ever has more than `concurrent` holders, no
//! fencing token of a limit is handed out twice, every permit whose grant was lost is reported
//! lost to its holder, and grants resume once the replica has taken over.

mod common;

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::DedicatedCluster;
use lanes::{LimitSpec, Limits, Priority};
use lanes_redis::RedisLimits;
use tokio::time::{Instant, sleep, timeout};

const CONCURRENT: i64 = 2;
const LIMITS: usize = 6;
const LEASE: Duration = Duration::from_secs(3);
const NS: &str = "failover";

#[derive(Default)]
struct Tally {
    holders: AtomicI64,
    peak: AtomicI64,
    grants: AtomicU64,
    tokens: Mutex<Vec<u64>>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_killed_mid_hammer_keeps_every_limit_bound() {
    let mut cluster = tokio::task::spawn_blocking(DedicatedCluster::start).await.unwrap();
    let mut clients = Vec::new();
    for _ in 0..4 {
        let backend = RedisLimits::cluster_builder(cluster.urls())
            .namespace(NS)
            .lease(LEASE)
            .op_timeout(Duration::from_millis(200))
            .build()
            .await
            .expect("the dedicated cluster answers");
        clients.push(Limits::with_backend(backend));
    }
    let names: Vec<String> = (0..LIMITS).map(|i| format!("db{i}")).collect();
    for name in &names {
        clients[0].define(name, LimitSpec::concurrent(CONCURRENT as u32)).await.unwrap();
    }
    let ask = cluster.ports[0];
    let primaries: Vec<u16> =
        names.iter().map(|name| cluster.primary_of(ask, &format!("{{{NS}:{name}}}"))).collect();
    let victim = primaries[0];
    let mut spread = primaries.clone();
    spread.sort_unstable();
    spread.dedup();
    assert!(spread.len() >= 2, "the limits live on more than one primary: {primaries:?}");

    let tallies: Arc<Vec<Tally>> = Arc::new((0..LIMITS).map(|_| Tally::default()).collect());
    let lost = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for task in 0..64u64 {
        let limits = clients[task as usize % 4].clone();
        let (tallies, lost, stop, names) =
            (tallies.clone(), lost.clone(), stop.clone(), names.clone());
        tasks.push(tokio::spawn(async move {
            let mut seed = task.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            while !stop.load(Ordering::Relaxed) {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let i = (seed % LIMITS as u64) as usize;
                let tally = &tallies[i];
                let permit = match limits
                    .acquire_timeout(&names[i], Priority::default(), Duration::from_millis(300))
                    .await
                {
                    Ok(permit) => permit,
                    Err(err) => {
                        if std::env::var("DEBUG_FAILOVER").is_ok() && seed % 16 == 0 {
                            eprintln!("{:?} {i} {err}", std::time::SystemTime::now());
                        }
                        sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let now = tally.holders.fetch_add(1, Ordering::SeqCst) + 1;
                tally.peak.fetch_max(now, Ordering::SeqCst);
                tally.grants.fetch_add(1, Ordering::Relaxed);
                tally.tokens.lock().unwrap().push(permit.fencing_token());
                // Most holds are short; one in four outlasts the failover, so that permits
                // granted in the lagging moments are still held when their loss comes out.
                let hold = if seed % 4 == 0 { 4_000 } else { 50 + seed % 350 };
                tokio::select! {
                    () = sleep(Duration::from_millis(hold)) => {}
                    () = permit.lost() => { lost.fetch_add(1, Ordering::Relaxed); }
                }
                tally.holders.fetch_sub(1, Ordering::SeqCst);
                drop(permit);
            }
        }));
    }
    sleep(Duration::from_millis(800)).await;
    let victims: Vec<usize> = (0..LIMITS).filter(|i| primaries[*i] == victim).collect();
    let before: u64 = victims.iter().map(|i| tallies[*i].grants.load(Ordering::Relaxed)).sum();
    assert!(before > 0, "the hammer reaches the victim's limits");

    // The victim's replica loses its link for good: from here on, what the victim writes
    // never reaches the replica that will take over.
    cluster.cut_replication(victim);
    sleep(Duration::from_millis(500)).await;
    let lagged: u64 = victims.iter().map(|i| tallies[*i].grants.load(Ordering::Relaxed)).sum();
    cluster.kill(victim);
    let killed = Instant::now();

    // Grants on the victim's limits resume once the replica is promoted and the hold is over.
    let resumed = timeout(Duration::from_secs(20), async {
        loop {
            let now: u64 = victims.iter().map(|i| tallies[*i].grants.load(Ordering::Relaxed)).sum();
            if now > lagged {
                return killed.elapsed();
            }
            sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("grants on the failed primary's limits resume after the failover");
    sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        timeout(Duration::from_secs(10), task).await.expect("tasks end").unwrap();
    }

    let peaks: Vec<i64> = tallies.iter().map(|t| t.peak.load(Ordering::SeqCst)).collect();
    println!("primaries {primaries:?} victim {victim} peaks {peaks:?}");
    for (i, tally) in tallies.iter().enumerate() {
        let peak = tally.peak.load(Ordering::SeqCst);
        assert!(peak <= CONCURRENT, "limit {} had {peak} holders at once", names[i]);
        let mut tokens = tally.tokens.lock().unwrap().clone();
        let total = tokens.len();
        tokens.sort_unstable();
        tokens.dedup();
        assert_eq!(tokens.len(), total, "limit {}: a fencing token was handed out twice", names[i]);
    }
    println!(
        "victim {victim} serving {victims:?}; grants before lag {before}, before kill {lagged}; \
         resumed {resumed:?} after the kill; lost reported {}",
        lost.load(Ordering::Relaxed)
    );
    assert!(lagged > before, "grants were made while the replica lagged (and were lost)");
    assert!(lost.load(Ordering::Relaxed) > 0, "the permits of lost grants were reported lost");
}
