#!/usr/bin/env bash
# Builds here (no GPU needed) everything a device run needs and stages it in one folder that the
# device tool can carry: the GPU test executables, the flashattn command, the cuda_bench and
# cuda_smoke examples, and the scripts of bench/. The device machine has no Rust; this machine's x86-64 builds run there.
#
#   bench/stage.sh [DEST]     # DEST defaults to <main checkout>/.device-<branch>
#   then:  run(command="bash .device-<branch>/bench/device_run.sh", carry=[".device-<branch>"])
set -euo pipefail
cd "$(dirname "$0")/.."
branch=$(git branch --show-current)
main_root=$(dirname "$(git rev-parse --path-format=absolute --git-common-dir)")
dest=${1:-$main_root/.device-$branch}
exclude="$main_root/.git/info/exclude"
name="/$(basename "$dest")/"
if [[ "$(dirname "$dest")" == "$main_root" ]] && ! grep -qxF "$name" "$exclude" 2>/dev/null; then
    echo "$name" >> "$exclude"
fi
rm -rf "$dest"
mkdir -p "$dest/bin" "$dest/tests" "$dest/bench"
cargo build --release --bin flashattn --example cuda_bench --example cuda_smoke
cp target/release/flashattn target/release/examples/cuda_bench target/release/examples/cuda_smoke "$dest/bin/"
cargo test --release --no-run --test cuda_forward --test cuda_backward --test cuda_compile --test cuda_memory --test cuda_cache --test cuda_nan --test cuda_hopper --test cuda_wgmma --test cuda_layer --test cuda_diagonal --test ring --test cuda_linear --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        print(m["executable"])
' | while read -r exe; do
        n=$(basename "$exe"); cp "$exe" "$dest/tests/${n%-*}"
    done
cp bench/*.sh bench/*.py "$dest/bench/"
strip "$dest"/bin/* "$dest"/tests/* 2>/dev/null || true
du -sh "$dest"
ls "$dest"/*
