# run61 (any GPU, ~10 min with the torch.compile peer): issue 28's one run (as run58) with the defaults run59
# decides, applied here as patches before the install: WOA16=1 the wo_a GEMV's tensor-core tile up to 16 fp32 rows
# (woa16.patch), LF32=1 the routers' gate and the compressor / indexer projections on linear_f32's one-token GEMV
# (lf32.patch), MOE0=1 the FP8 experts' tile at one token (moe0.patch), NOSUM=1 the pipeline without fuse_moe_sum
# (nosum.patch). The commit that adopts them has the tree that ran. The full slice through `dsv4c compile` + `dsv4c bench` at batch 1 / 8 / 64 with the eager,
# torch.compile (not with NO_TC=1) and HF transformers peers and the pinned-routing SNR.
# B=SECONDS budget. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-590}
H=examples/results/device-2026-12-06/run61
: > $OUT/gpu.txt
for p in WOA16:woa16 LF32:lf32 MOE0:moe0 NOSUM:nosum; do
  v=${p%%:*}; f=$H/${p#*:}.patch
  if [ "${!v}" = 1 ]; then patch -p1 < $f > /dev/null || exit 3; echo "applied $f" | tee -a $OUT/gpu.txt; fi
done
git diff --stat >> $OUT/gpu.txt 2>&1
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a $OUT/gpu.txt
timeout $((B - SECONDS - 10)) python examples/bench_artifact.py --work /tmp/slice --out $OUT/artifact.json \
  --prefill ${NO_TC:+--no-torch-compile} > $OUT/artifact.log 2>&1; echo rc=$? >> $OUT/artifact.log
tail -9 $OUT/artifact.log
cp /tmp/slice/compile.log $OUT/artifact_compile.log 2>/dev/null
rm -rf /tmp/slice
echo "at ${SECONDS}s" | tee -a $OUT/gpu.txt
