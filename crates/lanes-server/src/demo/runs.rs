//! The run-lane scenario: 10k varied jobs through a blocking and a background lane, an overload
//! burst, then a close.

use std::fmt::Write as _;
use std::io::{IsTerminal, Write as _};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use lanes::{BoxError, LaneLimits, LaneSet, LaneSetSnapshot, Registry, Run, RunContext};
use tokio::time::sleep;

use super::{DemoArgs, Rng, percentile};

/// What the jobs and finalizers saw.
#[derive(Default)]
struct Waits {
    /// Queue waits of started jobs, per lane.
    blocking: Vec<Duration>,
    background: Vec<Duration>,
    /// Finalizer calls.
    finalized: u64,
}

const PANIC_MESSAGE: &str = "demo: simulated job panic";

pub(super) async fn run(args: &DemoArgs) -> Result<(), BoxError> {
    super::quiet_panics(PANIC_MESSAGE);
    let registry = Registry::new();
    let lanes = LaneSet::builder()
        .lane("blocking", LaneLimits::new(8, 64))
        .lane("background", LaneLimits::new(4, 512))
        .audit_timeout(Duration::from_secs(1))
        .finalization_timeout(Duration::from_secs(1))
        .worker_drain_timeout(Duration::from_secs(2))
        .registry(&registry, "demo")
        .build()?;
    let waits = Arc::new(Mutex::new(Waits::default()));
    let started = Instant::now();
    let progress = tokio::spawn(progress(registry.clone(), started));

    println!(
        "run lanes: {} jobs through a blocking lane (8 running + 64 queued) and a background \
         lane (4 + 512), then a burst of {}, then a close.\n",
        args.runs, args.burst
    );

    // Steady phase: a producer that waits for room when a lane is full.
    let mut rng = Rng::new(args.seed);
    let mut callers = Vec::new();
    for _ in 0..args.runs {
        let blocking = rng.below(10) < 6;
        let admitted_at = Arc::new(OnceLock::new());
        let run = job(&mut rng, &waits, &admitted_at);
        if blocking {
            let drop_after = (rng.below(100) < 3).then(|| Duration::from_millis(2));
            let Ok(handle) = lanes.run_wait("blocking", run, None).await else { break };
            let _ = admitted_at.set(Instant::now());
            callers.push(tokio::spawn(async move {
                match drop_after {
                    // An impatient caller: dropping the handle cancels the run.
                    Some(after) => {
                        let _ = tokio::time::timeout(after, handle).await;
                    }
                    None => {
                        let _ = handle.await;
                    }
                }
            }));
        } else {
            if lanes.spawn_wait("background", run, None).await.is_err() {
                break;
            }
            let _ = admitted_at.set(Instant::now());
        }
        if rng.below(4) == 0 {
            tokio::task::yield_now().await;
        }
    }

    // Overload: a burst with no back-off. The lanes admit what fits and refuse the rest at once.
    for _ in 0..args.burst {
        let admitted_at = Arc::new(OnceLock::new());
        let run = job(&mut rng, &waits, &admitted_at);
        if let Ok(handle) = lanes.run("blocking", run) {
            let _ = admitted_at.set(Instant::now());
            callers.push(tokio::spawn(async move {
                let _ = handle.await;
            }));
        }
    }

    // Close with work still queued and executing: queued runs fail `closed`, executing jobs are
    // asked to stop, and `drained` waits for every finalizer.
    sleep(Duration::from_millis(5)).await;
    lanes.close();
    lanes.drained().await;
    for caller in callers {
        caller.await?;
    }
    progress.abort();

    let snapshot = registry.snapshot();
    let set = &snapshot.lane_set("demo").expect("the demo set is registered");
    let waits = waits.lock().map_err(|_| "queue-wait log poisoned")?;
    print!("{}", table(set, &waits, started.elapsed()));
    let admitted: u64 = set.lanes.iter().map(|lane| lane.admitted).sum();
    if waits.finalized != admitted {
        return Err(format!("{admitted} runs admitted but {} finalized", waits.finalized).into());
    }
    println!("every one of the {admitted} admitted runs was finalized exactly once.");
    Ok(())
}

