//! Who owns which ticket, and which clients are alive. Nothing else: grants, leases and the wait
//! order live in the backend (`lanes::limit`), written once.
//!
//! # Invariants
//!
//! 1. A ticket number names one ticket of one limit, owned by the client that created it.
//!    Another client acting on it is refused ([`Refused::NotYours`]); nothing is granted or
//!    released on its behalf.
//! 2. A server-chosen ticket number is unguessable (keyed hash of a counter, below 2^53 so
//!    JSON numbers carry it exactly) and never equal to a live ticket of the limit, so a client
//!    mixing its own numbers with the server's never has two tickets under one number.
//! 3. A queued ticket that nobody asked about for the queue grace (no long-poll on it in
//!    flight, no ask) is withdrawn — whatever else its client does, so a client that keeps
//!    renewing cannot hold a free limit with a ticket it abandoned. Permits stay until their
//!    leases end in the backend; the backend is asked about a permit once the lease it was
//!    last granted or renewed with has run out (whatever its client does, so the records of
//!    lapsed permits never pile up), and about every permit of a client gone silent.
//! 4. A record names one backend ticket, and only what is done to that one changes it: a
//!    request that acted on another backend ticket under the same number (an old long-poll,
//!    after a release and a new ask) neither removes the record nor marks it. While the
//!    request that created a ticket makes its first ask, the backend may not know the ticket
//!    yet: nobody else asks the backend about it (an answer "finished" would be wrong), and the
//!    creator, once its ask is back, gives the backend ticket back itself if the record went
//!    meanwhile. So no backend ticket is ever left with no record (a queued one nobody owns
//!    would stop its limit's line for good).
//! 5. A ticket that finished (released, withdrawn, or its permit found lapsed) is remembered
//!    for its owner for the longest lease, the latest [`FINISHED_KEPT`] of them: its owner
//!    asking about it again is refused ([`Refused::Finished`], 410) rather than given a new
//!    ticket under the old number (a look that came late, after a release or a lapse, would
//!    otherwise queue or take a permit nobody knows it holds). Another client may take the
//!    number as its own, as before (the memory is its owner's only).
//!
//! Pure: time is an argument, no I/O.

use std::collections::hash_map::RandomState;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::hash::BuildHasher;
use std::time::Duration;

use tokio::time::Instant;

/// A ticket and its owner.
#[derive(Debug)]
struct Owned {
    client: String,
    backend: u64,
    lease: Duration,
    granted: bool,
    /// When its lease ends, as the server last granted or renewed it: an estimate, to know
    /// when to ask the backend (whose lease, counted from its own grant, usually ends a little
    /// earlier; a renewal that failed is counted all the same, which only delays the ask).
    lease_ends: Instant,
    /// When a request last asked about it.
    asked: Instant,
    /// Requests asking about it now (long-polls in flight).
    polling: usize,
    /// The request that created it is making its first ask (invariant 4).
    first_ask: bool,
}

#[derive(Debug)]
struct Client {
    last_seen: Instant,
    in_flight: usize,
    /// `(limit, ticket)` of every ticket it owns.
    tickets: BTreeSet<(String, u64)>,
}

/// A ticket a request acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Begun {
    /// The client's number for it.
    pub(crate) ticket: u64,
    /// The backend's.
    pub(crate) backend: u64,
    /// Created by this request (its first ask), rather than asked about again.
    pub(crate) fresh: bool,
    /// Another request is making the ticket's first ask: this one asks the backend nothing
    /// (invariant 4).
    pub(crate) first_ask_elsewhere: bool,
    /// The ticket's lease, as its first ask set it: every grant and renewal of the ticket
    /// uses it, so the lease a client is told is the one its permit has.
    pub(crate) lease: Duration,
}

/// Why a request may not act on a ticket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Another client owns it.
    NotYours(u64),
    /// A new client, and the server keeps this many already.
    TooManyClients(usize),
    /// Its owner asks about a ticket that finished (invariant 5).
    Finished(u64),
}

/// Finished tickets remembered at most (invariant 5): a few hundred bytes each at most (names
/// of up to 200 bytes, kept twice), so tens of MB at worst.
pub(crate) const FINISHED_KEPT: usize = 65_536;

