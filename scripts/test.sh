#!/usr/bin/env bash
# Every test of the workspace, with the services they need (Redis, NATS) up.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh
cargo test --workspace
