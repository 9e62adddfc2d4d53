//! The `LimitBackend` conformance suite, unchanged, against `RedisLimits` on a real Redis.

mod common;

use std::sync::Arc;

use lanes::LimitBackend;
use lanes::limit::conformance;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_limits_pass_the_conformance_suite() {
    let ns = common::unique_ns("conformance");
    let _cleanup = common::Cleanup(ns.clone());
    let roomy: Arc<dyn LimitBackend> = Arc::new(common::client(&ns).await);
    let cramped: Arc<dyn LimitBackend> =
        Arc::new(common::builder(&ns).max_waiters(2).build().await.unwrap());
    conformance::run_all(
        "conf",
        |max_waiters| {
            if max_waiters == 2 { cramped.clone() } else { roomy.clone() }
        },
    )
    .await;
}
