//! The dashboard in a real browser (headless Chromium): a defined limit appears, and its
//! in-use figure follows an acquire. Leaves a screenshot in the test's target directory.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{Serve, chromium, http, rendered};
use serde_json::json;

/// The text of the in-use cell of `limit`'s row.
fn in_use(dom: &str, limit: &str) -> Option<String> {
    let row = dom.split(&format!("data-limit=\"{limit}\"")).nth(1)?;
    let cell = row.split("class=\"num in-use\">").nth(1)?;
    Some(cell.split('<').next()?.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_limits_and_follows_them() {
    let serve = Serve::start(&[]);
    let c = http();
    c.put(serve.url("/v1/limits/browser-check"))
        .json(&json!({"concurrent": 3}))
        .send()
        .await
        .unwrap();
    let url = serve.url("/");
    let dom = tokio::task::spawn_blocking({
        let url = url.clone();
        move || rendered(&url)
    })
    .await
    .unwrap();
    assert_eq!(in_use(&dom, "browser-check").as_deref(), Some("0 / 3"), "{dom}");
    assert!(!dom.contains("server/events"), "the server's internal channel is hidden");

    let granted = c
        .post(serve.url("/v1/limits/browser-check/acquire"))
        .json(&json!({"client": "browser-test", "lease_ms": 60000}))
        .send()
        .await
        .unwrap();
    assert_eq!(granted.status(), 200);
    let dom = tokio::task::spawn_blocking({
        let url = url.clone();
        move || rendered(&url)
    })
    .await
    .unwrap();
    assert_eq!(in_use(&dom, "browser-check").as_deref(), Some("1 / 3"), "{dom}");

    let shot = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard.png");
    let _ = std::fs::remove_file(&shot);
    let status = tokio::task::spawn_blocking({
        let shot = shot.clone();
        move || {
            Command::new(chromium())
                .args(["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"])
                .args(["--window-size=1280,720", "--virtual-time-budget=3000"])
                .arg(format!("--screenshot={}", shot.display()))
                .arg(url)
                .output()
                .expect("run chromium")
        }
    })
    .await
    .unwrap();
    assert!(status.status.success());
    let size = std::fs::metadata(&shot).expect("a screenshot").len();
    assert!(size > 5_000, "a real screenshot, {size} bytes");
    println!("dashboard screenshot: {}", shot.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_works_with_a_read_token_on_a_server_with_tokens() {
    let admin = "admin-token-0123456789";
    let read = "read-token-0123456789";
    let tokens = format!("admin:{admin} read:{read}");
    let serve = Serve::start_with("127.0.0.1:0", &[], &[("LANES_TOKENS", &tokens)]);
    let c = http();
    let defined = c
        .put(serve.url("/v1/limits/guarded"))
        .bearer_auth(admin)
        .json(&json!({"concurrent": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(defined.status(), 200);
    let (without, with) = tokio::task::spawn_blocking({
        let (plain, tokened) = (serve.url("/"), serve.url(&format!("/#token={read}")));
        move || (rendered(&plain), rendered(&tokened))
    })
    .await
    .unwrap();
    assert_eq!(in_use(&without, "guarded"), None, "shown without a token");
    assert!(without.contains("followed by a read token)"), "no hint about the token: {without}");
    assert_eq!(in_use(&with, "guarded").as_deref(), Some("0 / 4"), "{with}");
}

/// The DOM of `url` in a window `width` pixels wide, and a screenshot of it.
fn at_width(url: &str, width: u32) -> (String, PathBuf) {
    let size = format!("--window-size={width},900");
    let dom = Command::new(chromium())
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", &size])
        .args(["--virtual-time-budget=3000", "--dump-dom", url])
        .output()
        .expect("run chromium");
    assert!(dom.status.success(), "{}", String::from_utf8_lossy(&dom.stderr));
    let shot = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("dashboard-{width}.png"));
    let _ = std::fs::remove_file(&shot);
    let taken = Command::new(chromium())
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", &size])
        .arg("--virtual-time-budget=3000")
        .arg(format!("--screenshot={}", shot.display()))
        .arg(url)
        .output()
        .expect("run chromium");
    assert!(taken.status.success());
    (String::from_utf8(dom.stdout).expect("UTF-8"), shot)
}

/// The text of the first cell with class `class` in the per-key row of `key` under `limit`.
fn key_cell(dom: &str, limit: &str, key: &str, class: &str) -> Option<String> {
    let keys = dom.split(&format!("data-keys-of=\"{limit}\"")).nth(1)?;
    let row = keys.split(&format!("data-key=\"{key}\"")).nth(1)?;
    let cell = row.split(&format!("class=\"num {class}\">")).nth(1)?;
    Some(cell.split('<').next()?.to_owned())
}

/// Fairness made visible: a limit's waiters per fairness key, refusals, the client list and
/// the links, in a layout that fits a 700-pixel window as well as a wide one (no page wider
/// than the window), with a screenshot at each width.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_each_fairness_key_at_700_and_1280_pixels() {
    let serve = Serve::start(&[]);
    let c = http();
    c.put(serve.url("/v1/limits/shared")).json(&json!({"concurrent": 1})).send().await.unwrap();
    let acquire = |client: &str, key: &str| {
        // Long-polls: the waiters stay in the queue while the page is rendered, four Chromium
        // runs beside the other tests' on two cores; the server's longest wait (30 s), since
        // 20 s ran out before the second width in a CI run.
        let body = json!({"client": client, "lease_ms": 60000, "wait_ms": 30000, "priority": {"key": key}});
        c.post(serve.url("/v1/limits/shared/acquire")).json(&body).send()
    };
    let held = acquire("holder", "tenant-a").await.unwrap();
    assert_eq!(held.status(), 200);
    let mut waiters = Vec::new();
    for (client, key) in [("a1", "tenant-a"), ("a2", "tenant-a"), ("b1", "tenant-b")] {
        waiters.push(tokio::spawn(acquire(client, key)));
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let tried = c
        .post(serve.url("/v1/limits/shared/acquire"))
        .json(&json!({"client": "tryer", "queue": false}))
        .send()
        .await
        .unwrap();
    assert_eq!(tried.status(), 429);

    let url = serve.url("/");
    let shots = tokio::task::spawn_blocking(move || [700, 1280].map(|w| (w, at_width(&url, w))))
        .await
        .unwrap();
    for (width, (dom, shot)) in shots {
        assert!(dom.contains("data-overflow=\"no\""), "the page fits {width} px:\n{dom}");
        assert_eq!(
            key_cell(&dom, "shared", "tenant-a", "key-waiting").as_deref(),
            Some("2"),
            "{dom}"
        );
        assert_eq!(key_cell(&dom, "shared", "tenant-b", "key-waiting").as_deref(), Some("1"));
        assert_eq!(key_cell(&dom, "shared", "tenant-a", "key-grants").as_deref(), Some("1"));
        let refused = dom.split("data-limit=\"shared\"").nth(1).unwrap();
        assert!(refused.contains("class=\"num refused bad\">1<"), "the refused try counts: {dom}");
        for client in ["holder", "a1", "a2", "b1"] {
            assert!(dom.contains(&format!("<td>{client}</td>")), "{client} in the client list");
        }
        assert!(dom.contains("href=\"/metrics\"") && dom.contains("href=\"/openapi.json\""));
        let size = std::fs::metadata(&shot).expect("a screenshot").len();
        assert!(size > 5_000, "a real screenshot at {width} px, {size} bytes");
        println!("dashboard at {width} px: {}", shot.display());
    }
    waiters.into_iter().for_each(|w| w.abort());
}

/// Leased limits on Redis: the dashboard of a server on that Redis names their mode and shows
/// each client's share, permits out and demand, and for a rate its part of the rate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_a_leased_limits_shares() {
    use lanes::limit::share::SharePolicy;
    let url = common::redis_url();
    let ns = format!("dash-leased-{}", std::process::id());
    let serve = Serve::start(&["--redis", &url, "--namespace", &ns]);
    let client = lanes_redis::RedisLimits::builder(url.as_str())
        .namespace(ns.as_str())
        .build()
        .await
        .expect("Redis answers (REDIS_URL)");
    client
        .define_leased("leased-pool", lanes::LimitSpec::concurrent(4), SharePolicy::MaxMinFair)
        .await
        .unwrap();
    client
        .define_leased("leased-rate", lanes::LimitSpec::rate(50.0), SharePolicy::MaxMinFair)
        .await
        .unwrap();
    let limits = lanes::Limits::with_backend(client.clone());
    let mut held = Vec::new();
    for limit in ["leased-pool", "leased-rate"] {
        let permit = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            limits.acquire(limit, lanes::Priority::default()),
        )
        .await
        .expect("granted from the share")
        .unwrap();
        held.push(permit);
    }
    // A refresh reports the demand and brings the share down to it (polled: on a loaded host
    // the refresh can come later than any fixed pause).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while client.share("leased-pool") != Some((1, 1)) || client.rate_share("leased-rate").is_none()
    {
        assert!(std::time::Instant::now() < deadline, "{:?}", client.share("leased-pool"));
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let dom = tokio::task::spawn_blocking({
        let url = serve.url("/");
        move || rendered(&url)
    })
    .await
    .unwrap();
    assert!(dom.contains("leased-pool (leased, maxmin)"), "the mode is shown: {dom}");
    let row = dom.split("data-limit-shares=\"leased-pool\"").nth(1).expect("a shares row");
    // It wants one permit (the one out), so its share is one, not all four.
    let expected = format!("client {}: share 1, out 1, wants 1", client.ledger_id());
    assert!(row.contains(&expected), "{expected} in {row}");
    // A leased rate: each client's part of the rate, and the rate it wanted.
    let row = dom.split("data-limit-shares=\"leased-rate\"").nth(1).expect("a rate shares row");
    let row = row.split("</tr>").next().unwrap_or(row);
    assert!(row.contains(", rate ") && row.contains("/s wanted"), "the rate share in {row}");
}
