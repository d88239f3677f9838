# run40 (planned, ~8 min, any GPU; H100: the 2-layer slice). B=SECONDS budget, parts that would not fit are
# skipped and say so. At most 8 files to $OUT.
# 1. the indexer's staged selection against the one-program one (kernel A/B, contexts 8192..262144)
# 2. the deterministic step after 05c2ebd (sum_bi as one program per row), decode tile T = 16 / 32 / 64, beside
#    the default step: the deterministic mode's cost (issue 23 item 4)
# 2b. PDL on / off at batch 64 (FP8 experts)
# 3. GPU tests of the changed kernels (indexer, batch-invariant, deterministic mode)
export PYTHONPATH=$PWD
B=${B:-480}
fits() { if [ $((SECONDS + $1)) -lt $B ]; then return 0; fi; echo "skipped ($1 s would pass B=$B at $SECONDS s): $2"; return 1; }
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
R=examples/results/device-2026-12-06/run40
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
python $R/indexer_select.py $OUT/indexer_select.json 2>&1 | tail -8
for v in 1:def 1:16 1:32 1:64 8:def 8:16 8:64 64:def 64:16 64:32 64:64; do
  b=${v%%:*}; t=${v##*:}
  fits 45 "step $v" | tee -a $OUT/steps.txt | grep -q skipped && continue
  if [ $t = def ]; then
    python examples/profile_step.py --layers 2 --batch $b --expert-format mxfp4_w4a16 --top 45 \
      --out /tmp/s_${v/:/_}.json > /tmp/s.txt 2>&1
  else
    python $R/tile_t.py $t examples/profile_step.py --layers 2 --batch $b --deterministic \
      --expert-format mxfp4_w4a16 --top 45 --out /tmp/s_${v/:/_}.json > /tmp/s.txt 2>&1
  fi
  grep "^== \|^| routed\|^| dense\|^| attention\|^| other\|Error" /tmp/s.txt | sed "s/^/$v /" | tee -a $OUT/steps.txt
done
cp /tmp/s_1_16.json $OUT/det_t16_b1.json 2>/dev/null
# 2b. the step-wide PDL chain at batch 64 (run36 timed it at 1 and 8 only): the full slice's batch-64 step was
# 0.95x of e250a68's (run39); early-launched dependents may hold SM slots while a multi-wave kernel runs
for v in on off on off; do
  fits 45 "pdl $v b64" | tee -a $OUT/steps.txt | grep -q skipped && continue
  python examples/results/device-2026-12-05e/run36/pdl_switch.py $v examples/profile_step.py --layers 2 --batch 64 \
    --top 45 --out /tmp/p.json > /tmp/s.txt 2>&1
  grep "^== full" /tmp/s.txt | sed "s/^/pdl $v b64 /" | tee -a $OUT/steps.txt
done
LEFT=$((B - SECONDS)); [ $LEFT -lt 30 ] && LEFT=30
timeout $LEFT python -m pytest -q -m gpu tests/test_kernels_v4_indexer.py tests/test_kernels_batch_invariant.py \
  tests/test_deterministic.py > $OUT/gpu_tests.txt 2>&1; echo rc=$? timeout=$LEFT >> $OUT/gpu_tests.txt
tail -3 $OUT/gpu_tests.txt
