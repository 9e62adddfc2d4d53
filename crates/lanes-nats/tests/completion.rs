//! Completion tracking against the real NATS server (`NATS_URL`, default
//! `nats://127.0.0.1:4222`, JetStream enabled). Each test creates its own bucket and deletes it.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use lanes::pool::{Dispatcher, SubmitError};
use lanes::{BoxError, Registry};
use lanes_nats::KvCompletions;
use tokio::sync::{Semaphore, mpsc};
use tokio::time::{sleep, timeout};

type Res = Result<(), std::io::Error>;

struct Bucket {
    js: jetstream::Context,
    store: kv::Store,
    name: String,
}

impl Bucket {
    async fn new(test: &str) -> Self {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
        let client = timeout(Duration::from_secs(5), async_nats::connect(&url))
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "NATS at {url} did not answer within 5 s (set NATS_URL, start nats-server -js)"
                )
            })
            .unwrap_or_else(|e| {
                panic!("cannot connect to NATS at {url}: {e} (set NATS_URL, start nats-server -js)")
            });
        let js = jetstream::new(client);
        // nats-server removes its account's stream directory when the last stream goes, racing
        // a stream being created at that moment by a parallel test ("could not create storage
        // directory"); a stream that is never deleted keeps the directory.
        js.get_or_create_stream(jetstream::stream::Config {
            name: "LANES_TEST_ANCHOR".to_owned(),
            subjects: vec!["lanes.test.anchor".to_owned()],
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("cannot create the anchor stream (is JetStream enabled?): {e}"));
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let name = format!("lanes-{test}-{}-{nanos}", SEQ.fetch_add(1, Ordering::SeqCst));
        Self::create(&js, &name).await;
        let store = js.get_key_value(&name).await.unwrap();
        Self { js, store, name }
    }

    /// Makes the bucket's stream, as `nats kv add` makes it. (The client's own bucket creation
    /// asks for account information in a shape older servers do not send.)
    async fn create(js: &jetstream::Context, name: &str) {
        let stream = jetstream::stream::Config {
            name: format!("KV_{name}"),
            subjects: vec![format!("$KV.{name}.>")],
            max_messages_per_subject: 1,
            allow_rollup: true,
            deny_delete: true,
            allow_direct: true,
            discard: jetstream::stream::DiscardPolicy::New,
            ..Default::default()
        };
        js.create_stream(stream).await.unwrap_or_else(|e| {
            panic!("cannot create KV bucket {name} (is JetStream enabled?): {e}")
        });
    }

    fn completions(&self) -> KvCompletions {
        KvCompletions::new(self.store.clone())
    }

    async fn put(&self, key: &str) {
        self.store.put(key, "done".into()).await.unwrap();
    }

    async fn delete(self) {
        let _ = self.js.delete_stream(format!("KV_{}", self.name)).await;
    }
}

/// A dispatcher of `String` items tracked by their own text, whose completions go to a channel,
/// and whose workers wait for `gate` before processing.
async fn tracked(
    bucket: &Bucket,
    gate: Arc<Semaphore>,
    registry: Option<&Registry>,
) -> (Dispatcher<String>, mpsc::UnboundedReceiver<String>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let mut builder = Dispatcher::builder().workers(4).queue_size(64);
    if let Some(registry) = registry {
        builder = builder.registry(registry, "tracked");
    }
    let dispatcher = builder
        .completion(
            bucket.completions(),
            |item: &String| item.clone(),
            move |item: String| {
                let tx = tx.clone();
                async move {
                    tx.send(item).unwrap();
                    Res::Ok(())
                }
            },
        )
        .build(move |_: String| {
            let gate = gate.clone();
            async move {
                gate.acquire().await.unwrap().forget();
                Res::Ok(())
            }
        })
        .await
        .unwrap();
    (dispatcher, rx)
}

async fn next(rx: &mut mpsc::UnboundedReceiver<String>) -> String {
    timeout(Duration::from_secs(10), rx.recv()).await.expect("a completion").expect("open")
}

