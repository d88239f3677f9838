# run69 (any GPU, about 5 min; planned in the thirty-seventh session, not yet run): where the deterministic
# verify's time goes at batch 32 / 64 (issue 23's weakest cells, 54-77% of the byte bound). profile_step on the
# 2-layer v4-flash-slice, FP8 block experts, deterministic, the verify call of 1 + 3 tokens a row against the
# plain decode step of the same batch, per kernel class on the critical path. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-330}
P="examples/profile_step.py --layers 2 --expert-format fp8_block --deterministic --top 12"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
run() {  # label batch [profile_step args]
  [ $((SECONDS + 60)) -lt $B ] || { echo "$1 skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; return; }
  timeout 75 python $P --batch $2 "${@:3}" > /tmp/p.txt 2>&1
  { echo "### $1"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|(critical path) |\|Error" /tmp/p.txt | sed "s|^|$1: |" | tee -a $OUT/steps.txt
}
run "b64 verify k3" 64 --verify 3; run "b64 decode" 64
run "b32 verify k3" 32 --verify 3; run "b32 decode" 32
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
