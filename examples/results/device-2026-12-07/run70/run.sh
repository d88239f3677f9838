# run70 (any GPU, about 7 min; ran on `b4706c4`; its passes/overlap_early_ops.py was then reverted, not adopted,
# see BENCHMARKS.md): the compressor projections and the hash lookup launched on the side stream
# where their inputs are ready (passes/overlap_early_ops.py, Session.load's default with the shared experts) vs
# the shared experts alone on it (early_off.py). (1) GPU tests: the two-stream step's greedy tokens equal one
# stream's (bundled model cut to 2 layers, h100 target; 4 side calls). (2) The 2-layer v4-flash-slice decode
# step (a hash layer, a ratio-4 layer), FP8 block experts, whole-step CUDA graph, batch 1 interleaved (early,
# off, early, off), then batch 8 once each. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-450}
D=examples/results/device-2026-12-07/run70
P="examples/profile_step.py --layers 2 --expert-format fp8_block --top 8"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
git log -1 --format=%h | tee -a $OUT/steps.txt; git status --short | head -5 | tee -a $OUT/steps.txt
timeout 150 python -m pytest -q -m gpu -p no:logging tests/test_overlap_shared_experts.py 2>&1 | tail -3 \
  | tee $OUT/gpu_tests.txt
run() {  # label batch [wrapper]
  [ $((SECONDS + 60)) -lt $B ] || { echo "$1 skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; return; }
  timeout 70 python $3 $P --batch $2 > /tmp/p.txt 2>&1
  { echo "### $1"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|(critical path) |\|side stream\|Error" /tmp/p.txt | sed "s|^|$1: |" | tee -a $OUT/steps.txt
}
run "b1 early" 1; run "b1 off" 1 $D/early_off.py; run "b1 early" 1; run "b1 off" 1 $D/early_off.py
run "b8 early" 8; run "b8 off" 8 $D/early_off.py
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
