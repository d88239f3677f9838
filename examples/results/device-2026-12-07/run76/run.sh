# run76 (any GPU, about 4 min; planned in the thirty-eighth session, not yet run): the FP8 W8A16 dense GEMV at
# 16 / 32 / 64 tokens against experimental tensor-core tiles (bf16 or fp16 operands, 64 / 128 weight rows) and the
# W8A8 GEMV, the slice's six dense shapes alone (m64.py). Batch 64's dense linears ran at 17-47% of copy bandwidth
# in run37. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-300}
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout $((B - 20)) python examples/results/device-2026-12-07/run76/m64.py $OUT/m64.json $((B - 60)) > $OUT/m64.log 2>&1
echo rc=$? >> $OUT/m64.log; grep "^M=\|rc=\|Error" $OUT/m64.log | tee -a $OUT/steps.txt
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
