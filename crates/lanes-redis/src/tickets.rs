//! This client's bookkeeping of its tickets, per limit: one state per ticket.
//!
//! A ticket moves through these states (anything else is absent from the map):
//!
//! ```text
//!             ask                  granted by push or for another ask
//!   (absent) ─────▶ Waiting ──────────────────────────────────────▶ Granted
//!                     │  │ granted to its own ask                      │ claimed by its acquire
//!                     │  └──────────────────────────────▶ Held ◀───────┘
//!                     │ Redis unreachable
//!                     └──────▶ Open (fail-open) or Local (the local share)
//! ```
//!
//! A release removes a ticket from any state; a lost lease removes a `Held` or `Granted` one.
//! The waiting tickets are also kept in ticket order: the first is the client's asker.

// The crate root's private types and imports: this module is one of its impl blocks.
use super::*;

use std::collections::{HashSet, VecDeque};

#[derive(Default)]
pub(crate) struct State {
    pub(crate) limits: HashMap<String, ClientLimit>,
    /// Specs this client defined or read, for the local share and for redefinition after
    /// Redis lost its state.
    pub(crate) specs: HashMap<String, LimitSpec>,
    /// The limits this client defined itself: the only ones it defines again when one is gone
    /// while Redis kept its state (another client removed it, or it was lost with the last
    /// writes); a limit it only read is then unknown to it too.
    pub(crate) defined: HashSet<String>,
    /// The mode this client defined a limit with ("leased:maxmin", "leased:proportional"),
    /// given again whenever it defines the limit again; none for exact limits.
    pub(crate) modes: HashMap<String, String>,
    /// Releases that could not reach Redis, retried in the background.
    pub(crate) orphans: Orphans,
}

impl State {
    /// Every ticket still in use on some limit: known to this client (waiting, held, local or
    /// granted open), or its release not sent yet (a rider, or one kept through an outage).
    /// Redis would take an ask with such a ticket for the same ask again.
    pub(crate) fn tickets_in_use(&self) -> HashSet<u64> {
        let mut live: HashSet<u64> = self.orphans.tickets().collect();
        for limit in self.limits.values() {
            live.extend(limit.tickets.keys());
            live.extend(limit.riders.iter().map(|&(ticket, _)| ticket));
        }
        live
    }
}

/// Releases that could not reach Redis (or whose answer was lost), retried in the background
/// in batches: by limit, oldest first, at most `max` tickets in all.
///
/// Past the bound the oldest ticket of the limit is abandoned, and counted: an outage must not
/// grow it without end (every try answered by no one adds one). Abandoning one is safe, it only
/// frees capacity later: Redis ends a permit's lease without its renewal, and a queued ticket
/// granted later to nobody is handed back when its grant's push arrives.
pub(crate) struct Orphans {
    by_limit: HashMap<String, VecDeque<u64>>,
    len: usize,
    /// Taken for a call under way ([`settled`](Self::settled) when it ends).
    in_flight: usize,
    max: usize,
    abandoned: u64,
}

impl Default for Orphans {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_PENDING_RELEASES)
    }
}

/// The default bound on releases waiting for Redis.
pub(crate) const DEFAULT_MAX_PENDING_RELEASES: usize = 65_536;

impl Orphans {
    pub(crate) fn new(max: usize) -> Self {
        Self { by_limit: HashMap::new(), len: 0, in_flight: 0, max, abandoned: 0 }
    }

