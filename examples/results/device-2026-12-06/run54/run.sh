# run54 (any GPU, ~9 min): why run53's FP8 block experts' decode GEMV made the default step slower (b1 1.04 vs
# 0.95 ms) though its kernels took less time (180 vs 224 us): (1) the replayed step kernel by kernel
# (profile_step --timeline) with the GEMV requesting its first weights before the PDL wait (early), after it
# (late), and the tile (0), at batch 1, and late vs the tile at batch 8; (2) the slice's teacher-forced MTP
# grid, deterministic with FP8 block experts (A_REG on; run53 left no time for it).
# B=SECONDS budget. At most 8 files to $OUT: the profiles are appended to one file.
export PYTHONPATH=$PWD
B=${B:-540}
G=examples/results/device-2026-12-06/run54/gemv.py
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
for v in "1 64 early" "1 0 early" "1 64 late" "8 64 late" "8 0 early"; do
  set -- $v
  timeout 60 python $G $2 $3 -- examples/profile_step.py --layers 2 --expert-format fp8_block --batch $1 \
    --top 12 --timeline > /tmp/p.txt 2>&1
  { echo "### b$1 gemv $2 $3"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|^| routed\|Error" /tmp/p.txt | sed "s/^/b$1 gemv $2 $3: /" | tee -a $OUT/steps.txt
done
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
[ $((SECONDS + 280)) -lt $B ] || { echo "grid skipped: fewer than 280 s left of B=$B" | tee -a $OUT/steps.txt; exit 0; }
timeout $((B - SECONDS)) python examples/bench_mtp_forced.py --slice /tmp/fs --deterministic \
  --expert-format fp8_block --compile-batches 1,8,32,64 --batches 1,8,32,64 --budget-s $((B - SECONDS - 40)) \
  --out $OUT/forced_slice_det_fp8.json > $OUT/forced.log 2>&1; echo rc=$? >> $OUT/forced.log
tail -40 $OUT/forced.log | grep -v "^|" ; rm -rf /tmp/fs
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
