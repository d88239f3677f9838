# run53 call B (any GPU, ~9 min): pytest -m gpu tests/test_deterministic.py with A_REG on (the bundled model
# across batch and k; the 2-layer Flash model with bf16, MXFP4 and FP8 block experts: run48 took 176 s), then
# the default and deterministic FP8-expert steps at batch 1 / 8 / 64 side by side (bench_deterministic: more
# than 75 s for two modes in run52). B=SECONDS budget. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-540}
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 280 python -m pytest -q -m gpu tests/test_deterministic.py --durations=0 > $OUT/gpu_det.txt 2>&1
echo rc=$? >> $OUT/gpu_det.txt; tail -8 $OUT/gpu_det.txt
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
timeout $((B - SECONDS)) python examples/bench_deterministic.py --layers 2 \
  --modes default deterministic-fp8 --batches 1 8 64 --out $OUT/det_fp8.json 2>&1 | tail -4 | tee -a $OUT/steps.txt
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
