# run77 (any GPU, about 1.5 min; planned in the thirty-ninth session): where the plain batch-64 decode step's time
# goes now (issue 28's batch 64: 77.4% of the stored-format roofline, 85% asked). profile_step on the 2-layer
# v4-flash-slice, FP8 block experts, whole-step CUDA graph, the top 20 kernels and the step's timeline. The last
# per-class split at batch 64 was run42's (before the FP8 dense linears' own kernels): "other" 647 µs in 68 kernels.
# At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-100}
P="examples/profile_step.py --layers 2 --expert-format fp8_block --top 20"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout $((B - 10)) python $P --batch 64 --timeline > $OUT/b64.txt 2>&1
grep "^== full\|(critical path) |\|Error" $OUT/b64.txt | sed "s|^|b64: |" | tee -a $OUT/steps.txt
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
