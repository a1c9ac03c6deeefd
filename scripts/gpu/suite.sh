#!/usr/bin/env bash
# Runs on the GPU machine from the repository root, with .device/ carried (scripts/gpu/build.sh):
#   bash .device/suite.sh [tests] [forward] [e2e] [engine] [wake] [e2ewake] [e2eenv] [fwdenv] [e2e2gpu] [qwen] [smollm2]
#   (none = tests forward e2e)
# Every output goes to $OUT (suite.log, JSON, CSV). The fused kernels and the retained CUDA
# memory pool are compared side by side in the same run (CONFIGS below). `qwen` and `smollm2`
# need the models assembled by join.sh.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
gunzip -c .device/bench.gz > /tmp/b && chmod +x /tmp/b
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests forward e2e)
log() { echo "=== $(date +%T) $*"; }
# Side-by-side configurations: fF pP bB = SPECSPLIT_FUSED_KERNELS (0 / 1 = step / A = all),
# SPECSPLIT_CUDA_POOL_RETAIN=P, SPECSPLIT_BATCH_INVARIANT=B (b defaults to 1 when left out).
# Override with CONFIGS="f1p1b0 f1p1b1" bash .device/suite.sh ...; the e2e steps take
# DEPTHS (2,3,4) and PIPELINES (sequential) too.
CONFIGS="${CONFIGS:-f1p1b0 f1p1b1}"
cfg_env() {
    local f="${1:1:1}"; [ "$f" = A ] && f=all; [ "$f" = 1 ] && f=step
    local b="${1:5:1}"; [ -z "$b" ] && b=1
    echo "SPECSPLIT_FUSED_KERNELS=$f SPECSPLIT_CUDA_POOL_RETAIN=${1:3:1} SPECSPLIT_BATCH_INVARIANT=$b"
}
{
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for s in "${steps[@]}"; do case "$s" in
tests)
    gunzip -c .device/fused_kernels.gz > /tmp/t && chmod +x /tmp/t
    log "fused kernel tests"; /tmp/t --test-threads 1 --nocapture 2>&1 | tail -40 ;;
forward)
    for m in 0.5b 7b; do for c in $CONFIGS; do
        log "forward $m $c"
        env $(cfg_env $c) timeout 240 /tmp/b forward --model random:qwen2.5-$m \
            --device cuda:0 --contexts 512,2048 --chains 1,8 --trees 32 --iters 20 \
            --out "$OUT" --name forward-$m-$c 2>&1 | grep -v '^\s*$'
    done; done ;;
e2e)
    for c in $CONFIGS; do
        log "e2e synthetic $c"
        env $(cfg_env $c) timeout 280 /tmp/b e2e --target random:qwen2.5-7b \
            --draft random:qwen2.5-0.5b --device-target cuda:0 --device-draft cuda:0 \
            --synthetic-beta 0.8 --num-prompts 2 --max-tokens 64 --depths "${DEPTHS:-2,3,4}" \
            --pipelines "${PIPELINES:-sequential}" --out "$OUT" --name e2e-b08-$c 2>&1 | tail -20
    done ;;
engine)
    # The target engine's whole rounds beside the bare passes.
    log "forward 7b with engine rounds"
    timeout 240 /tmp/b forward --model random:qwen2.5-7b --device cuda:0 --contexts 512 \
        --chains 1,3,8 --trees 32 --iters 20 --out "$OUT" --name forward-7b-engine 2>&1 \
        | grep -v '^\s*$' ;;
wake)
    # Thread wake-ups per RPC: WAKE lists "inline client_spin server_spin_ms" triples, run in
    # turn (random:tiny on the GPU, so the servers' work is short GPU work).
    for v in ${WAKE:-000 100 110 1120 000 1120}; do
        i="${v:0:1}" c="${v:1:1}" w="${v:2}"
        log "rpc inline=$i client_spin=$c server_spin_ms=$w"
        SPECSPLIT_INLINE_WORK=$i SPECSPLIT_CLIENT_SPIN=$c SPECSPLIT_SERVER_SPIN_MS=$w \
            timeout 120 /tmp/b rpc --device cuda:0 --contexts 32,512 --rounds 200 \
            --out "$OUT" --name "rpc-w$v" 2>&1 | grep -E 'ctx|Ping|ping' 
    done ;;
