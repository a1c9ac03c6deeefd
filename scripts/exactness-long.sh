#!/usr/bin/env bash
# The long CPU exactness check (opt-in; about an hour on 2 cores): greedy speculation with the
# default Qwen2.5-Coder 0.5B -> 1.5B Q4_K_M pair equals target-only decoding over 40 prompts x 128
# tokens, chains and trees, sequential and overlapped. Prints one line per prompt and a summary.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-models.sh qwen-0.5b qwen-1.5b
cargo test -p specsplit-e2e --test cpu_exactness_long -- --ignored --nocapture "$@"
