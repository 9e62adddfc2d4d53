//! Keeping leases alive: the maintenance loop, renewals, and the namespace's epoch.

// The crate root's private types and imports: this module is one of its impl blocks.
use super::*;

use futures_util::future::join_all;

/// Every quarter of a second (or third of a lease, if shorter): checks the namespace's epoch
/// (so a Redis that lost its state is seen within one tick; in a task of its own), retries releases that could not
/// reach Redis, sends releases still waiting to ride (whose own task did not run), tells the
/// limits where this client waits that it is alive, and — every third of a lease — renews the
/// permits it holds for itself.
///
/// The calls of a tick are made at once, not one after the other: on a cluster whose primary
/// failed, each call to it waits out `op_timeout`, and the renewals of limits on the healthy
/// primaries must not queue behind them (their leases would end while their holders wait).
pub(crate) async fn maintain(inner: Weak<Inner>, auto_renew: bool) {
    let (period, renew_every) = match inner.upgrade() {
        Some(inner) => ((inner.lease / 3).min(Duration::from_millis(250)), inner.lease / 3),
        None => return,
    };
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut renewed = Instant::now();
    let mut touched = Instant::now();
    loop {
        tick.tick().await;
        let Some(inner) = inner.upgrade() else { return };
        let (orphans, riding) = {
            let mut state = inner.lock_state();
            let riding: Vec<String> = state
                .limits
                .iter()
                .filter(|(_, limit)| limit.has_riders())
                .map(|(name, _)| name.clone())
                .collect();
            (state.orphans.take(ORPHAN_CALLS, ORPHANS_PER_CALL), riding)
        };
        let waiting: Vec<String> = if due(touched.elapsed(), period, inner.queue_grace / 4) {
            touched = Instant::now();
            inner
                .lock_state()
                .limits
                .iter()
                .filter(|(_, limit)| limit.has_waiters())
                .map(|(name, _)| name.clone())
                .collect()
        } else {
            Vec::new()
        };
        let held: Vec<(String, Vec<u64>)> =
            if auto_renew && due(renewed.elapsed(), period, renew_every) {
                renewed = Instant::now();
                inner
                    .lock_state()
                    .limits
                    .iter()
                    .map(|(name, limit)| (name.clone(), limit.renewed()))
                    .filter(|(_, own)| !own.is_empty())
                    .collect()
            } else {
                Vec::new()
            };
        // The epoch is looked at in a task of its own, one at a time: a recovery (seconds, for
        // thousands of limits) must not hold up the renewals of permits granted meanwhile.
        if !inner.looking.swap(true, Ordering::AcqRel) {
            let looker = Looking(Arc::clone(&inner));
            tokio::spawn(async move {
                let _ = looker.0.detect_loss().await;
            });
        }
        let inner = &*inner;
        let releases = join_all(orphans.into_iter().map(|(name, tickets)| async move {
            inner.release_orphans(&name, tickets).await;
        }));
        let riders = join_all(riding.iter().map(|name| inner.flush_riders(name)));
        let touches = join_all(waiting.iter().map(|name| inner.call(name, "touch", NO_ARGS)));
        let renewals = join_all(held.into_iter().map(|(name, tickets)| async move {
            inner.renew_all(&name, tickets, inner.lease).await
        }));
        let _ = tokio::join!(releases, riders, touches, renewals);
    }
}

/// The maintenance loop's look at the epoch, under way until dropped (also when it panics).
struct Looking(Arc<Inner>);

impl Drop for Looking {
    fn drop(&mut self) {
        self.0.looking.store(false, Ordering::Release);
    }
}

/// The most calls a tick makes for releases that could not reach Redis, and the most tickets
/// each carries: after an outage the backlog drains at up to 4,096 tickets a tick, in a few
/// short script calls, instead of one call per ticket, all at once, on a Redis just back.
const ORPHAN_CALLS: usize = 16;
const ORPHANS_PER_CALL: usize = 256;

/// Whether a chore done `every` is due at a tick, `since` its last run, ticks coming every
/// `period`. Half a period of slack: the ticks keep their schedule, but each is handled a
/// little late, so a tick handled less late than the last is less than `period` after it. With
/// a plain `since >= every` such a tick would skip the chore and leave it for the next: a
/// renewal every two thirds of a lease instead of every third.
fn due(since: Duration, period: Duration, every: Duration) -> bool {
    since + period / 2 >= every
}

/// Reports each permit this client renews as lost the moment its lease may have ended on
/// the server without a renewal (Redis unreachable, or too slow): from then on Redis may grant
/// it to someone else, so its holder must stop believing it holds it. Scans at the next lease
/// end, and at least every 50 ms (a new lease ends later than that).
pub(crate) async fn watch_leases(inner: Weak<Inner>) {
    loop {
        let Some(strong) = inner.upgrade() else { return };
        let now = Instant::now();
        let mut lapsed = Vec::new();
        let mut next = now + Duration::from_millis(50);
        for (name, limit) in &mut strong.lock_state().limits {
            let (gone, soonest) = limit.lapse(now);
            lapsed.extend(gone.into_iter().map(|ticket| (name.clone(), ticket)));
            next = soonest.map_or(next, |soonest| soonest.min(next));
        }
        for (name, ticket) in lapsed {
            strong.mark_lost(&name, ticket);
        }
        drop(strong);
        tokio::time::sleep_until(next).await;
    }
}

