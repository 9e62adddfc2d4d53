//! Run lanes: an interactive lane answered in line, a batch lane whose runs end in finalizers,
//! and a clean drain. `cargo run -p lanes --example run_lane`

use std::time::Duration;

use lanes::{LaneLimits, LaneSet, Run};

#[tokio::main(flavor = "current_thread")]
pub(crate) async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let lanes = LaneSet::builder()
        .lane("interactive", LaneLimits::new(2, 8))
        .lane("batch", LaneLimits::new(1, 100))
        .audit_timeout(Duration::from_secs(1))
        .finalization_timeout(Duration::from_secs(1))
        .worker_drain_timeout(Duration::from_secs(5))
        .build()?;

    // In line: the caller awaits the outcome.
    let answer =
        lanes.run("interactive", Run::typed(|_cx| async { Ok::<_, std::io::Error>(42) }))?;
    println!("interactive run answered {}", answer.await?);

    // In the background: each outcome goes to its finalizer, exactly once.
    let (done, mut finalized) = tokio::sync::mpsc::unbounded_channel();
    for report in 0..5 {
        let done = done.clone();
        lanes.spawn(
            "batch",
            Run::typed(move |_cx| async move {
                tokio::time::sleep(Duration::from_millis(10)).await;
                Ok::<_, std::io::Error>(format!("report {report}"))
            })
            .finalizer(move |outcome| async move {
                let _ = done.send(outcome.map_err(|e| e.to_string()));
                Ok::<_, std::io::Error>(())
            }),
        )?;
    }
    drop(done);
    let mut reports = Vec::new();
    while reports.len() < 5 {
        let outcome = finalized.recv().await.expect("every run is finalized");
        reports.push(outcome?);
    }
    println!("batch lane finalized {} runs: {reports:?}", reports.len());
    // Closing refuses new runs and fails the ones still queued (their finalizers say so);
    // `drained` waits for the running ones.
    lanes.close();
    lanes.drained().await;
    Ok(())
}
