//! The `lanes` command.
//!
//! - `lanes demo`: runs short realistic workloads through the library and prints what happened.
//! - `lanes spill check DIR [--repair]`: inspects a spill queue directory.
//! - `lanes serve`: limits over HTTP, with a snapshot, Prometheus metrics and a dashboard.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand};
use lanes_server::ServeOptions;

mod demo;
mod spill;

/// Bounded, fair, observable, durable work admission.
#[derive(Debug, Parser)]
#[command(name = "lanes", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run short realistic workloads through the library, with live progress and final tables.
    Demo(demo::DemoArgs),
    /// Inspect a spill queue directory.
    #[command(subcommand)]
    Spill(spill::SpillCommand),
    /// Serve limits over HTTP (JSON API, /metrics, /v1/snapshot, a dashboard at /).
    Serve(ServeArgs),
}

/// Options of `lanes serve`; flags override the configuration file.
#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// The address to listen on.
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Keep limits in this Redis (`redis://host:port`) so several servers share them.
    #[arg(long)]
    redis: Option<String>,
    /// The Redis namespace of the limits.
    #[arg(long)]
    namespace: Option<String>,
    /// A `lanes.toml`: `listen`, `redis`, `namespace`, and `[limits.NAME]` tables.
    #[arg(long)]
    config: Option<PathBuf>,
    /// The most tickets waiting per limit (more are refused with 429).
    #[arg(long)]
    max_waiters: Option<usize>,
    /// How long a client with no request in flight keeps its queued tickets (default 2000).
    #[arg(long)]
    queue_grace_ms: Option<u64>,
    /// The longest lease a client may ask for; after Redis loses its state, grants wait this
    /// long (default 60000).
    #[arg(long)]
    max_lease_ms: Option<u64>,
}

impl ServeArgs {
    fn options(self) -> Result<ServeOptions, lanes::BoxError> {
        let mut options = match &self.config {
            Some(path) => ServeOptions::from_file(path)?,
            None => ServeOptions::default(),
        };
        if let Some(listen) = self.listen {
            options.listen = listen;
        }
        if self.redis.is_some() {
            options.redis = self.redis;
        }
        if let Some(namespace) = self.namespace {
            options.namespace = namespace;
        }
        if let Some(max_waiters) = self.max_waiters {
            options.max_waiters = max_waiters;
        }
        if let Some(ms) = self.queue_grace_ms {
            options.queue_grace = std::time::Duration::from_millis(ms);
        }
        if let Some(ms) = self.max_lease_ms {
            options.max_lease = std::time::Duration::from_millis(ms);
        }
        options.validate()?;
        Ok(options)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let cli = match cli.command {
        Command::Spill(command) => return spill::run(command),
        other => Cli { command: other },
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("lanes: cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Demo(args) => demo::run(args).await,
            Command::Serve(args) => lanes_server::server::run(args.options()?).await,
            Command::Spill(_) => unreachable!("handled before the runtime starts"),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("lanes: {err}");
            ExitCode::FAILURE
        }
    }
}
