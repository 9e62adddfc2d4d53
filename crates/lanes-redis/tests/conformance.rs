//! The `LimitBackend` conformance suite, unchanged, against `RedisLimits` on a real Redis and on
//! a real Redis Cluster (its limits spread over the cluster's slots and primaries).

mod common;

use std::sync::Arc;

use common::Target;
use lanes::LimitBackend;
use lanes::limit::conformance;

async fn conformance_on(target: Target) {
    let ns = common::unique_ns("conformance");
    let _cleanup = common::Cleanup::on(target, &ns);
    let roomy: Arc<dyn LimitBackend> = Arc::new(common::client_on(target, &ns).await);
    let cramped: Arc<dyn LimitBackend> =
        Arc::new(common::builder_on(target, &ns).max_waiters(2).build().await.unwrap());
    conformance::run_all(
        "conf",
        |max_waiters| {
            if max_waiters == 2 { cramped.clone() } else { roomy.clone() }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_limits_pass_the_conformance_suite() {
    conformance_on(Target::Single).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_limits_pass_the_conformance_suite() {
    conformance_on(Target::Cluster).await;
}