e2ewake)
    # WAKE_E2E: triples as for `wake`, or "def" for the defaults (no variable set).
    n="${MAX_TOKENS:-64}"
    for v in ${WAKE_E2E:-000 1120 000 1120}; do
        set_env=""
        if [ "$v" != def ]; then
            set_env="SPECSPLIT_INLINE_WORK=${v:0:1} SPECSPLIT_CLIENT_SPIN=${v:1:1} SPECSPLIT_SERVER_SPIN_MS=${v:2}"
        fi
        log "e2e synthetic, $n tokens, wake-up settings $v ($set_env)"
        env $set_env timeout 200 /tmp/b e2e --target random:qwen2.5-7b \
            --draft random:qwen2.5-0.5b --device-target cuda:0 --device-draft cuda:0 \
            --synthetic-beta 0.8 --num-prompts 2 --max-tokens "$n" --depths "${DEPTHS:-3,4}" \
            --trees "" --pipelines sequential --out "$OUT" --name "e2e-b08-w$v-$n" 2>&1 \
            | grep -E 'tok/s|best'
    done ;;
e2eenv)
    # ENVS lists settings run in turn, each a comma-separated list of VAR=value ("def": none),
    # e.g. ENVS="SPECSPLIT_SPARE_SESSIONS=0 def SPECSPLIT_SPARE_SESSIONS=0 def". E2E_ARGS adds
    # flags to every run (e.g. "--warmup 0"); TAG names the files (e2e-b08-<TAG><k>-<n>).
    n="${MAX_TOKENS:-64}"
    k=0
    for v in ${ENVS:-def}; do
        k=$((k + 1))
        set_env=""; [ "$v" != def ] && set_env="${v//,/ }"
        log "e2e synthetic, $n tokens, settings $v"
        env $set_env timeout 200 /tmp/b e2e --target random:qwen2.5-7b \
            --draft random:qwen2.5-0.5b --device-target cuda:0 --device-draft cuda:0 \
            --synthetic-beta 0.8 --num-prompts "${PROMPTS:-2}" --max-tokens "$n" \
            --depths "${DEPTHS:-3,4}" --trees "" --pipelines "${PIPELINES:-sequential}" \
            ${E2E_ARGS:-} --out "$OUT" --name "e2e-b08-${TAG:-env}$k-$n" 2>&1 \
            | grep -E 'tok/s|best|first round:|device time|row verify'
    done ;;
fwdenv)
    # The forward benchmark (ctx 512, chains 1 and 3, tree 32) of each of MODELS (0.5b 7b) under
    # each of ENVS in turn (as for e2eenv).
    k=0
    for v in ${ENVS:-def}; do
        k=$((k + 1))
        set_env=""; [ "$v" != def ] && set_env="${v//,/ }"
        for m in ${MODELS:-0.5b 7b}; do
            log "forward $m, settings $v"
            env $set_env timeout 240 /tmp/b forward --model random:qwen2.5-$m --device cuda:0 \
                --contexts 512 --chains 1,3 --trees 32 --iters 30 --out "$OUT" \
                --name "fwd-$m-env$k" 2>&1 | grep -v '^\s*$'
        done
    done ;;
e2e2gpu)
    # nvidia-h200-x2: the draft on its own GPU, so the overlapped pipeline does not share one.
    log "e2e synthetic, draft on cuda:1, defaults"
    timeout 280 /tmp/b e2e --target random:qwen2.5-7b \
        --draft random:qwen2.5-0.5b --device-target cuda:0 --device-draft cuda:1 \
        --synthetic-beta 0.8 --num-prompts 2 --max-tokens 64 --depths 2,3,4,6 \
        --pipelines sequential,overlapped --out "$OUT" --name e2e-b08-2gpu 2>&1 | tail -20 ;;
qwen)
    for c in $CONFIGS; do
        log "e2e qwen-coder 0.5b -> 1.5b, dequantized bf16, $c"
        env SPECSPLIT_MODELS_DIR=/tmp/models $(cfg_env $c) timeout 280 /tmp/b e2e \
            --target qwen-coder-1.5b --draft qwen-coder-0.5b --dtype bf16 \
            --device-target cuda:0 --device-draft cuda:0 --num-prompts 8 --max-tokens 64 \
            --depths 2,4,6 --trees "3,2,1" --pipelines sequential,overlapped \
            --out "$OUT" --name e2e-qwen-bf16-$c 2>&1 | tail -20
    done ;;
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
