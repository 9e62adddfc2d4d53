//! The bodies of the `lanes serve` HTTP API: every request and every answer, defined once for
//! the server and for [`RemoteLimits`](crate::RemoteLimits).
//!
//! Requests deserialize strictly (`deny_unknown_fields`: a misspelt field is a 400 naming it,
//! not silently ignored); answers deserialize leniently, so a client keeps working against a
//! server that adds fields. The fields of an answer appear in the order the server has always
//! sent them (a limit's in [`LimitList`] too, as in [`Limit`]; they used to come out sorted
//! there). `lanes serve`'s OpenAPI document is derived from these types (feature `openapi`).
//!
//! | Endpoint | Request | Answer |
//! |---|---|---|
//! | `GET /v1/limits` | | 200 [`LimitList`] |
//! | `GET /v1/limits/{name}` | | 200 [`Limit`] |
//! | `PUT /v1/limits/{name}` | [`Spec`] | 200 [`Limit`] |
//! | `DELETE /v1/limits/{name}` | | 204 |
//! | `POST /v1/limits/{name}/acquire` | [`AcquireRequest`] | 200 [`Granted`], 202 [`NotYet`], 429 [`TryRefused`] (a try) |
//! | `POST /v1/limits/{name}/release` | [`ReleaseRequest`] | 200 [`ReleaseAnswer`] |
//! | `POST /v1/clients/{client}/renew` | [`RenewRequest`] | 200 [`RenewAnswer`] |
//! | `POST /v1/limits/{name}/share` | [`ShareRefresh`] | 200 [`ShareAnswer`] |
//!
//! Every error (4xx, 5xx) answers an [`ErrorBody`].

use lanes::limit::ShareInfo;
use lanes::limit::ShareReply;
use lanes::limit::share::{Demand, RateDemand, RateLease, ShareLease, SharePolicy, ShareRequest};
use lanes::{LimitInfo, LimitSpec};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The longest limit name (and fairness key) the server accepts, in bytes.
pub const MAX_NAME: usize = 200;

/// The longest client id the server accepts, in bytes.
pub const MAX_CLIENT: usize = 200;

/// `PUT /v1/limits/{name}`: a limit's spec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Spec {
    /// Permits held at once.
    pub concurrent: u32,
    /// Grants per second (`None`, sent as `null`: no rate limit).
    #[serde(default)]
    pub per_second: Option<f64>,
    /// Grants at once after an idle period (`None`: `ceil(per_second)`, at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
    /// `leased`: clients serve the limit from shares of it they hold for a lease (leased
    /// capacity; a server on Redis only). `None` or `exact`: every acquire asks the server —
    /// for a new limit; a leased limit stays leased until it is removed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// How a leased limit is shared: `max_min_fair` (the default) or `proportional`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
}

impl Spec {
    /// The [`LimitSpec`] this body stands for (not yet validated).
    pub fn to_spec(&self) -> LimitSpec {
        let mut spec = LimitSpec::concurrent(self.concurrent);
        if let Some(rate) = self.per_second {
            spec = spec.per_second(rate);
        }
        if let Some(burst) = self.burst {
            spec = spec.burst(burst);
        }
        spec
    }
}

impl From<LimitSpec> for Spec {
    fn from(spec: LimitSpec) -> Self {
        Self {
            concurrent: spec.concurrent,
            per_second: spec.per_second,
            burst: Some(spec.burst),
            mode: None,
            policy: None,
        }
    }
}

/// A limit as the server reports it: its spec and its state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Limit {
    /// The limit's name.
    pub name: String,
    /// Permits held at once.
    pub concurrent: u32,
    /// Grants per second (`null`: no rate limit).
    pub per_second: Option<f64>,
    /// Grants at once after an idle period.
    pub burst: u32,
    /// Permits held now.
    pub in_use: u32,
    /// Tickets waiting.
    pub waiting: u64,
    /// The most permits ever held at once.
    pub max_in_use: u32,
    /// Permits granted since the limit was defined.
    pub granted_total: u64,
    /// `leased:maxmin` or `leased:proportional` for a limit served from clients' shares
    /// (absent: exact, every acquire decided where the limit lives).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// For a leased limit: each client's share and demand (live leases only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shares: Vec<Share>,
}

