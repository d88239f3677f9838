# run36, call 1 of 3: GPU tests of the PDL chain, the argmax kernel and fuse_hc_chain; the argmax microbench.
# Call 2: ab.sh (the step A/B). Call 3: sweep.sh (the W8A16 dense GEMV tiles). Outputs in $OUT.
set -x
export PYTHONPATH=$PWD  # the editable install is not always on the path of the python that runs
R=examples/results/device-2026-12-05e/run36
python -m pip install --no-deps --no-build-isolation -e . > $OUT/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
python $R/argmax_bench.py $OUT/argmax.json > $OUT/argmax.txt 2>&1
timeout 300 python -m pytest -q -m gpu tests/test_kernels_argmax.py tests/test_fuse_hc_chain.py \
  tests/test_kernels_act_quant.py \
  tests/test_kernels_fp8_gemm.py tests/test_kernels_moe_grouped.py tests/test_kernels_moe_fp4_gemv.py \
  tests/test_kernels_v4_attention.py tests/test_kernels_v4_compress.py tests/test_kernels_v4_indexer.py \
  tests/test_fuse_hc.py tests/test_fuse_rmsnorm.py tests/test_fuse_rope.py tests/test_fuse_rope_angles.py \
  tests/test_fuse_router.py tests/test_fuse_swiglu.py tests/test_fuse_sinkhorn.py tests/test_split.py \
  tests/test_compile_session.py > $OUT/gpu_tests.txt 2>&1
echo rc=$? >> $OUT/gpu_tests.txt
tail -3 $OUT/gpu_tests.txt

