# run78 (any GPU, about 6 min; run in the thirty-ninth session at B=250, one repetition: run78_out): three variants of the 2-layer v4-flash-slice decode step
# (FP8 block experts, whole-step CUDA graph, on the GPU alone), interleaved twice at batch 1 and 8:
#   base     the tree: the hash layer's table lookup as an ATen gather before `route_hashed` (run72's b1 timeline:
#            4.2 µs, outside the PDL chain)
#   lookup   the lookup inside `route_hashed_ids` (lookup_on.py, fuse_router.HASH_LOOKUP: one launch in the chain)
#   after    base with the shared expert's side call after the router (run74's fork_after_router.py)
# and the GPU tests of kernels/router.py. Adopt what wins at both batches. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-360}
D=examples/results/device-2026-12-07
P="examples/profile_step.py --layers 2 --expert-format fp8_block --top 8"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 60 python -m pytest -q -m gpu -p no:logging tests/test_fuse_router.py 2>&1 | tail -2 | tee $OUT/gpu_tests.txt
run() {  # label batch [wrapper]
  [ $((SECONDS + 35)) -lt $B ] || { echo "$1 skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; return; }
  timeout 60 python $3 $P --batch $2 > /tmp/p.txt 2>&1
  { echo "### $1"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|(critical path) |\|Error" /tmp/p.txt | sed "s|^|$1: |" | tee -a $OUT/steps.txt
}
for rep in 1 2; do
  for b in 1 8; do
    run "b$b base" $b; run "b$b lookup" $b $D/run78/lookup_on.py; run "b$b after" $b $D/run74/fork_after_router.py
  done
done
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
