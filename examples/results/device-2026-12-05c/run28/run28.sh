#!/bin/bash
# run28: deterministic mode with MXFP4 weight-only experts (moe_experts_fp4_bi): its GPU tests, then the
# slice's teacher-forced MTP grid in deterministic mode (the artifact keeps the experts' FP4 bytes, so it
# fits the disk beside the checkpoint)
cd "$(dirname "$0")/../../../.."
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.txt 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpu.txt
rm -rf /tmp/pc /tmp/fs /tmp/fb
df -h /tmp | tail -1 >> $OUT/gpu.txt
T0=$(date +%s)
timeout 150 python -m pytest -v -m gpu tests/test_kernels_batch_invariant.py tests/test_deterministic.py \
    -k "fp4 or mxfp4" -p no:logging --tb=long > $OUT/gpu_tests.txt 2>&1
echo "rc=$? $(( $(date +%s) - T0 )) s" >> $OUT/gpu_tests.txt
T1=$(date +%s)
timeout $(( 585 - (T1 - T0) )) python examples/bench_mtp_forced.py --slice /tmp/fs --deterministic \
    --expert-format mxfp4_w4a16 --compile-batches 1,8,32,64 --batches 1,8,32,64 \
    --budget-s $(( 540 - (T1 - T0) )) --out $OUT/forced_slice_det_mxfp4.json > $OUT/forced_log.txt 2>&1
echo "bench rc=$? $(( $(date +%s) - T1 )) s" >> $OUT/forced_log.txt
df -h /tmp | tail -1 >> $OUT/forced_log.txt
cat $OUT/gpu.txt
grep -E "PASS|FAIL|passed|failed|rc=|Error" $OUT/gpu_tests.txt | tail -12
grep -v "^  " $OUT/forced_log.txt | grep -v USDT | tail -40