/// One client's share of a leased limit, in a [`Limit`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Share {
    /// The client, by its id in the limit's ledger.
    pub client: u64,
    /// The most permits it may have out.
    pub share: u32,
    /// The capacity set aside for it (its share, or its permits out where more).
    pub reserved: u32,
    /// The permits it had out at its last refresh.
    pub held: u32,
    /// What it wanted at its last refresh (permits out and waiters).
    pub demand: u32,
    /// For a limit with a rate: its part of the rate, in grants per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_second: Option<f64>,
    /// For a limit with a rate: the rate it wanted, in grants per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_second_demand: Option<f64>,
}

impl From<ShareInfo> for Share {
    fn from(info: ShareInfo) -> Self {
        Self {
            client: info.client,
            share: info.share,
            reserved: info.reserved,
            held: info.held,
            demand: info.demand,
            per_second: info.per_second,
            per_second_demand: info.per_second_demand,
        }
    }
}

impl From<Share> for ShareInfo {
    fn from(share: Share) -> Self {
        let info =
            ShareInfo::new(share.client, share.share, share.reserved, share.held, share.demand);
        match (share.per_second, share.per_second_demand) {
            (Some(rate), demand) => info.with_rate(rate, demand.unwrap_or(0.0)),
            (None, _) => info,
        }
    }
}

impl From<LimitInfo> for Limit {
    fn from(info: LimitInfo) -> Self {
        Self {
            name: info.name,
            concurrent: info.spec.concurrent,
            per_second: info.spec.per_second,
            burst: info.spec.burst,
            in_use: info.in_use,
            waiting: u64::try_from(info.waiting).unwrap_or(u64::MAX),
            max_in_use: info.max_in_use,
            granted_total: info.granted_total,
            mode: info.mode,
            shares: info.shares.into_iter().map(Share::from).collect(),
        }
    }
}

impl From<Limit> for LimitInfo {
    fn from(limit: Limit) -> Self {
        let spec = LimitSpec {
            concurrent: limit.concurrent,
            per_second: limit.per_second,
            burst: limit.burst,
        };
        let info = LimitInfo::new(
            limit.name,
            spec,
            limit.in_use,
            usize::try_from(limit.waiting).unwrap_or(usize::MAX),
            limit.granted_total,
            limit.max_in_use,
        );
        match limit.mode {
            Some(mode) => {
                info.leased(mode, limit.shares.into_iter().map(ShareInfo::from).collect())
            }
            None => info,
        }
    }
}

/// `GET /v1/limits`: every limit, in name order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LimitList {
    /// The limits.
    pub limits: Vec<Limit>,
}

/// `POST /v1/limits/{name}/share`: a client refreshes its share of a leased limit (leased
/// capacity): what it wants, what it has out. Demands are by priority level (0 to 255, the
/// [`Priority`] level clamped to -128..=127 and shifted up by 128).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ShareRefresh {
    /// The client id (1 to [`MAX_CLIENT`] bytes, no control characters).
    pub client: String,
    /// Which instance of the client this is (random per instance): two processes sharing a
    /// client id hold shares of their own.
    #[serde(default)]
    pub instance: u64,
    /// The share's lease (`None`: the server's default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ms: Option<u64>,
    /// This refresh's number, increasing per client and limit: an older one than one applied
    /// is not applied.
    pub seq: u64,
    /// Permits the client has out (handed to its local holders).
    pub held: u32,
    /// Permits it wants, by level: `[[level, permits], ...]`.
    #[serde(default)]
    pub demand: Vec<(u8, u32)>,
    /// A block of this many fencing tokens for its grants (0: none).
    #[serde(default)]
    pub tokens: u64,
    /// The highest fencing token it has handed out (0: none).
    #[serde(default)]
    pub last_token: u64,
    /// Whether it believes it holds a live share.
    #[serde(default)]
    pub believes_held: bool,
    /// For a rate: the part it enforces now, in thousandths of a grant per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_held: Option<u64>,
    /// For a rate: the part it wants, by level, in thousandths of a grant per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_demand: Option<Vec<(u8, u32)>>,
}