/// A finished ticket: `(limit, ticket, owner)`.
type Finished = (String, u64, String);

/// What a renewal of one client covers ([`Sessions::tickets_of`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Renewing {
    /// `(limit, ticket, backend ticket, lease)` of each ticket to renew, in limit order.
    pub(crate) renew: Vec<(String, u64, u64, Duration)>,
    /// Tickets the client named that it does not own: their permits are lost.
    pub(crate) unknown: Vec<(String, u64)>,
}

/// A ticket the sweeper hands back to the backend, or asks the backend about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Lapsed {
    pub(crate) client: String,
    pub(crate) limit: String,
    pub(crate) ticket: u64,
    pub(crate) backend: u64,
}

#[derive(Debug)]
pub(crate) struct Sessions {
    tickets: HashMap<(String, u64), Owned>,
    clients: HashMap<String, Client>,
    keys: RandomState,
    drawn: u64,
    /// The most clients with a session.
    max_clients: usize,
    /// Finished tickets, `(limit, ticket, owner)` → when it finished, and their order
    /// (invariant 5): each owner's own (another client may use the number, and finish it, in
    /// between). An entry of the order whose time differs from the map's is stale (the number
    /// finished again since).
    finished: HashMap<Finished, Instant>,
    finished_order: VecDeque<(Finished, Instant)>,
    /// How long a finished ticket is remembered: the longest lease.
    finished_for: Duration,
}

impl Sessions {
    /// Sessions for at most `max_clients` clients, remembering finished tickets for
    /// `finished_for` (the longest lease).
    pub(crate) fn new(max_clients: usize, finished_for: Duration) -> Self {
        Self {
            tickets: HashMap::new(),
            clients: HashMap::new(),
            keys: RandomState::new(),
            drawn: 0,
            max_clients,
            finished: HashMap::new(),
            finished_order: VecDeque::new(),
            finished_for,
        }
    }

    /// Remembers that ticket `key` of `client` finished at `now` (invariant 5), and forgets
    /// those finished longer ago than the longest lease, and the oldest past the most kept.
    fn finish(&mut self, (limit, ticket): (String, u64), client: String, now: Instant) {
        let key = (limit, ticket, client);
        self.finished_order.push_back((key.clone(), now));
        self.finished.insert(key, now);
        let horizon = now.checked_sub(self.finished_for);
        while let Some((_, at)) = self.finished_order.front() {
            let expired = horizon.is_some_and(|horizon| *at <= horizon);
            if !expired && self.finished.len() <= FINISHED_KEPT {
                break;
            }
            let (key, at) = self.finished_order.pop_front().expect("looked at above");
            if self.finished.get(&key).is_some_and(|finished| *finished == at) {
                self.finished.remove(&key);
            }
        }
        // Stale entries of the order (numbers that finished again) are dropped once they
        // outnumber the live ones.
        if self.finished_order.len() > 2 * self.finished.len() + 64 {
            let finished = &self.finished;
            self.finished_order
                .retain(|(key, at)| finished.get(key).is_some_and(|done| done == at));
        }
    }

    /// Whether `client`'s ticket `key` finished less than the longest lease before `now`.
    fn has_finished(&self, (limit, ticket): (&str, u64), client: &str, now: Instant) -> bool {
        let key = (limit.to_owned(), ticket, client.to_owned());
        self.finished.get(&key).is_some_and(|at| now < *at + self.finished_for)
    }
}

/// Server-chosen numbers stay below 2^53: exact in every JSON implementation.
const TICKET_MASK: u64 = (1 << 53) - 1;

