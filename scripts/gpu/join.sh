#!/usr/bin/env bash
# On the GPU machine: moves any carried .dev-qNN piece to /tmp/pieces; when every piece of a
# model listed in .device/pieces.sha256 is there, assembles it into /tmp/models and checks its
# sha256. Prints what is still missing. See scripts/gpu/split.sh.
set -uo pipefail
mkdir -p /tmp/pieces /tmp/models
for d in .dev-q*; do [ -d "$d" ] && cp -n "$d"/* /tmp/pieces/ 2>/dev/null; done
[ -f .device/pieces.sha256 ] || { echo "no .device/pieces.sha256: carry .device first (scripts/gpu/split.sh puts it there)"; exit 1; }
while read -r sha f; do
    if [ -f "/tmp/models/$f" ]; then echo "have $f"; continue; fi
    parts=(/tmp/pieces/"$f".part*)
    cat "${parts[@]}" > "/tmp/models/$f.partial" 2>/dev/null
    if [ "$(sha256sum "/tmp/models/$f.partial" | cut -d' ' -f1)" = "$sha" ]; then
        mv "/tmp/models/$f.partial" "/tmp/models/$f"; echo "assembled $f"
    else
        rm -f "/tmp/models/$f.partial"; echo "incomplete $f: ${#parts[@]} pieces so far"
    fi
done < .device/pieces.sha256
ls -la /tmp/pieces | wc -l
