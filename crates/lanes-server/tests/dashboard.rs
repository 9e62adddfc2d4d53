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