    /// Every ticket waiting here for its release.
    fn tickets(&self) -> impl Iterator<Item = u64> + '_ {
        self.by_limit.values().flatten().copied()
    }

    /// Keeps `ticket` of limit `name` to be released once Redis answers.
    pub(crate) fn push(&mut self, name: &str, ticket: u64) {
        let queue = match self.by_limit.get_mut(name) {
            Some(queue) => queue,
            None => self.by_limit.entry(name.to_owned()).or_default(),
        };
        queue.push_back(ticket);
        if self.len < self.max {
            self.len += 1;
        } else {
            queue.pop_front();
            self.abandoned += 1;
        }
    }

    /// Up to `calls` batches of up to `per_call` tickets each, every batch of one limit, taken
    /// out to be released now, a batch of each limit in turn (one limit's backlog does not
    /// hold back the others'). Each batch is [`settled`](Self::settled) when its call ends.
    pub(crate) fn take(&mut self, calls: usize, per_call: usize) -> Vec<(String, Vec<u64>)> {
        let mut batches: Vec<(String, Vec<u64>)> = Vec::new();
        let mut taken = 0;
        while batches.len() < calls && taken < self.len {
            for (name, queue) in &mut self.by_limit {
                if batches.len() == calls {
                    break;
                }
                if !queue.is_empty() {
                    let batch: Vec<u64> = queue.drain(..queue.len().min(per_call)).collect();
                    taken += batch.len();
                    batches.push((name.clone(), batch));
                }
            }
        }
        self.by_limit.retain(|_, queue| !queue.is_empty());
        self.len -= taken;
        self.in_flight += taken;
        batches
    }

    /// A call for `n` tickets [taken](Self::take) ended (those that must be tried again are
    /// pushed back).
    pub(crate) fn settled(&mut self, n: usize) {
        self.in_flight -= n;
    }

    /// Gives up `n` tickets taken for a call that failed for good.
    pub(crate) fn abandon(&mut self, n: usize) {
        self.abandoned += n as u64;
    }

    /// Tickets waiting to be released, or in a call under way.
    pub(crate) fn len(&self) -> usize {
        self.len + self.in_flight
    }

    /// Tickets abandoned over the bound, since the client was built.
    pub(crate) fn abandoned(&self) -> u64 {
        self.abandoned
    }
}

/// Where one ticket of this client stands.
#[derive(Debug)]
enum Ticket {
    /// Queued on the server (or about to be), woken through `notify`.
    Waiting {
        notify: Arc<Notify>,
        /// The priority of its first ask, to queue it again if Redis lost it.
        priority: Option<Priority>,
        /// Its last answer was "retry after" (the bucket is empty).
        retrying: bool,
        /// Asked with its own lease: its holder renews it (the server's clients).
        external: bool,
    },
    /// The server granted it (pushed, or while another ticket asked); its acquire has not
    /// claimed the grant yet. It holds a permit on the server.
    Granted { grant: Grant, external: bool, until: Instant },
    /// Holds a permit on the server; renewed in the background unless `external`. `until` is
    /// when its lease may end on the server unless renewed (local time, no later than the
    /// server's end: counted from when the grant or the last renewal was asked for).
    Held { external: bool, until: Instant },
    /// Granted without a permit (fail-open).
    Open,
    /// Lives in the local share.
    Local,
}

impl Ticket {
    fn external(&self) -> bool {
        match self {
            Self::Waiting { external, .. }
            | Self::Granted { external, .. }
            | Self::Held { external, .. } => *external,
            Self::Open | Self::Local => false,
        }
    }

    fn holds_remote(&self) -> bool {
        matches!(self, Self::Granted { .. } | Self::Held { .. })
    }
}

/// Where a released ticket was, so the release goes to the right place.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Place {
    Open,
    Local,
    Remote,
}

/// What a grant made for a ticket other than the asker found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Delivered {
    /// Its waiter was woken with the grant.
    Woken,
    /// The ticket already held it (its own answer got here first): nothing new.
    Already,
    /// Its waiter is gone (released or dropped): hand the permit back.
    Gone,
}

/// How a waiting ticket should wait.
pub(crate) enum WaitPlan {
    /// It is granted (or open) already.
    Ready,
    /// It lives in the local share: wait there.
    Local,
    /// Wait for `notify`, for at most the duration.
    Remote(Arc<Notify>, Duration),
}

/// This client's tickets on one limit.
#[derive(Default)]
pub(crate) struct ClientLimit {
    tickets: HashMap<u64, Ticket>,
    /// The `Waiting` tickets in ticket order: the first is the client's asker.
    queue: BTreeSet<u64>,
    /// When the queue can next move for this client (server's answer, in local time): the
    /// earliest lease of the limit can lapse, or the token comes that another of the client's
    /// tickets, served next, waits for.
    next_expiry: Option<Instant>,
    /// Releases not sent yet (permits and waiting tickets dropped): each rides ahead of this
    /// client's next call on the limit, or goes in a call of its own if none comes first.
    riders: Vec<(u64, bool)>,
    /// Whether this client's last ask on the limit was queued (the limit was busy): its
    /// releases then go ahead of its next acquire in a call of their own (see
    /// `Inner::call_leased`).
    pub(crate) busy: bool,
}

