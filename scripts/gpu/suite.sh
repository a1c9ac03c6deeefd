#!/usr/bin/env bash
# Runs on the GPU machine from the repository root, with .device/ carried (scripts/gpu/build.sh):
#   bash .device/suite.sh [tests] [forward] [e2e] [engine] [wake] [e2eargs] [fwdargs] [e2e2gpu] [qwen] [smollm2]
#   (none = tests forward e2e)
# Every output goes to $OUT (suite.log, JSON, CSV). Settings compared side by side are passed as
# flags of specsplit-bench (see `specsplit-bench <mode> --help`); `qwen` and `smollm2` need the
# models assembled by join.sh.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
gunzip -c .device/bench.gz > /tmp/b && chmod +x /tmp/b
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests forward e2e)
log() { echo "=== $(date +%T) $*"; }
# Side-by-side forward configurations, separated by ';' (each a list of `forward` flags).
FWD_CONFIGS="${FWD_CONFIGS:---batch-invariant off;--batch-invariant on}"
{
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for s in "${steps[@]}"; do case "$s" in
tests)
    gunzip -c .device/fused_kernels.gz > /tmp/t && chmod +x /tmp/t
    log "fused kernel tests"; /tmp/t --nocapture 2>&1 | tail -40 ;;
forward)
    for m in 0.5b 7b; do
        k=0; IFS=';' read -ra cfgs <<< "$FWD_CONFIGS"
        for c in "${cfgs[@]}"; do
            k=$((k + 1)); log "forward $m: $c"
            # shellcheck disable=SC2086
            timeout 240 /tmp/b forward --model random:qwen2.5-$m --device cuda:0 \
                --contexts 512,2048 --chains 1,8 --trees 32 --iters 20 $c \
                --out "$OUT" --name forward-$m-c$k 2>&1 | grep -v '^\s*$'
        done
    done ;;
e2e)
    log "e2e synthetic"
    timeout 280 /tmp/b e2e --target random:qwen2.5-7b \
        --draft random:qwen2.5-0.5b --device-target cuda:0 --device-draft cuda:0 \
        --synthetic-beta 0.8 --num-prompts 2 --max-tokens 64 --depths "${DEPTHS:-2,3,4}" \
        --pipelines "${PIPELINES:-sequential}" --out "$OUT" --name e2e-b08 2>&1 | tail -20 ;;
engine)
    # The target engine's whole rounds beside the bare passes.
    log "forward 7b with engine rounds"
    timeout 240 /tmp/b forward --model random:qwen2.5-7b --device cuda:0 --contexts 512 \
        --chains 1,3,8 --trees 32 --iters 20 --out "$OUT" --name forward-7b-engine 2>&1 \
        | grep -v '^\s*$' ;;
wake)
    # Thread wake-ups per RPC: WAKE lists "client_spin:server_spin_ms" pairs (client_spin
    # auto|always|never), run in turn (random:tiny on the GPU, so the servers' work is short).
    for v in ${WAKE:-never:0 always:20 never:0 always:20}; do
        log "rpc client_spin=${v%%:*} spin_ms=${v##*:}"
        timeout 120 /tmp/b rpc --device cuda:0 --contexts 32,512 --rounds 200 \
            --client-spin "${v%%:*}" --spin-ms "${v##*:}" \
            --out "$OUT" --name "rpc-${v/:/-}" 2>&1 | grep -E 'ctx|Ping|ping'
    done ;;
e2eargs)
    # E2E_CONFIGS lists `e2e` flag sets separated by ';' ("" = defaults), run in turn; TAG names
    # the files (e2e-b08-<TAG><k>-<n>).
    n="${MAX_TOKENS:-64}"; k=0
    IFS=';' read -ra cfgs <<< "${E2E_CONFIGS:-}"; [ ${#cfgs[@]} -eq 0 ] && cfgs=("")
    for c in "${cfgs[@]}"; do
        k=$((k + 1)); log "e2e synthetic, $n tokens, flags: $c"
        # shellcheck disable=SC2086
        timeout 200 /tmp/b e2e --target random:qwen2.5-7b \
            --draft random:qwen2.5-0.5b --device-target cuda:0 --device-draft cuda:0 \
            --synthetic-beta 0.8 --num-prompts "${PROMPTS:-2}" --max-tokens "$n" \
            --depths "${DEPTHS:-3,4}" --trees "" --pipelines "${PIPELINES:-sequential}" \
            $c --out "$OUT" --name "e2e-b08-${TAG:-cfg}$k-$n" 2>&1 \
            | grep -E 'tok/s|best|first round:|device time|row verify'
    done ;;
fwdargs)
    # The forward benchmark (ctx 512, chains 1 and 3, tree 32) of each of MODELS (0.5b 7b) with
    # each of FWD_CONFIGS in turn.
    k=0; IFS=';' read -ra cfgs <<< "$FWD_CONFIGS"
    for c in "${cfgs[@]}"; do
        k=$((k + 1))
        for m in ${MODELS:-0.5b 7b}; do
            log "forward $m, flags: $c"
            # shellcheck disable=SC2086
            timeout 240 /tmp/b forward --model random:qwen2.5-$m --device cuda:0 \
                --contexts 512 --chains 1,3 --trees 32 --iters 30 $c --out "$OUT" \
                --name "fwd-$m-cfg$k" 2>&1 | grep -v '^\s*$'
        done
    done ;;
e2e2gpu)
    # Two GPUs of one host: the draft on its own GPU, so the overlapped pipeline does not share one.
    log "e2e synthetic, draft on cuda:1, defaults"
    timeout 280 /tmp/b e2e --target random:qwen2.5-7b \
        --draft random:qwen2.5-0.5b --device-target cuda:0 --device-draft cuda:1 \
        --synthetic-beta 0.8 --num-prompts 2 --max-tokens 64 --depths 2,3,4,6 \
        --pipelines sequential,overlapped --out "$OUT" --name e2e-b08-2gpu 2>&1 | tail -20 ;;
qwen)
    log "e2e qwen-coder 0.5b -> 1.5b, dequantized bf16"
    env SPECSPLIT_MODELS_DIR=/tmp/models timeout 280 /tmp/b e2e \
        --target qwen-coder-1.5b --draft qwen-coder-0.5b --dtype bf16 \
        --device-target cuda:0 --device-draft cuda:0 --num-prompts 8 --max-tokens 64 \
        --depths 2,4,6 --trees "3,2,1" --pipelines sequential,overlapped \
        --out "$OUT" --name e2e-qwen-bf16 2>&1 | tail -20 ;;
smollm2)
    log "e2e smollm2-135m (self-draft), real weights"
    env SPECSPLIT_MODELS_DIR=/tmp/models timeout 200 /tmp/b e2e --target smollm2 \
        --draft smollm2 --device-target cuda:0 --device-draft cuda:0 --num-prompts 8 \
        --max-tokens 64 --depths 2,4 --trees "3,2,1" --pipelines sequential \
        --out "$OUT" --name e2e-smollm2 2>&1 | tail -12 ;;
*) echo "unknown step $s" ;;
esac; done
log done
} 2>&1 | tee -a "$OUT/suite.log"
