//! The tower layer: waiting and rejecting modes, priorities from the request, permits held
//! until the response.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use lanes::limit::{LimitLayer, Overloaded, WhenBusy};
use lanes::{LimitSpec, Limits, Priority};
use tower::{Layer, ServiceExt, service_fn};

#[tokio::test(start_paused = true)]
async fn waiting_mode_bounds_in_flight_requests() {
    let limits = Limits::new();
    limits.define("backend", LimitSpec::concurrent(2)).await.unwrap();
    let in_flight = Arc::new(AtomicUsize::new(0));
    let max = Arc::new(AtomicUsize::new(0));
    let service = {
        let (in_flight, max) = (in_flight.clone(), max.clone());
        service_fn(move |req: u32| {
            let (in_flight, max) = (in_flight.clone(), max.clone());
            async move {
                let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                max.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(10)).await;
                in_flight.fetch_sub(1, Ordering::SeqCst);
                Ok::<_, Infallible>(req * 2)
            }
        })
    };
    let service = LimitLayer::new(&limits, "backend")
        .priority(|req: &u32| Priority::default().key(format!("user-{}", req % 3)))
        .layer(service);
    let calls: Vec<_> = (0..20).map(|i| tokio::spawn(service.clone().oneshot(i))).collect();
    for (i, call) in calls.into_iter().enumerate() {
        assert_eq!(call.await.unwrap().unwrap(), i as u32 * 2);
    }
    assert_eq!(max.load(Ordering::SeqCst), 2);
    assert_eq!(limits.info("backend").await.unwrap().unwrap().in_use, 0);
}

#[tokio::test(start_paused = true)]
async fn reject_mode_fails_fast_with_a_typed_error() {
    let limits = Limits::new();
    limits.define("backend", LimitSpec::concurrent(1)).await.unwrap();
    let service = LimitLayer::new(&limits, "backend")
        .when_busy(WhenBusy::Reject)
        .layer(service_fn(|()| async { Ok::<_, Infallible>("ok") }));
    let held = limits.acquire("backend", Priority::default()).await.unwrap();
    let err = service.clone().oneshot(()).await.unwrap_err();
    let overloaded = err.downcast_ref::<Overloaded>().expect("an Overloaded error");
    assert_eq!(overloaded.limit(), "backend");
    drop(held);
    assert_eq!(service.oneshot(()).await.unwrap(), "ok");
    let unknown = LimitLayer::new(&limits, "missing")
        .layer(service_fn(|()| async { Ok::<_, Infallible>(()) }));
    let err = unknown.oneshot(()).await.unwrap_err();
    assert!(
        err.downcast_ref::<lanes::LimitError>().is_some_and(lanes::LimitError::is_unknown_limit)
    );
}

