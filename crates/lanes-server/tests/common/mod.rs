//! A real `lanes serve` process for the HTTP tests.
#![allow(dead_code, unreachable_pub)] // each test binary uses part of this module

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use proptest::prelude::*;
use serde_json::Value;

/// A `lanes serve` on a free port, killed on drop.
pub struct Serve {
    pub base: String,
    child: Option<Child>,
}

impl Serve {
    /// Starts `lanes serve --listen 127.0.0.1:0` with `args`; returns once it listens.
    pub fn start(args: &[&str]) -> Self {
        Self::start_at("127.0.0.1:0", args)
    }

    /// Starts `lanes serve --listen ADDR` with `args` (a fixed address: a restart on the same
    /// port); returns once it listens.
    pub fn start_at(listen: &str, args: &[&str]) -> Self {
        Self::start_with(listen, args, &[])
    }

    /// Starts `lanes serve --listen ADDR` with `args` and environment variables `envs` (logs
    /// at `warn` unless `RUST_LOG` is among them); returns once it listens.
    pub fn start_with(listen: &str, args: &[&str], envs: &[(&str, &str)]) -> Self {
        let mut command = Command::new(env!("CARGO_BIN_EXE_lanes"));
        command.env("RUST_LOG", "warn").env_remove("LANES_TOKENS");
        for (key, value) in envs {
            command.env(key, value);
        }
        let mut child = command
            .args(["serve", "--listen", listen])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("run the lanes binary");
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let first = lines.next().expect("a first line").expect("readable");
        let base = first
            .strip_prefix("lanes serve: listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
            .trim()
            .to_owned();
        // Keep draining stdout so the server never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Self { base, child: Some(child) }
    }

    /// The server's resident memory, in KiB (from /proc).
    pub fn rss_kib(&self) -> u64 {
        let pid = self.child.as_ref().expect("running").id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS")
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().unwrap();
        let pid = child.id().to_string();
        Command::new("kill").args(["-TERM", &pid]).status().expect("kill");
        for _ in 0..100 {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        panic!("lanes serve did not exit within 5 s of SIGTERM");
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Sends a request, with a bearer token and a JSON body if given; (status, body as JSON, or
/// as a string when it is not JSON).
pub async fn request(
    c: &reqwest::Client,
    method: reqwest::Method,
    url: String,
    token: Option<&str>,
    body: Option<serde_json::Value>,
) -> (u16, serde_json::Value) {
    let mut request = c.request(method, url);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.expect("the server answers");
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)))
}

pub fn http() -> reqwest::Client {
    reqwest::Client::new()
}

pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// Arbitrary JSON, mostly objects with the API's field names.
pub fn arbitrary_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
        "[a-z0-9 _\\-]{0,12}".prop_map(Value::from),
    ];
    let keys = prop_oneof![
        Just("concurrent"),
        Just("per_second"),
        Just("burst"),
        Just("client"),
        Just("ticket"),
        Just("priority"),
        Just("lease_ms"),
        Just("wait_ms"),
        Just("level"),
        Just("key"),
        Just("weight"),
        Just("other"),
    ];
    leaf.prop_recursive(3, 24, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            prop::collection::btree_map(keys.clone().prop_map(str::to_owned), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// The headless Chromium to drive (`CHROMIUM`, or the first found).
pub fn chromium() -> String {
    if let Ok(path) = std::env::var("CHROMIUM") {
        return path;
    }
    for candidate in ["chromium", "chromium-browser", "google-chrome"] {
        if Command::new(candidate).arg("--version").output().is_ok_and(|o| o.status.success()) {
            return candidate.to_owned();
        }
    }
    panic!(
        "headless Chromium is needed for the dashboard test: `apt-get install chromium` (scripts/services.sh does it) or set CHROMIUM"
    );
}

/// The page's DOM after its scripts ran (they poll the snapshot every second).
pub fn rendered(url: &str) -> String {
    let out = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--virtual-time-budget=3000",
            "--dump-dom",
            url,
        ])
        .output()
        .expect("run chromium");
    assert!(out.status.success(), "chromium failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("UTF-8 DOM")
}
