//! The writer thread of a spill queue and the mailbox appenders hand it work through.
//!
//! Appenders frame their records straight into the mailbox's buffer (one copy from the
//! caller's bytes to the buffer, one from the buffer to the kernel) and leave a reply; the
//! writer swaps the whole buffer out in one lock, asks the [planner](super::core) what to do
//! with it, and performs the actions (invariants 1 and 3 of `handle.rs`). There is no message
//! per record: a group is whatever arrived while the last one was being written (and, but under
//! `Batch`, synced).
//!
//! Under `Batch` a second thread, the [`Syncer`], syncs behind the writer: the writer hands it
//! each written group's replies and goes on, and it answers them after the next sync it begins.
//! Everything written while one sync runs shares the next one, and the appenders answered by
//! one sync frame their next appends while the next runs: the disk is kept busy while the CPU
//! frames and writes. The adaptive linger (wait for the appenders the last sync answered, while
//! the bytes are few) happens there, before a sync, not before a write. A rotation or a close
//! first waits for the sync thread to answer everything handed to it, so appends are answered
//! in order of their segments.

use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::config::{SpillOptions, SyncPolicy};
use super::core::{Action, GROUP_BYTES, Group, LINGER_BYTES, Planner, lingers};
use super::error::SpillError;
use super::format::{Position, SEGMENT_HEADER, STATE, encode_state, segment_name};
use super::frame;
use super::handle::{Extent, Inner, create_segment};
use super::storage::{AppendFile, FileSync, Storage};
use crate::util::{Panicked, call_contained, lock};

/// A reply to an append, a commit or a close.
pub(super) type Reply = oneshot::Sender<Result<(), SpillError>>;

/// Where appenders leave work for the writer.
#[derive(Debug, Default)]
pub(super) struct Mailbox {
    inbox: Mutex<Inbox>,
    wake: Condvar,
}

#[derive(Debug, Default)]
pub(super) struct Inbox {
    /// The frames of every waiting append, back to back.
    buf: Vec<u8>,
    /// Each waiting append's frame bytes and reply, in order.
    appends: Vec<(usize, Reply)>,
    commits: Vec<Reply>,
    wanted: Option<Position>,
    close: Option<Reply>,
    /// No more work is taken: closing, or every handle is gone.
    shut: bool,
    /// The writer is waiting for work: an appender wakes it once `appends` reaches `want`.
    idle: bool,
    want: usize,
}

/// The mailbox refused the work: the queue is closing.
#[derive(Debug)]
pub(super) struct Shut;

impl Mailbox {
    /// Frames `records` (whose frames take `bytes`) into the buffer, to be answered on `reply`.
    pub(super) fn append<R: AsRef<[u8]>>(
        &self,
        records: &[R],
        bytes: usize,
        reply: Reply,
    ) -> Result<(), Shut> {
        let mut inbox = lock(&self.inbox);
        if inbox.shut {
            return Err(Shut);
        }
        inbox.buf.reserve(bytes);
        for record in records {
            frame::encode(record.as_ref(), &mut inbox.buf);
        }
        inbox.appends.push((bytes, reply));
        self.wake(inbox);
        Ok(())
    }

    /// Asks for the committed position `to` to be persisted, answered on `reply`.
    pub(super) fn commit(&self, to: Position, reply: Reply) -> Result<(), Shut> {
        let mut inbox = lock(&self.inbox);
        if inbox.shut {
            return Err(Shut);
        }
        inbox.wanted = inbox.wanted.max(Some(to));
        inbox.commits.push(reply);
        self.wake(inbox);
        Ok(())
    }

    /// Asks the writer to make everything durable and stop; `reply` answers once it has.
    pub(super) fn close(&self, reply: Reply) -> Result<(), Shut> {
        let mut inbox = lock(&self.inbox);
        if inbox.shut {
            return Err(Shut);
        }
        inbox.shut = true;
        inbox.close = Some(reply);
        self.wake(inbox);
        Ok(())
    }

