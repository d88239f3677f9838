# run43 (planned, any GPU, ~8 min): what the twenty-sixth session left untimed.
# 1. GPU tests of `fp8_linear_bi` (the deterministic mode's linears on the stored FP8 bytes) and the
#    deterministic mode;
# 2. its cost: the 2-layer slice's decode step in the default mode (MXFP4 experts, FP8 dense), deterministic
#    with bf16 dense (its default) and deterministic with FP8 dense (`--dense-format fp8_block_w8a16`), batch
#    1 / 8 / 64, rows and tokens checked across batches (issue 23 item 4);
# 3. where a deterministic verify call goes at batch 8 / 64 with k = 3 (`profile_step.py --verify 3`): the
#    slice's MTP grid was 28-74% of its bound at batch 8-64 (run42);
# 4. with time left, the three modes at MTP k = 3 (verify rows against decode rows).
# B=SECONDS budget; parts that would not fit are skipped and say so. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-480}
fits() { if [ $((SECONDS + $1)) -lt $B ]; then return 0; fi; echo "skipped ($1 s would pass B=$B at $SECONDS s): $2"; return 1; }
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 200 python -m pytest -q -m gpu tests/test_kernels_batch_invariant.py tests/test_deterministic.py \
  > $OUT/gpu_tests.txt 2>&1; echo rc=$? >> $OUT/gpu_tests.txt; tail -3 $OUT/gpu_tests.txt
M="default-mxfp4 deterministic-mxfp4 deterministic-mxfp4-fp8dense"
fits 150 "det modes" && python examples/bench_deterministic.py --layers 2 --modes $M --batches 1 8 64 \
  --out $OUT/det_fp8dense.json 2>&1 | tail -8 | tee -a $OUT/steps.txt
for b in 8 64; do
  fits 60 "verify profile b$b" | tee -a $OUT/steps.txt | grep -q skipped && continue
  python examples/profile_step.py --layers 2 --deterministic --expert-format mxfp4_w4a16 --batch $b --verify 3 \
    --top 40 --out /tmp/v$b.json > /tmp/v.txt 2>&1
  grep "^== \|^| routed\|^| dense\|^| attention\|^| other\|Error" /tmp/v.txt | sed "s/^/verify3 b$b /" | tee -a $OUT/steps.txt
  cp /tmp/v$b.json $OUT/verify3_b$b.json 2>/dev/null
done
fits 150 "det modes, mtp 3" && python examples/bench_deterministic.py --layers 2 --modes $M --mtp 3 --prompt 256 \
  --steps 16 --out $OUT/det_fp8dense_mtp.json 2>&1 | tail -8 | tee -a $OUT/steps.txt
