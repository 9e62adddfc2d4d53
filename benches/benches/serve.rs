//! Suite 11: `lanes serve` over loopback. Acquire/release requests per second and latency with
//! 64 concurrent connections, against a bare axum echo endpoint in the same run (the HTTP floor
//! on this host). Written to `target/lanes-bench/serve.json` for the report.
#![allow(missing_docs)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::Json;
use axum::routing::post;
use lanes_benches::{quick, write_result};
use lanes_server::{ServeOptions, Server};
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

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    if !args.is_empty() && !args.iter().any(|a| a.contains("serve")) {
        return;
    }
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        // The floor: an axum endpoint that parses a JSON body and answers it.
        let echo = axum::Router::new()
            .route("/echo", post(|Json(body): Json<Value>| async move { Json(body) }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let echo_addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, echo).await });

        let options =
            ServeOptions { listen: "127.0.0.1:0".parse().unwrap(), ..ServeOptions::default() };
        let server = Server::start(options).await.unwrap();
        let base = format!("http://{}", server.addr);
        reqwest::Client::new()
            .put(format!("{base}/v1/limits/bench"))
            .json(&json!({"concurrent": 1_000_000}))
            .send()
            .await
            .unwrap();

        let echo_url = format!("http://{echo_addr}/echo");
        let floor = drive(
            move |client, worker| {
                let url = echo_url.clone();
                async move {
                    let reply = client
                        .post(url)
                        .json(&json!({"client": format!("w{worker}"), "ticket": null}))
                        .send()
                        .await
                        .unwrap();
                    assert!(reply.status().is_success());
                    let _ = reply.bytes().await;
                }
            },
            1,
        )
        .await;
        println!("serve/echo: {floor}");

        let acquire_url = format!("{base}/v1/limits/bench/acquire");
        let release_url = format!("{base}/v1/limits/bench/release");
        let lanes = drive(
            move |client, worker| {
                let (acquire, release) = (acquire_url.clone(), release_url.clone());
                async move {
                    let reply: Value = client
                        .post(acquire)
                        .json(&json!({"client": format!("w{worker}")}))
                        .send()
                        .await
                        .unwrap()
                        .json()
                        .await
                        .unwrap();
                    assert_eq!(reply["granted"], true, "{reply}");
                    let reply = client
                        .post(release)
                        .json(&json!({"client": format!("w{worker}"), "ticket": reply["ticket"]}))
                        .send()
                        .await
                        .unwrap();
                    assert!(reply.status().is_success());
                    let _ = reply.bytes().await;
                }
            },
            2,
        )
        .await;
        println!("serve/acquire_release: {lanes}");
        server.shutdown().await.unwrap();
        write_result(
            "serve",
            &json!({ "connections": CONNECTIONS, "echo": floor, "acquire_release": lanes }),
        );
    });
}
