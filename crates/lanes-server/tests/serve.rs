//! `lanes serve` over HTTP, against the real binary: every endpoint, the error table,
//! idempotent acquire, leases and silent clients, graceful shutdown, two servers sharing a
//! limit through Redis, and a property-based fuzz that must never see a server error.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use common::{Serve, http};
use proptest::prelude::*;
use serde_json::{Value, json};

async fn call(
    client: &reqwest::Client,
    method: reqwest::Method,
    url: String,
    body: Option<Value>,
) -> (u16, Value) {
    common::request(client, method, url, None, body).await
}

async fn put(c: &reqwest::Client, s: &Serve, path: &str, body: Value) -> (u16, Value) {
    call(c, reqwest::Method::PUT, s.url(path), Some(body)).await
}

async fn post(c: &reqwest::Client, s: &Serve, path: &str, body: Value) -> (u16, Value) {
    call(c, reqwest::Method::POST, s.url(path), Some(body)).await
}

async fn get(c: &reqwest::Client, s: &Serve, path: &str) -> (u16, Value) {
    call(c, reqwest::Method::GET, s.url(path), None).await
}

#[tokio::test]
async fn every_endpoint_answers() {
    let serve = Serve::start(&[]);
    let c = http();
    let (status, limit) =
        put(&c, &serve, "/v1/limits/db", json!({"concurrent": 2, "per_second": 100.0, "burst": 5}))
            .await;
    assert_eq!(status, 200, "{limit}");
    assert_eq!((limit["concurrent"].as_u64(), limit["burst"].as_u64()), (Some(2), Some(5)));
    let (status, list) = get(&c, &serve, "/v1/limits").await;
    assert_eq!(status, 200);
    assert_eq!(list["limits"][0]["name"], "db");
    let (status, granted) =
        post(&c, &serve, "/v1/limits/db/acquire", json!({"client": "a", "lease_ms": 5000})).await;
    assert_eq!(status, 200, "{granted}");
    assert_eq!(granted["granted"], true);
    assert!(granted["fencing_token"].as_u64().unwrap() >= 1);
    assert!(granted["lease_expires_in_ms"].as_u64().unwrap() <= 5000);
    let ticket = granted["ticket"].as_u64().unwrap();
    let (status, one) = get(&c, &serve, "/v1/limits/db").await;
    assert_eq!((status, one["in_use"].as_u64()), (200, Some(1)));
    let (status, renewed) = post(&c, &serve, "/v1/clients/a/renew", json!({})).await;
    assert_eq!((status, renewed["renewed"].as_u64()), (200, Some(1)));
    let (status, snapshot) = get(&c, &serve, "/v1/snapshot").await;
    assert_eq!(status, 200);
    assert_eq!(snapshot["limits"]["server"][0]["in_use"], 1);
    assert_eq!(snapshot["server"]["backend"], "embedded");
    let (status, released) =
        post(&c, &serve, "/v1/limits/db/release", json!({"client": "a", "ticket": ticket})).await;
    assert_eq!((status, released["released"].as_bool()), (200, Some(true)));
    let (status, again) =
        post(&c, &serve, "/v1/limits/db/release", json!({"client": "a", "ticket": ticket})).await;
    assert_eq!(
        (status, again["released"].as_bool()),
        (200, Some(false)),
        "releasing twice is a no-op"
    );
    let metrics = c.get(serve.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("lanes_limit_granted_total{limit=\"db\"} 1"), "{metrics}");
    assert!(metrics.contains("lanes_http_requests_total"), "{metrics}");
    let (status, openapi) = get(&c, &serve, "/openapi.json").await;
    assert_eq!(status, 200);
    assert_eq!(openapi["openapi"], "3.1.0");
    let derived: Value = serde_json::from_str(lanes_server::server::openapi_document()).unwrap();
    assert_eq!(openapi, derived, "the served document is the one derived from the handlers");
    let page = c.get(serve.url("/")).send().await.unwrap().text().await.unwrap();
    assert!(page.contains("v1/snapshot") && !page.contains("https://"), "a self-contained page");
    let (status, _) = call(&c, reqwest::Method::DELETE, serve.url("/v1/limits/db"), None).await;
    assert_eq!(status, 204);
    assert_eq!(get(&c, &serve, "/v1/limits/db").await.0, 404);
}