/// 200 to a share refresh. `mode` `exact`: the limit is not leased (every acquire asks the
/// server), and the other fields are zero; `stale`: a later refresh of the client was applied
/// already; `leased`: the client's share until its lease ends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ShareAnswer {
    /// `exact`, `stale` or `leased`.
    pub mode: String,
    /// The most permits the client may have out.
    #[serde(default)]
    pub share: u32,
    /// When the share ends, on the server's store's clock (ms since the Unix epoch).
    #[serde(default)]
    pub expires_at_ms: u64,
    /// The first of the fencing tokens reserved for the client's grants.
    #[serde(default)]
    pub tokens_first: u64,
    /// How many tokens were reserved, from `tokens_first`.
    #[serde(default)]
    pub tokens_count: u64,
    /// The client's share had lapsed before this refresh: permits it had out must be reported
    /// lost.
    #[serde(default)]
    pub lapsed: bool,
    /// For a limit with a rate: the client's part, in thousandths of a grant per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_share: Option<u64>,
    /// For a limit with a rate: the whole rate, in thousandths of a grant per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<u64>,
    /// For a limit with a rate: its burst.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
}

impl ShareAnswer {
    /// An answer without a share: `exact` or `stale`.
    pub fn without_share(mode: &str) -> Self {
        Self {
            mode: mode.to_owned(),
            share: 0,
            expires_at_ms: 0,
            tokens_first: 0,
            tokens_count: 0,
            lapsed: false,
            rate_share: None,
            rate_limit: None,
            burst: None,
        }
    }
}

fn demand_of(levels: &[(u8, u32)]) -> Demand {
    levels.iter().fold(Demand::none(), |demand, (level, n)| demand.at(*level, *n))
}

fn levels_of(demand: &Demand) -> Vec<(u8, u32)> {
    demand.levels().collect()
}

impl ShareRefresh {
    /// The body of the refresh `request` of instance `instance` of `client`, for a share
    /// lasting `lease_ms`.
    pub fn new(client: &str, instance: u64, lease_ms: Option<u64>, request: &ShareRequest) -> Self {
        Self {
            client: client.to_owned(),
            instance,
            lease_ms,
            seq: request.seq,
            held: request.held,
            demand: levels_of(&request.demand),
            tokens: request.tokens,
            last_token: request.last_token,
            believes_held: request.believes_held,
            rate_held: request.rate.as_ref().map(|rate| rate.held),
            rate_demand: request.rate.as_ref().map(|rate| levels_of(&rate.demand)),
        }
    }

    /// The request this body stands for (the policy is the limit's own, set at definition).
    pub fn to_request(&self) -> ShareRequest {
        let mut request = ShareRequest::new(
            demand_of(&self.demand),
            self.held,
            SharePolicy::default(),
            self.tokens,
        );
        request.seq = self.seq;
        request.last_token = self.last_token;
        request.believes_held = self.believes_held;
        request.rate = match (self.rate_held, &self.rate_demand) {
            (Some(held), Some(levels)) => Some(RateDemand::new(held, demand_of(levels))),
            (Some(held), None) => Some(RateDemand::new(held, Demand::none())),
            (None, _) => None,
        };
        request
    }
}

impl ShareAnswer {
    /// The answer for `reply`.
    pub fn from_reply(reply: &ShareReply) -> Self {
        match reply {
            ShareReply::Exact => Self::without_share("exact"),
            ShareReply::Stale => Self::without_share("stale"),
            ShareReply::Leased(lease) => Self {
                mode: "leased".to_owned(),
                share: lease.share,
                expires_at_ms: u64::try_from(lease.expires_at.as_millis()).unwrap_or(u64::MAX),
                tokens_first: lease.tokens.start,
                tokens_count: lease.tokens.end - lease.tokens.start,
                lapsed: lease.lapsed,
                rate_share: lease.rate.map(|rate| rate.share),
                rate_limit: lease.rate.map(|rate| rate.limit),
                burst: lease.rate.map(|rate| rate.burst),
            },
        }
    }

    /// The reply this answer stands for; `None` for a mode this client does not know.
    pub fn to_reply(&self) -> Option<ShareReply> {
        match self.mode.as_str() {
            "exact" => Some(ShareReply::Exact),
            "stale" => Some(ShareReply::Stale),
            "leased" => {
                let tokens = self.tokens_first..self.tokens_first.saturating_add(self.tokens_count);
                let expires_at = std::time::Duration::from_millis(self.expires_at_ms);
                let lease = ShareLease::new(self.share, expires_at, tokens).lapsed(self.lapsed);
                Some(ShareReply::Leased(match (self.rate_share, self.rate_limit) {
                    (Some(share), Some(limit)) => {
                        lease.with_rate(RateLease::new(share, limit, self.burst.unwrap_or(1)))
                    }
                    _ => lease,
                }))
            }
            _ => None,
        }
    }
}

