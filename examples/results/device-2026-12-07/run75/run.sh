# run75 (any GPU, about 5 min; planned in the thirty-eighth session, run in the thirty-ninth at B=120: run75_out): `linear_f32_tc` (kernels/
# linear_f32.py: the routers' gates and the compressor / indexer projections at 2-16 token rows on one launch of
# batch_invariant's bi_matmul decode tile, in the PDL chain, instead of cuBLAS's split-K GEMM and its reduce) vs cuBLAS (TC_MAX_M 0).
# (1) GPU tests of kernels/linear_f32.py. (2) The 2-layer v4-flash-slice decode step at batch 8, FP8 block experts,
# whole-step CUDA graph, on the GPU alone, interleaved (tc, cublas, tc, cublas). Set TC_MAX_M to 16 if tc wins.
# At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-330}
P="examples/profile_step.py --layers 2 --expert-format fp8_block --top 8"
K="examples/results/device-2026-12-06/run52/knobs.py linear_f32.TC_MAX_M=16 --"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 90 python -m pytest -q -m gpu -p no:logging tests/test_kernels_linear_f32.py 2>&1 | tail -3 | tee $OUT/gpu_tests.txt
run() {  # label batch [wrapper...]
  [ $((SECONDS + 50)) -lt $B ] || { echo "$1 skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; return; }
  timeout 70 python ${@:3} $P --batch $2 > /tmp/p.txt 2>&1
  { echo "### $1"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|(critical path) |\|Error" /tmp/p.txt | sed "s|^|$1: |" | tee -a $OUT/steps.txt
}
run "b8 tc" 8 $K; run "b8 cublas" 8; run "b8 tc" 8 $K; run "b8 cublas" 8
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
