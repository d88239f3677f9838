# run65, short (the session's last ~150 s of device time): the routed experts' one-token sweep of the FP8 GEMV
# with Triton's pipeliner (stages) and the fused activation quantisation (fq) against the default, then while
# the budget lasts the 2-layer step at batch 1 (GPU alone): the defaults against fused quantisation + 3 stages +
# fuse_swiglu_linear (target.swiglu_in_gemv).
export PYTHONPATH=$PWD
B=${B:-140}
K=examples/results/device-2026-12-06/run65/knobs.py
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 60 python examples/bench_moe_kernels.py --sweep --formats fp8_block --tokens 1 --budget-s 40 \
  --candidates "default,gemv bn32 bk512 w8 s,gemv bn32 bk256 w4 s4" --out $OUT/sweep.json \
  > $OUT/sweep.txt 2>&1
grep "fp8_block | 1 " $OUT/sweep.txt | tee -a $OUT/steps.txt
G=moe_grouped.FP8_GEMV
for v in "0 0 0" "1 3 1" "0 0 0" "1 3 1"; do
  [ $((SECONDS + 30)) -lt $B ] || break
  set -- $v
  timeout 40 python $K ${G}_FUSE_QUANT=$1 ${G}_STAGES=$2 target.swiglu_in_gemv=$3 -- examples/profile_step.py \
    --layers 2 --expert-format fp8_block --top 8 --batch 1 > /tmp/p.txt 2>&1
  grep "^== full\|(critical path) |\|Error" /tmp/p.txt | sed "s|^|fq $1 stages $2 swiglu_in_gemv $3: |" \
    | tee -a $OUT/steps.txt
done
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
