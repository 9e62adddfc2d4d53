//! The `lanes` command.
//!
//! - `lanes demo`: runs short realistic workloads through the library and prints what happened.
//! - `lanes spill check DIR [--repair]`: inspects a spill queue directory.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::{Parser, Subcommand};

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