/// The most releases one call carries ahead of its own operation: a burst of drops becomes a
/// few calls of bounded length, not one script that holds Redis for long.
pub(crate) const MAX_RIDERS: usize = 64;

impl ClientLimit {
    /// Moves `ticket` to `state`. A ticket that stops waiting while it was the asker hands
    /// the role on: the next waiter is woken to ask.
    fn set(&mut self, ticket: u64, state: Ticket) {
        if matches!(state, Ticket::Waiting { .. }) {
            self.queue.insert(ticket);
            self.tickets.insert(ticket, state);
        } else {
            self.tickets.insert(ticket, state);
            self.leave_queue(ticket);
        }
    }

    fn remove(&mut self, ticket: u64) -> Option<Ticket> {
        let removed = self.tickets.remove(&ticket);
        self.leave_queue(ticket);
        removed
    }

    fn leave_queue(&mut self, ticket: u64) {
        let was_first = self.queue.first() == Some(&ticket);
        if self.queue.remove(&ticket) && was_first {
            self.wake_first();
        }
    }

    fn notify_of(&self, ticket: u64) -> Option<&Arc<Notify>> {
        match self.tickets.get(&ticket) {
            Some(Ticket::Waiting { notify, .. }) => Some(notify),
            _ => None,
        }
    }

    /// Wakes the client's asker on this limit (once the state's lock is let go: [`wakes`]).
    pub(crate) fn wake_first(&self) {
        if let Some(notify) = self.queue.first().and_then(|t| self.notify_of(*t)) {
            wakes::defer(Arc::clone(notify));
        }
    }

    /// Wakes every waiting ticket (after Redis lost its state, or pushes may have been lost),
    /// once the lock is let go.
    pub(crate) fn wake_all(&self) {
        for ticket in &self.queue {
            if let Some(notify) = self.notify_of(*ticket) {
                wakes::defer(Arc::clone(notify));
            }
        }
    }

    /// Whether any ticket waits on the server.
    pub(crate) fn has_waiters(&self) -> bool {
        !self.queue.is_empty()
    }

    /// Whether `ticket` waits on the server.
    pub(crate) fn is_waiting(&self, ticket: u64) -> bool {
        self.queue.contains(&ticket)
    }

    /// Whether this client's exact-mode bookkeeping knows `ticket` (waiting, held, local, or
    /// granted open).
    pub(crate) fn knows(&self, ticket: u64) -> bool {
        self.tickets.contains_key(&ticket)
    }

    /// Whether `ticket` lives in the local share.
    pub(crate) fn is_local(&self, ticket: u64) -> bool {
        matches!(self.tickets.get(&ticket), Some(Ticket::Local))
    }

    /// Whether `ticket` was granted without a permit.
    pub(crate) fn is_open(&self, ticket: u64) -> bool {
        matches!(self.tickets.get(&ticket), Some(Ticket::Open))
    }

    /// Whether `ticket` holds (or has been granted) a permit on the server.
    pub(crate) fn holds(&self, ticket: u64) -> bool {
        self.tickets.get(&ticket).is_some_and(Ticket::holds_remote)
    }

    /// The priority of a waiting ticket's first ask.
    pub(crate) fn priority(&self, ticket: u64) -> Option<Priority> {
        match self.tickets.get(&ticket) {
            Some(Ticket::Waiting { priority, .. }) => priority.clone(),
            _ => None,
        }
    }

