# run51 (planned, any GPU, ~7 min): the deterministic verify's batch-invariant linears and head (run49: 2.80 ms
# of 9.25 at batch 64, k = 3, about 150 TFLOP/s in m64n16k16 MMAs whose A, the weight tile, comes from shared
# memory). (1) the GPU test of `A_REG` (the 4-group programs take A from registers: same bits); (2) the verify
# call profiled with A_REG from 4 groups against without, then with the FP8 dense linears (`fp8_linear_bi`,
# whose converted tile already feeds A from registers); (3) the deterministic step at batch 1 / 8 / 64 with and
# without A_REG, interleaved. B=SECONDS budget. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-420}
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
