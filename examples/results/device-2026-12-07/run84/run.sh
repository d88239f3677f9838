# Ran in the forty-second session (run84_out/): within the spread; defer_sinkhorn was then removed, so this script and defer.py no longer run on the tree.
# run84 (any GPU, about 8 min; written in the forty-first session, not yet run): the deferred mHC Sinkhorn
# (passes/defer_sinkhorn.py, `Target.defer_sinkhorn`, off on every target): each site's Sinkhorn runs in the post-mix
# that reads comb, before its PDL wait, instead of at the end of the pre-mix's finish (run72's batch-1 timeline: the
# finish ends about 5.8 µs after the post-mix that feeds it, the rms_norm after it 2 µs more; five sites a 2-layer
# step, nine in the full slice).
#  1. GPU tests: tests/test_defer_sinkhorn.py -m gpu (the kernels at Flash dims; an h200 artifact with the pass on,
#     its greedy tokens against eager's).
#  2. The 2-layer v4-flash-slice step (FP8 block experts, whole-step CUDA graph, GPU alone): on vs off at batch 1
#     and 8 interleaved twice, batch 64 once, and one batch-1 timeline with it on.
# Adopt it (defer_sinkhorn=True on h100 / h200 in dsv4c/targets.py) if it wins; then the full slice
# (`B=575 bash ../device-2026-12-06/run61/run.sh`). At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-480}
D="python examples/results/device-2026-12-07/run84/defer.py"
P="examples/profile_step.py --layers 2 --expert-format fp8_block --top 8"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 150 python -m pytest -q -m gpu -p no:logging tests/test_defer_sinkhorn.py 2>&1 | tail -3 | tee $OUT/gpu_tests.txt
run() {  # label 0|1 profile_step args...
  [ $((SECONDS + 60)) -lt $B ] || { echo "$1 skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; return; }
  timeout 90 $D $2 -- $P "${@:3}" > /tmp/p.txt 2>&1
  { echo "### $1"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|(critical path) |\|Error" /tmp/p.txt | sed "s|^|$1: |" | tee -a $OUT/steps.txt
}
for rep in 1 2; do
  for b in 1 8; do run "b$b off" 0 --batch $b; run "b$b on" 1 --batch $b; done
done
run "b64 off" 0 --batch 64; run "b64 on" 1 --batch 64
run "b1 on timeline" 1 --batch 1 --timeline
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
