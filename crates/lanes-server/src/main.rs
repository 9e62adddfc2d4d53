//! The `lanes` command.
//!
//! - `lanes demo`: runs short realistic workloads through the library and prints what happened.
//! - `lanes spill check DIR [--repair]`: inspects a spill queue directory.
//! - `lanes serve`: limits over HTTP, with a snapshot, Prometheus metrics and a dashboard.
#![forbid(unsafe_code)]

use std::process::ExitCode;

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
    /// A `lanes.toml`: `[limits.NAME]` tables, `[[tokens]]` tables, and every setting below
    /// by its name with underscores.
    #[arg(long, env = "LANES_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    settings: lanes_server::Settings,
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
        options.apply(self.settings)?;
        if let Ok(text) = std::env::var("LANES_TOKENS") {
            options.tokens.extend(lanes_server::Token::parse_list(&text)?);
        }
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
