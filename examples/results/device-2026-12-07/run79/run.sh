# run79 (any GPU, about 9 min; fortieth session): three pieces in one call, each with its own output folder.
#  1. the shared expert's side call after the router (run74's fork_after_router.py) against the tree, interleaved
#     twice at batch 8 and 64 (run78 had one repetition: b8 1.458 vs 1.467 ms) -> $OUT/fork
#  2. run77: the plain batch-64 step per kernel class, top 20 and its timeline -> $OUT/b64
#  3. run76: the dense FP8 GEMV at 16-64 tokens against experimental tiles, with the time left -> $OUT/m64
# At most 8 files to $OUT in all.
export PYTHONPATH=$PWD
B=${B:-560}
D=examples/results/device-2026-12-07
P="examples/profile_step.py --layers 2 --expert-format fp8_block --top 8"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
O=$OUT; mkdir -p $O/fork $O/b64 $O/m64
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/fork/steps.txt
run() {  # label batch [wrapper]
  [ $((SECONDS + 40)) -lt $B ] || { echo "$1 skipped at ${SECONDS}s" | tee -a $O/fork/steps.txt; return; }
  timeout 60 python $3 $P --batch $2 > /tmp/p.txt 2>&1
  { echo "### $1"; cat /tmp/p.txt; } >> $O/fork/profiles.txt
  grep "^== full\|(critical path) |\|Error" /tmp/p.txt | sed "s|^|$1: |" | tee -a $O/fork/steps.txt
}
for rep in 1 2; do
  for b in 8 64; do run "b$b base" $b; run "b$b after" $b $D/run74/fork_after_router.py; done
done
echo "fork done at ${SECONDS}s" | tee -a $O/fork/steps.txt
OUT=$O/b64 B=$((B - SECONDS)) bash $D/run77/run.sh
left=$((B - SECONDS))
if [ $left -gt 120 ]; then OUT=$O/m64 B=$left bash $D/run76/run.sh; else echo "m64 skipped, ${left}s left" > $O/m64/steps.txt; fi