/// The checked-in `openapi.json` is the derived document (`LANES_BLESS=1` rewrites it after a
/// change to the API).
#[test]
fn the_checked_in_openapi_document_is_the_derived_one() {
    let derived = lanes_server::server::openapi_document();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("openapi.json");
    if std::env::var_os("LANES_BLESS").is_some() {
        std::fs::write(&path, derived).unwrap();
    }
    let checked_in = std::fs::read_to_string(&path).unwrap();
    assert!(
        checked_in == derived,
        "openapi.json differs from the document derived from the handlers: rerun with LANES_BLESS=1"
    );
}

#[tokio::test]
async fn bad_input_gets_the_documented_errors() {
    let serve = Serve::start(&["--max-waiters", "1"]);
    let c = http();
    put(&c, &serve, "/v1/limits/db", json!({"concurrent": 1})).await;
    // (what, method, path, body, status, the field the error names)
    type Case =
        (&'static str, reqwest::Method, &'static str, Option<Value>, u16, Option<&'static str>);
    let cases: Vec<Case> = vec![
        (
            "unknown limit",
            reqwest::Method::POST,
            "/v1/limits/nope/acquire",
            Some(json!({"client": "a"})),
            404,
            None,
        ),
        ("unknown limit info", reqwest::Method::GET, "/v1/limits/nope", None, 404, None),
        (
            "zero concurrent",
            reqwest::Method::PUT,
            "/v1/limits/x",
            Some(json!({"concurrent": 0})),
            400,
            Some("concurrent"),
        ),
        (
            "leased on the embedded backend",
            reqwest::Method::PUT,
            "/v1/limits/x",
            Some(json!({"concurrent": 1, "mode": "leased"})),
            400,
            Some("mode"),
        ),
        (
            "unknown mode",
            reqwest::Method::PUT,
            "/v1/limits/x",
            Some(json!({"concurrent": 1, "mode": "sometimes"})),
            400,
            Some("mode"),
        ),
        (
            "unknown policy",
            reqwest::Method::PUT,
            "/v1/limits/x",
            Some(json!({"concurrent": 1, "mode": "leased", "policy": "lottery"})),
            400,
            Some("policy"),
        ),
        (
            "a block of fencing tokens too large",
            reqwest::Method::POST,
            "/v1/limits/db/share",
            Some(json!({"client": "a", "seq": 1, "held": 0, "tokens": 1u64 << 25})),
            400,
            Some("tokens"),
        ),
        (
            "a fencing token past 2^53",
            reqwest::Method::POST,
            "/v1/limits/db/share",
            Some(json!({"client": "a", "seq": 1, "held": 0, "last_token": 1u64 << 60})),
            400,
            Some("last_token"),
        ),
        (
            "a share refresh without a client",
            reqwest::Method::POST,
            "/v1/limits/db/share",
            Some(json!({"seq": 1, "held": 0})),
            400,
            None,
        ),
        (
            "negative rate",
            reqwest::Method::PUT,
            "/v1/limits/x",
            Some(json!({"concurrent": 1, "per_second": -1.0})),
            400,
            Some("per_second"),
        ),
        (
            "zero burst",
            reqwest::Method::PUT,
            "/v1/limits/x",
            Some(json!({"concurrent": 1, "burst": 0})),
            400,
            Some("burst"),
        ),
        (
            "concurrent too big",
            reqwest::Method::PUT,
            "/v1/limits/x",
            Some(json!({"concurrent": 5_000_000_000u64})),
            400,
            Some("concurrent"),
        ),
        (
            "wrong type",
            reqwest::Method::PUT,
            "/v1/limits/x",
            Some(json!({"concurrent": "many"})),
            400,
            Some("concurrent"),
        ),
        (
            "unknown field",
            reqwest::Method::PUT,
            "/v1/limits/x",
            Some(json!({"concurrent": 1, "colour": "red"})),
            400,
            Some("colour"),
        ),
        (
            "missing client",
            reqwest::Method::POST,
            "/v1/limits/db/acquire",
            Some(json!({})),
            400,
            Some("body"),
        ),
        (
            "empty client",
            reqwest::Method::POST,
            "/v1/limits/db/acquire",
            Some(json!({"client": ""})),
            400,
            Some("client"),
        ),
        (
            "short lease",
            reqwest::Method::POST,
            "/v1/limits/db/acquire",
            Some(json!({"client": "a", "lease_ms": 5})),
            400,
            Some("lease_ms"),
        ),
        (
            "zero weight",
            reqwest::Method::POST,
            "/v1/limits/db/acquire",
            Some(json!({"client": "a", "priority": {"weight": 0}})),
            400,
            Some("priority.weight"),
        ),
        (
            "level out of range",
            reqwest::Method::POST,
            "/v1/limits/db/acquire",
            Some(json!({"client": "a", "priority": {"level": 3_000_000_000u64}})),
            400,
            Some("priority.level"),
        ),
        (
            "negative ticket",
            reqwest::Method::POST,
            "/v1/limits/db/release",
            Some(json!({"client": "a", "ticket": -1})),
            400,
            Some("ticket"),
        ),
        (
            "unknown client renew",
            reqwest::Method::POST,
            "/v1/clients/ghost/renew",
            Some(json!({})),
            404,
            None,
        ),
        (
            "a state change without JSON",
            reqwest::Method::POST,
            "/v1/clients/ghost/renew",
            None,
            415,
            None,
        ),
        ("no such endpoint", reqwest::Method::GET, "/v2/everything", None, 404, None),
        ("wrong method", reqwest::Method::PATCH, "/v1/limits/db", None, 405, None),
    ];
    for (label, method, path, body, expected, field) in cases {
        let (status, reply) = call(&c, method, serve.url(path), body).await;
        assert_eq!(status, expected, "{label}: {reply}");
        assert!(reply["error"].is_string(), "{label}: a JSON error, got {reply}");
        if let Some(field) = field {
            assert_eq!(reply["field"], field, "{label}: {reply}");
        }
    }
    // Malformed JSON.
    let malformed = c.put(serve.url("/v1/limits/x")).header("content-type", "application/json");
    let response = malformed.body("{not json").send().await.unwrap();
    assert_eq!(response.status(), 400);
    // An oversized body. The server answers before reading it all and drops the connection,
    // so these requests use unpooled clients (a pooled one could reuse the dropped connection).
    let fresh = || reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let big = format!("{{\"concurrent\": 1, \"pad\": \"{}\"}}", "x".repeat(200_000));
    let json = "application/json";
    let oversized = fresh().put(serve.url("/v1/limits/x")).header("content-type", json);
    let response = oversized.body(big).send().await.unwrap();
    assert_eq!(response.status(), 413);
    // Oversized headers.
    let response = fresh()
        .get(serve.url("/v1/limits"))
        .header("x-padding", "y".repeat(20_000))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 431);
    // Review finding (stop 73): hyper's buffer was the bound itself, so a head over it was
    // refused by hyper, without a body.
    let body: Value = response.json().await.expect("a JSON body");
    assert_eq!(body["code"], "headers_too_large", "{body}");
    // Too many waiters (the server allows 1 per limit here).
    assert_eq!(post(&c, &serve, "/v1/limits/db/acquire", json!({"client": "a"})).await.0, 200);
    assert_eq!(post(&c, &serve, "/v1/limits/db/acquire", json!({"client": "b"})).await.0, 202);
    let (status, reply) = post(&c, &serve, "/v1/limits/db/acquire", json!({"client": "c"})).await;
    assert_eq!((status, reply["limit"].as_str()), (429, Some("db")), "{reply}");
    // Removing a limit with permits held.
    let (status, reply) = call(&c, reqwest::Method::DELETE, serve.url("/v1/limits/db"), None).await;
    assert_eq!((status, reply["limit"].as_str()), (409, Some("db")));
}

