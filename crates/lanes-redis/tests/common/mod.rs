//! Shared by the lanes-redis tests: the Redis under test, unique namespaces, cleanup, and a
//! dedicated `redis-server` for tests that stop it.
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
    builder(ns).build().await.unwrap_or_else(|e| {
        panic!(
            "Redis is not reachable at {} ({e}); start it (bash scripts/services.sh) or set REDIS_URL",
            redis_url()
        )
    })
}

/// Deletes every key of `ns` on the Redis at `url`.
pub async fn cleanup_at(url: &str, ns: &str) {
    let Ok(client) = redis::Client::open(url) else { return };
    let Ok(mut conn) = client.get_multiplexed_async_connection().await else { return };
    for pattern in [format!("{{{ns}:*"), format!("lanes:{{{ns}}}:*")] {
        let keys: Vec<String> =
            redis::cmd("KEYS").arg(&pattern).query_async(&mut conn).await.unwrap_or_default();
        if !keys.is_empty() {
            let _: Result<(), _> = redis::cmd("DEL").arg(keys).query_async(&mut conn).await;
        }
    }
}

pub async fn cleanup(ns: &str) {
    cleanup_at(&redis_url(), ns).await;
}

/// Removes a namespace's keys when dropped (also when a test fails).
pub struct Cleanup(pub String);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let ns = self.0.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(cleanup(&ns));
        })
        .join();
    }
}

/// A `redis-server` of our own on an ephemeral port, for tests that stop and restart it.
pub struct DedicatedRedis {
    pub port: u16,
    child: Option<Child>,
}

impl DedicatedRedis {
    pub fn start() -> Self {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut redis = Self { port, child: None };
        redis.restart();
        redis
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts the server (again) on the same port and waits until it answers.
    pub fn restart(&mut self) {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", "no", "--protected-mode", "no"])
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
    }
}
