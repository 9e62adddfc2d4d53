#!/usr/bin/env bash
# Runs every benchmark suite, then writes BENCHMARKS.md from the results.
# LANES_BENCH_QUICK=1 bash benches/run.sh   -> quick mode (whole suite under 3 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo bench -p lanes-benches --benches
cargo run --release -q -p lanes-benches --bin report
