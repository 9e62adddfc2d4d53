//! `lanes spill check DIR [--repair]`: what a spill queue directory holds, and what recovery
//! would discard.

use std::path::PathBuf;
use std::process::ExitCode;

use lanes::spill::{self, CheckReport, SpillError};

/// Options of `lanes spill`.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum SpillCommand {
    /// Report segments, records, bytes, the committed position and any corruption, without
    /// changing anything (unless --repair). Exits 0 when clean, 3 when something is corrupt
    /// or lost and not repaired (with --repair: when the repaired directory still does not
    /// check clean, as when segments are missing), 1 on errors.
    Check {
        /// The queue's directory.
        dir: PathBuf,
        /// Truncate torn tails and drop foreign or acknowledged segments, as opening would.
        #[arg(long)]
        repair: bool,
        /// Accepted for compatibility and ignored: every frame that passes its two checksums is
        /// a record, whatever `max_record` it was written under, so a repair never drops one.
        #[arg(long, default_value_t = 8 << 20)]
        max_record: u32,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
}

pub(crate) fn run(command: SpillCommand) -> ExitCode {
    let SpillCommand::Check { dir, repair, max_record, json } = command;
    let result =
        if repair { spill::repair(&dir, max_record) } else { spill::check(&dir, max_record) };
    match result {
        Ok(report) => {
            if json {
                println!("{}", serde_json::to_string_pretty(&report).unwrap_or_default());
            } else {
                print!("{}", describe(&dir, &report, repair));
            }
            if !repair {
                return if report.is_clean() { ExitCode::SUCCESS } else { ExitCode::from(3) };
            }
            // What a repair cannot undo (a lost segment, a segment that lost its end, an
            // entry that is no file) is said, and exits 3: as the repair found it, and as the
            // directory still shows it after the repair.
            let lost = report.missing_segments > 0
                || report.truncated_inside > 0
                || !report.not_files.is_empty();
            match spill::check(&dir, max_record) {
                Ok(after) if after.is_clean() && !lost => ExitCode::SUCCESS,
                Ok(after) if after.is_clean() => {
                    if !json {
                        println!("records were lost (above): the repair cannot bring them back");
                    }
                    ExitCode::from(3)
                }
                Ok(after) => {
                    if json {
                        eprintln!(
                            "lanes spill check: the repaired directory still does not check clean"
                        );
                    } else {
                        print!("after the repair, still:\n{}", describe(&dir, &after, false));
                    }
                    ExitCode::from(3)
                }
                Err(err) => {
                    eprintln!("lanes spill check: {}", explain(&err));
                    ExitCode::FAILURE
                }
            }
        }
        Err(err) => {
            eprintln!("lanes spill check: {}", explain(&err));
            ExitCode::FAILURE
        }
    }
}

fn explain(err: &SpillError) -> String {
    match err {
        SpillError::Locked => {
            "the queue is open in another process (it holds the directory's LOCK); stop it first"
                .to_owned()
        }
        SpillError::NotADirectory(path) => {
            format!("{path} is not a directory: give the queue's directory")
        }
        other => other.to_string(),
    }
}

fn describe(dir: &std::path::Path, report: &CheckReport, repaired: bool) -> String {
    let verb = if repaired { "repaired" } else { "found" };
    let committed = report.committed.map_or("none".to_owned(), |p| p.to_string());
    let mut out = format!(
        "spill queue {}\n  segments            {}\n  records             {}\n  bytes               {}\n  committed position  {}\n",
        dir.display(),
        report.segments,
        report.records,
        report.bytes,
        committed,
    );
    if report.is_clean() {
        out.push_str("  corruption          none\n");
        return out;
    }
    let lines = [
        (
            report.state_reset,
            format!(
                "  state file          missing or unreadable: every record is delivered again ({verb})\n"
            ),
        ),
        (
            report.corrupt_regions > 0,
            format!(
                "  corrupt regions     {} ({} bytes), skipped\n",
                report.corrupt_regions, report.corrupt_bytes
            ),
        ),
        (
            report.torn_tails > 0,
            format!(
                "  torn tails          {} ({} bytes), {}\n",
                report.torn_tails,
                report.torn_bytes,
                if repaired { "truncated" } else { "to truncate (--repair)" }
            ),
        ),
        (
            report.bad_segments > 0,
            format!(
                "  foreign segments    {} ({} bytes), {}\n",
                report.bad_segments,
                report.bad_segment_bytes,
                if repaired { "dropped" } else { "to drop (--repair)" }
            ),
        ),
    ];
    for (show, line) in lines {
        if show {
            out.push_str(&line);
        }
    }
    if report.state_invalid {
        out.push_str(
            "  state file          points where no acknowledged position can be: recovery starts at or before it (records delivered again)\n",
        );
    }
    if report.missing_segments > 0 {
        let ranges: Vec<String> = report
            .missing_ranges
            .iter()
            .map(|(a, b)| if a == b { a.to_string() } else { format!("{a}-{b}") })
            .collect();
        out.push_str(&format!(
            "  missing segments    {} (ids {}): their records are lost\n",
            report.missing_segments,
            ranges.join(", ")
        ));
    }
    if report.truncated_inside > 0 {
        out.push_str(&format!(
            "  truncated inside    {} segments before the last ({} bytes torn): records lost inside the queue\n",
            report.truncated_inside, report.truncated_inside_bytes
        ));
    }
    if !report.not_files.is_empty() {
        out.push_str(&format!(
            "  not regular files   {} (never followed): {}\n",
            report.not_files.len(),
            report.not_files.join(", ")
        ));
    }
    if report.damaged_headers > 0 {
        out.push_str(&format!(
            "  damaged headers     {} (frames intact, kept), {}\n",
            report.damaged_headers,
            if repaired { "rewritten" } else { "to rewrite (--repair)" }
        ));
    }
    out
}
