//! Clients of the server: their tickets, the permits they hold and the leases on them.
//!
//! A client's tickets are its own numbers; the server maps each `(client, limit, ticket)` to a
//! backend ticket, so clients never collide. A held permit is a lease of the `lease_ms` it was
//! asked with; `renew` extends every lease the client holds. A client that is not heard from
//! for its lease (no request, no renewal, no long-poll in flight) loses its queued tickets at
//! once; its permits stay until their own leases end.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

/// A permit the client holds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Held {
    pub(crate) lease: Duration,
    pub(crate) expires: Instant,
}

#[derive(Debug)]
pub(crate) struct Ticket {
    pub(crate) backend: u64,
    pub(crate) held: Option<Held>,
}

#[derive(Debug)]
struct Session {
    last_seen: Instant,
    ttl: Duration,
    in_flight: usize,
    tickets: HashMap<(String, u64), Ticket>,
}

/// What the sweeper must hand back to the backend: `(limit, backend ticket)`.
#[derive(Debug, Default)]
pub(crate) struct Sweep {
    pub(crate) expired_permits: Vec<(String, u64)>,
    pub(crate) withdrawn_waiters: Vec<(String, u64)>,
}

#[derive(Debug, Default)]
pub(crate) struct Sessions {
    clients: HashMap<String, Session>,
}

impl Sessions {
    /// Marks a request of `client` starting; returns the backend ticket of `(limit, ticket)`,
    /// allocating it with `allocate` the first time (and for `ticket: None`, whose number is
    /// the backend ticket's).
    pub(crate) fn begin(
        &mut self,
        client: &str,
        limit: &str,
        ticket: Option<u64>,
        ttl: Duration,
        now: Instant,
        allocate: impl FnOnce() -> u64,
    ) -> (u64, u64) {
        let session = self.clients.entry(client.to_owned()).or_insert_with(|| Session {
            last_seen: now,
            ttl,
            in_flight: 0,
            tickets: HashMap::new(),
        });
        session.last_seen = now;
        session.ttl = ttl;
        session.in_flight += 1;
        let (theirs, backend) = match ticket {
            Some(theirs) => match session.tickets.get(&(limit.to_owned(), theirs)) {
                Some(known) => (theirs, known.backend),
                None => (theirs, allocate()),
            },
            None => {
                let backend = allocate();
                (backend, backend)
            }
        };
        session.tickets.entry((limit.to_owned(), theirs)).or_insert(Ticket { backend, held: None });
        (theirs, backend)
    }

    /// Marks a request of `client` finished.
    pub(crate) fn end(&mut self, client: &str, now: Instant) {
        if let Some(session) = self.clients.get_mut(client) {
            session.in_flight = session.in_flight.saturating_sub(1);
            session.last_seen = now;
        }
    }

    /// Records a grant; returns the lease end.
    pub(crate) fn granted(
        &mut self,
        client: &str,
        limit: &str,
        ticket: u64,
        lease: Duration,
        now: Instant,
    ) -> Instant {
        let Some(entry) = self
            .clients
            .get_mut(client)
            .and_then(|s| s.tickets.get_mut(&(limit.to_owned(), ticket)))
        else {
            return now + lease;
        };
        match &entry.held {
            Some(held) => held.expires,
            None => {
                let expires = now + lease;
                entry.held = Some(Held { lease, expires });
                expires
            }
        }
    }

    /// Forgets a ticket (released or withdrawn); its backend ticket, if it was known.
    pub(crate) fn forget(&mut self, client: &str, limit: &str, ticket: u64) -> Option<u64> {
        let session = self.clients.get_mut(client)?;
        let gone = session.tickets.remove(&(limit.to_owned(), ticket)).map(|t| t.backend);
        if session.tickets.is_empty() && session.in_flight == 0 {
            self.clients.remove(client);
        }
        gone
    }

    /// Extends every lease `client` holds; how many, or `None` for an unknown client.
    pub(crate) fn renew(&mut self, client: &str, now: Instant) -> Option<usize> {
        let session = self.clients.get_mut(client)?;
        session.last_seen = now;
        let mut renewed = 0;
        for ticket in session.tickets.values_mut() {
            if let Some(held) = &mut ticket.held {
                held.expires = now + held.lease;
                renewed += 1;
            }
        }
        Some(renewed)
    }