impl Sessions {
    /// Marks a request of `client` starting and finds or creates the ticket it acts on: its own
    /// number `ticket`, or a fresh server-chosen one for `None`. `allocate` gives a new backend
    /// ticket. A client without a session is refused once the most clients have one.
    pub(crate) fn begin(
        &mut self,
        client: &str,
        limit: &str,
        ticket: Option<u64>,
        lease: Duration,
        now: Instant,
        allocate: impl FnOnce() -> u64,
    ) -> Result<Begun, Refused> {
        if let Some(number) = ticket
            && let Some(owned) = self.tickets.get(&(limit.to_owned(), number))
        {
            if owned.client != client {
                return Err(Refused::NotYours(number));
            }
            let (backend, lease) = (owned.backend, owned.lease);
            let owned = self.tickets.get_mut(&(limit.to_owned(), number)).expect("found above");
            owned.asked = now;
            owned.polling += 1;
            let first_ask_elsewhere = owned.first_ask;
            self.touch(client, now).in_flight += 1;
            return Ok(Begun { ticket: number, backend, fresh: false, first_ask_elsewhere, lease });
        }
        if let Some(number) = ticket
            && self.has_finished((limit, number), client, now)
        {
            return Err(Refused::Finished(number));
        }
        if !self.clients.contains_key(client) && self.clients.len() >= self.max_clients {
            return Err(Refused::TooManyClients(self.max_clients));
        }
        let number = match ticket {
            Some(number) => number,
            None => self.draw(limit),
        };
        let backend = allocate();
        let owned = Owned {
            client: client.to_owned(),
            backend,
            lease,
            granted: false,
            lease_ends: now + lease,
            asked: now,
            polling: 1,
            first_ask: true,
        };
        self.tickets.insert((limit.to_owned(), number), owned);
        let session = self.touch(client, now);
        session.in_flight += 1;
        session.tickets.insert((limit.to_owned(), number));
        Ok(Begun { ticket: number, backend, fresh: true, first_ask_elsewhere: false, lease })
    }

    fn touch(&mut self, client: &str, now: Instant) -> &mut Client {
        let session = self.clients.entry(client.to_owned()).or_insert_with(|| Client {
            last_seen: now,
            in_flight: 0,
            tickets: BTreeSet::new(),
        });
        session.last_seen = now;
        session
    }

    /// An unguessable number that no live ticket of `limit` has (invariant 2).
    fn draw(&mut self, limit: &str) -> u64 {
        loop {
            self.drawn += 1;
            let number = self.keys.hash_one(self.drawn) & TICKET_MASK;
            if number != 0 && !self.tickets.contains_key(&(limit.to_owned(), number)) {
                return number;
            }
        }
    }

    /// Marks a request of `client` about `begun` of `limit` finished (its first ask ended too,
    /// if it made it).
    pub(crate) fn end(&mut self, client: &str, limit: &str, begun: Begun, now: Instant) {
        if let Some(owned) = self.tickets.get_mut(&(limit.to_owned(), begun.ticket))
            && owned.client == client
            && owned.backend == begun.backend
        {
            owned.polling = owned.polling.saturating_sub(1);
            owned.asked = now;
            if begun.fresh {
                owned.first_ask = false;
            }
        }
        if let Some(session) = self.clients.get_mut(client) {
            session.in_flight = session.in_flight.saturating_sub(1);
            session.last_seen = now;
        }
        self.drop_if_idle(client);
    }

    fn drop_if_idle(&mut self, client: &str) {
        if self.clients.get(client).is_some_and(|s| s.in_flight == 0 && s.tickets.is_empty()) {
            self.clients.remove(client);
        }
    }

    /// The first ask of `begun` (made by the request that created it) is back: whether its
    /// record is still there. If it is not (released, or withdrawn by a stopping server,
    /// meanwhile), the caller gives the backend ticket back (invariant 4).
    pub(crate) fn first_asked(&mut self, limit: &str, begun: Begun) -> bool {
        match self.tickets.get_mut(&(limit.to_owned(), begun.ticket)) {
            Some(owned) if owned.backend == begun.backend => {
                owned.first_ask = false;
                true
            }
            _ => false,
        }
    }

    /// Records that backend ticket `backend`, ticket `ticket` of `limit`, holds a permit
    /// (granted, or its lease restarted, at `now`): whether its record is still there (if not,
    /// the caller gives the permit back).
    pub(crate) fn granted(&mut self, limit: &str, ticket: u64, backend: u64, now: Instant) -> bool {
        match self.tickets.get_mut(&(limit.to_owned(), ticket)) {
            Some(owned) if owned.backend == backend => {
                owned.granted = true;
                owned.lease_ends = now + owned.lease;
                true
            }
            _ => false,
        }
    }

