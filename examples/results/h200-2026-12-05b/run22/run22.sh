#!/bin/bash
# run22: issue 23 on the GPU: the deterministic GPU tests (round graphs and prefill graphs now on by default)
# while the slice compiles in deterministic mode with --mtp 3, then the slice's teacher-forced grid
# (alpha 0.6 / 0.8 / 0.9, k = 1..3, batch 1 / 8 / 32 / 64) alone on the GPU
cd "$(dirname "$0")/../../../.."
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.txt 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpu.txt
T0=$(date +%s)
( timeout 300 python -m pytest -v -m gpu tests/test_deterministic.py -p no:logging --tb=long > $OUT/det_gpu_tests.txt 2>&1;
  echo "rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/det_gpu_tests.txt ) &
timeout 330 python examples/bench_mtp_forced.py --slice /tmp/fs --deterministic --compile-batches 1,8,32,64 \
  --compile-only > $OUT/forced_slice_log.txt 2>&1
echo "compile rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/forced_slice_log.txt
wait
LEFT=$(( 585 - ($(date +%s) - T0) ))
timeout $LEFT python examples/bench_mtp_forced.py --slice /tmp/fs --deterministic --compile-batches 1,8,32,64 \
  --batches 1,8,32,64 --budget-s $(( LEFT - 45 )) --out $OUT/forced_slice.json >> $OUT/forced_slice_log.txt 2>&1
echo "grid rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/forced_slice_log.txt
cat $OUT/gpu.txt
grep -E "PASSED|FAILED|passed|failed|rc=|^E " $OUT/det_gpu_tests.txt | tail -12
grep -v USDT $OUT/forced_slice_log.txt | tail -40
