//! Shared by the lanes-redis tests: the Redis and the Redis Cluster under test, unique
//! namespaces, cleanup, and a dedicated `redis-server` for tests that stop it.
#![allow(dead_code, unreachable_pub)] // each test binary uses part of this module

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lanes_redis::{RedisLimits, RedisLimitsBuilder};

/// `REDIS_URL`, default `redis://127.0.0.1:6379`.
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// Where a test's limits live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The one Redis at `REDIS_URL`.
    Single,
    /// The Redis Cluster at `REDIS_CLUSTER_URLS` (started by `bash scripts/services.sh --cluster`).
    Cluster,
}

/// `REDIS_CLUSTER_URLS` (comma-separated), default the six local nodes on ports 7000-7005.
pub fn cluster_urls() -> Vec<String> {
    match std::env::var("REDIS_CLUSTER_URLS") {
        Ok(urls) => urls.split(',').map(|u| u.trim().to_owned()).collect(),
        Err(_) => (7000..7006).map(|port| format!("redis://127.0.0.1:{port}")).collect(),
    }
}

/// Every address of `target`.
pub fn urls(target: Target) -> Vec<String> {
    match target {
        Target::Single => vec![redis_url()],
        Target::Cluster => cluster_urls(),
    }
}

/// A builder on `target`.
pub fn builder_on(target: Target, ns: &str) -> RedisLimitsBuilder {
    match target {
        Target::Single => builder(ns),
        Target::Cluster => RedisLimits::cluster_builder(cluster_urls()).namespace(ns),
    }
}

/// A client on `target`, failing clearly when it is not there.
pub async fn client_on(target: Target, ns: &str) -> RedisLimits {
    builder_on(target, ns).build().await.unwrap_or_else(|e| {
        panic!(
            "Redis ({target:?}) is not reachable at {} ({e}); start it (bash scripts/services.sh \
             --cluster) or set REDIS_URL / REDIS_CLUSTER_URLS",
            urls(target).join(", ")
        )
    })
}

/// A namespace no other test (or run) uses.
pub fn unique_ns(test: &str) -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("t-{test}-{}-{nanos}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::SeqCst))
}

/// A builder on the shared Redis, failing clearly when it is not there.
pub fn builder(ns: &str) -> RedisLimitsBuilder {
    RedisLimits::builder(redis_url()).namespace(ns)
}

pub async fn client(ns: &str) -> RedisLimits {
    client_on(Target::Single, ns).await
}

/// Deletes every key of `ns` on the Redis at `url` (on a cluster node: the keys of its slots;
/// a replica refuses the deletion, its primary does it).
pub async fn cleanup_at(url: &str, ns: &str) {
    let Ok(client) = redis::Client::open(url) else { return };
    let Ok(mut conn) = client.get_multiplexed_async_connection().await else { return };
    for pattern in [format!("{{{ns}:*"), format!("lanes:{{{ns}}}:*")] {
        let keys: Vec<String> =
            redis::cmd("KEYS").arg(&pattern).query_async(&mut conn).await.unwrap_or_default();
        // One key per DEL: on a cluster node the keys may be in different slots.
        for key in keys {
            let _: Result<(), _> = redis::cmd("DEL").arg(key).query_async(&mut conn).await;
        }
    }
}

pub async fn cleanup(ns: &str) {
    cleanup_at(&redis_url(), ns).await;
}

/// Removes a namespace's keys when dropped (also when a test fails).
pub struct Cleanup {
    ns: String,
    target: Target,
}

impl Cleanup {
    pub fn on(target: Target, ns: &str) -> Self {
        Self { ns: ns.to_owned(), target }
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let (ns, urls) = (self.ns.clone(), urls(self.target));
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                for url in urls {
                    cleanup_at(&url, &ns).await;
                }
            });
        })
        .join();
    }
}

/// A `redis-server` of our own on an ephemeral port, for tests that stop and restart it.
pub struct DedicatedRedis {
    pub port: u16,
    child: Option<Child>,
    /// Where it keeps its snapshot ([`save`](Self::save)), loaded again on a restart.
    dir: Option<std::path::PathBuf>,
}

impl DedicatedRedis {
    pub fn start() -> Self {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut redis = Self { port, child: None, dir: None };
        redis.restart();
        redis
    }

