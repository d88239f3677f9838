# run48 (twenty-eighth session, any GPU, ~9 min): run47's call B and the short half of call C in one call.
# tests/test_deterministic.py -m gpu after `704da21` (the decode tile's token groups) with the FP8-expert mode
# added (`moe_experts_fp8_bi`, never run on a GPU), the FP8-expert kernel's own GPU test, the FP8 wo_a kernel's
# 64-row token tile above 16 rows (run47/wo_a_tile.py) against the op's 16-row tiles at batch 8 / 64,
# interleaved twice, and the 2-layer slice's decode step in the default mode beside the deterministic modes
# with FP8 block and MXFP4 experts (batch 1 / 8 / 64).
# B=SECONDS budget. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-560}
R=examples/results/device-2026-12-06
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 60 python -m pytest -q -m gpu tests/test_kernels_batch_invariant.py -k fp8_experts > $OUT/gpu_tests.txt 2>&1
echo rc=$? >> $OUT/gpu_tests.txt; tail -2 $OUT/gpu_tests.txt
timeout 280 python -m pytest -q -m gpu tests/test_deterministic.py --durations=0 > $OUT/gpu_det.txt 2>&1
echo rc=$? >> $OUT/gpu_det.txt; tail -12 $OUT/gpu_det.txt
for t in 16 64 16 64; do
  timeout $((B - SECONDS - 40)) python $R/run47/wo_a_tile.py $t examples/bench_deterministic.py --layers 2 \
    --modes default-mxfp4 --batches 8 64 2>&1 | grep "^default" | sed "s/^/wo_a tile $t: /" | tee -a $OUT/steps.txt
done
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
timeout $((B - SECONDS)) python examples/bench_deterministic.py --layers 2 \
  --modes default deterministic-fp8 deterministic-mxfp4 --batches 1 8 64 --out $OUT/det_fp8.json 2>&1 \
  | tail -6 | tee -a $OUT/steps.txt
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
