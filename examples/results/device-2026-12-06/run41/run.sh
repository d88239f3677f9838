# run41 call A (H200: the 4-layer bf16 slice and its artifact do not fit an H100 together). First the GPU tests of
# the kernels changed since the last device run (the indexer's staged selection, fuse_hc's hc_head, the
# batch-invariant row_sum; call B ran the FP8 dense ones), then the FP8 dense kernels at prefill sizes
# (tile GEMM vs the weight widened for cuBLAS vs bf16 cuBLAS), then the full slice through `dsv4c compile` +
# `dsv4c bench` with every change since run39, the h200 target now FP8 dense (fp8_block_w8a16): decode at batch
# 1 / 8 / 64, batch 1 after 8192- and 65536-token prompts, prefill of 4096 tokens. No torch.compile peer.
# B=SECONDS budget. At most 8 files to $OUT.
export PYTHONPATH=$PWD
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
timeout 150 python -m pytest -q -m gpu tests/test_kernels_v4_indexer.py \
  tests/test_fuse_hc.py tests/test_kernels_batch_invariant.py > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt
tail -4 $OUT/gpu_tests.txt
timeout 90 python examples/bench_dense_kernels.py --m 128 512 4096 --kernels "bf16 linear" "w8a16 tile" \
  "w8a16 dequant+linear" --out /tmp/dense_prefill.json --md $OUT/dense_prefill.md > /tmp/dense.txt 2>&1
cat $OUT/dense_prefill.md | tail -12
timeout $((${B:-570} - SECONDS)) python examples/bench_artifact.py --work /tmp/slice --out $OUT/artifact.json \
  --long-context 8192 65536 --prefill 4096 --no-torch-compile > $OUT/artifact.log 2>&1; echo rc=$? >> $OUT/artifact.log
tail -22 $OUT/artifact.log
cp /tmp/slice/compile.log $OUT/ 2>/dev/null
rm -rf /tmp/slice
