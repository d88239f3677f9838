# run60 (any GPU, ~6 min): the deterministic mode's first hc_pre launch with 16 token rows per program
# (mhc.HC_BI_ROW_BLOCK = 16: the tiled `_hc_mix_kernel` with a fixed 16-row tile) vs one (1, the default): its GPU
# tests (a token's bits alone equal its bits among 256), then the verify of 1 + 3 tokens at batch 64 and 8 in
# deterministic mode with FP8 block experts (run49: 9.25 ms at batch 64, 310 µs of it in the one-row kernel),
# interleaved. If it wins, 16 becomes the default and tests/test_deterministic.py -m gpu runs with it.
# B=SECONDS budget. At most 8 files to $OUT: the profiles are appended to one file.
export PYTHONPATH=$PWD
B=${B:-360}
K=examples/results/device-2026-12-06/run52/knobs.py
P="examples/profile_step.py --layers 2 --deterministic --expert-format fp8_block --verify 3 --top 8"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 60 python -m pytest -q -m gpu tests/test_fuse_hc.py -k "row_block or deterministic_ops" \
  > $OUT/gpu_tests.txt 2>&1
echo rc=$? >> $OUT/gpu_tests.txt; tail -2 $OUT/gpu_tests.txt
run() {  # rows-per-program batch
  [ $((SECONDS + 45)) -lt $B ] || { echo "row block $1 b$2 skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; return; }
  timeout 60 python $K mhc.HC_BI_ROW_BLOCK=$1 -- $P --batch $2 > /tmp/p.txt 2>&1
  { echo "### row block $1, batch $2"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|(critical path) |\|_hc_mix_row\|Error" /tmp/p.txt | sed "s|^|row block $1 b$2: |" \
    | tee -a $OUT/steps.txt
}
for v in 16 1 16 1; do run $v 64; done
for v in 16 1; do run $v 8; done
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
