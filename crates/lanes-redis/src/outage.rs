//! What a client does without Redis: the outage policy, the local share, and the
//! detection of a Redis that lost its state.

// The crate root's private types and imports: this module is one of its impl blocks.
use super::*;

use std::collections::HashSet;

/// What a client does when Redis cannot answer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OutagePolicy {
    /// Acquires fail with [`LimitError::Backend`] (the default).
    FailClosed,
    /// Acquires are granted without a permit.
    FailOpen,
    /// Acquires fall back to an in-process limit with this share (in `(0, 1]`) of the spec.
    LocalShare(f64),
}

pub(crate) fn scaled(spec: LimitSpec, share: f64) -> LimitSpec {
    let scale = |n: u32| ((f64::from(n) * share).floor() as u32).max(1);
    LimitSpec {
        concurrent: scale(spec.concurrent),
        per_second: spec.per_second.map(|rate| rate * share),
        burst: scale(spec.burst),
    }
}

/// How far the recovery from a lost state got: the limits defined again for `epoch`, the
/// new epoch, which is taken as known only when every limit is.
#[derive(Default)]
pub(crate) struct Recovery {
    epoch: Option<String>,
    defined: HashSet<String>,
}

impl Inner {
    pub(crate) async fn outage_for(
        &self,
        name: &str,
        ticket: u64,
        ask: Ask,
        lease: Option<Duration>,
        err: CallError,
    ) -> Result<Answer, LimitError> {
        // A try whose call went unanswered may have been applied, and granted: its ticket is
        // released once Redis answers again, or the permit would sit there for a lease.
        if matches!(ask, Ask::Try) && matches!(err, CallError::Outage(_)) {
            self.lock_state().orphans.push(name, ticket);
        }
        let (priority, never_queue) = match ask {
            Ask::First(priority) => (priority, false),
            Ask::Try => (Priority::default(), true),
            Ask::Check => (Priority::default(), false),
        };
        self.on_outage(name, ticket, &priority, never_queue, lease, err).await
    }

    /// Records a permit as lost and wakes whoever awaits it.
    pub(crate) fn mark_lost(&self, name: &str, ticket: u64) {
        self.stats.lost_leases.fetch_add(1, Ordering::Relaxed);
        self.lost.mark(name, ticket);
    }

    /// Compares the namespace's epoch with the one this client knows. On a difference (or a
    /// missing epoch) Redis lost its state: every limit this client knows is defined again with
    /// a hold of `max_lease`, every permit it held is reported lost, and its waiters ask again
    /// (their tickets are queued anew). Answers whether a loss was found (by this call, or by
    /// another while this one waited for it).
    ///
    /// The recovery runs to its end in a task of its own, on the client's runtime, where all its
    /// background tasks run (a caller's runtime may stop being driven when the caller gives
    /// up, and the recovery would be parked there, holding its lock). The new epoch is taken as
    /// known only once it is complete: a caller that gives up on the way (an acquire's
    /// timeout), or a call that fails (Redis away again), leaves it for the next look, never
    /// half done (the limits after the one it stopped at would never be defined again). The
    /// permits held before the loss are reported lost when it is first found; those granted
    /// while a recovery goes on are not.
    pub(crate) async fn detect_loss(&self) -> Result<bool, CallError> {
        let key = self.epoch_key();
        let known = lock(&self.epoch).clone();
        let seen: Option<String> = self.command(redis::cmd("GET").arg(&key)).await?;
        if seen.is_some() && seen == known {
            return Ok(false);
        }
        let Some(me) = self.me.get().and_then(Weak::upgrade) else {
            return Err(CallError::Other(LimitError::backend("redis: the client is gone")));
        };
        let recovery = {
            let (me, known) = (Arc::clone(&me), known.clone());
            self.runtime.spawn(async move { me.recover(known).await })
        };
        match recovery.await {
            Ok(found) => found,
            // The client's runtime is gone (its tasks with it): here, then.
            Err(err) if err.is_cancelled() => me.recover(known).await,
            Err(err) => Err(CallError::Other(LimitError::backend(format!(
                "redis: the recovery from a lost state failed: {err}"
            )))),
        }
    }

