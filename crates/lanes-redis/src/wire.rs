//! The calls to Redis and the parsing of their replies.

// The crate root's private types and imports: this module is one of its impl blocks.
use super::*;
use redis::{RedisWrite, ToRedisArgs};

/// A failed Redis call: for lack of Redis (the outage policy applies) or another error.
pub(crate) enum CallError {
    Outage(String),
    Other(LimitError),
}

impl From<CallError> for LimitError {
    fn from(err: CallError) -> Self {
        match err {
            CallError::Outage(message) => {
                LimitError::backend(format!("redis unreachable: {message}"))
            }
            CallError::Other(err) => err,
        }
    }
}

pub(crate) fn is_outage(err: &RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    err.is_io_error()
        || err.is_timeout()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
        || err.is_unrecoverable_error()
        // A cluster in the middle of a failover, after the client's own retries.
        || err.is_cluster_error()
        || matches!(
            err.kind(),
            ErrorKind::ClusterConnectionNotFound
                | ErrorKind::Server(
                    ServerErrorKind::MasterDown
                        | ServerErrorKind::ReadOnly
                        | ServerErrorKind::BusyLoading
                )
        )
}

/// Which ask of a ticket.
#[derive(Clone)]
pub(crate) enum Ask {
    /// The first ask: queues the ticket at this priority unless granted.
    First(Priority),
    /// A later look: never queues.
    Check,
    /// Granted at once or nothing.
    Try,
}

/// What the acquire script said.
pub(crate) enum Reply {
    Answer(ScriptAnswer, Option<Grant>, Option<Duration>),
    Unknown,
    TooManyWaiters,
    Finished,
    /// The limit is leased: this client serves it from its share.
    Leased(SharePolicy),
}

pub(crate) fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(n) => Some(n.to_string()),
        _ => None,
    }
}

pub(crate) fn int(value: &Value) -> Option<i64> {
    match value {
        Value::Int(n) => Some(*n),
        other => text(other)?.parse().ok(),
    }
}

pub(crate) fn error_tag(value: &Value) -> Option<String> {
    match value {
        Value::Array(items) if items.len() == 1 => text(&items[0]),
        _ => None,
    }
}

/// A grant as the script answers it to the ticket asked about: its holder's entry,
/// "fence:expires" (one string costs Redis less to build and send than an array).
pub(crate) fn parse_held(held: &[u8]) -> Option<Grant> {
    let (fence, expires) = std::str::from_utf8(held).ok()?.split_once(':')?;
    let expires_us: u64 = expires.parse().ok()?;
    Some(Grant {
        fencing_token: fence.parse().ok()?,
        expires_at: Some(Duration::from_micros(expires_us)),
    })
}

pub(crate) fn parse_grant(fence: &Value, expires: &Value) -> Option<Grant> {
    let fencing_token = u64::try_from(int(fence)?).ok()?;
    let expires_us = u64::try_from(int(expires)?).ok()?;
    Some(Grant { fencing_token, expires_at: Some(Duration::from_micros(expires_us)) })
}

/// The limits' Redis Functions library (`limits.lua`), named after a hash of its code so that
/// clients of different versions never replace each other's.
pub(crate) struct Library {
    pub(crate) name: String,
    code: String,
}

impl Library {
    pub(crate) fn new() -> Self {
        // FNV-1a, 64 bits: stable across builds and platforms.
        let hash = SCRIPT.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
        });
        let name = format!("lanes_limits_{hash:016x}");
        let code = SCRIPT.replace("__LANES_LIBRARY__", &name);
        Self { name, code }
    }

    /// Loads it (on every primary of a cluster). A library of the same name has the same code:
    /// it is kept ([`already_loaded`] tells the error), and with it the library's own state (when
    /// a promotion was first seen: reloaded at every client's start, a promoted server was
    /// dated anew each time, and new limits held again).
    pub(crate) fn load(&self) -> redis::Cmd {
        let mut load = redis::cmd("FUNCTION");
        load.arg("LOAD").arg(&self.code);
        load
    }
}

