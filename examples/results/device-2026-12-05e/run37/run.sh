# run37, call 1 of 2 (~5 min): the W8A16 GEMV's retuned default tiles (d7dc9ba: bn64 bk128, 3 stages, the
# tensor-core K split) against bf16 F.linear at the slice's dense shapes; the GPU tests of the dense FP8
# kernels and pass, and of the batch-invariant kernels (1b1480d's K split: decode rows bit-identical at
# M = 1 / 8 / 64); where the deterministic step goes (2-layer slice, MXFP4 weight-only experts, batch 1
# and 8: run29 measured it at 4.5x the default step and nothing says why), after 1b1480d.
export PYTHONPATH=$PWD  # 8 files come back per call: dense.json/md, dense_prefill.json, gpu_tests, 4 det JSONs
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
python examples/bench_dense_kernels.py --m 1 8 64 --kernels "bf16 linear" "w8a16 gemv" \
  --out $OUT/dense.json --md $OUT/dense.md > /tmp/dense.txt 2>&1
cat $OUT/dense.md
# FP8 dense at prefill sizes: the W8A16 tile GEMM (what fp8_linear_w8a16 runs above 64 rows) against bf16
python examples/bench_dense_kernels.py --m 512 4096 --kernels "bf16 linear" "w8a16 tile" \
  --out $OUT/dense_prefill.json --md /tmp/dense_prefill.md > /tmp/dense_prefill.txt 2>&1
cat /tmp/dense_prefill.md
timeout 150 python -m pytest -q -m gpu tests/test_kernels_fp8_gemm.py tests/test_quantize_dense.py \
  tests/test_kernels_batch_invariant.py tests/test_deterministic.py > $OUT/gpu_tests.txt 2>&1
echo rc=$? >> $OUT/gpu_tests.txt; tail -3 $OUT/gpu_tests.txt
R=examples/results/device-2026-12-05e/run37
for v in 1:on 1:off 8:on 8:off; do  # the K split of 1b1480d against none, interleaved
  b=${v%%:*}; sw=${v##*:}
  python $R/split_switch.py $sw examples/profile_step.py --layers 2 --batch $b --deterministic \
    --expert-format mxfp4_w4a16 --top 45 --out $OUT/det_${sw}_b$b.json > /tmp/det_${sw}_b$b.txt 2>&1
  grep "^== \|^| routed\|^| dense\|^| attention\|^| other" /tmp/det_${sw}_b$b.txt | sed "s/^/split $sw b=$b /"
done
