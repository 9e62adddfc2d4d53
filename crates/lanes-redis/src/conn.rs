//! Where the limits live: one Redis, or a Redis Cluster. Both are one multiplexed connection,
//! replaced when calls stop being answered; the cluster one routes each call to the primary of
//! its key's slot and follows the cluster through failovers.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures_util::future::BoxFuture;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, RedisResult, Value};
use tokio::time::Instant;

/// The addresses a client was given.
#[derive(Debug, Clone)]
pub(crate) enum Target {
    /// One Redis (`redis://host:port/db`).
    Single(String),
    /// A Redis Cluster, by some of its nodes (the rest are discovered).
    Cluster(Vec<String>),
}

impl Target {
    /// Every address given, for messages and for the subscriber (which may use any node: a
    /// PUBLISH reaches every node of a cluster).
    pub(crate) fn urls(&self) -> &[String] {
        match self {
            Target::Single(url) => std::slice::from_ref(url),
            Target::Cluster(nodes) => nodes,
        }
    }

    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self, Target::Cluster(_))
    }
}

/// The connection of a client: cloned per call ([`Conn::live`]).
#[derive(Clone)]
pub(crate) enum Conn {
    Single(Arc<Replaceable<ConnectionManager>>),
    Cluster(Arc<Replaceable<ClusterConnection>>),
}

/// Makes a fresh connection.
type Dial<C> = Box<dyn Fn() -> BoxFuture<'static, RedisResult<C>> + Send + Sync>;

/// A connection that is replaced when it stops answering.
///
/// Neither of redis-rs' connections gets out of every such state by itself. The cluster one
/// can stay stuck after a primary dies: every call, to any slot, times out long after the
/// replica took over (redis-rs/redis-rs#1005, #1528). The single one reconnects only on the
/// errors it counts as fatal: not on calls that go unanswered (a half-open connection: a host
/// that died, a partition, a dropped NAT entry, until the kernel gives up after about 15
/// minutes), nor on `READONLY` (a failover behind one address that left it on the demoted
/// primary); and each call here is bounded from outside, so it may not even see its own
/// timeout. So a call that fails for lack of Redis asks for a fresh connection (at most one
/// at a time, and not more often than every `RECONNECT_EVERY`); calls use the newest one.
///
/// While the last attempt to connect failed, Redis is known to be away: calls fail at once
/// ([`Conn::unreachable`]) instead of each waiting out its timeout on a connection that
/// cannot answer, and each asks for another attempt, so the first that succeeds ends it.
pub(crate) struct Replaceable<C> {
    conn: Mutex<C>,
    dial: Dial<C>,
    /// Bounds each attempt to connect.
    timeout: Duration,
    /// Whether a reconnection is under way, and when the last one started.
    reconnecting: Mutex<(bool, Option<Instant>)>,
    /// The last attempt to connect failed (and none succeeded since).
    unreachable: AtomicBool,
}

/// The least time between two reconnections.
const RECONNECT_EVERY: Duration = Duration::from_millis(250);

impl<C: ConnectionLike + Clone + Send + 'static> Replaceable<C> {
    fn new(conn: C, dial: Dial<C>, timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            conn: Mutex::new(conn),
            dial,
            timeout,
            reconnecting: Mutex::new((false, None)),
            unreachable: AtomicBool::new(false),
        })
    }

    /// A call failed for lack of Redis: the connection is replaced in the background.
    fn failed(self: &Arc<Self>) {
        {
            let mut reconnecting = lock(&self.reconnecting);
            let recent = reconnecting.1.is_some_and(|at| at.elapsed() < RECONNECT_EVERY);
            if reconnecting.0 || recent {
                return;
            }
            *reconnecting = (true, Some(Instant::now()));
        }
        let this = self.clone();
        tokio::spawn(async move {
            // Cleared however the task ends (a runtime that shuts down drops it mid-way).
            let _done = Reconnected(&this.reconnecting);
            match tokio::time::timeout(this.timeout, (this.dial)()).await {
                Ok(Ok(conn)) => {
                    *lock(&this.conn) = conn;
                    this.unreachable.store(false, Ordering::Release);
                }
                _ => {
                    // Away only if the connection in use does not answer either: a new one
                    // may be refused for reasons the open one does not share (Redis at its
                    // most clients, a password rotated), and the failed call may only have
                    // been slow.
                    let mut current = lock(&this.conn).clone();
                    let ping = redis::cmd("PING");
                    let ping = ping.query_async::<Value>(&mut current);
                    let answers =
                        matches!(tokio::time::timeout(this.timeout / 4, ping).await, Ok(Ok(_)));
                    this.unreachable.store(!answers, Ordering::Release);
                }
            }
        });
    }
}

impl Conn {
    /// Connects to one Redis through `client`.
    pub(crate) async fn single(
        client: redis::Client,
        config: ConnectionManagerConfig,
        timeout: Duration,
    ) -> RedisResult<Self> {
        let conn = ConnectionManager::new_with_config(client.clone(), config.clone()).await?;
        let dial: Dial<ConnectionManager> = Box::new(move || {
            let (client, config) = (client.clone(), config.clone());
            Box::pin(async move { ConnectionManager::new_with_config(client, config).await })
        });
        Ok(Conn::Single(Replaceable::new(conn, dial, timeout)))
    }

    /// Connects to `nodes`' cluster. `timeout` bounds each attempt to connect.
    pub(crate) async fn cluster(client: ClusterClient, timeout: Duration) -> RedisResult<Self> {
        let conn = client.get_async_connection().await?;
        let dial: Dial<ClusterConnection> = Box::new(move || {
            let client = client.clone();
            Box::pin(async move { client.get_async_connection().await })
        });
        Ok(Conn::Cluster(Replaceable::new(conn, dial, timeout)))
    }

    /// The connection to make a call on.
    pub(crate) fn live(&self) -> Live {
        match self {
            Conn::Single(single) => Live::Single(lock(&single.conn).clone()),
            Conn::Cluster(cluster) => Live::Cluster(lock(&cluster.conn).clone()),
        }
    }

    /// Whether the last attempt to connect to one Redis failed: it is away, and a call would
    /// only wait out its timeout. Never for a cluster: one attempt to reach a cluster says
    /// nothing of the primary of a given limit, and calls to the healthy ones (renewals above
    /// all) must go on while another is away.
    pub(crate) fn unreachable(&self) -> bool {
        match self {
            Conn::Single(single) => single.unreachable.load(Ordering::Acquire),
            Conn::Cluster(_) => false,
        }
    }

    /// A call failed for lack of Redis: the connection is replaced in the background.
    pub(crate) fn failed(&self) {
        match self {
            Conn::Single(single) => single.failed(),
            Conn::Cluster(cluster) => cluster.failed(),
        }
    }
}

/// Marks a reconnection over when dropped.
struct Reconnected<'a>(&'a Mutex<(bool, Option<Instant>)>);

impl Drop for Reconnected<'_> {
    fn drop(&mut self) {
        lock(self.0).0 = false;
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One call's connection.
pub(crate) enum Live {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Live {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Live::Single(conn) => conn.req_packed_command(cmd),
            Live::Cluster(conn) => conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Live::Single(conn) => conn.req_packed_commands(pipeline, offset, count),
            Live::Cluster(conn) => conn.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Live::Single(conn) => conn.get_db(),
            Live::Cluster(conn) => conn.get_db(),
        }
    }
}
