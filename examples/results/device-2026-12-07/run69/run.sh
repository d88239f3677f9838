# run69 (any GPU, about 7 min; forty-third session): where the deterministic verify's time goes at batch 32 / 64
# (issue 23: the MTP grid's batch-32 / 64 cells sit at 52-75% of their byte bound; at batch 64 a k = 1 round
# costs 2.5 k = 0 steps where the bound allows about 1.5). The 2-layer v4-flash-slice, FP8 block experts,
# whole-step CUDA graph, GPU alone: the deterministic decode step (k = 0) beside the deterministic verify of
# 1 + k tokens a row, and the default mode's verify at the same shape for what batch invariance costs; and the
# deterministic decode tile's 8 token groups a program (`batch_invariant.DECODE_MAX_GROUPS` 8, never timed) in the verify.
# B=SECONDS budget. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-480}
P="python examples/results/device-2026-12-06/run52/knobs.py"
S="examples/profile_step.py --layers 2 --expert-format fp8_block --top 12"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
run() {  # label MODULE.NAME=INT profile_step args...
  [ $((SECONDS + 75)) -lt $B ] || { echo "$1 skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; return; }
  timeout 110 $P $2 -- $S "${@:3}" > /tmp/p.txt 2>&1
  { echo "### $1"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|(critical path) |\|Error" /tmp/p.txt | sed "s|^|$1: |" | tee -a $OUT/steps.txt
}
G=batch_invariant.DECODE_MAX_GROUPS
run "det b64 verify 3" $G=4 --deterministic --batch 64 --verify 3
run "det b64 verify 3 groups 8" $G=8 --deterministic --batch 64 --verify 3
run "det b64 decode" $G=4 --deterministic --batch 64
run "default b64 verify 3" $G=4 --batch 64 --verify 3
run "det b64 verify 1" $G=4 --deterministic --batch 64 --verify 1
run "det b32 verify 3" $G=4 --deterministic --batch 32 --verify 3
run "det b32 verify 3 groups 8" $G=8 --deterministic --batch 32 --verify 3
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
