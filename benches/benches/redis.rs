//! Suite 10: distributed limits on Redis. The floor is a `PING` round trip; `RedisLimits`'
//! acquire and release latency with 1, 8 and 64 concurrent clients; throughput against the
//! common sorted-set semaphore script (the distributed-lock / Redisson pattern) in the same
//! run, uncontended and contended; and the time a vanished holder's permit takes to reach a
//! waiter. Everything is written to `target/lanes-bench/redis.json` for the report.
//!
//! `LANES_REDIS_ONLY=throughput` runs the two throughput rows alone, `paired` runs them as
//! pairs of ours and the anchor's back to back in alternating order (`LANES_REDIS_PAIRS`,
//! default 9) and prints the median ratio with its quartiles, `handoff` times the contended
//! scenario's hand-offs (release to next grant), `leased` leased against exact.
//! `LANES_REDIS_SIDE=lanes` (or `anchor`) runs one side of the uncontended row alone, so that
//! the CPU time of the client process and of Redis can be split per cycle
//! (`benches/tools/redis_cpu_split.sh`).
//!
//! Needs Redis at `REDIS_URL` (default `redis://127.0.0.1:6379`); keys live under a namespace
//! of their own and are deleted afterwards.
#![allow(missing_docs)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lanes::{Answer, LimitBackend, LimitSpec, Limits, Priority};
use lanes_benches::{quick, write_result};
use lanes_redis::RedisLimits;
use serde_json::json;

/// The sorted-set semaphore: members are holders, scored by acquisition time; stale ones are
/// swept on every acquire (also counted by `benches/tools/redis_instructions.py`).
const SORTED_SET_ACQUIRE: &str = include_str!("sorted_set_acquire.lua");

/// The two throughput rows run on their own (`LANES_REDIS_ONLY=throughput` or `paired`): a
/// label, the clients, the limit and how long each permit is held.
const THROUGHPUT_ROWS: [(&str, usize, u32, Duration); 2] =
    [("uncontended", 8, 100_000, Duration::ZERO), ("contended", 16, 4, Duration::from_millis(2))];

fn url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

fn window() -> Duration {
    if quick() { Duration::from_secs(1) } else { Duration::from_secs(3) }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn summary(mut samples: Vec<f64>) -> serde_json::Value {
    samples.sort_by(f64::total_cmp);
    json!({ "n": samples.len(), "p50_us": percentile(&samples, 0.5), "p99_us": percentile(&samples, 0.99) })
}

async fn connection() -> redis::aio::MultiplexedConnection {
    redis::Client::open(url())
        .expect("a Redis URL")
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("Redis is not reachable at {} ({e})", url()))
}

async fn ping_rtt() -> serde_json::Value {
    let mut conn = connection().await;
    let mut samples = Vec::new();
    let end = Instant::now() + window();
    while Instant::now() < end {
        let start = Instant::now();
        let _: String = redis::cmd("PING").query_async(&mut conn).await.unwrap();
        samples.push(start.elapsed().as_secs_f64() * 1e6);
    }
    summary(samples)
}

/// Calls per command on the Redis at `url` (`INFO commandstats`), commands called by scripts
/// and functions included.
async fn commandstats(url: &str) -> std::collections::HashMap<String, u64> {
    let mut conn =
        redis::Client::open(url).unwrap().get_multiplexed_async_connection().await.unwrap();
    let info: String = redis::cmd("INFO").arg("commandstats").query_async(&mut conn).await.unwrap();
    info.lines()
        .filter_map(|line| {
            let (name, rest) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest.strip_prefix("calls=")?.split(',').next()?.parse().ok()?;
            Some((name.to_owned(), calls))
        })
        .collect()
}

/// The CPU time (user + system, seconds) the Redis at `url` has used so far.
async fn server_cpu(url: &str) -> f64 {
    let mut conn =
        redis::Client::open(url).unwrap().get_multiplexed_async_connection().await.unwrap();
    let info: String = redis::cmd("INFO").arg("cpu").query_async(&mut conn).await.unwrap();
    info.lines()
        .filter_map(|line| {
            let (name, value) = line.split_once(':')?;
            ["used_cpu_user", "used_cpu_sys"]
                .contains(&name)
                .then(|| value.trim().parse::<f64>().ok())?
        })
        .sum()
}