/// A waiter's priority, in an [`AcquireRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Priority {
    /// Higher levels are served first (default 0).
    #[serde(default)]
    pub level: i32,
    /// The fairness key: keys take turns within a level (`None`, sent as `null`: a group of
    /// its own). At most [`MAX_NAME`] bytes.
    #[serde(default)]
    pub key: Option<String>,
    /// Permits the key takes per turn, at least 1 (default 1).
    #[serde(default = "one")]
    pub weight: u32,
}

fn one() -> u32 {
    1
}

impl Default for Priority {
    fn default() -> Self {
        Self { level: 0, key: None, weight: 1 }
    }
}

impl Priority {
    /// The [`lanes::Priority`] this body stands for (not yet validated: a weight of 0 counts
    /// as 1 there, and the server refuses it).
    pub fn to_priority(&self) -> lanes::Priority {
        let mut priority = lanes::Priority::level(self.level).weight(self.weight);
        if let Some(key) = &self.key {
            priority = priority.key(key.as_str());
        }
        priority
    }
}

impl From<&lanes::Priority> for Priority {
    fn from(priority: &lanes::Priority) -> Self {
        Self {
            level: priority.level,
            key: priority.fairness_key.as_deref().map(str::to_owned),
            weight: priority.fairness_weight.max(1),
        }
    }
}

/// `POST /v1/limits/{name}/acquire`: a first ask, a look (long-polling up to `wait_ms`), or a
/// try (`"queue": false`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct AcquireRequest {
    /// The client id that owns the ticket (1 to [`MAX_CLIENT`] bytes, no control characters).
    pub client: String,
    /// The client's own ticket number (`None`: the server picks one and answers it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ticket: Option<u64>,
    /// The ticket's priority (used by its first ask only; `None`: the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<Priority>,
    /// The permit's lease (`None`: the server's default; set by the ticket's first ask, as
    /// its priority: later asks of the ticket are granted and renewed with that lease).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ms: Option<u64>,
    /// How long to long-poll (`None`: answer at once; capped by the server).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_ms: Option<u64>,
    /// `Some(false)`: a try, granted now or refused, never leaving a ticket behind (`None`:
    /// `true`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<bool>,
}

/// 200 to an acquire: the ticket holds a permit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Granted {
    /// The permit's fencing token, strictly increasing per limit.
    pub fencing_token: u64,
    #[cfg_attr(feature = "openapi", schema(value_type = bool))]
    granted: Flag<true>,
    /// The permit's lease.
    pub lease_expires_in_ms: u64,
    /// The ticket.
    pub ticket: u64,
}

impl Granted {
    /// A grant of `ticket` (`"granted": true`).
    pub fn new(ticket: u64, fencing_token: u64, lease_expires_in_ms: u64) -> Self {
        Self { fencing_token, granted: Flag, lease_expires_in_ms, ticket }
    }
}

/// Why an acquire was not granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Reason {
    /// Others are served first, or every permit is held: the ticket waits (202).
    Queued,
    /// A try found every permit held, or others waiting (429).
    Busy,
    /// The ticket is served next, but the token bucket has no token yet (a 202's
    /// `retry_after_ms` is when to ask again, at most half the queue grace; a 429's is when
    /// the bucket refills).
    Rate,
}

/// 202 to an acquire: not granted within `wait_ms`; the ticket stays queued if its client asks
/// again within the queue grace. `retry_after_ms` is at most half the grace; the `Retry-After`
/// header is it in whole seconds, rounded down.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NotYet {
    #[cfg_attr(feature = "openapi", schema(value_type = bool))]
    granted: Flag<false>,
    /// [`Reason::Queued`] or [`Reason::Rate`].
    pub reason: Reason,
    /// When to ask again.
    pub retry_after_ms: u64,
    /// The ticket, still queued.
    pub ticket: u64,
}

impl NotYet {
    /// `ticket` waits (`"granted": false`).
    pub fn new(ticket: u64, reason: Reason, retry_after_ms: u64) -> Self {
        Self { granted: Flag, reason, retry_after_ms, ticket }
    }
}