#[tokio::test]
async fn asking_again_with_the_same_ticket_is_idempotent() {
    let serve = Serve::start(&[]);
    let c = http();
    put(&c, &serve, "/v1/limits/db", json!({"concurrent": 1})).await;
    let (_, first) =
        post(&c, &serve, "/v1/limits/db/acquire", json!({"client": "a", "ticket": 7})).await;
    let (_, again) =
        post(&c, &serve, "/v1/limits/db/acquire", json!({"client": "a", "ticket": 7})).await;
    assert_eq!(first["fencing_token"], again["fencing_token"]);
    assert_eq!((first["ticket"].as_u64(), again["ticket"].as_u64()), (Some(7), Some(7)));
    // Ticket 7 of this limit is a's: b naming it is refused, naming the ticket.
    let (status, refused) =
        post(&c, &serve, "/v1/limits/db/acquire", json!({"client": "b", "ticket": 7})).await;
    assert_eq!((status, refused["ticket"].as_u64()), (409, Some(7)), "{refused}");
    let (status, other) =
        post(&c, &serve, "/v1/limits/db/acquire", json!({"client": "b", "ticket": 8})).await;
    assert_eq!((status, other["reason"].as_str()), (202, Some("queued")));
    // A long-poll is answered as soon as the permit is returned.
    let waiting = tokio::spawn({
        let (c, url) = (c.clone(), serve.url("/v1/limits/db/acquire"));
        async move {
            let response = c
                .post(url)
                .json(&json!({"client": "b", "ticket": 8, "wait_ms": 5000}))
                .send()
                .await
                .unwrap();
            (response.status().as_u16(), Instant::now())
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let released = Instant::now();
    post(&c, &serve, "/v1/limits/db/release", json!({"client": "a", "ticket": 7})).await;
    let (status, at) = waiting.await.unwrap();
    assert_eq!(status, 200);
    // Answered by the release, not by the end of its 5 s wait; the margin is for a loaded
    // two-core CI host.
    assert!(at - released < Duration::from_millis(1000), "{:?}", at - released);
}

#[tokio::test]
async fn a_silent_client_loses_its_waiters_after_the_grace_and_its_permits_with_their_leases() {
    let serve = Serve::start(&["--queue-grace-ms", "300"]);
    let c = http();
    put(&c, &serve, "/v1/limits/db", json!({"concurrent": 1})).await;
    // `a` holds with a 400 ms lease and goes silent; `b` queues and goes silent too: its ticket
    // is withdrawn after the queue grace (300 ms).
    assert_eq!(
        post(&c, &serve, "/v1/limits/db/acquire", json!({"client": "a", "lease_ms": 400})).await.0,
        200
    );
    assert_eq!(
        // b's lease is long: a ticket wrongly kept past the grace would be granted a's permit
        // and hold it well past the poll below.
        post(&c, &serve, "/v1/limits/db/acquire", json!({"client": "b", "lease_ms": 5000})).await.0,
        202
    );
    let (_, info) = get(&c, &serve, "/v1/limits/db").await;
    assert_eq!((info["in_use"].as_u64(), info["waiting"].as_u64()), (Some(1), Some(1)));
    // Both are gone by the lease's end plus the server's 100 ms sweep, and a loaded runner's
    // slack (polled: the server is another process, which a busy host can run late).
    let silent = std::time::Instant::now();
    let info = loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (_, info) = get(&c, &serve, "/v1/limits/db").await;
        let gone = (info["in_use"].as_u64(), info["waiting"].as_u64()) == (Some(0), Some(0));
        if gone || silent.elapsed() > Duration::from_millis(1_000) {
            break info;
        }
    };
    assert_eq!((info["in_use"].as_u64(), info["waiting"].as_u64()), (Some(0), Some(0)), "{info}");
    // A renewing client keeps its permit past the lease (renewing every fifth of it: a renewal
    // late by a loaded host's stall still comes in time).
    let (_, held) =
        post(&c, &serve, "/v1/limits/db/acquire", json!({"client": "c", "lease_ms": 1000})).await;
    assert_eq!(held["granted"], true);
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(post(&c, &serve, "/v1/clients/c/renew", json!({})).await.0, 200);
    }
    let (_, info) = get(&c, &serve, "/v1/limits/db").await;
    assert_eq!(info["in_use"].as_u64(), Some(1), "renewed past its lease");
}

#[tokio::test]
async fn sigterm_answers_long_polls_and_exits_cleanly() {
    let serve = Serve::start(&[]);
    let c = http();
    put(&c, &serve, "/v1/limits/db", json!({"concurrent": 1})).await;
    post(&c, &serve, "/v1/limits/db/acquire", json!({"client": "a"})).await;
    let polling = tokio::spawn({
        let (c, url) = (c.clone(), serve.url("/v1/limits/db/acquire"));
        async move {
            let response =
                c.post(url).json(&json!({"client": "b", "wait_ms": 20000})).send().await.unwrap();
            (response.status().as_u16(), response.json::<Value>().await.unwrap())
        }
    });
    // The long-poll waits before the server is asked to stop (a fixed pause could end first on
    // a loaded host, and the request would then find the server gone).
    let deadline = Instant::now() + Duration::from_secs(5);
    while get(&c, &serve, "/v1/limits/db").await.1["waiting"] != 1 {
        assert!(Instant::now() < deadline, "b's long-poll never queued");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let asked_to_stop = Instant::now();
    let status = tokio::task::spawn_blocking(move || serve.terminate()).await.unwrap();
    assert!(status.success(), "exit status {status:?}");
    let (code, reply) = polling.await.unwrap();
    assert_eq!((code, reply["granted"].as_bool()), (202, Some(false)), "{reply}");
    assert!(asked_to_stop.elapsed() < Duration::from_secs(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_share_a_limit_through_redis() {
    let ns = format!("serve-test-{}", std::process::id());
    let url = common::redis_url();
    let a = Serve::start(&["--redis", &url, "--namespace", &ns]);
    let b = Serve::start(&["--redis", &url, "--namespace", &ns]);
    let c = http();
    let (status, reply) = put(&c, &a, "/v1/limits/shared", json!({"concurrent": 2})).await;
    assert_eq!(status, 200, "{reply}");
    let (most, mut tokens) = hammer_two_servers(&a, &b, "shared").await;
    let (_, info) = get(&c, &b, "/v1/limits/shared").await;
    assert!(most <= 2, "held at once: {most} ({info})");
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), 120, "no fencing token twice");
    assert_eq!(info["max_in_use"].as_u64(), Some(2), "{info}");
    assert_eq!(info["granted_total"].as_u64(), Some(120));
    clean_namespace(&url, &ns).await;
}

/// Defines new limits on `servers` from many requests at once: the names each server took.
async fn race_new_limits(servers: &[&Serve], names: usize) -> Vec<String> {
    let c = http();
    let mut puts = tokio::task::JoinSet::new();
    for i in 0..names {
        let name = format!("race-{i}");
        let url = servers[i % servers.len()].url(&format!("/v1/limits/{name}"));
        let c = c.clone();
        puts.spawn(async move {
            let (status, reply) =
                call(&c, reqwest::Method::PUT, url, Some(json!({"concurrent": 1}))).await;
            match status {
                200 => Some(name),
                429 => {
                    assert_eq!(reply["code"], "too_many_limits", "{reply}");
                    None
                }
                _ => panic!("{status} {reply}"),
            }
        });
    }
    puts.join_all().await.into_iter().flatten().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_limits_defined_at_once_stay_within_max_limits() {
    // Review finding (stop 73): the cap was a count, then a define, so requests at once all
    // passed the count. On Redis each step is a round trip, and two servers share the count.
    let ns = format!("serve-cap-{}", std::process::id());
    let url = common::redis_url();
    let a = Serve::start(&["--redis", &url, "--namespace", &ns, "--max-limits", "3"]);
    let b = Serve::start(&["--redis", &url, "--namespace", &ns, "--max-limits", "3"]);
    let local = Serve::start(&["--max-limits", "3"]);
    for servers in [&[&a, &b][..], &[&local][..]] {
        let taken = race_new_limits(servers, 40).await;
        let (status, list) = get(&http(), servers[0], "/v1/limits").await;
        assert_eq!(status, 200, "{list}");
        let listed = list["limits"].as_array().unwrap().len();
        assert_eq!((taken.len(), listed), (3, 3), "defined: {taken:?}, listed: {list}");
    }
    clean_namespace(&url, &ns).await;
}

/// Review finding (stop 74): asking again for a held ticket answered a whole new lease, while
/// the backend kept the old one's end: past it, another client was granted the permit its
/// holder was told it held.
#[tokio::test]
async fn asking_again_for_a_held_ticket_starts_its_lease_again() {
    let serve = Serve::start(&[]);
    let c = http();
    put(&c, &serve, "/v1/limits/db", json!({"concurrent": 1})).await;
    let ask = json!({"client": "a", "ticket": 1, "lease_ms": 1000});
    let (status, first) = post(&c, &serve, "/v1/limits/db/acquire", ask.clone()).await;
    assert_eq!(status, 200, "{first}");
    tokio::time::sleep(Duration::from_millis(700)).await;
    let (status, again) = post(&c, &serve, "/v1/limits/db/acquire", ask).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["fencing_token"], first["fencing_token"], "the same permit");
    assert_eq!(again["lease_expires_in_ms"], 1000);
    // Past the first lease's end, within the second's.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let other = json!({"client": "b", "ticket": 2, "wait_ms": 0});
    let (status, reply) = post(&c, &serve, "/v1/limits/db/acquire", other).await;
    assert_eq!(status, 202, "a's permit is still held: {reply}");
}

/// Review finding (stop 74): a 202 told its client to come back after the rate's whole wait
/// (or the re-ask interval), though the sweep withdraws a queued ticket nobody asks about for
/// the queue grace: a client that did as told had lost its place.
#[tokio::test]
async fn a_queued_ticket_is_told_to_come_back_within_the_queue_grace() {
    let serve = Serve::start(&["--queue-grace-ms", "400"]);
    let c = http();
    let spec = json!({"concurrent": 10, "per_second": 0.2, "burst": 1});
    put(&c, &serve, "/v1/limits/r", spec).await;
    let (status, _) = post(&c, &serve, "/v1/limits/r/acquire", json!({"client": "a"})).await;
    assert_eq!(status, 200);
    let ask = json!({"client": "b", "ticket": 2, "wait_ms": 0});
    let (status, reply) = post(&c, &serve, "/v1/limits/r/acquire", ask.clone()).await;
    assert_eq!((status, reply["reason"].as_str()), (202, Some("rate")), "{reply}");
    let after = reply["retry_after_ms"].as_u64().unwrap();
    assert!(after <= 200, "told to come back after {after} ms, past half the grace");
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(after)).await;
        let (status, reply) = post(&c, &serve, "/v1/limits/r/acquire", ask.clone()).await;
        assert_eq!(status, 202, "{reply}");
    }
    // Kept all along: never withdrawn by the sweep (its events are counted every 100 ms).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let metrics = c.get(serve.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("kind=\"queued\""), "{metrics}");
    assert!(!metrics.contains("kind=\"waiter_withdrawn\""), "{metrics}");
}

#[test]
fn fuzzed_requests_never_get_a_server_error() {
    let serve = Serve::start(&["--max-waiters", "5"]);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let c = http();
    runtime.block_on(put(&c, &serve, "/v1/limits/fuzz", json!({"concurrent": 2})));
    let paths = [
        "/v1/limits/fuzz",
        "/v1/limits/fuzz/acquire",
        "/v1/limits/fuzz/release",
        "/v1/limits/other/acquire",
        "/v1/clients/fuzz/renew",
        "/v1/limits/%00bad",
        "/v1/limits",
    ];
    let methods = [
        reqwest::Method::GET,
        reqwest::Method::POST,
        reqwest::Method::PUT,
        reqwest::Method::DELETE,
    ];
    let config =
        ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() };
    proptest!(config, |(path in 0..paths.len(), method in 0..methods.len(), body in common::arbitrary_json())| {
        let (status, reply) = runtime.block_on(call(&c, methods[method].clone(), serve.url(paths[path]), Some(body.clone())));
        prop_assert!(status < 500 || status == 503, "{} {} {body} -> {status} {reply}", methods[method], paths[path]);
    });
}

