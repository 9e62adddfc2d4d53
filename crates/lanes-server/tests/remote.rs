//! `RemoteLimits` passes the `LimitBackend` conformance suite, unchanged, against real
//! `lanes serve` processes.

mod common;

use std::sync::Arc;

use common::Serve;
use lanes::LimitBackend;
use lanes::limit::conformance;
use lanes_server::RemoteLimits;

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
