#!/bin/bash
# run19: the GPU tests of the code written without a device since run18 (round graphs, stash, warm_up,
# paged/prefix/batched prefill, deterministic mode)
cd "$(dirname "$0")/../../../.."
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.txt 2>&1
T0=$(date +%s)
timeout 290 python -m pytest -v -s -m gpu tests/test_mtp_pipeline.py -p no:logging --tb=short > $OUT/mtp_gpu_tests.txt 2>&1
echo "mtp tests rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/mtp_gpu_tests.txt
timeout 270 python -m pytest -v -m gpu tests/test_paged_session.py tests/test_prefix_cache.py tests/test_batched_prefill.py tests/test_deterministic.py -p no:logging --tb=short > $OUT/gpu_tests.txt 2>&1
echo "other tests rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
grep -E "^E |PASSED|FAILED|ERROR|passed|failed|rc=|^ +[18] " $OUT/mtp_gpu_tests.txt $OUT/gpu_tests.txt | head -60