/// One job of the workload: a few milliseconds of "work", sometimes failing or panicking,
/// always honouring cancellation.
fn job(
    rng: &mut Rng,
    waits: &Arc<Mutex<Waits>>,
    admitted_at: &Arc<OnceLock<Instant>>,
) -> Run<impl lanes::lane::Job<Output = ()>, impl lanes::lane::Finalize<(), Output = ()>> {
    let work = Duration::from_micros(500 + rng.below(8_000));
    let fate = rng.below(100);
    let (waits, finalized, admitted_at) = (waits.clone(), waits.clone(), admitted_at.clone());
    let mut run = Run::typed(move |cx: RunContext| async move {
        if let Ok(mut waits) = waits.lock() {
            let lane =
                if cx.lane() == "blocking" { &mut waits.blocking } else { &mut waits.background };
            // Set by the producer right after admission; a job can start before it is set.
            let waited = admitted_at.get().map_or(Duration::ZERO, Instant::elapsed);
            lane.push(waited);
        }
        tokio::select! {
            reason = cx.cancelled() => return Err(format!("stopped: {}", reason.as_str()).into()),
            () = sleep(work) => {}
        }
        match fate {
            0..=3 => Err::<(), BoxError>("downstream refused".into()),
            4 => panic!("{}", PANIC_MESSAGE),
            _ => Ok(()),
        }
    })
    // A finalizer that "commits" the result: here it counts itself and passes the outcome on.
    .finalizer(move |outcome| async move {
        if let Ok(mut log) = finalized.lock() {
            log.finalized += 1;
        }
        outcome
    });
    if fate >= 95 {
        run = run.queue_timeout(Duration::from_millis(10));
    }
    if fate == 90 {
        run = run.execution_timeout(Duration::from_millis(2));
    }
    run
}

async fn progress(registry: Registry, started: Instant) {
    let tty = std::io::stdout().is_terminal();
    let period = if tty { Duration::from_millis(100) } else { Duration::from_secs(1) };
    loop {
        sleep(period).await;
        let snapshot = registry.snapshot();
        let Some(set) = snapshot.lane_set("demo") else {
            return;
        };
        let mut line = format!("{:>6.1}s", started.elapsed().as_secs_f64());
        for lane in &set.lanes {
            let _ = write!(
                line,
                "  {}: {:>2} running {:>3} queued {:>6} done {:>5} failed {:>5} refused",
                lane.name,
                lane.executing,
                lane.queued,
                lane.completed,
                lane.failed.total(),
                lane.rejected.total(),
            );
        }
        let mut out = std::io::stdout().lock();
        if tty {
            let _ = write!(out, "\r{line}");
        } else {
            let _ = writeln!(out, "{line}");
        }
        let _ = out.flush();
    }
}

/// How one row of the final table reads a lane.
type Cell<'w> = dyn Fn(&lanes::LaneSnapshot) -> String + 'w;

fn table(set: &LaneSetSnapshot, waits: &Waits, elapsed: Duration) -> String {
    let mut out = String::from("\n\n");
    let rows: [(&str, &Cell<'_>); 15] = [
        ("admitted", &|l| l.admitted.to_string()),
        ("refused: full", &|l| l.rejected.full.to_string()),
        ("refused: closed", &|l| l.rejected.closed.to_string()),
        ("completed", &|l| l.completed.to_string()),
        ("failed: job error", &|l| l.failed.job.to_string()),
        ("failed: panic", &|l| l.failed.panic.to_string()),
        ("failed: timeout", &|l| l.failed.timeout.to_string()),
        ("failed: canceled", &|l| l.failed.canceled.to_string()),
        ("failed: closed", &|l| l.failed.closed.to_string()),
        ("failed: poisoned", &|l| l.failed.poisoned.to_string()),
        ("max executing", &|l| format!("{} / {}", l.max_executing, l.limits.concurrent)),
        ("max owned", &|l| format!("{} / {}", l.max_owned, l.limits.capacity())),
        ("queue wait p50", &|l| format!("{:.2?}", wait(waits, &l.name, 0.50))),
        ("queue wait p99", &|l| format!("{:.2?}", wait(waits, &l.name, 0.99))),
        ("reconciles", &|l| {
            let ok = l.admitted == l.completed + l.failed.total() && l.owned == 0;
            if ok { "yes".to_owned() } else { "NO".to_owned() }
        }),
    ];
    let _ = write!(out, "{:<20}", "");
    for lane in &set.lanes {
        let _ = write!(out, "{:>14}", lane.name);
    }
    out.push('\n');
    for (label, cell) in rows {
        let _ = write!(out, "{label:<20}");
        for lane in &set.lanes {
            let _ = write!(out, "{:>14}", cell(lane));
        }
        out.push('\n');
    }
    let _ = writeln!(out, "\nfinished in {elapsed:.2?}");
    out
}

fn wait(waits: &Waits, lane: &str, p: f64) -> Duration {
    let mut sorted =
        if lane == "blocking" { waits.blocking.clone() } else { waits.background.clone() };
    sorted.sort_unstable();
    percentile(&sorted, p)
}
