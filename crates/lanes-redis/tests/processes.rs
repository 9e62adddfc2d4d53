//! RedisLimits across OS processes, on a real Redis and on a real Redis Cluster: this test
//! binary re-spawns itself as children that hammer one limit or hold a permit until they are
//! killed.
//!
//! - Several processes hammering one limit never hold more than `concurrent` permits at once,
//!   by the server's high-water mark and by the holders' own count; fencing tokens are unique
//!   and grow within each process.
//! - A holder killed with SIGKILL loses its permit to a waiter within `lease + 100 ms`.
//! - Leased: four processes hammering never exceed `concurrent` and keep at least 85% of it
//!   busy; a killed process's share is reused
//!   within a lease and a refresh; four processes hammering a leased *rate* grant within ±5%
//!   of the rate over every 10 s window.
//!
//! A plain `main` (harness = false): a child is this binary with `LANES_REDIS_CHILD` set.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::Target;
use lanes::{LimitSpec, Limits, Priority};
use tokio::time::{Instant, sleep, timeout};

const CONCURRENT: u32 = 3;
const CHILDREN: usize = 4;
const ITERATIONS: usize = 60;

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    match std::env::var("LANES_REDIS_CHILD").as_deref() {
        Ok("hammer") => runtime.block_on(hammer()),
        Ok("hold") => runtime.block_on(hold()),
        Ok("hold-leased") => runtime.block_on(hold_leased()),
        Ok("rate-hammer") => runtime.block_on(rate_hammer()),
        Ok("leased-hammer") => runtime.block_on(leased_hammer()),
        Ok(other) => panic!("unknown child mode {other}"),
        Err(_) => {
            for target in [Target::Single, Target::Cluster] {
                println!("test processes_never_exceed_the_limit on {target:?} ...");
                runtime.block_on(processes_never_exceed_the_limit(target));
                println!("test processes_never_exceed_the_limit on {target:?} ... ok");
                println!("test a_killed_holder_is_reclaimed_within_its_lease on {target:?} ...");
                runtime.block_on(a_killed_holder_is_reclaimed(target));
                println!("test a_killed_holder_is_reclaimed_within_its_lease on {target:?} ... ok");
            }
            println!("test processes_never_exceed_a_leased_limit ...");
            runtime.block_on(processes_never_exceed_a_leased_limit());
            println!("test processes_never_exceed_a_leased_limit ... ok");
            println!("test a_killed_processes_share_is_reused_within_a_lease_and_a_refresh ...");
            runtime.block_on(a_killed_processes_share_is_reused());
            println!("test a_killed_processes_share_is_reused_within_a_lease_and_a_refresh ... ok");
            println!("test processes_hammering_a_leased_rate_grant_it_within_5_percent ...");
            runtime.block_on(processes_hammering_a_leased_rate_grant_it_within_5_percent());
            println!("test processes_hammering_a_leased_rate_grant_it_within_5_percent ... ok");
        }
    }
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is set for children"))
}