/// 429 to a try (`"queue": false`): refused, and no ticket is left behind. Sent with a
/// `Retry-After` header (whole seconds, at least 1).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TryRefused {
    #[cfg_attr(feature = "openapi", schema(value_type = bool))]
    granted: Flag<false>,
    /// [`Reason::Busy`] or [`Reason::Rate`].
    pub reason: Reason,
    /// When to try again.
    pub retry_after_ms: u64,
}

impl TryRefused {
    /// A refused try (`"granted": false`).
    pub fn new(reason: Reason, retry_after_ms: u64) -> Self {
        Self { granted: Flag, reason, retry_after_ms }
    }
}

/// `POST /v1/limits/{name}/release`: return a permit, or withdraw a queued ticket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ReleaseRequest {
    /// The client id that owns the ticket.
    pub client: String,
    /// The ticket.
    pub ticket: u64,
}

/// 200 to a release.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReleaseAnswer {
    /// Whether the server knew the ticket (held or waiting).
    pub released: bool,
}

/// `POST /v1/clients/{client}/renew`: renew the leases the client holds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RenewRequest {
    /// The tickets to renew (at most [`MAX_RENEW`]). The client's other tickets are not
    /// renewed: their leases run out. A named ticket the server does not hold for the client
    /// is answered lost. Absent (`{}`): every ticket of the client.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tickets: Option<Vec<TicketRef>>,
}

/// The most tickets one [`RenewRequest`] may name.
pub const MAX_RENEW: usize = 100_000;

/// A ticket of a limit, in a [`RenewRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct TicketRef {
    /// Its limit.
    pub limit: String,
    /// Its ticket.
    pub ticket: u64,
}

/// The preference (`Prefer: lanes-unrenewed`) of a renewal that can be told which tickets were
/// left unrenewed ([`RenewAnswer::unrenewed`]) rather than refused as a whole.
pub const PREFER_UNRENEWED: &str = "lanes-unrenewed";

/// 200 to `POST /v1/clients/{client}/renew`: the leases asked for were renewed, except the
/// lost ones and the unrenewed ones.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RenewAnswer {
    /// Permits whose lease had ended (or that the backend lost): their fencing tokens are
    /// stale.
    #[serde(default)]
    pub lost: Vec<LostTicket>,
    /// How many tickets were renewed.
    pub renewed: u64,
    /// Tickets left unrenewed because the backend failed on their limit (a Redis Cluster
    /// primary away, say), while it renewed the others: their leases run on from their last
    /// renewal. Only for a request that says `Prefer: lanes-unrenewed` ([`PREFER_UNRENEWED`]);
    /// any other is answered 503, as is every request when the backend fails on every limit.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unrenewed: Vec<TicketRef>,
}

/// A lost permit, in a [`RenewAnswer`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LostTicket {
    /// Its limit.
    pub limit: String,
    /// Its ticket.
    pub ticket: u64,
}

/// Every error answer: what was wrong, and the field, limit or ticket concerned.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    /// What was wrong.
    pub error: String,
    /// A stable name for the kind of error, for programs: `unauthorized`, `forbidden`,
    /// `too_many_limits`, `too_many_clients`, `too_many_waiters`, `too_many_connections`,
    /// `body_too_large`, `body_timeout`, `headers_too_large`, ... (absent on older errors that
    /// the status already names).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    /// The offending field of the request (400).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// The limit concerned (404, 409, 410, 429, 503).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<String>,
    /// The ticket concerned (409: another client's; 410: finished).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ticket: Option<u64>,
}

impl ErrorBody {
    /// An error naming nothing else.
    pub fn new(error: impl Into<String>) -> Self {
        Self { error: error.into(), code: None, field: None, limit: None, ticket: None }
    }
}

/// The `granted` flag of an acquire answer: always `B` on the wire, and only `B` reads back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Flag<const B: bool>;

impl<const B: bool> Serialize for Flag<B> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bool(B)
    }
}

impl<'de, const B: bool> Deserialize<'de> for Flag<B> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        if bool::deserialize(deserializer)? == B {
            Ok(Self)
        } else {
            Err(serde::de::Error::custom(format_args!("expected \"granted\": {B}")))
        }
    }
}

#[cfg(test)]
mod tests {
    use serde::Serialize;
    use serde::de::DeserializeOwned;

