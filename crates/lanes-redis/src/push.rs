//! Grants and wake-ups pushed on the client's channel.

// The crate root's private types and imports: this module is one of its impl blocks.
use super::*;

/// How often the subscriber's connection is pinged, and how long it has to answer.
const KEEPALIVE: Duration = Duration::from_secs(1);

/// Listens on the client's channel; wakes the first waiter of each limit it names. Reconnects
/// after a failure, or a ping unanswered for [`KEEPALIVE`] (to the next of `clients`, which
/// are the nodes of a cluster or the one Redis), and then wakes every waiter: pushes may have
/// been missed, and a grant pushed to a waiter other than the first (served first for its
/// priority) is found only by that waiter's own ask.
pub(crate) async fn subscribe(
    clients: Vec<redis::Client>,
    inner: Weak<Inner>,
    subscribed: tokio::sync::oneshot::Sender<()>,
) {
    let mut subscribed = Some(subscribed);
    let mut backoff = Duration::from_millis(50);
    for client in clients.iter().cycle() {
        let Some(strong) = inner.upgrade() else { return };
        let channel = format!("{}{}", strong.channel_prefix, strong.client);
        let prefix = format!("{}:", strong.namespace);
        drop(strong);
        let pubsub = async {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, RedisError>(pubsub)
        };
        let pubsub = match tokio::time::timeout(Duration::from_secs(2), pubsub).await {
            Ok(Ok(pubsub)) => pubsub,
            _ => {
                tokio::time::sleep(backoff / clients.len() as u32).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        backoff = Duration::from_millis(50);
        if let Some(done) = subscribed.take() {
            let _ = done.send(());
        }
        if let Some(strong) = inner.upgrade() {
            // Once the connection for calls answers (it may still be marked away, and the
            // waiters' asks would then all meet the outage policy at once), within a bound.
            let ready = Instant::now() + strong.op_timeout * 4;
            while strong.conn.unreachable() && Instant::now() < ready {
                strong.conn.failed();
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            for limit in strong.lock_state().limits.values() {
                limit.wake_all();
            }
        }
        // A connection that goes silent without closing (half-open) would lose every push
        // until the kernel gave up on it: a ping that goes unanswered starts over.
        let (mut sink, mut messages) = pubsub.split();
        let mut keepalive = tokio::time::interval(KEEPALIVE);
        keepalive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        keepalive.tick().await;
        loop {
            let message = tokio::select! {
                message = messages.next() => message,
                _ = keepalive.tick() => {
                    match tokio::time::timeout(KEEPALIVE, sink.ping::<redis::Value>()).await {
                        Ok(Ok(_)) => continue,
                        _ => break,
                    }
                }
            };
            let Some(message) = message else { break };
            let Some(strong) = inner.upgrade() else { return };
            let Ok(payload) = message.get_payload::<String>() else { continue };
            strong.stats.notifications.fetch_add(1, Ordering::Relaxed);
            if let Some((name, ticket)) = strong.pushed(&prefix, &payload) {
                // Granted to a waiter that is gone: hand the permit back now, in a task of its
                // own, so the pushes behind this one are not delayed by the call.
                tokio::spawn(async move {
                    if let Err(CallError::Outage(_)) =
                        strong.call(&name, "release", &[ticket.to_string()]).await
                    {
                        strong.lock_state().orphans.push(&name, ticket);
                    }
                });
            }
        }
    }
}

/// A pushed grant: `ticket|fence|expires|namespace:limit`.
pub(crate) fn parse_push(payload: &str) -> Option<(u64, Grant, &str)> {
    let mut parts = payload.splitn(4, '|');
    let ticket = parts.next()?.parse().ok()?;
    let fencing_token = parts.next()?.parse().ok()?;
    let expires: u64 = parts.next()?.parse().ok()?;
    let name = parts.next()?;
    Some((ticket, Grant { fencing_token, expires_at: Some(Duration::from_micros(expires)) }, name))
}

impl Inner {
    /// A message on the client's channel: a grant made on behalf of one of its waiters, or a
    /// wake-up for the client's first waiter of a limit.
    /// Returns a permit to hand back if its waiter is gone.
    pub(crate) fn pushed(&self, prefix: &str, payload: &str) -> Option<(String, u64)> {
        let mut state = self.lock_state();
        match parse_push(payload) {
            Some((ticket, grant, qualified)) => {
                let name = qualified.strip_prefix(prefix)?;
                let limit = state.limits.entry(name.to_owned()).or_default();
                // Granted before it got here, by up to the push's delay: counted as if asked for
                // one op timeout (at most a quarter of the lease) ago.
                let early = self.op_timeout.min(self.lease / 4);
                let until = self.lease_end(Instant::now() - early, self.lease);
                match limit.deliver(ticket, grant, until) {
                    Delivered::Woken | Delivered::Already => None,
                    Delivered::Gone => Some((name.to_owned(), ticket)),
                }
            }
            None => {
                let name = payload.strip_prefix(prefix)?;
                if let Some(limit) = state.limits.get(name) {
                    limit.wake_first();
                }
                None
            }
        }
    }
}
