//! The builder of a [`RedisLimits`]: every option, validated when it builds.

// The crate root's private types and imports: this module is one of its impl blocks.
use super::*;

use lanes::{ConfigError, ConfigRule};

/// Builds a [`RedisLimits`].
#[derive(Debug, Clone)]
pub struct RedisLimitsBuilder {
    pub(crate) target: Target,
    pub(crate) namespace: String,
    pub(crate) lease: Duration,
    pub(crate) max_waiters: usize,
    pub(crate) outage: OutagePolicy,
    pub(crate) op_timeout: Duration,
    pub(crate) auto_renew: bool,
    pub(crate) max_lease: Option<Duration>,
    pub(crate) queue_grace: Duration,
    pub(crate) max_limits: usize,
    pub(crate) max_pending_releases: usize,
}

impl RedisLimitsBuilder {
    /// The longest lease any client of the namespace uses (default: this client's lease). After
    /// Redis lost its state, no permit is granted until this long after the loss was seen, so
    /// every lease that could still be believed held has ended first.
    pub fn max_lease(mut self, max_lease: Duration) -> Self {
        self.max_lease = Some(max_lease);
        self
    }

    /// How long a client may go unheard before its queued tickets are dropped from the queues
    /// (default 2 s; the client touches its limits well within it while it lives).
    pub fn queue_grace(mut self, grace: Duration) -> Self {
        self.queue_grace = grace;
        self
    }

