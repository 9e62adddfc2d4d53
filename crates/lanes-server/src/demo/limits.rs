//! The limits scenario: four tenants with skewed load share one downstream limit (10 at once,
//! 100 per second); each tenant's throughput, waits, and how fair the shares were.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lanes::{BoxError, LimitSpec, Limits, Priority, Registry};
use tokio::time::sleep;

use super::{DemoArgs, Rng, jain, percentile};

/// (tenant, share of the offered load).
const TENANTS: [(&str, u64); 4] = [("acme", 70), ("globex", 20), ("initech", 5), ("umbrella", 5)];
/// Requests per second offered by all tenants together: twice what the downstream allows.
const OFFERED_PER_SECOND: u64 = 200;
const LIMIT_PER_SECOND: f64 = 100.0;

#[derive(Default)]
struct Tally {
    offered: u64,
    served: u64,
    waits: Vec<Duration>,
}

pub(super) async fn run(args: &DemoArgs) -> Result<(), BoxError> {
    let registry = Registry::new();
    let limits = Limits::builder().registry(&registry, "demo").build()?;
    limits.define("downstream", LimitSpec::concurrent(10).per_second(LIMIT_PER_SECOND)).await?;
    let window = Duration::from_secs_f64(args.seconds.clamp(0.5, 60.0));
    println!(
        "limits: {} tenants offer {OFFERED_PER_SECOND} requests/s for {window:.1?} to a downstream \
         limited to 10 at once and {LIMIT_PER_SECOND}/s; acme sends 70% of them. Each tenant is a \
         fairness key of weight 1.\n",
        TENANTS.len()
    );
    let tally: Arc<Mutex<BTreeMap<&'static str, Tally>>> = Arc::new(Mutex::new(BTreeMap::new()));
    let mut rng = Rng::new(args.seed);
    let started = Instant::now();
    let mut requests = Vec::new();
    let gap = Duration::from_secs(1) / u32::try_from(OFFERED_PER_SECOND).unwrap_or(1);
    let mut next = started;
    while started.elapsed() < window {
        let pick = rng.below(100);
        let mut cumulative = 0;
        let tenant = TENANTS
            .iter()
            .find(|(_, share)| {
                cumulative += share;
                pick < cumulative
            })
            .map_or("acme", |(name, _)| *name);
        let work = Duration::from_millis(20 + rng.below(60));
        tally.lock().map_err(|_| "tally poisoned")?.entry(tenant).or_default().offered += 1;
        let (limits, tally) = (limits.clone(), tally.clone());
        requests.push(tokio::spawn(async move {
            let asked = Instant::now();
            let Ok(permit) = limits.acquire("downstream", Priority::default().key(tenant)).await
            else {
                return;
            };
            if let Ok(mut tally) = tally.lock() {
                let entry = tally.entry(tenant).or_default();
                entry.served += 1;
                entry.waits.push(asked.elapsed());
            }
            sleep(work).await; // the downstream call
            drop(permit);
        }));
        next += gap;
        tokio::time::sleep_until(next.into()).await;
    }
    // The window is over: requests still waiting give up (their tickets are withdrawn).
    for request in &requests {
        request.abort();
    }
    for request in requests {
        let _ = request.await;
    }
    let elapsed = started.elapsed();
    let info = limits.info("downstream").await?.ok_or("the limit vanished")?;

    let tally = tally.lock().map_err(|_| "tally poisoned")?;
    let seconds = elapsed.as_secs_f64();
    // The grants the limit made (its burst included), shared max-min fairly by demand.
    let fair = max_min_shares(&tally, info.granted_total as f64);
    println!(
        "{:<10} {:>8} {:>8} {:>9} {:>10} {:>10} {:>10}",
        "tenant", "offered", "served", "served/s", "fair share", "wait p50", "wait p99"
    );
    let mut normalized = Vec::new();
    for (name, _) in TENANTS {
        let Some(t) = tally.get(name) else { continue };
        let mut waits = t.waits.clone();
        waits.sort_unstable();
        let share = fair.get(name).copied().unwrap_or(0.0);
        if share > 0.0 {
            normalized.push(t.served as f64 / share);
        }
        println!(
            "{:<10} {:>8} {:>8} {:>9.1} {:>10.0} {:>10.1?} {:>10.1?}",
            name,
            t.offered,
            t.served,
            t.served as f64 / seconds,
            share,
            percentile(&waits, 0.50),
            percentile(&waits, 0.99),
        );
    }
    println!(
        "\nfairness (Jain's index of served / max-min fair share): {:.3}   permits granted: {}, \
         most held at once: {} of {}",
        jain(&normalized),
        info.granted_total,
        info.max_in_use,
        info.spec.concurrent
    );
    println!("snapshot: {}", registry.snapshot().to_json());
    Ok(())
}

/// Max-min fair shares of `capacity` grants: tenants asking less than an equal share get what
/// they ask, the rest is split equally among the others.
fn max_min_shares(
    tally: &BTreeMap<&'static str, Tally>,
    capacity: f64,
) -> BTreeMap<&'static str, f64> {
    let mut demands: Vec<(&'static str, f64)> =
        tally.iter().map(|(name, t)| (*name, t.offered as f64)).collect();
    demands.sort_by(|a, b| a.1.total_cmp(&b.1));
    let mut left = capacity;
    let mut shares = BTreeMap::new();
    let count = demands.len();
    for (i, (name, demand)) in demands.into_iter().enumerate() {
        let equal = left / (count - i) as f64;
        let share = demand.min(equal);
        shares.insert(name, share);
        left -= share;
    }
    shares
}
