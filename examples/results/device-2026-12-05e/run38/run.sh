# run38 (~8 min; planned 2026-12-06, no device time left that session). c1fa12a's decode tile for the
# deterministic linears, then the FP8-dense step's extra "other" kernels that run37 could not name.
# B=SECONDS (default 500): parts that would not fit are skipped and say so. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-500}
fits() { if [ $((SECONDS + $1)) -lt $B ]; then return 0; fi; echo "skipped ($1 s would pass B=$B at $SECONDS s): $2"; return 1; }
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/det.txt
R=examples/results/device-2026-12-05e/run38
# 1. the batch-invariant matmul per shape: bf16 cuBLAS, the 64 x 64 tile, the decode tile, the W8A16 GEMV
python examples/bench_dense_kernels.py --m 1 8 64 --kernels "bf16 linear" "bi tile" "bi decode tile" "w8a16 gemv" \
  --out $OUT/bi_kernels.json --md /tmp/bi.md > /tmp/bi.txt 2>&1; cat /tmp/bi.md
# 1b. FP8 W8A16 at prefill sizes on the GEMV kernel (weights on wgmma's register A operand, 64-token tiles; the
# sm_90 build's PTX shows the register form) against the tile GEMM (weights through shared memory: 0.33x bf16 in
# run37) and cuBLAS bf16
fits 60 "w8a16 prefill" && python examples/bench_dense_kernels.py --m 512 4096 \
  --kernels "bf16 linear" "w8a16 tile" "w8a16 gemv" --out /tmp/w8a16_prefill.json --md $OUT/w8a16_prefill.md \
  > /tmp/w8a16_prefill.txt 2>&1; cat $OUT/w8a16_prefill.md
# 1c. the FP8 grouped MoE at the Session's prefill chunk (2048 tokens: 48 assignments per expert, under
# default_config's 64 for the fp8_prefill kernels) and beside it: the default tile vs kernels/moe_fp8_prefill.py
fits 90 "moe prefill" && python examples/bench_moe_kernels.py --sweep --formats fp8_block --tokens 1024,2048,4096 \
  --candidates default,fp8_prefill --budget-s 80 --out /tmp/moe_pre.json > $OUT/moe_prefill.txt 2>&1; \
  grep "^| fp8" $OUT/moe_prefill.txt
# 2. the deterministic step, decode tile on / off, interleaved (run37 `split on`: 2.616 / 3.026 ms)
for v in 1:on 1:off 8:on 8:off 64:on 64:off; do
  b=${v%%:*}; sw=${v##*:}
  fits 40 "det $v" | tee -a $OUT/det.txt | grep -q skipped && continue
  python $R/tile_switch.py $sw examples/profile_step.py --layers 2 --batch $b --deterministic \
    --expert-format mxfp4_w4a16 --top 45 --out /tmp/det_${sw}_b$b.json > /tmp/det_${sw}_b$b.txt 2>&1
  grep "^== \|^| routed\|^| dense\|^| attention\|^| other\|Error" /tmp/det_${sw}_b$b.txt | sed "s/^/tile $sw b=$b /" \
    | tee -a $OUT/det.txt
done
cp /tmp/det_on_b1.json $OUT/ 2>/dev/null
# 3. FP8 dense's extra kernels: the step at batch 64 both ways, every kernel kept (one JSON each)
for f in bf16 fp8_block_w8a16; do
  fits 40 "dense $f" && python examples/profile_step.py --layers 2 --batch 64 --expert-format fp8_block \
    --dense-format $f --top 200 --out $OUT/dense_${f}_b64.json > /tmp/d.txt 2>&1 && grep "^== full" /tmp/d.txt
done
# 4. GPU tests: the batch-invariant kernels (decode tile) and deterministic mode (both Flash cases: 11dd028)
LEFT=$((B - SECONDS)); [ $LEFT -lt 30 ] && LEFT=30
timeout $LEFT python -m pytest -q -m gpu tests/test_kernels_batch_invariant.py tests/test_deterministic.py \
  > $OUT/gpu_tests.txt 2>&1; echo rc=$? timeout=$LEFT >> $OUT/gpu_tests.txt; tail -3 $OUT/gpu_tests.txt