/// Reads the namespace's epoch, creating a fresh random one if Redis has none.
pub(crate) async fn ensure_epoch(conn: &mut Live, key: &str) -> Result<String, RedisError> {
    let fresh = {
        use std::hash::BuildHasher;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        format!("{:016x}", std::collections::hash_map::RandomState::new().hash_one(nanos))
    };
    let _: Option<String> =
        redis::cmd("SET").arg(key).arg(&fresh).arg("NX").query_async(conn).await?;
    let epoch: Option<String> = redis::cmd("GET").arg(key).query_async(conn).await?;
    Ok(epoch.unwrap_or(fresh))
}

impl Inner {
    /// Renews every held permit of `name`; returns the tickets whose lease had ended, and
    /// those this client believes hold a permit that wait in Redis (a failover or a restart
    /// lost their grant: Redis counts them in no one's use). Tickets that wait, and that this
    /// client knows to be waiting, are not refused.
    pub(crate) async fn renew_all(
        &self,
        name: &str,
        tickets: Vec<u64>,
        lease: Duration,
    ) -> Result<Vec<u64>, CallError> {
        // The permits of this client's share of a leased limit are renewed here: Redis does
        // not know them.
        let tickets: Vec<u64> = match self.leased(name) {
            Some(share) => tickets
                .into_iter()
                .filter(|&ticket| {
                    let waiting = !share.holds(ticket) && share.knows(ticket);
                    // Held and renewed (a lease that ended is not), or waiting in the share's
                    // line: kept. The rest go to Redis, which refuses what it does not hold.
                    let kept = match self.share_lease(Some(lease)) {
                        Some(lease) => waiting || share.lease(ticket, lease),
                        None => share.knows(ticket),
                    };
                    !kept
                })
                .collect(),
            None => tickets,
        };
        if tickets.is_empty() {
            return Ok(Vec::new());
        }
        let args: Vec<String> = tickets.iter().map(u64::to_string).collect();
        // Which of them this client believes hold a permit as it asks: one granted while the
        // answer travels (its long-poll's answer, a push) may well wait in Redis as it answers.
        let held_before: BTreeSet<u64> = {
            let state = self.lock_state();
            let limit = state.limits.get(name);
            tickets.iter().copied().filter(|t| limit.is_some_and(|l| l.holds(*t))).collect()
        };
        let sent = Instant::now();
        let value = self.call_leased(name, "renew", lease, &args).await?;
        let refused: Vec<u64> = if error_tag(&value).as_deref() == Some("unknown") {
            // Redis no longer knows the limit (it restarted empty): nothing is held there.
            tickets.clone()
        } else {
            let Value::Array(items) = value else {
                return Err(CallError::Other(LimitError::backend("redis: odd renewal")));
            };
            let items: Vec<String> = items.iter().filter_map(text).collect();
            let state = self.lock_state();
            let limit = state.limits.get(name);
            items
                .iter()
                .filter_map(|item| match item.strip_prefix('w') {
                    Some(waiting) => {
                        let ticket: u64 = waiting.parse().ok()?;
                        let held = held_before.contains(&ticket)
                            && limit.is_some_and(|limit| limit.holds(ticket));
                        held.then_some(ticket)
                    }
                    None => item.parse().ok(),
                })
                .collect()
        };
        {
            let refused: BTreeSet<u64> = refused.iter().copied().collect();
            let renewed: Vec<u64> =
                tickets.into_iter().filter(|ticket| !refused.contains(ticket)).collect();
            let mut state = self.lock_state();
            if let Some(limit) = state.limits.get_mut(name) {
                limit.renewed_until(&renewed, self.lease_end(sent, lease));
            }
        }
        if !refused.is_empty() {
            let mut lost = Vec::new();
            {
                let mut state = self.lock_state();
                if let Some(limit) = state.limits.get_mut(name) {
                    lost.extend(refused.iter().copied().filter(|ticket| limit.lose(*ticket)));
                }
            }
            for ticket in lost {
                self.mark_lost(name, ticket);
            }
        }
        Ok(refused)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// The tick after a late one comes less than a period after it: the chore still runs.
    #[test]
    fn a_tick_handled_less_late_than_the_last_still_renews() {
        // Lease 300 ms: a tick and a renewal every 100 ms. The last renewal was handled 3 ms
        // after its tick, this tick 1 ms after its own: 98 ms since.
        assert!(due(98 * MS, 100 * MS, 100 * MS));
        // A lease of 30 s: ticks every 250 ms, a renewal every 10 s, not at every tick.
        assert!(!due(9_700 * MS, 250 * MS, 10_000 * MS));
        assert!(due(9_998 * MS, 250 * MS, 10_000 * MS));
        // Nor does a tick that comes right after a renewal.
        assert!(!due(MS, 100 * MS, 100 * MS));
    }
}
