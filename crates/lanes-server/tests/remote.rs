//! `RemoteLimits` passes the `LimitBackend` conformance suite, unchanged, against real
//! `lanes serve` processes.

mod common;

use std::sync::Arc;

use common::Serve;
use lanes::LimitBackend;
use lanes::limit::conformance;
use lanes_remote::RemoteLimits;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_limits_pass_the_conformance_suite() {
    let roomy_server = Serve::start(&[]);
    let cramped_server = Serve::start(&["--max-waiters", "2"]);
    let roomy: Arc<dyn LimitBackend> =
        Arc::new(RemoteLimits::new(roomy_server.base.clone()).unwrap());
    let cramped: Arc<dyn LimitBackend> =
        Arc::new(RemoteLimits::new(cramped_server.base.clone()).unwrap());
    conformance::run_all(
        "remote",
        |max_waiters| {
            if max_waiters == 2 { cramped.clone() } else { roomy.clone() }
        },
    )
    .await;
}

/// A server that forgets its state (a restart of an embedded server) loses the client's
/// permits: the background renewal hears "unknown client", and the permit says it is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_the_server_forgot_is_lease_lost() {
    let first = Serve::start(&[]);
    let addr = first.base.trim_start_matches("http://").to_owned();
    let remote = RemoteLimits::with_client(
        first.base.clone(),
        "lease-lost",
        std::time::Duration::from_millis(300),
    )
    .unwrap();
    let limits = lanes::Limits::with_backend(remote);
    limits.define("db", lanes::LimitSpec::concurrent(1)).await.unwrap();
    let permit = limits.acquire("db", lanes::Priority::default()).await.unwrap();
    // Renewed in the background well past its lease.
    tokio::time::sleep(std::time::Duration::from_millis(700)).await;
    assert!(!permit.lease_lost(), "a renewed permit is not lost");
    drop(first);
    let _second = Serve::start_at(&addr, &[]);
    tokio::time::timeout(std::time::Duration::from_secs(5), permit.lost())
        .await
        .expect("the renewal learns that the server forgot the permit");
    assert!(permit.lease_lost());
}