/// Redis commands per acquire + release: one client cycling on a roomy limit; every command
/// the server ran in the window (the function's own calls included, the FCALL itself apart),
/// per cycle.
async fn commands_per_cycle(ns: &str) -> serde_json::Value {
    let backend = RedisLimits::builder(url()).namespace(ns).build().await.unwrap();
    backend.define("commands", LimitSpec::concurrent(100_000)).await.unwrap();
    let before = commandstats(&url()).await;
    let cycles = 2_000u64;
    for _ in 0..cycles {
        let ticket = backend.ticket();
        backend.acquire("commands", ticket, &Priority::default(), None).await.unwrap();
        backend.release("commands", ticket).await.unwrap();
    }
    let after = commandstats(&url()).await;
    let diff = |name: &str| after.get(name).unwrap_or(&0) - before.get(name).unwrap_or(&0);
    let total: u64 = after
        .keys()
        .filter(|name| !["info", "fcall"].contains(&name.as_str()))
        .map(|name| diff(name))
        .sum();
    json!({ "cycles": cycles, "fcalls_per_cycle": diff("fcall") as f64 / cycles as f64, "commands_per_cycle": total as f64 / cycles as f64 })
}

/// `clients` clients, each its own `RedisLimits` and its own limit, cycling acquire + release:
/// what a Redis (or a cluster, whose primaries each serve some of the limits) sustains when
/// the load is spread over many limits.
async fn spread(builder: impl Fn() -> lanes_redis::RedisLimitsBuilder, clients: usize) -> f64 {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for client in 0..clients {
        let backend = builder().build().await.unwrap();
        let name = format!("spread-{client}");
        backend.define(&name, LimitSpec::concurrent(100_000)).await.unwrap();
        let (stop, done) = (stop.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let priority = Priority::default();
            while !stop.load(Ordering::Relaxed) {
                let ticket = backend.ticket();
                backend.acquire(&name, ticket, &priority, None).await.unwrap();
                backend.release(&name, ticket).await.unwrap();
                done.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    per_second_over_window(tasks, &stop, &done).await
}

/// Lets `tasks` run for `window()`, stops them (through `stop`), and returns the count they
/// kept in `done` per second of that time.
async fn per_second_over_window(
    tasks: Vec<tokio::task::JoinHandle<()>>,
    stop: &AtomicBool,
    done: &AtomicU64,
) -> f64 {
    let start = Instant::now();
    tokio::time::sleep(window()).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

/// The local cluster's nodes (`REDIS_CLUSTER_URLS`, default ports 7000-7005), if it answers.
async fn cluster_urls() -> Option<Vec<String>> {
    let urls: Vec<String> = match std::env::var("REDIS_CLUSTER_URLS") {
        Ok(urls) => urls.split(',').map(|u| u.trim().to_owned()).collect(),
        Err(_) => (7000..7006).map(|port| format!("redis://127.0.0.1:{port}")).collect(),
    };
    let client = redis::Client::open(urls[0].as_str()).ok()?;
    let mut conn = client.get_multiplexed_async_connection().await.ok()?;
    let info: String = redis::cmd("CLUSTER").arg("INFO").query_async(&mut conn).await.ok()?;
    info.contains("cluster_state:ok").then_some(urls)
}

/// `clients` clients, each its own `RedisLimits`, acquiring and releasing a roomy limit.
async fn lanes_latency(ns: &str, clients: usize) -> serde_json::Value {
    let setup = RedisLimits::builder(url()).namespace(ns).build().await.unwrap();
    let name = format!("latency-{clients}");
    setup.define(&name, LimitSpec::concurrent(100_000)).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let backend = RedisLimits::builder(url()).namespace(ns).build().await.unwrap();
        let (name, stop) = (name.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let (mut acquires, mut releases) = (Vec::new(), Vec::new());
            let priority = Priority::default();
            while !stop.load(Ordering::Relaxed) {
                let ticket = backend.ticket();
                let start = Instant::now();
                let answer = backend.acquire(&name, ticket, &priority, None).await.unwrap();
                assert!(matches!(answer, Answer::Granted(_)), "{answer:?}");
                let acquired = Instant::now();
                backend.release(&name, ticket).await.unwrap();
                acquires.push((acquired - start).as_secs_f64() * 1e6);
                releases.push(acquired.elapsed().as_secs_f64() * 1e6);
            }
            (acquires, releases)
        }));
    }
    let start = Instant::now();
    tokio::time::sleep(window()).await;
    stop.store(true, Ordering::Relaxed);
    let (mut acquires, mut releases) = (Vec::new(), Vec::new());
    for task in tasks {
        let (a, r) = task.await.unwrap();
        acquires.extend(a);
        releases.extend(r);
    }
    let elapsed = start.elapsed().as_secs_f64();
    let per_second = acquires.len() as f64 / elapsed;
    json!({ "clients": clients, "acquire": summary(acquires), "release": summary(releases), "cycles_per_s": per_second })
}

/// Grants and releases of a throughput run, timed: how long a permit takes to go from one
/// holder to the next (`LANES_REDIS_ONLY=handoff`).
#[derive(Default)]
struct Handoffs(std::sync::Mutex<Vec<(Instant, bool)>>);

impl Handoffs {
    /// A holder was granted (`true`) or is about to release (`false`).
    fn note(handoffs: Option<&Self>, granted: bool) {
        if let Some(handoffs) = handoffs {
            handoffs.0.lock().unwrap().push((Instant::now(), granted));
        }
    }

    /// The time from a release to the grant after it (each grant paired with the latest
    /// release not yet paired before it), in ms: p50 and p90.
    fn gaps(&self) -> (f64, f64) {
        let mut events = self.0.lock().unwrap().clone();
        events.sort_by_key(|&(at, _)| at);
        let (mut released, mut gaps) = (Vec::new(), Vec::new());
        for (at, granted) in events {
            if !granted {
                released.push(at);
            } else if let Some(release) = released.pop() {
                gaps.push((at - release).as_secs_f64() * 1e3);
            }
        }
        gaps.sort_by(f64::total_cmp);
        (percentile(&gaps, 0.5), percentile(&gaps, 0.9))
    }
}

/// The anchor: `clients` connections running the sorted-set script, polling every `poll`
/// while the set is full, for `window()`; holds each permit for `hold`. With `shared`, the
/// clients are tasks of one process sharing one multiplexed connection.
async fn sorted_set_throughput(
    ns: &str,
    clients: usize,
    limit: u32,
    hold: Duration,
    shared: bool,
    handoffs: Option<Arc<Handoffs>>,
) -> f64 {
    let key = format!("{{{ns}}}:sorted-set-{clients}-{limit}");
    let script = redis::Script::new(SORTED_SET_ACQUIRE);
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    let one = connection().await;
    for c in 0..clients {
        let (key, script, stop, done) = (key.clone(), script.clone(), stop.clone(), done.clone());
        let handoffs = handoffs.clone();
        let mut conn = if shared { one.clone() } else { connection().await };
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let id = format!("{c}-{n}");
                n += 1;
                loop {
                    let got: i64 = script
                        .key(&key)
                        .arg(limit)
                        .arg(&id)
                        .arg(30_000)
                        .invoke_async(&mut conn)
                        .await
                        .unwrap();
                    if got == 1 || stop.load(Ordering::Relaxed) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Handoffs::note(handoffs.as_deref(), true);
                if !hold.is_zero() {
                    tokio::time::sleep(hold).await;
                }
                Handoffs::note(handoffs.as_deref(), false);
                let _: i64 =
                    redis::cmd("ZREM").arg(&key).arg(&id).query_async(&mut conn).await.unwrap();
                done.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    per_second_over_window(tasks, &stop, &done).await
}

/// The scenario's ceiling: the same clients, limit and hold on an in-process
/// `tokio::sync::Semaphore` (no Redis, no round trip), for `window()`. With a hold, the
/// holds and the timer's granularity bound what any shared limit can reach.
async fn in_process_ceiling(clients: usize, limit: u32, hold: Duration) -> f64 {
    let semaphore = Arc::new(tokio::sync::Semaphore::new(limit as usize));
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let (semaphore, stop, done) = (semaphore.clone(), stop.clone(), done.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let permit = semaphore.acquire().await.expect("open");
                    if !hold.is_zero() {
                        tokio::time::sleep(hold).await;
                    }
                    drop(permit);
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    per_second_over_window(tasks, &stop, &done).await
}

/// `RedisLimits` through the `Limits` facade, same shape as the anchor. With `shared`, the
/// clients are tasks of one process sharing one `RedisLimits` (one connection).
async fn lanes_throughput(
    ns: &str,
    clients: usize,
    limit: u32,
    hold: Duration,
    shared: bool,
    handoffs: Option<Arc<Handoffs>>,
) -> f64 {
    let name = format!("throughput-{clients}-{limit}");
    let setup =
        Limits::with_backend(RedisLimits::builder(url()).namespace(ns).build().await.unwrap());
    setup.define(&name, LimitSpec::concurrent(limit)).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let limits = if shared {
            setup.clone()
        } else {
            Limits::with_backend(RedisLimits::builder(url()).namespace(ns).build().await.unwrap())
        };
        let (name, stop, done) = (name.clone(), stop.clone(), done.clone());
        let handoffs = handoffs.clone();
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let acquired = limits
                    .acquire_timeout(&name, Priority::default(), Duration::from_secs(2))
                    .await;
                if let Ok(permit) = acquired {
                    Handoffs::note(handoffs.as_deref(), true);
                    if !hold.is_zero() {
                        tokio::time::sleep(hold).await;
                    }
                    Handoffs::note(handoffs.as_deref(), false);
                    drop(permit);
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    per_second_over_window(tasks, &stop, &done).await
}

/// Leased capacity against exact mode on the same Redis: one client (one instance) with
/// `tasks` tasks acquiring and releasing a roomy limit, as fast as they can, for `window()`.
/// Returns (acquires per second, Redis calls per second) for each mode.
async fn leased_vs_exact(ns: &str, tasks: usize) -> serde_json::Value {
    use lanes::limit::share::SharePolicy;
    let mut rows = Vec::new();
    for leased in [false, true] {
        let backend = RedisLimits::builder(url()).namespace(ns).build().await.unwrap();
        let name = if leased { "mode-leased" } else { "mode-exact" };
        let spec = LimitSpec::concurrent(1_000);
        if leased {
            backend.define_leased(name, spec, SharePolicy::MaxMinFair).await.unwrap();
        } else {
            backend.define(name, spec).await.unwrap();
        }
        let limits = Limits::with_backend(backend.clone());
        // Let a leased client's first refreshes give it its share.
        drop(limits.acquire(name, Priority::default()).await.unwrap());
        tokio::time::sleep(Duration::from_millis(300)).await;
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicU64::new(0));
        let calls_before = backend.stats().calls;
        let start = Instant::now();
        let mut handles = Vec::new();
        for _ in 0..tasks {
            let (limits, stop, done) = (limits.clone(), stop.clone(), done.clone());
            handles.push(tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let permit = limits.acquire(name, Priority::default()).await.unwrap();
                    drop(permit);
                    n += 1;
                    // A leased acquire never waits: let the timers and the other tasks run.
                    if n.is_multiple_of(64) {
                        tokio::task::yield_now().await;
                    }
                }
                done.fetch_add(n, Ordering::Relaxed);
            }));
        }
        tokio::time::sleep(window()).await;
        stop.store(true, Ordering::Relaxed);
        for handle in handles {
            handle.await.unwrap();
        }
        let elapsed = start.elapsed().as_secs_f64();
        let calls = (backend.stats().calls - calls_before) as f64 / elapsed;
        rows.push(json!({ "mode": if leased { "leased" } else { "exact" }, "acquires_per_s": done.load(Ordering::Relaxed) as f64 / elapsed, "calls_per_s": calls }));
    }
    json!({ "tasks": tasks, "rows": rows })
}

/// A holder that vanishes (no release, no more renewals): how long after its last renewal's
/// lease ends does a waiter get the permit.
async fn reclaim(ns: &str, lease: Duration) -> serde_json::Value {
    let name = "reclaim";
    let waiter =
        Limits::with_backend(RedisLimits::builder(url()).namespace(ns).build().await.unwrap());
    waiter.define(name, LimitSpec::concurrent(1)).await.unwrap();
    let mut after_lease = Vec::new();
    for _ in 0..if quick() { 3 } else { 10 } {
        let holder = RedisLimits::builder(url())
            .namespace(ns)
            .lease(lease)
            .auto_renew(false)
            .build()
            .await
            .unwrap();
        let ticket = holder.ticket();
        assert!(matches!(
            holder.acquire(name, ticket, &Priority::default(), None).await,
            Ok(Answer::Granted(_))
        ));
        let granted_at = Instant::now();
        drop(holder);
        let permit = waiter.acquire(name, Priority::default()).await.unwrap();
        let took = granted_at.elapsed();
        after_lease.push((took.as_secs_f64() - lease.as_secs_f64()) * 1e3);
        drop(permit);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    after_lease.sort_by(f64::total_cmp);
    json!({ "lease_ms": lease.as_millis() as u64, "after_lease_ms_max": after_lease.last(), "after_lease_ms_p50": percentile(&after_lease, 0.5) })
}

async fn cleanup(ns: &str) {
    cleanup_at(&url(), ns).await;
}

/// Deletes `ns`'s keys on the Redis at `url` (one key per DEL: on a cluster node they may be
/// in different slots; a replica refuses, its primary deletes).
async fn cleanup_at(url: &str, ns: &str) {
    let Ok(client) = redis::Client::open(url) else { return };
    let Ok(mut conn) = client.get_multiplexed_async_connection().await else { return };
    for pattern in [format!("{{{ns}:*"), format!("{{{ns}}}:*"), format!("lanes:{{{ns}}}:*")] {
        let keys: Vec<String> =
            redis::cmd("KEYS").arg(&pattern).query_async(&mut conn).await.unwrap_or_default();
        for key in keys {
            let _: Result<(), _> = redis::cmd("DEL").arg(key).query_async(&mut conn).await;
        }
    }
}

fn main() {
    // `cargo bench` passes `--bench`; a name filter that excludes this suite skips it.
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    if !args.is_empty() && !args.iter().any(|a| "redis".contains(a.as_str()) || a.contains("redis"))
    {
        return;
    }
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let ns = format!("bench-{}", std::process::id());
        // LANES_REDIS_ONLY=leased measures leased against exact alone (while working on it).
        if std::env::var("LANES_REDIS_ONLY").as_deref() == Ok("leased") {
            println!("redis/leased: {}", leased_vs_exact(&ns, 8).await);
            cleanup(&ns).await;
            return;
        }
        // LANES_REDIS_SIDE=lanes|anchor runs one side of the uncontended row alone.
        if let Ok(which) = std::env::var("LANES_REDIS_SIDE") {
            let rate = if which == "lanes" {
                lanes_throughput(&ns, 8, 100_000, Duration::ZERO, false, None).await
            } else {
                sorted_set_throughput(&ns, 8, 100_000, Duration::ZERO, false, None).await
            };
            println!("side {which}: {rate:.0}/s");
            cleanup(&ns).await;
            return;
        }
        // LANES_REDIS_ONLY=throughput measures the two throughput rows alone (while working on
        // the script).
        if std::env::var("LANES_REDIS_ONLY").as_deref() == Ok("throughput") {
            for (label, clients, limit, hold) in THROUGHPUT_ROWS {
                let lanes = lanes_throughput(&ns, clients, limit, hold, false, None).await;
                let anchor = sorted_set_throughput(&ns, clients, limit, hold, false, None).await;
                let ceiling = in_process_ceiling(clients, limit, hold).await;
                println!("redis/throughput/{label}: lanes {lanes:.0}/s, sorted set {anchor:.0}/s, {:.2}x; in-process ceiling {ceiling:.0}/s", lanes / anchor);
            }
            cleanup(&ns).await;
            return;
        }
        // LANES_REDIS_ONLY=paired measures the two throughput rows in pairs, ours and the
        // anchor's back to back in alternating order (`LANES_REDIS_PAIRS` of them, 9 unless
        // set): the ratio is taken within each pair, so drift of the host between pairs
        // cancels, and the median of the pairs is the figure, with its quartiles as the spread.
        if std::env::var("LANES_REDIS_ONLY").as_deref() == Ok("paired") {
            let pairs: usize =
                std::env::var("LANES_REDIS_PAIRS").ok().and_then(|p| p.parse().ok()).unwrap_or(9);
            for (label, clients, limit, hold) in THROUGHPUT_ROWS {
                let mut ratios = Vec::new();
                for pair in 0..pairs {
                    let (lanes, anchor) = if pair % 2 == 0 {
                        let lanes = lanes_throughput(&ns, clients, limit, hold, false, None).await;
                        (lanes, sorted_set_throughput(&ns, clients, limit, hold, false, None).await)
                    } else {
                        let anchor =
                            sorted_set_throughput(&ns, clients, limit, hold, false, None).await;
                        (lanes_throughput(&ns, clients, limit, hold, false, None).await, anchor)
                    };
                    ratios.push(lanes / anchor);
                }
                ratios.sort_by(f64::total_cmp);
                println!(
                    "redis/paired/{label}: lanes / sorted set = {:.2}x (quartiles {:.2}-{:.2}, {pairs} pairs)",
                    percentile(&ratios, 0.5),
                    percentile(&ratios, 0.25),
                    percentile(&ratios, 0.75)
                );
            }
            cleanup(&ns).await;
            return;
        }
        // LANES_REDIS_ONLY=handoff times the contended scenario's hand-offs, ours and the
        // anchor's: from one holder's release to the next grant.
        if std::env::var("LANES_REDIS_ONLY").as_deref() == Ok("handoff") {
            let hold = Duration::from_millis(2);
            let ours = Arc::new(Handoffs::default());
            let lanes = lanes_throughput(&ns, 16, 4, hold, false, Some(ours.clone())).await;
            let theirs = Arc::new(Handoffs::default());
            let anchor = sorted_set_throughput(&ns, 16, 4, hold, false, Some(theirs.clone())).await;
            let ((p50, p90), (a50, a90)) = (ours.gaps(), theirs.gaps());
            println!("redis/handoff: lanes {lanes:.0}/s, release -> next grant p50 {p50:.2} ms, p90 {p90:.2} ms; sorted set {anchor:.0}/s, p50 {a50:.2} ms, p90 {a90:.2} ms");
            cleanup(&ns).await;
            return;
        }
        let ping = ping_rtt().await;
        println!("redis/ping: {ping}");
        let mut latency = Vec::new();
        for clients in [1, 8, 64] {
            let result = lanes_latency(&ns, clients).await;
            println!("redis/latency/{clients}: {result}");
            latency.push(result);
        }
        let mut throughput = Vec::new();
        for (label, clients, limit, hold, shared) in [
            ("uncontended", 8usize, 100_000u32, Duration::ZERO, false),
            ("contended", 16, 4, Duration::from_millis(2), false),
            ("uncontended, one process", 8, 100_000, Duration::ZERO, true),
            ("contended, one process", 16, 4, Duration::from_millis(2), true),
        ] {
            let lanes = lanes_throughput(&ns, clients, limit, hold, shared, None).await;
            let anchor = sorted_set_throughput(&ns, clients, limit, hold, shared, None).await;
            let ceiling = in_process_ceiling(clients, limit, hold).await;
            let row = json!({ "scenario": label, "clients": clients, "limit": limit, "hold_ms": hold.as_millis() as u64, "shared": shared, "lanes_per_s": lanes, "sorted_set_per_s": anchor, "ceiling_per_s": ceiling });
            println!("redis/throughput/{label}: {row}");
            throughput.push(row);
        }
        let reclaim = reclaim(&ns, Duration::from_millis(500)).await;
        println!("redis/reclaim: {reclaim}");
        let commands = commands_per_cycle(&ns).await;
        println!("redis/commands: {commands}");
        // The same load spread over 8 limits: on the one Redis, and on the cluster.
        let cpu_before = server_cpu(&url()).await;
        let spread_start = Instant::now();
        let single = spread(|| RedisLimits::builder(url()).namespace(&ns), 8).await;
        // Server CPU per cycle under that load, networking included: what one primary's core
        // costs per acquire + release, the basis of docs/scale.md's extrapolation.
        let cpu = server_cpu(&url()).await - cpu_before;
        let cycles = single * spread_start.elapsed().as_secs_f64();
        let server_us_per_cycle = cpu / cycles * 1e6;
        let cluster = match cluster_urls().await {
            Some(urls) => {
                let cluster_ns = format!("{ns}-cluster");
                let builder = || RedisLimits::cluster_builder(urls.clone()).namespace(&cluster_ns);
                let cycles = spread(builder, 8).await;
                let latency = {
                    let backend = builder().build().await.unwrap();
                    backend.define("latency", LimitSpec::concurrent(100_000)).await.unwrap();
                    let mut samples = Vec::new();
                    let end = Instant::now() + window();
                    while Instant::now() < end {
                        let ticket = backend.ticket();
                        let start = Instant::now();
                        backend.acquire("latency", ticket, &Priority::default(), None).await.unwrap();
                        samples.push(start.elapsed().as_secs_f64() * 1e6);
                        backend.release("latency", ticket).await.unwrap();
                    }
                    summary(samples)
                };
                for url in &urls {
                    cleanup_at(url, &cluster_ns).await;
                }
                json!({ "nodes": urls.len(), "spread_cycles_per_s": cycles, "acquire": latency })
            }
            None => serde_json::Value::Null,
        };
        let spread = json!({ "clients": 8, "single_cycles_per_s": single, "server_cpu_us_per_cycle": server_us_per_cycle, "cluster": cluster });
        let leased = leased_vs_exact(&ns, 8).await;
        println!("redis/leased: {leased}");
        println!("redis/spread: {spread}");
        cleanup(&ns).await;
        write_result(
            "redis",
            &json!({ "ping": ping, "latency": latency, "throughput": throughput, "reclaim": reclaim, "commands": commands, "spread": spread, "leased": leased }),
        );
    });
}
