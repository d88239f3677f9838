#!/bin/bash
# run21: the prefix-cache bench (slot caches; the device time left did not allow --paged) with warm_up's 16-row cases and per-stage Triton compile
# counts; then, in what time is left, the prefix-cache GPU test that run19's limit cut (pytest-timeout)
cd "$(dirname "$0")/../../../.."
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.txt 2>&1
T0=$(date +%s)
timeout 320 python examples/bench_prefix_cache.py --work /tmp/pc --out $OUT/pc.json > $OUT/pc_log.txt 2>&1
echo "bench rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/pc_log.txt
grep -v USDT $OUT/pc_log.txt | grep -v "^ " | tail -24
rm -rf /tmp/pc
timeout 130 python -m pytest -v -m gpu tests/test_prefix_cache.py -p no:logging --tb=short --timeout 120 > $OUT/pc_gpu_test.txt 2>&1
echo "test rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/pc_gpu_test.txt
grep -E "^E |PASSED|FAILED|passed|failed|rc=|Timeout|File " $OUT/pc_gpu_test.txt | head -30
