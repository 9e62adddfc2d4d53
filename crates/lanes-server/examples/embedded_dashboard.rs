//! An application with its own `lanes` dashboard: a run lane set, per-tenant limits and a
//! rate limit per client in front of its own route, registered in one `Registry`, and the
//! dashboard mounted under `/lanes` of the application's axum router.
//!
//! ```sh
//! cargo run -p lanes-server --example embedded_dashboard
//! # then open http://127.0.0.1:7979/lanes ; LANES_EXAMPLE_SECONDS=5 stops it after 5 s
//! ```

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::Request;
use axum::routing::get;
use lanes::limit::{LimitLayer, WhenBusy};
use lanes::{KeyedLimit, LaneLimits, LaneSet, LimitSpec, Limits, Priority, Registry, Run};

/// The application: its router (its own routes and the dashboard at `/lanes`), and the
/// primitives behind it, all reporting to one registry.
pub(crate) async fn application() -> Result<(Router, LaneSet, Limits), Box<dyn std::error::Error>> {
    let registry = Registry::new();
    let lanes = LaneSet::builder()
        .lane("checkout", LaneLimits::new(4, 100))
        .lane("reports", LaneLimits::new(1, 10))
        .audit_timeout(Duration::from_secs(1))
        .finalization_timeout(Duration::from_secs(1))
        .worker_drain_timeout(Duration::from_secs(5))
        .registry(&registry, "app")
        .build()?;
    let limits = Limits::builder().registry(&registry, "app-limits").build()?;
    limits.define("payments-api", LimitSpec::concurrent(8).per_second(100.0)).await?;
    // Each client (by its `x-client` header): 50 requests a second, a burst of 100; past it,
    // 429 with Retry-After. The layer keeps the limit alive; the registry only reports it.
    let per_client: KeyedLimit =
        KeyedLimit::builder("per-client", LimitSpec::rate(50.0).burst(100))
            .registry(&registry, "per-client")
            .build()?;
    let client = |req: &Request<Body>| {
        let client = req.headers().get("x-client").and_then(|v| v.to_str().ok());
        Priority::default().key(client.unwrap_or("anonymous"))
    };
    let router = Router::new()
        .route("/", get(|| async { "the application" }))
        .layer(LimitLayer::keyed(&per_client).priority(client).when_busy(WhenBusy::Reject).http())
        .nest("/lanes", lanes_server::embed::dashboard(registry));
    Ok((router, lanes, limits))
}

/// Some work through the lanes and the limit, so the dashboard has something to show.
pub(crate) async fn work(lanes: &LaneSet, limits: &Limits, runs: usize) {
    for i in 0..runs {
        let limits = limits.clone();
        let admitted = lanes.spawn(
            if i % 4 == 0 { "reports" } else { "checkout" },
            Run::typed(move |_cx| async move {
                let tenant = Priority::default().key(format!("tenant-{}", i % 3));
                let _permit = limits.acquire("payments-api", tenant).await?;
                tokio::time::sleep(Duration::from_millis(5)).await;
                Ok::<_, lanes::LimitError>(())
            })
            .finalizer(|outcome| async move { outcome.map(|_| ()) }),
        );
        if admitted.is_err() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (router, lanes, limits) = application().await?;
    let addr = std::env::var("LANES_EXAMPLE_LISTEN").unwrap_or_else(|_| "127.0.0.1:7979".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("dashboard at http://{}/lanes", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, router).await });
    let seconds = std::env::var("LANES_EXAMPLE_SECONDS").ok().and_then(|s| s.parse().ok());
    let until = seconds.map(|s| tokio::time::Instant::now() + Duration::from_secs(s));
    while until.is_none_or(|until| tokio::time::Instant::now() < until) {
        work(&lanes, &limits, 50).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    lanes.close();
    lanes.drained().await;
    Ok(())
}
