# run56 (any GPU, ~5.5 min): (1) GPU tests: the grouped wo_a with its one-token path on the dense FP8 GEMV (the tests
# set it on), fp8_gemm's GEMV, the attention combine with one head per program (same bits); (2) Flash's wo_a at
# one token, GEMV vs the 16-row tile (bench_wo_a.py); (3) the default 2-layer step at batch 1 on the GPU alone
# (profile_step's second timing) and its critical-path classes: wo_a GEMV 1 / 0 (run52/knobs.py sets
# grouped_linear.FP8_GEMV_MAX_M), then the attention combine at 264 / 0 programs (run56/attn.py).
# B=SECONDS budget. At most 8 files to $OUT: the profiles are appended to one file.
export PYTHONPATH=$PWD
B=${B:-330}
K=examples/results/device-2026-12-06/run52/knobs.py
A=examples/results/device-2026-12-06/run56/attn.py
P="examples/profile_step.py --layers 2 --expert-format fp8_block --batch 1 --top 8"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 120 python -m pytest -q -m gpu tests/test_kernels_fp8_grouped_linear.py tests/test_kernels_fp8_gemm.py \
  tests/test_kernels_v4_attention.py -k "gpu or cuda" > $OUT/gpu_tests.txt 2>&1
echo rc=$? >> $OUT/gpu_tests.txt; tail -2 $OUT/gpu_tests.txt
timeout 40 python examples/results/device-2026-12-06/run56/bench_wo_a.py 2>&1 | tee -a $OUT/steps.txt
for v in "$K grouped_linear.FP8_GEMV_MAX_M=1" "$K grouped_linear.FP8_GEMV_MAX_M=0" "$A 264" "$A 0"; do
  [ $((SECONDS + 40)) -lt $B ] || { echo "profile $v skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; continue; }
  timeout 45 python $v -- $P > /tmp/p.txt 2>&1
  { echo "### $v"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|^| dense\|^| attention\|^| other\|Error" /tmp/p.txt | sed "s|^|$v: |" | tee -a $OUT/steps.txt
done
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
