# run59 (any GPU, ~7.5 min): (1) GPU tests of the grouped wo_a (fp32 rows on the GEMV's CUDA-core and tensor-core
# paths) and fp8_gemm's GEMV; (2) the 2-layer slice's batch-8 step on the GPU alone with wo_a's 8 fp32 rows on the
# GEMV's tensor-core tile (grouped_linear.FP8_GEMV_MAX_M = 16) vs the 16-row tile (1, the default), interleaved;
# (3) what run58 had no time for: the batch-1 step with the FP8 experts' GEMV off / on (FP8_GEMV_MAX_ASSIGN 0 / 8,
# the default 8), interleaved; (4) the batch-1 step with `linear_f32` (the routers' gate, the compressor and
# indexer projections) on kernels/linear_f32.py's one-token GEMV (`--kernels linear_f32=fused` and
# linear_f32.GEMV_MAX_ELEMENTS = 16M) vs cuBLAS (split-K and its reduce, outside the PDL chain), interleaved.
# If (2) or (4) wins, FP8_GEMV_MAX_M = 16 / the targets' `linear_f32: fused` with GEMV_MAX_ELEMENTS become defaults.
# B=SECONDS budget. At most 8 files to $OUT: the profiles are appended to one file.
export PYTHONPATH=$PWD
B=${B:-470}
K=examples/results/device-2026-12-06/run52/knobs.py
P="examples/profile_step.py --layers 2 --expert-format fp8_block --top 8"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 100 python -m pytest -q -m gpu tests/test_kernels_fp8_grouped_linear.py tests/test_kernels_fp8_gemm.py \
  tests/test_kernels_linear_f32.py > $OUT/gpu_tests.txt 2>&1
echo rc=$? >> $OUT/gpu_tests.txt; tail -2 $OUT/gpu_tests.txt
run() {  # label batch knob [profile_step args]
  [ $((SECONDS + 40)) -lt $B ] || { echo "$1 skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; return; }
  timeout 50 python $K $3 -- $P --batch $2 "${@:4}" > /tmp/p.txt 2>&1
  { echo "### $1"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|(critical path) |\|Error" /tmp/p.txt | sed "s|^|$1: |" | tee -a $OUT/steps.txt
}
for v in 16 1 16 1; do run "b8 wo_a gemv max $v" 8 grouped_linear.FP8_GEMV_MAX_M=$v; done
for v in 0 8 0 8; do run "b1 moe gemv $v" 1 moe_grouped.FP8_GEMV_MAX_ASSIGN=$v; done
for v in 1 0 1 0; do
  if [ $v = 1 ]; then run "b1 linear_f32 gemv" 1 linear_f32.GEMV_MAX_ELEMENTS=16777216 --kernels linear_f32=fused
  else run "b1 linear_f32 cublas" 1 linear_f32.GEMV_MAX_ELEMENTS=0; fi
done
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
