#!/bin/bash
# run31: the FP4 GEMV with several assignments per weight read (Fp4GemvConfig.rows): GPU tests, the
# kernel against the one before it (rows 1 and 4, same process), then the slice's teacher-forced grid in
# deterministic mode with MXFP4 experts (moe_experts_fp4_bi now runs rows 4) to compare with run28
cd "$(dirname "$0")/../../../.."
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.txt 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpu.txt
rm -rf /tmp/pc /tmp/fs /tmp/fb
T0=$(date +%s)
timeout 200 python examples/results/device-2026-12-05d/run31/old_vs_new.py > $OUT/old_vs_new_log.txt 2>&1
echo "old_vs_new rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/old_vs_new_log.txt
T1=$(date +%s)
timeout 150 python -m pytest -v -m gpu tests/test_kernels_moe_fp4_gemv.py tests/test_kernels_batch_invariant.py \
    tests/test_deterministic.py -k "fp4 or mxfp4 or gemv" -p no:logging --tb=short > $OUT/gpu_tests.txt 2>&1
echo "rc=$? $(( $(date +%s) - T1 )) s" >> $OUT/gpu_tests.txt
T2=$(date +%s)
timeout $(( 590 - (T2 - T0) )) python examples/bench_mtp_forced.py --slice /tmp/fs --deterministic \
    --expert-format mxfp4_w4a16 --compile-batches 1,8,32,64 --batches 1,8,32,64 \
    --budget-s $(( 545 - (T2 - T0) )) --out $OUT/forced_slice_det_mxfp4.json > $OUT/forced_log.txt 2>&1
echo "bench rc=$? $(( $(date +%s) - T2 )) s" >> $OUT/forced_log.txt
cat $OUT/gpu.txt
grep "^|" $OUT/old_vs_new_log.txt; tail -3 $OUT/old_vs_new_log.txt
grep -E "PASS|FAIL|passed|failed|rc=|Error" $OUT/gpu_tests.txt | tail -14
grep "^|" $OUT/forced_log.txt | tail -40; tail -3 $OUT/forced_log.txt
