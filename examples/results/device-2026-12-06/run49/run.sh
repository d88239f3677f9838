# run49 (twenty-eighth session, any GPU, ~3 min): where the deterministic verify with FP8 block experts spends
# its time (the slice's MTP grid at 50-58% of the bound at batch 64, run48): profile_step of the verify call of
# 1 + 3 tokens per row at batch 64 and 8 on the 2-layer slice; then the default batch-1 step (FP8 experts, the
# step-wide PDL chain on) with its 60 largest kernels, for issue 28's small-kernel gap.
# At most 8 files to $OUT.
export PYTHONPATH=$PWD
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
for B in 64 8; do
  python examples/profile_step.py --layers 2 --deterministic --expert-format fp8_block --batch $B --verify 3 \
    --top 40 --out $OUT/verify3_b${B}_fp8.json > $OUT/verify3_b${B}_fp8.txt 2>&1
  grep "^== \|^| routed\|^| dense\|^| attention\|^| other\|Error" $OUT/verify3_b${B}_fp8.txt | sed "s/^/verify3 b$B /"
done
python examples/profile_step.py --layers 2 --batch 1 --top 90 --out $OUT/b1.json > $OUT/b1.txt 2>&1
grep "^== \|^| routed\|^| dense\|^| attention\|^| other\|Error" $OUT/b1.txt