fn child(mode: &str, ns: &str, lease_ms: u64, target: Target) -> Command {
    let mut command = Command::new(std::env::current_exe().expect("this binary"));
    let target = if target == Target::Cluster { "cluster" } else { "single" };
    command
        .env("LANES_REDIS_CHILD", mode)
        .env("LANES_TARGET", target)
        .env("LANES_NS", ns)
        .env("LANES_LEASE_MS", lease_ms.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    command
}

async fn child_limits() -> (Limits, redis::aio::MultiplexedConnection, String) {
    let ns = env("LANES_NS");
    let lease = Duration::from_millis(env("LANES_LEASE_MS").parse().unwrap());
    let target = match env("LANES_TARGET").as_str() {
        "cluster" => Target::Cluster,
        _ => Target::Single,
    };
    let backend = common::builder_on(target, &ns).lease(lease).build().await.expect("redis");
    let conn = redis::Client::open(common::redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    (Limits::with_backend(backend), conn, format!("{{{ns}}}:holders"))
}

/// Child: acquire, count ourselves in, hold briefly, count out, release; report.
async fn hammer() {
    let (limits, mut conn, holders) = child_limits().await;
    let mut most = 0i64;
    let mut tokens = Vec::new();
    for i in 0..ITERATIONS {
        let permit = limits.acquire("shared", Priority::default()).await.expect("acquire");
        let now: i64 = redis::cmd("INCR").arg(&holders).query_async(&mut conn).await.unwrap();
        most = most.max(now);
        tokens.push(permit.fencing_token());
        sleep(Duration::from_millis(1 + (i % 3) as u64)).await;
        let _: i64 = redis::cmd("DECR").arg(&holders).query_async(&mut conn).await.unwrap();
        drop(permit);
    }
    let tokens: Vec<String> = tokens.iter().map(u64::to_string).collect();
    println!("MOST {most} TOKENS {}", tokens.join(","));
}

/// Microseconds since the Unix epoch: one clock for every process of the test.
fn epoch_us() -> u64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    since.as_micros() as u64
}

/// Child: eight tasks acquire the leased rate limit `rated` back to back until
/// `LANES_UNTIL_US` (epoch µs); reports the moment of every grant.
async fn rate_hammer() {
    let (limits, _conn, _) = child_limits().await;
    let until: u64 = env("LANES_UNTIL_US").parse().unwrap();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let limits = limits.clone();
        tasks.push(tokio::spawn(async move {
            let mut at = Vec::new();
            while epoch_us() < until {
                let permit = limits.acquire("rated", Priority::default()).await.expect("acquire");
                at.push(epoch_us());
                drop(permit);
            }
            at
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.unwrap());
    }
    let all: Vec<String> = all.iter().map(u64::to_string).collect();
    println!("GRANTS {}", all.join(","));
}

/// Child: six tasks hammer the leased limit `shared` until `LANES_UNTIL_US` (epoch µs), each
/// counting itself in and out of a counter in Redis around a 1–3 ms hold; reports the most
/// holders it counted, its fencing tokens (each task checks that its own grow), and every
/// hold as `start-end` (µs).
async fn leased_hammer() {
    let (limits, conn, holders) = child_limits().await;
    let until: u64 = env("LANES_UNTIL_US").parse().unwrap();
    let mut tasks = Vec::new();
    for t in 0..6u64 {
        let (limits, mut conn, holders) = (limits.clone(), conn.clone(), holders.clone());
        tasks.push(tokio::spawn(async move {
            let (mut most, mut held) = (0i64, Vec::new());
            let mut n = t;
            while epoch_us() < until {
                let permit = limits.acquire("shared", Priority::default()).await.expect("acquire");
                let start = epoch_us();
                let now: i64 =
                    redis::cmd("INCR").arg(&holders).query_async(&mut conn).await.unwrap();
                most = most.max(now);
                n += 1;
                sleep(Duration::from_millis(1 + n % 3)).await;
                let _: i64 = redis::cmd("DECR").arg(&holders).query_async(&mut conn).await.unwrap();
                let token = permit.fencing_token();
                assert!(
                    held.last().is_none_or(|last: &(u64, u64, u64)| last.0 < token),
                    "tokens grow"
                );
                held.push((token, start, epoch_us()));
                drop(permit);
            }
            (most, held)
        }));
    }
    let (mut most, mut held) = (0, Vec::new());
    for task in tasks {
        let (m, h) = task.await.unwrap();
        most = most.max(m);
        held.extend(h);
    }
    let tokens: Vec<String> = held.iter().map(|(token, _, _)| token.to_string()).collect();
    let spans: Vec<String> = held.iter().map(|(_, s, e)| format!("{s}-{e}")).collect();
    println!("MOST {most}");
    println!("TOKENS {}", tokens.join(","));
    println!("SPANS {}", spans.join(","));
}

/// Four processes hammer a leased rate of 200 a second (each process's share set by Redis
/// from the rates its acquires arrive at): from two seconds in (the shares settle), every
/// 10 s window, taken every 250 ms, sees 2,000 grants ±5% across the processes.
async fn processes_hammering_a_leased_rate_grant_it_within_5_percent() {
    use lanes::limit::share::SharePolicy;
    const RATE: f64 = 200.0;
    let ns = common::unique_ns("procs-rate");
    let _cleanup = common::Cleanup::on(Target::Single, &ns);
    let lease = Duration::from_millis(1500);
    let backend = common::builder(&ns).lease(lease).build().await.expect("redis");
    backend
        .define_leased("rated", LimitSpec::rate(RATE).burst(4), SharePolicy::MaxMinFair)
        .await
        .unwrap();
    let start = epoch_us();
    let until = start + 13_000_000;
    let children: Vec<_> = (0..CHILDREN)
        .map(|_| {
            let mut command = child("rate-hammer", &ns, lease.as_millis() as u64, Target::Single);
            command.env("LANES_UNTIL_US", until.to_string()).spawn().expect("spawn")
        })
        .collect();
    let mut grants = Vec::new();
    let mut per_child = Vec::new();
    for child in children {
        let stdout = child_output(child).await;
        let at: Vec<u64> =
            report(&stdout, "GRANTS ").split(',').filter_map(|t| t.parse().ok()).collect();
        per_child.push(at.len());
        grants.extend(at);
    }
    grants.sort_unstable();
    let window = 10_000_000u64;
    let want = RATE * 10.0;
    let mut from = start + 2_000_000;
    let (mut least, mut most) = (f64::MAX, 0f64);
    while from + window <= until {
        let n = grants.iter().filter(|&&at| at >= from && at < from + window).count() as f64;
        (least, most) = (least.min(n), most.max(n));
        assert!(
            (n - want).abs() <= want * 0.05,
            "{n} grants in the 10 s from {:.2} s, want {want} ±5% (per process: {per_child:?})",
            (from - start) as f64 / 1e6
        );
        from += 250_000;
    }
    println!("  10 s windows: {least} to {most} grants (want {want}); per process {per_child:?}");
    // Every process had a part: the rate was shared, not taken by one.
    assert!(per_child.iter().all(|&n| n as f64 > want / 8.0), "per process: {per_child:?}");
}

/// Child: take the permit, say so, and hold it until killed.
async fn hold() {
    let (limits, _conn, _) = child_limits().await;
    let permit = limits.acquire("held", Priority::default()).await.expect("acquire");
    println!("HELD {}", permit.fencing_token());
    sleep(Duration::from_secs(3600)).await;
}

/// Child: takes both permits of the leased limit `leased` from its share, says so, and holds
/// them until killed.
async fn hold_leased() {
    let (limits, _conn, _) = child_limits().await;
    let first = limits.acquire("leased", Priority::default()).await.expect("acquire");
    let second = limits.acquire("leased", Priority::default()).await.expect("acquire");
    println!("HELD {} {}", first.fencing_token(), second.fencing_token());
    sleep(Duration::from_secs(3600)).await;
}

/// A process holding a leased limit's whole capacity is killed with SIGKILL: a waiter in
/// another process gets a permit once the dead share's lease ends and its own share is
/// refreshed (a starved client refreshes every tenth of a lease), and its token is new.
async fn a_killed_processes_share_is_reused() {
    use lanes::limit::share::SharePolicy;
    let ns = common::unique_ns("leased-kill");
    let _cleanup = common::Cleanup::on(Target::Single, &ns);
    let lease = Duration::from_millis(500);
    let backend = common::builder(&ns).lease(lease).build().await.expect("redis");
    backend
        .define_leased("leased", LimitSpec::concurrent(2), SharePolicy::MaxMinFair)
        .await
        .unwrap();
    let limits = Limits::with_backend(backend);
    let mut holder =
        child("hold-leased", &ns, lease.as_millis() as u64, Target::Single).spawn().expect("spawn");
    let child_tokens = held_tokens(&mut holder).await;
    assert_eq!(child_tokens.len(), 2, "the child holds both");
    let (took, token) = granted_after_kill(&limits, "leased", holder, lease).await;
    assert!(took <= lease + lease / 3 + Duration::from_millis(200), "reused after {took:?}");
    assert!(!child_tokens.contains(&token), "a token of its own: {token} vs {child_tokens:?}");
}

/// Waits for the hammer children and checks their reports: none counted more than
/// `CONCURRENT` holders at once, each made `ITERATIONS` grants with growing tokens, and no token
/// was handed out twice across them. Returns the most holders any of them counted.
fn hammer_reports(children: Vec<std::process::Child>) -> i64 {
    let (mut all_tokens, mut most_seen) = (Vec::new(), 0);
    for child in children {
        let out = child.wait_with_output().expect("the child finishes");
        assert!(out.status.success(), "a child failed: {:?}", out.status);
        let stdout = String::from_utf8(out.stdout).unwrap();
        let line = stdout.lines().find(|l| l.starts_with("MOST ")).expect("a report");
        let mut parts = line.split_whitespace();
        let most: i64 = parts.nth(1).unwrap().parse().unwrap();
        assert!(most <= i64::from(CONCURRENT), "holders counted {most} at once");
        most_seen = most_seen.max(most);
        let tokens: Vec<u64> =
            parts.nth(1).unwrap().split(',').map(|t| t.parse().unwrap()).collect();
        assert_eq!(tokens.len(), ITERATIONS);
        assert!(tokens.windows(2).all(|w| w[0] < w[1]), "tokens grow within a process");
        all_tokens.extend(tokens);
    }
    let total = all_tokens.len();
    all_tokens.sort_unstable();
    all_tokens.dedup();
    assert_eq!(all_tokens.len(), total, "no fencing token was handed out twice");
    most_seen
}

/// Waits for `child` (off the runtime's threads) and returns its stdout; it must succeed.
async fn child_output(child: std::process::Child) -> String {
    let out = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .expect("the child finishes");
    assert!(out.status.success(), "a child failed: {:?}", out.status);
    String::from_utf8(out.stdout).unwrap()
}

/// The rest of the report line of `stdout` that starts with `tag`.
fn report<'a>(stdout: &'a str, tag: &str) -> &'a str {
    let line = stdout.lines().find(|l| l.starts_with(tag)).expect("a report");
    &line[tag.len()..]
}

