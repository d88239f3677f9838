# run39 (H200: the 4-layer bf16 slice and its artifact do not fit an H100 together). Issue 28 items 4 and 5:
# the full slice's decode step with today's kernels, the 65536-token point, and benchmark.md's prefill workloads
# (4096 and 16384 tokens at batch 1) against the compute roofline. No torch.compile peer (160 s; the eager peer
# stays); the prefill at the default 2048-token chunks and at 8192 (the MoE then runs kernels/moe_fp8_prefill.py:
# 192 assignments per expert). About 9 min. At most 8 files to $OUT.
export PYTHONPATH=$PWD
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
timeout ${T:-560} python examples/bench_artifact.py --work /tmp/slice --out $OUT/artifact.json --long-context 65536 --prefill-chunks 0 8192 \
  --no-torch-compile > $OUT/artifact.log 2>&1; echo rc=$? >> $OUT/artifact.log
tail -25 $OUT/artifact.log
cp /tmp/slice/compile.log $OUT/ 2>/dev/null
rm -rf /tmp/slice
