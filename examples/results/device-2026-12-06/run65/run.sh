# Ran on 2026-12-07 (H100, `699cb91`; outputs: ../../device-2026-12-07/run65_out). The FP8_GEMV_STAGES and
# FP8_GEMV_FUSE_QUANT knobs it sets were removed after it (both slower), so the "fuse_quant stages 3" step no
# longer applies.
# run65 (any GPU, ~6 min): the routed experts' decode sweep (bench_moe_kernels.py --sweep, fp8_block with the FP8
# GEMV's tiles, Triton's pipeliner (stages) and the fused activation quantisation (fq), at 1 and 8 tokens); then
# the 2-layer step at batch 1 on the GPU alone, interleaved: the default, the FP8 experts' GEMV config the sweep
# names (T13=BN,BK,W,STAGES,FUSE_QUANT; by default the sweep's fastest GEMV at one token), and fused quantisation
# with 3 stages, and fuse_swiglu_linear on (target.swiglu_in_gemv: the shared experts' SwiGLU in w2's GEMV); then
# once each: linear_f32's one-token GEMV with up to 16 programs per SM (2: the default) and
# the dense one-token GEMV's pipelined loop; last, while the budget lasts, the GPU tests of the kernels changed.
# B=SECONDS budget. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-400}
K=examples/results/device-2026-12-06/run65/knobs.py
P="examples/profile_step.py --layers 2 --expert-format fp8_block --top 8"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/steps.txt
timeout 130 python examples/bench_moe_kernels.py --sweep --formats fp8_block --tokens 1,8 \
  --budget-s 100 --out $OUT/sweep.json > $OUT/sweep.txt 2>&1
grep "fp8_block | 1 \|best\|ratio" $OUT/sweep.txt | head -30 | tee -a $OUT/steps.txt
run() {  # label batch knobs... (module constants under dsv4c.kernels) [:: profile_step args]
  [ $((SECONDS + 40)) -lt $B ] || { echo "$1 skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; return; }
  local label=$1 batch=$2 kn=() ex=(); shift 2
  while [ $# -gt 0 ] && [ "$1" != "::" ]; do kn+=("$1"); shift; done; [ "$1" = "::" ] && shift; ex=("$@")
  timeout 55 python $K "${kn[@]}" -- $P --batch $batch "${ex[@]}" > /tmp/p.txt 2>&1
  { echo "### $label"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|(critical path) |\|Error" /tmp/p.txt | sed "s|^|$label: |" | tee -a $OUT/steps.txt
}
T=${T13:-$(python - $OUT/sweep.json <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["format"] == "fp8_block" and r["tokens"] == 1
        and r.get("status") == "ok" and r["config"]["gemv"] and r.get("graph_us")]
c = min(rows, key=lambda r: r["graph_us"])["config"] if rows else {"block_n": 32, "block_k": 512, "num_warps": 8,
                                                                    "gemv_stages": 0, "fuse_quant": False}
print(f"{c['block_n']},{c['block_k']},{c['num_warps']},{c['gemv_stages']},{int(c['fuse_quant'])}")
PY
)}; IFS=, read bn bk w st fq <<< "$T"
G=moe_grouped.FP8_GEMV
M="${G}_BLOCK_N=$bn ${G}_BLOCK_K=$bk ${G}_WARPS=$w ${G}_STAGES=$st ${G}_FUSE_QUANT=$fq"
for i in 1 2; do
  run "b1 default" 1 linear_f32.GEMV_PROGRAMS_PER_SM=2
  run "b1 moe gemv $T" 1 $M
  run "b1 moe fuse_quant stages 3" 1 ${G}_FUSE_QUANT=1 ${G}_STAGES=3
  run "b1 swiglu in w2's GEMV" 1 target.swiglu_in_gemv=1
done
run "b1 lf32 16/SM" 1 linear_f32.GEMV_PROGRAMS_PER_SM=16
run "b1 dense gemv pipelined" 1 fp8_gemv.GEMV_PIPELINED=1
if [ $((SECONDS + 60)) -lt $B ]; then
  timeout $((B - SECONDS - 5)) python -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_moe_fp8_gemv.py \
    tests/test_kernels_fp8_gemm.py tests/test_kernels_linear_f32.py tests/test_kernels_l2_prefetch.py \
    > $OUT/tests.txt 2>&1
  tail -3 $OUT/tests.txt | tee -a $OUT/steps.txt
fi
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
