# run72 (any GPU, about 2.5 min): the 2-layer v4-flash-slice decode step kernel by kernel at batch 8 and batch 1
# (profile_step --timeline; FP8 block experts, whole-step CUDA graph, the shared experts on the side stream), to
# see where batch 8's dense linears lose against batch 1's in the step (run70: dense GEMMs and head 585 vs 492 µs on
# the critical path; run71: 81 vs 65 µs for the six dense shapes alone). At most 8 files to $OUT.
export PYTHONPATH=$PWD
P="examples/profile_step.py --layers 2 --expert-format fp8_block --top 40 --timeline"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
for b in 8 1; do
  timeout 80 python $P --batch $b > $OUT/b${b}_timeline.txt 2>&1
  grep "^== full\|(critical path) |\|Error" $OUT/b${b}_timeline.txt | sed "s|^|b$b: |" | tee -a $OUT/steps.txt
done
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