    /// A first ask: `ticket` waits from now on (before the call travels, so a grant pushed
    /// meanwhile finds its waiter). Returns whether this client knew nothing of the ticket
    /// before: then no call about it has been made, and Redis holds nothing for it.
    pub(crate) fn ask(&mut self, ticket: u64, priority: Priority, external: bool) -> bool {
        if let Some(Ticket::Waiting { priority: p, external: e, .. }) =
            self.tickets.get_mut(&ticket)
        {
            // Asked again: its waiter may be sleeping on the same `notify`.
            (*p, *e) = (Some(priority), external);
            return false;
        }
        let new = !self.tickets.contains_key(&ticket);
        let notify = Arc::default();
        self.set(
            ticket,
            Ticket::Waiting { notify, priority: Some(priority), retrying: false, external },
        );
        new
    }

    /// `ticket` waits on the server, answered "retry after" (`retrying`) or queued. Keeps what
    /// the ticket's first ask recorded.
    pub(crate) fn queued(&mut self, ticket: u64, retrying: bool) {
        match self.tickets.get_mut(&ticket) {
            Some(Ticket::Waiting { retrying: r, .. }) => *r = retrying,
            Some(other) => {
                let external = other.external();
                self.set(
                    ticket,
                    Ticket::Waiting { notify: Arc::default(), priority: None, retrying, external },
                );
            }
            None => self.set(
                ticket,
                Ticket::Waiting {
                    notify: Arc::default(),
                    priority: None,
                    retrying,
                    external: false,
                },
            ),
        }
    }

    /// The server's hint of when the queue can next move for this client (`next_expiry`).
    pub(crate) fn expires_in(&mut self, hint: Option<Duration>) {
        self.next_expiry = hint.map(|after| Instant::now() + after);
    }

    /// `ticket` was granted to its own ask: it holds a permit now, until `until` unless
    /// renewed. `external` marks a ticket whose holder renews it; a ticket asked first with its
    /// own lease stays external.
    pub(crate) fn hold(&mut self, ticket: u64, external: bool, until: Instant) {
        let external = external || self.tickets.get(&ticket).is_some_and(Ticket::external);
        self.set(ticket, Ticket::Held { external, until });
    }

    /// The leases of `tickets` were renewed: each held one lasts until `until` now.
    pub(crate) fn renewed_until(&mut self, tickets: &[u64], until: Instant) {
        for ticket in tickets {
            if let Some(Ticket::Held { until: held, .. } | Ticket::Granted { until: held, .. }) =
                self.tickets.get_mut(ticket)
            {
                *held = until;
            }
        }
    }

    /// The permits this client renews whose lease may have ended on the server by `now`
    /// without a renewal: they hold nothing from now on. Returns them, and when the next
    /// one may end.
    pub(crate) fn lapse(&mut self, now: Instant) -> (Vec<u64>, Option<Instant>) {
        let mut lapsed = Vec::new();
        let mut next: Option<Instant> = None;
        for (ticket, state) in &self.tickets {
            let (Ticket::Held { external: false, until }
            | Ticket::Granted { external: false, until, .. }) = state
            else {
                continue;
            };
            if *until <= now {
                lapsed.push(*ticket);
            } else {
                next = Some(next.map_or(*until, |next| next.min(*until)));
            }
        }
        lapsed.sort_unstable();
        for ticket in &lapsed {
            self.remove(*ticket);
        }
        (lapsed, next)
    }

    /// Claims a grant made on `ticket`'s behalf: the ticket holds its permit from now on.
    pub(crate) fn claim(&mut self, ticket: u64) -> Option<Grant> {
        match self.tickets.get(&ticket) {
            Some(Ticket::Granted { grant, external, until }) => {
                let (grant, external, until) = (*grant, *external, *until);
                self.set(ticket, Ticket::Held { external, until });
                Some(grant)
            }
            _ => None,
        }
    }

    /// A grant the server made for `ticket` while another ticket asked, or pushed; its lease
    /// may end at `until` unless renewed.
    pub(crate) fn deliver(&mut self, ticket: u64, grant: Grant, until: Instant) -> Delivered {
        match self.tickets.get(&ticket) {
            Some(Ticket::Granted { .. } | Ticket::Held { .. }) => Delivered::Already,
            Some(Ticket::Waiting { notify, external, .. }) => {
                let (notify, external) = (Arc::clone(notify), *external);
                self.set(ticket, Ticket::Granted { grant, external, until });
                wakes::defer(notify);
                Delivered::Woken
            }
            Some(Ticket::Open | Ticket::Local) | None => Delivered::Gone,
        }
    }

