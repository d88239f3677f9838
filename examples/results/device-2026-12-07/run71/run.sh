# run71 (any GPU, about 5 min): the FP8 W8A16 dense GEMV at 1 / 4 / 8 tokens against experimental tensor-core
# (bf16 or fp16 operands) and CUDA-core multi-token variants, the slice's six dense shapes (m8.py). At most 8
# files to $OUT.
export PYTHONPATH=$PWD
B=${B:-300}
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
git log -1 --format=%h | tee -a $OUT/steps.txt
timeout $((B - 20)) python examples/results/device-2026-12-07/run71/m8.py $OUT/m8.json $((B - 60)) > $OUT/m8.log 2>&1
echo rc=$? >> $OUT/m8.log; grep "^M=\|rc=\|Error" $OUT/m8.log | tee -a $OUT/steps.txt
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
