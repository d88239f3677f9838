# run37 as one call (~8 min): run.sh and dense_ab.sh merged after repeated failed machine starts left the
# session budget for one start. Order: the FP8-dense step A/B (issue 28 item 1's decision) first, then the
# dense kernels with d7dc9ba's defaults, the deterministic step with and without 1b1480d's K split, and the
# GPU tests last under a timeout. At most 8 files to $OUT.
# B=SECONDS (default 500): the call's budget; a part that would not fit is skipped and says so.
export PYTHONPATH=$PWD
B=${B:-500}
fits() { if [ $((SECONDS + $1)) -lt $B ]; then return 0; fi; echo "skipped ($1 s would pass B=$B at $SECONDS s): $2"; return 1; }
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/dense_ab.txt
T0=$SECONDS
for v in 1:bf16 1:fp8_block_w8a16 8:bf16 8:fp8_block_w8a16 64:bf16 64:fp8_block_w8a16; do
  b=${v%%:*}; f=${v##*:}
  python examples/profile_step.py --layers 2 --batch $b --expert-format fp8_block --dense-format $f --top 45 \
    --out /tmp/dense_${f}_b$b.json > /tmp/p.txt 2>&1
  grep "^== full\|Error\|error" /tmp/p.txt | sed "s/^/$f b=$b /" | tee -a $OUT/dense_ab.txt
  grep "^| dense\|^| routed\|^| other\|^| attention" /tmp/p.txt | sed "s/^/$f b=$b /" >> $OUT/dense_ab.txt
done
echo "dense A/B $((SECONDS - T0)) s" | tee -a $OUT/dense_ab.txt
fits 60 "dense kernels" && python examples/bench_dense_kernels.py --m 1 8 64 --kernels "bf16 linear" "w8a16 gemv" \
  --out $OUT/dense.json --md $OUT/dense.md > /tmp/dense.txt 2>&1
cat $OUT/dense.md
fits 60 "prefill tiles" && python examples/bench_dense_kernels.py --m 512 4096 --kernels "bf16 linear" "w8a16 tile" \
  --out /tmp/dense_prefill.json --md $OUT/dense_prefill.md > /tmp/dense_prefill.txt 2>&1
cat $OUT/dense_prefill.md; echo "kernels done at $((SECONDS - T0)) s"
R=examples/results/device-2026-12-05e/run37
for v in 1:on 1:off 8:on 8:off; do  # 1b1480d's K split against none, interleaved
  b=${v%%:*}; sw=${v##*:}
  fits 40 "det $v" | tee -a $OUT/det.txt | grep -q skipped && continue
  python $R/split_switch.py $sw examples/profile_step.py --layers 2 --batch $b --deterministic \
    --expert-format mxfp4_w4a16 --top 45 --out /tmp/det_${sw}_b$b.json > /tmp/det_${sw}_b$b.txt 2>&1
  grep "^== \|^| routed\|^| dense\|^| attention\|^| other\|Error" /tmp/det_${sw}_b$b.txt | sed "s/^/split $sw b=$b /" \
    | tee -a $OUT/det.txt
done
cp /tmp/det_on_b1.json /tmp/det_off_b1.json $OUT/ 2>/dev/null
echo "det done at $((SECONDS - T0)) s"
LEFT=$((500 - SECONDS)); [ $LEFT -lt 30 ] && LEFT=30
timeout $LEFT python -m pytest -q -m gpu tests/test_kernels_batch_invariant.py tests/test_deterministic.py \
  tests/test_kernels_fp8_gemm.py tests/test_quantize_dense.py > $OUT/gpu_tests.txt 2>&1
echo rc=$? timeout=$LEFT >> $OUT/gpu_tests.txt; tail -3 $OUT/gpu_tests.txt
