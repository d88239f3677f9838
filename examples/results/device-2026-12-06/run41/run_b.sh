# run41 call B (H200; run before call A): issue 28 item 1's decision, the h200 target's dense format. The full slice compiled with
# bf16 dense (the widened weights, the target's default until this session) and with fp8_block_w8a16 (the new
# default: the release's FP8 bytes on the W8A16 GEMV, prefill-sized calls widened per call for cuBLAS), one run:
# decode at batch 1 / 8 / 64, pinned-routing SNR, and the prefill of 4096 tokens (two 2048-token calls).
# B=SECONDS budget. At most 8 files to $OUT.
export PYTHONPATH=$PWD
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
timeout 100 python -m pytest -q -m gpu tests/test_kernels_fp8_gemm.py > $OUT/gpu_tests.txt 2>&1
echo rc=$? >> $OUT/gpu_tests.txt; tail -3 $OUT/gpu_tests.txt
timeout $((${B:-480} - SECONDS)) python examples/bench_dense_formats.py --work /tmp/dense --out $OUT/dense_formats.json \
  --formats bf16 fp8_block_w8a16 --prefill 4096 > $OUT/dense_formats.log 2>&1; echo rc=$? >> $OUT/dense_formats.log
tail -14 $OUT/dense_formats.log
rm -rf /tmp/dense