    /// Every handle is gone: the writer finishes what it holds and stops.
    pub(super) fn abandon(&self) {
        let mut inbox = lock(&self.inbox);
        inbox.shut = true;
        self.wake(inbox);
    }

    fn wake(&self, mut inbox: MutexGuard<'_, Inbox>) {
        let enough = inbox.appends.len() >= inbox.want || inbox.shut || !inbox.commits.is_empty();
        if inbox.idle && enough {
            inbox.idle = false;
            drop(inbox);
            self.wake.notify_one();
        }
    }
}

/// What the writer took from the mailbox in one turn.
#[derive(Default)]
struct Taken {
    buf: Vec<u8>,
    appends: Vec<(usize, Reply)>,
    commits: Vec<Reply>,
    close: Option<Reply>,
    tick: bool,
    /// The mailbox is shut and was emptied: this is the last turn.
    last: bool,
}

/// The writer thread's state.
pub(super) struct Writer {
    pub(super) inner: std::sync::Weak<Inner>,
    pub(super) mailbox: Arc<Mailbox>,
    pub(super) storage: Arc<dyn Storage>,
    pub(super) options: SpillOptions,
    pub(super) planner: Planner,
    pub(super) file: Box<dyn AppendFile>,
    pub(super) active: u64,
    pub(super) active_len: u64,
    pub(super) unsynced: bool,
    pub(super) last_sync: Instant,
    /// How long the last sync took (a `Batch` group lingers for at most half of it).
    pub(super) sync_took: Duration,
    /// How many appends the last group held.
    pub(super) last_group: usize,
    /// The committed position the state file holds.
    pub(super) persisted: Position,
    /// The latest committed position asked for.
    pub(super) wanted: Position,
    /// Released when the writer stops, after its last sync (and before `close` answers, so
    /// the directory is free once `close` returns).
    pub(super) lock: Option<Box<dyn fmt::Debug + Send + Sync>>,
    /// Under `Batch`, the thread that syncs behind the writer (when the storage offers a
    /// [`FileSync`]), and the active segment's handle for it.
    pub(super) syncer: Option<(Syncer, Arc<dyn FileSync>)>,
}

impl Writer {
    pub(super) fn run(mut self) {
        // The buffers go back and forth between the mailbox and the writer, keeping their
        // capacity: no allocation per group once warm.
        let mut taken = Taken::default();
        loop {
            self.take(&mut taken);
            let last = taken.last;
            // `handle` contains the group's work inside its span; a panic in the span itself
            // (a subscriber's, entering or leaving it) is caught here.
            if call_contained(|| self.handle(&mut taken)).and_then(|handled| handled).is_err() {
                self.panicked(&mut taken);
            }
            if last {
                return;
            }
        }
    }

    /// After [`handle`](Self::handle) panicked (a tracing subscriber's panic in the group's
    /// span or an event, or a bug): the queue fails as after an I/O error, so later appends
    /// and commits are answered with the failure and no more is written, and so are the
    /// group's unanswered ones (an append the panic cut off may have been written: `Failed`
    /// says as much, where a dropped answer would have said `Closed`). A close finishes, as
    /// one after an I/O error does, so that the directory's lock goes and `drained` resolves.
    /// Unwound, the panic ended this thread with the mailbox open: every later append waited
    /// for good.
    fn panicked(&mut self, taken: &mut Taken) {
        let cause = self.fail("the spill writer panicked");
        let failed = || Err(SpillError::Failed(cause.clone()));
        for (_, reply) in taken.appends.drain(..) {
            let _ = reply.send(failed());
        }
        for reply in taken.commits.drain(..) {
            let _ = reply.send(failed());
        }
        taken.buf.clear();
        taken.tick = false;
        if taken.last {
            // The close's own steps, best effort: what earlier groups handed the sync thread
            // is answered, and the file is trimmed, synced and its state persisted.
            let _ = call_contained(|| self.close_files());
            self.closed();
            if let Some(reply) = taken.close.take() {
                let _ = reply.send(Err(SpillError::Failed(cause)));
            }
        }
    }