    /// Forgets a ticket of `client`; its backend ticket if it existed. With `finished` (the time
    /// it was released, withdrawn or found lapsed), it is remembered as finished (invariant 5);
    /// without (a first ask that failed, a try refused: both leave nothing), its number may be
    /// asked with afresh. With `only` given, only if its record names that backend ticket
    /// (invariant 4: what a request found finished is that backend ticket, not a newer one
    /// under its number).
    ///
    /// # Errors
    ///
    /// [`Refused::NotYours`] if another client owns it (invariant 1).
    pub(crate) fn forget(
        &mut self,
        client: &str,
        limit: &str,
        ticket: u64,
        only: Option<u64>,
        finished: Option<Instant>,
    ) -> Result<Option<u64>, Refused> {
        let key = (limit.to_owned(), ticket);
        match self.tickets.get(&key) {
            None => return Ok(None),
            Some(owned) if owned.client != client => return Err(Refused::NotYours(ticket)),
            Some(owned) if only.is_some_and(|backend| backend != owned.backend) => {
                return Ok(None);
            }
            Some(_) => {}
        }
        let owned = self.tickets.remove(&key).expect("present");
        if let Some(session) = self.clients.get_mut(client) {
            session.tickets.remove(&key);
        }
        self.drop_if_idle(client);
        if let Some(now) = finished {
            self.finish(key, owned.client, now);
        }
        Ok(Some(owned.backend))
    }

    /// The tickets of `client` to renew, as `(limit, ticket, backend ticket, lease)`, in limit
    /// order: every one it owns, or with `named`, those of the named ones it owns; but those
    /// whose first ask is still being made (the backend may not know them yet: invariant 4).
    /// And the named tickets it does not own (forgotten here: their permits are lost). `None`
    /// for a client without a session. Marks the client seen, and the renewed leases renewed at
    /// `now` (what renewal finds lost is forgotten); the owned tickets it does not name are
    /// left to lapse.
    pub(crate) fn tickets_of(
        &mut self,
        client: &str,
        named: Option<&[(String, u64)]>,
        now: Instant,
    ) -> Option<Renewing> {
        let session = self.clients.get_mut(client)?;
        session.last_seen = now;
        let mut unknown = Vec::new();
        let keys: Vec<(String, u64)> = match named {
            None => session.tickets.iter().cloned().collect(),
            Some(named) => {
                let mut keys = Vec::with_capacity(named.len());
                for key in named {
                    match session.tickets.contains(key) {
                        true => keys.push(key.clone()),
                        false => unknown.push(key.clone()),
                    }
                }
                keys.sort_unstable();
                keys.dedup();
                keys
            }
        };
        let renew = keys
            .into_iter()
            .filter_map(|key| {
                let owned = self.tickets.get_mut(&key).filter(|owned| !owned.first_ask)?;
                owned.lease_ends = now + owned.lease;
                Some((key.0, key.1, owned.backend, owned.lease))
            })
            .collect();
        Some(Renewing { renew, unknown })
    }

    /// Takes out the queued tickets nobody asked about for `grace` (invariant 3), to withdraw;
    /// and lists the permits past the lease they were last granted or renewed with, and those
    /// of clients silent for `grace` with nothing in flight, to ask the backend whether their
    /// leases have ended.
    pub(crate) fn sweep(&mut self, now: Instant, grace: Duration) -> (Vec<Lapsed>, Vec<Lapsed>) {
        let mut withdraw = Vec::new();
        let abandoned: Vec<(String, u64)> = self
            .tickets
            .iter()
            .filter(|(_, o)| !o.granted && o.polling == 0 && o.asked + grace <= now)
            .map(|(key, _)| key.clone())
            .collect();
        for key in abandoned {
            let owned = self.tickets.remove(&key).expect("listed above");
            if let Some(session) = self.clients.get_mut(&owned.client) {
                session.tickets.remove(&key);
            }
            self.drop_if_idle(&owned.client);
            self.finish(key.clone(), owned.client.clone(), now);
            withdraw.push(Lapsed {
                client: owned.client,
                limit: key.0,
                ticket: key.1,
                backend: owned.backend,
            });
        }
        let mut probe = Vec::new();
        for (key, owned) in &self.tickets {
            let silent = || {
                self.clients
                    .get(&owned.client)
                    .is_some_and(|s| s.in_flight == 0 && s.last_seen + grace <= now)
            };
            if owned.granted && (owned.lease_ends <= now || silent()) {
                probe.push(Lapsed {
                    client: owned.client.clone(),
                    limit: key.0.clone(),
                    ticket: key.1,
                    backend: owned.backend,
                });
            }
        }
        withdraw.sort_by(|a, b| (&a.limit, a.ticket).cmp(&(&b.limit, b.ticket)));
        probe.sort_by(|a, b| (&a.limit, a.ticket).cmp(&(&b.limit, b.ticket)));
        (withdraw, probe)
    }

