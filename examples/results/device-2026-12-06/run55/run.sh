# run55 (any GPU, ~5 min): (1) the FP8 block experts' decode GEMV (64) against the tile (0) at batch 1, timed on
# the GPU alone (profile_step's new second timing: a sleep kernel hides the host's launch work; run54's timelines
# showed the replayed kernels spanning 0.86 ms of 0.98-1.07 ms steps); (2) the slice's teacher-forced MTP grid,
# deterministic with FP8 block experts (A_REG on), with what is left of B.
# B=SECONDS budget. At most 8 files to $OUT: the profiles are appended to one file.
export PYTHONPATH=$PWD
B=${B:-320}
G=examples/results/device-2026-12-06/run54/gemv.py
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
for g in 64 0; do
  timeout 60 python $G $g early -- examples/profile_step.py --layers 2 --expert-format fp8_block --batch 1 \
    --top 12 > /tmp/p.txt 2>&1
  { echo "### b1 gemv $g"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|^| routed\|Error" /tmp/p.txt | sed "s/^/b1 gemv $g: /" | tee -a $OUT/steps.txt
done
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
[ $((SECONDS + 150)) -lt $B ] || { echo "grid skipped: fewer than 150 s left of B=$B" | tee -a $OUT/steps.txt; exit 0; }
timeout $((B - SECONDS)) python examples/bench_mtp_forced.py --slice /tmp/fs --deterministic \
  --expert-format fp8_block --compile-batches 1,8,32,64 --batches 1,8,32,64 --budget-s $((B - SECONDS - 25)) \
  --out $OUT/forced_slice_det_fp8.json > $OUT/forced.log 2>&1; echo rc=$? >> $OUT/forced.log
tail -30 $OUT/forced.log; rm -rf /tmp/fs
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
