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

use super::handle::Process;
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

/// A registered key.
struct Entry<T> {
    /// The tracked copy of the item, until its signal takes it for `on_complete`.
    waiting: Option<T>,
    /// The item is still with the dispatcher: being submitted, queued or processed. Its key
    /// stays registered until then, signal or not (another item of the key is refused
    /// `DuplicateKey`), so whatever ends its stay (its processing, or a refused or dropped
    /// submit) finds its own registration by key.
    held: bool,
}

/// The registered keys, and the completions under way.
struct Items<T> {
    map: FastMap<String, Entry<T>>,
    /// Entries whose item waits for its signal (the snapshot's `tracked`).
    waiting: usize,
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
    /// The item registered under `key` left the dispatcher: processed (`ok`), or failed,
    /// panicked, refused its limit's permit or cancelled, or its submit was refused or dropped
    /// while it waited. A processed item waits on for its
    /// signal; any other is forgotten (it was not handed on, so no signal is to come, and it
    /// must not hold a tracking place for good). Either way, a signal that came meanwhile
    /// leaves the key free.
    pub(crate) fn left(&self, key: &str, ok: bool) {
        let (removed, idle) = {
            let mut items = lock(&self.items);
            let removed = match items.map.get_mut(key) {
                Some(entry) if ok && entry.waiting.is_some() => {
                    entry.held = false;
                    None
                }
                Some(_) => items.remove(key),
                // Untracked meanwhile: a stop or an abort.
                None => None,
            };
            (removed, items.is_idle())
        };
        drop_contained(removed);
        self.stop_if_orphaned(idle);
    }

    /// Ends the watch of an orphaned tracker that went idle.
    fn stop_if_orphaned(&self, idle: bool) {
        if idle && self.orphaned.load(std::sync::atomic::Ordering::Acquire) {
            self.stop_watching();
        }
    }

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
        let entries = {
            let mut items = lock(&self.items);
            items.waiting = 0;
            std::mem::take(&mut items.map)
        };
        drop_contained(entries);
    }
}

/// A tracked dispatcher's process function: tells the tracker when each item leaves the
/// dispatcher, and how ([`Tracker::left`]).
pub(crate) struct TrackedProcess<P, T> {
    process: P,
    tracker: Arc<Tracker<T>>,
}

impl<P, T> TrackedProcess<P, T> {
    pub(crate) fn new(process: P, tracker: Arc<Tracker<T>>) -> Self {
        Self { process, tracker }
    }
}

impl<T: Send + 'static, P: Process<T>> Process<T> for TrackedProcess<P, T> {
    type Future = Leaving<P::Future, T>;

    fn call(&self, worker: usize, item: T) -> Self::Future {
        // Made first: a process function that panics before it returns a future drops it,
        // which tells the tracker the item failed.
        let leaves =
            Leaves { key: Some((self.tracker.key_of)(&item)), tracker: self.tracker.clone() };
        Leaving { inner: self.process.call(worker, item), leaves }
    }

    fn skipped(&self, item: &T) {
        self.tracker.left(&(self.tracker.key_of)(item), false);
    }
}

/// Tells the tracker that an item left: at the end of its processing, or, dropped before
/// (a panic, an abort), that it failed.
pub(crate) struct Leaves<T> {
    key: Option<String>,
    tracker: Arc<Tracker<T>>,
}

impl<T> Leaves<T> {
    fn left(&mut self, ok: bool) {
        if let Some(key) = self.key.take() {
            self.tracker.left(&key, ok);
        }
    }
}

impl<T> Drop for Leaves<T> {
    fn drop(&mut self) {
        self.left(false);
    }
}

pin_project_lite::pin_project! {
    /// A tracked item's processing, which tells the tracker how it ended.
    pub(crate) struct Leaving<F, T> {
        #[pin]
        inner: F,
        leaves: Leaves<T>,
    }
}

impl<F: Future<Output = Result<(), BoxError>>, T> Future for Leaving<F, T> {
    type Output = Result<(), BoxError>;

    fn poll(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let this = self.project();
        let done = std::task::ready!(this.inner.poll(cx));
        this.leaves.left(done.is_ok());
        std::task::Poll::Ready(done)
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
    /// No item waits for its signal, no `on_complete` runs.
    fn is_idle(&self) -> bool {
        self.waiting == 0 && self.running == 0
    }

    /// Removes `key`'s entry, answering its item if that still waited for its signal.
    fn remove(&mut self, key: &str) -> Option<T> {
        let waiting = self.map.remove(key)?.waiting;
        self.waiting -= usize::from(waiting.is_some());
        waiting
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
            items: Mutex::new(Items { map: FastMap::default(), waiting: 0, running: 0 }),
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

    /// Registers `item` under `key` before it is enqueued; [`left`](Self::left) ends it.
    pub(crate) fn track(&self, key: String, item: T) -> Result<(), Untracked> {
        let mut items = lock(&self.items);
        if items.map.contains_key(&key) {
            return Err(Untracked::Duplicate);
        }
        if items.map.len() >= self.max {
            return Err(Untracked::Full);
        }
        items.waiting += 1;
        items.map.insert(key, Entry { waiting: Some(item), held: true });
        Ok(())
    }

    pub(crate) fn snapshot(&self) -> CompletionSnapshot {
        let mut status = lock(&self.status).clone();
        status.tracked = lock(&self.items).waiting;
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
        let taken = {
            let mut guard = lock(&self.items);
            let items = &mut *guard;
            let taken = match items.map.get_mut(key) {
                // Its item is still with the dispatcher: the key stays registered until it
                // leaves.
                Some(entry) if entry.held => {
                    let taken = entry.waiting.take();
                    items.waiting -= usize::from(taken.is_some());
                    taken
                }
                Some(_) => items.remove(key),
                None => None,
            };
            items.running += usize::from(taken.is_some());
            taken
        };
        let Some(item) = taken else {
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
        // Its dispatcher was dropped and this was the last item: the watch ends (this item's
        // `on_complete` has run to its end).
        self.stop_if_orphaned(idle);
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
        lock(&self.items).waiting
    }
}
