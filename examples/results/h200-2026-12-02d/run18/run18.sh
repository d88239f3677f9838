#!/bin/bash
# run18: h23g's MTP round graphs on the GPU (equality + per-round times), then the prefix-cache bench with Session.warm_up
cd "$(dirname "$0")/.."
python -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.txt 2>&1
T0=$(date +%s)
timeout 140 python -m pytest -q -s -m gpu tests/test_mtp_pipeline.py -p no:logging --tb=short > $OUT/mtp_gpu_tests.txt 2>&1
echo "mtp tests rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/mtp_gpu_tests.txt
timeout 235 python examples/bench_prefix_cache.py --work /tmp/dsv4c_pc --out $OUT/prefix_cache.json > $OUT/prefix_log.txt 2>&1
echo "bench rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/prefix_log.txt
grep -v USDT $OUT/prefix_log.txt | grep -v "^ " | tail -30; grep -E "^E |passed|failed|rc=|\|" $OUT/mtp_gpu_tests.txt | head -40
