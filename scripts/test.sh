#!/usr/bin/env bash
# The test command: fetches the real models the tests use (cached, checksummed), then runs the
# whole workspace's tests on the CPU. Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-models.sh
cargo test --workspace "$@"
