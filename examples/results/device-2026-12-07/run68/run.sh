# run68 (any GPU, about 6 min): the shared experts on a second captured stream (passes/overlap_shared_experts.py,
# Session.load's default) vs one stream. (1) GPU tests: the two-stream step's greedy tokens equal one stream's
# (bundled model cut to 2 layers, h100 target), the side stream's split counters; the FP8 GEMM/GEMV tests (the
# split counters changed). (2) The 2-layer v4-flash-slice decode step, FP8 block experts, whole-step CUDA graph,
# batch 1 interleaved (side, one, side, one), then batch 8 once each. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-400}
P="examples/profile_step.py --layers 2 --expert-format fp8_block --top 8"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 200 python -m pytest -q -m gpu -p no:logging tests/test_overlap_shared_experts.py tests/test_kernels_fp8_gemm.py \
  2>&1 | tail -5 | tee $OUT/gpu_tests.txt
run() {  # label batch [profile_step args]
  [ $((SECONDS + 60)) -lt $B ] || { echo "$1 skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; return; }
  timeout 70 python $P --batch $2 "${@:3}" > /tmp/p.txt 2>&1
  { echo "### $1"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|(critical path) |\|side stream\|Error" /tmp/p.txt | sed "s|^|$1: |" | tee -a $OUT/steps.txt
}
run "b1 side" 1; run "b1 one" 1 --one-stream; run "b1 side" 1; run "b1 one" 1 --one-stream
run "b8 side" 8; run "b8 one" 8 --one-stream
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
