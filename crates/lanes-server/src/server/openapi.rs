//! The OpenAPI document, derived from the handlers' annotations and the wire types' schemas
//! (`lanes_remote::wire`, the same types the handlers answer with), so it cannot drift from
//! what the server does. The checked-in `openapi.json` is this document; a test keeps them
//! equal.

use lanes_remote::wire;
use serde::Serialize;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{ContentBuilder, RefOr, ResponseBuilder};
use utoipa::{Modify, OpenApi, ToSchema};

use super::api;

/// `GET /healthz`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Health {
    /// Always `ok`.
    pub(crate) status: &'static str,
}

/// `GET /readyz`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Ready {
    /// Always `ready`.
    pub(crate) status: &'static str,
    /// `embedded` or `redis`.
    pub(crate) backend: &'static str,
}

/// The server's own part of `GET /v1/snapshot`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ServerInfo {
    /// Clients with a session.
    pub(crate) clients: usize,
    /// `embedded` or `redis`.
    pub(crate) backend: &'static str,
    /// The first 200 clients by id.
    pub(crate) client_list: Vec<super::sessions::ClientInfo>,
}

/// `GET /v1/snapshot`: the `lanes` registry snapshot (every registered primitive by kind and
/// name, the server's limits under `limits.server`), and the server's own figures.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct SnapshotAnswer {
    /// The registry snapshot's sections (`lanes`, `limits`, `pools`, `channels`, `spill`...).
    #[serde(flatten)]
    #[schema(value_type = Object)]
    pub(crate) registry: lanes::Snapshot,
    /// The server's own figures.
    pub(crate) server: ServerInfo,
}

/// A 429 to an acquire: a refused try, or too many waiters (an error).
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
#[allow(dead_code)] // a schema only: the handler answers either body directly
pub(crate) enum TooMany {
    /// A refused try (`"queue": false`): `reason` `busy` or `rate`.
    Try(wire::TryRefused),
    /// Too many waiters on the limit, or (`code` `too_many_clients`) too many clients.
    Error(wire::ErrorBody),
}

/// The document.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "lanes serve",
        description = "Limits over HTTP: a counting semaphore and a token bucket per limit in front \
            of a fair wait queue (priority level, then weighted turns between fairness keys, then \
            arrival). Permits are leases held by clients; a client renews every lease it holds with \
            one request. A queued ticket nobody asks about for the queue grace is withdrawn, and a \
            permit ends with its lease unless renewed. With API tokens, every endpoint but `/`, `/healthz` \
            and `/readyz` needs `Authorization: Bearer`: `read` may GET, `client` may also acquire, \
            release and renew as its bound client ids, `admin` may do everything."
    ),
    paths(
        api::list,
        api::get,
        api::define,
        api::remove,
        api::acquire,
        api::release,
        api::share,
        api::renew,
        api::snapshot,
        api::metrics,
        api::healthz,
        api::readyz,
        api::openapi,
        api::dashboard,
    ),
    components(schemas(wire::ErrorBody, wire::LostTicket)),
    modifiers(&Common),
)]
pub(crate) struct ApiDoc;

/// What every operation may answer whatever it is (auth, browser guards, transport bounds),
/// and the bearer scheme.
struct Common;

impl Modify for Common {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
        let error = |description: &str| {
            let schema = RefOr::Ref(utoipa::openapi::Ref::from_schema_name("ErrorBody"));
            ResponseBuilder::new()
                .description(description)
                .content("application/json", ContentBuilder::new().schema(Some(schema)).build())
                .build()
        };
        let common = [
            ("401", "No token, or an unknown one (code `unauthorized`)."),
            (
                "403",
                "The token's role or client ids do not allow it (`forbidden`), a foreign \
                     Origin (`cross_origin`) or Host (`host_not_allowed`).",
            ),
            ("408", "The body did not arrive within the body timeout (`body_timeout`)."),
            ("413", "The body is larger than the body limit (`body_too_large`)."),
            ("415", "A POST or PUT that is not `application/json`."),
            (
                "431",
                "A request head larger than `--max-header-bytes` (16 KiB by default): `headers_too_large` (past twice the bound, at least 8 KiB, or past 100 header fields, an empty 431 from the HTTP layer).",
            ),
        ];
        for item in openapi.paths.paths.values_mut() {
            let operations = [&mut item.get, &mut item.put, &mut item.post, &mut item.delete];
            for operation in operations.into_iter().flatten() {
                for (status, description) in common {
                    operation
                        .responses
                        .responses
                        .entry(status.to_owned())
                        .or_insert_with(|| RefOr::T(error(description)));
                }
            }
        }
    }
}

/// The document as pretty JSON (what `GET /openapi.json` answers).
pub(crate) fn document() -> &'static str {
    static DOCUMENT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    DOCUMENT.get_or_init(|| {
        let mut json = ApiDoc::openapi().to_pretty_json().expect("the document serializes");
        json.push('\n');
        json
    })
}
