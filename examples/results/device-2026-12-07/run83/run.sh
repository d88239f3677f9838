# Not run: run85 took its HC_ROW_GROUP A/B (within the spread), and the forty-second session removed HC_ROW_GROUP and row_block.
# run83 (any GPU, about 9 min; written in the forty-first session, not yet run): the mHC row kernel with several rows
# a program (`mhc.HC_ROW_GROUP`, 1 in the tree: at 64 tokens one row a program reads fn's 1.5 MB from L2 64 times)
# and the deterministic verify's pieces that run80 could not reach.
#  1. GPU tests of the mHC kernels (the row kernel's rows-a-program bits among them).
#  2. One site alone (run81/hc64.py): the row kernel at 1 / 2 / 4 / 8 rows a program and the 16-row tile, 16-64 tokens.
#  3. The 2-layer v4-flash-slice step (FP8 block experts, whole-step CUDA graph, GPU alone): HC_ROW_GROUP 8 vs 1 at
#     batch 64 and 32, interleaved twice at 64.
#  4. The deterministic verify of 1 + 3 tokens at batch 64: HC_BI_ROW_BLOCK 8 (the row kernel, 8 rows a program) vs
#     16 (the tile), and batch_invariant.DECODE_MAX_GROUPS 8 vs 4 (route_prep_fused is on in all of them since
#     `92c1b63`).
# Adopt what wins; then tests/test_deterministic.py -m gpu (over 200 s: give it a call of its own), the full slice
# (`B=575 bash ../device-2026-12-06/run61/run.sh`) and the MTP grid (`GRID_ONLY=1 B=400 bash ../device-2026-12-06/run63/run.sh`).
# At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-560}
K="python examples/results/device-2026-12-06/run52/knobs.py"
P="examples/profile_step.py --layers 2 --expert-format fp8_block --top 8"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 150 python -m pytest -q -m gpu -p no:logging tests/test_fuse_hc.py tests/test_fuse_hc_chain.py 2>&1 | tail -2 | tee $OUT/gpu_tests.txt
(cd examples/results/device-2026-12-07/run81 && timeout 100 python hc64.py $OUT/hc64.json 80 \
  "tree,rows kernel,rows g2,rows g4,rows g8,bm16 c128" 2>&1 | tail -30 > $OUT/hc64.log)
run() {  # label MODULE.NAME=INT profile_step args...
  [ $((SECONDS + 60)) -lt $B ] || { echo "$1 skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; return; }
  timeout 90 $K $2 -- $P "${@:3}" > /tmp/p.txt 2>&1
  { echo "### $1"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|(critical path) |\|Error" /tmp/p.txt | sed "s|^|$1: |" | tee -a $OUT/steps.txt
}
H=mhc.HC_ROW_GROUP
run "b64 group 1" $H=1 --batch 64; run "b64 group 8" $H=8 --batch 64
run "b32 group 1" $H=1 --batch 32; run "b32 group 8" $H=8 --batch 32
V="--deterministic --verify 3"
run "b64 det verify k3 tile 16" mhc.HC_BI_ROW_BLOCK=16 --batch 64 $V
run "b64 det verify k3 rows 8" mhc.HC_BI_ROW_BLOCK=8 --batch 64 $V
run "b64 det verify k3 groups 8" batch_invariant.DECODE_MAX_GROUPS=8 --batch 64 $V
run "b64 group 1" $H=1 --batch 64; run "b64 group 8" $H=8 --batch 64
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
