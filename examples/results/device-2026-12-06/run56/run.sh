# run56 (any GPU, ~2.5 min): (1) GPU tests of the grouped wo_a (its new one-token path on the dense FP8 GEMV)
# and fp8_gemm's decode GEMV; (2) Flash's wo_a at one token, GEMV vs the 16-row tile (bench_wo_a.py); (3) the
# default 2-layer step at batch 1 timed on the GPU alone with each (run52/knobs.py sets FP8_GEMV_MAX_M).
# B=SECONDS budget. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-150}
K=examples/results/device-2026-12-06/run52/knobs.py
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 60 python -m pytest -q -m gpu tests/test_kernels_fp8_grouped_linear.py tests/test_kernels_fp8_gemm.py \
  -k "gpu" > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt; tail -2 $OUT/gpu_tests.txt
timeout 40 python examples/results/device-2026-12-06/run56/bench_wo_a.py 2>&1 | tee -a $OUT/steps.txt
for v in 1 0; do
  [ $((SECONDS + 40)) -lt $B ] || { echo "profile $v skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; continue; }
  timeout 45 python $K grouped_linear.FP8_GEMV_MAX_M=$v -- examples/profile_step.py --layers 2 \
    --expert-format fp8_block --batch 1 --top 8 > /tmp/p.txt 2>&1
  { echo "### b1 wo_a gemv $v"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|^| dense\|Error" /tmp/p.txt | sed "s/^/b1 wo_a gemv $v: /" | tee -a $OUT/steps.txt
done
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
