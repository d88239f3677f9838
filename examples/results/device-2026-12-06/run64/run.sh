# run64 (any GPU, ~7 min; thirty-third session): the L2 prefetch of the next linears' weights at the start of each
# run of small kernels (passes/prefetch_weights.py, kernels/l2_prefetch.py; new, untimed). GPU tests of the kernel
# (prefetched bytes read faster), then the 2-layer slice's step on the GPU alone, interleaved: the default (32 MiB,
# bulk prefetch) against `--skip-passes prefetch_weights` at batch 1, then 48 MiB, the per-line prefetch and the
# dense GEMV's weights loaded evict_first (fp8_gemv.W_EVICT_FIRST), then batch 8 on / off. B=SECONDS budget. At most 8 files to $OUT: the profiles are appended to one file.
export PYTHONPATH=$PWD
B=${B:-420}
H=examples/results/device-2026-12-06/run64
P="examples/profile_step.py --layers 2 --expert-format fp8_block --top 8"
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
timeout 120 python -m pytest -q -p no:logging -m gpu tests/test_kernels_l2_prefetch.py > $OUT/gpu_tests.txt 2>&1
tail -3 $OUT/gpu_tests.txt | tee -a $OUT/steps.txt
run() {  # label batch bytes mode evict [profile_step args]
  [ $((SECONDS + 45)) -lt $B ] || { echo "$1 skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; return; }
  timeout 60 python $H/pf.py $3 $4 $5 -- $P --batch $2 "${@:6}" > /tmp/p.txt 2>&1
  { echo "### $1"; cat /tmp/p.txt; } >> $OUT/profiles.txt
  grep "^== full\|(critical path) |\|Error" /tmp/p.txt | sed "s|^|$1: |" | tee -a $OUT/steps.txt
}
M=$((32 << 20))
run "b1 on" 1 $M 0 0 --timeline
run "b1 off" 1 $M 0 0 --skip-passes prefetch_weights --timeline
run "b1 on" 1 $M 0 0
run "b1 off" 1 $M 0 0 --skip-passes prefetch_weights
run "b1 on evict-first" 1 $M 0 1
run "b1 on 48MiB" 1 $((48 << 20)) 0 0
run "b1 on per-line" 1 $M 1 0
run "b8 on" 8 $M 0 0
run "b8 off" 8 $M 0 0 --skip-passes prefetch_weights
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
