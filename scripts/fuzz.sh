#!/usr/bin/env bash
# The long run of the request fuzzer (tests/tests/fuzz_requests.rs): every request type of both
# workers, CASES inputs each (default 170000: over a million in all, plus a tenth of that per
# route over loopback), each test in its own process so that one that aborts (an allocation
# over the fuzzer's 1 GiB hard cap) does not stop the others. JOBS tests run at once (default:
# the number of cores). Prints each test's summary and every distinct failure with its input.
#
#   scripts/fuzz.sh            # CASES=170000
#   CASES=20000 scripts/fuzz.sh
set -uo pipefail
cd "$(dirname "$0")/.."
CASES="${CASES:-170000}"
JOBS="${JOBS:-$(nproc)}"
# One thread of model work per test process: the tests run side by side.
export RAYON_NUM_THREADS="${RAYON_NUM_THREADS:-1}"
bin=$(cargo test -p specsplit-e2e --test fuzz_requests --no-run --message-format=json 2>/dev/null \
  | sed -n 's/.*"executable":"\([^"]*fuzz_requests[^"]*\)".*/\1/p' | tail -1)
if [ -z "$bin" ]; then
  echo "building the fuzz test failed" >&2
  exit 2
fi
out=$(mktemp -d)
tests="fuzz_draft_requests fuzz_verify_requests fuzz_draft_end_session fuzz_target_end_session
fuzz_draft_ping fuzz_target_ping fuzz_over_loopback"
start=$(date +%s)
printf '%s\n' $tests | xargs -P "$JOBS" -I{} sh -c \
  "PROPTEST_CASES=$CASES '$bin' --exact {} --nocapture > '$out/{}.log' 2>&1; echo \"{}: exit \$?\" >> '$out/{}.log'"
status=0
for t in $tests; do
  echo "== $t"
  grep -E "cases,|^- |^  |fuzz: one allocation|exit [0-9]+$" "$out/$t.log" | grep -vE "^ +[0-9]+: |^ +at " | cut -c1-400
  tail -1 "$out/$t.log" | grep -q "exit 0$" || status=1
done
echo "== $(($(date +%s) - start)) s; logs in $out"
exit $status
