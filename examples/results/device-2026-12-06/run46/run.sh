# run46 (twenty-seventh session, any GPU, ~9 min): V4's grouped wo_a on its stored FP8 bytes
# (`fp8_grouped_linear`, the h100/h200 targets' FP8 dense default now covers it). GPU tests of the new kernel
# and of the decode tile's token groups; the 2-layer slice's default step with wo_a FP8 against bf16
# (`wo_a_switch.py`, one run each, batch 1 / 8 / 64); then the full slice through `dsv4c compile` + `dsv4c
# bench` (decode at batch 1 / 8 / 64, an 8192-token context, the prefill of 4096 tokens).
# B=SECONDS budget. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-560}
R=examples/results/device-2026-12-06/run46
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 120 python -m pytest -q -m gpu tests/test_kernels_fp8_grouped_linear.py tests/test_kernels_batch_invariant.py \
  > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt; tail -3 $OUT/gpu_tests.txt
for s in on off; do
  python $R/wo_a_switch.py $s examples/bench_deterministic.py --layers 2 --modes default-mxfp4 --batches 1 8 64 \
    2>&1 | grep "^default" | sed "s/^/wo_a $s: /" | tee -a $OUT/steps.txt
done
timeout $((B - SECONDS)) python examples/bench_artifact.py --work /tmp/slice --out $OUT/artifact.json \
  --long-context 8192 --prefill 4096 --no-torch-compile > $OUT/artifact.log 2>&1; echo rc=$? >> $OUT/artifact.log
tail -22 $OUT/artifact.log
cp /tmp/slice/compile.log $OUT/artifact_compile.log 2>/dev/null
rm -rf /tmp/slice
