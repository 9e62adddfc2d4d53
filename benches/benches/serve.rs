//! Suite 11: `lanes serve` over loopback. Acquire/release requests per second and latency with
//! 64 concurrent connections, against a bare axum echo endpoint in the same run (the HTTP floor
//! on this host): once in plain HTTP without tokens, once over TLS with API tokens against the
//! echo over the same TLS. Written to `target/lanes-bench/serve.json` for the report.
#![allow(missing_docs)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::Json;
use axum::routing::post;
use lanes_benches::{quick, write_result};
use lanes_server::{ServeOptions, Server, TlsFiles, Token};
use serde_json::{Value, json};

const CONNECTIONS: usize = 64;

fn window() -> Duration {
    if quick() { Duration::from_secs(2) } else { Duration::from_secs(5) }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// Runs `CONNECTIONS` tasks calling `one` (which makes `per_call` requests) for the window.
async fn drive<F, Fut>(one: F, per_call: usize) -> Value
where
    F: Fn(reqwest::Client, usize) -> Fut + Send + Sync + 'static + Clone,
    Fut: std::future::Future<Output = ()> + Send,
{
    let client = reqwest::Client::builder().pool_max_idle_per_host(CONNECTIONS).build().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for worker in 0..CONNECTIONS {
        let (client, stop, one) = (client.clone(), stop.clone(), one.clone());
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let start = Instant::now();
                one(client.clone(), worker).await;
                latencies.push(start.elapsed().as_secs_f64() * 1e6 / per_call as f64);
            }
            latencies
        }));
    }
    let start = Instant::now();
    tokio::time::sleep(window()).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.unwrap());
    }
    let elapsed = start.elapsed().as_secs_f64();
    let requests = (all.len() * per_call) as f64;
    all.sort_by(f64::total_cmp);
    json!({
        "requests_per_s": requests / elapsed,
        "p50_us": percentile(&all, 0.5),
        "p99_us": percentile(&all, 0.99),
    })
}

/// An axum router served over TLS with `acceptor`, on a free loopback port; its address.
async fn serve_tls(
    router: axum::Router,
    acceptor: tokio_rustls::TlsAcceptor,
) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else { return };
            let _ = tcp.set_nodelay(true);
            let (acceptor, router) = (acceptor.clone(), router.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else { return };
                let service = hyper_util::service::TowerToHyperService::new(router);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    addr
}

/// The echo floor and `lanes serve`'s acquire + release, each driven for the window; `token`
/// goes with every request (to the echo too: the same bytes on the wire).
async fn measure(
    client: reqwest::Client,
    echo_url: String,
    base: String,
    token: Option<&'static str>,
) -> (Value, Value) {
    let auth = move |request: reqwest::RequestBuilder| match token {
        Some(token) => request.bearer_auth(token),
        None => request,
    };
    let echo_client = client.clone();
    let floor = drive(
        move |_, worker| {
            let (url, client) = (echo_url.clone(), echo_client.clone());
            async move {
                let request =
                    client.post(url).json(&json!({"client": format!("w{worker}"), "ticket": null}));
                let reply = auth(request).send().await.unwrap();
                assert!(reply.status().is_success());
                let _ = reply.bytes().await;
            }
        },
        1,
    )
    .await;
    let acquire_url = format!("{base}/v1/limits/bench/acquire");
    let release_url = format!("{base}/v1/limits/bench/release");
    let lanes = drive(
        move |_, worker| {
            let (acquire, release, client) =
                (acquire_url.clone(), release_url.clone(), client.clone());
            async move {
                let request = client.post(acquire).json(&json!({"client": format!("w{worker}")}));
                let reply: Value = auth(request).send().await.unwrap().json().await.unwrap();
                assert_eq!(reply["granted"], true, "{reply}");
                let body = json!({"client": format!("w{worker}"), "ticket": reply["ticket"]});
                let reply = auth(client.post(release).json(&body)).send().await.unwrap();
                assert!(reply.status().is_success());
                let _ = reply.bytes().await;
            }
        },
        2,
    )
    .await;
    (floor, lanes)
}

