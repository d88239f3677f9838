#!/bin/bash
# run21: prefill CUDA graphs (runtime/prefill_graphs.py) on the GPU: their GPU test (in the background, tiny
# fp32 model) beside the prefix-cache bench (slot and paged caches, prefill graphs on, each profiled scenario
# timed op by op too)
cd "$(dirname "$0")/../../../.."
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.txt 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpu.txt
T0=$(date +%s)
( timeout 240 python -m pytest -v -m gpu tests/test_prefill_graphs.py -p no:logging --tb=long > $OUT/pg_gpu_test.txt 2>&1;
  echo "rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/pg_gpu_test.txt ) &
timeout 555 python examples/bench_prefix_cache.py --paged --profile-prefill --work /tmp/pc --out $OUT/pc_paged.json > $OUT/pc_log.txt 2>&1
echo "bench rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/pc_log.txt
wait
cat $OUT/gpu.txt
grep -E "passed|failed|rc=|Error|error" $OUT/pg_gpu_test.txt | tail -8
grep -v USDT $OUT/pc_log.txt | grep -v "^  " | tail -45