/// The holder child's `HELD` line: the fencing tokens it holds.
async fn held_tokens(holder: &mut std::process::Child) -> Vec<u64> {
    let stdout = holder.stdout.take().unwrap();
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).unwrap();
        line
    })
    .await
    .unwrap();
    let tokens = line.strip_prefix("HELD ").expect("the child holds").split_whitespace();
    tokens.map(|t| t.parse().unwrap()).collect()
}

/// A waiter on `limit` must not be granted while the holder lives (two leases), and is once
/// the holder is killed with SIGKILL. Returns how long after the kill, and its token.
async fn granted_after_kill(
    limits: &Limits,
    limit: &'static str,
    mut holder: std::process::Child,
    lease: Duration,
) -> (Duration, u64) {
    let waiter = tokio::spawn({
        let limits = limits.clone();
        async move {
            let permit = limits.acquire(limit, Priority::default()).await.unwrap();
            (Instant::now(), permit.fencing_token())
        }
    });
    // Longer than a lease: the child renews, so nobody gets the permit meanwhile.
    sleep(lease * 2).await;
    assert!(!waiter.is_finished(), "the live holder keeps its permit by renewing it");
    let killed = Instant::now();
    holder.kill().expect("SIGKILL the holder");
    let _ = holder.wait();
    let (granted, token) =
        timeout(Duration::from_secs(5), waiter).await.expect("the waiter is granted").unwrap();
    (granted - killed, token)
}