    /// `ticket` no longer waits (its try failed, it was refused, or it moves elsewhere). A
    /// ticket in any other state is untouched.
    pub(crate) fn forget(&mut self, ticket: u64) {
        if self.is_waiting(ticket) {
            self.remove(ticket);
        }
    }

    /// Redis was unreachable: `ticket` is granted without a permit.
    pub(crate) fn open(&mut self, ticket: u64) {
        self.set(ticket, Ticket::Open);
    }

    /// Redis was unreachable: `ticket` lives in the local share.
    pub(crate) fn local(&mut self, ticket: u64) {
        self.set(ticket, Ticket::Local);
    }

    /// A dropped permit or waiting ticket whose release is to ride with this client's next
    /// call on the limit: it leaves the bookkeeping now. `None` for a ticket served without
    /// Redis (the local share, fail-open), which goes back the usual way; else whether no
    /// other release was waiting (then whoever queued it must see that it is sent).
    pub(crate) fn ride(&mut self, ticket: u64) -> Option<bool> {
        if self.is_local(ticket) || self.is_open(ticket) {
            return None;
        }
        // A ticket not known here may hold a permit in Redis (this client forgot it).
        let held = !self.is_waiting(ticket);
        self.remove(ticket);
        self.riders.push((ticket, held));
        Some(self.riders.len() == 1)
    }

    /// Whether releases wait to ride.
    pub(crate) fn has_riders(&self) -> bool {
        !self.riders.is_empty()
    }

    /// Up to [`MAX_RIDERS`] releases waiting to ride, oldest first, for the call about to go,
    /// and whether they should go first in a call of their own: some return a permit (rather
    /// than withdraw a waiting ticket) on a limit that was busy at this client's last ask.
    pub(crate) fn take_riders(&mut self) -> (Vec<u64>, bool) {
        let n = self.riders.len().min(MAX_RIDERS);
        let first = self.busy && self.riders[..n].iter().any(|&(_, held)| held);
        (self.riders.drain(..n).map(|(ticket, _)| ticket).collect(), first)
    }

    /// Releases `ticket` from any state and says where it was.
    pub(crate) fn release(&mut self, ticket: u64) -> Place {
        match self.remove(ticket) {
            Some(Ticket::Open) => Place::Open,
            Some(Ticket::Local) => Place::Local,
            _ => Place::Remote,
        }
    }

    /// The lease of `ticket` ended on the server: it holds nothing. Returns whether it held
    /// (or had been granted) a permit.
    pub(crate) fn lose(&mut self, ticket: u64) -> bool {
        if self.holds(ticket) {
            self.remove(ticket);
            true
        } else {
            false
        }
    }

    /// Redis lost its state: every permit this client held there is gone. Returns them.
    pub(crate) fn lose_all(&mut self) -> Vec<u64> {
        let mut lost: Vec<u64> =
            self.tickets.iter().filter(|(_, t)| t.holds_remote()).map(|(id, _)| *id).collect();
        lost.sort_unstable();
        for ticket in &lost {
            self.tickets.remove(ticket);
        }
        lost
    }

    /// The permits this client renews in the background (held, not external), in ticket order.
    pub(crate) fn renewed(&self) -> Vec<u64> {
        let mut own: Vec<u64> = self
            .tickets
            .iter()
            .filter(|(_, t)| t.holds_remote() && !t.external())
            .map(|(id, _)| *id)
            .collect();
        own.sort_unstable();
        own
    }