const ADMIN: &str = "bench-admin-token-0123456789";
const CLIENT: &str = "bench-client-token-0123456789";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    if !args.is_empty() && !args.iter().any(|a| a.contains("serve")) {
        return;
    }
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let echo = axum::Router::new()
            .route("/echo", post(|Json(body): Json<Value>| async move { Json(body) }));
        let pooled = || reqwest::Client::builder().pool_max_idle_per_host(CONNECTIONS);

        // Plain HTTP, no tokens.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let echo_addr = listener.local_addr().unwrap();
        tokio::spawn({
            let echo = echo.clone();
            async move { axum::serve(listener, echo).await }
        });
        let options =
            ServeOptions { listen: "127.0.0.1:0".parse().unwrap(), ..ServeOptions::default() };
        let server = Server::start(options).await.unwrap();
        let base = format!("http://{}", server.addr);
        let client = pooled().build().unwrap();
        define(&client, &base, None).await;
        let (floor, lanes) =
            measure(client, format!("http://{echo_addr}/echo"), base.clone(), None).await;
        println!("serve/echo: {floor}\nserve/acquire_release: {lanes}");
        // The same two through wrk, an external load generator, if it is installed.
        let wrk_echo = wrk(&format!("http://{echo_addr}/echo"), ECHO_LUA).await;
        let wrk_lanes = wrk(&format!("{base}/v1/limits/bench"), LANES_LUA).await;
        println!("serve/wrk: echo {wrk_echo:?}, lanes {wrk_lanes:?}");
        server.shutdown().await.unwrap();

        // TLS and tokens, against the echo over the same TLS.
        let cert = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()]).unwrap();
        let dir = std::env::temp_dir().join(format!("lanes-bench-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (cert_path, key_path) = (dir.join("cert.pem"), dir.join("key.pem"));
        std::fs::write(&cert_path, cert.cert.pem()).unwrap();
        std::fs::write(&key_path, cert.signing_key.serialize_pem()).unwrap();
        let tokens = format!("admin:{ADMIN} client:{CLIENT}:w*");
        let options = ServeOptions {
            listen: "127.0.0.1:0".parse().unwrap(),
            tls: Some(TlsFiles { cert: cert_path.clone(), key: key_path.clone() }),
            tokens: Token::parse_list(&tokens).unwrap(),
            ..ServeOptions::default()
        };
        let server = Server::start(options).await.unwrap();
        let base = format!("https://{}", server.addr);
        let key = tokio_rustls::rustls::pki_types::PrivateKeyDer::Pkcs8(
            cert.signing_key.serialize_der().into(),
        );
        let config = tokio_rustls::rustls::ServerConfig::builder_with_provider(Arc::new(
            tokio_rustls::rustls::crypto::aws_lc_rs::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.cert.der().clone()], key)
        .unwrap();
        let tls_echo = serve_tls(echo, tokio_rustls::TlsAcceptor::from(Arc::new(config))).await;
        let trusted = reqwest::Certificate::from_der(cert.cert.der()).unwrap();
        let client = pooled().tls_certs_only([trusted]).build().unwrap();
        define(&client, &base, Some(ADMIN)).await;
        let (tls_floor, tls_lanes) =
            measure(client, format!("https://{tls_echo}/echo"), base, Some(CLIENT)).await;
        println!("serve/tls_echo: {tls_floor}\nserve/tls_acquire_release: {tls_lanes}");
        server.shutdown().await.unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        write_result(
            "serve",
            &json!({
                "connections": CONNECTIONS,
                "echo": floor,
                "acquire_release": lanes,
                "tls_echo": tls_floor,
                "tls_acquire_release": tls_lanes,
                "wrk_echo_requests_per_s": wrk_echo,
                "wrk_acquire_release_requests_per_s": wrk_lanes,
            }),
        );
    });
}

/// wrk's script for the echo floor: the body an acquire sends.
const ECHO_LUA: &str = r#"
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"client":"w1","ticket":null}'
"#;

/// wrk's script for `lanes serve`: a try on a ticket of this thread's client (tickets are per
/// limit, so each thread numbers its own range) and its release, pipelined on one connection so
/// the release follows its acquire.
const LANES_LUA: &str = r#"
local threads = 0
function setup(thread)
  thread:set("id", threads)
  threads = threads + 1
end
local n = 0
local headers = {["Content-Type"] = "application/json"}
request = function()
  n = n + 1
  local who = '{"client":"wrk-' .. id .. '","ticket":' .. ((id + 1) * 1000000000 + n)
  return wrk.format("POST", wrk.path .. "/acquire", headers, who .. ',"queue":false}')
      .. wrk.format("POST", wrk.path .. "/release", headers, who .. '}')
end
local shown = 0
response = function(status, headers, body)
  if status ~= 200 and shown < 3 then
    shown = shown + 1
    print("unexpected " .. status .. " " .. body)
  end
end
"#;

/// Requests per second wrk reaches with 2 threads and the suite's connections, or `None` when
/// wrk is not installed (`apt-get install wrk`).
async fn wrk(url: &str, script: &str) -> Option<f64> {
    let path = std::env::temp_dir().join(format!("lanes-wrk-{}.lua", std::process::id()));
    std::fs::write(&path, script).ok()?;
    let seconds = window().as_secs().max(2).to_string();
    let connections = CONNECTIONS.to_string();
    let out = tokio::process::Command::new("wrk")
        .args(["-t2", "-c", &connections, "-d", &seconds, "-s"])
        .arg(&path)
        .arg(url)
        .output()
        .await
        .ok()?;
    let _ = std::fs::remove_file(&path);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("Non-2xx"), "wrk saw errors against {url}: {text}");
    text.lines()
        .find_map(|line| line.strip_prefix("Requests/sec:"))
        .and_then(|rate| rate.trim().parse().ok())
}

/// Defines the roomy limit the bench cycles on.
async fn define(client: &reqwest::Client, base: &str, token: Option<&str>) {
    let mut request =
        client.put(format!("{base}/v1/limits/bench")).json(&json!({"concurrent": 1_000_000}));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    assert_eq!(request.send().await.unwrap().status(), 200);
}
