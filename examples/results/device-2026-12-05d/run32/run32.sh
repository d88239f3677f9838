#!/bin/bash
# run32: run31's kernel comparison again (its import failed), then the 2-layer deterministic MXFP4 GPU test
cd "$(dirname "$0")/../../../.."
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.txt 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpu.txt
T0=$(date +%s)
timeout 240 python examples/results/device-2026-12-05d/run31/old_vs_new.py > $OUT/old_vs_new_log.txt 2>&1
echo "old_vs_new rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/old_vs_new_log.txt
T1=$(date +%s)
timeout 200 python -m pytest -v -m gpu tests/test_deterministic.py -k "mxfp4" -p no:logging --tb=short > $OUT/gpu_tests.txt 2>&1
echo "rc=$? $(( $(date +%s) - T1 )) s" >> $OUT/gpu_tests.txt
cat $OUT/gpu.txt
grep "^|" $OUT/old_vs_new_log.txt; tail -3 $OUT/old_vs_new_log.txt
grep -E "PASS|FAIL|passed|failed|rc=|Error" $OUT/gpu_tests.txt | tail -6
