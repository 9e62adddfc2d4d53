//! The keyed-pool scenario: versioned updates of 200 entities, one of them slow, applied in
//! per-key mode and then in hashed-shards mode for contrast.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lanes::BoxError;
use lanes::pool::{KeyedMode, KeyedPool};
use tokio::time::sleep;

use super::{DemoArgs, Rng, percentile};

const ENTITIES: u64 = 200;
const UPDATES: u64 = 3_000;
const WORKERS: usize = 8;
const SLOW: u64 = 0;

/// What one mode's run saw.
struct Seen {
    applied: u64,
    violations: u64,
    fast_waits: Vec<Duration>,
    elapsed: Duration,
}

pub(super) async fn run(args: &DemoArgs) -> Result<(), BoxError> {
    println!(
        "keyed pool: {UPDATES} versioned updates of {ENTITIES} entities on {WORKERS} workers; \
         entity-{SLOW} is slow (40 ms per update), the others take 1–3 ms. Each entity's \
         updates must apply in version order.\n"
    );
    let per_key = apply(KeyedMode::PerKey, args.seed).await?;
    let hashed = apply(KeyedMode::Hashed, args.seed).await?;
    println!(
        "{:<14} {:>8} {:>16} {:>16} {:>16} {:>9}",
        "mode", "applied", "order violations", "others' wait p50", "others' wait p99", "took"
    );
    for (name, seen) in [("per-key", &per_key), ("hashed shards", &hashed)] {
        let mut waits = seen.fast_waits.clone();
        waits.sort_unstable();
        println!(
            "{:<14} {:>8} {:>16} {:>16.1?} {:>16.1?} {:>9.2?}",
            name,
            seen.applied,
            seen.violations,
            percentile(&waits, 0.50),
            percentile(&waits, 0.99),
            seen.elapsed
        );
    }
    println!(
        "\nIn hashed mode the entities that share the slow entity's shard wait behind it; in \
         per-key mode the slow entity holds one worker and nobody else waits for it."
    );
    if per_key.violations + hashed.violations != 0 {
        return Err("per-key order was violated".into());
    }
    Ok(())
}

async fn apply(mode: KeyedMode, seed: u64) -> Result<Seen, BoxError> {
    // Last applied version per entity, and the waits of the fast entities' updates.
    let versions: Arc<Mutex<BTreeMap<u64, u64>>> = Arc::default();
    let violations = Arc::new(Mutex::new(0u64));
    let waits: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let builder = KeyedPool::builder()
        .queue_size(UPDATES as usize)
        .key_of(|update: &(u64, u64, Instant)| update.0);
    let builder = match mode {
        KeyedMode::PerKey => builder.workers(WORKERS),
        KeyedMode::Hashed => builder.hashed_shards(WORKERS),
    };
    let pool = {
        let (versions, violations, waits) = (versions.clone(), violations.clone(), waits.clone());
        builder.build(move |_, (entity, version, sent): (u64, u64, Instant)| {
            let (versions, violations, waits) =
                (versions.clone(), violations.clone(), waits.clone());
            async move {
                if entity != SLOW
                    && let Ok(mut waits) = waits.lock()
                {
                    waits.push(sent.elapsed());
                }
                let cost = if entity == SLOW { 40 } else { 1 + version % 3 };
                sleep(Duration::from_millis(cost)).await;
                if let (Ok(mut versions), Ok(mut violations)) = (versions.lock(), violations.lock())
                {
                    let last = versions.entry(entity).or_insert(0);
                    if version != *last + 1 {
                        *violations += 1;
                    }
                    *last = version;
                }
                Ok::<_, BoxError>(())
            }
        })?
    };
    let mut rng = Rng::new(seed);
    let mut next_version = vec![0u64; ENTITIES as usize];
    let started = Instant::now();
    for i in 0..UPDATES {
        // The slow entity gets a steady share of the updates; the rest are spread at random.
        let entity = if i % 40 == 0 { SLOW } else { 1 + rng.below(ENTITIES - 1) };
        next_version[entity as usize] += 1;
        pool.submit_wait((entity, next_version[entity as usize], Instant::now())).await?;
        if i % 4 == 0 {
            sleep(Duration::from_millis(1)).await;
        }
    }
    pool.stop(Duration::from_secs(60)).await?;
    let elapsed = started.elapsed();
    let applied = pool.stats().completed;
    let violations = *violations.lock().map_err(|_| "poisoned")?;
    let fast_waits = waits.lock().map_err(|_| "poisoned")?.clone();
    Ok(Seen { applied, violations, fast_waits, elapsed })
}
