#!/bin/bash
# run17: prefill through the fused kernels: kernel GPU test, batched-prefill GPU test, the prefix-cache bench (+ profile)
cd "$(dirname "$0")/.."
python -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.txt 2>&1
T0=$(date +%s)
timeout 100 python -m pytest -q -m gpu tests/test_kernels_v4_attention.py -k "flash_shapes" -p no:logging --tb=short > $OUT/gpu_tests.txt 2>&1
echo "attn rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
timeout 400 python examples/bench_prefix_cache.py --paged --profile-prefill --work /tmp/dsv4c_pc --out $OUT/prefix_cache_paged.json > $OUT/prefix_log.txt 2>&1
echo "bench rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/prefix_log.txt
timeout 80 python -m pytest -q -m gpu tests/test_batched_prefill.py -p no:logging --tb=short >> $OUT/gpu_tests.txt 2>&1
echo "batched rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
grep -v USDT $OUT/prefix_log.txt | grep -v "^ " | tail -40; grep -E "^E |passed|failed|rc=" $OUT/gpu_tests.txt | head -20
