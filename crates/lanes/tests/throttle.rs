//! The one permit glue: run lanes, pools and channel consumers take permits through a
//! `Throttle` whose refusal policy is explicit (fail the work, or retry with a backoff).

mod common;

use std::time::Duration;

use lanes::channel::{Channel, ChannelConfig, ConsumerOptions, PermitPer};
use lanes::limit::{OnRefusal, Throttle};
use lanes::{
    ConfigRule, Dispatcher, LaneLimits, LaneSet, LimitSpec, Limits, Priority, Reason, Run,
};

fn retry() -> OnRefusal {
    OnRefusal::Retry { first: Duration::from_millis(10), max: Duration::from_millis(40) }
}

fn lanes() -> LaneSet {
    common::one_lane("work", LaneLimits::new(1, 4)).build().unwrap()
}

/// A run whose limit does not exist yet: `Fail` fails it at once in the queue stage; `Retry`
/// keeps asking (holding no slot) and runs once the limit is defined.
#[tokio::test(start_paused = true)]
async fn a_run_fails_or_retries_a_refusal_as_its_throttle_says() {
    let lanes = lanes();
    let limits = Limits::new();
    let failing = Throttle::new(&limits, "later", Priority::default());
    assert_eq!(failing.refusal_policy(), OnRefusal::Fail);
    let run = Run::typed(|_| async { Ok::<_, std::io::Error>(1) }).throttle(failing);
    let err = lanes.run("work", run).unwrap().await.unwrap_err();
    assert_eq!(err.reason(), Reason::Limit);
    assert!(err.is_queue_failure());

    let retrying = Throttle::new(&limits, "later", Priority::default()).on_refusal(retry());
    let run = Run::typed(|_| async { Ok::<_, std::io::Error>(2) }).throttle(retrying);
    let handle = lanes.run("work", run).unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Still waiting, and holding no slot: another run goes through.
    assert_eq!(lanes.snapshot().lanes[0].executing, 0);
    let other = lanes.run("work", Run::typed(|_| async { Ok::<_, std::io::Error>(3) })).unwrap();
    assert_eq!(other.await.unwrap(), 3);
    limits.define("later", LimitSpec::concurrent(1)).await.unwrap();
    assert_eq!(tokio::time::timeout(Duration::from_secs(1), handle).await.unwrap().unwrap(), 2);
}

/// A pool's item under a retrying throttle is processed once its limit exists; under the
/// default it counts as failed.
#[tokio::test(start_paused = true)]
async fn a_pool_item_fails_or_retries_a_refusal_as_its_throttle_says() {
    let limits = Limits::new();
    let failing = Dispatcher::builder()
        .workers(1)
        .queue_size(4)
        .limit(&limits, "later", Priority::default())
        .build(|_: u32| async { Ok::<_, std::io::Error>(()) })
        .unwrap();
    failing.submit(1).unwrap();
    failing.stop(Duration::from_secs(1)).await.unwrap();
    assert_eq!((failing.stats().failed, failing.stats().completed), (1, 0));

    let retrying = Dispatcher::builder()
        .workers(1)
        .queue_size(4)
        .throttle(Throttle::new(&limits, "later", Priority::default()).on_refusal(retry()))
        .build(|_: u32| async { Ok::<_, std::io::Error>(()) })
        .unwrap();
    retrying.submit(1).unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(retrying.stats().completed, 0);
    limits.define("later", LimitSpec::concurrent(1)).await.unwrap();
    retrying.stop(Duration::from_secs(1)).await.unwrap();
    assert_eq!((retrying.stats().failed, retrying.stats().completed), (0, 1));
}

/// A consumer has no run to fail: a throttle that would fail is refused when the consumer is
/// built, by name; a retrying one is accepted.
#[tokio::test]
async fn a_consumer_only_takes_a_retrying_throttle() {
    let limits = Limits::new();
    let channel: Channel<u32> = Channel::named("events", ChannelConfig::new(8)).unwrap();
    let failing = Throttle::new(&limits, "api", Priority::default());
    let err = channel
        .consumer(ConsumerOptions::new().throttle(failing, PermitPer::Batch))
        .map(|_| ())
        .unwrap_err();
    let lanes::ChannelError::Config(config) = err else { panic!("{err:?}") };
    assert_eq!(config.field(), "channels.events.consumer.throttle");
    assert_eq!(config.rule(), ConfigRule::Unsupported);
    let retrying = Throttle::new(&limits, "api", Priority::default()).on_refusal(OnRefusal::RETRY);
    assert!(channel.consumer(ConsumerOptions::new().throttle(retrying, PermitPer::Batch)).is_ok());
}