async fn processes_never_exceed_the_limit(target: Target) {
    let ns = common::unique_ns("procs");
    let _cleanup = common::Cleanup::on(target, &ns);
    let limits = Limits::with_backend(common::client_on(target, &ns).await);
    limits.define("shared", LimitSpec::concurrent(CONCURRENT)).await.unwrap();
    let children: Vec<_> =
        (0..CHILDREN).map(|_| child("hammer", &ns, 3000, target).spawn().expect("spawn")).collect();
    hammer_reports(children);
    let info = limits.info("shared").await.unwrap().unwrap();
    assert!(info.max_in_use <= CONCURRENT, "server high-water mark {}", info.max_in_use);
    assert_eq!(info.max_in_use, CONCURRENT, "the hammering did fill the limit");
    assert_eq!(info.granted_total, (CHILDREN * ITERATIONS) as u64);
}

/// A hammer on a leased limit: four processes of six tasks each serve the limit from their
/// shares (learning that it is leased from their first acquire) for four seconds. By the
/// processes' own count (a counter in Redis around each hold) never more than `concurrent`
/// holders; from one second in (the shares settle), the holds cover at least 85% of
/// `concurrent` × the time; fencing tokens unique across processes and growing within each.
async fn processes_never_exceed_a_leased_limit() {
    use lanes::limit::share::SharePolicy;
    const LEASED: u32 = 8;
    let ns = common::unique_ns("procs-leased");
    let _cleanup = common::Cleanup::on(Target::Single, &ns);
    let backend =
        common::builder(&ns).lease(Duration::from_millis(600)).build().await.expect("redis");
    backend
        .define_leased("shared", LimitSpec::concurrent(LEASED), SharePolicy::MaxMinFair)
        .await
        .unwrap();
    let start = epoch_us();
    let until = start + 4_000_000;
    let children: Vec<_> = (0..CHILDREN)
        .map(|_| {
            let mut command = child("leased-hammer", &ns, 600, Target::Single);
            command.env("LANES_UNTIL_US", until.to_string()).spawn().expect("spawn")
        })
        .collect();
    let (mut all_tokens, mut spans) = (Vec::new(), Vec::new());
    for child in children {
        let stdout = child_output(child).await;
        let field = |tag: &str| report(&stdout, tag).to_owned();
        let most: i64 = field("MOST ").parse().unwrap();
        assert!(most <= i64::from(LEASED), "holders counted {most} at once");
        all_tokens.extend(field("TOKENS ").split(',').map(|t| t.parse::<u64>().unwrap()));
        for span in field("SPANS ").split(',') {
            let (s, e) = span.split_once('-').unwrap();
            spans.push((s.parse::<u64>().unwrap(), e.parse::<u64>().unwrap()));
        }
    }
    let total = all_tokens.len();
    all_tokens.sort_unstable();
    all_tokens.dedup();
    assert_eq!(all_tokens.len(), total, "no fencing token was handed out twice");
    // Busy time in [1 s, end - 0.2 s], against `concurrent` × that window.
    let (from, to) = (start + 1_000_000, until - 200_000);
    let busy: u64 = spans.iter().map(|&(s, e)| e.min(to).saturating_sub(s.max(from))).sum();
    let utilisation = busy as f64 / ((to - from) as f64 * f64::from(LEASED));
    println!("  {total} grants; utilisation {:.1}% of {LEASED}", utilisation * 100.0);
    // A loaded runner's late wake-ups and process start-ups cost a few points; a client
    // idling on its share would leave a quarter of the limit unused.
    assert!(utilisation >= 0.85, "utilisation {:.1}%", utilisation * 100.0);
}

async fn a_killed_holder_is_reclaimed(target: Target) {
    let ns = common::unique_ns("kill");
    let _cleanup = common::Cleanup::on(target, &ns);
    let lease = Duration::from_millis(500);
    let limits = Limits::with_backend(common::client_on(target, &ns).await);
    limits.define("held", LimitSpec::concurrent(1)).await.unwrap();
    let mut holder = child("hold", &ns, lease.as_millis() as u64, target).spawn().expect("spawn");
    let child_token = held_tokens(&mut holder).await[0];
    let (took, token) = granted_after_kill(&limits, "held", holder, lease).await;
    assert!(took <= lease + Duration::from_millis(300), "reclaimed after {took:?}");
    assert!(token > child_token, "the new holder's token fences the dead one");
}