#[tokio::test]
async fn a_kv_write_fires_on_complete_once() {
    let bucket = Bucket::new("fires").await;
    let gate = Arc::new(Semaphore::new(1_000));
    let (dispatcher, mut rx) = tracked(&bucket, gate, None).await;
    dispatcher.submit("order-1".to_owned()).unwrap();
    assert_eq!(dispatcher.tracked(), 1);
    bucket.put("order-1").await;
    assert_eq!(next(&mut rx).await, "order-1");
    assert_eq!(dispatcher.tracked(), 0);
    // A second write of the same key finds nothing tracked: on_complete fired once.
    bucket.put("order-1").await;
    sleep(Duration::from_millis(200)).await;
    assert!(rx.try_recv().is_err());
    dispatcher.stop(Duration::from_secs(5)).await.unwrap();
    bucket.delete().await;
}

#[tokio::test]
async fn replayed_and_untracked_keys_are_ignored() {
    let bucket = Bucket::new("ignored").await;
    // Written before the dispatcher exists: part of what a watch would replay.
    bucket.put("old").await;
    let registry = Registry::new();
    let gate = Arc::new(Semaphore::new(1_000));
    let (dispatcher, mut rx) = tracked(&bucket, gate, Some(&registry)).await;
    dispatcher.submit("old".to_owned()).unwrap();
    bucket.put("stranger").await; // nobody tracks it
    bucket.store.delete("old").await.unwrap(); // deletes never complete anything
    sleep(Duration::from_millis(300)).await;
    assert!(rx.try_recv().is_err(), "neither the replay, a stranger nor a delete completes");
    assert_eq!(dispatcher.tracked(), 1);
    bucket.put("old").await; // a new write does
    assert_eq!(next(&mut rx).await, "old");
    let snapshot = registry.snapshot();
    let completion = snapshot.pool("tracked").unwrap().completion.unwrap();
    assert_eq!((completion.completed, completion.tracked), (1, 0));
    assert!(completion.untracked >= 1);
    assert!(completion.broken.is_none());
    dispatcher.stop(Duration::from_secs(5)).await.unwrap();
    bucket.delete().await;
}

#[tokio::test]
async fn completions_written_before_processing_are_matched() {
    let bucket = Bucket::new("race").await;
    // Workers are held: every completion below is written between submit and processing.
    let gate = Arc::new(Semaphore::new(0));
    let (dispatcher, mut rx) = tracked(&bucket, gate.clone(), None).await;
    let dispatcher = Arc::new(dispatcher);
    let writers: Vec<_> = (0..20)
        .map(|i| {
            let (dispatcher, store) = (dispatcher.clone(), bucket.store.clone());
            tokio::spawn(async move {
                let key = format!("item-{i}");
                dispatcher.submit(key.clone()).unwrap();
                store.put(&key, "done".into()).await.unwrap();
            })
        })
        .collect();
    for writer in writers {
        writer.await.unwrap();
    }
    let mut seen: Vec<String> = Vec::new();
    for _ in 0..20 {
        seen.push(next(&mut rx).await);
    }
    seen.sort();
    let mut expected: Vec<String> = (0..20).map(|i| format!("item-{i}")).collect();
    expected.sort();
    assert_eq!(seen, expected);
    assert_eq!(dispatcher.stats().completed, 0, "none was processed yet");
    gate.add_permits(20);
    dispatcher.stop(Duration::from_secs(5)).await.unwrap();
    assert_eq!(dispatcher.stats().completed, 20);
    bucket.delete().await;
}

#[tokio::test]
async fn a_second_in_flight_key_is_refused_and_rolled_back_registrations_free_it() {
    let bucket = Bucket::new("duplicate").await;
    let gate = Arc::new(Semaphore::new(0));
    let (dispatcher, mut rx) = tracked(&bucket, gate.clone(), None).await;
    dispatcher.submit("k".to_owned()).unwrap();
    match dispatcher.submit("k".to_owned()) {
        Err(SubmitError::DuplicateKey(item)) => assert_eq!(item, "k"),
        other => panic!("expected DuplicateKey, got {other:?}"),
    }
    assert_eq!(dispatcher.tracked(), 1, "the refused duplicate left the first registration alone");
    bucket.put("k").await;
    assert_eq!(next(&mut rx).await, "k");
    gate.add_permits(10);
    dispatcher.stop(Duration::from_secs(5)).await.unwrap();
    // After stop: refused as Stopped, and the registration was rolled back.
    assert!(dispatcher.submit("late".to_owned()).unwrap_err().is_stopped());
    assert_eq!(dispatcher.tracked(), 0);
    bucket.delete().await;
}

