# run59 (any GPU, ~9 min; (4), (3), (2) in that order, (2) while the budget lasts): (1) GPU tests of the grouped wo_a (fp32 rows on the GEMV's CUDA-core and tensor-core
# paths), fp8_gemm's GEMV, linear_f32's GEMV and the mHC post-mix's second y (fuse_moe_sum); (2) the 2-layer
# slice's batch-8 step on the GPU alone with wo_a's 8 fp32 rows on the GEMV's tensor-core tile
# (grouped_linear.FP8_GEMV_MAX_M = 16) vs the 16-row tile (1, the default), interleaved; (3) the batch-1 step with
# `linear_f32` (the routers' gate, the compressor and indexer projections) on kernels/linear_f32.py's one-token
# GEMV (`--kernels linear_f32=fused` and linear_f32.GEMV_MAX_ELEMENTS = 16M) vs cuBLAS (split-K and its reduce,
# outside the PDL chain), interleaved; (4) the batch-1 step with the MoE's routed + shared sum folded into the
# post-mix (fuse_moe_sum, in the pipeline) vs without the pass (`--skip-passes fuse_moe_sum`), interleaved.
# If (2) or (3) wins, FP8_GEMV_MAX_M = 16 / the targets' `linear_f32: fused` with GEMV_MAX_ELEMENTS become defaults
# (run61's patches); if (4) loses, fuse_moe_sum leaves the pipeline.
# B=SECONDS budget. At most 8 files to $OUT: the profiles are appended to one file.
export PYTHONPATH=$PWD
B=${B:-560}
K=examples/results/device-2026-12-06/run52/knobs.py
P="examples/profile_step.py --layers 2 --expert-format fp8_block --top 8"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 120 python -m pytest -q -m gpu tests/test_kernels_fp8_grouped_linear.py tests/test_kernels_fp8_gemm.py \
  tests/test_kernels_linear_f32.py tests/test_fuse_moe_sum.py > $OUT/gpu_tests.txt 2>&1
echo rc=$? >> $OUT/gpu_tests.txt; tail -2 $OUT/gpu_tests.txt
run() {  # label batch knob [profile_step args]
  [ $((SECONDS + 40)) -lt $B ] || { echo "$1 skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; return; }
  timeout 50 python $K $3 -- $P --batch $2 "${@:4}" > /tmp/p.txt 2>&1
  { echo "### $1"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|(critical path) |\|Error" /tmp/p.txt | sed "s|^|$1: |" | tee -a $OUT/steps.txt
}
for v in 1 0 1 0; do
  if [ $v = 1 ]; then run "b1 linear_f32 gemv" 1 linear_f32.GEMV_MAX_ELEMENTS=16777216 --kernels linear_f32=fused
  else run "b1 linear_f32 cublas" 1 linear_f32.GEMV_MAX_ELEMENTS=0; fi
done
for v in 1 0 1 0; do
  if [ $v = 1 ]; then run "b1 moe_sum folded" 1 grouped_linear.FP8_GEMV_MAX_M=1
  else run "b1 moe_sum unfolded" 1 grouped_linear.FP8_GEMV_MAX_M=1 --skip-passes fuse_moe_sum; fi
done
for v in 16 1 16 1; do run "b8 wo_a gemv max $v" 8 grouped_linear.FP8_GEMV_MAX_M=$v; done  # while B lasts
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
