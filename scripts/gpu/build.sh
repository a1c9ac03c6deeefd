#!/usr/bin/env bash
# Builds the GPU payload on a machine without a GPU (see ../shared/gpu/README.md for the toolkit):
# the benchmark binary and the fused-kernel GPU test, gzipped into .device/ with the device-side
# scripts, ready to carry (`run` with carry [".device"]). Needs `install-cuda-toolkit.sh` once.
#
# Usage: scripts/gpu/build.sh     (CUDA_COMPUTE_CAP defaults to 90: H100/H200)
set -euo pipefail
cd "$(dirname "$0")/../.."
env_sh="${SPECSPLIT_CUDA_ENV:-../shared/gpu/cuda-env.sh}"
# shellcheck disable=SC1090
[ -f "$env_sh" ] && source "$env_sh"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target-cuda}"
cargo build --release --features cuda -p specsplit-bench
test_exe="$(cargo test --release --features cuda -p specsplit-models --test fused_kernels --no-run \
    --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "fused_kernels":
        print(m["executable"])')"
mkdir -p .device
gzip -c "$CARGO_TARGET_DIR/release/specsplit-bench" > .device/bench.gz
gzip -c "$test_exe" > .device/fused_kernels.gz
cp scripts/gpu/suite.sh scripts/gpu/join.sh .device/
du -sh .device
