# run40 call B (planned, ~9 min, any GPU): the step-wide PDL chain on / off at batch 64, fuse_hc's head fusion
# on / off at batch 1, then the GPU tests of the
# changed kernels (indexer, batch-invariant, deterministic mode). B=SECONDS budget. At most 8 files to $OUT.
export PYTHONPATH=$PWD
B=${B:-540}
fits() { if [ $((SECONDS + $1)) -lt $B ]; then return 0; fi; echo "skipped ($1 s would pass B=$B at $SECONDS s): $2"; return 1; }
python -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.txt 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/steps.txt
# 2b. the step-wide PDL chain at batch 64 (run36 timed it at 1 and 8 only): the full slice's batch-64 step was
# 0.95x of e250a68's (run39); early-launched dependents may hold SM slots while a multi-wave kernel runs
for v in on off on off; do
  fits 45 "pdl $v b64" | tee -a $OUT/steps.txt | grep -q skipped && continue
  python examples/results/device-2026-12-05e/run36/pdl_switch.py $v examples/profile_step.py --layers 2 --batch 64 \
    --top 45 --out /tmp/p.json > /tmp/s.txt 2>&1
  grep "^== full" /tmp/s.txt | sed "s/^/pdl $v b64 /" | tee -a $OUT/steps.txt
done
# 2c. the head's mHC collapse as dsv4c::hc_head (this session) against its ~12 ATen ops, batch 1, interleaved
for v in on off on off; do
  fits 45 "head $v b1" | tee -a $OUT/steps.txt | grep -q skipped && continue
  python examples/results/device-2026-12-06/run40/head_switch.py $v examples/profile_step.py --layers 2 --batch 1 \
    --top 45 --out /tmp/h.json > /tmp/s.txt 2>&1
  grep "^== full" /tmp/s.txt | sed "s/^/head $v b1 /" | tee -a $OUT/steps.txt
done
LEFT=$((B - SECONDS)); [ $LEFT -lt 30 ] && LEFT=30
timeout $LEFT python -m pytest -q -m gpu tests/test_kernels_v4_indexer.py tests/test_fuse_hc.py \
  tests/test_kernels_batch_invariant.py tests/test_deterministic.py > $OUT/gpu_tests.txt 2>&1; echo rc=$? timeout=$LEFT >> $OUT/gpu_tests.txt
tail -3 $OUT/gpu_tests.txt
