//! The in-process backend passes the LimitBackend conformance suite, through the trait.

use std::sync::Arc;

use lanes::limit::{LocalLimits, conformance};

#[tokio::test]
async fn the_local_backend_conforms() {
    conformance::run_all("local", |max_waiters| {
        Arc::new(LocalLimits::with_max_waiters(max_waiters))
    })
    .await;
}
