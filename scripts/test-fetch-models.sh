#!/usr/bin/env bash
# Checks how scripts/fetch-models.sh chooses between the Hugging Face Hub and the package mirror,
# without fetching from either: the mirror (`fetch_parts`) is replaced by a stub that records its
# call, and the Hub is a local HTTP server (python3 -m http.server) in the Hub's URL layout.
#
# Usage: scripts/test-fetch-models.sh. Needs curl and python3; with the real
# qwen2.5-coder-0.5b GGUF in $SPECSPLIT_MODELS_DIR (default ./models) it also checks a download
# from the local Hub against the pinned sha256 (a 0.5 GB loopback copy into a temporary dir).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
models="${SPECSPLIT_MODELS_DIR:-$root/models}"
file=qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
repo=Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF
work="$(mktemp -d)"
server_pid=""
cleanup() {
    [ -n "$server_pid" ] && kill "$server_pid" 2> /dev/null
    rm -rf "$work"
}
trap cleanup EXIT
failures=0
check() { # check NAME COMMAND...: runs COMMAND, reports NAME
    local name="$1"; shift
    if "$@"; then echo "PASS: $name"; else echo "FAIL: $name"; failures=$((failures + 1)); fi
}

# run_fetch DEST ENDPOINT [ENV...]: fetch_qwen05 into DEST with the mirror stubbed; prints its
# stdout and stderr together.
run_fetch() {
    local dest_dir="$1" endpoint="$2"; shift 2
    env -u HF_HUB_OFFLINE HF_ENDPOINT="$endpoint" SPECSPLIT_MODELS_DIR="$dest_dir" "$@" \
        bash -c 'source "$1"; fetch_parts() { echo "MIRROR $1"; }; fetch_qwen05' \
        _ "$root/scripts/fetch-models.sh" 2>&1
}

# A local Hub serving $work/hub/<repo>/resolve/main/<file>.
start_hub() {
    local port
    port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
    python3 -m http.server --bind 127.0.0.1 --directory "$work/hub" "$port" > /dev/null 2>&1 &
    server_pid=$!
    for _ in $(seq 50); do
        curl -s -o /dev/null "http://127.0.0.1:$port/" && break
        sleep 0.1
    done
    hub="http://127.0.0.1:$port"
}
mkdir -p "$work/hub/$repo/resolve/main"
start_hub

unreachable() {
    local out; out="$(run_fetch "$work/a" http://127.0.0.1:9)"
    echo "$out" | grep -q "did not serve" && echo "$out" | grep -q "MIRROR $file"
}
check "Hub unreachable: falls back to the mirror" unreachable

offline() {
    local out; out="$(run_fetch "$work/b" "$hub" HF_HUB_OFFLINE=1)"
    echo "$out" | grep -q "HF_HUB_OFFLINE is set" && echo "$out" | grep -q "MIRROR $file"
}
check "HF_HUB_OFFLINE: the mirror, the Hub not asked" offline

not_on_hub() {
    local out; out="$(run_fetch "$work/c" "$hub")"
    echo "$out" | grep -q "did not serve" && echo "$out" | grep -q "MIRROR $file"
}
check "Hub answers 404: falls back to the mirror" not_on_hub

wrong_bytes() {
    echo "not the model" > "$work/hub/$repo/resolve/main/$file"
    local out; out="$(run_fetch "$work/d" "$hub")"
    rm "$work/hub/$repo/resolve/main/$file"
    echo "$out" | grep -q "does not have the pinned sha256" && echo "$out" | grep -q "MIRROR $file" &&
        [ ! -e "$work/d/$file" ] && [ ! -e "$work/d/$file.partial" ]
}
check "Hub serves other bytes: rejected, falls back to the mirror" wrong_bytes

if [ -f "$models/$file" ]; then
    cached_present() {
        local out; out="$(run_fetch "$models" http://127.0.0.1:9)"
        echo "$out" | grep -q "ok: $models/$file (cached)" && ! echo "$out" | grep -q "MIRROR\|fetching"
    }
    check "present and verified: neither Hub nor mirror asked" cached_present
    from_hub() {
        ln -s "$models/$file" "$work/hub/$repo/resolve/main/$file"
        local out; out="$(run_fetch "$work/e" "$hub")"
        echo "$out" | grep -q "ok: $work/e/$file (from $hub)" && ! echo "$out" | grep -q MIRROR &&
            cmp -s "$models/$file" "$work/e/$file"
    }
    check "Hub serves the pinned file: fetched from the Hub" from_hub
else
    echo "SKIP: $models/$file absent (cached and from-Hub checks)"
fi

[ "$failures" -eq 0 ] || { echo "$failures check(s) failed" >&2; exit 1; }
echo "all checks passed"
