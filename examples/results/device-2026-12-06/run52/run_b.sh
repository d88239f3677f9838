# run52 call B (any GPU, ~5 min): pytest -m gpu tests/test_deterministic.py with A_REG on and the tree's
# SERIAL_SPLIT_MIN_TILES (the bundled model across batch and k; the 2-layer Flash model), then the default and
# deterministic steps at batch 1 / 8 / 64 side by side. B=SECONDS budget. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-300}
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout $((B - SECONDS - 60)) python -m pytest -q -m gpu tests/test_deterministic.py --durations=0 > $OUT/gpu_det.txt 2>&1
echo rc=$? >> $OUT/gpu_det.txt; tail -8 $OUT/gpu_det.txt
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
timeout $((B - SECONDS)) python examples/bench_deterministic.py --layers 2 \
  --modes default deterministic-fp8 --batches 1 8 64 --out $OUT/det_fp8.json 2>&1 | tail -4 | tee -a $OUT/steps.txt
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