    /// Every queued (not granted) ticket, taken out: what a server that stops withdraws.
    pub(crate) fn drain_queued(&mut self) -> Vec<Lapsed> {
        let keys: Vec<(String, u64)> =
            self.tickets.iter().filter(|(_, o)| !o.granted).map(|(k, _)| k.clone()).collect();
        let mut out = Vec::new();
        for key in keys {
            let owned = self.tickets.remove(&key).expect("present");
            if let Some(session) = self.clients.get_mut(&owned.client) {
                session.tickets.remove(&key);
            }
            out.push(Lapsed {
                client: owned.client,
                limit: key.0,
                ticket: key.1,
                backend: owned.backend,
            });
        }
        out.sort_by(|a, b| (&a.limit, a.ticket).cmp(&(&b.limit, b.ticket)));
        out
    }

    /// Clients with a session.
    pub(crate) fn clients(&self) -> usize {
        self.clients.len()
    }

    /// The first `max` clients by name: their tickets (and how many hold a permit), requests
    /// in flight, and time since they were last seen.
    pub(crate) fn list(&self, now: Instant, max: usize) -> Vec<ClientInfo> {
        let mut names: Vec<&String> = self.clients.keys().collect();
        names.sort();
        names
            .into_iter()
            .take(max)
            .map(|name| {
                let client = &self.clients[name];
                let held = client
                    .tickets
                    .iter()
                    .filter(|(limit, ticket)| {
                        self.tickets.get(&(limit.clone(), *ticket)).is_some_and(|t| t.granted)
                    })
                    .count();
                ClientInfo {
                    client: name.clone(),
                    tickets: client.tickets.len(),
                    held,
                    in_flight: client.in_flight,
                    idle_ms: u64::try_from(
                        now.saturating_duration_since(client.last_seen).as_millis(),
                    )
                    .unwrap_or(u64::MAX),
                }
            })
            .collect()
    }
}

