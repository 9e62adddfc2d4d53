//! The client of `lanes serve`: [`RemoteLimits`], a [`LimitBackend`](lanes::LimitBackend) over
//! its HTTP API, and [`wire`], the bodies of that API (shared with the server, so there is one
//! definition of each).
//!
//! A service uses a shared server exactly like a local [`Limits`](lanes::Limits): the same
//! wait order (priority level, weighted turns between fairness keys, arrival), the same
//! permits, now leased from the server and renewed in the background. `http://` and
//! `https://` servers both work (TLS through rustls, checking the server's certificate against
//! the platform's roots); pass your own [`reqwest::Client`] to
//! [`RemoteLimits::with_http_client`] to trust a private CA, go through a proxy, and so on.
//!
//! This crate pulls no server code: no web framework, no Redis client, no command line.
//!
//! # Example
//!
//! ```no_run
//! use lanes::{LimitSpec, Limits, Priority};
//! use lanes_remote::RemoteLimits;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let limits = Limits::with_backend(RemoteLimits::new("https://limits.internal:7878")?);
//! limits.define("payments-api", LimitSpec::concurrent(10).per_second(100.0)).await?;
//! let permit = limits.acquire("payments-api", Priority::level(1).key("tenant-a")).await?;
//! // ... call the payments API, handing it permit.fencing_token() ...
//! drop(permit); // released on the server
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]

mod client;
mod leased;
pub mod wire;

use std::fmt;

pub use client::RemoteLimits;
pub use leased::EXACT_FOR;
/// The HTTP client underneath, for [`RemoteLimits::with_http_client`].
pub use reqwest;

/// A [`RemoteLimits`] that cannot be made: what was wrong with its settings.
///
/// Converts into [`LimitError::Backend`](lanes::LimitError::Backend), for code that handles
/// every limit error alike.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// The server address is not an `http://` or `https://` URL with a host (and no query,
    /// fragment or credentials).
    InvalidUrl {
        /// The address as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The client id is empty, longer than [`RemoteLimits::MAX_CLIENT_ID`] bytes, or has
    /// control characters.
    InvalidClientId(String),
    /// The HTTP client could not be built (its TLS setup, say).
    Http(String),
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InvalidUrl { url, reason } => {
                write!(f, "lanes serve: {url:?} is not a server URL: {reason}")
            }
            Self::InvalidClientId(client) => write!(
                f,
                "lanes serve: invalid client id {client:?}: a client id is 1 to {} bytes without control characters",
                RemoteLimits::MAX_CLIENT_ID
            ),
            Self::Http(message) => {
                write!(f, "lanes serve: cannot build the HTTP client: {message}")
            }
        }
    }
}

impl std::error::Error for ConfigError {}

impl From<ConfigError> for lanes::LimitError {
    fn from(err: ConfigError) -> Self {
        Self::Backend(lanes::limit::BackendError::with_source(err.to_string(), err))
    }
}
