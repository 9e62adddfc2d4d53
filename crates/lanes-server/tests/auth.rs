//! `lanes serve` with API tokens, against the real binary: every role allowed and refused on
//! every endpoint, client ids bound to tokens, the loopback-only open mode, the browser guards
//! (content type, origin, host), the limit and client caps, metric series of deleted limits,
//! health checks, access logs, and `RemoteLimits` with a token.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::Serve;
use lanes::LimitBackend;
use serde_json::{Value, json};

const ADMIN: &str = "admin-token-0123456789";
const CLIENT: &str = "client-token-0123456789";
const READ: &str = "read-token-0123456789";

fn tokens() -> String {
    format!("admin:{ADMIN} client:{CLIENT}:w1,batch-* read:{READ}")
}

fn serve(args: &[&str]) -> Serve {
    Serve::start_with("127.0.0.1:0", args, &[("LANES_TOKENS", &tokens())])
}

/// Sends a request with an optional bearer token and JSON body; (status, body).
async fn send(
    serve: &Serve,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> (u16, Value) {
    let c = reqwest::Client::new();
    common::request(&c, method.parse().unwrap(), serve.url(path), token, body).await
}

/// As `send` without a token, with the answer's `Retry-After` header.
async fn send_for_retry(
    serve: &Serve,
    method: &str,
    path: &str,
    body: Value,
) -> (u16, Value, Option<String>) {
    let c = reqwest::Client::new();
    let response = c.request(method.parse().unwrap(), serve.url(path)).json(&body).send().await;
    let response = response.expect("the server answers");
    let status = response.status().as_u16();
    let retry = response.headers().get("retry-after").map(|v| v.to_str().unwrap().to_owned());
    (status, response.json().await.unwrap(), retry)
}

/// Sends `head` (and no more) to `addr`; the first bytes of the answer, which must come within
/// 3 s.
fn first_answer(addr: &str, head: &str) -> String {
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream.write_all(head.as_bytes()).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut answer = [0; 4096];
    let read = stream.read(&mut answer).expect("an answer before the body timeout");
    String::from_utf8_lossy(&answer[..read]).into_owned()
}

/// Review finding (stop 73): a request's body was read before its token was checked, so
/// anyone who reached the port could have the server wait out the body timeout and buffer up
/// to `--max-body` on every connection. A request without a token is refused on its head.
#[test]
fn a_request_without_a_token_is_refused_before_its_body_is_read() {
    let serve = serve(&["--body-timeout-ms", "5000"]);
    let addr = serve.base.trim_start_matches("http://").to_owned();
    let head = format!(
        "PUT /v1/limits/db HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: 60000\r\n\r\n{{"
    );
    let answer = first_answer(&addr, &head);
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    // Nor on a public path, which takes no body (review finding, stop 74).
    let head = format!("GET /healthz HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 60000\r\n\r\n{{");
    let answer = first_answer(&addr, &head);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

#[tokio::test]
async fn every_role_is_allowed_and_refused_where_it_should_be_on_every_endpoint() {
    let serve = serve(&[]);
    let (status, _) =
        send(&serve, "PUT", "/v1/limits/db", Some(ADMIN), Some(json!({"concurrent": 100}))).await;
    assert_eq!(status, 200);
    // (method, path, body, the least role that may: 0 none, 1 read, 2 client, 3 admin)
    let acquire = json!({"client": "w1", "wait_ms": 0});
    let endpoints: Vec<(&str, &str, Option<Value>, u8)> = vec![
        ("GET", "/healthz", None, 0),
        ("GET", "/readyz", None, 0),
        ("GET", "/", None, 0),
        ("GET", "/v1/limits", None, 1),
        ("GET", "/v1/limits/db", None, 1),
        ("GET", "/v1/snapshot", None, 1),
        ("GET", "/metrics", None, 1),
        ("GET", "/openapi.json", None, 1),
        ("POST", "/v1/limits/db/acquire", Some(acquire), 2),
        ("POST", "/v1/limits/db/release", Some(json!({"client": "w1", "ticket": 1})), 2),
        ("POST", "/v1/clients/w1/renew", Some(json!({})), 2),
        ("PUT", "/v1/limits/other", Some(json!({"concurrent": 1})), 3),
        ("DELETE", "/v1/limits/other", None, 3),
    ];
    let roles = [
        (None, 0u8),
        (Some("wrong-token-0123456789"), 0),
        (Some(READ), 1),
        (Some(CLIENT), 2),
        (Some(ADMIN), 3),
    ];
    for (method, path, body, least) in &endpoints {
        for (token, level) in roles {
            let (status, answer) = send(&serve, method, path, token, body.clone()).await;
            let what = format!("{method} {path} with {token:?}: {status} {answer}");
            if *least == 0 || level >= *least {
                assert!(![401, 403].contains(&status), "refused: {what}");
            } else if level == 0 {
                assert_eq!(status, 401, "{what}");
                assert_eq!(answer["code"], "unauthorized", "{what}");
            } else {
                assert_eq!(status, 403, "{what}");
                assert_eq!(answer["code"], "forbidden", "{what}");
            }
        }
    }
}

#[tokio::test]
async fn a_client_token_acts_only_as_the_client_ids_it_is_bound_to() {
    let serve = serve(&[]);
    send(&serve, "PUT", "/v1/limits/db", Some(ADMIN), Some(json!({"concurrent": 5}))).await;
    for (client, allowed) in
        [("w1", true), ("w1~7", true), ("batch-9", true), ("w2", false), ("w10", false)]
    {
        let body = json!({"client": client, "wait_ms": 0});
        let (status, answer) =
            send(&serve, "POST", "/v1/limits/db/acquire", Some(CLIENT), Some(body)).await;
        assert_eq!(status == 403, !allowed, "{client}: {status} {answer}");
        let renew = format!("/v1/clients/{client}/renew");
        let (status, _) = send(&serve, "POST", &renew, Some(CLIENT), Some(json!({}))).await;
        assert_eq!(status == 403, !allowed, "renew {client}: {status}");
    }
    // The admin acts as anyone.
    let body = json!({"client": "w2", "wait_ms": 0});
    let (status, _) = send(&serve, "POST", "/v1/limits/db/acquire", Some(ADMIN), Some(body)).await;
    assert_eq!(status, 200);
}

#[test]
fn without_tokens_it_refuses_a_non_loopback_address_unless_told_it_is_insecure() {
    let out = Command::new(env!("CARGO_BIN_EXE_lanes"))
        .args(["serve", "--listen", "0.0.0.0:0"])
        .env_remove("LANES_TOKENS")
        .output()
        .expect("run lanes");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("without API tokens") && stderr.contains("--insecure-no-auth"),
        "{stderr}"
    );
    let serve = Serve::start_with("0.0.0.0:0", &["--insecure-no-auth"], &[]);
    assert!(serve.base.contains("0.0.0.0"));
    // A token too short, or a client token bound to nobody, is refused at start.
    for bad in ["read:short", "client:client-token-0123456789"] {
        let out = Command::new(env!("CARGO_BIN_EXE_lanes"))
            .args(["serve", "--listen", "127.0.0.1:0"])
            .env("LANES_TOKENS", bad)
            .output()
            .expect("run lanes");
        assert!(!out.status.success(), "{bad}");
        assert!(!String::from_utf8_lossy(&out.stderr).contains("0123456789"), "secret echoed");
    }
}

#[tokio::test]
async fn a_browser_cannot_change_state_cross_site_or_through_a_foreign_host() {
    let serve = Serve::start(&[]);
    let c = reqwest::Client::new();
    let url = serve.url("/v1/limits/db");
    // A form-style body (no preflight in a browser) is refused.
    let plain = c.put(&url).header("content-type", "text/plain").body(r#"{"concurrent":1}"#);
    let response = plain.send().await.unwrap();
    assert_eq!(response.status(), 415);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["code"], "unsupported_media_type");
    // A foreign origin is refused, the server's own is not.
    let foreign =
        c.put(&url).header("origin", "http://evil.example").json(&json!({"concurrent": 1}));
    assert_eq!(foreign.send().await.unwrap().status(), 403);
    let own = serve.base.clone();
    let same = c.put(&url).header("origin", own).json(&json!({"concurrent": 1}));
    assert_eq!(same.send().await.unwrap().status(), 200);
    // A foreign Host (DNS rebinding) is refused on a loopback server; the dashboard is not.
    let rebound = c.get(serve.url("/v1/limits")).header("host", "evil.example");
    let response = rebound.send().await.unwrap();
    assert_eq!(response.status(), 403);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["code"], "host_not_allowed");
    let port = serve.base.rsplit(':').next().unwrap().to_owned();
    let local = c.get(serve.url("/")).header("host", format!("localhost:{port}"));
    assert_eq!(local.send().await.unwrap().status(), 200);
}

