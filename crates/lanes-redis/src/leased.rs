//! Leased capacity, the client half: a limit defined `leased` is served from this client's
//! share of it, with no round trip per acquire. A task per leased limit refreshes the share
//! every third of a lease ([`Inner::refresh_share`], the store's half), stating the demand
//! (permits out plus waiters) and the permits out; acquires are granted locally, first come
//! first served, while fewer than the share are out, each with a fencing token from the block
//! the last refresh reserved. A share that is not refreshed before its lease ends becomes
//! nothing, and every permit handed out from it is reported lost, because Redis gives the
//! capacity to others from then on.

// The crate root's private types and imports: this module is one of its impl blocks.
use super::*;

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;

/// One leased limit as this client serves it.
pub(crate) struct Leased {
    pub(crate) policy: SharePolicy,
    state: Mutex<LeasedState>,
    /// Woken when a permit may be free (a release, a larger share, new tokens).
    room: Notify,
}

#[derive(Default)]
struct LeasedState {
    share: u32,
    /// When the share ends unless refreshed (local time, no later than Redis's end).
    until: Option<Instant>,
    tokens: Range<u64>,
    /// Permits out: ticket -> its fencing token.
    holders: BTreeMap<u64, u64>,
    /// Tickets waiting, in arrival order.
    waiting: VecDeque<u64>,
}

impl Leased {
    pub(crate) fn new(policy: SharePolicy) -> Self {
        Self { policy, state: Mutex::new(LeasedState::default()), room: Notify::new() }
    }

    /// A grant for `ticket` if its turn has come and the share has room; else it waits in line.
    pub(crate) fn ask(&self, ticket: u64, queue: bool) -> Answer {
        let mut state = lock(&self.state);
        if let Some(token) = state.holders.get(&ticket) {
            return Answer::Granted(Grant { fencing_token: *token, expires_at: None });
        }
        let live = state.until.is_some_and(|until| until > Instant::now());
        let first = state.waiting.front().is_none_or(|head| *head == ticket);
        let room = (state.holders.len() as u32) < state.share && !state.tokens.is_empty();
        if live && first && room {
            if state.waiting.front() == Some(&ticket) {
                state.waiting.pop_front();
            }
            let token = state.tokens.next().expect("checked above");
            state.holders.insert(ticket, token);
            drop(state);
            // The next in line may fit too.
            self.room.notify_waiters();
            return Answer::Granted(Grant { fencing_token: token, expires_at: None });
        }
        if queue && !state.waiting.contains(&ticket) {
            state.waiting.push_back(ticket);
        }
        Answer::Queued
    }

    /// Gives `ticket`'s permit back, or withdraws it from the line.
    pub(crate) fn release(&self, ticket: u64) -> Released {
        let mut state = lock(&self.state);
        let released = if state.holders.remove(&ticket).is_some() {
            Released::Permit
        } else if let Some(at) = state.waiting.iter().position(|t| *t == ticket) {
            state.waiting.remove(at);
            Released::Withdrawn
        } else {
            Released::Unknown
        };
        drop(state);
        self.room.notify_waiters();
        released
    }

    /// Waits until a permit may be free, for at most `at_most`.
    pub(crate) async fn wait(&self, at_most: Duration) {
        let _ = tokio::time::timeout(at_most, self.room.notified()).await;
    }

    /// What to tell the store: (permits out, permits out plus waiters).
    fn demand(&self) -> (u32, u32) {
        let state = lock(&self.state);
        let held = state.holders.len() as u32;
        (held, held + state.waiting.len() as u32)
    }

    /// A refresh came back: the new share until `until`, and a new block of tokens if asked.
    fn renewed(&self, share: u32, until: Instant, tokens: Range<u64>) {
        let mut state = lock(&self.state);
        state.share = share;
        state.until = Some(until);
        if !tokens.is_empty() {
            state.tokens = tokens;
        }
        drop(state);
        self.room.notify_waiters();
    }

    /// The share lapsed unrefreshed: nothing more is granted, and every permit out is lost.
    fn lapse(&self, now: Instant) -> Vec<u64> {
        let mut state = lock(&self.state);
        if state.until.is_none_or(|until| until > now) {
            return Vec::new();
        }
        state.share = 0;
        state.until = None;
        std::mem::take(&mut state.holders).into_keys().collect()
    }

    fn tokens_left(&self) -> u64 {
        let state = lock(&self.state);
        state.tokens.end - state.tokens.start
    }
}

impl Inner {
    /// Starts serving `name` leased, if this client does not already.
    pub(crate) fn lease(&self, name: &str, policy: SharePolicy) -> Arc<Leased> {
        let mut state = lock(&self.state);
        if let Some(leased) = state.leased.get(name) {
            return leased.clone();
        }
        let leased = Arc::new(Leased::new(policy));
        state.leased.insert(name.to_owned(), leased.clone());
        drop(state);
        let me = self.me.get().cloned().unwrap_or_default();
        let task = tokio::spawn(refresh(me, name.to_owned(), leased.clone()));
        lock(&self.tasks).push(task);
        leased
    }

    /// The leased limit `name`, if this client serves it leased.
    pub(crate) fn leased(&self, name: &str) -> Option<Arc<Leased>> {
        lock(&self.state).leased.get(name).cloned()
    }
}

/// A leased limit's answer to an ask.
pub(crate) fn answer(leased: &Leased, ticket: u64, ask: &Ask) -> Answer {
    match ask {
        Ask::First(_) => leased.ask(ticket, true),
        Ask::Check | Ask::Try => leased.ask(ticket, false),
    }
}

/// Refreshes one leased limit's share every third of a lease (at once while it has waiters it
/// cannot serve, every tenth of a lease), and reports its permits lost if the share lapses.
async fn refresh(inner: Weak<Inner>, name: String, leased: Arc<Leased>) {
    loop {
        let Some(strong) = inner.upgrade() else { return };
        let (held, wanted) = leased.demand();
        let lease = strong.lease;
        // Enough tokens for a third of a lease at a full share's turnover, at least 64.
        let tokens = if leased.tokens_left() < u64::from(wanted.max(1)) * 4 {
            u64::from(wanted.max(16)) * 16
        } else {
            0
        };
        let sent = Instant::now();
        let demand = Demand::of(wanted);
        if let Ok(answer) = strong.refresh_share(&name, &demand, held, leased.policy, tokens).await
        {
            leased.renewed(answer.share, strong.lease_end(sent, lease), answer.tokens);
        }
        for ticket in leased.lapse(Instant::now()) {
            strong.mark_lost(&name, ticket);
        }
        let (_, wanted_now) = leased.demand();
        let starved = wanted_now > lock(&leased.state).share;
        drop(strong);
        let pause = if starved { lease / 10 } else { lease / 3 };
        tokio::time::sleep(pause).await;
    }
}
