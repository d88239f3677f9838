# run58 (any GPU, ~8 min without the torch.compile peer): issue 28's one run again (as run47 call A) with this
# session's defaults: the wo_a GEMV on the graph's fp32 token (grouped_linear.FP8_GEMV_MAX_M = 1), mHC's fn before
# the PDL wait (mhc.HC_EARLY_FN = 1), the attention combine at 264 programs and the FP8 experts' GEMV at one token
# (moe_grouped.FP8_GEMV_MAX_ASSIGN = 8). The full slice through `dsv4c compile` + `dsv4c bench` at batch 1 / 8 / 64
# with the eager, torch.compile (not with NO_TC=1: about 170 s) and HF transformers peers and the pinned-routing
# SNR; then, while the budget lasts, the 2-layer batch-1 step with the experts' GEMV off / on (FP8_GEMV_MAX_ASSIGN
# 0 / 8, interleaved: run54 timed it from a timeline, not on the GPU alone).
# B=SECONDS budget. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-590}
K=examples/results/device-2026-12-06/run52/knobs.py
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
timeout $((B - SECONDS - 10)) python examples/bench_artifact.py --work /tmp/slice --out $OUT/artifact.json \
  --prefill ${NO_TC:+--no-torch-compile} > $OUT/artifact.log 2>&1; echo rc=$? >> $OUT/artifact.log
tail -9 $OUT/artifact.log
cp /tmp/slice/compile.log $OUT/artifact_compile.log 2>/dev/null
rm -rf /tmp/slice
for v in 0 8 0 8; do
  [ $((SECONDS + 40)) -lt $B ] || { echo "moe gemv $v skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; continue; }
  timeout 45 python $K moe_grouped.FP8_GEMV_MAX_ASSIGN=$v -- examples/profile_step.py --layers 2 \
    --expert-format fp8_block --batch 1 --top 8 > /tmp/p.txt 2>&1
  { echo "### moe gemv $v"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|(critical path) |\|Error" /tmp/p.txt | sed "s|^|moe gemv $v: |" | tee -a $OUT/steps.txt
done
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