    /// How `ticket` waits: until woken, or for the time after which it should ask again.
    /// The asker wakes when the earliest lease can lapse; the others only for safety.
    pub(crate) fn plan_wait(&mut self, ticket: u64, at_most: Duration) -> WaitPlan {
        match self.tickets.get(&ticket) {
            Some(Ticket::Granted { .. } | Ticket::Open) => return WaitPlan::Ready,
            Some(Ticket::Local) => return WaitPlan::Local,
            // Held already (its answer came first): its check answers at once.
            Some(Ticket::Held { .. }) => return WaitPlan::Remote(Arc::default(), Duration::ZERO),
            Some(Ticket::Waiting { .. }) => {}
            None => self.queued(ticket, false),
        }
        let Some(Ticket::Waiting { notify, retrying, .. }) = self.tickets.get(&ticket) else {
            unreachable!("made waiting above");
        };
        let first = self.queue.first() == Some(&ticket);
        let sleep = if *retrying {
            at_most
        } else if first || self.queue.len() == 1 {
            let until_expiry = self
                .next_expiry
                .map(|at| at.saturating_duration_since(Instant::now()) + Duration::from_millis(2));
            until_expiry.map_or(at_most, |d| d.min(at_most)).min(FIRST_REASK)
        } else {
            SAFETY_REASK.min(at_most)
        };
        WaitPlan::Remote(Arc::clone(notify), sleep)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wakes::woken;

    /// A lease end far away.
    fn far() -> Instant {
        Instant::now() + Duration::from_secs(3600)
    }

    fn grant(fence: u64) -> Grant {
        Grant { fencing_token: fence, expires_at: None }
    }

    fn asked(tickets: &[u64]) -> ClientLimit {
        let mut limit = ClientLimit::default();
        for &t in tickets {
            limit.ask(t, Priority::default(), false);
        }
        limit
    }

    #[test]
    fn an_unrenewed_lease_lapses_and_only_the_clients_own_permits_do() {
        let mut limit = ClientLimit::default();
        let now = Instant::now();
        let ms = Duration::from_millis;
        limit.hold(1, false, now + ms(10));
        limit.hold(2, false, now + ms(100));
        limit.hold(3, true, now); // external: its holder renews it
        limit.ask(4, Priority::default(), false);
        assert_eq!(limit.deliver(4, grant(1), now + ms(5)), Delivered::Woken);
        let (lapsed, next) = limit.lapse(now + ms(20));
        assert_eq!(lapsed, [1, 4]);
        assert_eq!(next, Some(now + ms(100)));
        assert!(!limit.holds(1) && limit.holds(2) && limit.holds(3) && !limit.holds(4));
        assert!(limit.claim(4).is_none(), "a lapsed grant is not claimed");
        limit.renewed_until(&[2], now + ms(500));
        assert_eq!(limit.lapse(now + ms(200)), (Vec::new(), Some(now + ms(500))));
        assert_eq!(limit.lapse(now + ms(500)).0, [2]);
    }

    /// A number drawn again once ticket numbers come round must not be one still in use: see
    /// `RedisLimits`'s `ticket`.
    #[test]
    fn a_ticket_is_in_use_while_it_waits_holds_or_awaits_its_release() {
        let mut state = State::default();
        let limit = state.limits.entry("a".to_owned()).or_default();
        limit.ask(1, Priority::default(), false);
        limit.hold(2, false, far());
        limit.hold(3, false, far());
        assert_eq!(limit.ride(3), Some(true), "3's release rides the next call");
        state.limits.entry("b".to_owned()).or_default().hold(4, false, far());
        state.orphans.push("b", 5);
        assert_eq!(state.tickets_in_use(), HashSet::from([1, 2, 3, 4, 5]));
        let limit = state.limits.get_mut("a").unwrap();
        assert_eq!(limit.take_riders(), (vec![3], false));
        assert_eq!(limit.release(2), Place::Remote);
        assert_eq!(state.tickets_in_use(), HashSet::from([1, 4, 5]), "2 and 3 released");
    }

    #[test]
    fn an_ask_waits_and_its_own_grant_holds() {
        let mut limit = asked(&[7]);
        assert!(limit.is_waiting(7) && !limit.holds(7));
        assert_eq!(limit.priority(7), Some(Priority::default()));
        limit.hold(7, false, far());
        assert!(!limit.is_waiting(7) && limit.holds(7));
        assert!(!limit.has_waiters());
        assert_eq!(limit.renewed(), vec![7]);
        assert_eq!(limit.release(7), Place::Remote);
        assert!(!limit.holds(7) && limit.renewed().is_empty());
    }

    #[test]
    fn a_delivered_grant_wakes_its_waiter_once_and_is_claimed_once() {
        let mut limit = asked(&[1, 2]);
        let WaitPlan::Remote(notify, _) = limit.plan_wait(2, Duration::from_secs(5)) else {
            panic!("a waiting ticket waits remotely");
        };
        assert_eq!(limit.deliver(2, grant(9), far()), Delivered::Woken);
        // The permit was stored: its waiter's next `notified()` completes at once.
        assert!(woken(&notify));
        assert!(matches!(limit.plan_wait(2, Duration::from_secs(5)), WaitPlan::Ready));
        assert!(limit.holds(2) && !limit.is_waiting(2));
        assert_eq!(limit.renewed(), vec![2], "a granted ticket is renewed before it is claimed");
        assert_eq!(limit.deliver(2, grant(9), far()), Delivered::Already);
        assert_eq!(limit.claim(2), Some(grant(9)));
        assert_eq!(limit.claim(2), None, "claimed once");
        assert!(limit.holds(2));
        assert!(limit.is_waiting(1));
    }

    #[test]
    fn waiters_are_woken_only_once_the_state_is_let_go() {
        let mut limit = asked(&[1, 2, 3]);
        let [first, second, third] = [1, 2, 3].map(|t| limit.notify_of(t).cloned().unwrap());
        let wakes = wakes::Wakes::begin();
        // The asker's grant wakes it, and hands the asker's role to the next waiter.
        assert_eq!(limit.deliver(1, grant(3), far()), Delivered::Woken);
        limit.wake_all();
        assert!(!woken(&first) && !woken(&second) && !woken(&third), "none under the lock");
        drop(wakes);
        assert!(woken(&first) && woken(&second) && woken(&third));
    }

    #[test]
    fn a_grant_for_a_gone_waiter_goes_back() {
        let mut limit = asked(&[3]);
        limit.release(3);
        assert_eq!(limit.deliver(3, grant(1), far()), Delivered::Gone);
        limit.open(4);
        assert_eq!(limit.deliver(4, grant(2), far()), Delivered::Gone);
        assert!(!limit.holds(3) && !limit.holds(4));
    }

    #[test]
    fn the_first_waiter_is_the_asker_and_the_next_takes_over() {
        let mut limit = asked(&[5, 3, 9]);
        let first = limit.notify_of(3).cloned().unwrap();
        let second = limit.notify_of(5).cloned().unwrap();
        limit.wake_first();
        assert!(woken(&first), "the lowest ticket is the asker");
        // When the asker stops waiting, the next one is woken to ask.
        limit.forget(3);
        assert!(woken(&second));
        assert!(limit.has_waiters());
        limit.forget(5);
        limit.forget(9);
        assert!(!limit.has_waiters());
    }

    #[test]
    fn an_asker_granted_to_its_own_ask_hands_the_role_on() {
        let mut limit = asked(&[1, 2]);
        let next = limit.notify_of(2).cloned().unwrap();
        limit.hold(1, false, far());
        assert!(woken(&next), "the next waiter asks now");
    }

    #[test]
    fn forget_leaves_a_held_ticket_held() {
        let mut limit = asked(&[1]);
        limit.hold(1, false, far());
        limit.forget(1);
        assert!(limit.holds(1));
    }

    #[test]
    fn an_external_ticket_is_not_renewed_by_the_client() {
        let mut limit = ClientLimit::default();
        limit.ask(1, Priority::default(), true);
        limit.ask(2, Priority::default(), false);
        limit.hold(1, false, far());
        limit.hold(2, false, far());
        limit.hold(3, true, far());
        assert_eq!(limit.renewed(), vec![2]);
        assert_eq!(limit.deliver(1, grant(1), far()), Delivered::Already);
    }

    #[test]
    fn retry_after_and_queued_keep_the_first_ask() {
        let mut limit = asked(&[1]);
        limit.queued(1, true);
        assert!(limit.is_waiting(1));
        assert_eq!(limit.priority(1), Some(Priority::default()));
        let WaitPlan::Remote(_, sleep) = limit.plan_wait(1, Duration::from_secs(30)) else {
            panic!("waits remotely");
        };
        assert_eq!(sleep, Duration::from_secs(30), "a retrying ticket sleeps the whole wait");
        limit.queued(1, false);
        let WaitPlan::Remote(_, sleep) = limit.plan_wait(1, Duration::from_secs(30)) else {
            panic!("waits remotely");
        };
        assert_eq!(sleep, FIRST_REASK, "the asker re-asks within a second");
    }

    #[test]
    fn losing_state_drops_every_remote_permit_and_only_those() {
        let mut limit = asked(&[1, 2, 3, 4]);
        limit.hold(1, false, far());
        limit.deliver(2, grant(5), far());
        limit.open(3);
        let lost = limit.lose_all();
        assert_eq!(lost, vec![1, 2]);
        assert!(limit.is_open(3) && limit.is_waiting(4));
        assert!(!limit.lose(4), "a waiting ticket held nothing");
        assert!(limit.is_waiting(4));
        limit.hold(4, false, far());
        assert!(limit.lose(4) && !limit.holds(4));
    }

    #[test]
    fn outage_places_decide_where_the_release_goes() {
        let mut limit = asked(&[1, 2]);
        limit.open(1);
        limit.local(2);
        assert!(limit.is_open(1) && limit.is_local(2));
        assert!(!limit.has_waiters());
        assert!(matches!(limit.plan_wait(1, Duration::from_secs(1)), WaitPlan::Ready));
        assert!(matches!(limit.plan_wait(2, Duration::from_secs(1)), WaitPlan::Local));
        assert_eq!(limit.release(1), Place::Open);
        assert_eq!(limit.release(2), Place::Local);
        assert_eq!(limit.release(2), Place::Remote, "an unknown ticket is released remotely");
    }

    #[test]
    fn a_wait_on_an_unknown_ticket_queues_it() {
        let mut limit = ClientLimit::default();
        assert!(matches!(limit.plan_wait(8, Duration::from_secs(1)), WaitPlan::Remote(..)));
        assert!(limit.is_waiting(8));
        assert_eq!(limit.priority(8), None);
    }

    /// Past its bound the list abandons the oldest ticket of the limit pushed to, and counts
    /// it; `take` hands out batches of one limit each, oldest first, within its caps.
    #[test]
    fn orphans_are_bounded_and_taken_in_batches() {
        let mut orphans = Orphans::new(4);
        for ticket in 1..=3 {
            orphans.push("a", ticket);
        }
        orphans.push("b", 10);
        orphans.push("a", 4); // over the bound: 1, the oldest of "a", goes
        orphans.push("b", 11); // 10 goes
        assert_eq!((orphans.len(), orphans.abandoned()), (4, 2));
        let mut batches = orphans.take(8, 2);
        batches.sort();
        let expected = [("a", vec![2, 3]), ("a", vec![4]), ("b", vec![11])];
        assert_eq!(batches, expected.map(|(name, batch)| (name.to_owned(), batch)));
        assert_eq!(orphans.len(), 4, "taken, under way: still pending");
        orphans.settled(4);
        assert_eq!(orphans.len(), 0);
        // Within its caps: at most `calls` batches of `per_call` tickets.
        let mut orphans = Orphans::new(100);
        for ticket in 0..10 {
            orphans.push("c", ticket);
        }
        assert_eq!(
            orphans.take(2, 3),
            [("c".to_owned(), vec![0, 1, 2]), ("c".to_owned(), vec![3, 4, 5])]
        );
        orphans.settled(6);
        assert_eq!(orphans.len(), 4);
        assert_eq!(orphans.take(8, 8), [("c".to_owned(), vec![6, 7, 8, 9])]);
        orphans.settled(4);
        assert!(orphans.take(8, 8).is_empty());
        // A batch of each limit in turn: one limit's backlog does not hold back another's.
        let mut orphans = Orphans::new(1_000);
        for ticket in 0..100 {
            orphans.push("big", ticket);
        }
        orphans.push("small", 7);
        let batches = orphans.take(2, 10);
        assert!(batches.iter().any(|(name, _)| name == "small"), "{batches:?}");
        orphans.settled(11);
        // Failed for good: abandoned, counted.
        orphans.abandon(5);
        assert_eq!(orphans.abandoned(), 5);
    }
}
