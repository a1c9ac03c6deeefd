#!/usr/bin/env bash
# The long CPU exactness check (opt-in; about an hour on 2 cores): greedy speculation with the
# default Qwen2.5-Coder 0.5B -> 1.5B Q4_K_M pair equals target-only decoding over 40 prompts x 128
# tokens, chains and trees, sequential and overlapped; and the 1.5B target's logits are bit-identical
# for a token decoded alone and inside passes of up to 129 rows. Prints one line per prompt.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-models.sh qwen-0.5b qwen-1.5b
cargo test -p specsplit-models --test batch_invariance -- --ignored --nocapture
cargo test -p specsplit-e2e --test cpu_exactness_long -- --ignored --nocapture "$@"
