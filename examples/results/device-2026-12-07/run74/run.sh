# run74 (any GPU, about 6.5 min; planned in the thirty-eighth session; its variant ran inside run78 instead): the shared expert's side call
# after the router (fork_after_router.py: the router's latency-bound kernels launch first, the shared expert
# overlaps the routed experts' GEMMs) vs before it (the default since run68; run72's timelines show the router's
# first kernel 5 / 9-10 µs late at batch 1 / 8 behind the shared expert's GEMV). The 2-layer v4-flash-slice decode
# step, FP8 block experts, whole-step CUDA graph, on the GPU alone, interleaved at batch 1 and 8. Adopt 0 if it
# wins at both batches. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-400}
D=examples/results/device-2026-12-07/run74
P="examples/profile_step.py --layers 2 --expert-format fp8_block --top 8"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
run() {  # label batch [wrapper]
  [ $((SECONDS + 50)) -lt $B ] || { echo "$1 skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; return; }
  timeout 70 python $3 $P --batch $2 > /tmp/p.txt 2>&1
  { echo "### $1"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|(critical path) |\|Error" /tmp/p.txt | sed "s|^|$1: |" | tee -a $OUT/steps.txt
}
for b in 1 8; do
  run "b$b before" $b; run "b$b after" $b $D/fork_after_router.py
  run "b$b before" $b; run "b$b after" $b $D/fork_after_router.py
done
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
