#!/bin/bash
# run27: the admission batching (one reset per cache, grouped restores and stores, one host copy of a call's
# first-token logits) measured by the prefix-cache bench; its GPU tests in the background during the build
cd "$(dirname "$0")/../../../.."
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.txt 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpu.txt
df -h /tmp | tail -1 >> $OUT/gpu.txt
rm -rf /tmp/pc /tmp/fs /tmp/fb
T0=$(date +%s)
( timeout 200 python -m pytest -v -m gpu tests/test_prefix_cache.py tests/test_batched_prefill.py -p no:logging \
    --tb=long > $OUT/gpu_tests.txt 2>&1; echo "rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt ) &
timeout 540 python examples/bench_prefix_cache.py --paged --profile-prefill --work /tmp/pc --out $OUT/pc_paged.json \
    > $OUT/pc_log.txt 2>&1
echo "bench rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/pc_log.txt
wait
rm -rf /tmp/pc
cat $OUT/gpu.txt
grep -E "passed|failed|rc=|Error|error" $OUT/gpu_tests.txt | tail -8
grep -v USDT $OUT/pc_log.txt | grep -v "^  " | tail -45
