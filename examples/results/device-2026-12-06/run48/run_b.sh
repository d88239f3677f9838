# run48 call B (any GPU, ~8 min): the slice's teacher-forced MTP grid in deterministic mode with FP8 block
# experts (`moe_experts_fp8_bi`: an expert read once per 16 of its assignments in a verify call; issue 23's grid
# at batch 32-64, where the MXFP4 GEMV's verify reached 28-40% of the bound in run42).
# B=SECONDS budget. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-480}
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout $((B - SECONDS)) python examples/bench_mtp_forced.py --slice /tmp/fs --deterministic --expert-format fp8_block \
  --compile-batches 1,8,32,64 --batches 1,8,32,64 --budget-s $((B - SECONDS - 30)) \
  --out $OUT/forced_slice_det_fp8.json > $OUT/forced.log 2>&1; echo rc=$? >> $OUT/forced.log
tail -30 $OUT/forced.log
rm -rf /tmp/fs
