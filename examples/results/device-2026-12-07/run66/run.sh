# run66 (any GPU, ~6 min): run61's full-slice bench cut at its budget in run65's session before the pinned-routing
# accuracy; this reruns it without the torch.compile and HF peers (run61's output has them, same tree) so the
# step times come with the SNR of what was timed. BATCHES="1" STEPS=8 for the accuracy with a short batch-1
# check only (the SNR is on the prefill graph, which the decode buckets do not change). Then, while the budget
# lasts (thirty-sixth session: the bench first), the GPU tests of the kernels changed since run65 and
# l2_wait.py (the L2 prefetch against the wait after it). B=SECONDS budget. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-500}
H=examples/results/device-2026-12-07/run66
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
timeout $((B - SECONDS - 10)) python examples/bench_artifact.py --work /tmp/slice --out $OUT/artifact.json \
  --prefill --no-torch-compile --no-hf --batches ${BATCHES:-1 8 64} --steps ${STEPS:-27} \
  > $OUT/artifact.log 2>&1; echo rc=$? >> $OUT/artifact.log
grep "accuracy" $OUT/artifact.log | cut -c1-400; tail -9 $OUT/artifact.log
rm -rf /tmp/slice
echo "bench done at ${SECONDS}s" | tee -a $OUT/gpu.txt
# the one-token FP8 GEMV without its SwiGLU and pipelined paths (f778edb); the L2 prefetch's rewritten test
if [ $((SECONDS + 60)) -lt $B ]; then
  timeout $((B - SECONDS - 5)) python -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_fp8_gemm.py \
    tests/test_kernels_l2_prefetch.py 2>&1 | tail -4 | tee -a $OUT/gpu.txt
fi
[ $((SECONDS + 40)) -lt $B ] && timeout $((B - SECONDS - 5)) python $H/l2_wait.py 2>&1 | tail -4 | tee -a $OUT/gpu.txt
echo "at ${SECONDS}s" | tee -a $OUT/gpu.txt
