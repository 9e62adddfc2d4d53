//! The library side of the `lanes` command: the server behind `lanes serve` ([`server`]).
//!
//! Its client, [`lanes_remote::RemoteLimits`] (a [`LimitBackend`](lanes::LimitBackend) over the
//! HTTP API), lives in the `lanes-remote` crate, with the API's bodies
//! ([`lanes_remote::wire`]), which this server uses too: depend on `lanes-remote` for the
//! client alone, without the server's dependencies.
#![forbid(unsafe_code)]

pub mod embed;
pub mod server;

/// The client of `lanes serve`, re-exported from [`lanes_remote`] (use it from there).
pub use lanes_remote::RemoteLimits;
pub use server::{Role, ServeOptions, Server, Settings, TlsFiles, Token};
