# Ran in the forty-second session (run85_out/); HC_ROW_GROUP was then removed, so its A/B no longer runs on the tree.
# run85 (any GPU, about 9 min; forty-second session): the deterministic mode's GPU tests, which the budget cut twice
# (over 200 s; route_prep_fused now runs in the deterministic verify at batch 64), then what is left of run83 (never run; deleted since): the mHC
# row kernel with 8 rows a program (`mhc.HC_ROW_GROUP`) against 1 in the 2-layer v4-flash-slice step (FP8 block
# experts, whole-step CUDA graph, GPU alone) at batch 64 and 32, interleaved.
# B=SECONDS budget. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-560}
K="python examples/results/device-2026-12-06/run52/knobs.py"
P="examples/profile_step.py --layers 2 --expert-format fp8_block --top 8"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout ${DET_S:-330} python -m pytest -q -m gpu -p no:logging --durations=0 tests/test_deterministic.py > $OUT/det_tests.txt 2>&1
echo "det rc=$? at ${SECONDS}s" | tee -a $OUT/steps.txt; tail -12 $OUT/det_tests.txt
run() {  # label MODULE.NAME=INT profile_step args...
  [ $((SECONDS + 60)) -lt $B ] || { echo "$1 skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; return; }
  timeout 90 $K $2 -- $P "${@:3}" > /tmp/p.txt 2>&1
  { echo "### $1"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|(critical path) |\|Error" /tmp/p.txt | sed "s|^|$1: |" | tee -a $OUT/steps.txt
}
H=mhc.HC_ROW_GROUP
run "b64 group 1" $H=1 --batch 64; run "b64 group 8" $H=8 --batch 64
run "b32 group 1" $H=1 --batch 32; run "b32 group 8" $H=8 --batch 32
run "b64 group 8" $H=8 --batch 64; run "b64 group 1" $H=1 --batch 64
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
