# run63 (any GPU, ~9 min; planned after the thirty-second session): what run59-62 left untimed. (1) The deterministic
# decode step at batch 1 and 8 with hc_pre's 16-row tile (`mhc.HC_BI_ROW_BLOCK` 16, the default since `c6b709f`:
# one row in a 16-row tile at batch 1) vs the one-row kernel (1), interleaved; (2) [the FP8 experts' one-token GEMV A/B:
# run65 timed it, dropped here]; (3) while the
# budget lasts, the slice's deterministic teacher-forced MTP grid with the new defaults (run48's call B; its
# batch-64 cells α 0.9, k = 2 / 3 are still missing).
# B=SECONDS budget. At most 8 files to $OUT: the profiles are appended to one file.
export PYTHONPATH=$PWD
B=${B:-560}
K=examples/results/device-2026-12-06/run52/knobs.py
P="examples/profile_step.py --layers 2 --expert-format fp8_block --top 8"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
run() {  # label batch knob [profile_step args]
  [ $((SECONDS + 45)) -lt $B ] || { echo "$1 skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; return; }
  timeout 55 python $K $3 -- $P --batch $2 "${@:4}" > /tmp/p.txt 2>&1
  { echo "### $1"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|(critical path) |\|Error" /tmp/p.txt | sed "s|^|$1: |" | tee -a $OUT/steps.txt
}
if [ -z "$GRID_ONLY" ]; then  # GRID_ONLY=1: the MTP grid alone (the tile A/B ran in the thirty-sixth session)
  for v in 16 1 16 1; do run "det b1 row block $v" 1 mhc.HC_BI_ROW_BLOCK=$v --deterministic; done
  for v in 16 1; do run "det b8 row block $v" 8 mhc.HC_BI_ROW_BLOCK=$v --deterministic; done
fi
if [ $((SECONDS + 200)) -lt $B ]; then
  timeout $((B - SECONDS)) python examples/bench_mtp_forced.py --slice /tmp/fs --deterministic --expert-format fp8_block \
    --compile-batches 1,8,32,64 --batches 1,8,32,64 --budget-s $((B - SECONDS - 30)) \
    --out $OUT/forced_slice_det_fp8.json > $OUT/forced.log 2>&1; echo rc=$? >> $OUT/forced.log
  tail -30 $OUT/forced.log; rm -rf /tmp/fs
fi
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
