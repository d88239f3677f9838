# run64 call D (warm machine): the one-token GEMV's K split with up to 8 programs per SM (fp8_gemv.GEMV_PROGRAMS_PER_SM
# 8: wo_b split 8, wq_b split 2) vs 2 (the default), the 2-layer step at batch 1 on the GPU alone, interleaved
# (VALS="16 8 16 8 32": the second call).
export PYTHONPATH=$PWD
B=${B:-240}
K=examples/results/device-2026-12-06/run52/knobs.py
P="examples/profile_step.py --layers 2 --expert-format fp8_block --top 8"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
run() {  # label batch knob [profile_step args]
  [ $((SECONDS + 40)) -lt $B ] || { echo "$1 skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; return; }
  timeout 55 python $K $3 -- $P --batch $2 "${@:4}" > /tmp/p.txt 2>&1
  { echo "### $1"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|(critical path) |\|Error" /tmp/p.txt | sed "s|^|$1: |" | tee -a $OUT/steps.txt
}
for v in ${VALS:-8 2 8 2 4}; do run "b1 gemv programs/SM $v" 1 fp8_gemv.GEMV_PROGRAMS_PER_SM=$v --skip-passes prefetch_weights; done
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
