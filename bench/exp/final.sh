set -u
export PATH=/usr/local/cuda/bin:$PATH LD_LIBRARY_PATH=/usr/local/cuda/lib64 PYTHONUNBUFFERED=1
mkdir -p $OUT/m
R=$PWD
cd crates/flashattn/kernels
V=wgmma_d64_192x128,wgmma_d64_128x128,wgmma_d128_128x128,wgmma_d128_128x64,wgmma_d192_128x64,wgmma_d256_128x64,wgmma_d256_128x32
timeout 60 python3 harness.py check --variants $V > $OUT/m/check.txt 2>&1; echo "check rc=$? $(tail -1 $OUT/m/check.txt)" >> $OUT/m/summary.txt
compute-sanitizer --help > $OUT/m/cs-help.txt 2>&1
F="--filter kns=flash_fwd_wgmma"; grep -q -- "--kernel-name" $OUT/m/cs-help.txt && F="--kernel-name kns=flash_fwd_wgmma"
for tool in racecheck synccheck memcheck; do
  timeout 40 compute-sanitizer --tool $tool $F --print-limit 20 python3 harness.py check --quick --variants $V > $OUT/m/$tool.log 2>&1
  echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|check failures' $OUT/m/$tool.log | tr '\n' ' ')" >> $OUT/m/summary.txt
done
cd $OUT && tar czf m.tgz m && rm -rf m; cd $R
bash .device-gpu-bwd/REQUEST.sh > /dev/null 2>&1; cd $OUT && tar czf bwd.tgz bwd && rm -rf bwd; cd $R
bash .device-pycuda/REQUEST.sh > /dev/null 2>&1; cd $OUT && tar czf py.tgz py && rm -rf py; cd $R
ls -la $OUT
