# run80 (any GPU, about 9 min; written in the fortieth session, not yet run): two settings that are off.
#  1. `moe_grouped.ROUTE_PREP_KERNEL_MAX_ASSIGN` 4096: `route_prep_fused`, the grouped MoE's routing prep in one
#     Triton program instead of about 24 ATen launches (run79's batch-64 timeline: 76-77 µs a layer between the
#     router and the first expert GEMM), against 0 (the tree), interleaved twice at batch 64 and 32 (384 / 192
#     assignments: sorted routing; batch 8 is direct and never sorts), and in the deterministic verify of 1 + 3
#     tokens at batch 64 (issue 23's weakest cells).
#  2. `batch_invariant.DECODE_MAX_GROUPS` 8: the deterministic decode tile's 8 token groups a program above 64 rows
#     (each weight read once per 128 verify rows instead of 64), against 4, in the verify at batch 64 and 32.
# First the GPU tests (kernels/moe_grouped.py's route tests, the launch chain, the batch-invariant kernels'); then
# the 2-layer v4-flash-slice step (FP8 block experts, whole-step CUDA graph) on the GPU alone. Adopt (set the
# constants) what wins, then tests/test_deterministic.py -m gpu, the full slice (`B=575 bash
# ../device-2026-12-06/run61/run.sh`) and the MTP grid (`GRID_ONLY=1 B=400 bash ../device-2026-12-06/run63/run.sh`).
# At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-560}
K="python examples/results/device-2026-12-06/run52/knobs.py"
P="examples/profile_step.py --layers 2 --expert-format fp8_block --top 8"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 120 python -m pytest -q -m gpu -p no:logging tests/test_kernels_moe_grouped.py -k route 2>&1 | tail -2 | tee $OUT/gpu_tests.txt
timeout 120 python -m pytest -q -m gpu -p no:logging tests/test_kernels_batch_invariant.py 2>&1 | tail -2 | tee -a $OUT/gpu_tests.txt
timeout 60 python -m pytest -q -p no:logging tests/test_kernel_launch_chain.py 2>&1 | tail -1 | tee -a $OUT/gpu_tests.txt
run() {  # label MODULE.NAME=INT profile_step args...
  [ $((SECONDS + 45)) -lt $B ] || { echo "$1 skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; return; }
  timeout 75 $K $2 -- $P "${@:3}" > /tmp/p.txt 2>&1
  { echo "### $1"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|(critical path) |\|Error" /tmp/p.txt | sed "s|^|$1: |" | tee -a $OUT/steps.txt
}
R=moe_grouped.ROUTE_PREP_KERNEL_MAX_ASSIGN
G=batch_invariant.DECODE_MAX_GROUPS
for rep in 1 2; do
  for b in 64 32; do run "b$b base" $R=0 --batch $b; run "b$b kernel" $R=4096 --batch $b; done
done
V="--deterministic --verify 3"
run "b64 det verify k3 base" $R=0 --batch 64 $V
run "b64 det verify k3 kernel" $R=4096 --batch 64 $V
run "b64 det verify k3 groups 8" $G=8 --batch 64 $V
run "b32 det verify k3 groups 4" $G=4 --batch 32 $V
run "b32 det verify k3 groups 8" $G=8 --batch 32 $V
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
