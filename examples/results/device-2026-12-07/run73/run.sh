# run73 (any GPU, about 5.5 min): RMSNorm, RoPE and the head norm + RoPE reading column slices of a fused
# projection's output through their strides (no ATen copy launch before them at several tokens) vs copying first
# (copy_on.py); and mHC's post-mix loading its fn tiles after the PDL wait (mhc.HC_EARLY_FN=0) instead of before.
# (1) GPU tests of the norm and RoPE kernels. (2) The 2-layer v4-flash-slice decode step at batch 8, FP8 block
# experts, whole-step CUDA graph, on the GPU alone: strided, copy, strided, copy, then HC_EARLY_FN=0 twice.
# At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-330}
D=examples/results/device-2026-12-07/run73
P="examples/profile_step.py --layers 2 --expert-format fp8_block --top 8"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
git log -1 --format=%h | tee -a $OUT/steps.txt
timeout 90 python -m pytest -q -m gpu -p no:logging tests/test_fuse_rope.py tests/test_fuse_rmsnorm.py 2>&1 | tail -3 \
  | tee $OUT/gpu_tests.txt
run() {  # label batch [wrapper...]
  [ $((SECONDS + 50)) -lt $B ] || { echo "$1 skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; return; }
  timeout 70 python ${@:3} $P --batch $2 > /tmp/p.txt 2>&1
  { echo "### $1"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|(critical path) |\|Error" /tmp/p.txt | sed "s|^|$1: |" | tee -a $OUT/steps.txt
}
K="examples/results/device-2026-12-06/run52/knobs.py mhc.HC_EARLY_FN=0 --"
run "b8 strided" 8; run "b8 copy" 8 $D/copy_on.py; run "b8 strided" 8; run "b8 copy" 8 $D/copy_on.py
run "b8 late fn" 8 $K; run "b8 late fn" 8 $K
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
