//! The embeddable dashboard, through the `embedded_dashboard` example's own application: its
//! snapshot shows the application's lanes and limits, and its page loads in headless Chromium
//! from the mount point. Its metrics are exact when scraped.

mod common;

#[path = "../examples/embedded_dashboard.rs"]
#[allow(dead_code)] // the example's `main` is not called here
mod example;

use serde_json::Value;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_application_mounts_its_own_dashboard() {
    let (router, lanes, limits) = example::application().await.expect("the example's application");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    example::work(&lanes, &limits, 20).await;

    let c = reqwest::Client::new();
    let own = c.get(format!("{base}/")).send().await.unwrap().text().await.unwrap();
    assert_eq!(own, "the application");
    for client in ["10.0.0.1", "10.0.0.2"] {
        let answer = c.get(format!("{base}/")).header("x-client", client).send().await.unwrap();
        assert_eq!(answer.status(), 200);
    }
    let snapshot: Value =
        c.get(format!("{base}/lanes/v1/snapshot")).send().await.unwrap().json().await.unwrap();
    let lane_names: Vec<&str> = snapshot["lane_sets"]["app"]["lanes"]
        .as_array()
        .expect("the application's lane set")
        .iter()
        .map(|l| l["name"].as_str().unwrap())
        .collect();
    assert_eq!(lane_names, ["checkout", "reports"], "{snapshot}");
    let limit = &snapshot["limits"]["app-limits"][0];
    assert_eq!(limit["name"], "payments-api", "{snapshot}");
    assert!(limit["granted_total"].as_u64().unwrap() > 0, "{snapshot}");
    // The rate limit per client in front of the application's own route.
    let per_client = &snapshot["keyed_limits"]["per-client"];
    assert_eq!(per_client["keys"], 3, "two clients and the anonymous one: {snapshot}");
    assert_eq!(per_client["acquired_total"], 3, "{snapshot}");

    // The page, at the mount point.
    let page = c.get(format!("{base}/lanes")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    assert!(page.text().await.unwrap().contains("v1/snapshot"));
    // In a browser, the page finds its snapshot below the mount point and shows the
    // application's lanes and limit.
    let dom = tokio::task::spawn_blocking(move || common::rendered(&format!("{base}/lanes")))
        .await
        .unwrap();
    assert!(dom.contains("payments-api"), "{dom}");
    assert!(dom.contains("data-keyed-limit=\"per-client\""), "{dom}");
    assert!(dom.contains("checkout") && dom.contains("reports"), "{dom}");
    assert!(dom.contains("this application's registry"), "{dom}");
    lanes.close();
    lanes.drained().await;
}

/// A channel publishes its `emitted` count to the metrics in steps while its consumer does not
/// take; a scrape of the dashboard's `/metrics` catches it up first.
#[tokio::test]
async fn a_scrape_shows_every_record_a_channel_was_given() {
    let registry = lanes::Registry::new();
    // The router installs the recorder, before the channel registers its counters.
    let router = lanes_server::embed::dashboard(registry.clone());
    let channels = lanes::channel::Channels::builder().registry(&registry, "scraped").build();
    let channels = channels.expect("a registry of channels");
    let channel = channels.create::<u64>("orders", lanes::channel::ChannelConfig::new(64));
    let channel = channel.expect("a channel");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    for record in 0..10 {
        channel.try_emit(record).unwrap();
    }
    let body = reqwest::get(format!("{base}/metrics")).await.unwrap().text().await.unwrap();
    let line = body
        .lines()
        .find(|l| l.starts_with("lanes_channel_emitted_total") && l.contains("\"orders\""))
        .unwrap_or_else(|| panic!("no emitted series for the channel: {body}"));
    assert!(line.ends_with(" 10"), "{line}");
}