    /// A server that loads, on every restart, the snapshot last taken by [`save`](Self::save)
    /// (it takes none by itself).
    pub fn start_with_snapshots() -> Self {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let dir =
            std::env::temp_dir().join(format!("lanes-redis-rdb-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut redis = Self { port, child: None, dir: Some(dir) };
        redis.restart();
        redis
    }

    /// Takes a snapshot now (`SAVE`).
    pub fn save(&self) {
        let client = redis::Client::open(self.url()).unwrap();
        let mut conn = client.get_connection().unwrap();
        let _: String = redis::cmd("SAVE").query(&mut conn).unwrap();
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts the server (again) on the same port and waits until it answers.
    pub fn restart(&mut self) {
        let mut command = Command::new("redis-server");
        command
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", "no", "--protected-mode", "no"]);
        if let Some(dir) = &self.dir {
            command.arg("--dir").arg(dir).args(["--dbfilename", "dump.rdb"]);
        }
        let child = command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is installed (the outage tests run their own)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(client) = redis::Client::open(self.url())
                && let Ok(mut conn) = client.get_connection()
                && redis::cmd("PING").query::<String>(&mut conn).is_ok()
            {
                return;
            }
            assert!(Instant::now() < deadline, "the dedicated redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the server and starts it again late in a second of the wall clock, then waits
    /// until that second has passed: the server's `uptime_in_seconds`, the difference of two
    /// whole-second clocks, then reads 1 though it has run for a few milliseconds.
    pub fn restart_late_in_a_second(&mut self) {
        let second = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
        for _ in 0..20 {
            while !(900..920).contains(&second().subsec_millis()) {
                std::thread::sleep(Duration::from_millis(1));
            }
            let started_in = second().as_secs();
            self.stop();
            self.restart();
            let now = second();
            if now.as_secs() == started_in {
                // Into the next second, and past it by a little.
                std::thread::sleep(Duration::from_nanos(u64::from(
                    1_000_000_000 - now.subsec_nanos(),
                )));
                std::thread::sleep(Duration::from_millis(20));
                return;
            }
        }
        panic!("the dedicated redis-server took most of a second to start, twenty times");
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing is answered.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws a [`pause`](Self::pause)d server (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("the server runs").id().to_string();
        let status = Command::new("kill").args([signal, &pid]).status().expect("kill runs");
        assert!(status.success(), "kill {signal} {pid}");
    }

    /// Kills the server (SIGKILL: nothing is saved).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for DedicatedRedis {
    fn drop(&mut self) {
        self.stop();
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A Redis Cluster of our own (three primaries with a replica each, on free loopback ports),
/// for tests that kill its nodes.
pub struct DedicatedCluster {
    pub ports: Vec<u16>,
    dir: std::path::PathBuf,
    children: Vec<Option<Child>>,
}

impl DedicatedCluster {
    pub fn start() -> Self {
        let dir = std::env::temp_dir().join(format!("lanes-cluster-{}", unique_ns("c")));
        let mut ports = Vec::new();
        while ports.len() < 6 {
            // The cluster bus listens on port + 10000: both must be free.
            let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            if port < 50_000
                && !ports.contains(&port)
                && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok()
            {
                ports.push(port);
            }
        }
        let mut children = Vec::new();
        for port in &ports {
            let node_dir = dir.join(port.to_string());
            std::fs::create_dir_all(&node_dir).unwrap();
            let child = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", ""])
                .args(["--appendonly", "no", "--protected-mode", "no"])
                .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"])
                .args(["--cluster-config-file", "nodes.conf"])
                .arg("--dir")
                .arg(&node_dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server is installed (the cluster tests run their own)");
            children.push(Some(child));
        }
        let cluster = Self { ports, dir, children };
        for port in &cluster.ports {
            cluster.wait(*port, |conn| redis::cmd("PING").query::<String>(conn).is_ok());
        }
        let nodes: Vec<String> = cluster.ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let created = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&nodes)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli is installed");
        assert!(created.status.success(), "{}", String::from_utf8_lossy(&created.stdout));
        for port in &cluster.ports {
            cluster.wait(*port, |conn| {
                let info: String =
                    redis::cmd("CLUSTER").arg("INFO").query(conn).unwrap_or_default();
                let role: String =
                    redis::cmd("INFO").arg("replication").query(conn).unwrap_or_default();
                info.contains("cluster_state:ok")
                    && (role.contains("role:master") || role.contains("master_link_status:up"))
            });
        }
        cluster
    }

    fn wait(&self, port: u16, ready: impl Fn(&mut redis::Connection) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(client) = redis::Client::open(format!("redis://127.0.0.1:{port}"))
                && let Ok(mut conn) = client.get_connection()
                && ready(&mut conn)
            {
                return;
            }
            assert!(Instant::now() < deadline, "cluster node {port} did not get ready");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn urls(&self) -> Vec<String> {
        self.ports.iter().map(|port| format!("redis://127.0.0.1:{port}")).collect()
    }

    /// A plain connection to the node on `port`.
    pub fn node(&self, port: u16) -> redis::Connection {
        redis::Client::open(format!("redis://127.0.0.1:{port}")).unwrap().get_connection().unwrap()
    }

    /// The port of the primary that serves `key`'s slot, as the node on `ask` sees it.
    pub fn primary_of(&self, ask: u16, key: &str) -> u16 {
        let mut conn = self.node(ask);
        let slot: i64 = redis::cmd("CLUSTER").arg("KEYSLOT").arg(key).query(&mut conn).unwrap();
        let nodes: String = redis::cmd("CLUSTER").arg("NODES").query(&mut conn).unwrap();
        for line in nodes.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if !fields[2].contains("master") || fields[2].contains("fail") {
                continue;
            }
            for range in &fields[8..] {
                let (lo, hi) = range.split_once('-').unwrap_or((range, range));
                if let (Ok(lo), Ok(hi)) = (lo.parse::<i64>(), hi.parse::<i64>())
                    && (lo..=hi).contains(&slot)
                {
                    let addr = fields[1].split('@').next().unwrap();
                    return addr.rsplit(':').next().unwrap().parse().unwrap();
                }
            }
        }
        panic!("no primary serves slot {slot}");
    }

    /// The port of the replica of the primary on `primary`.
    pub fn replica_of(&self, primary: u16) -> u16 {
        let mut conn = self.node(primary);
        let id: String = redis::cmd("CLUSTER").arg("MYID").query(&mut conn).unwrap();
        let nodes: String = redis::cmd("CLUSTER").arg("NODES").query(&mut conn).unwrap();
        let line = nodes
            .lines()
            .find(|line| line.split_whitespace().nth(3) == Some(id.as_str()))
            .expect("the primary has a replica");
        let addr = line.split_whitespace().nth(1).unwrap().split('@').next().unwrap();
        addr.rsplit(':').next().unwrap().parse().unwrap()
    }

    /// Cuts the replication link of the primary on `primary` for good: its replica can no
    /// longer authenticate to it, and its link is dropped. What the primary writes from now
    /// on is lost if its replica takes over.
    pub fn cut_replication(&self, primary: u16) {
        let mut replica = self.node(self.replica_of(primary));
        for (key, value) in [("masteruser", "lanes-nobody"), ("masterauth", "nope")] {
            let _: () =
                redis::cmd("CONFIG").arg("SET").arg(key).arg(value).query(&mut replica).unwrap();
        }
        let _: i64 = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("replica")
            .query(&mut self.node(primary))
            .unwrap();
    }

    /// Kills the node on `port` (SIGKILL: nothing is saved).
    pub fn kill(&mut self, port: u16) {
        let index = self.ports.iter().position(|p| *p == port).expect("a node of this cluster");
        if let Some(mut child) = self.children[index].take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for DedicatedCluster {
    fn drop(&mut self) {
        for child in self.children.iter_mut().filter_map(Option::take) {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs `scenario` on a thread of its own and fails if it has not ended within 30 s: a
/// deadlock fails the test instead of hanging the run.
pub fn ends_in_time(what: &str, scenario: impl FnOnce() + Send + 'static) {
    use std::sync::mpsc::RecvTimeoutError;
    let (done, ended) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        scenario();
        let _ = done.send(());
    });
    match ended.recv_timeout(Duration::from_secs(30)) {
        Ok(()) => {}
        Err(RecvTimeoutError::Timeout) => panic!("{what}: still running after 30 s (deadlocked)"),
        Err(RecvTimeoutError::Disconnected) => panic!("{what}: panicked"),
    }
}