    /// The recovery of [`detect_loss`](Self::detect_loss), one at a time; `known` is the epoch
    /// the caller knew.
    async fn recover(&self, known: Option<String>) -> Result<bool, CallError> {
        let mut recovery = self.recovering.lock().await;
        if *lock(&self.epoch) != known {
            return Ok(true); // another task of this client recovered meanwhile
        }
        let mut conn = self.conn.live();
        let fresh =
            tokio::time::timeout(self.op_timeout, ensure_epoch(&mut conn, &self.epoch_key()))
                .await
                .map_err(|_| self.outage("no answer".into()))?
                .map_err(|e| self.outage(e.to_string()))?;
        if known.as_ref() == Some(&fresh) {
            return Ok(false);
        }
        if recovery.epoch.as_ref() != Some(&fresh) {
            *recovery = Recovery { epoch: Some(fresh.clone()), defined: HashSet::new() };
            // Found now: every permit held before it is lost. (Not when a recovery cut short
            // goes on: permits granted since, once their limit was back, are good.)
            let held: Vec<(String, u64)> = {
                let mut state = self.lock_state();
                let mut held = Vec::new();
                for (name, limit) in &mut state.limits {
                    let lost = limit.lose_all();
                    held.extend(lost.into_iter().map(|ticket| (name.clone(), ticket)));
                }
                held
            };
            for (name, ticket) in held {
                self.mark_lost(&name, ticket);
            }
        }
        let specs: Vec<(String, LimitSpec)> =
            self.lock_state().specs.iter().map(|(n, s)| (n.clone(), *s)).collect();
        for (name, spec) in specs {
            // Defined again by an attempt that stopped later: its hold is not to start over.
            if recovery.defined.contains(&name) {
                continue;
            }
            self.stats.redefinitions.fetch_add(1, Ordering::Relaxed);
            match self.define_held(&name, spec, self.max_lease).await {
                // Redis away again: the next look goes on from here.
                Err(err @ CallError::Outage(_)) => return Err(err),
                // Refused (defined otherwise by another client meanwhile, say): that limit is
                // as Redis has it now.
                Ok(()) | Err(CallError::Other(_)) => {}
            }
            recovery.defined.insert(name);
        }
        // Every limit is back: the waiters ask again (their tickets are queued anew).
        for limit in self.lock_state().limits.values() {
            limit.wake_all();
        }
        *lock(&self.epoch) = Some(fresh);
        Ok(true)
    }

    pub(crate) fn epoch_key(&self) -> String {
        format!("lanes:{{{}}}:epoch", self.namespace)
    }

    pub(crate) async fn on_outage(
        &self,
        name: &str,
        ticket: u64,
        priority: &Priority,
        never_queue: bool,
        lease: Option<Duration>,
        err: CallError,
    ) -> Result<Answer, LimitError> {
        let message = match err {
            CallError::Other(err) => return Err(err),
            CallError::Outage(message) => message,
        };
        // Granted and pushed while the call went unanswered: that is the answer, whatever the
        // policy. (Under `LocalShare` a push may still come while the share is set up: it is
        // looked for again where the ticket moves to the share.)
        if let Some(pushed) = self.lock_state().limits.get_mut(name).and_then(|l| l.claim(ticket)) {
            return Ok(Answer::Granted(pushed));
        }
        match self.outage {
            OutagePolicy::FailClosed => {
                Err(LimitError::backend(format!("redis unreachable: {message}")))
            }
            OutagePolicy::FailOpen => {
                let mut state = self.lock_state();
                let limit = state.limits.entry(name.to_owned()).or_default();
                if let Some(pushed) = limit.claim(ticket) {
                    return Ok(Answer::Granted(pushed));
                }
                // The ticket may be queued on the server: withdraw it once Redis is back.
                let queued_remotely = limit.is_waiting(ticket);
                limit.open(ticket);
                if queued_remotely {
                    state.orphans.push(name, ticket);
                }
                self.stats.open_grants.fetch_add(1, Ordering::Relaxed);
                Ok(Answer::Granted(Grant { fencing_token: 0, expires_at: None }))
            }
            OutagePolicy::LocalShare(share) => {
                let Some(spec) = self.lock_state().specs.get(name).copied() else {
                    return Err(LimitError::backend(format!(
                        "redis unreachable ({message}) and the spec of {name:?} is unknown to this client"
                    )));
                };
                if self.local.info(name).await?.is_none() {
                    self.local.define(name, scaled(spec, share)).await?;
                }
                {
                    let mut state = self.lock_state();
                    let limit = state.limits.entry(name.to_owned()).or_default();
                    if let Some(pushed) = limit.claim(ticket) {
                        return Ok(Answer::Granted(pushed));
                    }
                    // The ticket may be queued on the server: withdraw it once Redis is back.
                    let queued_remotely = limit.is_waiting(ticket);
                    limit.local(ticket);
                    if queued_remotely {
                        state.orphans.push(name, ticket);
                    }
                }
                self.stats.local_acquires.fetch_add(1, Ordering::Relaxed);
                if !never_queue {
                    return self.local.acquire(name, ticket, priority, lease).await;
                }
                // A try: granted at once or nothing, here too. Queued in the local share, its
                // ticket would stay there for good (nobody withdraws a try that was answered).
                let answer = self.local.try_acquire(name, ticket, lease).await;
                if !matches!(answer, Ok(Answer::Granted(_))) {
                    self.lock_state().limits.entry(name.to_owned()).or_default().release(ticket);
                }
                answer
            }
        }
    }
}
