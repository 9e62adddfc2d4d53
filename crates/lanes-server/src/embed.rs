//! The dashboard of an application's own [`Registry`], as an axum [`Router`] to mount where
//! the application likes (`Router::nest("/lanes", ..)`): the page at the mount point
//! (`/lanes`), the snapshot at `v1/snapshot` below it (`/lanes/v1/snapshot`), and every
//! `lanes_*` metric the process recorded at `metrics` (`/lanes/metrics`, Prometheus text).
//! The same page `lanes serve` shows, for the lanes, pools, channels, limits and spill queues
//! the application registered.
//!
//! ```
//! use std::time::Duration;
//! use lanes::{LaneLimits, LaneSet, Registry};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let registry = Registry::new();
//! let lanes = LaneSet::builder()
//!     .lane("checkout", LaneLimits::new(4, 100))
//!     .audit_timeout(Duration::from_secs(1))
//!     .finalization_timeout(Duration::from_secs(1))
//!     .worker_drain_timeout(Duration::from_secs(5))
//!     .registry(&registry, "api")
//!     .build()?;
//! let app: axum::Router = axum::Router::new()
//!     // ... the application's own routes ...
//!     .nest("/lanes", lanes_server::embed::dashboard(registry));
//! # drop((app, lanes));
//! # Ok(())
//! # }
//! ```
//!
//! The router has no authentication of its own: mount it behind what guards the rest of the
//! application's operational endpoints.

use axum::Router;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use lanes::Registry;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// The dashboard page (at `/` of the router, and so at its mount point), the registry's
/// snapshot as JSON (at `/v1/snapshot`) and the process's metrics (at `/metrics`, see
/// [`prometheus`]).
pub fn dashboard(registry: Registry) -> Router {
    let metrics = prometheus();
    let scraped = registry.clone();
    Router::new()
        .route("/", get(page))
        .route(
            "/v1/snapshot",
            get(move || {
                let registry = registry.clone();
                async move { axum::Json(registry.snapshot()) }
            }),
        )
        .route(
            "/metrics",
            get(move || {
                // A snapshot first: a busy channel publishes its `emitted` and `processed`
                // counts in steps, and catches up when a snapshot is taken.
                drop(scraped.snapshot());
                let body = metrics.render();
                async move { ([("content-type", "text/plain; version=0.0.4")], body) }
            }),
        )
}

/// The process-wide Prometheus recorder, installed on first use, with the help text of every
/// `lanes_*` metric and the wait-time histograms turned on
/// ([`lanes::observe::set_wait_timing`]). If the process installed another `metrics` recorder
/// first, that one keeps receiving the series and this handle renders nothing: mount the
/// application's own exporter instead.
pub fn prometheus() -> PrometheusHandle {
    static HANDLE: std::sync::OnceLock<PrometheusHandle> = std::sync::OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new().build_recorder();
            let handle = recorder.handle();
            let _ = metrics::set_global_recorder(recorder);
            lanes::observe::describe_metrics();
            lanes::observe::set_wait_timing(true);
            handle
        })
        .clone()
}

async fn page() -> Response {
    ([("content-type", "text/html; charset=utf-8")], crate::server::DASHBOARD).into_response()
}