    /// A close's work on the files: what was handed to the sync thread is answered, and the
    /// active file is trimmed (a closed queue leaves its files exactly as long as their data;
    /// a failed trim leaves reserved zeros, which recovery reads as unwritten), synced and its
    /// state persisted. The sync's and the state write's result.
    fn close_files(&mut self) -> std::io::Result<()> {
        self.settle();
        if self.file.trim().is_ok() {
            self.unsynced = true;
        }
        self.sync().and_then(|()| self.persist())
    }

    /// The close is done: the directory's lock goes and `drained` resolves, and readers
    /// waiting for records learn that no more will come.
    fn closed(&mut self) {
        drop(self.lock.take());
        if let Some(inner) = self.inner.upgrade() {
            inner.finished.send_replace(true);
            inner.data.notify_waiters();
        }
    }

    /// Waits for work and takes all of it (under `Batch` with a window, lingering for more).
    fn take(&mut self, taken: &mut Taken) {
        let mut inbox = lock(&self.mailbox.inbox);
        let interval = match self.options.sync {
            SyncPolicy::Interval(every) => Some(every),
            _ => None,
        };
        loop {
            let work = !inbox.appends.is_empty() || !inbox.commits.is_empty();
            if work || inbox.shut {
                break;
            }
            if let Some(every) = interval {
                let left = every.saturating_sub(self.last_sync.elapsed());
                if left.is_zero() {
                    taken.tick = true;
                    // The next tick is an interval on, whether this one's sync runs or not:
                    // once the queue failed its syncs are skipped, and a tick timed from the
                    // last sync that ran came at once, every turn (the writer spun until
                    // closed, retrying a failed state write each turn).
                    self.last_sync = Instant::now();
                    break;
                }
                inbox = self.wait(inbox, 1, Some(left));
            } else {
                // No spin first: on 2 cores a spinning writer takes the core the appender it
                // waits for needs (measured: a 30 µs spin cost `Always` 10% at 64 KiB, 200 µs
                // cost it a third).
                inbox = self.wait(inbox, 1, None);
            }
        }
        let window = self.options.batch_window;
        // With a sync thread, a group is written at once: the sync thread's next sync covers
        // whatever arrives while its current one runs, so waiting here would only delay it.
        let adaptive = window.is_zero() && self.syncer.is_none();
        if self.options.sync == SyncPolicy::Batch && (adaptive || !window.is_zero()) {
            // Linger for the appenders the last group answered (they are likely on their way
            // back) while the group is small enough for a sync to cost more than its bytes,
            // for at most half a sync; or for the configured window.
            let (want, linger, most) = match adaptive {
                true => (self.last_group, (self.sync_took / 2).min(MAX_LINGER), LINGER_BYTES),
                false => (usize::MAX, window, GROUP_BYTES),
            };
            let deadline = Instant::now() + linger;
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                let more = lingers(inbox.appends.len(), inbox.buf.len(), want, most);
                if left.is_zero() || inbox.shut || !more {
                    break;
                }
                inbox = self.wait(inbox, want, Some(left));
            }
        }
        std::mem::swap(&mut taken.buf, &mut inbox.buf);
        std::mem::swap(&mut taken.appends, &mut inbox.appends);
        self.last_group = taken.appends.len().max(1);
        std::mem::swap(&mut taken.commits, &mut inbox.commits);
        if let Some(to) = inbox.wanted.take() {
            self.wanted = self.wanted.max(to);
        }
        taken.close = inbox.close.take();
        taken.last = inbox.shut;
        if let SyncPolicy::Interval(every) = self.options.sync {
            taken.tick |= self.last_sync.elapsed() >= every;
        }
    }

    /// Waits until woken (an appender brought `want` appends, a commit, a close) or `timeout`.
    fn wait<'a>(
        &self,
        mut inbox: MutexGuard<'a, Inbox>,
        want: usize,
        timeout: Option<Duration>,
    ) -> MutexGuard<'a, Inbox> {
        inbox.idle = true;
        inbox.want = want;
        let mut inbox = match timeout {
            Some(left) => {
                let wake = &self.mailbox.wake;
                wake.wait_timeout(inbox, left).unwrap_or_else(|e| e.into_inner()).0
            }
            None => self.mailbox.wake.wait(inbox).unwrap_or_else(|e| e.into_inner()),
        };
        inbox.idle = false;
        inbox
    }

    /// Handles a group in its span: the work is contained inside it, so that a panic there
    /// never unwinds through the span's exit (a subscriber that panics again there would
    /// abort the process). `Err` if it panicked.
    fn handle(&mut self, taken: &mut Taken) -> Result<(), Panicked> {
        let _span = tracing::trace_span!(
            "lanes.spill.group",
            appends = taken.appends.len(),
            bytes = taken.buf.len(),
            commits = taken.commits.len(),
        )
        .entered();
        call_contained(|| self.handle_group(taken))
    }

    /// Plans the group and performs the plan. After a failure, no more I/O: every append is
    /// answered with the failure, and commits with the error.
    fn handle_group(&mut self, taken: &mut Taken) {
        let group = Group {
            appends: taken.appends.iter().map(|(bytes, _)| *bytes).collect(),
            commit: !taken.commits.is_empty(),
            frees: self.wanted.segment > self.persisted.segment,
            tick: taken.tick,
            close: taken.last,
        };
        let mut failure: Option<Arc<str>> =
            self.inner.upgrade().and_then(|i| lock(&i.shared).failed.clone());
        let mut replies = Answering { replies: taken.appends.drain(..), inner: self.inner.clone() };
        let mut answered = 0;
        let mut persisted: Result<(), Arc<str>> = Ok(());
        let mut plan = self.planner.plan(&group);
        if self.syncer.is_none() {
            // No sync thread: this thread syncs, then answers.
            plan = plan
                .into_iter()
                .flat_map(|action| match action {
                    Action::SyncThenAnswer(upto) => vec![Action::Sync, Action::Answer(upto)],
                    action => vec![action],
                })
                .collect();
        }
        for action in plan {
            let done = match action {
                Action::Write(range) if failure.is_none() => self.write(&taken.buf[range]),
                Action::Sync if failure.is_none() => self.sync(),
                Action::Rotate if failure.is_none() => {
                    // The sync thread may have failed since this group began: a failed sync
                    // may have lost pages that the rotation's own sync would then pass as
                    // durable, so nothing more is written or answered as durable.
                    failure = self.settle();
                    match failure {
                        None => self.rotate(),
                        Some(_) => Ok(()),
                    }
                }
                Action::Write(_) | Action::Sync | Action::Rotate => Ok(()),
                Action::SyncThenAnswer(upto) if failure.is_none() => {
                    let (syncer, file) = self.syncer.as_ref().expect("planned with a sync thread");
                    syncer.hand(file, replies.by_ref().take(upto - answered));
                    answered = upto;
                    Ok(())
                }
                Action::Answer(upto) | Action::SyncThenAnswer(upto) => {
                    for (_, reply) in replies.by_ref().take(upto - answered) {
                        let _ = reply.send(match &failure {
                            None => Ok(()),
                            Some(cause) => Err(SpillError::Failed(cause.clone())),
                        });
                    }
                    answered = upto;
                    Ok(())
                }
                Action::Persist => {
                    // A failed state write fails the commits, not the appends; one that no
                    // commit waits for (an `Interval` tick's) is said here, or nobody would.
                    persisted = self.persist().map_err(|e| Arc::from(e.to_string()));
                    if let Err(err) = &persisted
                        && taken.commits.is_empty()
                    {
                        tracing::warn!(segment = self.active, error = %err, "spill state write failed; acknowledged segments stay until a later one succeeds");
                    }
                    Ok(())
                }
                Action::AnswerCommits => {
                    for reply in taken.commits.drain(..) {
                        let result = persisted.clone();
                        let _ =
                            reply
                                .send(result.map_err(|e| {
                                    SpillError::Io(std::io::Error::other(e.as_ref()))
                                }));
                    }
                    Ok(())
                }
                Action::Close => {
                    let result = self.close_files();
                    self.closed();
                    if let Some(reply) = taken.close.take() {
                        let _ = reply.send(result.map_err(SpillError::Io));
                    }
                    Ok(())
                }
            };
            if let Err(err) = done {
                // Failed before the event, which a subscriber may panic in (`run` contains it).
                failure = Some(self.fail(&err.to_string()));
                tracing::error!(segment = self.active, error = %err, "spill write failed; the queue fails every later append");
            }
        }
        taken.buf.clear();
        taken.tick = false;
    }

    /// Writes `buf` to the active segment and publishes the new end to readers.
    fn write(&mut self, buf: &[u8]) -> std::io::Result<()> {
        self.file.append(buf)?;
        self.active_len += buf.len() as u64;
        self.unsynced = true;
        if let Some(inner) = self.inner.upgrade() {
            let mut shared = lock(&inner.shared);
            if let Some(extent) = shared.extents.get_mut(&self.active) {
                extent.valid_end = self.active_len;
            }
            drop(shared);
            inner.data.notify_waiters();
        }
        Ok(())
    }

    fn sync(&mut self) -> std::io::Result<()> {
        if self.unsynced {
            let start = Instant::now();
            self.file.sync()?;
            self.sync_took = start.elapsed();
            self.unsynced = false;
        }
        self.last_sync = Instant::now();
        Ok(())
    }

    /// Seals the active segment (synced) and starts the next one.
    fn rotate(&mut self) -> std::io::Result<()> {
        // The seal says where the data ends, so recovery can tell a complete segment from one
        // that lost its end. Not part of the readable range (the extent ends before it).
        let mut seal = Vec::with_capacity(frame::SEAL_LEN as usize);
        frame::encode_seal(self.active_len, &mut seal);
        self.file.append(&seal)?;
        self.active_len += frame::SEAL_LEN;
        // A sealed segment ends at its seal: no reserved zeros behind it.
        self.file.trim()?;
        self.unsynced = true;
        self.sync()?;
        // The next id, past any a non-file entry holds (a directory or symlink named like a
        // segment: never a segment, and recovery tells it so, not as a lost one).
        let mut id = self.active + 1;
        self.file = loop {
            match create_segment(&*self.storage, id, self.options.segment_size) {
                Err(err)
                    if err.kind() == std::io::ErrorKind::AlreadyExists
                        && self.storage.list_other()?.contains(&segment_name(id)) =>
                {
                    id = id.checked_add(1).ok_or(err)?;
                }
                made => break made?,
            }
        };
        self.active = id;
        self.active_len = SEGMENT_HEADER;
        if let Some((_, file)) = &mut self.syncer {
            *file = self.file.syncer()?.expect("the storage offered a sync handle before");
        }
        // After the file exists (a crash in between leaves a segment past the recorded last,
        // which is fine; the other order would report a loss that did not happen).
        self.storage.write_atomic(STATE, &encode_state(self.persisted, id))?;
        if let Some(inner) = self.inner.upgrade() {
            let mut shared = lock(&inner.shared);
            shared.extents.insert(id, Extent { valid_end: SEGMENT_HEADER, skipped: Vec::new() });
            shared.active = id;
        }
        Ok(())
    }

    /// Writes the state file if the committed position moved, then deletes the segments it
    /// fully covers (invariant 3).
    fn persist(&mut self) -> std::io::Result<()> {
        if self.wanted <= self.persisted {
            return Ok(());
        }
        self.storage.write_atomic(STATE, &encode_state(self.wanted, self.active))?;
        self.persisted = self.wanted;
        let covered: Vec<u64> = match self.inner.upgrade() {
            Some(inner) => {
                let mut shared = lock(&inner.shared);
                shared.persisted = self.persisted;
                let ids: Vec<u64> = shared
                    .extents
                    .range(..self.persisted.segment)
                    .map(|(id, _)| *id)
                    .filter(|id| *id != self.active)
                    .collect();
                for id in &ids {
                    shared.extents.remove(id);
                }
                ids
            }
            None => Vec::new(),
        };
        for id in covered {
            self.storage.remove(&segment_name(id))?;
        }
        if !matches!(self.options.sync, SyncPolicy::Never) {
            self.storage.sync_dir()?;
        }
        Ok(())
    }

    /// Waits until the sync thread answered every append handed to it (so appends are
    /// answered in order of their segments), then returns the queue's failure, if any.
    fn settle(&self) -> Option<Arc<str>> {
        if let Some((syncer, _)) = &self.syncer {
            syncer.drain();
        }
        self.inner.upgrade().and_then(|inner| lock(&inner.shared).failed.clone())
    }

    /// Makes the queue refuse appends from now on.
    fn fail(&mut self, cause: &str) -> Arc<str> {
        fail(&self.inner, cause)
    }
}

