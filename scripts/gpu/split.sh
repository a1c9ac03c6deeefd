#!/usr/bin/env bash
# Cuts SmolLM2-135M and the Qwen2.5-Coder pair into pieces small enough to carry to the GPU machine one call at a
# time (the carry limit is 64 MiB a call, .device/ included): .dev-q00, .dev-q01, ... each one
# folder holding one piece, plus .device/pieces.sha256 listing the assembled files' checksums.
# Carry piece N with `carry [".dev-qNN"]` and run `bash .device/join.sh` each time: join.sh moves
# it to /tmp/pieces (ignored folders and /tmp persist while the machine stays warm, i.e. calls
# less than ~30 s apart) and assembles + checks the models once all pieces are there.
#
# Usage: scripts/gpu/split.sh [MiB per piece, default 60]
set -euo pipefail
cd "$(dirname "$0")/../.."
mib="${1:-60}"
models="${SPECSPLIT_MODELS_DIR:-models}"
rm -rf .dev-q*
mkdir -p .device
: > .device/pieces.sha256
i=0
for f in smollm2-135m-instruct-q4_1.gguf qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
    qwen2.5-coder-1.5b-instruct-q4_k_m.gguf; do
    [ -f "$models/$f" ] || { echo "missing $models/$f: run scripts/fetch-models.sh" >&2; exit 1; }
    sha256sum "$models/$f" | sed "s#$models/##" >> .device/pieces.sha256
    tmp="$(mktemp -d)"
    split -b "${mib}M" -d -a 3 "$models/$f" "$tmp/$f.part"
    for p in "$tmp"/*; do
        d="$(printf '.dev-q%02d' "$i")"; mkdir -p "$d"; mv "$p" "$d/"; i=$((i + 1))
    done
    rm -rf "$tmp"
done
echo "$i pieces:"; ls -d .dev-q* | tr '\n' ' '; echo
cp scripts/gpu/join.sh .device/