    /// Takes out what lapsed at `now`: permits whose lease ended, and the queued tickets of
    /// clients not heard from for their lease.
    pub(crate) fn sweep(&mut self, now: Instant) -> Sweep {
        let mut sweep = Sweep::default();
        self.clients.retain(|_, session| {
            let gone = session.in_flight == 0 && session.last_seen + session.ttl <= now;
            session.tickets.retain(|(limit, _), ticket| match &ticket.held {
                Some(held) if held.expires <= now => {
                    sweep.expired_permits.push((limit.clone(), ticket.backend));
                    false
                }
                Some(_) => true,
                None if gone => {
                    sweep.withdrawn_waiters.push((limit.clone(), ticket.backend));
                    false
                }
                None => true,
            });
            !(gone && session.tickets.is_empty())
        });
        sweep
    }

    /// Clients with a session.
    pub(crate) fn clients(&self) -> usize {
        self.clients.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(2);

    #[test]
    fn tickets_map_per_client_and_limit() {
        let mut sessions = Sessions::default();
        let now = Instant::now();
        let mut next = 100;
        let mut alloc = || {
            next += 1;
            next
        };
        let (a, ba) = sessions.begin("a", "db", Some(1), LEASE, now, &mut alloc);
        let (b, bb) = sessions.begin("b", "db", Some(1), LEASE, now, &mut alloc);
        assert_eq!((a, b), (1, 1));
        assert_ne!(ba, bb, "two clients' ticket 1 are different backend tickets");
        let (again, bagain) = sessions.begin("a", "db", Some(1), LEASE, now, &mut alloc);
        assert_eq!((again, bagain), (1, ba), "asking again is the same ticket");
        let (fresh, bfresh) = sessions.begin("a", "db", None, LEASE, now, &mut alloc);
        assert_eq!(fresh, bfresh, "a server-chosen ticket is the backend's");
    }

    #[test]
    fn a_silent_client_loses_its_waiters_at_once_and_its_permits_with_their_leases() {
        let mut sessions = Sessions::default();
        let start = Instant::now();
        let mut next = 0;
        let mut alloc = || {
            next += 1;
            next
        };
        sessions.begin("a", "db", Some(1), LEASE, start, &mut alloc);
        sessions.granted("a", "db", 1, Duration::from_secs(5), start);
        sessions.begin("a", "db", Some(2), LEASE, start, &mut alloc);
        sessions.end("a", start);
        sessions.end("a", start);
        let sweep = sessions.sweep(start + Duration::from_secs(1));
        assert!(sweep.expired_permits.is_empty() && sweep.withdrawn_waiters.is_empty());
        // Silent for its lease: the waiter goes, the permit stays.
        let sweep = sessions.sweep(start + LEASE);
        assert_eq!(sweep.withdrawn_waiters, [("db".to_owned(), 2)]);
        assert!(sweep.expired_permits.is_empty());
        // The permit's own lease (5 s) ends.
        let sweep = sessions.sweep(start + Duration::from_secs(5));
        assert_eq!(sweep.expired_permits, [("db".to_owned(), 1)]);
        assert_eq!(sessions.clients(), 0);
    }

    #[test]
    fn renewals_keep_permits_and_in_flight_requests_keep_waiters() {
        let mut sessions = Sessions::default();
        let start = Instant::now();
        let mut next = 0;
        let mut alloc = || {
            next += 1;
            next
        };
        sessions.begin("a", "db", Some(1), LEASE, start, &mut alloc);
        sessions.granted("a", "db", 1, LEASE, start);
        sessions.end("a", start);
        sessions.begin("a", "db", Some(2), LEASE, start, &mut alloc); // a long-poll in flight
        for second in 1..10 {
            let now = start + Duration::from_secs(second);
            assert_eq!(sessions.renew("a", now), Some(1));
            let sweep = sessions.sweep(now + Duration::from_millis(500));
            assert!(sweep.expired_permits.is_empty() && sweep.withdrawn_waiters.is_empty());
        }
        assert_eq!(sessions.renew("nobody", start), None);
        assert_eq!(sessions.forget("a", "db", 1), Some(1));
        assert_eq!(sessions.forget("a", "db", 1), None);
    }
}
