# run47 call C (planned, any GPU, ~9 min): the deterministic mode with FP8 block experts (`moe_experts_fp8_bi`,
# `--expert-format fp8_block`: the grouped tensor-core tile at every token count, an expert read once per 16 of
# its assignments; untimed when written). Its GPU test, its decode step beside the default and the MXFP4
# deterministic mode (batch 1 / 8 / 64), then the slice's teacher-forced MTP grid with it (issue 23: the MXFP4
# GEMV's verify reached 28-40% of the bound at batch 32-64, run42).
# B=SECONDS budget. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-580}
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 90 python -m pytest -q -m gpu tests/test_kernels_batch_invariant.py -k fp8_experts > $OUT/gpu_tests.txt 2>&1
echo rc=$? >> $OUT/gpu_tests.txt; tail -2 $OUT/gpu_tests.txt
python examples/bench_deterministic.py --layers 2 --modes default deterministic-fp8 deterministic-mxfp4 \
  --batches 1 8 64 --out $OUT/det_fp8.json 2>&1 | tail -6 | tee -a $OUT/steps.txt
timeout $((B - SECONDS)) python examples/bench_mtp_forced.py --slice /tmp/fs --deterministic --expert-format fp8_block \
  --compile-batches 1,8,32,64 --batches 1,8,32,64 --budget-s $((B - SECONDS - 30)) \
  --out $OUT/forced_slice_det_fp8.json > $OUT/forced.log 2>&1; echo rc=$? >> $OUT/forced.log
tail -30 $OUT/forced.log
rm -rf /tmp/fs