#[tokio::test]
async fn the_limit_and_client_caps_answer_their_typed_errors() {
    let serve = Serve::start(&["--max-limits", "2", "--max-clients", "2"]);
    for name in ["a", "b"] {
        let (status, _) = send(
            &serve,
            "PUT",
            &format!("/v1/limits/{name}"),
            None,
            Some(json!({"concurrent": 10})),
        )
        .await;
        assert_eq!(status, 200);
    }
    // Every 429 carries a `Retry-After` (review finding, stop 79: these three had none).
    let (status, body, retry) =
        send_for_retry(&serve, "PUT", "/v1/limits/c", json!({"concurrent": 1})).await;
    assert_eq!((status, body["code"].as_str()), (429, Some("too_many_limits")), "{body}");
    assert_eq!(retry.as_deref(), Some("1"), "too_many_limits");
    // Redefining an existing limit is not a new one.
    let (status, _) =
        send(&serve, "PUT", "/v1/limits/a", None, Some(json!({"concurrent": 3}))).await;
    assert_eq!(status, 200);
    for client in ["x", "y"] {
        let body = json!({"client": client, "wait_ms": 0});
        let (status, _) = send(&serve, "POST", "/v1/limits/a/acquire", None, Some(body)).await;
        assert_eq!(status, 200);
    }
    let body = json!({"client": "z", "wait_ms": 0});
    let (status, answer, retry) =
        send_for_retry(&serve, "POST", "/v1/limits/a/acquire", body).await;
    assert_eq!((status, answer["code"].as_str()), (429, Some("too_many_clients")), "{answer}");
    assert_eq!(retry.as_deref(), Some("1"), "too_many_clients");
    // A full waiting room has its code too (review finding, stop 73: it had none).
    let waiters = Serve::start(&["--max-waiters", "1"]);
    let (status, _) =
        send(&waiters, "PUT", "/v1/limits/a", None, Some(json!({"concurrent": 1}))).await;
    assert_eq!(status, 200);
    let mut codes = Vec::new();
    let mut retry = None;
    for client in ["x", "y", "z"] {
        let body = json!({"client": client, "wait_ms": 0});
        let answer = send_for_retry(&waiters, "POST", "/v1/limits/a/acquire", body).await;
        codes.push((answer.0, answer.1["code"].as_str().map(str::to_owned)));
        retry = answer.2;
    }
    assert_eq!(codes[2], (429, Some("too_many_waiters".to_owned())), "{codes:?}");
    assert_eq!(retry.as_deref(), Some("1"), "too_many_waiters");
}