/// One client of the server, for the snapshot's client list.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub(crate) struct ClientInfo {
    /// The client id.
    pub(crate) client: String,
    /// Tickets it owns (waiting or holding).
    pub(crate) tickets: usize,
    /// Of those, the ones holding a permit.
    pub(crate) held: usize,
    /// Its requests in flight (long-polls).
    pub(crate) in_flight: usize,
    /// Milliseconds since a request of it was last seen.
    pub(crate) idle_ms: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(10);
    const GRACE: Duration = Duration::from_secs(2);

    fn counter() -> impl FnMut() -> u64 {
        let mut next = 100;
        move || {
            next += 1;
            next
        }
    }

    #[test]
    fn a_new_client_is_refused_past_the_most_clients_and_a_known_one_is_not() {
        let mut sessions = Sessions::new(1, Duration::from_secs(60));
        let now = Instant::now();
        let mut alloc = counter();
        assert!(sessions.begin("a", "db", Some(1), LEASE, now, &mut alloc).is_ok());
        assert_eq!(
            sessions.begin("b", "db", Some(2), LEASE, now, &mut alloc),
            Err(Refused::TooManyClients(1))
        );
        assert!(sessions.begin("a", "db", Some(3), LEASE, now, &mut alloc).is_ok());
    }

    /// Invariant 5: a finished ticket is refused to its owner for the longest lease, and no
    /// longer; the memory keeps the latest `FINISHED_KEPT`, and a refused try or a failed first
    /// ask (forgotten without a time) leaves the number free.
    #[test]
    fn a_finished_ticket_is_remembered_for_its_owner_within_bounds() {
        let horizon = Duration::from_secs(60);
        let mut sessions = Sessions::new(usize::MAX, horizon);
        let start = Instant::now();
        let mut alloc = counter();
        let begin = |s: &mut Sessions, client: &str, n: u64, at: Instant, alloc: &mut _| {
            s.begin(client, "db", Some(n), LEASE, at, alloc)
        };
        begin(&mut sessions, "a", 1, start, &mut alloc).unwrap();
        assert!(sessions.forget("a", "db", 1, None, Some(start)).unwrap().is_some());
        let soon = start + horizon - Duration::from_millis(1);
        assert_eq!(begin(&mut sessions, "a", 1, soon, &mut alloc), Err(Refused::Finished(1)));
        assert!(begin(&mut sessions, "b", 1, soon, &mut alloc).unwrap().fresh, "not b's");
        // b finishes its own ticket 1 too: a's memory of its own stays (review finding, stop
        // 79: it was one owner's per number, and b's finish erased a's).
        sessions.forget("b", "db", 1, None, Some(soon)).unwrap();
        assert_eq!(begin(&mut sessions, "a", 1, soon, &mut alloc), Err(Refused::Finished(1)));
        assert_eq!(begin(&mut sessions, "b", 1, soon, &mut alloc), Err(Refused::Finished(1)));
        assert!(begin(&mut sessions, "a", 1, start + horizon, &mut alloc).unwrap().fresh);
        sessions.forget("a", "db", 1, None, None).unwrap();
        assert!(begin(&mut sessions, "a", 1, start + horizon, &mut alloc).unwrap().fresh);
        // Bounded: past the most kept, the oldest go first; the order's stale entries too.
        let total = FINISHED_KEPT as u64 + 10;
        for n in 10..10 + total {
            begin(&mut sessions, "c", n, start, &mut alloc).unwrap();
            sessions.forget("c", "db", n, None, Some(start)).unwrap();
        }
        assert_eq!(sessions.finished.len(), FINISHED_KEPT);
        assert!(sessions.finished_order.len() <= 2 * FINISHED_KEPT + 64);
        assert!(begin(&mut sessions, "c", 10, start, &mut alloc).unwrap().fresh, "the oldest went");
        let last = 10 + total - 1;
        assert_eq!(
            begin(&mut sessions, "c", last, start, &mut alloc),
            Err(Refused::Finished(last))
        );
        // Expired entries go as later ones finish.
        let later = start + horizon + Duration::from_secs(1);
        begin(&mut sessions, "c", 5, later, &mut alloc).unwrap();
        sessions.forget("c", "db", 5, None, Some(later)).unwrap();
        assert_eq!(sessions.finished.len(), 1, "only the latest is within the horizon");
    }

    #[test]
    fn a_ticket_belongs_to_its_creator() {
        let mut sessions = Sessions::new(usize::MAX, Duration::from_secs(60));
        let now = Instant::now();
        let mut alloc = counter();
        let a = sessions.begin("alice", "db", Some(1), LEASE, now, &mut alloc).unwrap();
        assert!(a.fresh);
        assert_eq!(
            sessions.begin("mallory", "db", Some(1), LEASE, now, &mut alloc),
            Err(Refused::NotYours(1))
        );
        assert_eq!(sessions.forget("mallory", "db", 1, None, None), Err(Refused::NotYours(1)));
        let again = sessions.begin("alice", "db", Some(1), LEASE, now, &mut alloc).unwrap();
        assert_eq!((again.backend, again.fresh), (a.backend, false));
        // Another limit's ticket 1 is another ticket.
        assert!(sessions.begin("mallory", "other", Some(1), LEASE, now, &mut alloc).is_ok());
        assert_eq!(sessions.forget("alice", "db", 1, None, None), Ok(Some(a.backend)));
        assert_eq!(sessions.forget("alice", "db", 1, None, None), Ok(None));
    }

    #[test]
    fn server_chosen_numbers_never_collide_with_live_tickets() {
        let mut sessions = Sessions::new(usize::MAX, Duration::from_secs(60));
        let now = Instant::now();
        let mut alloc = counter();
        let drawn = sessions.begin("x", "db", None, LEASE, now, &mut alloc).unwrap();
        assert!(drawn.ticket < 1 << 53);
        sessions.forget("x", "db", drawn.ticket, None, None).unwrap();
        let explicit = sessions.begin("x", "db", Some(drawn.ticket + 2), LEASE, now, &mut alloc);
        let explicit = explicit.unwrap();
        for _ in 0..1000 {
            let next = sessions.begin("x", "db", None, LEASE, now, &mut alloc).unwrap();
            assert!(next.fresh);
            assert_ne!(next.ticket, explicit.ticket);
            assert_ne!(next.backend, explicit.backend);
        }
    }

    #[test]
    fn abandoned_tickets_go_after_the_grace() {
        let mut sessions = Sessions::new(usize::MAX, Duration::from_secs(60));
        let start = Instant::now();
        let mut alloc = counter();
        let held = sessions.begin("a", "db", Some(1), LEASE, start, &mut alloc).unwrap();
        assert!(sessions.granted("db", 1, held.backend, start));
        sessions.end("a", "db", held, start);
        let queued = sessions.begin("a", "db", Some(2), LEASE, start, &mut alloc).unwrap();
        // A long-poll in flight keeps the ticket.
        assert_eq!(sessions.sweep(start + GRACE * 3, GRACE), (vec![], vec![]));
        sessions.end("a", "db", queued, start + GRACE * 3);
        let (withdraw, probe) = sessions.sweep(start + GRACE * 3 + GRACE / 2, GRACE);
        assert!(withdraw.is_empty() && probe.is_empty());
        let (withdraw, probe) = sessions.sweep(start + GRACE * 4, GRACE);
        assert_eq!(withdraw.iter().map(|l| l.backend).collect::<Vec<_>>(), [queued.backend]);
        assert_eq!(probe.iter().map(|l| l.backend).collect::<Vec<_>>(), [held.backend]);
        assert_eq!(sessions.clients(), 1, "the permit keeps the session");
        sessions.forget("a", "db", 1, None, Some(start)).unwrap();
        assert_eq!(sessions.clients(), 0);
    }

    /// Review finding (stop 72): only a silent client's permits were asked about, so a client
    /// that kept sending requests and let its leases lapse piled up records for good.
    #[test]
    fn a_permit_past_its_lease_is_asked_about_whatever_its_client_does() {
        let mut sessions = Sessions::new(usize::MAX, Duration::from_secs(60));
        let start = Instant::now();
        let mut alloc = counter();
        let held = sessions.begin("a", "db", Some(1), LEASE, start, &mut alloc).unwrap();
        assert!(sessions.granted("db", 1, held.backend, start));
        sessions.end("a", "db", held, start);
        // The client keeps a request in flight: never silent.
        let busy = sessions.begin("a", "other", Some(2), LEASE, start, &mut alloc).unwrap();
        let probed = |sessions: &mut Sessions, at| {
            sessions.sweep(at, GRACE).1.iter().map(|l| l.backend).collect::<Vec<_>>()
        };
        assert_eq!(probed(&mut sessions, start + LEASE / 2), Vec::<u64>::new());
        assert_eq!(probed(&mut sessions, start + LEASE), [held.backend]);
        // A renewal moves the lease on; a grant again (a re-ask restarts it) too.
        sessions.tickets_of("a", None, start + LEASE);
        assert_eq!(probed(&mut sessions, start + LEASE * 3 / 2), Vec::<u64>::new());
        assert!(sessions.granted("db", 1, held.backend, start + LEASE * 3 / 2));
        assert_eq!(probed(&mut sessions, start + LEASE * 2), Vec::<u64>::new());
        assert_eq!(probed(&mut sessions, start + LEASE * 5 / 2), [held.backend]);
        sessions.end("a", "other", busy, start);
    }

    /// Review finding (stop 73): a renewal renewed every ticket of its client, so a ticket the
    /// client had lost track of (a failed release) was kept alive for as long as the client
    /// held anything else; and a named ticket the server no longer had was not reported lost.
    #[test]
    fn a_renewal_naming_its_tickets_renews_only_those_and_reports_the_unknown() {
        let mut sessions = Sessions::new(usize::MAX, Duration::from_secs(60));
        let start = Instant::now();
        let mut alloc = counter();
        let mut held = Vec::new();
        for ticket in [1, 2] {
            let begun = sessions.begin("a", "db", Some(ticket), LEASE, start, &mut alloc).unwrap();
            assert!(sessions.first_asked("db", begun));
            assert!(sessions.granted("db", ticket, begun.backend, start));
            sessions.end("a", "db", begun, start);
            held.push(begun.backend);
        }
        // The client keeps a request in flight: never silent.
        let busy = sessions.begin("a", "busy", Some(3), LEASE, start, &mut alloc).unwrap();
        let named = [("db".to_owned(), 2), ("db".to_owned(), 9), ("other".to_owned(), 1)];
        let renewing = sessions.tickets_of("a", Some(&named), start + LEASE / 2).unwrap();
        assert_eq!(renewing.renew, [("db".to_owned(), 2, held[1], LEASE)]);
        assert_eq!(renewing.unknown, [("db".to_owned(), 9), ("other".to_owned(), 1)]);
        // Ticket 1 was not named: it lapses at its old lease's end and is asked about then.
        let probed = sessions.sweep(start + LEASE, GRACE).1;
        assert_eq!(probed.iter().map(|l| l.backend).collect::<Vec<_>>(), [held[0]]);
        sessions.end("a", "busy", busy, start);
    }

    /// Review finding (stop 72): records were keyed by number alone, so a request that had
    /// asked about one backend ticket could remove or mark the record of another under the
    /// same number, and a second ask racing the first could find the ticket "finished" before
    /// the backend knew it; either left a backend ticket that no record names (invariant 4).
    #[test]
    fn a_record_changes_only_for_its_own_backend_ticket() {
        let mut sessions = Sessions::new(usize::MAX, Duration::from_secs(60));
        let start = Instant::now();
        let mut alloc = counter();
        let first = sessions.begin("a", "db", Some(7), LEASE, start, &mut alloc).unwrap();
        assert!(first.fresh && !first.first_ask_elsewhere);
        // A second ask while the first is being made asks the backend nothing, and a renewal
        // leaves the ticket out.
        let second = sessions.begin("a", "db", Some(7), LEASE * 2, start, &mut alloc).unwrap();
        assert!(!second.fresh && second.first_ask_elsewhere);
        assert_eq!(second.lease, LEASE, "the first ask's lease");
        assert_eq!(sessions.tickets_of("a", None, start), Some(Renewing::default()));
        sessions.end("a", "db", second, start);
        assert!(sessions.first_asked("db", first));
        sessions.end("a", "db", first, start);
        let third = sessions.begin("a", "db", Some(7), LEASE, start, &mut alloc).unwrap();
        assert!(!third.fresh && !third.first_ask_elsewhere);
        assert_eq!(
            sessions.tickets_of("a", None, start).map(|r| r.renew),
            Some(vec![("db".to_owned(), 7, first.backend, LEASE)])
        );
        // Forgotten without finishing (its first ask failed, or a try was refused), and asked
        // for again under the same number: a new backend ticket. (A released one would be
        // refused: invariant 5.)
        assert_eq!(sessions.forget("a", "db", 7, None, None), Ok(Some(first.backend)));
        let renewed = sessions.begin("a", "db", Some(7), LEASE, start, &mut alloc).unwrap();
        assert!(renewed.fresh && renewed.backend != first.backend);
        // What the old request saw of the old backend ticket changes nothing of the new one.
        sessions.end("a", "db", third, start);
        assert!(!sessions.granted("db", 7, first.backend, start));
        assert_eq!(sessions.forget("a", "db", 7, Some(first.backend), Some(start)), Ok(None));
        assert!(!sessions.first_asked("db", first));
        // The new ticket's own request is still in flight: its ticket is not withdrawn.
        let (withdraw, _) = sessions.sweep(start + GRACE * 2, GRACE);
        assert!(withdraw.is_empty(), "{withdraw:?}");
        assert!(sessions.first_asked("db", renewed));
        assert!(sessions.granted("db", 7, renewed.backend, start));
        assert_eq!(
            sessions.forget("a", "db", 7, Some(renewed.backend), Some(start)),
            Ok(Some(renewed.backend))
        );
    }
}
