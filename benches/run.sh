#!/usr/bin/env bash
# Runs every benchmark suite, then writes BENCHMARKS.md from the results.
# LANES_BENCH_QUICK=1 bash benches/run.sh   -> quick mode (about 8 minutes on 2 cores)
# Suite 10 needs Redis (started by scripts/services.sh when it is down locally).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh
cargo bench -p lanes-benches --benches
cargo run --release -q -p lanes-benches --bin report