    use super::*;

    /// `value` serializes to exactly `json` (the bytes the server sent before these types, but
    /// for the key order inside a listed limit), and reads back as itself.
    #[track_caller]
    fn round_trip<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(
        value: &T,
        json: &str,
    ) {
        assert_eq!(serde_json::to_string(value).unwrap(), json);
        assert_eq!(&serde_json::from_str::<T>(json).unwrap(), value);
    }

    #[test]
    fn answers_are_the_json_the_server_sends() {
        round_trip(
            &Granted::new(7, 42, 10_000),
            r#"{"fencing_token":42,"granted":true,"lease_expires_in_ms":10000,"ticket":7}"#,
        );
        round_trip(
            &NotYet::new(7, Reason::Queued, 1000),
            r#"{"granted":false,"reason":"queued","retry_after_ms":1000,"ticket":7}"#,
        );
        round_trip(
            &NotYet::new(7, Reason::Rate, 250),
            r#"{"granted":false,"reason":"rate","retry_after_ms":250,"ticket":7}"#,
        );
        // A refused try names no ticket: it left none behind.
        round_trip(
            &TryRefused::new(Reason::Busy, 1000),
            r#"{"granted":false,"reason":"busy","retry_after_ms":1000}"#,
        );
        round_trip(&ReleaseAnswer { released: true }, r#"{"released":true}"#);
        let lost = vec![LostTicket { limit: "db".into(), ticket: 3 }];
        round_trip(
            &RenewAnswer { lost, renewed: 2, unrenewed: vec![] },
            r#"{"lost":[{"limit":"db","ticket":3}],"renewed":2}"#,
        );
        round_trip(
            &RenewAnswer { lost: vec![], renewed: 0, unrenewed: vec![] },
            r#"{"lost":[],"renewed":0}"#,
        );
        round_trip(
            &RenewAnswer {
                lost: vec![],
                renewed: 1,
                unrenewed: vec![TicketRef { limit: "jobs".into(), ticket: 4 }],
            },
            r#"{"lost":[],"renewed":1,"unrenewed":[{"limit":"jobs","ticket":4}]}"#,
        );
        round_trip(&RenewRequest::default(), "{}");
        round_trip(
            &RenewRequest { tickets: Some(vec![TicketRef { limit: "db".into(), ticket: 3 }]) },
            r#"{"tickets":[{"limit":"db","ticket":3}]}"#,
        );
        let limit = Limit {
            name: "db".into(),
            concurrent: 10,
            per_second: None,
            burst: 1,
            in_use: 2,
            waiting: 3,
            max_in_use: 4,
            granted_total: 5,
            mode: None,
            shares: Vec::new(),
        };
        round_trip(
            &limit,
            r#"{"name":"db","concurrent":10,"per_second":null,"burst":1,"in_use":2,"waiting":3,"max_in_use":4,"granted_total":5}"#,
        );
        // Before, the listed limits' keys came out sorted (through a `serde_json::Value`); now in
        // the order of a single limit. The same JSON object either way.
        round_trip(
            &LimitList { limits: vec![Limit { per_second: Some(2.5), ..limit }] },
            r#"{"limits":[{"name":"db","concurrent":10,"per_second":2.5,"burst":1,"in_use":2,"waiting":3,"max_in_use":4,"granted_total":5}]}"#,
        );
    }

    #[test]
    fn share_bodies_carry_a_request_and_a_reply_whole() {
        let demand = Demand::none().at(128, 3).at(200, 1);
        let mut request = ShareRequest::new(demand.clone(), 2, SharePolicy::default(), 64);
        request.seq = 7;
        request.last_token = 99;
        request.believes_held = true;
        request.rate = Some(RateDemand::new(50_000, Demand::none().at(128, 80_000)));
        let body = ShareRefresh::new("me", 5, Some(600), &request);
        round_trip(
            &body,
            r#"{"client":"me","instance":5,"lease_ms":600,"seq":7,"held":2,"demand":[[200,1],[128,3]],"tokens":64,"last_token":99,"believes_held":true,"rate_held":50000,"rate_demand":[[128,80000]]}"#,
        );
        assert_eq!(body.to_request(), request);
        let lease = ShareLease::new(4, std::time::Duration::from_millis(1_000), 10..74)
            .lapsed(true)
            .with_rate(RateLease::new(40_000, 100_000, 10));
        let answer = ShareAnswer::from_reply(&ShareReply::Leased(lease.clone()));
        round_trip(
            &answer,
            r#"{"mode":"leased","share":4,"expires_at_ms":1000,"tokens_first":10,"tokens_count":64,"lapsed":true,"rate_share":40000,"rate_limit":100000,"burst":10}"#,
        );
        assert_eq!(answer.to_reply(), Some(ShareReply::Leased(lease)));
        for reply in [ShareReply::Exact, ShareReply::Stale] {
            assert_eq!(ShareAnswer::from_reply(&reply).to_reply(), Some(reply));
        }
        let leased = Limit {
            mode: Some("leased:maxmin".into()),
            shares: vec![Share::from(ShareInfo::new(1, 2, 3, 2, 5).with_rate(1.5, 2.5))],
            ..Limit::from(LimitInfo::new("db", LimitSpec::concurrent(3), 0, 0, 0, 0))
        };
        let info = LimitInfo::from(leased.clone());
        assert_eq!(info.mode.as_deref(), Some("leased:maxmin"));
        assert_eq!(Limit::from(info), leased);
    }

    #[test]
    fn errors_name_only_what_they_concern() {
        round_trip(&ErrorBody::new("no such endpoint"), r#"{"error":"no such endpoint"}"#);
        round_trip(
            &ErrorBody {
                field: Some("lease_ms".into()),
                ..ErrorBody::new("a lease is 100 to 60000 ms")
            },
            r#"{"error":"a lease is 100 to 60000 ms","field":"lease_ms"}"#,
        );
        round_trip(
            &ErrorBody {
                limit: Some("db".into()),
                ticket: Some(9),
                ..ErrorBody::new("ticket 9 of limit \"db\" belongs to another client")
            },
            r#"{"error":"ticket 9 of limit \"db\" belongs to another client","limit":"db","ticket":9}"#,
        );
    }

    #[test]
    fn the_granted_flag_is_checked() {
        assert!(
            serde_json::from_str::<Granted>(
                r#"{"fencing_token":1,"granted":false,"lease_expires_in_ms":1,"ticket":1}"#
            )
            .is_err()
        );
        assert!(
            serde_json::from_str::<NotYet>(
                r#"{"granted":true,"reason":"queued","retry_after_ms":1,"ticket":1}"#
            )
            .is_err()
        );
    }

    #[test]
    fn requests_are_strict_and_default_what_is_missing() {
        let acquire = AcquireRequest {
            client: "c".into(),
            ticket: Some(5),
            priority: Some(Priority { level: 1, key: None, weight: 2 }),
            lease_ms: Some(10_000),
            wait_ms: None,
            queue: Some(false),
        };
        round_trip(
            &acquire,
            r#"{"client":"c","ticket":5,"priority":{"level":1,"key":null,"weight":2},"lease_ms":10000,"queue":false}"#,
        );
        let minimal: AcquireRequest = serde_json::from_str(r#"{"client":"c"}"#).unwrap();
        assert_eq!(minimal.ticket, None);
        assert_eq!(minimal.queue, None);
        let priority: Priority = serde_json::from_str("{}").unwrap();
        assert_eq!(priority, Priority::default());
        assert!(serde_json::from_str::<AcquireRequest>(r#"{"client":"c","tickets":1}"#).is_err());
        assert!(serde_json::from_str::<Priority>(r#"{"levle":1}"#).is_err());
        assert!(
            serde_json::from_str::<ReleaseRequest>(r#"{"client":"c","ticket":1,"x":0}"#).is_err()
        );
        round_trip(
            &ReleaseRequest { client: "c".into(), ticket: 1 },
            r#"{"client":"c","ticket":1}"#,
        );
        assert!(serde_json::from_str::<Spec>(r#"{"concurrent":1,"rate":2}"#).is_err());
        round_trip(
            &Spec::from(LimitSpec::concurrent(3).per_second(2.5)),
            r#"{"concurrent":3,"per_second":2.5,"burst":3}"#,
        );
        let spec: Spec = serde_json::from_str(r#"{"concurrent":3,"per_second":2.5}"#).unwrap();
        assert_eq!(spec.to_spec(), LimitSpec::concurrent(3).per_second(2.5));
    }
}