/// Whether a load failed only because the library was there already (loaded by another client
/// of this version, or by this one meanwhile).
pub(crate) fn already_loaded(err: &impl std::fmt::Display) -> bool {
    err.to_string().contains("already exists")
}

/// An argument of a function call written straight into the command (a number without a
/// `String` of its own), for the calls on every acquire and release.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Arg<'a> {
    Int(u64),
    Signed(i64),
    Text(&'a str),
}

/// A call with no arguments of its own.
pub(crate) const NO_ARGS: &[Arg<'static>] = &[];

impl ToRedisArgs for Arg<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        match *self {
            Self::Int(n) => n.write_redis_args(out),
            Self::Signed(n) => n.write_redis_args(out),
            Self::Text(text) => text.write_redis_args(out),
        }
    }
}

impl Inner {
    pub(crate) async fn call<A: ToRedisArgs + Sync>(
        &self,
        name: &str,
        op: &str,
        args: &[A],
    ) -> Result<Value, CallError> {
        self.call_leased(name, op, self.lease, args).await
    }

    pub(crate) async fn call_leased<A: ToRedisArgs + Sync>(
        &self,
        name: &str,
        op: &str,
        lease: Duration,
        args: &[A],
    ) -> Result<Value, CallError> {
        // The operations that carry riders (see `limits.lua`): releases of this client's
        // dropped permits on the limit, done first, in the same call.
        let (riders, alone) = match op {
            "acquire" | "check" | "try" | "release" => self.take_riders(name),
            _ => (Vec::new(), false),
        };
        if op == "acquire" && alone {
            // The limit was busy at this client's last ask, so this acquire will likely queue:
            // the permits go back first in a call of their own, whose grants to waiters are
            // pushed as soon as it ends, not after the queueing of this ask too. The asker,
            // which would wait anyway, pays a round trip.
            let _ = self.call_riding(name, "release", self.lease, NO_ARGS, riders).await;
            return self.call_riding(name, op, lease, args, Vec::new()).await;
        }
        self.call_riding(name, op, lease, args, riders).await
    }

    /// Sends releases waiting to ride on `name` in calls of their own, when no other call
    /// took them first (the task that queued the first of them runs this).
    pub(crate) async fn flush_riders(&self, name: &str) {
        loop {
            let (riders, _) = self.take_riders(name);
            if riders.is_empty() {
                return;
            }
            // A release whose ticket is its first rider (the script reads them alike).
            let _ = self.call_riding(name, "release", self.lease, NO_ARGS, riders).await;
        }
    }

    /// Releases `tickets` of `name` (taken from the orphans) in one call. If Redis cannot be
    /// reached they go back to the orphans; an error of another kind (a damaged key) would
    /// come back every time, and they are abandoned, as past the bound.
    pub(crate) async fn release_orphans(&self, name: &str, tickets: Vec<u64>) {
        // The tickets as the release's own arguments (the script reads them as riders), not
        // as riders: those go back to the orphans whatever the error.
        let args: Vec<Arg<'_>> = tickets.iter().map(|&ticket| Arg::Int(ticket)).collect();
        let result = self.call_riding(name, "release", self.lease, &args, Vec::new()).await;
        let mut state = self.lock_state();
        state.orphans.settled(tickets.len());
        match result {
            Ok(_) => {}
            Err(CallError::Outage(_)) => {
                for ticket in tickets {
                    state.orphans.push(name, ticket);
                }
            }
            Err(CallError::Other(_)) => state.orphans.abandon(tickets.len()),
        }
    }

    fn take_riders(&self, name: &str) -> (Vec<u64>, bool) {
        self.lock_state().limits.get_mut(name).map(ClientLimit::take_riders).unwrap_or_default()
    }

