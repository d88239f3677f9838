# run64 call B (warm machine): the prefetch op was missing from split_at_routers.OP_CAPTURE, so call A's "on" steps ran
# piecewise (not comparable). Again with it capture-safe: GPU test, then b1 on / off twice, b8 on / off.
export PYTHONPATH=$PWD
B=${B:-300}
H=examples/results/device-2026-12-06/run64
P="examples/profile_step.py --layers 2 --expert-format fp8_block --top 8"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 60 python -m pytest -q -s -p no:logging -m gpu tests/test_kernels_l2_prefetch.py > $OUT/gpu_tests.txt 2>&1
grep "cold\|passed\|failed" $OUT/gpu_tests.txt | tee -a $OUT/steps.txt
run() {  # label batch bytes mode evict [profile_step args]
  [ $((SECONDS + 40)) -lt $B ] || { echo "$1 skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; return; }
  timeout 55 python $H/pf.py $3 $4 $5 -- $P --batch $2 "${@:6}" > /tmp/p.txt 2>&1
  { echo "### $1"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|^== graphs\|(critical path) |\|Error" /tmp/p.txt | sed "s|^|$1: |" | tee -a $OUT/steps.txt
}
M=$((32 << 20))
run "b1 on" 1 $M 0 0 --timeline
run "b1 off" 1 $M 0 0 --skip-passes prefetch_weights
run "b1 on" 1 $M 0 0
run "b1 off" 1 $M 0 0 --skip-passes prefetch_weights
run "b8 on" 8 $M 0 0
run "b8 off" 8 $M 0 0 --skip-passes prefetch_weights
run "b1 on evict-first" 1 $M 0 1
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
