//! Where the limits live: one Redis, or a Redis Cluster. Both are one multiplexed connection
//! that reconnects by itself; the cluster one routes each call to the primary of its key's slot
//! and follows the cluster through failovers.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager};
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
    Single(ConnectionManager),
    Cluster(Arc<Cluster>),
}

/// A cluster connection that is replaced when it stops answering.
///
/// redis-rs' cluster connection can stay stuck after a primary dies: every call, to any slot,
/// times out long after the replica took over (redis-rs/redis-rs#1005, #1528). So a call that
/// fails for lack of Redis asks for a fresh connection (at most one at a time, and not more
/// often than every `RECONNECT_EVERY`); calls use the newest one.
pub(crate) struct Cluster {
    client: ClusterClient,
    conn: Mutex<ClusterConnection>,
    timeout: Duration,
    /// Whether a reconnection is under way, and when the last one started.
    reconnecting: Mutex<(bool, Option<Instant>)>,
}

/// The least time between two reconnections of a cluster connection.
const RECONNECT_EVERY: Duration = Duration::from_millis(250);

impl Conn {
    /// Connects to `nodes`' cluster. `timeout` bounds each attempt to connect.
    pub(crate) async fn cluster(client: ClusterClient, timeout: Duration) -> RedisResult<Self> {
        let conn = client.get_async_connection().await?;
        Ok(Conn::Cluster(Arc::new(Cluster {
            client,
            conn: Mutex::new(conn),
            timeout,
            reconnecting: Mutex::new((false, None)),
        })))
    }

    /// The connection to make a call on.
    pub(crate) fn live(&self) -> Live {
        match self {
            Conn::Single(conn) => Live::Single(conn.clone()),
            Conn::Cluster(cluster) => Live::Cluster(lock(&cluster.conn).clone()),
        }
    }

    /// A call failed for lack of Redis: a cluster connection is replaced in the background.
    /// (A single connection reconnects by itself.)
    pub(crate) fn failed(&self) {
        let Conn::Cluster(cluster) = self else { return };
        {
            let mut reconnecting = lock(&cluster.reconnecting);
            let recent = reconnecting.1.is_some_and(|at| at.elapsed() < RECONNECT_EVERY);
            if reconnecting.0 || recent {
                return;
            }
            *reconnecting = (true, Some(Instant::now()));
        }
        let cluster = cluster.clone();
        tokio::spawn(async move {
            // Cleared however the task ends (a runtime that shuts down drops it mid-way).
            let _done = Reconnected(&cluster);
            let fresh =
                tokio::time::timeout(cluster.timeout, cluster.client.get_async_connection());
            if let Ok(Ok(conn)) = fresh.await {
                *lock(&cluster.conn) = conn;
            }
        });
    }
}

/// Marks a cluster's reconnection over when dropped.
struct Reconnected<'a>(&'a Cluster);

impl Drop for Reconnected<'_> {
    fn drop(&mut self) {
        lock(&self.0.reconnecting).0 = false;
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
