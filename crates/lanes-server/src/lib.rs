//! The library side of the `lanes` command: the server behind `lanes serve` ([`server`]) and
//! [`RemoteLimits`], a [`LimitBackend`](lanes::LimitBackend) over its HTTP API.
#![forbid(unsafe_code)]

mod remote;
pub mod server;

pub use remote::RemoteLimits;
pub use server::{ServeOptions, Server};