#[tokio::test]
async fn stop_releases_the_watcher() {
    let bucket = Bucket::new("stop").await;
    let fired = Arc::new(AtomicUsize::new(0));
    let errors: Arc<Mutex<Vec<BoxError>>> = Arc::default();
    let dispatcher = {
        let (fired, errors) = (fired.clone(), errors.clone());
        Dispatcher::builder()
            .workers(1)
            .queue_size(4)
            .completion(
                bucket.completions(),
                |item: &String| item.clone(),
                move |_: String| {
                    fired.fetch_add(1, Ordering::SeqCst);
                    async { Res::Ok(()) }
                },
            )
            .on_watch_error(move |err| errors.lock().unwrap().push(err))
            .build(|_: String| async { Res::Ok(()) })
            .await
            .unwrap()
    };
    dispatcher.submit("a".to_owned()).unwrap();
    dispatcher.stop(Duration::from_secs(5)).await.unwrap();
    dispatcher.stop(Duration::from_secs(5)).await.unwrap(); // idempotent
    bucket.put("a").await;
    sleep(Duration::from_millis(300)).await;
    assert_eq!(fired.load(Ordering::SeqCst), 0, "the watcher stopped with the dispatcher");
    assert!(errors.lock().unwrap().is_empty());
    bucket.delete().await;
}

#[tokio::test]
async fn a_missing_bucket_is_a_clear_error() {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let client = async_nats::connect(&url).await.unwrap_or_else(|e| panic!("NATS at {url}: {e}"));
    let err = KvCompletions::open(client, "lanes-no-such-bucket").await.unwrap_err();
    assert!(!err.to_string().is_empty());
}

/// The keys of the next `n` completions of `stream`, each within 10 s.
async fn next_keys(stream: &mut lanes::pool::CompletionStream, n: usize) -> Vec<String> {
    use futures_util::StreamExt;
    let mut keys = Vec::new();
    for _ in 0..n {
        let got = timeout(Duration::from_secs(10), stream.next()).await.expect("puts arrive");
        keys.push(got.unwrap().unwrap());
    }
    keys
}

/// Review finding (stop 73): a watch made again after one broke (`watch_all`) delivered only
/// what was written after it existed, so a completion written while the watch was down was
/// never delivered and its item stayed tracked for good. Now a watch made again resumes after
/// the last revision seen; the first still replays nothing.
#[tokio::test]
async fn a_watch_made_again_resumes_where_the_last_one_stopped() {
    use futures_util::StreamExt;
    use lanes::pool::CompletionSource;
    let bucket = Bucket::new("resume").await;
    bucket.put("old").await;
    let source = bucket.completions();
    let mut first = source.watch().await.unwrap();
    bucket.put("a").await;
    let got = timeout(Duration::from_secs(10), first.next()).await.expect("a put arrives");
    assert_eq!(got.unwrap().unwrap(), "a", "what the bucket held before is not replayed");
    drop(first); // the watch broke
    bucket.put("b").await; // while it was down
    let mut second = source.watch().await.unwrap();
    bucket.put("c").await;
    let keys = next_keys(&mut second, 2).await;
    assert_eq!(keys, ["b", "c"], "the put made while the watch was down, and no earlier one");
    bucket.delete().await;
}

/// Review finding (stop 73, left then): a bucket deleted and made again starts its revisions
/// from 1, and a watch made again after that resumed past the old bucket's last revision,
/// skipping the new bucket's puts up to there.
#[tokio::test]
async fn a_watch_made_again_on_a_bucket_made_again_delivers_its_puts() {
    use futures_util::StreamExt;
    use lanes::pool::CompletionSource;
    let bucket = Bucket::new("remade").await;
    for key in ["old-1", "old-2", "old-3", "old-4"] {
        bucket.put(key).await;
    }
    let source = bucket.completions();
    let mut first = source.watch().await.unwrap();
    bucket.put("a").await;
    let got = timeout(Duration::from_secs(10), first.next()).await.expect("a put arrives");
    assert_eq!(got.unwrap().unwrap(), "a");
    drop(first); // the watch broke
    bucket.js.delete_stream(format!("KV_{}", bucket.name)).await.unwrap();
    Bucket::create(&bucket.js, &bucket.name).await;
    bucket.put("b").await; // revision 1 of the new bucket, while no watch ran
    let mut second = source.watch().await.unwrap();
    bucket.put("c").await;
    let keys = next_keys(&mut second, 2).await;
    assert_eq!(keys, ["b", "c"], "the new bucket's puts");
    bucket.delete().await;
}