/// The HTTP flavor goes straight into `axum::Router::layer` (its error stays `Infallible`), and
/// answers refusals as responses: 429 with `Retry-After` when busy, 503 for an unknown limit.
#[tokio::test]
async fn the_http_layer_goes_into_an_axum_router_and_answers_refusals() {
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use axum::routing::get;

    let limits = Limits::new();
    limits.define("api", LimitSpec::concurrent(1)).await.unwrap();
    let tenant = |req: &Request<Body>| {
        let tenant = req.headers().get("x-tenant").and_then(|v| v.to_str().ok());
        Priority::default().key(tenant.unwrap_or("anonymous"))
    };
    let app = axum::Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(LimitLayer::new(&limits, "api").priority(tenant).when_busy(WhenBusy::Reject).http());
    let request = || Request::get("/").header("x-tenant", "a").body(Body::empty()).unwrap();
    let ok = app.clone().oneshot(request()).await.unwrap();
    assert_eq!(ok.status(), StatusCode::OK);

    let held = limits.acquire("api", Priority::default()).await.unwrap();
    let busy = app.clone().oneshot(request()).await.unwrap();
    assert_eq!(busy.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(busy.headers()["retry-after"], "1");
    let body = axum::body::to_bytes(busy.into_body(), 1 << 16).await.unwrap();
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["limit"], "api", "{body}");
    drop(held);
    assert_eq!(app.clone().oneshot(request()).await.unwrap().status(), StatusCode::OK);

    let unknown = axum::Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(LimitLayer::new(&limits, "nope").http());
    assert_eq!(unknown.oneshot(request()).await.unwrap().status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(limits.info("api").await.unwrap().unwrap().in_use, 0);
}

#[tokio::test(start_paused = true)]
async fn a_keyed_layer_limits_each_client_on_its_own_and_answers_429_with_its_retry_after() {
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use axum::routing::get;
    use lanes::KeyedLimit;

    let per_client: KeyedLimit =
        KeyedLimit::new("per-client", LimitSpec::rate(2.0).burst(2)).unwrap();
    let client = |req: &Request<Body>| {
        let addr = req.headers().get("x-client").and_then(|v| v.to_str().ok());
        Priority::default().key(addr.unwrap_or("unknown"))
    };
    let app = axum::Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(LimitLayer::keyed(&per_client).priority(client).when_busy(WhenBusy::Reject).http());
    let from = |addr: &str| Request::get("/").header("x-client", addr).body(Body::empty()).unwrap();
    for _ in 0..2 {
        assert_eq!(app.clone().oneshot(from("a")).await.unwrap().status(), StatusCode::OK);
    }
    let limited = app.clone().oneshot(from("a")).await.unwrap();
    assert_eq!(limited.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(limited.headers()["retry-after"], "1");
    let body = axum::body::to_bytes(limited.into_body(), 1 << 16).await.unwrap();
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["limit"], "per-client", "{body}");
    // Another client is another limit; the first gets a token back after 500 ms.
    assert_eq!(app.clone().oneshot(from("b")).await.unwrap().status(), StatusCode::OK);
    tokio::time::advance(Duration::from_millis(500)).await;
    assert_eq!(app.clone().oneshot(from("a")).await.unwrap().status(), StatusCode::OK);
    assert_eq!(per_client.info().refused_total, 1);
}

#[tokio::test(start_paused = true)]
async fn a_keyed_layer_full_of_keys_in_use_answers_429_not_503() {
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use axum::routing::get;
    use lanes::KeyedLimit;

    let per_client: KeyedLimit =
        KeyedLimit::builder("per-client", LimitSpec::rate(1.0)).max_keys(1).build().unwrap();
    let client = |req: &Request<Body>| {
        Priority::default().key(req.headers()["x-client"].to_str().unwrap().to_owned())
    };
    for when_busy in [WhenBusy::Reject, WhenBusy::Wait] {
        let app = axum::Router::new()
            .route("/", get(|| async { "hello" }))
            .layer(LimitLayer::keyed(&per_client).priority(client).when_busy(when_busy).http());
        let from =
            |addr: &str| Request::get("/").header("x-client", addr).body(Body::empty()).unwrap();
        if when_busy == WhenBusy::Reject {
            assert_eq!(app.clone().oneshot(from("a")).await.unwrap().status(), StatusCode::OK);
        }
        // "a" is kept (its bucket refills for a second): no room for "b".
        let full = app.clone().oneshot(from("b")).await.unwrap();
        assert_eq!(full.status(), StatusCode::TOO_MANY_REQUESTS, "{when_busy:?}");
        let body = axum::body::to_bytes(full.into_body(), 1 << 16).await.unwrap();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["limit"], "per-client", "{body}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_keyed_layer_in_waiting_mode_runs_one_request_per_key_at_a_time() {
    use lanes::KeyedLimit;

    let per_user: KeyedLimit = KeyedLimit::new("per-user", LimitSpec::concurrent(1)).unwrap();
    let in_flight: Arc<[AtomicUsize; 3]> = Arc::new(Default::default());
    let service = {
        let in_flight = in_flight.clone();
        service_fn(move |req: u32| {
            let in_flight = in_flight.clone();
            async move {
                let slot = &in_flight[(req % 3) as usize];
                assert_eq!(slot.fetch_add(1, Ordering::SeqCst), 0, "one per key at a time");
                tokio::time::sleep(Duration::from_millis(10)).await;
                slot.fetch_sub(1, Ordering::SeqCst);
                Ok::<_, Infallible>(req)
            }
        })
    };
    let service = LimitLayer::keyed(&per_user)
        .priority(|req: &u32| Priority::default().key(format!("user-{}", req % 3)))
        .layer(service);
    let started = tokio::time::Instant::now();
    let calls: Vec<_> = (0..12).map(|i| tokio::spawn(service.clone().oneshot(i))).collect();
    for (i, call) in calls.into_iter().enumerate() {
        assert_eq!(call.await.unwrap().unwrap(), i as u32);
    }
    // Three keys in parallel, four requests each one after another.
    assert_eq!(started.elapsed(), Duration::from_millis(40));
    assert_eq!(per_user.info().held, 0);
}
