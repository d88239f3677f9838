# run52 (any GPU, ~10 min): (1) GPU tests: the FP8 block experts' decode GEMV (kernels/moe_fp8_gemv.py), the
# split counters left as found (fp8_gemm's GPU tests),
# SERIAL's and A_REG's same bits; (2) the deterministic verify (batch 64, k = 3) profiled with the decode tile's
# serial split (SERIAL_SPLIT_MIN_TILES 128) and without (0); (3) the default mode's step (FP8 block experts, FP8
# dense) with the GEMV (`moe_grouped.FP8_GEMV_MAX_ASSIGN` 64) and with the tile (0), beside the deterministic
# FP8-expert step (A_REG on; it never uses the GEMV), batch 1 / 8 / 64; (4) the slice's teacher-forced MTP grid,
# deterministic with FP8 block experts, with the faster of (2). B=SECONDS budget. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-400}
R=examples/results/device-2026-12-06/run52
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 120 python -m pytest -q -m gpu tests/test_kernels_moe_fp8_gemv.py tests/test_kernels_batch_invariant.py \
  tests/test_kernels_fp8_gemm.py \
  -k "gemv or registers or serial or gpu" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
tail -2 $OUT/gpu_tests.txt
for g in 64 0; do
  [ $((SECONDS + 75)) -lt $B ] || { echo "skipped gemv $g at ${SECONDS}s" | tee -a $OUT/steps.txt; continue; }
  timeout 75 python $R/knobs.py moe_grouped.FP8_GEMV_MAX_ASSIGN=$g -- \
    examples/bench_deterministic.py --layers 2 --modes default deterministic-fp8 --batches 1 8 64 2>&1 \
    | grep "^default\|^deterministic\|Error" | sed "s/^/gemv $g: /" | tee -a $OUT/steps.txt
done
P="examples/profile_step.py --layers 2 --deterministic --expert-format fp8_block --batch 64 --verify 3 --top 12"
for t in 128 0; do
  [ $((SECONDS + 60)) -lt $B ] || { echo "skipped serial $t at ${SECONDS}s" | tee -a $OUT/steps.txt; continue; }
  timeout 60 python $R/knobs.py batch_invariant.SERIAL_SPLIT_MIN_TILES=$t -- $P > $OUT/verify_serial$t.txt 2>&1
  grep "^== full\|^| dense\|Error" $OUT/verify_serial$t.txt | sed "s/^/serial $t: /" | tee -a $OUT/steps.txt
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
timeout $((B - SECONDS)) python $R/knobs.py batch_invariant.SERIAL_SPLIT_MIN_TILES=$best -- \
  examples/bench_mtp_forced.py --slice /tmp/fs --deterministic --expert-format fp8_block \
  --compile-batches 1,8,32,64 --batches 1,8,32,64 --budget-s $((B - SECONDS - 40)) \
  --out $OUT/forced_slice_det_fp8.json > $OUT/forced.log 2>&1; echo rc=$? >> $OUT/forced.log
tail -40 $OUT/forced.log | grep -v "^|" ; rm -rf /tmp/fs
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
