# run86 (any GPU, about 9 min; written in the forty-second session): a decode step's work outside its CUDA
# graph. The full slice's step was 1.133 / 2.573 / 7.260 ms against replays of 1.106 / 2.512 / 7.222 at batch 1 /
# 8 / 64 (run61 on a1974fa: 36 / 40 / 66 us a step outside the graph: a staging copy, four device copies of the
# step's inputs into the executor's static buffers, a copy of the logits, the argmax, the token copy). The
# staged decode inputs (staging.patch: slots / pos0 / n_real written straight into the executor's static block,
# the logits read as views) take four of those copies away.
#  1. tests/test_split.py and the session's staged-input test, on the GPU machine's CPU (fast: -k staged);
#  2. the full slice through bench_artifact (no torch.compile / HF peers, no prefill points) with the patch in;
#  3. step_breakdown on that artifact with the patch reversed, then in, then reversed, then in (ab.py).
# B=SECONDS budget. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-560}
H=examples/results/device-2026-12-07/run86
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/steps.txt
timeout 120 python -m pytest -q -p no:logging -k staged tests/test_split.py tests/test_compile_session.py 2>&1 | tail -2 | tee -a $OUT/steps.txt
timeout 330 python examples/bench_artifact.py --work /tmp/slice --out $OUT/artifact.json --prefill --no-torch-compile \
  --no-hf > $OUT/artifact.log 2>&1; echo "bench rc=$? at ${SECONDS}s" | tee -a $OUT/steps.txt
tail -6 $OUT/artifact.log | tee -a $OUT/steps.txt
ab() {  # label: reversed | staged
  [ $((SECONDS + 75)) -lt $B ] || { echo "$1 skipped at ${SECONDS}s" | tee -a $OUT/steps.txt; return; }
  if [ "$1" = reversed ]; then patch -R -p1 < $H/staging.patch > /dev/null || exit 3; fi
  timeout 90 python $H/ab.py /tmp/slice/art $1 $OUT/ab.json 2>&1 | grep "^$1:" | tee -a $OUT/steps.txt
  if [ "$1" = reversed ]; then patch -p1 < $H/staging.patch > /dev/null || exit 4; fi
}
ab reversed; ab staged; ab reversed; ab staged
echo "at ${SECONDS}s" | tee -a $OUT/steps.txt