/// The appends of a group on their way to their answers: any left when a panic unwinds
/// through it are answered with the queue's failure (the panic's, `Writer::panicked`), not
/// dropped.
struct Answering<I: Iterator<Item = (usize, Reply)>> {
    replies: I,
    inner: std::sync::Weak<Inner>,
}

impl<I: Iterator<Item = (usize, Reply)>> Iterator for Answering<I> {
    type Item = (usize, Reply);

    fn next(&mut self) -> Option<Self::Item> {
        self.replies.next()
    }
}

impl<I: Iterator<Item = (usize, Reply)>> Drop for Answering<I> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let cause = fail(&self.inner, "the spill writer panicked");
            for (_, reply) in self.replies.by_ref() {
                let _ = reply.send(Err(SpillError::Failed(cause.clone())));
            }
        }
    }
}

/// The thread that syncs behind the writer under `Batch`: the writer hands it the appends of a
/// written group and goes on to the next; it syncs once for everything handed to it while its
/// previous sync ran, then answers them. After a failed sync it answers every later append with
/// the failure (a page the kernel failed to write back may be gone: nothing after it is durable).
#[derive(Debug)]
pub(super) struct Syncer {
    shared: Arc<SyncShared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[derive(Debug, Default)]
struct SyncShared {
    state: Mutex<SyncState>,
    /// Wakes the sync thread: work was handed over, or it should stop.
    wake: Condvar,
    /// Wakes a writer waiting in [`Syncer::drain`].
    drained: Condvar,
}

#[derive(Debug, Default)]
struct SyncState {
    /// The files to sync, in order, each with the appends a sync of it answers.
    jobs: Vec<(Arc<dyn FileSync>, Vec<Reply>)>,
    /// Jobs taken and not yet answered.
    busy: bool,
    stop: bool,
    /// The appends and frame bytes waiting in `jobs`.
    appends: usize,
    bytes: usize,
    /// The sync thread is lingering for `want` appends (the last sync's count, at least 1).
    lingering: bool,
    want: usize,
}

impl Syncer {
    /// Starts the sync thread of the queue `inner`.
    pub(super) fn start(inner: std::sync::Weak<Inner>) -> std::io::Result<Self> {
        let shared = Arc::new(SyncShared::default());
        let thread = std::thread::Builder::new().name("lanes-spill-sync".to_owned()).spawn({
            let shared = shared.clone();
            move || sync_loop(&shared, &inner)
        })?;
        Ok(Self { shared, thread: Some(thread) })
    }