    async fn call_riding<A: ToRedisArgs + Sync>(
        &self,
        name: &str,
        op: &str,
        lease: Duration,
        args: &[A],
        riders: Vec<u64>,
    ) -> Result<Value, CallError> {
        // Releases that the call may not have made (it failed, timed out, or was dropped)
        // are retried in the background, as releases that could not reach Redis are (a
        // second release of a ticket is a no-op).
        let mut riding = Riding { inner: self, name, tickets: riders };
        // Sized once: grown argument by argument, the command's two buffers were reallocated
        // about eight times per call, a fifth of the client's instructions per acquire. An
        // operation's own arguments are a few numbers and short words (24 bytes is roomy).
        let data = 96
            + self.library.name.len()
            + self.namespace.len()
            + name.len()
            + self.channel_prefix.len()
            + 24 * (args.len() + riding.tickets.len());
        let mut fcall = redis::Cmd::with_capacity(9 + args.len() + riding.tickets.len(), data);
        fcall
            .arg("FCALL")
            .arg(&self.library.name)
            .arg(1)
            .arg(self.base(name))
            .arg(op)
            .arg(&self.channel_prefix)
            .arg(lease.as_millis() as u64)
            .arg(self.queue_grace.as_millis() as u64)
            .arg(self.client);
        for arg in args {
            fcall.arg(arg);
        }
        for ticket in &riding.tickets {
            fcall.arg(*ticket);
        }
        self.stats.calls.fetch_add(1, Ordering::Relaxed);
        let mut result = self.query(&fcall).await;
        if let Err(CallError::Other(err)) = &result
            && err.to_string().contains("Function not found")
        {
            // A Redis that restarted empty (or a node that never had it): load it again.
            match self.command::<String>(&self.library.load()).await {
                Err(CallError::Other(err)) if already_loaded(&err) => {}
                Err(err) => return Err(err),
                Ok(_) => {}
            }
            result = self.query(&fcall).await;
        }
        if result.is_ok() {
            riding.tickets.clear();
        }
        result
    }

    /// One command, bounded by `op_timeout`, its failure sorted into outage or not.
    async fn query(&self, cmd: &redis::Cmd) -> Result<Value, CallError> {
        self.reachable()?;
        let mut conn = self.conn.live();
        match tokio::time::timeout(self.op_timeout, cmd.query_async(&mut conn)).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(err)) if is_outage(&err) => {
                self.stats.outages.fetch_add(1, Ordering::Relaxed);
                Err(self.outage(err.to_string()))
            }
            Ok(Err(err)) => Err(CallError::Other(backend(err))),
            Err(_) => {
                self.stats.outages.fetch_add(1, Ordering::Relaxed);
                Err(self.outage(format!("no answer within {:?}", self.op_timeout)))
            }
        }
    }

    /// Fails at once while the last attempt to connect failed (asking for another): a call
    /// would wait out `op_timeout` on a connection that cannot answer, and under
    /// `FailOpen` or `LocalShare` every acquire would pay it.
    fn reachable(&self) -> Result<(), CallError> {
        if !self.conn.unreachable() {
            return Ok(());
        }
        self.stats.outages.fetch_add(1, Ordering::Relaxed);
        Err(self.outage("the last attempt to connect failed".into()))
    }

    /// A call failed for lack of Redis: the connection is told (a cluster's is replaced).
    pub(crate) fn outage(&self, message: String) -> CallError {
        self.conn.failed();
        CallError::Outage(message)
    }

    pub(crate) async fn command<T: redis::FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
    ) -> Result<T, CallError> {
        self.reachable()?;
        let mut conn = self.conn.live();
        match tokio::time::timeout(self.op_timeout, cmd.query_async(&mut conn)).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(err)) if is_outage(&err) => Err(self.outage(err.to_string())),
            Ok(Err(err)) => Err(CallError::Other(backend(err))),
            Err(_) => Err(self.outage(format!("no answer within {:?}", self.op_timeout))),
        }
    }
}

/// The riders of a call until it is answered: dropped before that, it hands them to the
/// background retry of releases.
struct Riding<'a> {
    inner: &'a Inner,
    name: &'a str,
    tickets: Vec<u64>,
}

impl Drop for Riding<'_> {
    fn drop(&mut self) {
        if !self.tickets.is_empty() {
            let mut state = self.inner.lock_state();
            for ticket in self.tickets.drain(..) {
                state.orphans.push(self.name, ticket);
            }
        }
    }
}