/// Review finding (stop 73): settings the server cannot work with were accepted: a huge
/// `--max-connections` left a server that said it listened and refused every connection, a
/// default lease under the minimum made every acquire without `lease_ms` a 400, a body limit
/// of 0 made every POST a 413, and `lanes.toml` limits were neither counted against
/// `max_limits` nor checked as names.
#[test]
fn settings_the_server_cannot_work_with_are_refused_at_start() {
    let dir = std::env::temp_dir().join(format!("lanes-bad-settings-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let unnamed = dir.join("unnamed.toml");
    std::fs::write(&unnamed, "[limits.\"\"]\nconcurrent = 1\n").unwrap();
    let many = dir.join("many.toml");
    std::fs::write(
        &many,
        "max_limits = 1\n[limits.a]\nconcurrent = 1\n[limits.b]\nconcurrent = 1\n",
    )
    .unwrap();
    let (unnamed, many) = (unnamed.to_str().unwrap(), many.to_str().unwrap());
    for (args, says) in [
        (&["--max-connections", "18446744073709551615"][..], "max connections"),
        (&["--default-lease-ms", "50"], "default lease"),
        (&["--max-body", "0"], "max body"),
        (&["--config", unnamed], "limit name"),
        (&["--config", many], "max limits"),
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_lanes"))
            .arg("serve")
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run lanes");
        // A server that started anyway is stopped, and fails the test, rather than hanging it.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while child.try_wait().unwrap().is_none() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(says), "{args:?}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn deleted_limits_leave_no_metric_series_and_health_checks_answer() {
    let serve = Serve::start(&[]);
    for i in 0..300 {
        let path = format!("/v1/limits/gone-{i}");
        let (status, _) = send(&serve, "PUT", &path, None, Some(json!({"concurrent": 1}))).await;
        assert_eq!(status, 200);
    }
    let c = reqwest::Client::new();
    let during = c.get(serve.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(during.contains("lanes_limit_concurrent{limit=\"gone-299\"} 1"), "{during}");
    assert!(during.contains("# HELP lanes_limit_in_use"));
    for i in 0..300 {
        let (status, _) = send(&serve, "DELETE", &format!("/v1/limits/gone-{i}"), None, None).await;
        assert_eq!(status, 204);
    }
    let after = c.get(serve.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(!after.contains("gone-"), "series of deleted limits remain");
    assert!(after.len() < during.len() / 4, "{} -> {} bytes", during.len(), after.len());
    let (status, body) = send(&serve, "GET", "/healthz", None, None).await;
    assert_eq!((status, body["status"].as_str()), (200, Some("ok")));
    let (status, body) = send(&serve, "GET", "/readyz", None, None).await;
    assert_eq!((status, body["status"].as_str()), (200, Some("ready")));
}

#[test]
fn every_request_is_logged_with_its_status_latency_and_client() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lanes"))
        .args(["serve", "--listen", "127.0.0.1:0", "--log-format", "json"])
        .env("RUST_LOG", "info")
        .env("LANES_TOKENS", tokens())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run lanes");
    let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = stdout.next().unwrap().unwrap();
    let base = first.strip_prefix("lanes serve: listening on ").unwrap().trim().to_owned();
    std::thread::spawn(move || for _ in stdout {});
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let c = reqwest::Client::new();
        c.get(format!("{base}/v1/limits")).bearer_auth(READ).send().await.unwrap();
        c.get(format!("{base}/v1/limits")).send().await.unwrap();
    });
    let _ = child.kill();
    let stderr = BufReader::new(child.stderr.take().unwrap());
    let lines: Vec<Value> = stderr
        .lines()
        .map_while(Result::ok)
        .filter_map(|line| serde_json::from_str(&line).ok())
        .filter(|v: &Value| v["target"] == "lanes::access")
        .collect();
    let _ = child.wait();
    assert_eq!(lines.len(), 2, "{lines:?}");
    let fields: Vec<(&str, u64, &str)> = lines
        .iter()
        .map(|l| {
            let f = &l["fields"];
            assert!(f["latency_us"].as_u64().is_some(), "{l}");
            (
                f["path"].as_str().unwrap(),
                f["status"].as_u64().unwrap(),
                f["client"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(fields, [("/v1/limits", 200, "read#3"), ("/v1/limits", 401, "-")]);
}

#[tokio::test]
async fn settings_come_from_lanes_toml_then_the_environment_then_flags() {
    let dir = std::env::temp_dir().join(format!("lanes-settings-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("lanes.toml");
    std::fs::write(
        &config,
        format!(
            "max_limits = 1\nmax_clients = 7\n[[tokens]]\nrole = \"admin\"\ntoken = \"{ADMIN}\"\n\
             [limits.db]\nconcurrent = 2\n"
        ),
    )
    .unwrap();
    let path = config.to_str().unwrap();
    // The file: one limit at most, and it is taken by `db`; a token is needed.
    let serve = Serve::start_with("127.0.0.1:0", &["--config", path], &[]);
    let (status, _) = send(&serve, "GET", "/v1/limits/db", None, None).await;
    assert_eq!(status, 401);
    let body = Some(json!({"concurrent": 1}));
    let (status, answer) = send(&serve, "PUT", "/v1/limits/x", Some(ADMIN), body.clone()).await;
    assert_eq!((status, answer["code"].as_str()), (429, Some("too_many_limits")));
    drop(serve);
    // The environment over the file, a flag over the environment.
    let env = [("LANES_MAX_LIMITS", "3")];
    let serve = Serve::start_with("127.0.0.1:0", &["--config", path], &env);
    for name in ["x", "y"] {
        let (status, _) =
            send(&serve, "PUT", &format!("/v1/limits/{name}"), Some(ADMIN), body.clone()).await;
        assert_eq!(status, 200);
    }
    let (status, _) = send(&serve, "PUT", "/v1/limits/z", Some(ADMIN), body.clone()).await;
    assert_eq!(status, 429);
    drop(serve);
    let serve = Serve::start_with("127.0.0.1:0", &["--config", path, "--max-limits", "2"], &env);
    let (status, _) = send(&serve, "PUT", "/v1/limits/x", Some(ADMIN), body.clone()).await;
    assert_eq!(status, 200);
    let (status, _) = send(&serve, "PUT", "/v1/limits/y", Some(ADMIN), body).await;
    assert_eq!(status, 429);
    drop(serve);
    // An unknown key is named.
    std::fs::write(&config, "max_limitz = 1\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_lanes"))
        .args(["serve", "--config", path])
        .output()
        .expect("run lanes");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("max_limitz"));
    // Review finding (stop 73): a syntax error quoted its line, secret and all; so did a
    // Redis URL's password in the error of a Redis that did not answer.
    std::fs::write(&config, "[[tokens]]\nrole = \"admin\"\ntoken = \"Sup3rSecretAdminToken999\n")
        .unwrap();
    let redis = "redis://default:RedisPassw0rd@127.0.0.1:1";
    for args in [&["serve", "--config", path][..], &["serve", "--redis", redis]] {
        let out = Command::new(env!("CARGO_BIN_EXE_lanes")).args(args).output().expect("run lanes");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(!out.status.success(), "{args:?}: {stderr}");
        for secret in ["Sup3rSecret", "RedisPassw0rd"] {
            assert!(!stderr.contains(secret) && !stdout.contains(secret), "{args:?}: {stderr}");
        }
        if args[1] == "--config" {
            assert!(stderr.contains("line 3"), "the error says where: {stderr}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn remote_limits_sends_its_token() {
    let serve = serve(&[]);
    send(&serve, "PUT", "/v1/limits/db", Some(ADMIN), Some(json!({"concurrent": 1}))).await;
    let bound = lanes_remote::RemoteLimits::with_client(&serve.base, "w1", Duration::from_secs(10))
        .unwrap()
        .with_token(CLIENT);
    let limits = lanes::Limits::with_backend(bound);
    let permit =
        limits.acquire("db", lanes::Priority::default()).await.expect("granted with the token");
    drop(permit);
    let anonymous =
        lanes_remote::RemoteLimits::with_client(&serve.base, "w1", Duration::from_secs(10))
            .unwrap();
    let refused = anonymous.info("db").await;
    assert!(refused.is_err(), "{refused:?}");
    let stranger =
        lanes_remote::RemoteLimits::with_client(&serve.base, "w2", Duration::from_secs(10))
            .unwrap()
            .with_token(CLIENT);
    let limits = lanes::Limits::with_backend(stranger);
    assert!(limits.acquire("db", lanes::Priority::default()).await.is_err());
    // A share is refreshed only as a client the token may act for.
    let refresh = |client: &str| Some(json!({"client": client, "seq": 1, "held": 0}));
    let (status, body) =
        send(&serve, "POST", "/v1/limits/db/share", Some(CLIENT), refresh("w2")).await;
    assert_eq!(status, 403, "{body}");
    let (status, body) =
        send(&serve, "POST", "/v1/limits/db/share", Some(CLIENT), refresh("w1")).await;
    assert_eq!((status, body["mode"].as_str()), (200, Some("exact")), "{body}");
}

/// Every operation of the served OpenAPI document, with random tokens, path parameters,
/// content types and bodies: never a server error (but 503 from the backend), and every status
/// one the document declares for that operation.
#[test]
fn fuzzed_operations_with_tokens_answer_only_documented_statuses() {
    use proptest::prelude::*;
    let serve = serve(&["--max-waiters", "5", "--max-limits", "50"]);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let c = reqwest::Client::new();
    let document: Value = runtime
        .block_on(async {
            let body = Some(json!({"concurrent": 2}));
            send(&serve, "PUT", "/v1/limits/fuzz", Some(ADMIN), body).await;
            c.get(serve.url("/openapi.json")).bearer_auth(READ).send().await.unwrap().json().await
        })
        .unwrap();
    let mut operations: Vec<(String, String, Vec<u16>)> = Vec::new();
    for (path, item) in document["paths"].as_object().unwrap() {
        for (method, operation) in item.as_object().unwrap() {
            let statuses =
                operation["responses"].as_object().unwrap().keys().map(|s| s.parse().unwrap());
            operations.push((method.to_uppercase(), path.clone(), statuses.collect()));
        }
    }
    assert!(operations.len() >= 13, "{operations:?}");
    let names = ["fuzz", "other", "%00bad", "w1", "batch-1"];
    let tokens = [None, Some("wrong-token-0123456789"), Some(READ), Some(CLIENT), Some(ADMIN)];
    let seen = std::sync::Mutex::new(std::collections::BTreeSet::new());
    let config =
        ProptestConfig { cases: 400, failure_persistence: None, ..ProptestConfig::default() };
    proptest!(config, |(
        op in 0..operations.len(),
        name in 0..names.len(),
        token in 0..tokens.len(),
        plain_text in proptest::bool::weighted(0.1),
        body in proptest::option::of(common::arbitrary_json()),
    )| {
        let (method, template, documented) = &operations[op];
        let path = template.replace("{name}", names[name]).replace("{client}", names[name]);
        let (status, reply) = runtime.block_on(async {
            let mut request = c.request(method.parse().unwrap(), serve.url(&path));
            if let Some(token) = tokens[token] {
                request = request.bearer_auth(token);
            }
            request = match (&body, plain_text) {
                (Some(body), false) => request.json(body),
                (Some(body), true) => {
                    request.header("content-type", "text/plain").body(body.to_string())
                }
                (None, _) => request,
            };
            let response = request.send().await.expect("the server answers");
            let status = response.status().as_u16();
            (status, response.text().await.unwrap_or_default())
        });
        seen.lock().unwrap().insert(status);
        prop_assert!(status < 500 || status == 503, "{method} {path} -> {status} {reply}");
        prop_assert!(
            documented.contains(&status),
            "{method} {path} -> {status}, not in the document's {documented:?}: {reply}"
        );
    });
    // The fuzz reached the server's refusals as well as its answers.
    let seen = seen.into_inner().unwrap();
    for status in [200, 400, 401, 403, 404, 415] {
        assert!(seen.contains(&status), "never saw {status}: {seen:?}");
    }
}
