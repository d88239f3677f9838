# run51 (planned, any GPU, ~9 min): the deterministic verify's batch-invariant linears and head (run49: 2.80 ms
# of 9.25 at batch 64, k = 3, about 150 TFLOP/s in m64n16k16 MMAs whose A, the weight tile, comes from shared
# memory). (1) the GPU test of `A_REG` (the 4-group programs take A from registers: same bits); (2) the verify
# call profiled with A_REG from 4 groups against without, then with the FP8 dense linears (`fp8_linear_bi`,
# whose converted tile already feeds A from registers); (3) the deterministic step at batch 1 / 8 / 64 with and
# without A_REG, interleaved; (4) if time is left, the attention's fixed split at 4 instead of 8 (run49: 0.96
# ms at batch 64, k = 3) on the verify and on the batch-1 step. B=SECONDS budget. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-540}
R=examples/results/device-2026-12-06/run51
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 90 python -m pytest -q -m gpu tests/test_kernels_batch_invariant.py -k "registers or bi_matmul_rows" \
  > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt; tail -2 $OUT/gpu_tests.txt
P="examples/profile_step.py --layers 2 --deterministic --expert-format fp8_block --batch 64 --verify 3 --top 20"
for g in 4 0; do
  timeout 70 python $R/a_reg.py $g $P > $OUT/verify_areg$g.txt 2>&1
  grep "^== full\|^| dense\|Error" $OUT/verify_areg$g.txt | sed "s/^/a_reg $g: /" | tee -a $OUT/steps.txt
done
timeout 70 python $P --dense-format fp8_block_w8a16 > $OUT/verify_fp8dense.txt 2>&1
grep "^== full\|^| dense\|Error" $OUT/verify_fp8dense.txt | sed "s/^/fp8 dense: /" | tee -a $OUT/steps.txt
for g in 4 0 4 0; do
  timeout $((B - SECONDS - 10)) python $R/a_reg.py $g examples/bench_deterministic.py --layers 2 \
    --modes deterministic-fp8 --batches 1 8 64 2>&1 | grep "^deterministic" | sed "s/^/a_reg $g: /" \
    | tee -a $OUT/steps.txt
done
fits() {
  if [ $((SECONDS + $1)) -lt $B ]; then return 0; fi
  echo "skipped ($1 s would pass B=$B at $SECONDS s): $2"; return 1
}
for sp in 4 8; do
  fits 45 "split $sp verify" && timeout 60 python $R/det_split.py $sp $P 2>&1 \
    | grep "^== full\|^| attention\|Error" | sed "s/^/split $sp verify: /" | tee -a $OUT/steps.txt
  fits 45 "split $sp b1" && timeout 60 python $R/det_split.py $sp examples/profile_step.py --layers 2 --deterministic \
    --expert-format fp8_block --batch 1 --top 5 2>&1 | grep "^== full\|^| attention" | sed "s/^/split $sp b1: /" \
    | tee -a $OUT/steps.txt
done
