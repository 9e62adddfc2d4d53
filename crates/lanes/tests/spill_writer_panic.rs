//! A spill queue whose writer thread panics (here: a tracing subscriber that panics in the
//! writer's span for a group) fails like a queue whose disk failed, instead of leaving every
//! later append waiting for good. Its own test binary: the subscriber is the process's global
//! one, the only way to reach the writer's thread.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use lanes::spill::{SpillError, SpillOptions, SpillQueue, SyncPolicy};
use tokio::time::timeout;

/// Set while the subscriber panics on entering a spill writer's group span.
static PANICS: AtomicBool = AtomicBool::new(false);
static PANICKED: AtomicUsize = AtomicUsize::new(0);

/// Every span and event enabled; entering `lanes.spill.group` panics while `PANICS` is set.
struct PanicsInTheWriter;

impl tracing::Subscriber for PanicsInTheWriter {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, attributes: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        let group = attributes.metadata().name() == "lanes.spill.group";
        tracing::span::Id::from_u64(if group { 2 } else { 1 })
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, _: &tracing::Event<'_>) {}
    fn enter(&self, span: &tracing::span::Id) {
        if span.into_u64() == 2 && PANICS.load(Ordering::SeqCst) {
            PANICKED.fetch_add(1, Ordering::SeqCst);
            panic!("the subscriber panics");
        }
    }
    fn exit(&self, _: &tracing::span::Id) {}
}

/// The append that meets the panic is answered `Failed`, as is every later one; the close
/// finishes and the queue drains. (Before, the panic
/// ended the writer thread with the mailbox open: the next append waited for good.)
#[test]
fn a_writer_that_panics_fails_the_queue() {
    tracing::subscriber::set_global_default(PanicsInTheWriter).unwrap();
    let dir = std::env::temp_dir().join(format!("lanes-writer-panic-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let options = SpillOptions::default().sync(SyncPolicy::Always);
        let (queue, _) = SpillQueue::open(&dir, options).await.unwrap();
        queue.append(b"before").await.expect("the writer works");
        PANICS.store(true, Ordering::SeqCst);
        let ten = Duration::from_secs(10);
        let first = timeout(ten, queue.append(b"met the panic")).await.expect("answered");
        assert!(matches!(first, Err(SpillError::Failed(_))), "{first:?}");
        PANICS.store(false, Ordering::SeqCst);
        let later = timeout(ten, queue.append(b"after")).await.expect("answered");
        assert!(matches!(later, Err(SpillError::Failed(_))), "{later:?}");
        // Its answer is the final sync's and state write's, as for a queue a disk error failed.
        let _closed = timeout(ten, queue.close()).await.expect("the close finishes");
        timeout(ten, queue.drained()).await.expect("the queue drains");
    });
    assert!(PANICKED.load(Ordering::SeqCst) >= 1, "the subscriber panicked");
    let _ = std::fs::remove_dir_all(&dir);
}
