#!/usr/bin/env bash
# Every test of the workspace, with the services they need (Redis, a local Redis Cluster, NATS) up.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh --cluster
cargo test --workspace
