//! Completion tracking: items are processed here, but *completed* by another processor that
//! signals it by writing the item's key somewhere (a NATS KV bucket in `lanes-nats`).

use std::fmt;
use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_core::Stream;
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use tokio::task::AbortHandle;

use crate::util::{CatchPanic, FastMap, call_contained, drop_contained, lock};
use crate::{BoxError, BoxFuture};

/// Completion signals: the key of each completed item, or an error that broke the watch (the
/// stream ends after it).
pub type CompletionStream = Pin<Box<dyn Stream<Item = Result<String, BoxError>> + Send>>;

/// Where completion signals come from.
pub trait CompletionSource: Send + Sync + 'static {
    /// Starts watching. When the future resolves, the watch is established: every signal
    /// written from then on is delivered. Signals written before (what a store would replay
    /// first) are not delivered, and neither are deletions.
    fn watch(&self) -> BoxFuture<'_, Result<CompletionStream, BoxError>>;
}

/// The state of a dispatcher's completion tracking, in its snapshot.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct CompletionSnapshot {
    /// Items waiting for their completion signal.
    pub tracked: usize,
    /// The bound on tracked items.
    pub max_tracked: usize,
    /// Signals that matched a tracked item (each fired `on_complete` once).
    pub completed: u64,
    /// Signals for keys nobody tracks (ignored).
    pub untracked: u64,
    /// Times the watch broke (each reported to `on_watch_error`).
    pub watch_failures: u64,
    /// The last error that broke the watch, while it is broken.
    pub broken: Option<String>,
}

type OnComplete<T> = Box<dyn Fn(T) -> BoxFuture<'static, Result<(), BoxError>> + Send + Sync>;

/// The tracked items, and the completions under way.
struct Items<T> {
    /// Each item with the number of its registration ([`Tracker::track`]).
    map: FastMap<String, (u64, T)>,
    /// The next registration's number.
    next: u64,
    /// Signals whose item left `map` and whose `on_complete` is still running: the watch of an
    /// orphaned tracker ends only once none is (it would cut the callback short).
    running: usize,
}

pub(crate) struct Tracker<T> {
    items: Mutex<Items<T>>,
    pub(crate) max: usize,
    pub(crate) key_of: Box<dyn Fn(&T) -> String + Send + Sync>,
    /// Tracked items are clones: the original goes to the process function.
    pub(crate) clone_item: Box<dyn Fn(&T) -> T + Send + Sync>,
    on_complete: OnComplete<T>,
    on_watch_error: Option<Box<dyn Fn(BoxError) + Send + Sync>>,
    on_error: Option<Arc<dyn Fn(BoxError) + Send + Sync>>,
    status: Mutex<CompletionSnapshot>,
    watcher: Mutex<Option<AbortHandle>>,
    /// Asks the watcher to end between signals ([`stop_watching`](Self::stop_watching)): a
    /// stored permit, so one asked while an `on_complete` runs is read after it.
    stop: Notify,
    /// The watcher task ended (or was aborted): set, then `ended` notified, as it goes.
    watch_over: std::sync::atomic::AtomicBool,
    ended: Notify,
    /// Its dispatcher was dropped: the watch ends once no item is tracked.
    orphaned: std::sync::atomic::AtomicBool,
}

impl<T> fmt::Debug for Tracker<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tracker").field("status", &*lock(&self.status)).finish_non_exhaustive()
    }
}

/// Why an item could not be tracked.
pub(crate) enum Untracked {
    Duplicate,
    Full,
}

impl<T> Tracker<T> {
    /// Its dispatcher was dropped: nothing more is tracked, so the watch ends once the items
    /// tracked now have completed (at once if none is).
    pub(crate) fn orphan(&self) {
        self.orphaned.store(true, std::sync::atomic::Ordering::Release);
        if lock(&self.items).is_idle() {
            self.stop_watching();
        }
    }

    /// Ends the watch between signals: an `on_complete` under way runs to its end first.
    pub(crate) fn stop_watching(&self) {
        self.stop.notify_one();
    }

    /// Ends the watch at once (an abort, a dispatcher that failed to build, a stop out of
    /// time): an `on_complete` under way is cut at its next await.
    pub(crate) fn abort_watching(&self) {
        if let Some(watcher) = lock(&self.watcher).take() {
            watcher.abort();
        }
    }

    /// Resolves once the watcher task has ended (asked to stop, aborted, or never started).
    pub(crate) async fn watch_ended(&self) {
        use std::sync::atomic::Ordering;
        loop {
            let ended = self.ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            if self.watch_over.load(Ordering::Acquire) || lock(&self.watcher).is_none() {
                return;
            }
            ended.await;
        }
    }

    /// Forgets every item still waiting for its signal: the watch has ended, and none will
    /// come (`tracked` says 0 from then on).
    pub(crate) fn untrack_all(&self) {
        let items = std::mem::take(&mut lock(&self.items).map);
        drop_contained(items);
    }
}

/// Marks the watcher ended when its task ends, however it ends (its future dropped on abort).
struct WatchOver<T>(Arc<Tracker<T>>);

impl<T> Drop for WatchOver<T> {
    fn drop(&mut self) {
        self.0.watch_over.store(true, std::sync::atomic::Ordering::Release);
        self.0.ended.notify_waiters();
    }
}

impl<T> Items<T> {
    /// Nothing tracked, no `on_complete` running.
    fn is_idle(&self) -> bool {
        self.map.is_empty() && self.running == 0
    }
}

