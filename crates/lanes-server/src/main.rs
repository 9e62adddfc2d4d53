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
    Serve(Box<ServeArgs>),
}

/// Options of `lanes serve`. A flag wins over its `LANES_*` environment variable, which wins
/// over the configuration file, which wins over the default shown.
#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// The address to listen on [default: 127.0.0.1:7878].
    #[arg(long, env = "LANES_LISTEN")]
    listen: Option<SocketAddr>,
    /// Keep limits in this Redis (`redis://host:port`) so several servers share them
    /// [default: in this process].
    #[arg(long, env = "LANES_REDIS")]
    redis: Option<String>,
    /// The Redis namespace of the limits [default: lanes].
    #[arg(long, env = "LANES_NAMESPACE")]
    namespace: Option<String>,
    /// A `lanes.toml`: `listen`, `redis`, `namespace`, `[limits.NAME]`, `[[tokens]]` and every
    /// setting below by its name with underscores.
    #[arg(long, env = "LANES_CONFIG")]
    config: Option<PathBuf>,
    /// A file of API tokens (`[[tokens]]` tables: `role`, `token`, `clients`). Tokens are
    /// never given on the command line; `LANES_TOKENS` holds them as `role:secret` or
    /// `client:secret:id1,id2` entries separated by spaces.
    #[arg(long, env = "LANES_TOKENS_FILE")]
    tokens_file: Option<PathBuf>,
    /// Serve without tokens on a non-loopback address: anyone who reaches it may define,
    /// delete and hold every limit.
    #[arg(long, env = "LANES_INSECURE_NO_AUTH")]
    insecure_no_auth: bool,
    /// The `Host` names accepted, comma-separated (`*`: any) [default: on loopback,
    /// localhost and the loopback addresses; elsewhere, any].
    #[arg(long, env = "LANES_ALLOWED_HOSTS", value_delimiter = ',')]
    allowed_hosts: Option<Vec<String>>,
    /// The most limits [default: 10000].
    #[arg(long, env = "LANES_MAX_LIMITS")]
    max_limits: Option<usize>,
    /// The most clients with a session [default: 100000].
    #[arg(long, env = "LANES_MAX_CLIENTS")]
    max_clients: Option<usize>,
    /// The most tickets waiting per limit (more are refused with 429) [default: 10000].
    #[arg(long, env = "LANES_MAX_WAITERS")]
    max_waiters: Option<usize>,
    /// The longest an acquire long-polls [default: 30000].
    #[arg(long, env = "LANES_MAX_WAIT_MS")]
    max_wait_ms: Option<u64>,
    /// The lease of a permit whose acquire names none [default: 10000].
    #[arg(long, env = "LANES_DEFAULT_LEASE_MS")]
    default_lease_ms: Option<u64>,
    /// The longest lease a client may ask for; after Redis loses its state, grants wait this
    /// long [default: 60000].
    #[arg(long, env = "LANES_MAX_LEASE_MS")]
    max_lease_ms: Option<u64>,
    /// How long a client with no request in flight keeps its queued tickets [default: 2000].
    #[arg(long, env = "LANES_QUEUE_GRACE_MS")]
    queue_grace_ms: Option<u64>,
    /// The most bytes of a request body [default: 65536].
    #[arg(long, env = "LANES_MAX_BODY")]
    max_body: Option<usize>,
    /// Access and server logs: `text` or `json` (filter with `RUST_LOG`, default `info`).
    #[arg(long, env = "LANES_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
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
        if let Some(path) = &self.tokens_file {
            options.tokens.extend(ServeOptions::tokens_from_file(path)?);
        }
        if let Ok(text) = std::env::var("LANES_TOKENS") {
            options.tokens.extend(lanes_server::Token::parse_list(&text)?);
        }
        options.insecure_no_auth |= self.insecure_no_auth;
        if let Some(hosts) = self.allowed_hosts {
            options.allowed_hosts = hosts;
        }
        let ms = std::time::Duration::from_millis;
        options.max_limits = self.max_limits.unwrap_or(options.max_limits);
        options.max_clients = self.max_clients.unwrap_or(options.max_clients);
        options.max_waiters = self.max_waiters.unwrap_or(options.max_waiters);
        options.max_wait = self.max_wait_ms.map_or(options.max_wait, ms);
        options.default_lease_ms = self.default_lease_ms.unwrap_or(options.default_lease_ms);
        options.max_lease = self.max_lease_ms.map_or(options.max_lease, ms);
        options.queue_grace = self.queue_grace_ms.map_or(options.queue_grace, ms);
        options.max_body = self.max_body.unwrap_or(options.max_body);
        options.validate()?;
        Ok(options)
    }
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`), as text or JSON lines.
fn init_logs(format: &str) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = if format == "json" { builder.json().try_init() } else { builder.try_init() };
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
            Command::Serve(args) => {
                init_logs(&args.log_format);
                lanes_server::server::run((*args).options()?).await
            }
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
