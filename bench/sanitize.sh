#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck on a small run of every kernel variant (the cuda_smoke
# example: each dtype, head dims 1..512, every option, varlen), on the GPU machine. Logs to $OUT.
# Exit status 1 if either tool reports an error or the run fails.
#
#   bash bench/sanitize.sh PATH/TO/cuda_smoke
#   TOOLS=racecheck bash bench/sanitize.sh ...     # one tool (each takes minutes: split the
#                                                  # calls within the device tool's limit)
set -uo pipefail
bin=${1:?usage: sanitize.sh PATH/TO/cuda_smoke}
OUT=${OUT:-/tmp/flashattn-out}
mkdir -p "$OUT"
export FLASHATTN_CACHE_DIR=${FLASHATTN_CACHE_DIR:-/tmp/flashattn-cache}
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
# Compile (and cache) every variant outside the sanitizer first.
"$bin" > "$OUT/smoke.log" 2>&1 || { echo "cuda_smoke failed:"; tail -20 "$OUT/smoke.log"; }
status=0
for tool in ${TOOLS:-memcheck racecheck}; do
    "$cs" --tool "$tool" --error-exitcode 99 --print-limit 50 "$bin" > "$OUT/$tool.log" 2>&1
    rc=$?
    echo "$tool: rc=$rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$tool.log" | tail -1)"
    [[ $rc -eq 0 ]] || { status=1; grep -E '=========' "$OUT/$tool.log" | head -30; }
done
grep -E '^variants' "$OUT/smoke.log"
exit $status
