//! Keeping leases alive: the maintenance loop, renewals, and the namespace's epoch.

// The crate root's private types and imports: this module is one of its impl blocks.
use super::*;

/// Every quarter of a second (or third of a lease, if shorter): checks the namespace's epoch
/// (so a Redis that lost its state is seen within one tick), retries releases that could not
/// reach Redis, tells the limits where this client waits that it is alive, and — every third of
/// a lease — renews the permits it holds for itself.
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
        let _ = inner.detect_loss().await;
        let orphans = std::mem::take(&mut lock(&inner.state).orphans);
        for (name, ticket) in orphans {
            if let Err(CallError::Outage(_)) =
                inner.call(&name, "release", &[ticket.to_string()]).await
            {
                lock(&inner.state).orphans.push((name, ticket));
            }
        }
        if touched.elapsed() >= inner.queue_grace / 4 {
            touched = Instant::now();
            let waiting: Vec<String> = lock(&inner.state)
                .limits
                .iter()
                .filter(|(_, limit)| limit.has_waiters())
                .map(|(name, _)| name.clone())
                .collect();
            for name in waiting {
                let _ = inner.call(&name, "touch", &[]).await;
            }
        }
        if !auto_renew || renewed.elapsed() < renew_every {
            continue;
        }
        renewed = Instant::now();
        let held: Vec<(String, Vec<u64>)> = lock(&inner.state)
            .limits
            .iter()
            .map(|(name, limit)| (name.clone(), limit.renewed()))
            .filter(|(_, own)| !own.is_empty())
            .collect();
        for (name, tickets) in held {
            let _ = inner.renew_all(&name, tickets, inner.lease).await;
        }
    }
}

/// Reads the namespace's epoch, creating a fresh random one if Redis has none.
pub(crate) async fn ensure_epoch(
    conn: &mut ConnectionManager,
    key: &str,
) -> Result<String, RedisError> {
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
    /// Renews every held permit of `name`; returns the tickets whose lease had ended.
    pub(crate) async fn renew_all(
        &self,
        name: &str,
        tickets: Vec<u64>,
        lease: Duration,
    ) -> Result<Vec<u64>, CallError> {
        let args: Vec<String> = tickets.iter().map(u64::to_string).collect();
        let value = self.call_leased(name, "renew", lease, &args).await?;
        let refused: Vec<u64> = if error_tag(&value).as_deref() == Some("unknown") {
            // Redis no longer knows the limit (it restarted empty): nothing is held there.
            tickets
        } else {
            let Value::Array(items) = value else {
                return Err(CallError::Other(LimitError::backend("redis: odd renewal")));
            };
            items.iter().filter_map(|v| text(v)?.parse().ok()).collect()
        };
        if !refused.is_empty() {
            let mut lost = Vec::new();
            {
                let mut state = lock(&self.state);
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
