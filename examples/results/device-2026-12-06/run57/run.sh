# run57 (any GPU, ~6 min): (1) GPU tests of this session's switches: the wo_a GEMV on the graph's fp32 token
# (rounded in the kernel), the dense GEMV's first weights before the PDL wait (fp8_gemv.EARLY_WEIGHTS), mHC's
# scalar Sinkhorn (mhc.HC_SCALAR_SINKHORN) and fn before the wait (mhc.HC_EARLY_FN), the combine at its new
# default (264 programs); (2) the 2-layer slice's batch-1 step on the GPU alone with each switch alone, all of
# them, and the baseline twice (first and last); (3) batch 8, baseline vs all.
# B=SECONDS budget. At most 8 files to $OUT: the profiles are appended to one file.
export PYTHONPATH=$PWD
B=${B:-360}
K=examples/results/device-2026-12-06/run52/knobs.py
P="examples/profile_step.py --layers 2 --expert-format fp8_block --top 8"
ALL="grouped_linear.FP8_GEMV_MAX_M=1 fp8_gemv.EARLY_WEIGHTS=1 mhc.HC_SCALAR_SINKHORN=1 mhc.HC_EARLY_FN=1"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 150 python -m pytest -q -m gpu tests/test_kernels_fp8_grouped_linear.py tests/test_kernels_fp8_gemm.py \
  tests/test_fuse_hc_chain.py tests/test_kernels_v4_attention.py > $OUT/gpu_tests.txt 2>&1
echo rc=$? >> $OUT/gpu_tests.txt; tail -2 $OUT/gpu_tests.txt
run() {  # label batch knobs...
  local label=$1 b=$2; shift 2
  [ $((SECONDS + 40)) -lt $B ] || { echo "profile $label skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; return; }
  timeout 50 python $K "$@" -- $P --batch $b > /tmp/p.txt 2>&1
  { echo "### $label"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|(critical path) |\|Error" /tmp/p.txt | sed "s|^|$label: |" | tee -a $OUT/steps.txt
}
run "b1 base" 1
run "b1 wo_a gemv" 1 grouped_linear.FP8_GEMV_MAX_M=1
run "b1 early weights" 1 fp8_gemv.EARLY_WEIGHTS=1
run "b1 scalar sinkhorn" 1 mhc.HC_SCALAR_SINKHORN=1
run "b1 early fn" 1 mhc.HC_EARLY_FN=1
run "b1 all" 1 $ALL
run "b1 base again" 1
run "b8 all" 8 $ALL
run "b8 base" 8
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
