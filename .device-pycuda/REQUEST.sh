#!/usr/bin/env bash
# flashattn-py on CUDA tensors (branch py-cuda), run 2: the system python3 (torch lives in its user
# site), the wheel and (if missing) pytest unpacked into /tmp/fa-site on PYTHONPATH: no pip, no venv.
# Order: a smoke call, the stream/compile/opcheck/error tests, a short bench, the shape grid, then
# a wheel of py-cuda merged with gpu-bwd (bwd/) on the gradient tests. Each pytest is stopped with
# SIGINT at its deadline, so its log still ends with the summary of what ran.
set -uo pipefail
D=.device-pycuda
LOG="$OUT/py"
mkdir -p "$LOG"
export FLASHATTN_CACHE_DIR=/tmp/flashattn-kernel-cache
unpack() { python3 -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' "$@"; }
SECONDS=0
{
    date -u; nvidia-smi -L; python3 --version
    python3 -c "import torch, numpy; print('torch', torch.__version__, torch.version.cuda, torch.cuda.is_available(), 'numpy', numpy.__version__)"
    rm -rf /tmp/fa-site /tmp/fa-site-bwd && mkdir -p /tmp/fa-site /tmp/fa-site-bwd
    unpack /tmp/fa-site $D/*.whl
    unpack /tmp/fa-site-bwd $D/bwd/*.whl
    if ! python3 -m pytest --version; then
        unpack /tmp/fa-site $D/pytest-wheels/*.whl
        unpack /tmp/fa-site-bwd $D/pytest-wheels/*.whl
    fi
    PYTHONPATH=/tmp/fa-site python3 -m pytest --version
} > "$LOG/env.txt" 2>&1
export PYTHONPATH=/tmp/fa-site
timeout -s INT -k 5 45 python3 $D/smoke.py > "$LOG/smoke.log" 2>&1
echo "rc=$? after ${SECONDS}s" >> "$LOG/smoke.log"
PYTEST=(python3 -m pytest -p no:cacheprovider -v --tb=short -rxXfs --durations=12)
SEL="side_stream or mixed or dlpack or opcheck or compile or varlen or causal_rows or head_dim or strided"
timeout -s INT -k 5 70 "${PYTEST[@]}" --junitxml="$LOG/junit_a.xml" -k "$SEL" $D/tests/test_cuda.py \
    > "$LOG/pytest_a.log" 2>&1
echo "rc=$? after ${SECONDS}s" >> "$LOG/pytest_a.log"
timeout -s INT -k 5 30 python3 $D/bench/compare_python.py --device cuda --seqlens 1024,4096 --repeats 20 \
    --overhead-repeats 300 > "$LOG/bench_cuda.log" 2>&1
echo "rc=$? after ${SECONDS}s" >> "$LOG/bench_cuda.log"
left=$((170 - SECONDS))
if (( left > 10 )); then
    timeout -s INT -k 5 "$left" "${PYTEST[@]}" --junitxml="$LOG/junit_b.xml" -k "not ($SEL)" \
        $D/tests/test_cuda.py > "$LOG/pytest_b.log" 2>&1
    echo "rc=$? after ${SECONDS}s" >> "$LOG/pytest_b.log"
fi
# py-cuda + gpu-bwd: the same tests, now with a CUDA backward (gradients checked, not xfailed).
export PYTHONPATH=/tmp/fa-site-bwd
left=$((228 - SECONDS))
if (( left > 10 )); then
    BWD="causal_rows or head_dim or side_stream or (varlen and not compile) or (options and bfloat16) or (shapes and torch.float16)"
    timeout -s INT -k 5 "$left" "${PYTEST[@]}" --junitxml="$LOG/junit_bwd.xml" -k "$BWD" \
        $D/tests/test_cuda.py > "$LOG/pytest_bwd.log" 2>&1
    echo "rc=$? after ${SECONDS}s" >> "$LOG/pytest_bwd.log"
fi
