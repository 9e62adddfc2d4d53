//! An axum service with a fair limit per tenant in front of its handler: at most 2 requests run
//! at once, tenants take turns, and a request that finds no permit is answered 429.
//! `cargo run -p lanes --features http --example axum_tenants`

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::get;
use lanes::limit::{LimitLayer, WhenBusy};
use lanes::{LimitSpec, Limits, Priority};
use tower::ServiceExt;

#[tokio::main]
pub(crate) async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let limits = Limits::new();
    limits.define("api", LimitSpec::concurrent(2)).await?;
    let tenant = |req: &Request<Body>| {
        let tenant = req.headers().get("x-tenant").and_then(|v| v.to_str().ok());
        Priority::default().key(tenant.unwrap_or("anonymous"))
    };
    let waiting = axum::Router::new()
        .route("/", get(|| async { "served" }))
        .layer(LimitLayer::new(&limits, "api").priority(tenant).http());
    let rejecting = axum::Router::new()
        .route("/", get(|| async { "served" }))
        .layer(LimitLayer::new(&limits, "api").priority(tenant).when_busy(WhenBusy::Reject).http());
    let request = |tenant: &str| Request::get("/").header("x-tenant", tenant).body(Body::empty());

    let response = waiting.clone().oneshot(request("acme")?).await?;
    println!("acme: {}", response.status());
    assert_eq!(response.status(), StatusCode::OK);

    // Both permits held elsewhere: the rejecting route answers 429 with Retry-After.
    let a = limits.acquire("api", Priority::default()).await?;
    let b = limits.acquire("api", Priority::default()).await?;
    let response = rejecting.oneshot(request("globex")?).await?;
    println!(
        "globex while busy: {} (retry after {:?})",
        response.status(),
        response.headers().get("retry-after")
    );
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    drop((a, b));
    Ok(())
}
