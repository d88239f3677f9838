# run52 call B (any GPU, ~9 min; if device time is left after run.sh): (1) pytest -m gpu for the FP8 block experts' decode GEMV
# (kernels/moe_fp8_gemv.py) and tests/test_deterministic.py with A_REG on and the tree's
# SERIAL_SPLIT_MIN_TILES; (2) the GEMV against the tile in the default mode (FP8 block experts, FP8 dense):
# `moe_grouped.FP8_GEMV_MAX_ASSIGN` 64 / 0 / 64 / 0 around bench_deterministic's default and
# deterministic-fp8 steps at batch 1 / 8 / 64 (the deterministic mode does not use it: its own row of
# side-by-side figures); (3) the batch-1 step profiled with it. B=SECONDS budget. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-560}
R=examples/results/device-2026-12-06/run52
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 90 python -m pytest -q -m gpu tests/test_kernels_moe_fp8_gemv.py > $OUT/gpu_gemv.txt 2>&1
echo rc=$? >> $OUT/gpu_gemv.txt; tail -2 $OUT/gpu_gemv.txt
timeout 230 python -m pytest -q -m gpu tests/test_deterministic.py --durations=0 > $OUT/gpu_det.txt 2>&1
echo rc=$? >> $OUT/gpu_det.txt; tail -8 $OUT/gpu_det.txt
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
for g in 64 0 64 0; do
  [ $((SECONDS + 60)) -lt $B ] || { echo "skipped gemv $g at ${SECONDS}s" | tee -a $OUT/steps.txt; continue; }
  timeout 70 python $R/knobs.py moe_grouped.FP8_GEMV_MAX_ASSIGN=$g -- examples/bench_deterministic.py --layers 2 \
    --modes default deterministic-fp8 --batches 1 8 64 2>&1 | grep "^default\|^deterministic" \
    | sed "s/^/gemv $g: /" | tee -a $OUT/steps.txt
done
[ $((SECONDS + 45)) -lt $B ] && timeout 50 python $R/knobs.py moe_grouped.FP8_GEMV_MAX_ASSIGN=64 -- \
  examples/profile_step.py --layers 2 --expert-format fp8_block --batch 1 --top 12 > $OUT/b1_gemv.txt 2>&1
grep "^== full\|^| routed\|^| dense" $OUT/b1_gemv.txt | tee -a $OUT/steps.txt
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
