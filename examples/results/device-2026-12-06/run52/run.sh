# run52 (any GPU, ~9 min): A_REG on (DECODE_A_REG_MIN_GROUPS = 4, from run51). (1) the slice's teacher-forced
# MTP grid in deterministic mode with FP8 block experts, as run48 call B; (2) pytest -m gpu
# tests/test_deterministic.py (the bundled model across batch and k; the 2-layer Flash model); (3) the default
# and deterministic steps at batch 1 / 8 / 64 side by side. B=SECONDS budget. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-560}
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 330 python examples/bench_mtp_forced.py --slice /tmp/fs --deterministic --expert-format fp8_block \
  --compile-batches 1,8,32,64 --batches 1,8,32,64 --budget-s 300 \
  --out $OUT/forced_slice_det_fp8.json > $OUT/forced.log 2>&1; echo rc=$? >> $OUT/forced.log
tail -40 $OUT/forced.log | grep -v "^|" ; rm -rf /tmp/fs
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
timeout $((B - SECONDS - 60)) python -m pytest -q -m gpu tests/test_deterministic.py --durations=0 > $OUT/gpu_det.txt 2>&1
echo rc=$? >> $OUT/gpu_det.txt; tail -8 $OUT/gpu_det.txt
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
timeout $((B - SECONDS)) python examples/bench_deterministic.py --layers 2 \
  --modes default deterministic-fp8 --batches 1 8 64 --out $OUT/det_fp8.json 2>&1 | tail -4 | tee -a $OUT/steps.txt
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
