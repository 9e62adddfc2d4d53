//! `lanes demo` end to end: the real binary, a smaller workload, its exit status and its table.

use std::process::Command;

#[test]
fn demo_runs_and_every_admitted_run_is_finalized() {
    let out = Command::new(env!("CARGO_BIN_EXE_lanes"))
        .args(["demo", "lanes", "--runs", "1500", "--burst", "400", "--seed", "3"])
        .output()
        .expect("run the lanes binary");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "lanes demo failed:\n{stdout}\n{stderr}");
    let reconciles = stdout.lines().find(|l| l.starts_with("reconciles")).expect("table row");
    assert_eq!(reconciles.split_whitespace().collect::<Vec<_>>(), ["reconciles", "yes", "yes"]);
    assert!(stdout.contains("admitted runs was finalized exactly once"), "{stdout}");
    assert!(!stderr.contains("simulated job panic"), "simulated panics are kept quiet");
}

#[test]
fn demo_limits_shares_the_downstream_fairly() {
    let out = Command::new(env!("CARGO_BIN_EXE_lanes"))
        .args(["demo", "limits", "--seconds", "1.5"])
        .output()
        .expect("run the lanes binary");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let line = stdout.lines().find(|l| l.starts_with("fairness")).expect("a fairness line");
    let index: f64 = line
        .split(": ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("an index");
    assert!(index > 0.9, "{line}");
    assert!(line.contains("most held at once: 10 of 10") || line.contains("of 10"), "{line}");
    for tenant in ["acme", "globex", "initech", "umbrella"] {
        assert!(stdout.contains(tenant), "{stdout}");
    }
}

#[test]
fn demo_keyed_holds_per_key_order_in_both_modes() {
    let out = Command::new(env!("CARGO_BIN_EXE_lanes"))
        .args(["demo", "keyed"])
        .output()
        .expect("run the lanes binary");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for mode in ["per-key", "hashed shards"] {
        let row =
            stdout.lines().find(|l| l.starts_with(mode)).unwrap_or_else(|| panic!("{stdout}"));
        let cells: Vec<&str> = row.trim_start_matches(mode).split_whitespace().collect();
        assert_eq!(cells[0], "3000", "every update applied: {row}");
        assert_eq!(cells[1], "0", "no order violation: {row}");
    }
}

#[test]
fn unknown_arguments_are_refused_with_usage() {
    let out = Command::new(env!("CARGO_BIN_EXE_lanes"))
        .args(["demo", "--runs", "lots"])
        .output()
        .expect("run the lanes binary");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("invalid value 'lots'"), "{stderr}");
    // Review finding (stop 73): a NaN made the limits scenario panic (exit 101), and values
    // out of range were clamped silently.
    for seconds in ["nan", "inf", "0.1", "600"] {
        let out = Command::new(env!("CARGO_BIN_EXE_lanes"))
            .args(["demo", "limits", "--seconds", seconds])
            .output()
            .expect("run the lanes binary");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{seconds}: {stderr}");
        assert!(stderr.contains("--seconds"), "{seconds}: {stderr}");
    }
}

#[test]
fn demo_channel_loses_nothing_acknowledged_across_a_crash() {
    let out = Command::new(env!("CARGO_BIN_EXE_lanes"))
        .args(["demo", "channel", "--records", "6000"])
        .output()
        .expect("run the lanes binary");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("acknowledged records lost: 0"), "{stdout}");
    assert!(stdout.contains("6000 distinct orders of 6000"), "{stdout}");
    assert!(stdout.contains("nothing acknowledged was lost: yes"), "{stdout}");
    let spilled = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("emitted 3000"))
        .and_then(|l| l.split("spilled ").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse::<u64>().ok())
        .expect("a spilled count before the crash");
    assert!(spilled > 0, "the overload spilled: {stdout}");
}

#[test]
fn after_the_demo_every_primitive_has_metrics_with_help() {
    let dir = std::env::temp_dir().join(format!("lanes-demo-metrics-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("metrics.txt");
    let out = Command::new(env!("CARGO_BIN_EXE_lanes"))
        .args(["demo", "all", "--runs", "500", "--burst", "100", "--seconds", "0.5"])
        .args(["--records", "2000", "--metrics-out"])
        .arg(&file)
        .output()
        .expect("run the lanes binary");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&file).expect("the metrics file");
    let helped: Vec<&str> =
        text.lines().filter_map(|l| l.strip_prefix("# HELP ")?.split(' ').next()).collect();
    let samples: Vec<(&str, f64)> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').expect("a sample line");
            (series, value.parse().expect("a number"))
        })
        .collect();
    for primitive in ["lane", "limit", "pool", "channel", "spill"] {
        let prefix = format!("lanes_{primitive}_");
        assert!(samples.iter().any(|(s, _)| s.starts_with(&prefix)), "no {prefix} series:\n{text}");
    }
    for (series, _) in &samples {
        let family = series.split('{').next().unwrap();
        let family = ["_sum", "_count"]
            .iter()
            .find_map(|suffix| family.strip_suffix(suffix).filter(|f| helped.contains(f)))
            .unwrap_or(family);
        assert!(helped.contains(&family), "{family} has no HELP:\n{text}");
    }
    // At quiescence nothing is held, executing or waiting, and every admitted run finished.
    let sum = |name: &str| -> f64 {
        samples.iter().filter(|(s, _)| s.split('{').next() == Some(name)).map(|(_, v)| v).sum()
    };
    for gauge in ["lanes_lane_executing", "lanes_lane_queued", "lanes_limit_held"] {
        assert_eq!(sum(gauge), 0.0, "{gauge}:\n{text}");
    }
    assert_eq!(sum("lanes_limit_waiters"), 0.0, "{text}");
    assert!(sum("lanes_lane_admitted_total") > 0.0);
    assert_eq!(sum("lanes_lane_admitted_total"), sum("lanes_lane_finished_total"), "{text}");
    assert!(sum("lanes_spill_appended_total") > 0.0, "{text}");
    std::fs::remove_dir_all(&dir).ok();
}
