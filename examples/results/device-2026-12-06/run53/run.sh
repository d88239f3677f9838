# run53 (planned, any GPU, ~10 min): what run52 could not reach in its 300 s. (1) the rest of its GPU tests
# (fp8_gemm's decode GEMV at 8 and 64 tokens and its configs: the split counters left as found); (2) the FP8
# block experts' decode GEMV (`moe_grouped.FP8_GEMV_MAX_ASSIGN` 64) against the tile (0) in the default mode's
# batch-1 and batch-8 steps, profiled per kernel class, interleaved; (3) the deterministic verify (batch 64,
# k = 3) with the decode tile's serial split (`batch_invariant.SERIAL_SPLIT_MIN_TILES` 128) and without (0);
# (4) the slice's teacher-forced MTP grid, deterministic with FP8 block experts, with the faster of (3).
# run52's lesson: a bench_deterministic run of two modes takes more than 75 s; a profile about 35 s.
# B=SECONDS budget. At most 8 files to $OUT: the profiles are appended to one file.
export PYTHONPATH=$PWD
B=${B:-570}
K=examples/results/device-2026-12-06/run52/knobs.py
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 120 python -m pytest -q -m gpu tests/test_kernels_fp8_gemm.py -k "gemv_gpu" > $OUT/gpu_tests.txt 2>&1
echo rc=$? >> $OUT/gpu_tests.txt; tail -2 $OUT/gpu_tests.txt
for b in 1 8; do
  for g in 64 0 64 0; do
    timeout 60 python $K moe_grouped.FP8_GEMV_MAX_ASSIGN=$g -- examples/profile_step.py --layers 2 \
      --expert-format fp8_block --batch $b --top 12 > /tmp/p.txt 2>&1
    { echo "### b$b gemv $g"; cat /tmp/p.txt; } >> $OUT/profiles.txt
    grep "^== full\|^| routed\|Error" /tmp/p.txt | sed "s/^/b$b gemv $g: /" | tee -a $OUT/steps.txt
  done
done
P="examples/profile_step.py --layers 2 --deterministic --expert-format fp8_block --batch 64 --verify 3 --top 12"
for t in 128 0; do
  timeout 60 python $K batch_invariant.SERIAL_SPLIT_MIN_TILES=$t -- $P > /tmp/p.txt 2>&1
  { echo "### verify serial $t"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|^| dense\|Error" /tmp/p.txt | sed "s/^/serial $t: /" | tee -a $OUT/steps.txt
done
best=$(python - $OUT/steps.txt <<'PY'
import re, sys
ms = {t: sum(float(m) for m in re.findall(rf"^serial {t}: == full: ([0-9.]+) ms", open(sys.argv[1]).read(), re.M))
      for t in ("128", "0")}
print(128 if 0 < ms["128"] < ms["0"] else 0)
PY
)
echo "at ${SECONDS}s; the grid with SERIAL_SPLIT_MIN_TILES=$best" | tee -a $OUT/steps.txt
[ $((SECONDS + 280)) -lt $B ] || { echo "grid skipped: fewer than 280 s left of B=$B" | tee -a $OUT/steps.txt; exit 0; }
timeout $((B - SECONDS)) python $K batch_invariant.SERIAL_SPLIT_MIN_TILES=$best -- \
  examples/bench_mtp_forced.py --slice /tmp/fs --deterministic --expert-format fp8_block \
  --compile-batches 1,8,32,64 --batches 1,8,32,64 --budget-s $((B - SECONDS - 40)) \
  --out $OUT/forced_slice_det_fp8.json > $OUT/forced.log 2>&1; echo rc=$? >> $OUT/forced.log
tail -40 $OUT/forced.log | grep -v "^|" ; rm -rf /tmp/fs
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