    /// Hands over appends (their frame bytes and replies), to be answered once a sync of
    /// `file` begun from now has ended.
    fn hand(&self, file: &Arc<dyn FileSync>, appends: impl Iterator<Item = (usize, Reply)>) {
        let mut state = lock(&self.shared.state);
        let state = &mut *state;
        let replies = appends.map(|(bytes, reply)| {
            state.appends += 1;
            state.bytes += bytes;
            reply
        });
        match state.jobs.last_mut() {
            Some((last, waiting)) if Arc::ptr_eq(last, file) => waiting.extend(replies),
            _ => {
                let replies = replies.collect();
                state.jobs.push((file.clone(), replies));
            }
        }
        if !state.lingering || !lingers(state.appends, state.bytes, state.want, LINGER_BYTES) {
            self.shared.wake.notify_one();
        }
    }

    /// Waits until every append handed over was answered.
    fn drain(&self) {
        let mut state = lock(&self.shared.state);
        while state.busy || !state.jobs.is_empty() {
            state = self.shared.drained.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl Drop for Syncer {
    fn drop(&mut self) {
        lock(&self.shared.state).stop = true;
        self.shared.wake.notify_one();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn sync_loop(shared: &SyncShared, inner: &std::sync::Weak<Inner>) {
    let mut failure: Option<Arc<str>> = None;
    let mut jobs = Vec::new();
    let mut took = Duration::ZERO;
    loop {
        let mut state = lock(&shared.state);
        state.busy = false;
        if state.jobs.is_empty() {
            shared.drained.notify_all();
        }
        while state.jobs.is_empty() && !state.stop {
            state = shared.wake.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        if state.jobs.is_empty() {
            return;
        }
        // The adaptive linger of `Batch`: wait for the appenders the last sync answered (they
        // are likely on their way back) while the handed bytes are few enough for a sync to
        // cost more than they do, for at most half a sync. Writes go on meanwhile.
        let deadline = Instant::now() + (took / 2).min(MAX_LINGER);
        while !state.stop && lingers(state.appends, state.bytes, state.want, LINGER_BYTES) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            state.lingering = true;
            state = shared.wake.wait_timeout(state, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        state.lingering = false;
        state.want = state.appends.max(1);
        (state.appends, state.bytes) = (0, 0);
        std::mem::swap(&mut jobs, &mut state.jobs);
        state.busy = true;
        drop(state);
        let start = Instant::now();
        for (file, replies) in jobs.drain(..) {
            // A sync that panics (a careless `Storage`) is a failed sync: unwound, it would end
            // this thread with the job taken, and the writer would wait for it for good.
            let synced = || {
                call_contained(|| file.sync())
                    .unwrap_or_else(|_| Err(std::io::Error::other("the storage's sync panicked")))
            };
            if failure.is_none()
                && let Err(err) = synced()
            {
                failure = Some(fail(inner, &err.to_string()));
                // Contained: unwound, a subscriber's panic would end this thread with the job
                // taken, and the writer would wait for it for good.
                let _ = call_contained(|| {
                    tracing::error!(error = %err, "spill sync failed; the queue fails every later append");
                });
            }
            for reply in replies {
                let _ = reply.send(match &failure {
                    None => Ok(()),
                    Some(cause) => Err(SpillError::Failed(cause.clone())),
                });
            }
        }
        took = start.elapsed();
    }
}

/// Makes the queue refuse appends from now on; the cause it keeps (the first one).
fn fail(inner: &std::sync::Weak<Inner>, cause: &str) -> Arc<str> {
    let cause: Arc<str> = Arc::from(cause);
    match inner.upgrade() {
        Some(inner) => lock(&inner.shared).failed.get_or_insert_with(|| cause.clone()).clone(),
        None => cause,
    }
}

/// The longest a `Batch` group lingers for returning appenders.
const MAX_LINGER: Duration = Duration::from_millis(1);
