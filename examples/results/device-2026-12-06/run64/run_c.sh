# run64 call C (warm machine): the GEMV from a cold vs warm L2 (gemv_l2.py), then run63's FP8 experts' one-token
# GEMV A/B (FP8_GEMV_MAX_ASSIGN 8 vs 0) on the GPU alone, while the budget lasts.
export PYTHONPATH=$PWD
B=${B:-300}
K=examples/results/device-2026-12-06/run52/knobs.py
P="examples/profile_step.py --layers 2 --expert-format fp8_block --top 8"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
timeout 60 python examples/results/device-2026-12-06/run64/gemv_l2.py 2>&1 | tee $OUT/gemv_l2.txt
run() {  # label batch knob [profile_step args]
  [ $((SECONDS + 40)) -lt $B ] || { echo "$1 skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; return; }
  timeout 55 python $K $3 -- $P --batch $2 "${@:4}" > /tmp/p.txt 2>&1
  { echo "### $1"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|(critical path) |\|Error" /tmp/p.txt | sed "s|^|$1: |" | tee -a $OUT/steps.txt
}
for v in 8 0 8 0; do run "b1 moe gemv $v" 1 moe_grouped.FP8_GEMV_MAX_ASSIGN=$v --skip-passes prefetch_weights; done
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