impl<T: Send + 'static> Tracker<T> {
    pub(crate) fn new<C, Fut, E>(
        max: usize,
        key_of: Box<dyn Fn(&T) -> String + Send + Sync>,
        clone_item: Box<dyn Fn(&T) -> T + Send + Sync>,
        on_complete: C,
        on_watch_error: Option<Box<dyn Fn(BoxError) + Send + Sync>>,
        on_error: Option<Arc<dyn Fn(BoxError) + Send + Sync>>,
    ) -> Self
    where
        C: Fn(T) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: Into<BoxError> + 'static,
    {
        let on_complete: OnComplete<T> = Box::new(move |item| {
            let fut = on_complete(item);
            Box::pin(async move { fut.await.map_err(Into::into) })
        });
        Self {
            items: Mutex::new(Items { map: FastMap::default(), next: 0, running: 0 }),
            max,
            key_of,
            clone_item,
            on_complete,
            on_watch_error,
            on_error,
            status: Mutex::new(CompletionSnapshot { max_tracked: max, ..Default::default() }),
            orphaned: std::sync::atomic::AtomicBool::new(false),
            watcher: Mutex::new(None),
            stop: Notify::new(),
            watch_over: std::sync::atomic::AtomicBool::new(false),
            ended: Notify::new(),
        }
    }

    /// Registers `item` under `key` before it is enqueued: the registration's number, for
    /// [`forget`](Self::forget).
    pub(crate) fn track(&self, key: String, item: T) -> Result<u64, Untracked> {
        let mut items = lock(&self.items);
        if items.map.contains_key(&key) {
            return Err(Untracked::Duplicate);
        }
        if items.map.len() >= self.max {
            return Err(Untracked::Full);
        }
        let number = items.next;
        items.next += 1;
        items.map.insert(key, (number, item));
        Ok(number)
    }

    /// Rolls registration `number` of `key` back (the submit was refused), if it is still
    /// there: a signal may have taken it meanwhile, and another submit registered the key
    /// again, whose registration is not this one's to forget.
    pub(crate) fn forget(&self, key: &str, number: u64) {
        let removed = {
            let mut items = lock(&self.items);
            match items.map.get(key) {
                Some((registered, _)) if *registered == number => items.map.remove(key),
                _ => None,
            }
        };
        drop_contained(removed);
    }

    pub(crate) fn snapshot(&self) -> CompletionSnapshot {
        let mut status = lock(&self.status).clone();
        status.tracked = lock(&self.items).map.len();
        status
    }

    /// Watches `stream`, then re-establishes the watch with back-off whenever it breaks, until
    /// stopped.
    pub(crate) fn spawn_watcher(
        self: &Arc<Self>,
        source: Arc<dyn CompletionSource>,
        first: CompletionStream,
    ) {
        let tracker = self.clone();
        let over = WatchOver(self.clone());
        let handle = tokio::spawn(async move {
            let _over = over;
            let mut stream = Some(first);
            let mut backoff = Duration::from_millis(50);
            loop {
                if let Some(watch) = stream.take() {
                    let Some(broke) = tracker.consume(watch).await else { return };
                    tracker.broken(broke);
                    backoff = Duration::from_millis(50);
                }
                let watched = async {
                    tokio::time::sleep(backoff).await;
                    source.watch().await
                };
                let watched = tokio::select! {
                    () = tracker.stop.notified() => return,
                    watched = watched => watched,
                };
                backoff = (backoff * 2).min(Duration::from_secs(5));
                match watched {
                    Ok(watch) => {
                        lock(&tracker.status).broken = None;
                        stream = Some(watch);
                    }
                    Err(err) => tracker.broken(err),
                }
            }
        });
        *lock(&self.watcher) = Some(handle.abort_handle());
    }

    /// Consumes signals until the watch breaks (why), or it is asked to stop (`None`).
    async fn consume(&self, mut watch: CompletionStream) -> Option<BoxError> {
        loop {
            let next = tokio::select! {
                () = self.stop.notified() => return None,
                next = poll_fn(|cx| watch.as_mut().poll_next(cx)) => next,
            };
            match next {
                Some(Ok(key)) => self.complete(&key).await,
                Some(Err(err)) => return Some(err),
                None => return Some("the completion watch ended".into()),
            }
        }
    }

    async fn complete(&self, key: &str) {
        let removed = {
            let mut items = lock(&self.items);
            let removed = items.map.remove(key);
            items.running += usize::from(removed.is_some());
            removed
        };
        let Some((_, item)) = removed else {
            lock(&self.status).untracked += 1;
            return;
        };
        lock(&self.status).completed += 1;
        let result = match call_contained(|| (self.on_complete)(item)) {
            Ok(fut) => CatchPanic::new(fut).await.unwrap_or_else(|payload| {
                drop_contained(payload);
                Err("on_complete panicked".into())
            }),
            Err(_) => Err("on_complete panicked".into()),
        };
        if let (Err(err), Some(on_error)) = (result, &self.on_error) {
            let _ = call_contained(|| on_error(err));
        }
        let idle = {
            let mut items = lock(&self.items);
            items.running -= 1;
            items.is_idle()
        };
        if idle && self.orphaned.load(std::sync::atomic::Ordering::Acquire) {
            // Its dispatcher was dropped and this was the last item: the watch ends (this
            // item's `on_complete` has run to its end).
            self.stop_watching();
        }
    }

    fn broken(&self, err: BoxError) {
        // Written out before the lock: an error's `Display` is user code.
        let broken = err.to_string();
        {
            let mut status = lock(&self.status);
            status.watch_failures += 1;
            status.broken = Some(broken);
        }
        match &self.on_watch_error {
            Some(report) => {
                let _ = call_contained(|| report(err));
            }
            None => drop_contained(err),
        }
    }

    /// How many items wait for their signal (for tests and the snapshot).
    pub(crate) fn tracked(&self) -> usize {
        lock(&self.items).map.len()
    }
}