    /// Keys and channels are prefixed with `namespace` (default `"lanes"`): clients that share
    /// a namespace share its limits.
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = namespace.into();
        self
    }

    /// How long a permit lasts without a renewal (default 3 s, at least 100 ms).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The most tickets waiting per limit (default 100,000).
    pub fn max_waiters(mut self, max_waiters: usize) -> Self {
        self.max_waiters = max_waiters;
        self
    }

    /// The most limits the namespace may hold when this client defines a new one (default: no
    /// cap). Past it, [`LimitBackend::define`](lanes::LimitBackend::define) of a new name fails
    /// with [`LimitError::TooManyLimits`]; redefining a limit never does. The count and the new
    /// name are checked and registered in one Redis call, so defines at once from any number of
    /// clients cannot pass it together. (A define that fails after that call, on a timeout or
    /// dropped, may leave its name counted, though [`list`](lanes::LimitBackend::list) does
    /// not show it, until it is defined or removed: a removal of a name without a limit
    /// answers [`LimitError::UnknownLimit`] and uncounts it.)
    pub fn max_limits(mut self, max_limits: usize) -> Self {
        self.max_limits = max_limits;
        self
    }

    /// The most releases kept to retry while Redis cannot answer them (default 65,536): the
    /// releases of permits dropped during an outage, and of tries whose answer was lost (under
    /// [`OutagePolicy::FailOpen`] or [`OutagePolicy::LocalShare`], every try during an outage
    /// adds one). Past it the oldest of the limit is abandoned, counted in
    /// [`RedisStats::abandoned_releases`]: Redis frees its permit when the lease ends instead.
    /// Once Redis answers, they are sent in batches (up to 4,096 tickets every quarter of a
    /// second).
    pub fn max_pending_releases(mut self, max: usize) -> Self {
        self.max_pending_releases = max;
        self
    }

    /// What to do when Redis cannot answer (default [`OutagePolicy::FailClosed`]).
    pub fn outage(mut self, policy: OutagePolicy) -> Self {
        self.outage = policy;
        self
    }

    /// The longest any Redis call may take (default 500 ms).
    pub fn op_timeout(mut self, timeout: Duration) -> Self {
        self.op_timeout = timeout;
        self
    }

    /// Whether held permits are renewed in the background (default true). Without it, hold a
    /// permit for less than the lease or call [`RedisLimits::renew`].
    pub fn auto_renew(mut self, auto_renew: bool) -> Self {
        self.auto_renew = auto_renew;
        self
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let bad = |field: &str, rule| Err(ConfigError::new(field, rule));
        if self.lease < Duration::from_millis(100) {
            return bad("lease", ConfigRule::AtLeastTime { min: Duration::from_millis(100) });
        }
        if let OutagePolicy::LocalShare(share) = self.outage {
            if share.is_nan() || share <= 0.0 {
                return bad("outage.local_share", ConfigRule::Positive);
            }
            if share > 1.0 {
                return bad("outage.local_share", ConfigRule::OverMax { max: 1 });
            }
        }
        if self.op_timeout.is_zero() {
            return bad("op_timeout", ConfigRule::ZeroTimeout);
        }
        if self.queue_grace < Duration::from_millis(500) {
            return bad("queue_grace", ConfigRule::AtLeastTime { min: Duration::from_millis(500) });
        }
        // Parsed as `connect` will, without a connection.
        match &self.target {
            Target::Single(url) if redis::Client::open(url.as_str()).is_err() => {
                let must_be = "a redis:// or unix:// address (this build has no TLS)";
                bad("url", ConfigRule::Form { must_be })
            }
            Target::Cluster(nodes) if nodes.is_empty() => bad("nodes", ConfigRule::Missing),
            Target::Cluster(nodes)
                if redis::cluster::ClusterClientBuilder::new(nodes.iter().map(String::as_str))
                    .build()
                    .is_err() =>
            {
                let must_be = "redis:// addresses with the same credentials (no TLS, no sockets)";
                bad("nodes", ConfigRule::Form { must_be })
            }
            _ => Ok(()),
        }
    }

    /// Connects, takes a client id, subscribes to the client's channel and starts the renewal
    /// task. Call inside a tokio runtime.
    ///
    /// # Errors
    ///
    /// [`LimitError::InvalidOptions`] if an option breaks a rule (a lease under 100 ms, a
    /// local share outside `(0, 1]`, a zero op timeout, a queue grace under 500 ms, no node
    /// address, an address that is not Redis's): the error names the setting.
    /// [`LimitError::Backend`] if Redis cannot be reached.
    pub async fn build(self) -> Result<RedisLimits, LimitError> {
        self.validate().map_err(LimitError::InvalidOptions)?;
        let max_lease = self.max_lease.unwrap_or(self.lease).max(self.lease);
        let conn = tokio::time::timeout(self.op_timeout * 4, self.connect())
            .await
            .map_err(|_| LimitError::backend(format!("redis at {} did not answer", self.where_())))?
            .map_err(backend)?;
        // The subscriber may listen on any node: a PUBLISH reaches every node of a cluster.
        let subscribers = self
            .target
            .urls()
            .iter()
            .map(|url| redis::Client::open(url.as_str()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(backend)?;
        let ns = &self.namespace;
        // Client ids come from a counter in Redis. One that is missing (a new namespace, or a
        // Redis that lost it) starts at a random place: clients still running from before a
        // loss keep their ids, and counting again from 1 handed those same ids (and tickets,
        // and pushed grants) to the clients that came after.
        let seed = {
            use std::hash::BuildHasher;
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            std::collections::hash_map::RandomState::new().hash_one(nanos) % (1 << CLIENT_BITS)
        };
        let _: Option<String> = redis::cmd("SET")
            .arg(format!("lanes:{{{ns}}}:clients"))
            .arg(seed)
            .arg("NX")
            .query_async(&mut conn.live())
            .await
            .map_err(backend)?;
        let id: u64 = redis::cmd("INCR")
            .arg(format!("lanes:{{{ns}}}:clients"))
            .query_async(&mut conn.live())
            .await
            .map_err(backend)?;
        let client_id = id % (1 << CLIENT_BITS);
        let epoch = ensure_epoch(&mut conn.live(), &format!("lanes:{{{ns}}}:epoch"))
            .await
            .map_err(backend)?;
        let library = Library::new();
        let loaded: Result<String, _> = library.load().query_async(&mut conn.live()).await;
        match loaded {
            Err(err) if err.to_string().contains("unknown command") => {
                return Err(LimitError::backend(
                    "lanes-redis needs Redis 7.0 or later (Functions)",
                ));
            }
            Err(err) if !crate::wire::already_loaded(&err) => return Err(backend(err)),
            _ => {}
        }
        let inner = Arc::new(Inner {
            conn,
            cluster: self.target.is_cluster(),
            library,
            namespace: self.namespace.clone(),
            channel_prefix: format!("lanes:{ns}:client:"),
            client: client_id,
            next_ticket: AtomicU64::new(1),
            lease: self.lease,
            max_waiters: self.max_waiters,
            outage: self.outage,
            op_timeout: self.op_timeout,
            max_lease,
            queue_grace: self.queue_grace,
            max_limits: self.max_limits,
            auto_renew: self.auto_renew,
            epoch: Mutex::new(None),
            looking: std::sync::atomic::AtomicBool::new(false),
            reuse: Mutex::default(),
            recovering: tokio::sync::Mutex::default(),
            lost: LostLeases::default(),
            state: StateLock::new(tickets::Orphans::new(self.max_pending_releases)),
            local: Arc::new(LocalLimits::with_max_waiters(self.max_waiters)),
            stats: Stats::default(),
            tasks: Mutex::new(Vec::new()),
            me: std::sync::OnceLock::new(),
            runtime: tokio::runtime::Handle::current(),
            leased: std::sync::RwLock::default(),
            ledger_id: ledger_id(),
            share_seq: AtomicU64::new(0),
        });
        let _ = inner.me.set(Arc::downgrade(&inner));
        *lock(&inner.epoch) = Some(epoch);
        let (subscribed_tx, subscribed) = tokio::sync::oneshot::channel();
        let subscriber =
            tokio::spawn(subscribe(subscribers, Arc::downgrade(&inner), subscribed_tx));
        let renewer = tokio::spawn(maintain(Arc::downgrade(&inner), self.auto_renew));
        let watcher = tokio::spawn(watch_leases(Arc::downgrade(&inner)));
        lock(&inner.tasks).extend([subscriber, renewer, watcher]);
        // Waiters are pushed: be listening before the first acquire.
        let _ = tokio::time::timeout(self.op_timeout * 4, subscribed).await;
        Ok(RedisLimits { inner })
    }

    /// The addresses, for messages.
    fn where_(&self) -> String {
        self.target.urls().iter().map(|url| crate::redacted(url)).collect::<Vec<_>>().join(", ")
    }

    /// The connection: to one Redis, or to the cluster its nodes belong to.
    async fn connect(&self) -> Result<Conn, RedisError> {
        match &self.target {
            Target::Single(url) => {
                let client = redis::Client::open(url.as_str())?;
                let config = ConnectionManagerConfig::new()
                    .set_response_timeout(Some(self.op_timeout))
                    .set_connection_timeout(Some(self.op_timeout))
                    .set_number_of_retries(2)
                    .set_max_delay(Duration::from_millis(500));
                Conn::single(client, config, self.op_timeout * 4).await
            }
            Target::Cluster(nodes) => {
                if nodes.is_empty() {
                    return Err(RedisError::from((
                        redis::ErrorKind::InvalidClientConfig,
                        "a cluster needs at least one node address",
                    )));
                }
                // Calls are bounded by `op_timeout` above the client; within it, a call that
                // meets a failover (CLUSTERDOWN, TRYAGAIN, a dead primary) is retried on the
                // refreshed slot map a few times.
                let client =
                    redis::cluster::ClusterClientBuilder::new(nodes.iter().map(String::as_str))
                        .connection_timeout(self.op_timeout)
                        .response_timeout(self.op_timeout)
                        .retries(3)
                        .min_retry_wait(10)
                        .max_retry_wait(100)
                        .build()?;
                Conn::cluster(client, self.op_timeout * 4).await
            }
        }
    }
}

/// A random identity for leased ledgers, below 2^53 (exact in Lua's numbers).
fn ledger_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(nanos);
    hasher.write_u32(std::process::id());
    (hasher.finish() >> 11).max(1)
}
