# run42 (any GPU; written for an H100 while no H200 came): the GPU tests of the kernels changed since the last
# device run (FP8 dequant path of fp8_linear_w8a16, the indexer's staged selection, fuse_hc's hc_head, the
# batch-invariant row_sum), the FP8 dense kernels at prefill sizes, then on the 2-layer slice: the decode step
# with the new default dense format (fp8_block_w8a16) against bf16 dense at batch 1 / 64, interleaved, and the
# deterministic step after 05c2ebd (sum_bi as a row kernel) at batch 1 / 64 beside them.
# B=SECONDS budget; parts that would not fit are skipped and say so. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-560}
fits() { if [ $((SECONDS + $1)) -lt $B ]; then return 0; fi; echo "skipped ($1 s would pass B=$B at $SECONDS s): $2"; return 1; }
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 170 python -m pytest -q -m gpu tests/test_kernels_fp8_gemm.py tests/test_kernels_v4_indexer.py \
  tests/test_fuse_hc.py tests/test_kernels_batch_invariant.py > $OUT/gpu_tests.txt 2>&1
echo rc=$? >> $OUT/gpu_tests.txt; tail -4 $OUT/gpu_tests.txt
timeout 90 python examples/bench_dense_kernels.py --m 128 512 4096 --kernels "bf16 linear" "w8a16 tile" \
  "w8a16 dequant+linear" --out /tmp/dense_prefill.json --md $OUT/dense_prefill.md > /tmp/dense.txt 2>&1
tail -20 $OUT/dense_prefill.md
for v in 1:fp8 1:bf16 64:fp8 64:bf16 1:det 64:det 1:fp8 1:bf16 64:fp8 64:bf16; do
  b=${v%%:*}; f=${v##*:}
  fits 45 "step $v" | tee -a $OUT/steps.txt | grep -q skipped && continue
  case $f in
    fp8) args="--expert-format mxfp4_w4a16";;
    bf16) args="--expert-format mxfp4_w4a16 --dense-format bf16";;
    det) args="--expert-format mxfp4_w4a16 --deterministic";;
  esac
  python examples/profile_step.py --layers 2 --batch $b $args --top 45 --out /tmp/s_${f}_$b.json > /tmp/s.txt 2>&1
  grep "^== \|^| routed\|^| dense\|^| attention\|^| other\|Error" /tmp/s.txt | sed "s/^/$v /" | tee -a $OUT/steps.txt
done
cp /tmp/s_det_1.json $OUT/det_b1.json 2>/dev/null
cp /tmp/s_fp8_1.json $OUT/fp8_b1.json 2>/dev/null
