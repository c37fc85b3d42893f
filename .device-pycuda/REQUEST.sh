#!/usr/bin/env bash
# flashattn-py on CUDA tensors (branch py-cuda): installs the wheel in this folder into a venv over
# the system's torch, runs the GPU tests and a short bench. Run from the repository root.
set -uo pipefail
D=.device-pycuda
LOG="$OUT/py"
mkdir -p "$LOG"
export FLASHATTN_CACHE_DIR=/tmp/flashattn-kernel-cache
{
    date -u; nvidia-smi -L; python3 --version
    python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.is_available())"
} > "$LOG/env.txt" 2>&1
python3 -m venv --system-site-packages /tmp/pyc-venv >> "$LOG/env.txt" 2>&1 || true
PY=python3
[[ -x /tmp/pyc-venv/bin/python ]] && PY=/tmp/pyc-venv/bin/python
if ! $PY -m pytest --version >> "$LOG/env.txt" 2>&1; then
    $PY -m pip install --quiet --no-deps --no-index $D/pytest-wheels/*.whl >> "$LOG/env.txt" 2>&1
    $PY -m pytest --version >> "$LOG/env.txt" 2>&1
fi
$PY -m pip install --no-deps --no-index --force-reinstall $D/*.whl >> "$LOG/env.txt" 2>&1
(cd /tmp && $PY -c "import flashattn, flashattn._cuda as c; print(flashattn.__file__); print('nvrtc', c.load_nvrtc(), c.nvrtc_version())") >> "$LOG/env.txt" 2>&1
# The GPU tests first (the CPU ones ran on the developers' machine), then the rest if time allows.
SECONDS=0
timeout 170 $PY -m pytest -p no:cacheprovider -q -rxXs --durations=15 --junitxml="$LOG/junit_cuda.xml" \
    $D/tests/test_cuda.py > "$LOG/pytest_cuda.log" 2>&1
echo "rc=$? after ${SECONDS}s" >> "$LOG/pytest_cuda.log"
timeout 40 $PY $D/bench/compare_python.py --device cuda --seqlens 1024,4096 --repeats 20 \
    --overhead-repeats 300 > "$LOG/bench_cuda.log" 2>&1
echo "rc=$? after ${SECONDS}s" >> "$LOG/bench_cuda.log"
left=$((225 - SECONDS))
if (( left > 20 )); then
    timeout "$left" $PY -m pytest -p no:cacheprovider -q --ignore=$D/tests/test_cuda.py $D/tests \
        > "$LOG/pytest_rest.log" 2>&1
    echo "rc=$? after ${SECONDS}s" >> "$LOG/pytest_rest.log"
fi
