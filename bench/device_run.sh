#!/usr/bin/env bash
# One device run, on the GPU machine, from a folder staged by bench/stage.sh: the GPU tests, the
# sanitizers on a small run of every kernel variant, the flashattn command's GPU path (check, and
# bench with first-use compile and cached load times), its recovery from a damaged kernel disk
# cache, and the benchmark against PyTorch SDPA.
# Logs and JSON go to $OUT (the device tool brings them back); a summary is printed last.
#
#   bash .device-NAME/bench/device_run.sh [tests] [cli] [cache] [sanitize] [bench] [bench-quick]
#   (default: tests cli cache sanitize bench)
# Sanitize takes minutes (memcheck + racecheck; TOOLS=racecheck runs one): give it a call of its
# own within the device tool's 10-minute limit.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/flashattn-out}
mkdir -p "$OUT"
export FLASHATTN_CACHE_DIR=${FLASHATTN_CACHE_DIR:-/tmp/flashattn-cache}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1
# The CLI tests start this binary (their build path does not exist on this machine).
export FLASHATTN_BIN=${FLASHATTN_BIN:-$here/bin/flashattn}
steps=("$@"); [[ ${#steps[@]} -eq 0 ]] && steps=(tests cli cache sanitize bench)
summary=()
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
for step in "${steps[@]}"; do
    t0=$SECONDS
    case $step in
    tests)
        for t in "$here"/tests/*; do
            n=$(basename "$t")
            "$t" --include-ignored --test-threads=4 --show-output > "$OUT/test-$n.log" 2>&1
            rc=$?
            summary+=("test $n: rc=$rc $(grep -E '^test result' "$OUT/test-$n.log" | tail -1) ($((SECONDS - t0)) s)")
            grep -E '^test .*FAILED|panicked' "$OUT/test-$n.log" | head -20
        done ;;
    cli)
        fa="$here/bin/flashattn"
        "$fa" check --device cuda > "$OUT/cli-check.log" 2>&1
        summary+=("cli check: rc=$? $(grep -c '^\[PASS\]' "$OUT/cli-check.log") PASS, $(grep -c '^\[FAIL\]' "$OUT/cli-check.log") FAIL")
        for dt in bf16 f16 f32; do
            "$fa" bench --device cuda --dtype "$dt" --seqlens 1024,4096,16384 --head-dims 64,128 \
                --json "$OUT/cli-bench-$dt.json" > "$OUT/cli-bench-$dt.log" 2>&1
            summary+=("cli bench $dt: rc=$?")
        done
        summary+=("cli: ($((SECONDS - t0)) s)") ;;
    cache)
        # The kernel disk cache after damage: `flashattn run --device cuda` fills a fresh cache,
        # then runs again after each way of damaging every entry; each run must exit 0, give
        # the first run's output bit for bit (and the CPU's within 1e-5), and rewrite the entries.
        work=$(mktemp -d)
        export FLASHATTN_CACHE_DIR="$work/cache"
        python3 "$here/bench/cache_damage.py" inputs "$work/in.safetensors"
        fa() { "$here/bin/flashattn" run --input "$work/in.safetensors" --output "$work/$1.safetensors" \
            --causal --device "$2" >> "$OUT/cache.log" 2>&1; }
        fa cpu cpu && fa ref cuda
        rc=$?
        for damage in truncate empty flip; do
            python3 "$here/bench/cache_damage.py" damage "$FLASHATTN_CACHE_DIR" "$damage" >> "$OUT/cache.log" 2>&1
            fa "$damage" cuda
            run_rc=$?
            python3 "$here/bench/cache_damage.py" compare "$work" "$damage" "$FLASHATTN_CACHE_DIR" >> "$OUT/cache.log" 2>&1
            cmp_rc=$?
            echo "cache damage $damage: run rc=$run_rc, check rc=$cmp_rc" | tee -a "$OUT/cache.log"
            [[ $run_rc -eq 0 && $cmp_rc -eq 0 ]] || rc=1
        done
        summary+=("cache damage recovery: rc=$rc ($((SECONDS - t0)) s)")
        unset FLASHATTN_CACHE_DIR
        rm -rf "$work" ;;
    sanitize)
        bash "$here/bench/sanitize.sh" "$here/bin/cuda_smoke"
        summary+=("sanitize: rc=$? ($((SECONDS - t0)) s)") ;;
    bench|bench-quick)
        extra=(); [[ $step == bench-quick ]] && extra=(--seqlens 1024,8192 --samples 5 --rounds 1)
        # SM clock, power and throttle reasons every 200 ms: shows when the GPU itself slowed down.
        nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active \
            --format=csv -lms 200 > "$OUT/clocks.csv" 2>&1 &
        smi=$!
        python3 "$here/bench/compare_sdpa.py" --bin "$here/bin/cuda_bench" --standard \
            --json "$OUT/compare_sdpa.json" "${extra[@]}" 2>&1 | tee "$OUT/bench.log"
        summary+=("bench: rc=${PIPESTATUS[0]} ($((SECONDS - t0)) s)")
        kill $smi 2>/dev/null ;;
    *) echo "unknown step $step" >&2 ;;
    esac
done
echo
printf '%s\n' "${summary[@]}"