#[tokio::test]
async fn a_config_file_predefines_limits_and_a_bad_one_is_refused() {
    let dir = std::env::temp_dir().join(format!("lanes-serve-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("lanes.toml");
    std::fs::write(
        &good,
        "namespace = \"test\"\n[limits.payments-api]\nconcurrent = 10\nper_second = 100.0\nburst = 20\n",
    )
    .unwrap();
    let serve = Serve::start(&["--config", good.to_str().unwrap()]);
    let (status, limit) = get(&http(), &serve, "/v1/limits/payments-api").await;
    assert_eq!(status, 200, "{limit}");
    assert_eq!((limit["concurrent"].as_u64(), limit["burst"].as_u64()), (Some(10), Some(20)));
    assert_eq!(limit["per_second"].as_f64(), Some(100.0));
    drop(serve);

    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "[limits.broken]\nconcurrent = 0\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lanes"))
        .args(["serve", "--listen", "127.0.0.1:0", "--config", bad.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("limits.broken") && stderr.contains("concurrent"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two servers on one Redis serve a limit defined leased from their shares: HTTP clients of
/// both never hold more than `concurrent` permits together, every acquire is granted, and the
/// fencing tokens are unique.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_serve_a_leased_limit_from_their_shares() {
    use lanes::limit::share::SharePolicy;
    let ns = format!("serve-leased-{}", std::process::id());
    let url = common::redis_url();
    let a = Serve::start(&["--redis", &url, "--namespace", &ns]);
    let b = Serve::start(&["--redis", &url, "--namespace", &ns]);
    let definer = lanes_redis::RedisLimits::builder(url.as_str())
        .namespace(ns.as_str())
        .build()
        .await
        .expect("Redis answers (REDIS_URL)");
    definer
        .define_leased("leased", lanes::LimitSpec::concurrent(3), SharePolicy::MaxMinFair)
        .await
        .unwrap();
    let (most, mut tokens) = hammer_two_servers(&a, &b, "leased").await;
    assert!(most <= 3, "held at once: {most}");
    let total = tokens.len();
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!((total, tokens.len()), (120, 120), "every acquire granted, no token twice");
    // Both servers served it leased: the ledger lists them (and the definer).
    let info = lanes::LimitBackend::info(&definer, "leased").await.unwrap().unwrap();
    assert!(info.shares.len() >= 3, "{info:?}");
    drop(definer);
    clean_namespace(&url, &ns).await;
}

/// Eight HTTP workers, half on each server, each doing 15 acquire / hold 3 ms / release cycles
/// on `limit`, counting the holders across both. Returns the most held at once and every
/// fencing token granted.
async fn hammer_two_servers(a: &Serve, b: &Serve, limit: &str) -> (i64, Vec<u64>) {
    let c = http();
    let holders = Arc::new(AtomicI64::new(0));
    let most = Arc::new(AtomicI64::new(0));
    let tokens = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..8 {
        let server = if i % 2 == 0 { a } else { b };
        let base = server.url(&format!("/v1/limits/{limit}"));
        let (c, holders, most, tokens) = (c.clone(), holders.clone(), most.clone(), tokens.clone());
        tasks.push(tokio::spawn(async move {
            let client = format!("worker-{i}");
            for _ in 0..15 {
                let mut ticket = None;
                let token = loop {
                    let reply: Value = c
                        .post(format!("{base}/acquire"))
                        .json(&json!({"client": client, "ticket": ticket, "wait_ms": 2000}))
                        .send()
                        .await
                        .unwrap()
                        .json()
                        .await
                        .unwrap();
                    ticket = reply["ticket"].as_u64();
                    if reply["granted"] == true {
                        break reply["fencing_token"].as_u64().expect("a token");
                    }
                };
                let now = holders.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokens.lock().unwrap().push(token);
                tokio::time::sleep(Duration::from_millis(3)).await;
                holders.fetch_sub(1, Ordering::SeqCst);
                c.post(format!("{base}/release"))
                    .json(&json!({"client": client, "ticket": ticket}))
                    .send()
                    .await
                    .unwrap();
            }
        }));
    }
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(60), task).await.expect("workers end").unwrap();
    }
    let tokens = tokens.lock().unwrap().clone();
    (most.load(Ordering::SeqCst), tokens)
}

/// Deletes every key of namespace `ns` on the Redis at `url` (one key per DEL).
async fn clean_namespace(url: &str, ns: &str) {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    for pattern in [format!("{{{ns}:*"), format!("lanes:{{{ns}}}:*")] {
        let keys: Vec<String> =
            redis::cmd("KEYS").arg(pattern).query_async(&mut conn).await.unwrap();
        for key in keys {
            let _: () = redis::cmd("DEL").arg(key).query_async(&mut conn).await.unwrap();
        }
    }
}
